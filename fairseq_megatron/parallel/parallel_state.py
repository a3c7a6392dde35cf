"""The process groups of this rank, made once from the parallel layout.

Every entry point (fairseq's launch of train, eval-lm, validate, generate
and interactive; the hub; the scripts) calls :func:`initialize_model_parallel`
once, with the sizes of its configuration: it checks them
(:class:`~fairseq_megatron.parallel.layout.ParallelLayout`) and creates every
group this package uses, on torch's ``DeviceMesh`` with dimensions
``("pp", "dp", "cp", "tp")`` (Megatron-Core's rank order, see
:mod:`~fairseq_megatron.parallel.layout`). The groups of this rank:

* tensor-parallel: the ``T`` ranks of one stage of one model copy;
* context-parallel: the ``C`` ranks that split one sequence;
* data-parallel: the ``D`` ranks holding the same part of the same stage;
* data-and-context-parallel: the ``D x C`` ranks whose gradients are
  averaged together (the mesh's ``dp`` and ``cp`` dimensions flattened;
  Megatron-Core's ``get_data_parallel_group(with_context_parallel=True)``);
* pipeline-parallel: the same tensor part of each stage of one model copy, stage order;
* model-parallel: the ``T x P`` ranks whose part files make one checkpoint
  (the mesh's ``pp`` and ``tp`` dimensions flattened);
* embedding: the first and last stage of a pipeline group (one rank when
  ``P = 1``), over which the tied input/output embedding's gradients are
  summed (Megatron-LM ``_EMBEDDING_GROUP``).

Everything else reads the groups here: models, the trainer and the pipeline
schedule never create one. Each group is a :class:`RankGroup`, its size and
this rank's index in it beside the process group, so that a layer can be
built as rank ``k`` of a size-``T`` model without any process group (on the
``meta`` device, for the checkpoint tools).

Single-process mode: where torch.distributed was never initialised (a
one-process eval-lm, generate or hub run, or a user's script), every size is
1 and every group is ``None``, meaning "a group of one": no mesh, no
RANK or MASTER_ADDR needed. ``None`` never means the whole world here.

The getters keep Megatron-LM's and fairscale's names
(``get_tensor_model_parallel_group`` ...), which fairseq imports through
:mod:`fairseq_megatron.fairseq_integration.mpu`.
"""

import atexit
import copy
import datetime
import functools
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch.distributed as dist
# Before any world starts: its functions take ``group.WORLD`` as a default argument, evaluated at import;
# imported once a world runs (torch's sharded-tensor code does, during training), they keep its group to the
# very end, past release_process_groups. Imported now, the default is None, which means the same world.
import torch.distributed.nn.functional  # noqa: F401

from fairseq_megatron.errors import UsageError
from fairseq_megatron.parallel.layout import MESH_DIMENSIONS, Coordinates, ParallelLayout

ProcessGroup = Optional[dist.ProcessGroup]


class ModelParallelNotInitializedError(RuntimeError):
    """Raised when a group is asked for in a distributed run before the groups exist."""


@dataclass(frozen=True)
class RankGroup:
    """One group of ranks as this rank sees it: ``size`` ranks, this one
    ``rank`` among them, and the process group that connects them (None for
    a group of one, or for a layer built without process groups, which can
    then run no collective)."""

    size: int = 1
    rank: int = 0
    group: ProcessGroup = None

    def release(self) -> None:
        """Drop the process group (the layers holding this object can then
        run no collective); only :func:`release_process_groups` calls it, at
        exit. The one change a ``RankGroup`` ever sees."""
        object.__setattr__(self, "group", None)

    @classmethod
    def of(cls, group: ProcessGroup) -> "RankGroup":
        """The size and this rank's index of ``group`` (None: a group of one)."""
        if group is None:
            return cls()
        return cls(dist.get_world_size(group=group), dist.get_rank(group=group), group)

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.size}")


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's place in the layout and its groups (see the module docstring)."""

    layout: ParallelLayout
    coordinates: Coordinates
    mesh: Optional[object]  # torch.distributed.device_mesh.DeviceMesh; None in a single process
    tensor: RankGroup
    context: RankGroup
    data: RankGroup
    pipeline: RankGroup
    model: RankGroup
    embedding: RankGroup
    pipeline_ranks: tuple  # global ranks of this rank's pipeline group, stage order
    data_context: RankGroup = RankGroup()  # the data-parallel ranks of every context shard: D x C ranks


_SINGLE_PROCESS = ProcessGroups(ParallelLayout(1), Coordinates(0, 0, 0, 0), None, *([RankGroup()] * 6), (0,))
_state: Optional[ProcessGroups] = None
_launched: Optional[Tuple[int, int, int]] = None  # this process's launch sizes, until its groups exist (launch_layout)


def launch_layout(tensor: int, pipeline: int = 1, context: int = 1) -> None:
    """Take the parallel sizes this process's launch read from its
    configuration (once: :func:`fairseq_megatron.fairseq_integration.distributed.launch_sizes`)
    as those of the layout the next :func:`initialize_model_parallel` with
    the tensor-parallel size alone builds: fairseq's ``distributed_init``
    starts torch.distributed and then calls it so, with
    ``--model-parallel-size`` as its one argument
    (``fairseq/distributed/utils.py``). Kept until the groups are built."""
    global _launched
    _launched = (tensor, pipeline, context)


def _device_type() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _build(layout: ParallelLayout) -> ProcessGroups:
    """Create every group of ``layout`` (collective: every rank calls it, in the same order)."""
    from torch.distributed.device_mesh import init_device_mesh

    me = dist.get_rank()
    mesh = init_device_mesh(_device_type(), layout.mesh_shape, mesh_dim_names=MESH_DIMENSIONS)
    model_mesh = mesh["pp", "tp"]._flatten("mp")
    embedding = None
    for ranks in layout.embedding_groups():  # not a mesh dimension: first and last stage only
        group = dist.new_group(ranks)
        if me in ranks:
            embedding = group

    def dimension(sub_mesh) -> RankGroup:
        return RankGroup(sub_mesh.size(), sub_mesh.get_local_rank(), sub_mesh.get_group())

    pipeline = dimension(mesh["pp"])
    data = dimension(mesh["dp"])
    data_context = dimension(mesh["dp", "cp"]._flatten("dp_cp")) if layout.context > 1 else data
    return ProcessGroups(
        layout=layout,
        coordinates=layout.coordinates(me),
        mesh=mesh,
        tensor=dimension(mesh["tp"]),
        context=dimension(mesh["cp"]),
        data=data,
        pipeline=pipeline,
        model=dimension(model_mesh),
        embedding=RankGroup.of(embedding),
        pipeline_ranks=tuple(dist.get_process_group_ranks(pipeline.group)),
        data_context=data_context,
    )


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: Optional[int] = None,
                              context_parallel_size: int = 1) -> None:
    """Build this rank's groups for the layout of these sizes; groups built
    before are forgotten first. ``tensor_model_parallel_size`` is fairseq's
    ``--model-parallel-size``. Called with it alone (fairseq's
    ``distributed_init``, and the fairscale-style API) where the launch gave
    this process its layout (:func:`launch_layout`), it builds that layout's
    groups, the tensor-parallel size checked against it; otherwise the
    layout of these sizes. Mirrors Megatron-LM's ``mpu.initialize_model_parallel``.

    Every rank creates every group in the same order and returns once all
    of them have. Without torch.distributed, sizes of 1 give the
    single-process mode.

    Raises:
        UsageError: a size below 1, a world size the sizes do not divide,
            sizes above 1 in a single process, or a tensor-parallel size
            other than the launch layout's.
        ModelParallelNotInitializedError: never raised for sizes of 1.
    """
    global _state, _launched
    tensor = tensor_model_parallel_size
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    if pipeline_model_parallel_size is None and _launched is not None:
        if _launched[0] != tensor:
            raise UsageError(f"the model-parallel groups were asked for --model-parallel-size {tensor}, and this run "
                             f"was launched with {_launched[0]}")
        sizes = _launched
    else:
        sizes = (tensor, 1 if pipeline_model_parallel_size is None else pipeline_model_parallel_size,
                 context_parallel_size)
    layout = ParallelLayout(world, *sizes)  # the one check of the sizes, in the world that runs them
    destroy_model_parallel()
    _launched = None
    if not distributed:
        _state = _SINGLE_PROCESS
        return
    _state = _build(layout)
    release_at_exit()
    # Leave together: a rank that fails right after (a bad option its tool checks at the start) closed its
    # connections while a slower rank was still opening them, which then failed in gloo's connect instead
    # of reporting that option.
    dist.barrier()


def ensure_model_parallel(tensor: int = 1, pipeline: int = 1, context: int = 1) -> None:
    """:func:`initialize_model_parallel` unless the groups of these sizes
    exist already (the hub, loading a second model in one process)."""
    if _state is not None and (_state.layout.tensor, _state.layout.pipeline, _state.layout.context) == (
            tensor, pipeline, context):
        return
    initialize_model_parallel(tensor, pipeline, context)


def start_single_rank_world() -> None:
    """Start a torch.distributed world of this one process (NCCL with a GPU,
    else gloo; an in-memory store, no environment needed), for code that
    needs a process group even at one rank (torch's FSDP2)."""
    import torch

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    hook = sys.excepthook
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    release_at_exit()
    # torch's hook prefixes each line of an uncaught error with "[rank0]: ", which tells the ranks of a launched
    # world apart; a world of one process has no other rank, and its one-line errors stay one line
    sys.excepthook = hook


_patient_group: ProcessGroup = None


def get_patient_group() -> ProcessGroup:
    """A gloo group of the whole world with a week's timeout, for messages
    that wait on a person (fairseq-interactive's input, which rank 0 reads
    and sends to the others; the default group would time out). Made on
    first use: every rank must ask for it at the same point."""
    global _patient_group
    if _patient_group is None:
        _patient_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=7))
    return _patient_group


def destroy_model_parallel() -> None:
    """Forget the groups (tests use this to re-initialise in one process)."""
    global _state
    _state = None


@functools.lru_cache(maxsize=None)  # registered once per process, whatever the number of calls
def release_at_exit() -> None:
    """Have :func:`release_process_groups` run when this process exits normally."""
    atexit.register(_release_after_normal_exit)


def _release_after_normal_exit() -> None:
    # After an uncaught error, a rank's peers may still wait in a collective: leave the groups to the
    # process's end (torchtitan destroys its groups after a successful run only, for the same reason).
    if getattr(sys, "last_value", None) is None:
        release_process_groups()


def release_process_groups() -> None:
    """Destroy torch.distributed's groups and drop every handle to them this
    package holds, so that each gloo backend is destroyed, and its worker
    threads joined, while Python still runs.

    A gloo worker thread releases a finished collective's tensors after the
    caller has moved on; if the interpreter is finalizing by then, freeing a
    tensor's Python object from that thread aborts the process ("terminate
    called without an active exception", SIGABRT, after the script's last
    line; torch's bug, docs/architecture.md).
    ``torch.distributed.destroy_process_group`` alone does not prevent it:
    it stops no gloo thread while a layer still holds the group, and the
    model's layers hold theirs (through the :class:`RankGroup` objects
    here) until the very end. Groups a caller made itself and keeps are its
    own to release.
    """
    global _state, _patient_group
    state, _state, _patient_group = _state, None, None
    if state is not None and state is not _SINGLE_PROCESS:
        for rank_group in (state.tensor, state.context, state.data, state.pipeline, state.model,
                           state.embedding, state.data_context):
            rank_group.release()
        # The mesh holds its groups too, and its flattened meshes (made by _build) refer to it and it to them:
        # undone here, the mesh goes with the last reference, without a garbage collection (which at exit
        # would also run other objects' finalizers early, a data loader's timed wait on its workers among them).
        state.mesh._flatten_mapping.clear()
    del state
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def model_parallel_is_initialized() -> bool:
    """Whether the groups were built (and not destroyed since), single-process mode included."""
    return _state is not None


def _current() -> ProcessGroups:
    """The groups built, or the single-process mode where torch.distributed
    runs no world of several ranks.

    Raises:
        ModelParallelNotInitializedError: torch.distributed is initialised
            with more than one rank but the groups are not.
    """
    if _state is not None:
        return _state
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return _SINGLE_PROCESS
    raise ModelParallelNotInitializedError(
        "the model-parallel groups are not initialized: with torch.distributed running, call "
        "fairseq_megatron.parallel.parallel_state.initialize_model_parallel(N) first "
        "(fairseq's tools do this at launch)")


def get_process_groups() -> ProcessGroups:
    """This rank's layout and groups (raises as :func:`_current`)."""
    return _current()


def get_parallel_layout() -> ParallelLayout:
    """The layout of the groups built, or of a single process (all sizes 1)."""
    return _current().layout


def get_device_mesh():
    """The ``DeviceMesh`` the groups were made on (None in a single process)."""
    return _current().mesh


def get_tensor_model_parallel() -> RankGroup:
    """This rank's tensor-parallel group, with its size and this rank's index."""
    return _current().tensor


def get_tensor_model_parallel_group() -> ProcessGroup:
    """The tensor-model-parallel group of this rank (``None`` in a single process)."""
    return _current().tensor.group


def get_context_parallel() -> RankGroup:
    """This rank's context-parallel group, with its size C and this rank's index."""
    return _current().context


def get_context_parallel_group() -> ProcessGroup:
    """The ranks that split this rank's sequences (``None`` in a single process)."""
    return _current().context.group


def get_context_parallel_rank() -> int:
    """This rank's index in its context-parallel group, 0..C-1: which chunks of each sequence it holds."""
    return _current().context.rank


def get_pipeline_model_parallel_group() -> ProcessGroup:
    """This rank's pipeline group: the same tensor part of every stage of one model copy."""
    return _current().pipeline.group


def get_model_parallel_group() -> ProcessGroup:
    """Every rank of this rank's model copy, ``T x P`` ranks."""
    return _current().model.group


def get_embedding_group() -> ProcessGroup:
    """The first and last stage of this rank's pipeline group."""
    return _current().embedding.group


def _data(with_context_parallel: bool) -> RankGroup:
    return _state.data_context if with_context_parallel else _state.data


def get_data_parallel_group(with_context_parallel: bool = False) -> ProcessGroup:
    """The data-parallel group of this rank (``None``: the default group, or a
    single process; fairseq then uses its global group). With
    ``with_context_parallel``, the ``D x C`` ranks of every context shard of
    the data-parallel copies (Megatron-Core's argument): the group over which
    gradients are averaged."""
    return _data(with_context_parallel).group if _state is not None else None


def world_size(group: ProcessGroup) -> int:
    """Number of ranks in ``group``; 1 for ``None`` (a group of one)."""
    return 1 if group is None else dist.get_world_size(group=group)


def rank(group: ProcessGroup) -> int:
    """This process's rank inside ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group=group)


def get_tensor_model_parallel_world_size() -> int:
    """The tensor-model-parallel size T (1 in a single process)."""
    return _current().tensor.size


def get_tensor_model_parallel_rank() -> int:
    """This rank's index in its tensor-model-parallel group, 0..T-1: which model part it holds."""
    return _current().tensor.rank


def get_context_parallel_world_size() -> int:
    """The context-parallel size C (1 in a single process)."""
    return _current().context.size


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    """Number of model copies (1 in a single process); ``D x C`` with
    ``with_context_parallel``."""
    if _state is None:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return _data(with_context_parallel).size


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    """Which model copy this rank belongs to: the data shard it reads; with
    ``with_context_parallel``, its index among the ``D x C`` ranks."""
    if _state is None:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return _data(with_context_parallel).rank


def get_pipeline_model_parallel_world_size() -> int:
    """The number of pipeline stages P (1 in a single process)."""
    return _current().pipeline.size


def get_pipeline_model_parallel_rank() -> int:
    """This rank's stage, 0..P-1 (0 in a single process)."""
    return _current().pipeline.rank


def get_pipeline_model_parallel_ranks() -> List[int]:
    """The global ranks of this rank's pipeline group, in stage order."""
    return list(_current().pipeline_ranks)


def is_pipeline_first_stage() -> bool:
    """Whether this rank holds the first stage (the embeddings)."""
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    """Whether this rank holds the last stage (final layer norm, output projection, loss)."""
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 in this rank's group."""
    group = get_tensor_model_parallel_group()
    return 0 if group is None else dist.get_global_rank(group, 0)


class _DefaultGroup:
    def __repr__(self):
        return "DEFAULT_GROUP"


DEFAULT_GROUP = _DefaultGroup()
"""Sentinel for layer constructors: "this rank's tensor-parallel group"."""


def resolve_tensor_parallel(group) -> RankGroup:
    """What a layer constructor's ``group`` argument means: this rank's
    tensor-parallel group for :data:`DEFAULT_GROUP`, a :class:`RankGroup`
    as it is (e.g. rank ``k`` of ``T`` without a process group), or a
    process group (None: a group of one)."""
    if group is DEFAULT_GROUP:
        return get_tensor_model_parallel()
    if isinstance(group, RankGroup):
        return group
    return RankGroup.of(group)


class SharesProcessGroupsWhenCopied:
    """Mixin for ``nn.Module`` classes that keep a process group (or a
    :class:`RankGroup`) as an attribute.

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
            if isinstance(value, (dist.ProcessGroup, RankGroup)):
                memo[id(value)] = value
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(vars(self), memo))
        return copied

