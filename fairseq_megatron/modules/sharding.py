"""How a full ("master") tensor maps onto its tensor-model-parallel shards.

Layers build the master weight with the initialiser once, on every rank with
the same default generator state, and keep their own slice. A model at
model-parallel size N therefore starts from exactly the weights of the same
model at size 1, which is what the parity tests compare (Megatron-LM
``_initialize_affine_weight_cpu`` does the same).

A model built only to receive a checkpoint's weights (fairseq's
``load_model_ensemble_and_task``, which loads every parameter with
``strict=True`` right after building) needs none of this:
:func:`initialisation_skipped` leaves its shards NaN instead, so that a
parameter the checkpoint failed to fill cannot pass for a trained one.
"""

import contextlib
from typing import Callable, Iterator

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


_initialisation_skipped = False


@contextlib.contextmanager
def initialisation_skipped() -> Iterator[None]:
    """Within this context :func:`init_shard_` fills shards with NaN instead of
    drawing a master tensor, and draws nothing from the default generator.

    For models whose every parameter is loaded from a checkpoint right after
    they are built (``fairseq_integration`` step 26). Drawing the master
    tensors is the whole cost of building the model: 14 s of 14 s for
    8 Megatron-11b layers (1.2B parameters) on 2 CPU threads, so about
    2 minutes on 2 threads for the 72 layers, on every rank at every
    model-parallel size (each rank draws the full master tensor of each layer).
    """
    global _initialisation_skipped
    previous, _initialisation_skipped = _initialisation_skipped, True
    try:
        yield
    finally:
        _initialisation_skipped = previous


def initialisation_is_skipped() -> bool:
    """Whether this is within :func:`initialisation_skipped` (for modules
    that initialise other than through :func:`init_shard_`)."""
    return _initialisation_skipped


def init_shard_(
    shard: torch.Tensor,
    full_shape,
    dim: int,
    rank: int,
    world_size: int,
    init_method: Callable[[torch.Tensor], None],
) -> None:
    """Fill ``shard`` with this rank's slice of a master tensor of ``full_shape``
    initialised by ``init_method`` (in fp32, then cast); with NaN within
    :func:`initialisation_skipped`."""
    if _initialisation_skipped:
        with torch.no_grad():
            shard.fill_(float("nan"))
        return
    full = torch.empty(full_shape, dtype=torch.float32)
    init_method(full)
    with torch.no_grad():
        shard.copy_(shard_of(full, dim, rank, world_size))
