"""fairseq-train with ``--ddp-backend fully_sharded`` saving and resuming, as a
user runs it (torchrun, CPU, gloo): at T 2, from the session's trained
checkpoint, dropout off.

One ``pytorch_ddp`` run at T 2 x D 2 that never stops is the reference
(8 updates, saved every 2). Each sharded run resumes a checkpoint of
another run and is compared with the reference at the update it ends:

- ``pytorch_ddp`` -> ``fully_sharded`` (D 2), updates 3-4;
- ``fully_sharded`` D 2 -> D 1 (``--update-freq 2``: the same two batches
  per update), updates 5-6, into a directory holding a D 2 save of the
  same names (its extra shards must go);
- ``fully_sharded`` D 1 -> D 2, updates 7-8, saving every update and keeping
  one interval checkpoint (two ranks per part save; one removes);
- ``fully_sharded`` -> ``pytorch_ddp``, updates 5-6.

Weights within 1e-5: fp32 sums in another order (reduce-scatter instead of
all-reduce, one rank summing two micro-batches), over at most 8 Adam updates
of learning rate 1e-3; Adam's moments or step count started afresh move
every weight by about the learning rate at the next update (1e-3), and so
would the wrong batches. The weights and optimizer state of every rank are
in the files: the part files of each save hold the whole model part, and
each rank's optimizer shard its 1 / D of the Adam moments, which is also
all it holds after resuming (its memory report).
"""

import os
import re
import shutil

import pytest
import torch

from tests.e2e.common import eval_args, eval_loss, train_without_dropout
from tests.helpers import fairseq

# what each run resumes (None: the session's trained weights), data-parallel size, backend, last update
RUNS = {
    "ddp": (None, 2, "pytorch_ddp", 8),
    "ddp_to_fsdp": ("ddp/checkpoint_1_2.pt", 2, "fully_sharded", 4),
    "fsdp_d2_to_d1": ("ddp_to_fsdp/checkpoint_last.pt", 1, "fully_sharded", 6),
    "fsdp_d1_to_d2": ("fsdp_d2_to_d1/checkpoint_last.pt", 2, "fully_sharded", 8),
    "fsdp_to_ddp": ("ddp_to_fsdp/checkpoint_last.pt", 2, "pytorch_ddp", 6),
}
TOLERANCE = 1e-5


def _model(save_dir, name, part):
    return torch.load(os.path.join(save_dir, name.replace(".pt", f"-model_part-{part}.pt")), map_location="cpu",
                      weights_only=False)["model"]


def _train(trained, tmp_path, name, *extra):
    resumed, groups, backend, last = RUNS[name]
    start = (["--finetune-from-model", os.path.join(trained["ckpt"], "checkpoint_last.pt")] if resumed is None
             else ["--restore-file", str(tmp_path / resumed)])
    _, log = train_without_dropout(trained["data"], tmp_path / name, last, 2, "--ddp-backend", backend,
                                   "--save-interval-updates", "2", *start,
                                   *(["--update-freq", "2"] if groups == 1 else []), *extra, groups=groups)
    return log


def _memory_reports(log):
    """(parameters, optimizer state) in MiB from each rank's memory report."""
    return [(float(p), float(o)) for p, o in re.findall(
        r"memory of rank \d+: parameters ([0-9.]+) MiB, gradients [0-9.]+ MiB, optimizer state ([0-9.]+) MiB", log)]


def test_fully_sharded_resumes_at_any_data_parallel_size_and_from_and_to_pytorch_ddp(trained, tmp_path, capsys):
    for name in RUNS:
        extra = ()
        if name == "fsdp_d2_to_d1":  # its save dir holds a D 2 save under the names it saves
            shutil.copytree(tmp_path / "ddp_to_fsdp", tmp_path / name)
        if name == "fsdp_d1_to_d2":  # every rank saves a shard; one per part removes the checkpoint not kept
            extra = ("--save-interval-updates", "1", "--keep-interval-updates", "1")
        log = _train(trained, tmp_path, name, *extra)
        if RUNS[name][2] == "fully_sharded":  # every rank's memory report, each holding its share
            groups = RUNS[name][1]
            reports = _memory_reports(log)
            assert len(reports) == 2 * groups, log[-3000:]
            # Adam's state is two fp32 moments per fp32 parameter: twice the parameters this rank holds (the
            # step counts are a few bytes; each figure is rounded to 0.01 MiB), resumed or not
            assert all(abs(optimizer - 2 * params) <= 0.02 and params > 0.05 for params, optimizer in reports), \
                reports
    # the D 1 save removed the D 2 save's second shards of each part; the D 2 save kept one interval checkpoint
    assert sorted(f for f in os.listdir(tmp_path / "fsdp_d2_to_d1") if f.startswith("checkpoint_last")) == [
        "checkpoint_last-model_part-0-optimizer-0.pt", "checkpoint_last-model_part-0.pt",
        "checkpoint_last-model_part-1-optimizer-0.pt", "checkpoint_last-model_part-1.pt",
        "checkpoint_last.pt.manifest.json"]
    assert sorted(f for f in os.listdir(tmp_path / "fsdp_d1_to_d2") if f.startswith("checkpoint_1_")) == [
        "checkpoint_1_8-model_part-0-optimizer-0.pt", "checkpoint_1_8-model_part-0-optimizer-1.pt",
        "checkpoint_1_8-model_part-0.pt", "checkpoint_1_8-model_part-1-optimizer-0.pt",
        "checkpoint_1_8-model_part-1-optimizer-1.pt", "checkpoint_1_8-model_part-1.pt",
        "checkpoint_1_8.pt.manifest.json"]
    for name, (_, groups, backend, last) in RUNS.items():
        if name == "ddp":
            continue
        for part in range(2):
            mine, reference = (_model(tmp_path / name, "checkpoint_last.pt", part),
                               _model(tmp_path / "ddp", f"checkpoint_1_{last}.pt", part))
            assert mine.keys() == reference.keys()
            for key in reference:
                assert torch.allclose(mine[key], reference[key], rtol=0, atol=TOLERANCE), (name, part, key)
    # a sharded save: the part files, one optimizer shard per rank, one manifest listing them
    files = sorted(f for f in os.listdir(tmp_path / "ddp_to_fsdp") if f.startswith("checkpoint_last"))
    assert files == ["checkpoint_last-model_part-0-optimizer-0.pt", "checkpoint_last-model_part-0-optimizer-1.pt",
                     "checkpoint_last-model_part-0.pt", "checkpoint_last-model_part-1-optimizer-0.pt",
                     "checkpoint_last-model_part-1-optimizer-1.pt", "checkpoint_last-model_part-1.pt",
                     "checkpoint_last.pt.manifest.json"], files

    # the resharding tool's --keep-optimizer joins optimizer shards (it refused them, and the refusal of a
    # sharded checkpoint resumed at another size advised it): the same parameters' states as a whole save's
    from fairseq_megatron.cli import reshard_checkpoint

    sharded, whole = tmp_path / "ddp_to_fsdp" / "checkpoint_last.pt", tmp_path / "fsdp_to_ddp" / "checkpoint_last.pt"
    kept = {}
    for source, out in ((sharded, tmp_path / "kept_from_shards"), (whole, tmp_path / "kept")):
        rc = reshard_checkpoint.main(["--input", str(source), "--output", str(out / "model.pt"),
                                      "--model-parallel-size", "1", "--keep-optimizer"])
        assert rc == 0, capsys.readouterr().err
        kept[out.name] = torch.load(out / "model.pt", weights_only=False)["last_optimizer_state"]["state"]
    assert kept["kept_from_shards"].keys() == kept["kept"].keys() and kept["kept"]
    for index, entry in kept["kept"].items():
        assert kept["kept_from_shards"][index]["exp_avg"].shape == entry["exp_avg"].shape, index

    # fairseq-eval-lm at model-parallel size 1 of the sharded T 2 x D 2 checkpoint at update 4, and of the
    # reference's: the same weights within 1e-5, the same loss to the 4 decimals printed
    losses = {}
    for name, checkpoint in (("ddp_to_fsdp", "checkpoint_last.pt"), ("ddp", "checkpoint_1_4.pt")):
        _, out = fairseq("eval_lm", eval_args(trained["data"], str(tmp_path / name / checkpoint), 1))
        losses[name] = eval_loss(out)
    assert losses["ddp_to_fsdp"] == pytest.approx(losses["ddp"], abs=1e-4), losses

    # that checkpoint with one optimizer shard gone: one line, before any update
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "ddp_to_fsdp", broken)
    os.remove(broken / "checkpoint_last-model_part-1-optimizer-0.pt")
    rc, log = train_without_dropout(trained["data"], tmp_path / "after_broken", 6, 2, "--ddp-backend", "fully_sharded",
                                    "--restore-file", str(broken / "checkpoint_last.pt"), check=False)
    assert rc == 1 and log.rstrip().splitlines()[-1].endswith(
        f"optimizer shard {broken}/checkpoint_last-model_part-1-optimizer-0.pt of "
        f"{broken}/checkpoint_last-model_part-1.pt is missing (the part was saved with 2): restore it, or resume "
        f"with --reset-optimizer to start the optimizer afresh"), log[-3000:]
    assert "num_updates" not in log
