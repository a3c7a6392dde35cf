"""The checks of the training options of our models, before any work.

The model's options are checked by the model (:mod:`fairseq_megatron.models.options`),
the parallel sizes by the layout (:class:`~fairseq_megatron.parallel.layout.ParallelLayout`,
:func:`~fairseq_megatron.parallel.layout.check_size`), the data-parallel
backend by its class (:mod:`.data_parallel`), float8's machine by
:func:`~fairseq_megatron.training.float8.check_fp8_environment`; training's
own options here: precision, gradient accumulation, what pipeline stages
need of the batches and the loss.
"""

import torch
from fairseq.utils import safe_getattr

from fairseq_megatron.errors import UsageError
from fairseq_megatron.models.options import check_blocks_and_loss
from fairseq_megatron.models.pipeline_stage import pipeline_stages
from fairseq_megatron.parallel.layout import check_size
from fairseq_megatron.training.pipeline_schedules import check_schedule, schedule_of


def check_training_precision(common, fp32_parameters: bool = False) -> None:
    """Refuse fairseq-train precision flags that fail later on this machine.

    ``common``: fairseq's ``cfg.common``. ``--bf16`` means TPU in fairseq
    0.12 (it sets ``--tpu``: ``fairseq/options.py``, ``parse_args_and_arch``;
    its help says "implies --tpu") and without ``torch_xla``
    fairseq-train failed with "'NoneType' object has no attribute
    'xla_device'". ``--fp16`` on CPU (``--cpu``, or no CUDA) failed in
    ``fairseq/optim/fp16_optimizer.py``, whose fp32 master weights go to the
    current CUDA device: "Torch not compiled with CUDA enabled".
    ``--memory-efficient-fp16`` and ``--amp`` run there and pass, and so does
    ``--fp16`` where the data parallelism keeps the parameters in fp32
    (``fp32_parameters``: ``--ddp-backend fully_sharded``, fp32 sharded
    parameters and fairseq's loss scaler, no fp32 copy).

    Raises:
        UsageError: either case, naming the flag to use instead.
    """
    import importlib.util

    if (common.bf16 or common.memory_efficient_bf16) and importlib.util.find_spec("torch_xla") is None:
        flag = "--memory-efficient-bf16" if common.memory_efficient_bf16 else "--bf16"
        raise UsageError(f"fairseq's {flag} means TPU (it needs torch_xla); for bf16 on a GPU or CPU "
                         f"use --bf16-autocast (fp32 weights, bf16 autocast)")
    fp16_optimizer = common.fp16 and not common.memory_efficient_fp16 and not fp32_parameters  # fp16: set for both
    if fp16_optimizer and (common.cpu or not torch.cuda.is_available()):
        raise UsageError("--fp16 needs a CUDA GPU (fairseq's FP16 optimizer keeps its fp32 master weights "
                         "there); on CPU train in fp32 or with --bf16-autocast")


def check_training_options(args) -> None:
    """Refuse the training options our model cannot be trained with, from
    the options alone: bf16 autocast with fp16 weights, ``--cuda-graphs``
    with gradient accumulation, a pipeline that cannot be built or
    scheduled (:func:`check_pipeline_options`).
    ``args``: fairseq-train's options as the model receives them (its
    ``cfg.model``: every option, for our architectures); options a config
    does not hold are not checked. fairseq-train's start calls it before it
    writes anything, and :func:`~fairseq_megatron.training.parallelize.parallelize`
    before it applies them.

    Raises:
        UsageError: the first refusal, naming the options to change.
    """
    if safe_getattr(args, "bf16_autocast", False):
        half = [f"--{f.replace('_', '-')}" for f in ("fp16", "memory_efficient_fp16", "amp")
                if safe_getattr(args, f, False)]
        if half:
            raise UsageError(f"--bf16-autocast trains fp32 weights under bf16 autocast; drop {' '.join(half)}")
    accumulated = max(safe_getattr(args, "update_freq", None) or [1])
    if safe_getattr(args, "cuda_graphs", False) and accumulated > 1:
        # The backward graph's weight gradients live in the graphs' memory
        # pool; the next micro-batch's replay overwrites the gradient being
        # accumulated (pytorch/pytorch#96693: silently wrong sums).
        raise UsageError(
            f"--cuda-graphs with --update-freq {accumulated}: a CUDA graph replay would overwrite "
            "the gradients being accumulated; use --update-freq 1 (a larger --batch-size instead)"
        )
    check_pipeline_options(args)


def check_pipeline_options(args) -> None:
    """Refuse a pipeline that cannot be built or scheduled, from the options alone.

    The schedule (``--pipeline-schedule``) must be able to run the stages'
    chunks and the update's micro-batches
    (:func:`~fairseq_megatron.training.pipeline_schedules.check_schedule`);
    every micro-batch must have the
    shape the stages' buffers were made for, which only fairseq's
    ``--sample-break-mode none`` gives (full blocks of
    ``--tokens-per-sample``); the last stage computes the loss on its
    vocabulary shard, so the criterion is ``vocab_parallel_cross_entropy``.
    The training options are checked only where ``args`` holds
    them (a command line of fairseq-train; a checkpoint's config loaded for
    evaluation has one stage).

    Raises:
        UsageError: the first refusal, naming the option to change.
    """
    stages = pipeline_stages(args)
    check_size("pipeline", stages)
    given_virtual = safe_getattr(args, "virtual_pipeline_model_parallel_size", None)
    given_virtual = 1 if given_virtual is None else int(given_virtual)
    if given_virtual < 1 or (given_virtual > 1 and stages == 1):
        raise UsageError(f"--virtual-pipeline-model-parallel-size {given_virtual}: the number of model chunks per "
                         f"stage is at least 1, and above 1 only with --pipeline-model-parallel-size above 1")
    if stages == 1:
        schedule_of(args)  # refuses an unknown name; any other runs as one stage (a checkpoint's, loaded at P = 1)
        return
    check_schedule(args)
    check_blocks_and_loss(args, f"--pipeline-model-parallel-size {stages}", "the stages exchange micro-batches "
                          "of one shape", "the last stage computes the loss on its vocabulary shard")
    unsupported = [f"--{flag.replace('_', '-')}" for flag in ("amp", "cuda_graphs")
                   if safe_getattr(args, flag, False)]
    if safe_getattr(args, "decoder_layerdrop", 0):
        unsupported.append(f"--decoder-layerdrop {args.decoder_layerdrop}")
    if unsupported:
        raise UsageError(f"{' '.join(unsupported)}: not supported with --pipeline-model-parallel-size {stages}")
