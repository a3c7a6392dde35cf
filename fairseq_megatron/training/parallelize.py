"""What training applies to a built model, in one place and in one order.

torchtitan's ``parallelize(model, parallel_dims, config)`` receives the
layout and applies tensor parallelism, activation checkpointing,
compilation and sharding to a model built without them; here tensor and
sequence parallelism are the layers' own, and :func:`parallelize` applies
the rest for this rank's groups, each from its own module:

1. the pipeline split (:mod:`.pipeline_split`), while the deferred weights
   are still on the ``meta`` device, then their memory
   (``model.materialize()``);
2. float8 products (:mod:`.float8`), then per-layer compilation or the
   compiled layer stack, and CUDA graphs (:mod:`.compile`);
3. activation checkpointing and offload (:mod:`.activation_checkpointing`),
   after compilation so that the recompute replays the compiled forward
   (torchtitan compiles the checkpointed block instead; the recompute here
   swaps the RNG tracker's streams, which dynamo does not trace);
4. bf16 autocast (:mod:`.autocast`), of the decoder and, with pipeline
   stages, of the modules torch's schedule runs, one per model chunk
   (:class:`~fairseq_megatron.training.pipeline_schedule.ChunkModule`);
5. context parallelism where this rank's context-parallel group has more
   than one rank (:mod:`.context_parallel`);
6. data parallelism, the object of ``--ddp-backend`` (:mod:`.data_parallel`):
   with ``fully_sharded`` torch's FSDP2 shards each decoder layer and then
   the model, or each model chunk's module, over the ranks that average
   gradients.

``MegatronTrainer`` calls it before fairseq's trainer moves the model to its
device, and keeps what it returns; evaluation and generation run the model
as built.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch.nn as nn
from fairseq.utils import safe_getattr

from fairseq_megatron.models.pipeline_stage import PipelineStageLayout
from fairseq_megatron.parallel.context_parallel import ContextSplit
from fairseq_megatron.parallel.parallel_state import ProcessGroups
from fairseq_megatron.training.activation_checkpointing import apply_activation_checkpointing
from fairseq_megatron.training.autocast import apply_bf16_autocast
from fairseq_megatron.training.compile import apply_compile, raise_cuda_graphs_need_the_stack
from fairseq_megatron.training.context_parallel import apply_context_parallel
from fairseq_megatron.training.data_parallel import DataParallel, data_parallel_class
from fairseq_megatron.training.float8 import apply_float8
from fairseq_megatron.training.options import check_training_options
from fairseq_megatron.training.pipeline_schedule import ChunkModule
from fairseq_megatron.training.pipeline_schedules import stage_layout
from fairseq_megatron.training.pipeline_split import split_for_stage


@dataclass(frozen=True)
class Parallelized:
    """What :func:`parallelize` made of one rank's model."""

    stage: PipelineStageLayout
    """This rank's pipeline stage (the only one at ``P = 1``)."""
    chunk_modules: Tuple[nn.Module, ...]
    """The modules torch's pipeline schedule runs, one per model chunk of the stage; none at ``P = 1``."""
    context_split: Optional[ContextSplit]
    """How this rank's ``C`` context-parallel ranks split a sequence; None at ``C = 1``."""
    data_parallel: DataParallel
    """The data parallelism of ``--ddp-backend``: its groups, wrapper and checkpoint state."""


def parallelize(model: nn.Module, groups: ProcessGroups, cfg) -> Parallelized:
    """Apply to ``model`` (a ``model_parallel_transformer_lm``, as built:
    whole) what fairseq-train's configuration ``cfg`` asks for, for this
    rank's ``groups`` (:func:`~fairseq_megatron.parallel.parallel_state.get_process_groups`),
    in the order of the module docstring. ``cfg.model``: the training options
    the model carries (``--pipeline-model-parallel-size``,
    ``--checkpoint-activations``, ``--offload-activations``, ``--fp8``,
    ``--compile-layers``, ``--cuda-graphs``, ``--bf16-autocast``);
    ``cfg.distributed_training``: ``--ddp-backend`` and its options;
    ``cfg.common``: the precision.

    Raises:
        UsageError: what :func:`~fairseq_megatron.training.options.check_training_options`
            refuses; ``--cuda-graphs`` without the compiled layer stack;
            ``--fp8`` without torchao.
    """
    args = cfg.model
    check_training_options(args)
    stage = stage_layout(args, groups.pipeline.rank)
    split_for_stage(model, stage)
    model.materialize()
    decoder = model.decoder
    if safe_getattr(args, "fp8", False):
        apply_float8(decoder, safe_getattr(args, "fp8_recipe", None) or "tensorwise")
    offload = bool(safe_getattr(args, "offload_activations", False))
    checkpointing = offload or bool(safe_getattr(args, "checkpoint_activations", False))  # fairseq: offload implies it
    cuda_graphs = bool(safe_getattr(args, "cuda_graphs", False))
    if safe_getattr(args, "compile_layers", False):
        apply_compile(decoder, checkpointing, cuda_graphs)
    elif cuda_graphs:
        raise_cuda_graphs_need_the_stack()
    if checkpointing:
        apply_activation_checkpointing(decoder, offload_to_cpu=offload)
    chunk_modules = tuple(ChunkModule(decoder, chunk) for chunk in stage.chunks) if stage.stages > 1 else ()
    if safe_getattr(args, "bf16_autocast", False):
        for module in (decoder, *chunk_modules):
            apply_bf16_autocast(module)
    context_split = apply_context_parallel(model, groups.context) if groups.context.size > 1 else None
    data_parallel = data_parallel_class(cfg.distributed_training)(groups)
    data_parallel.apply(model, list(chunk_modules) or [model], cfg)
    return Parallelized(stage, chunk_modules, context_split, data_parallel)
