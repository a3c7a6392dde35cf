"""What fairseq's megatron git submodule, which no pip release ships, would
have given it: the ``mpu`` module, and a ``MegatronTrainer`` that can be
built (steps 1 and 2 of :mod:`fairseq_megatron.fairseq_integration`).

1. :func:`provide_mpu` -- registers :mod:`fairseq_megatron.parallel.mpu` as
   ``fairseq.model_parallel.megatron.mpu``, the module fairseq imports when
   ``--model-parallel-size > 1`` (no pip release ships the git submodule).

2. :func:`enable_megatron_trainer` -- ``fairseq_cli/train.py`` imported
   ``MegatronTrainer`` before any user dir, so its "submodule present" flag is
   already False; set it and bind the names it failed to import. Its
   ``clip_grad_norm`` counted the parameters every rank holds in full (layer
   norms, row-parallel biases) once per rank, so ``gnorm`` and clipping
   depended on the model-parallel size; now each counts once
   (:mod:`fairseq_megatron.parallel.grad_norm`). The ``crash.pt`` that fairseq's
   trainer writes on a FloatingPointError had no part suffix, so every rank
   of a group wrote (and renamed) the same file: one rank's part survived
   under a whole checkpoint's name, and the other rank could fail with
   FileNotFoundError instead of the real error. Each rank now writes its
   own ``crash-model_part-K.pt``.
"""

import functools
import sys
import types


def provide_mpu() -> None:
    import fairseq.model_parallel

    from fairseq_megatron.parallel import mpu

    package = types.ModuleType("fairseq.model_parallel.megatron")
    package.__path__ = []  # a namespace with one submodule, mpu
    package.mpu = mpu
    sys.modules["fairseq.model_parallel.megatron"] = package
    sys.modules["fairseq.model_parallel.megatron.mpu"] = mpu
    fairseq.model_parallel.megatron = package


def enable_megatron_trainer() -> None:
    from fairseq.model_parallel import megatron_trainer

    from fairseq_megatron.parallel import mpu, parallel_state
    from fairseq_megatron.parallel.grad_norm import model_parallel_norm_aggregator

    for name in (
        "get_data_parallel_group",
        "get_data_parallel_rank",
        "get_data_parallel_world_size",
        "get_model_parallel_group",
        "get_model_parallel_src_rank",
        "get_cuda_rng_tracker",
    ):
        setattr(megatron_trainer, name, getattr(mpu, name))
    megatron_trainer.has_megatron_submodule = True

    def clip_grad_norm(self, clip_norm):
        """Clip by the norm of the whole model, replicated parameters counted
        once (fairseq's counts them once per model-parallel rank)."""
        aggregate = model_parallel_norm_aggregator(self.model, parallel_state.get_tensor_model_parallel_group())
        return self.optimizer.clip_grad_norm(clip_norm, aggregate_norm_fn=aggregate)

    megatron_trainer.MegatronTrainer.clip_grad_norm = clip_grad_norm

    original_save = megatron_trainer.MegatronTrainer.save_checkpoint

    @functools.wraps(original_save)
    def save_checkpoint(self, filename, extra_state):
        suffix = self.checkpoint_suffix  # "-model_part-K" (fairseq's distributed_init sets it)
        if suffix and filename.endswith(".pt") and not filename.endswith(suffix + ".pt"):
            filename = filename[: -len(".pt")] + suffix + ".pt"  # crash.pt; the others have it
        return original_save(self, filename, extra_state)

    megatron_trainer.MegatronTrainer.save_checkpoint = save_checkpoint
