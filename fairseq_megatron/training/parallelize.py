"""What training applies to a built model, in one place and in one order.

torchtitan's ``parallelize`` applies tensor parallelism, activation
checkpointing, compilation and sharding to a model built without them;
here tensor and sequence parallelism are the layers' own, and
:func:`parallelize` applies the rest, each from its own module:

1. the pipeline split (:mod:`.pipeline_split`), while the deferred weights
   are still on the ``meta`` device, then their memory
   (``model.materialize()``);
2. float8 products (:mod:`.float8`), then per-layer compilation or the
   compiled layer stack, and CUDA graphs (:mod:`.compile`);
3. activation checkpointing and offload (:mod:`.activation_checkpointing`),
   after compilation so that the recompute replays the compiled forward;
4. bf16 autocast (:mod:`.autocast`);
5. context parallelism where this rank's context-parallel group has more
   than one rank (:mod:`.context_parallel`).

``MegatronTrainer`` calls it before fairseq's trainer moves the model to its
device; evaluation and generation run the model as built.
"""

import torch.nn as nn
from fairseq.utils import safe_getattr

from fairseq_megatron.models.pipeline_stage import PipelineStageLayout
from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.training.activation_checkpointing import apply_activation_checkpointing
from fairseq_megatron.training.autocast import apply_bf16_autocast
from fairseq_megatron.training.compile import apply_compile, raise_cuda_graphs_need_the_stack
from fairseq_megatron.training.context_parallel import apply_context_parallel
from fairseq_megatron.training.float8 import apply_float8
from fairseq_megatron.training.pipeline_split import split_for_stage


def parallelize(model: nn.Module, args, stage: PipelineStageLayout = None) -> None:
    """Apply to ``model`` (a ``model_parallel_transformer_lm``, as built) what
    the training options ``args`` ask for (``--checkpoint-activations``,
    ``--offload-activations``, ``--fp8``, ``--compile-layers``,
    ``--cuda-graphs``, ``--bf16-autocast``) and split it for ``stage``
    (default: this rank's stage of ``--pipeline-model-parallel-size``).

    Raises:
        UsageError: ``--cuda-graphs`` without the compiled layer stack;
            ``--fp8`` without torchao.
    """
    split_for_stage(model, stage or PipelineStageLayout.of(args))
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
    if safe_getattr(args, "bf16_autocast", False):
        apply_bf16_autocast(decoder)
    context = parallel_state.get_context_parallel()
    if context.size > 1:
        apply_context_parallel(model, context)
