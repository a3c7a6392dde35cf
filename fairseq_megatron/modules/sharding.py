"""How a full ("master") tensor maps onto its tensor-model-parallel shards.

Layers build the master weight with the initialiser once, on every rank with
the same default generator state, and keep their own slice. A model at
model-parallel size N therefore starts from exactly the weights of the same
model at size 1, which is what the parity tests compare (Megatron-LM
``_initialize_affine_weight_cpu`` does the same).

A model that may get a checkpoint's weights (fairseq-train, which builds
before it looks for ``checkpoint_last.pt``; every tool that loads a
checkpoint) is built within :func:`initialisation_deferred`: its shards are
NaN, so that a parameter the checkpoint failed to fill cannot pass for a
trained one, and the draws wait, to run only if no checkpoint fills the
parameters, giving the same weights as at the build. Drawing the master
tensors is the whole cost of building the model: 14 s of 14 s for 8
Megatron-11b layers (1.2B parameters) on 2 CPU threads, about 2 minutes for
the 72 layers, on every rank at every model-parallel size (each rank draws
the full master tensor of each layer).
"""

import contextlib
from typing import Callable, Iterator, List, Optional

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


class DeferredInitialisation:
    """The initialisations left out of a build within
    :func:`initialisation_deferred`, in the order they were due, and the
    default generator's state when the build began.

    :meth:`run` draws them from that state, so the parameters get bitwise
    the values the build would have given them, and the generator is left
    where the build would have left it, provided nothing else drew from it
    during the build (the caller checks: :meth:`generator_moved`). The
    parameters may have been moved to another device or dtype since
    (``nn.Module.half``/``.to`` keep the Parameter objects): each master
    tensor is still drawn in fp32 on the CPU, then cast into the shard.
    """

    def __init__(self):
        self.generator_state = torch.get_rng_state()
        self._pending: List[Callable[[], object]] = []

    def add(self, initialise: Callable[[], object]) -> None:
        """Queue ``initialise()`` (its result is discarded)."""
        self._pending.append(initialise)

    def __len__(self) -> int:
        return len(self._pending)

    def generator_moved(self) -> bool:
        """Whether the default generator has drawn since the build began."""
        return not torch.equal(torch.get_rng_state(), self.generator_state)

    def run(self) -> None:
        """Draw the queued initialisations, in order, from the state at the
        build's start (the generator is reset to it first)."""
        torch.set_rng_state(self.generator_state)
        for initialise in self._pending:
            initialise()
        self._pending.clear()


_deferred: Optional[DeferredInitialisation] = None
_discarding = False


@contextlib.contextmanager
def initialisation_deferred() -> Iterator[DeferredInitialisation]:
    """Within this context :func:`init_shard_` fills shards with NaN and
    queues its draw on the :class:`DeferredInitialisation` yielded, drawing
    nothing from the default generator."""
    global _deferred
    previous, _deferred = _deferred, DeferredInitialisation()
    try:
        yield _deferred
    finally:
        _deferred = previous


def deferred_initialisation() -> Optional[DeferredInitialisation]:
    """The queue of the enclosing :func:`initialisation_deferred`, or None."""
    return _deferred


def draw_later(draw: Callable[[], object]) -> bool:
    """Whether an initialisation must not draw now: within
    :func:`initialisation_deferred` (``draw`` is queued). For
    :func:`init_shard_` and modules that initialise other than through it."""
    if _deferred is not None:
        _deferred.add(draw)
    return _deferred is not None


@contextlib.contextmanager
def draws_discarded() -> Iterator[None]:
    """Within this context :func:`init_shard_` draws each master tensor and
    throws it away (or, deferred, queues a draw that keeps no reference to
    the shard), leaving the shard uninitialised. A pipeline stage builds the
    modules of the other stages this way, so that the default generator
    reaches each of its own layers where a one-stage build would: the stage
    gets bitwise the weights the same layers have at
    ``--pipeline-model-parallel-size 1``."""
    global _discarding
    previous, _discarding = _discarding, True
    try:
        yield
    finally:
        _discarding = previous


def init_shard_(
    shard: torch.Tensor,
    full_shape,
    dim: int,
    rank: int,
    world_size: int,
    init_method: Callable[[torch.Tensor], None],
) -> None:
    """Fill ``shard`` with this rank's slice of a master tensor of ``full_shape``
    initialised by ``init_method`` (in fp32 on the CPU, then cast); with NaN
    within :func:`initialisation_deferred` until its queue runs."""
    if _discarding:  # the same draw, holding no reference to the shard
        def draw() -> None:
            init_method(torch.empty(full_shape, dtype=torch.float32))
    else:
        def draw() -> None:
            full = torch.empty(full_shape, dtype=torch.float32)
            init_method(full)
            with torch.no_grad():
                shard.copy_(shard_of(full, dim, rank, world_size))

    if draw_later(draw):
        with torch.no_grad():
            shard.fill_(float("nan"))
    else:
        draw()
