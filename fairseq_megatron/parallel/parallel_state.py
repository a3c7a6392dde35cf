"""Tensor-, pipeline- and data-parallel process groups, in one place.

A world of ``W = T x P x D`` ranks is a grid (:class:`ParallelLayout`):
``T`` tensor-parallel ranks hold the parts of one pipeline stage, ``P``
pipeline stages hold one whole model, and ``D`` data-parallel copies of
that model read different batches. Ranks are ordered as Megatron-Core
orders them (``megatron/core/parallel_state.py``, order "tp-dp-pp"):
tensor fastest, then data, then pipeline, so global rank
``r = t + T * (d + D * p)``. At ``P = 1`` this is Megatron-LM's and
fairscale's layout of 2020: model-parallel groups are blocks of
consecutive ranks, data-parallel groups stride across them.

Groups of this rank:

* tensor-parallel: the ``T`` ranks of one stage of one model copy;
* pipeline-parallel: the ``P`` ranks holding the same tensor part of each
  stage of one model copy, stage order;
* data-parallel: the ``D`` ranks holding the same part of the same stage;
* model-parallel: the ``T x P`` ranks of one model copy (a checkpoint's
  part files are written by one such group);
* embedding: the first and last stage of a pipeline group (one rank when
  ``P = 1``), over which the tied input/output embedding's gradients are
  summed (Megatron-LM ``_EMBEDDING_GROUP``).

This module also:

* refuses, in one line, a world size not divisible by ``T x P``;
* has a *single-process* mode: when torch.distributed was never
  initialised and a layer asks for its group, it gets ``None`` and a world
  size of 1, so a size-1 model runs in a plain Python process (fairseq
  does not initialise torch.distributed for single-process runs).

Layers take the group at construction time (default: :func:`get_tensor_model_parallel_group`)
and pass it to the communication functions in
:mod:`fairseq_megatron.parallel.mappings`; nothing deeper reads globals.
"""

import copy
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch.distributed as dist

from fairseq_megatron.errors import UsageError

ProcessGroup = Optional[dist.ProcessGroup]


class ModelParallelNotInitializedError(RuntimeError):
    """Raised when a model-parallel size > 1 is used before the groups exist."""


@dataclass(frozen=True)
class ParallelLayout:
    """The grid of ``world_size`` ranks: ``tensor`` x ``data`` x ``pipeline``,
    tensor fastest, pipeline slowest (see the module docstring).

    Raises (on construction):
        UsageError: a size below 1, or ``world_size`` not divisible by
            ``tensor x pipeline``.
    """

    world_size: int
    tensor: int = 1
    pipeline: int = 1

    def __post_init__(self):
        if self.tensor < 1 or self.pipeline < 1:
            raise UsageError(f"--model-parallel-size {self.tensor} and --pipeline-model-parallel-size "
                             f"{self.pipeline}: both are at least 1")
        if self.world_size % (self.tensor * self.pipeline):
            what = f"--model-parallel-size {self.tensor}"
            if self.pipeline > 1:
                what += f" x --pipeline-model-parallel-size {self.pipeline} = {self.tensor * self.pipeline}"
            raise UsageError(f"world size {self.world_size} is not divisible by {what}")

    @property
    def data(self) -> int:
        """The number of model copies, ``world_size / (tensor x pipeline)``."""
        return self.world_size // (self.tensor * self.pipeline)

    def rank(self, tensor: int, data: int, pipeline: int) -> int:
        """The global rank at these coordinates."""
        return tensor + self.tensor * (data + self.data * pipeline)

    def coordinates(self, rank: int) -> Tuple[int, int, int]:
        """``(tensor, data, pipeline)`` coordinates of global ``rank``."""
        return rank % self.tensor, rank // self.tensor % self.data, rank // (self.tensor * self.data)

    def tensor_parallel_groups(self) -> List[List[int]]:
        return [[self.rank(t, d, p) for t in range(self.tensor)]
                for p in range(self.pipeline) for d in range(self.data)]

    def data_parallel_groups(self) -> List[List[int]]:
        return [[self.rank(t, d, p) for d in range(self.data)]
                for p in range(self.pipeline) for t in range(self.tensor)]

    def pipeline_parallel_groups(self) -> List[List[int]]:
        return [[self.rank(t, d, p) for p in range(self.pipeline)]
                for d in range(self.data) for t in range(self.tensor)]

    def model_parallel_groups(self) -> List[List[int]]:
        """One group per model copy: every tensor part of every stage, in rank order."""
        return [sorted(self.rank(t, d, p) for p in range(self.pipeline) for t in range(self.tensor))
                for d in range(self.data)]

    def embedding_groups(self) -> List[List[int]]:
        """First and last stage of each pipeline group (one rank at ``pipeline = 1``)."""
        return [sorted({group[0], group[-1]}) for group in self.pipeline_parallel_groups()]


@dataclass
class _Groups:
    layout: ParallelLayout
    tensor: ProcessGroup
    pipeline: ProcessGroup
    data: ProcessGroup
    model: ProcessGroup
    embedding: ProcessGroup


_groups: Optional[_Groups] = None


def initialize_model_parallel(model_parallel_size: int, pipeline_model_parallel_size: int = 1) -> None:
    """Split the default process group into tensor-, pipeline- and
    data-parallel groups (and the model-parallel and embedding groups) of
    :class:`ParallelLayout`; any groups built before are forgotten first.

    Every rank creates every group, in the same order (``dist.new_group``
    is collective over the whole world), and returns once all of them have. ``model_parallel_size`` is the
    tensor-parallel size ``T`` (fairseq's ``--model-parallel-size``; fairseq
    calls this function with it alone). Mirrors Megatron-LM's
    ``mpu.initialize_model_parallel``.

    Raises:
        ModelParallelNotInitializedError: torch.distributed is not initialised.
        UsageError: a size below 1, or the world size not divisible by ``T x P``.
    """
    global _groups
    if not dist.is_available() or not dist.is_initialized():
        raise ModelParallelNotInitializedError(
            "torch.distributed is not initialized: launch with torchrun (or "
            "--distributed-world-size) before using --model-parallel-size"
        )
    layout = ParallelLayout(dist.get_world_size(), model_parallel_size, pipeline_model_parallel_size)
    me = dist.get_rank()

    def mine(groups: List[List[int]]) -> ProcessGroup:
        found = None
        for ranks in groups:
            group = dist.new_group(ranks)
            if me in ranks:
                found = group
        return found

    destroy_model_parallel()
    _groups = _Groups(
        layout=layout,
        tensor=mine(layout.tensor_parallel_groups()),
        pipeline=mine(layout.pipeline_parallel_groups()),
        data=mine(layout.data_parallel_groups()),
        model=mine(layout.model_parallel_groups()),
        embedding=mine(layout.embedding_groups()),
    )
    # Leave together: a rank that fails right after (a bad option its tool checks at the start) closed its
    # connections while a slower rank was still opening them, which then failed in gloo's connect instead
    # of reporting that option.
    dist.barrier()


def destroy_model_parallel() -> None:
    """Forget the groups (tests use this to re-initialise in one process)."""
    global _groups
    _groups = None


def model_parallel_is_initialized() -> bool:
    """Whether :func:`initialize_model_parallel` has built the groups (and they were not destroyed)."""
    return _groups is not None


def get_parallel_layout() -> ParallelLayout:
    """The layout of the groups built, or of a single process (all sizes 1)."""
    if _groups is not None:
        return _groups.layout
    return ParallelLayout(world_size(None))


def _group(name: str) -> ProcessGroup:
    if _groups is not None:
        return getattr(_groups, name)
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    raise ModelParallelNotInitializedError(
        f"the {name}-parallel group is not initialized: with torch.distributed running, "
        "call fairseq_megatron.parallel.parallel_state.initialize_model_parallel(N) first "
        "(fairseq does this when --model-parallel-size > 1)"
    )


def get_tensor_model_parallel_group() -> ProcessGroup:
    """The tensor-model-parallel group of this rank.

    Returns ``None`` in single-process mode (torch.distributed not
    initialised), meaning "a group of one".

    Raises:
        ModelParallelNotInitializedError: torch.distributed is initialised
            with more than one rank but the groups are not.
            (With one rank the group of one is returned as ``None``.)
    """
    return _group("tensor")


def get_pipeline_model_parallel_group() -> ProcessGroup:
    """This rank's pipeline group: the same tensor part of every stage of
    one model copy (``None`` in a single process). Raises as
    :func:`get_tensor_model_parallel_group`."""
    return _group("pipeline")


def get_model_parallel_group() -> ProcessGroup:
    """Every rank of this rank's model copy, ``T x P`` ranks (``None`` in a
    single process). Raises as :func:`get_tensor_model_parallel_group`."""
    return _group("model")


def get_embedding_group() -> ProcessGroup:
    """The first and last stage of this rank's pipeline group (``None`` in
    a single process). Raises as :func:`get_tensor_model_parallel_group`."""
    return _group("embedding")


def get_data_parallel_group() -> ProcessGroup:
    """The data-parallel group of this rank (``None`` = the default group or a single process)."""
    return _groups.data if _groups is not None else None


def world_size(group: ProcessGroup) -> int:
    """Number of ranks in ``group``; 1 for ``None`` in single-process mode."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group=group)


def rank(group: ProcessGroup) -> int:
    """This process's rank inside ``group``; 0 in single-process mode."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group=group)


def get_tensor_model_parallel_world_size() -> int:
    """The tensor-model-parallel size N (1 in a single process)."""
    return world_size(get_tensor_model_parallel_group())


def get_tensor_model_parallel_rank() -> int:
    """This rank's index in its tensor-model-parallel group, 0..N-1: which model part it holds."""
    return rank(get_tensor_model_parallel_group())


def get_data_parallel_world_size() -> int:
    """Number of model copies, world size / (T x P) (1 in a single process)."""
    return world_size(get_data_parallel_group())


def get_data_parallel_rank() -> int:
    """Which model copy this rank belongs to: the data shard it reads."""
    return rank(get_data_parallel_group())


def get_pipeline_model_parallel_world_size() -> int:
    """The number of pipeline stages P (1 in a single process or without pipeline groups)."""
    return _groups.layout.pipeline if _groups is not None else 1


def get_pipeline_model_parallel_rank() -> int:
    """This rank's stage, 0..P-1 (0 in a single process)."""
    return rank(_groups.pipeline) if _groups is not None else 0


def get_pipeline_model_parallel_ranks() -> List[int]:
    """The global ranks of this rank's pipeline group, in stage order."""
    if _groups is not None:
        return dist.get_process_group_ranks(_groups.pipeline)
    return [dist.get_rank() if dist.is_available() and dist.is_initialized() else 0]


def is_pipeline_first_stage() -> bool:
    """Whether this rank holds the first stage (the embeddings)."""
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    """Whether this rank holds the last stage (final layer norm, output projection, loss)."""
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of model-parallel rank 0 in this rank's group."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    tp = get_tensor_model_parallel_world_size()
    return (dist.get_rank() // tp) * tp


class _DefaultGroup:
    def __repr__(self):
        return "DEFAULT_GROUP"


DEFAULT_GROUP = _DefaultGroup()
"""Sentinel for layer constructors: "use :func:`get_tensor_model_parallel_group` now"."""


def resolve_group(group) -> ProcessGroup:
    """``group`` itself, or this rank's tensor-model-parallel group for :data:`DEFAULT_GROUP`."""
    return get_tensor_model_parallel_group() if group is DEFAULT_GROUP else group


class SharesProcessGroupsWhenCopied:
    """Mixin for ``nn.Module`` classes that keep a process group as an attribute.

    ``copy.deepcopy`` of a model built from them failed with "cannot pickle
    'ProcessGroup' object": fairseq-train ``--store-ema`` copies the whole
    model (``fairseq/models/ema/ema.py``), at any model-parallel size > 1 and
    under any distributed launch. A copy now shares the group (a handle to
    the communicator of the same ranks: it lives in the same process and
    holds the same part); everything else is deep-copied as for any
    ``nn.Module`` (new parameters, buffers and submodules).
    """

    def __deepcopy__(self, memo):
        for value in vars(self).values():
            if isinstance(value, dist.ProcessGroup):
                memo[id(value)] = value
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(vars(self), memo))
        return copied
