"""``--bf16-autocast``: training passes under ``torch.autocast(bfloat16)``
over fp32 weights, applied to a built module from outside.

Matrix multiplies and attention run in bf16, layer norms in fp32, logits in
bf16 (the criterion computes the loss in fp32); weights, gradients and the
optimizer stay fp32 and no loss scaling is needed. Evaluation, generation
and weights that are not fp32 (``--fp16`` made them half precision) run as
they are.
"""

import contextlib

import torch
import torch.nn as nn

from fairseq_megatron.modules.forward_wrappers import record_wrapper


def training_autocast(module: nn.Module, device: torch.device):
    """bf16 autocast for a training pass of ``module`` on ``device`` over fp32 weights; else a no-op."""
    weight = next(module.parameters(), None)
    if module.training and weight is not None and weight.dtype == torch.float32:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def apply_bf16_autocast(module: nn.Module) -> nn.Module:
    """Run ``module.forward`` under :func:`training_autocast` (the device is
    that of its first tensor argument)."""
    eager = module.forward

    def forward(*args, **kwargs):
        first = next((a for a in (*args, *kwargs.values()) if torch.is_tensor(a)), None)
        device = first.device if first is not None else torch.device("cpu")
        with training_autocast(module, device):
            return eager(*args, **kwargs)

    module.forward = forward
    record_wrapper(module, "forward", apply_bf16_autocast)
    return module
