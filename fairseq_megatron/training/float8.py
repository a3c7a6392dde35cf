"""``--fp8``: the decoder layers' linear products in float8 for training
passes, applied to a built decoder from outside (torchao's float8 training;
the products themselves: :mod:`fairseq_megatron.modules.float8`).

Applied only for training, so that evaluating an ``--fp8`` checkpoint needs
neither torchao nor a float8 GPU. The output projection onto the vocabulary
stays in high precision.
"""

import logging
from typing import Optional

import torch
import torch.nn as nn
from fairseq.utils import safe_getattr

from fairseq_megatron.errors import UsageError
from fairseq_megatron.modules import ColumnParallelLinear, ModelParallelMultiheadAttention, RowParallelLinear
from fairseq_megatron.modules.float8 import Float8Training, emulated

logger = logging.getLogger(__name__)


def apply_float8(decoder: nn.Module, recipe: str) -> None:
    """Give the linears of ``decoder``'s layers torchao's ``recipe``
    (``tensorwise`` or ``rowwise``), emulated in the test mode
    (``FAIRSEQ_MEGATRON_FP8_EMULATE=1``).

    Raises:
        UsageError: torchao is not installed, or an unknown recipe.
    """
    float8 = Float8Training.of_recipe(recipe, emulate=emulated())
    use_float8(decoder.layers, float8)
    logger.info(f"--fp8: in training passes the decoder layers' linears (q/k/v, attention output, FFN) compute "
                f"their products in float8 (torchao, {recipe} scaling"
                f"{', emulated: the test mode' if float8.config.emulate else ''})")


def use_float8(layers: nn.Module, float8: Optional[Float8Training]) -> int:
    """Give every column- and row-parallel linear and every parallel
    attention inside ``layers`` (the decoder layers, not the output
    projection) ``float8`` (None: back to high precision). Returns how many
    modules it set."""
    count = 0
    for module in layers.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ModelParallelMultiheadAttention)):
            module.float8 = float8
            count += 1
    return count


def check_fp8_environment(args, cpu: bool) -> None:
    """Refuse ``--fp8`` on a machine that cannot run it, before any work:
    torchao's float8 training must import, and unless the test mode
    (``FAIRSEQ_MEGATRON_FP8_EMULATE=1``, :mod:`fairseq_megatron.modules.float8`)
    emulates it, the run needs a CUDA GPU with float8 matrix multiplies
    (compute capability 8.9 or newer: Ada, Hopper, Blackwell). ``cpu``:
    fairseq's ``--cpu``. fairseq-train's start calls it.

    Raises:
        UsageError: either case, in one line.
    """
    if not safe_getattr(args, "fp8", False):
        return
    if not emulated():  # the device first: it needs no import of torchao
        needs = ("--fp8 needs a GPU with float8 matrix multiplies (compute capability 8.9 or newer: Ada, Hopper, "
                 "Blackwell)")
        if cpu or not torch.cuda.is_available():
            raise UsageError(f"{needs}; this run is on the CPU")
        capability = torch.cuda.get_device_capability()
        if capability < (8, 9):
            raise UsageError(f"{needs}; {torch.cuda.get_device_name()} has {capability[0]}.{capability[1]}")
    Float8Training.of_recipe(safe_getattr(args, "fp8_recipe", None) or "tensorwise", emulate=emulated())
