"""The checks of fairseq-train's own options for our models, before any work.

The model's options are checked by the model (:mod:`fairseq_megatron.models.options`),
the parallel sizes by the layout (:class:`~fairseq_megatron.parallel.layout.ParallelLayout`),
the data-parallel backend by its class (:mod:`.data_parallel`); what is left
is training's: the precision flags here, float8's machine
(:func:`~fairseq_megatron.training.float8.check_fp8_environment`).
"""

import torch

from fairseq_megatron.errors import UsageError


def check_training_precision(common, fp32_parameters: bool = False) -> None:
    """Refuse fairseq-train precision flags that fail later on this machine.

    ``common``: fairseq's ``cfg.common``. ``--bf16`` means TPU in fairseq
    0.12 (it sets ``--tpu``; FAIRSEQ_FACTS.md) and without ``torch_xla``
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
