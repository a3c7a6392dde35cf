"""How a full ("master") tensor maps onto its tensor-model-parallel shards.

Layers build the master weight with the initialiser once, on every rank with
the same default generator state, and keep their own slice. A model at
model-parallel size N therefore starts from exactly the weights of the same
model at size 1, which is what the parity tests compare (Megatron-LM
``_initialize_affine_weight_cpu`` does the same).

Each layer takes the :class:`DeferredInitialisation` of the model being
built (``initialisation``): its shards are made on the ``meta`` device and
its draws queued in the order they are due, to run once, explicitly, after
the model is parallelized: the builder draws them at once for a model
nobody loads (its queue run as the build ends), while one that a checkpoint
fills (fairseq-train's trainer, which looks for ``checkpoint_last.pt``
after the build; every tool that loads a checkpoint) gives its weights
NaN-filled memory (:meth:`DeferredInitialisation.materialize`), so that a
parameter the checkpoint failed to fill cannot pass for a trained one, and
draws them only if no checkpoint fills them, giving the same weights.
A layer built without one draws at once. Drawing the master tensors is
nearly the whole cost of building a model, on every rank at every
model-parallel size (each rank draws the full master tensor of each layer).
"""

from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn

from fairseq_megatron.errors import UsageError
from fairseq_megatron.modules.parameter_attributes import copy_parameter_attributes


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


def local_piece(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The piece of ``value`` (shaped like ``target``) that this rank holds of
    ``target``: all of it, or for a ``DTensor`` (a parameter sharded over
    data-parallel ranks) the piece its placements cut (``torch.chunk``),
    without communication: every rank holds the whole ``value``."""
    if not hasattr(target, "device_mesh"):
        return value
    mesh, piece = target.device_mesh, value
    for mesh_dim, placement in enumerate(target.placements):
        if placement.is_shard():
            pieces = torch.chunk(piece, mesh.size(mesh_dim), dim=placement.dim)
            index = mesh.get_local_rank(mesh_dim)
            piece = pieces[index] if index < len(pieces) else piece.narrow(placement.dim, 0, 0)
    return piece


def fill_(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy this rank's piece of ``value`` into ``target`` (:func:`local_piece`)."""
    with torch.no_grad():
        if hasattr(target, "device_mesh"):
            target.to_local().copy_(local_piece(target, value))
        else:
            target.copy_(value)


class DeferredInitialisation:
    """The initialisations of one model's build, queued in the order they
    were due, and the default generator's state when the build began.

    The layers given it make their sharded weights on the ``meta`` device
    (no memory); :meth:`materialize` gives them memory,
    NaN-filled (so that a weight a checkpoint failed to fill cannot pass for
    a trained one), after the caller has dropped what this rank does not
    hold (a pipeline stage keeps its own layers:
    :mod:`fairseq_megatron.training.pipeline_split`). :meth:`run` then draws
    every queued initialisation from the build's generator state: into the
    weights still held, and drawn and thrown away for the others, so the
    weights held are bitwise those a build that drew at once gives them,
    and the generator is left where that build leaves it, whatever drew
    from it in between: every draw of the build is queued (a module that
    draws as it is built, fairseq's learned positions, is queued again in
    its place, :meth:`insert`). Parameters moved to another device or dtype
    since keep being filled: each master tensor is drawn in fp32 on the
    CPU, then cast into the shard.
    """

    def __init__(self):
        self.generator_state = torch.get_rng_state()
        self._pending: List[Callable[[Callable[[torch.Tensor], Optional[torch.Tensor]]], object]] = []
        self._replaced: Dict[int, torch.Tensor] = {}  # id of a meta parameter -> the parameter that took its place

    def add(self, initialise: Callable[[Callable[[torch.Tensor], Optional[torch.Tensor]]], object]) -> None:
        """Queue ``initialise(held)``, where ``held(param)`` is the parameter
        that now stands for ``param`` (None where this rank dropped it)."""
        self._pending.append(initialise)

    def insert(self, index: int, initialise: Callable[[Callable[[torch.Tensor], Optional[torch.Tensor]]], object]) -> None:
        """Queue ``initialise(held)`` at position ``index``: the draw of a
        module that was built (and drew from the generator) before the
        initialisations queued since."""
        self._pending.insert(index, initialise)

    def __len__(self) -> int:
        return len(self._pending)

    def generator_moved(self) -> bool:
        """Whether the default generator has drawn since the build began."""
        return not torch.equal(torch.get_rng_state(), self.generator_state)

    def materialize(self, module: nn.Module, device=None) -> None:
        """Give every ``meta`` parameter of ``module`` memory on ``device``
        (default: torch's default device),
        filled with NaN: a new parameter in its place, the same one wherever
        the meta parameter was shared (a tied output projection), with its
        attributes (:mod:`~fairseq_megatron.modules.parameter_attributes`)."""
        for owner in module.modules():
            for name, param in owner._parameters.items():
                if param is None or not param.is_meta:
                    continue
                held = self._replaced.get(id(param))
                if held is None:
                    held = nn.Parameter(torch.full(param.shape, float("nan"), dtype=param.dtype, device=device),
                                        requires_grad=param.requires_grad)
                    copy_parameter_attributes(param, held)
                    self._replaced[id(param)] = held
                    self._replaced[id(held)] = held
                owner._parameters[name] = held

    def replaced(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Record that parameter ``new`` took the place of ``old`` (sharded
        data parallelism makes a ``DTensor`` of each): the draws for ``old``
        go into ``new``, this rank's piece of them."""
        self._replaced[id(old)] = new
        for key, value in list(self._replaced.items()):
            if value is old:
                self._replaced[key] = new

    def held(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """The parameter that stands for ``param`` after :meth:`materialize`
        and :meth:`replaced` (``param`` itself if nothing took its place); None
        for a meta parameter that was dropped before."""
        if id(param) in self._replaced:
            return self._replaced[id(param)]
        return None if param.is_meta else param

    def run(self) -> None:
        """Draw the queued initialisations, in order, from the state at the
        build's start (the generator is reset to it first)."""
        torch.set_rng_state(self.generator_state)
        for initialise in self._pending:
            initialise(self.held)
        self._pending.clear()


def new_shard(*shape: int, initialisation: Optional[DeferredInitialisation] = None) -> torch.Tensor:
    """An uninitialised fp32 tensor for a shard that :func:`init_shard_` fills:
    on the ``meta`` device where its draw is queued on ``initialisation``."""
    return torch.empty(*shape, device="meta" if initialisation is not None else None)


def draw_later(draw: Callable[[], object], initialisation: Optional[DeferredInitialisation]) -> bool:
    """Whether an initialisation must not draw now: where ``initialisation``
    is given (``draw`` is queued on it, and its result thrown away when it
    runs). For modules that initialise other than through :func:`init_shard_`."""
    if initialisation is not None:
        initialisation.add(lambda held: draw())
    return initialisation is not None


def init_shard_(
    shard: torch.Tensor,
    full_shape,
    dim: int,
    rank: int,
    world_size: int,
    init_method: Callable[[torch.Tensor], None],
    initialisation: Optional[DeferredInitialisation] = None,
) -> None:
    """Fill ``shard`` with this rank's slice of a master tensor of ``full_shape``
    initialised by ``init_method`` (in fp32 on the CPU, then cast): now, or
    where ``initialisation`` is given, when its queue runs (drawn and thrown
    away if this rank no longer holds ``shard`` then)."""
    def draw(target: Optional[torch.Tensor]) -> None:
        full = torch.empty(full_shape, dtype=torch.float32, device="cpu")
        init_method(full)
        if target is not None:
            fill_(target, shard_of(full, dim, rank, world_size))

    if initialisation is not None:
        initialisation.add(lambda held: draw(held(shard)))
    else:
        draw(shard)
