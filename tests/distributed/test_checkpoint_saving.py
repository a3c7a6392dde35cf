"""fairseq-train's checkpoint save (``MegatronTrainer.save_checkpoint``, one
part per rank) when the disk is full: the write is made to fail on rank 1
only, as a disk that fills during the save would."""

import logging
import os

import pytest
import torch

from tests.helpers import build_trainer, run_distributed
from tests.support.full_disk import TORCH_WRITE_FAILED, FullDiskAt


def _full_disk_worker(rank, world_size, save_dir, error):
    from fairseq_megatron.checkpoint.layout import CheckpointError

    trainer, batches = build_trainer(save_dir, False, world_size)
    trainer.train_step([next(batches)])
    path = os.path.join(save_dir, "checkpoint_last.pt")
    trainer.consolidate_optimizer()  # as fairseq's save_checkpoint does first
    trainer.save_checkpoint(path, {})  # the previous save, whole
    part = os.path.join(save_dir, f"checkpoint_last-model_part-{rank}.pt")
    before = open(part, "rb").read()
    trainer.train_step([next(batches)])
    real_save = torch.save
    if rank == 1:
        torch.save = FullDiskAt(real_save, call=1, error=error)
    logged = _Records()
    logging.getLogger().addHandler(logged)
    try:
        trainer.consolidate_optimizer()
        trainer.save_checkpoint(path, {})
        said = None
    except CheckpointError as e:
        said = str(e)
    finally:
        torch.save = real_save
        logging.getLogger().removeHandler(logged)
    torch.distributed.barrier()  # the other rank's save has ended: its temporary file is gone
    return {"said": said, "files": sorted(os.listdir(save_dir)), "unchanged": open(part, "rb").read() == before,
            "part": part, "logged": logged.errors}


class _Records(logging.Handler):
    """The messages of the records at level ERROR and above that reach the root logger."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.errors = []

    def emit(self, record):
        self.errors.append(record.getMessage())


@pytest.mark.slow  # two trainers built per case: left out of make test-fast
@pytest.mark.parametrize("error", ["ENOSPC", "torch"])
def test_a_full_disk_during_a_save_is_one_line_and_leaves_the_previous_part(tmp_path, error):
    """It was a traceback (``OSError: [Errno 28] No space left on device``,
    or torch's "file write failed") with fairseq's ``.tmp`` file left
    behind, and then, once fairseq's save had retried twice 2.5 s apart, a
    traceback logged at level ERROR before the one line. Now the rank whose
    write failed raises one line with the reason and the bytes free, having
    logged no error, its temporary file is removed, and its previous part
    is still there, byte for byte; the other rank's save went through (the
    parts are then of two saves, which every load refuses)."""
    save_dir = str(tmp_path / "ckpt")
    outcomes = run_distributed(_full_disk_worker, 2, tmp_path, save_dir, error)
    assert outcomes[0]["said"] is None and not outcomes[0]["unchanged"]  # rank 0 saved the new update
    said = outcomes[1]["said"]
    # torch's words where it failed: the bytes needed are unknown
    reason = "No space left on device" if error == "ENOSPC" else f"RuntimeError: {TORCH_WRITE_FAILED}"
    assert said is not None and said.startswith(f"cannot write {outcomes[1]['part']}: {reason} (") and said.endswith(
        " free there); nothing was written"), said
    assert outcomes[1]["unchanged"] and outcomes[1]["logged"] == [], outcomes[1]["logged"]
    assert outcomes[1]["files"] == ["checkpoint_last-model_part-0.pt", "checkpoint_last-model_part-1.pt"]
