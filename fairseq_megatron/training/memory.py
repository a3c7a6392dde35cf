"""What one rank holds, counted from its tensors: parameters, gradients,
optimizer state and the activations autograd keeps for the backward pass.

Counted in bytes of the tensors this rank holds (a sharded parameter's local
shard, not the whole tensor), each storage once (a tied weight, a tensor
saved twice). On a GPU the allocator can say more (``torch.cuda.max_memory_allocated``
includes workspaces and fragmentation); these counts are what the parallel
layout decides, the same on any device.
"""

import logging
import resource
import sys
import weakref
from typing import Iterable, List

import torch
import torch.nn as nn

MIB = 2 ** 20

logger = logging.getLogger(__name__)
logger.setLevel(logging.INFO)  # every rank's report: fairseq raises the level on ranks other than 0


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds (a DTensor's local shard)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors`` (their local parts)."""
    seen, total = set(), 0
    for tensor in tensors:
        if tensor is None or not torch.is_tensor(tensor):
            continue
        local = local_tensor(tensor)
        if local.device.type == "meta":
            continue
        storage = local.untyped_storage()
        key = (storage.data_ptr(), local.device)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters on this rank."""
    return tensor_bytes(model.parameters())


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s gradients on this rank (parameters without one count nothing)."""
    return tensor_bytes(p.grad for p in model.parameters())


def optimizer_state_bytes(state: dict) -> int:
    """Bytes of the tensors of an optimizer's ``state`` (torch's
    ``optimizer.state``: ``{parameter: {name: value}}``)."""
    return tensor_bytes(value for entries in state.values() for value in entries.values())


def _optimizers_within(optimizer, depth: int = 4) -> List[object]:
    """The optimizers a fairseq optimizer wraps (its ``optimizer``,
    ``fp32_optimizer``, ``wrapped_optimizer``, ...), outermost first."""
    found = [optimizer]
    if depth:
        for name in ("_optimizer", "optimizer", "fp32_optimizer", "wrapped_optimizer"):
            inner = vars(optimizer).get(name) if hasattr(optimizer, "__dict__") else None
            if inner is not None and inner is not optimizer:
                found += _optimizers_within(inner, depth - 1)
    return found


def fairseq_optimizer_state_bytes(optimizer) -> int:
    """Bytes of the state of a fairseq optimizer (and of those it wraps):
    torch optimizers' ``state`` (Adam's moments) and the fp32 master weights
    of fairseq's ``FP16Optimizer`` (``fp32_params``)."""
    tensors = []
    for inner in _optimizers_within(optimizer):
        if isinstance(inner, torch.optim.Optimizer):
            tensors += [v for entries in inner.state.values() for v in entries.values()]
        masters = getattr(inner, "fp32_params", None) if isinstance(getattr(inner, "__dict__", None), dict) else None
        if torch.is_tensor(masters):
            tensors.append(masters)
        elif isinstance(masters, dict):
            tensors += list(masters.values())
    return tensor_bytes(tensors)


def peak_memory_bytes() -> int:
    """The most memory this process has held: the CUDA allocator's peak on a
    GPU, else the process's peak resident set (Linux counts it in KiB, macOS
    in bytes)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def memory_report(rank: int, model: nn.Module, optimizer) -> str:
    """``memory of rank R: parameters X MiB, gradients Y MiB, optimizer state
    Z MiB``, the bytes of the tensors this rank holds, and the peak device
    (or process) memory."""
    where = "device" if torch.cuda.is_available() and torch.cuda.is_initialized() else "process"
    return (f"memory of rank {rank}: parameters {parameter_bytes(model) / MIB:.2f} MiB, gradients "
            f"{gradient_bytes(model) / MIB:.2f} MiB, optimizer state {fairseq_optimizer_state_bytes(optimizer) / MIB:.2f} "
            f"MiB; peak {where} memory {peak_memory_bytes() / MIB:.0f} MiB")


def log_memory_report(rank: int, model: nn.Module, optimizer) -> None:
    """Log :func:`memory_report` on every rank."""
    logger.info(memory_report(rank, model, optimizer))


class SavedActivations:
    """Bytes of the tensors autograd saves for the backward pass (the
    activations) while this context is open: :attr:`current` and :attr:`peak`.

    Parameters saved by the operations that use them (a linear layer keeps
    its weight) are not activations and are not counted; a storage saved by
    several operations counts once, until the last of them is freed.
    Mirrors what ``torch.autograd.graph.saved_tensors_hooks`` exposes: each
    saved tensor is packed when the forward saves it and freed with the graph
    after the backward pass.
    """

    def __init__(self, model: nn.Module):
        self._parameters = {local_tensor(p).untyped_storage().data_ptr() for p in model.parameters()
                            if local_tensor(p).device.type != "meta"}
        self._holders = {}  # storage key -> number of saved tensors holding it
        self.current = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), tensor.device)
        if storage.data_ptr() in self._parameters or tensor.device.type == "meta":
            return tensor
        if self._holders.get(key, 0) == 0:
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        self._holders[key] = self._holders.get(key, 0) + 1
        held = _Saved(tensor)
        weakref.finalize(held, self._release, key, storage.nbytes())
        return held

    def _release(self, key, nbytes: int) -> None:
        self._holders[key] -= 1
        if self._holders[key] == 0:
            del self._holders[key]
            self.current -= nbytes

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Saved) else held

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


class _Saved:
    """A saved tensor, whose end (when autograd frees the graph) the counter watches."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        # Detached: the same storage without its grad_fn. Holding the tensor
        # itself closes a cycle through autograd's graph (node -> saved
        # tensor -> grad_fn -> node) that Python's garbage collector cannot
        # see; autograd breaks it only when it runs the node without
        # retain_graph, which a split backward (torch.distributed.pipelining's
        # input then weight pass) never does for the nodes of the input path:
        # their activations stayed until the process ended.
        self.tensor = tensor.detach()
