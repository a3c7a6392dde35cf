"""Tensor-model-parallel and data-parallel process groups, in one place.

The groups themselves are created and owned by
``fairscale.nn.model_parallel.initialize`` (the layout Megatron-LM uses:
model-parallel groups are blocks of consecutive ranks, data-parallel groups
stride across them). This module adds what fairscale leaves out:

* a clear error when the world size is not divisible by the model-parallel
  size (fairscale silently shrinks the size to the world size);
* a *single-process* mode: when torch.distributed was never initialised and a
  layer asks for its group, it gets ``None`` and a world size of 1, so a
  model-parallel-size-1 model runs in a plain Python process (fairseq does not
  initialise torch.distributed for single-process runs).

Layers take the group at construction time (default: :func:`get_tensor_model_parallel_group`)
and pass it to the communication functions in
:mod:`fairseq_megatron.parallel.mappings`; nothing deeper reads globals.
"""

import copy
from typing import Optional

import torch.distributed as dist
from fairscale.nn.model_parallel import initialize as _fs

from fairseq_megatron.errors import UsageError

ProcessGroup = Optional[dist.ProcessGroup]


class ModelParallelNotInitializedError(RuntimeError):
    """Raised when a model-parallel size > 1 is used before the groups exist."""


def initialize_model_parallel(model_parallel_size: int) -> None:
    """Split the default process group into tensor-model-parallel and data-parallel groups.

    With world size W and model-parallel size M, ranks ``[k*M, (k+1)*M)`` form
    model-parallel group k (one model part each), and ranks ``{r, r+M, ...}``
    form the data-parallel groups (mirrors Megatron-LM's
    ``mpu.initialize_model_parallel``; see fairscale ``initialize.py``).

    Raises:
        ModelParallelNotInitializedError: torch.distributed is not initialised.
        UsageError: ``model_parallel_size`` < 1 or W is not divisible by it.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ModelParallelNotInitializedError(
            "torch.distributed is not initialized: launch with torchrun (or "
            "--distributed-world-size) before using --model-parallel-size"
        )
    world_size = dist.get_world_size()
    if model_parallel_size < 1 or world_size % model_parallel_size != 0:
        raise UsageError(
            f"world size {world_size} is not divisible by --model-parallel-size "
            f"{model_parallel_size}"
        )
    _fs.initialize_model_parallel(model_parallel_size)


def destroy_model_parallel() -> None:
    """Forget the groups (tests use this to re-initialise in one process)."""
    _fs.destroy_model_parallel()


def model_parallel_is_initialized() -> bool:
    """Whether :func:`initialize_model_parallel` has built the groups (and they were not destroyed)."""
    return _fs.model_parallel_is_initialized()


def get_tensor_model_parallel_group() -> ProcessGroup:
    """The tensor-model-parallel group of this rank.

    Returns ``None`` in single-process mode (torch.distributed not
    initialised), meaning "a group of one".

    Raises:
        ModelParallelNotInitializedError: torch.distributed is initialised
            with more than one rank but the model-parallel groups are not.
            (With one rank the group of one is returned as ``None``.)
    """
    if _fs.model_parallel_is_initialized():
        return _fs.get_model_parallel_group()
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    raise ModelParallelNotInitializedError(
        "model parallel group is not initialized: with torch.distributed running, "
        "call fairseq_megatron.parallel.parallel_state.initialize_model_parallel(N) first "
        "(fairseq does this when --model-parallel-size > 1)"
    )


def get_data_parallel_group() -> ProcessGroup:
    """The data-parallel group of this rank (``None`` = the default group or a single process)."""
    if _fs.model_parallel_is_initialized():
        return _fs.get_data_parallel_group()
    return None


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
    """The model-parallel size N (1 in a single process)."""
    return world_size(get_tensor_model_parallel_group())


def get_tensor_model_parallel_rank() -> int:
    """This rank's index in its tensor-model-parallel group, 0..N-1: which model part it holds."""
    return rank(get_tensor_model_parallel_group())


def get_data_parallel_world_size() -> int:
    """Number of model copies, world size / N (1 in a single process)."""
    return world_size(get_data_parallel_group())


def get_data_parallel_rank() -> int:
    """Which model copy this rank belongs to: the data shard it reads."""
    return rank(get_data_parallel_group())


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
