"""fairseq's ``Trainer.train_step`` in our ``MegatronTrainer`` (model-parallel
size 1, ``--bf16-autocast``, the fused AdamW a GPU run gets): what the host
reads from tensors during a step, and non-finite gradients skipped on the
device (the error raised one update later).

On a GPU every host read of a device tensor (``bool(t)``, ``t.item()``)
waits for all queued work. On CPU nothing waits, but the reads are still
visible: ``aten._local_scalar_dense`` is where every one of them goes, and a
dispatch mode records each with its Python stack. The step runs in a spawned
process of world size 1 (checked), as fairseq-train would. Not covered
here: ``--compile-layers`` (torch.compile runs the code eagerly while a
dispatch mode is active, so such a case would only repeat the eager one);
tests/gpu/test_cuda.py checks that path on a GPU with torch's sync debug mode."""

import os
import traceback

import pytest
import torch

from tests.helpers import build_trainer, run_distributed

# Reads that stay on the host on any device: the padding test of the batch
# while it is still on the CPU (padding_tested_on_the_host, called by
# MegatronTrainer._prepare_sample); fairseq's
# sinusoidal positions, which take the batch shape as a CPU tensor
# (torch.onnx.operators.shape_as_tensor) and compare it with ints; and the
# previous update's skip flag, a pinned host copy read after waiting for that
# update's kernel only (fused_adam._HostCopy).
HOST_ONLY_READS = ("trainer.py:padding_tested_on_the_host", "sinusoidal_positional_embedding.py:forward",
                   "fused_adam.py:read")


def _reads_worker(rank, world_size, save_dir, extra_args):
    from torch.utils._python_dispatch import TorchDispatchMode

    from fairseq_megatron.fairseq_integration.trainer import MegatronTrainer, _NormCheckedOnTheDevice
    from fairseq_megatron.training import activation_checkpointing

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sites = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                frames = traceback.extract_stack()[:-1]
                self.sites.append([f"{os.path.basename(f.filename)}:{f.name}" for f in frames])
            return func(*args, **(kwargs or {}))

    def unexpected_reads(trainer, batch):
        with HostReads() as reads:
            trainer.train_step([batch])
        return [s[-4:] for s in reads.sites if not any(f in frame for f in HOST_ONLY_READS for frame in s)]

    trainer, batches = build_trainer(save_dir, True, world_size, extra_args)
    trainer.train_step([next(batches)])  # the first step builds and warms up
    ours = unexpected_reads(trainer, next(batches))
    # Control: the norm as a plain tensor, which fairseq's own finiteness test reads.
    norms = []

    def plain_norm(clip_norm):
        norms.append(MegatronTrainer.clip_grad_norm(trainer, clip_norm))
        return norms[-1].as_subclass(torch.Tensor)

    trainer.clip_grad_norm = plain_norm
    try:
        theirs = unexpected_reads(trainer, next(batches))
    finally:
        del trainer.clip_grad_norm
    assert isinstance(norms[0], _NormCheckedOnTheDevice)
    decoder = trainer.get_model().decoder
    checkpointed = getattr(decoder.layers[0].forward, "func", None) is activation_checkpointing._checkpointed_forward
    ran_as = (type(trainer).__name__, decoder.sequence_parallel, checkpointed)
    return ours, theirs, ran_as


def _nonfinite_worker(rank, world_size, save_dir, fused):
    trainer, batches = build_trainer(save_dir, fused, world_size)
    model = trainer.get_model()
    inject = {"on": False}
    first = next(model.parameters())
    if rank == 0:
        first.register_hook(lambda grad: grad * float("nan") if inject["on"] else grad)
    trainer.train_step([next(batches)])
    before = [p.detach().clone() for p in model.parameters()]
    inject["on"] = True
    outcome = []
    for _ in range(2):
        try:
            trainer.train_step([next(batches)])
            outcome.append("ok")
        except FloatingPointError as e:
            outcome.append(f"FloatingPointError: {e}")
            break
    unchanged = all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    crash = os.path.join(save_dir, "crash.pt" if world_size == 1 else f"crash-model_part-{rank}.pt")
    saved = torch.load(crash, weights_only=False)["model"]
    own_part = all(torch.equal(saved[name], p.detach()) for name, p in model.state_dict().items())
    return outcome, unchanged, trainer.get_num_updates(), own_part


@pytest.mark.parametrize("model_parallel_size, extra_args", [
    (1, []),
    (2, ["--sequence-parallel", "--checkpoint-activations"]),  # MegatronTrainer, recomputation, SP collectives
], ids=["size-1", "size-2-sequence-parallel-checkpointed"])
@pytest.mark.slow  # several seconds: left out of make test-fast
def test_a_training_step_reads_nothing_from_the_device(tmp_path, model_parallel_size, extra_args):
    """After the warm-up step, a training step reads no tensor on the host
    except the host-only sites named above; with fairseq's own finiteness
    test given a plain norm the same step reads it in train_step (the
    control: this test sees such a read). At size 2 on every rank."""
    results = run_distributed(_reads_worker, model_parallel_size, tmp_path, str(tmp_path / "ckpt"), extra_args)
    expected = ("MegatronTrainer", False, False) if model_parallel_size == 1 else ("MegatronTrainer", True, True)
    for ours, theirs, ran_as in results:
        assert ran_as == expected
        assert ours == [], f"host reads in a training step: {ours}"
        assert len(theirs) == 1 and "trainer.py:train_step" in theirs[0], theirs


@pytest.mark.parametrize("fused, model_parallel_size", [(True, 1), (False, 1), (True, 2)],
                         ids=["fused-adamw", "fairseq-adam", "fused-adamw-size-2"])
@pytest.mark.slow  # several seconds: left out of make test-fast
def test_nonfinite_gradients(tmp_path, fused, model_parallel_size):
    """NaN gradients in update 2. With the fused AdamW the step returns
    (no read of the norm), the update is skipped on the device (every
    weight bitwise unchanged) and the next step raises fairseq's
    FloatingPointError naming update 2, through fairseq's own handler
    (it writes crash.pt). With fairseq's Python Adam (the control, and any
    optimizer but ours) fairseq raises in update 2 itself. At size 2 the
    NaN is in rank 0's shard only; the norm over the group makes both
    ranks skip and raise together, and each rank's crash file holds its
    own part (fairseq wrote one crash.pt from both ranks)."""
    results = run_distributed(_nonfinite_worker, model_parallel_size, tmp_path, str(tmp_path / "ckpt"), fused)
    for outcome, unchanged, updates, crash_holds_own_part in results:
        assert unchanged and crash_holds_own_part
        if fused:
            assert outcome[0] == "ok" and len(outcome) == 2, outcome
            assert outcome[1].startswith("FloatingPointError: gradients are Nan/Inf in update 2 (skipped"), outcome
            assert updates == 2
        else:
            assert outcome == ["FloatingPointError: gradients are Nan/Inf"], outcome
            assert updates == 1
