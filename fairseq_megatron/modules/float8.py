"""Float8 matrix products for the parallel linear layers (``--fp8``).

The column- and row-parallel linears and the fused q/k/v projection compute
``F.linear(x, weight, bias)``; with ``--fp8`` their training passes run the
three products of a linear layer (output, input gradient, weight gradient)
in float8 through torchao's float8 training
(``torchao/float8/float8_linear.py``: ``matmul_with_hp_or_float8_args``,
the function torchao's own ``Float8Linear`` calls), with one of torchao's
recipes: ``tensorwise`` (one dynamic scale per tensor; e4m3 for inputs and
weights, e5m2 for output gradients) or ``rowwise`` (one power-of-two scale
per row or column; e4m3 throughout). torchao's ``convert_to_float8_training``
swaps ``nn.Linear`` modules only, so our layers call the function
themselves, through :func:`linear`.

Float8 is a compute mode: parameters, gradients, optimizer state and
checkpoints keep their dtype (fp32 with ``--bf16-autocast``). Evaluation and
incremental decoding run in high precision, as the layers' ``training`` flag
says, and so does the output projection onto the vocabulary (the
vocab-parallel embedding's weight), as torchao and Megatron leave the LM
head.

Scales are computed on each rank's shard, without communication: a
tensor-parallel rank scales its own weight shard and, in a row-parallel
layer, its own input shard. With ``rowwise`` every scale is a power of two,
so a shard's float8 values are those of the whole tensor; with
``tensorwise`` they can differ from one model-parallel size to another by
float8's rounding.

``FAIRSEQ_MEGATRON_FP8_EMULATE=1`` is a test mode: torchao's emulation
(``Float8LinearConfig(emulate=True)``: values rounded to float8, products in
fp32) on any device, CPU included. It is how the tests run ``--fp8`` without
a float8 GPU, and says nothing about speed.
"""

import dataclasses
import os
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fairseq_megatron.errors import UsageError

RECIPES = ("tensorwise", "rowwise")
EMULATE_VARIABLE = "FAIRSEQ_MEGATRON_FP8_EMULATE"
INSTALL_HINT = "pip install 'fairseq_megatron[fp8]' (torchao==0.18.0)"


def emulated() -> bool:
    """Whether the test mode (``FAIRSEQ_MEGATRON_FP8_EMULATE=1``) is on."""
    return os.environ.get(EMULATE_VARIABLE, "") not in ("", "0")


@dataclasses.dataclass(frozen=True)
class Float8Training:
    """What a layer needs for float8 products: torchao's
    ``Float8LinearConfig`` of ``recipe`` and the ``LinearMMConfig`` that
    torchao's ``Float8Linear`` derives from it. Build with
    :meth:`of_recipe`."""

    recipe: str
    config: Any  # torchao.float8.Float8LinearConfig
    mm_config: Any  # torchao.float8.float8_training_tensor.LinearMMConfig

    @classmethod
    def of_recipe(cls, recipe: str, emulate: bool = False) -> "Float8Training":
        """torchao's recipe ``recipe`` (``tensorwise`` or ``rowwise``), with
        its emulation when ``emulate``.

        Raises:
            UsageError: torchao is not installed, or ``recipe`` is not one of
                :data:`RECIPES`.
        """
        if recipe not in RECIPES:
            raise UsageError(f"--fp8-recipe {recipe}: choose one of {', '.join(RECIPES)}")
        try:
            from torchao.float8 import Float8LinearConfig
            from torchao.float8.float8_linear import Float8Linear
        except ImportError as e:
            raise UsageError(f"--fp8 needs torchao's float8 training ({e}): {INSTALL_HINT}") from None
        config = Float8LinearConfig.from_recipe_name(recipe)
        if emulate:
            config = dataclasses.replace(config, emulate=True)
        # torchao's own derivation of the three GEMMs' settings (fast
        # accumulation for the output only, emulation), on a layer of no size
        mm_config = Float8Linear(1, 1, bias=False, config=config, device="meta").linear_mm_config
        return cls(recipe, config, mm_config)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` with float8 products: ``x`` ``(*, in)``,
        ``weight`` ``(out, in)``, ``bias`` ``(out,)`` -> ``(*, out)``. Under
        autocast ``x`` is cast to the autocast dtype first, and the output
        has that dtype, as ``F.linear`` and torchao's ``Float8Linear`` do;
        the weight goes from its own dtype to float8 directly."""
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        y = matmul_with_hp_or_float8_args.apply(x, weight.t(), self.mm_config, self.config)
        return y if bias is None else y + bias.to(y.dtype)


def active(module: nn.Module) -> bool:
    """Whether ``module``'s products run in float8 now (``--fp8``, training)."""
    return getattr(module, "float8", None) is not None and module.training


def linear(module: nn.Module, x: torch.Tensor, weight: torch.Tensor,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``module``'s forward, its products in
    float8 when ``module`` is training and ``--fp8`` gave it a
    :class:`Float8Training`; otherwise exactly ``F.linear``."""
    if not active(module):
        return F.linear(x, weight, bias)
    return module.float8.linear(x, weight, bias)
