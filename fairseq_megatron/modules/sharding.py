"""How a full ("master") tensor maps onto its tensor-model-parallel shards.

Layers build the master weight with the initialiser once, on every rank with
the same default generator state, and keep their own slice. A model at
model-parallel size N therefore starts from exactly the weights of the same
model at size 1, which is what the parity tests compare (Megatron-LM
``_initialize_affine_weight_cpu`` does the same).
"""

from typing import Callable

import torch

from fairseq_megatron.errors import UsageError


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``, or a UsageError (a ValueError) naming ``what`` if it does not divide."""
    if numerator % denominator != 0:
        raise UsageError(
            f"{what} ({numerator}) is not divisible by the model-parallel size ({denominator})"
        )
    return numerator // denominator


def shard_of(full: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous chunk of ``full`` along ``dim`` (a copy)."""
    size = divide(full.size(dim), world_size, f"dimension {dim} of a {tuple(full.shape)} tensor")
    return full.narrow(dim, rank * size, size).clone()


def init_shard_(
    shard: torch.Tensor,
    full_shape,
    dim: int,
    rank: int,
    world_size: int,
    init_method: Callable[[torch.Tensor], None],
) -> None:
    """Fill ``shard`` with this rank's slice of a master tensor of ``full_shape``
    initialised by ``init_method`` (in fp32, then cast)."""
    full = torch.empty(full_shape, dtype=torch.float32)
    init_method(full)
    with torch.no_grad():
        shard.copy_(shard_of(full, dim, rank, world_size))
