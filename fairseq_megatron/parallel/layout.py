"""The parallel layout: how ``W`` ranks split into tensor, context, data and
pipeline parallelism, and the one place where these sizes are checked.

A world of ``W = T x C x D x P`` ranks is a grid. ``T`` tensor-parallel
ranks hold the parts of one pipeline stage (Shoeybi et al. 2019, section 3),
``C`` context-parallel ranks split its sequence, ``D`` data-parallel copies
read different batches, and ``P`` pipeline stages hold one whole model.
Ranks are ordered as Megatron-Core orders them
(``megatron/core/parallel_state.py``, order "tp-cp-dp-pp"): tensor fastest,
then context, data and pipeline, so global rank
``r = t + T * (c + C * (d + D * p))``. At ``C = P = 1`` this is Megatron-LM's
and fairscale's layout of 2020, so the part files keep their meaning:
model-parallel groups are blocks of consecutive ranks, data-parallel groups
stride across them.

:class:`ParallelLayout` is the grid alone (sizes, and which ranks form
which group), a pure value that the planner, the checkpoint tools and the
tests use without any process group. The groups of a running process are
made from it by :mod:`fairseq_megatron.parallel.parallel_state`, on torch's
``DeviceMesh`` with dimensions named ``pp``, ``dp``, ``cp`` and ``tp``.
"""

from dataclasses import dataclass
from typing import List, NamedTuple

from fairseq_megatron.errors import UsageError

MESH_DIMENSIONS = ("pp", "dp", "cp", "tp")
"""The ``DeviceMesh`` dimension names, slowest first (the mesh's own order)."""


class Coordinates(NamedTuple):
    """Where one rank sits in the grid."""

    tensor: int
    context: int
    data: int
    pipeline: int


SIZES = {"tensor": ("--model-parallel-size", "model parts"),
         "pipeline": ("--pipeline-model-parallel-size", "pipeline stages"),
         "context": ("--context-parallel-size", "context-parallel ranks")}
"""Each parallel size: the flag that sets it, and what it counts."""


def check_size(name: str, size: int) -> None:
    """The one check of parallel size ``name`` (a key of :data:`SIZES`) on
    its own, wherever it is read.

    Raises:
        UsageError: ``size`` below 1.
    """
    flag, what = SIZES[name]
    if size < 1:
        raise UsageError(f"{flag} {size}: the number of {what} is at least 1")


def _flag_product(tensor: int, context: int, pipeline: int) -> str:
    """``--model-parallel-size T`` (x the other flags given): how the user named the product."""
    flags = [f"--model-parallel-size {tensor}"]
    if context > 1:
        flags.append(f"--context-parallel-size {context}")
    if pipeline > 1:
        flags.append(f"--pipeline-model-parallel-size {pipeline}")
    product = f" = {tensor * context * pipeline}" if len(flags) > 1 else ""
    return " x ".join(flags) + product


@dataclass(frozen=True)
class ParallelLayout:
    """The grid of ``world_size`` ranks: ``tensor`` x ``context`` x ``data``
    x ``pipeline``, tensor fastest, pipeline slowest (see the module
    docstring). ``data`` is what the world size leaves.

    The one check of the parallel sizes: every entry point builds its
    layout from the configuration before any work.

    Raises (on construction):
        UsageError: a size below 1; a world size that ``tensor x context x
            pipeline`` does not divide; more than one rank per model copy in
            a single process (no launcher), naming the torchrun command.
    """

    world_size: int
    tensor: int = 1
    pipeline: int = 1
    context: int = 1

    def __post_init__(self):
        for name in SIZES:
            check_size(name, getattr(self, name))
        per_copy = self.tensor * self.context * self.pipeline
        if self.world_size == 1 and per_copy > 1:
            raise UsageError(
                f"{_flag_product(self.tensor, self.context, self.pipeline)} needs {per_copy} processes, one per "
                f"model part{' of each pipeline stage' if self.pipeline > 1 else ''}, and this run is one "
                f"process: launch it with torchrun --nproc_per_node {per_copy} (or give fairseq "
                f"--distributed-world-size {per_copy} on a machine with {per_copy} GPUs)")
        if self.world_size % per_copy:
            raise UsageError(f"world size {self.world_size} is not divisible by "
                             f"{_flag_product(self.tensor, self.context, self.pipeline)}")

    @property
    def data(self) -> int:
        """The number of model copies, ``world_size / (tensor x context x pipeline)``."""
        return self.world_size // (self.tensor * self.context * self.pipeline)

    @property
    def mesh_shape(self):
        """``(P, D, C, T)``: the sizes of :data:`MESH_DIMENSIONS`."""
        return self.pipeline, self.data, self.context, self.tensor

    def rank(self, tensor: int = 0, data: int = 0, pipeline: int = 0, context: int = 0) -> int:
        """The global rank at these coordinates."""
        return tensor + self.tensor * (context + self.context * (data + self.data * pipeline))

    def coordinates(self, rank: int) -> Coordinates:
        """Where global ``rank`` sits."""
        rank, t = divmod(rank, self.tensor)
        rank, c = divmod(rank, self.context)
        p, d = divmod(rank, self.data)
        return Coordinates(tensor=t, context=c, data=d, pipeline=p)

    def _groups(self, varying: str) -> List[List[int]]:
        """The groups of ranks that differ only in coordinate ``varying`` (each in that coordinate's order)."""
        sizes = {"tensor": self.tensor, "context": self.context, "data": self.data, "pipeline": self.pipeline}
        fixed = [name for name in ("tensor", "context", "data", "pipeline") if name != varying]
        groups = []
        for flat in range(self.world_size // sizes[varying]):
            coordinates = {}
            for name in fixed:
                flat, coordinates[name] = divmod(flat, sizes[name])
            groups.append([self.rank(**coordinates, **{varying: i}) for i in range(sizes[varying])])
        return sorted(groups)

    def tensor_parallel_groups(self) -> List[List[int]]:
        """The ``T`` ranks of one stage of one model copy (one context shard), each group."""
        return self._groups("tensor")

    def context_parallel_groups(self) -> List[List[int]]:
        """The ``C`` ranks that split one sequence, each group."""
        return self._groups("context")

    def data_parallel_groups(self) -> List[List[int]]:
        """The ``D`` ranks holding the same part of the same stage, each group."""
        return self._groups("data")

    def pipeline_parallel_groups(self) -> List[List[int]]:
        """The ``P`` ranks holding the same part of each stage of one model copy, in stage order."""
        return self._groups("pipeline")

    def model_parallel_groups(self) -> List[List[int]]:
        """One group per model copy and context shard: every tensor part of every stage, in rank order
        (the ranks whose files make one checkpoint)."""
        return sorted(sorted(self.rank(tensor=t, context=c, data=d, pipeline=p)
                             for p in range(self.pipeline) for t in range(self.tensor))
                      for d in range(self.data) for c in range(self.context))

    def embedding_groups(self) -> List[List[int]]:
        """First and last stage of each pipeline group (one rank at ``pipeline = 1``)."""
        return [sorted({group[0], group[-1]}) for group in self.pipeline_parallel_groups()]
