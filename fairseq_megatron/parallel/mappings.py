"""Communication at the edges of a tensor-model-parallel region.

One autograd Function per forward/backward pair (Shoeybi et al. 2019, Fig. 3,
the "f" and "g" operators; Megatron-LM ``tensor_parallel/mappings.py``):

=========================================  ===================  ===================
function                                   forward              backward
=========================================  ===================  ===================
copy_to_tensor_model_parallel_region       identity             all-reduce (sum)
reduce_from_tensor_model_parallel_region   all-reduce (sum)     identity
scatter_to_tensor_model_parallel_region    keep own last-dim    all-gather last dim
                                           chunk
gather_from_tensor_model_parallel_region   all-gather last dim  keep own chunk
=========================================  ===================  ===================

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", section 4.2.2; Megatron-LM
``tensor_parallel/mappings.py``) keeps the residual stream split along the
sequence (first, ``T``) dimension between the tensor-parallel blocks, and
replaces each all-reduce by a reduce-scatter plus an all-gather:

=========================================  ===================  ===================
function                                   forward              backward
=========================================  ===================  ===================
scatter_to_sequence_parallel_region        keep own T chunk     all-gather T
gather_from_sequence_parallel_region       all-gather T         reduce-scatter T
                                                                (or keep own chunk)
reduce_scatter_to_sequence_parallel_region reduce-scatter T     all-gather T
=========================================  ===================  ===================

Every function takes the process group explicitly (``None`` = single process)
and is the identity when the group has one rank. Inputs are never modified in
place; collectives run on fresh tensors allocated on the input's device, so
the same code runs with gloo on CPU and NCCL on GPU.
"""

import torch
import torch.distributed as dist

from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.parallel.parallel_state import ProcessGroup


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    if parallel_state.world_size(group) == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def _split_last_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    n = parallel_state.world_size(group)
    if n == 1:
        return x
    if x.size(-1) % n != 0:
        raise ValueError(f"last dimension {x.size(-1)} is not divisible by the group size {n}")
    return x.chunk(n, dim=-1)[parallel_state.rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    n = parallel_state.world_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


def _native_tensor_collectives(group: ProcessGroup) -> bool:
    # NCCL has single-tensor all-gather / reduce-scatter; with gloo we use
    # the list form and all-reduce + narrow (same result, more traffic).
    return dist.get_backend(group) == "nccl"


def _sequence_group_size(x: torch.Tensor, group: ProcessGroup) -> int:
    n = parallel_state.world_size(group)
    if x.size(0) % n != 0:
        raise ValueError(f"sequence length {x.size(0)} is not divisible by the group size {n}")
    return n


def _split_first_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    n = _sequence_group_size(x, group)
    return x.chunk(n, dim=0)[parallel_state.rank(group)].contiguous()


def _gather_first_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    n = parallel_state.world_size(group)
    x = x.contiguous()
    if _native_tensor_collectives(group):
        out = x.new_empty((n * x.size(0),) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=0)


def _reduce_scatter_first_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    n = _sequence_group_size(x, group)
    x = x.contiguous()
    if _native_tensor_collectives(group):
        out = x.new_empty((x.size(0) // n,) + tuple(x.shape[1:]))
        dist.reduce_scatter_tensor(out, x, group=group)
        return out
    return _split_first_dim(_all_reduce(x, group), group)


def all_gather_sequence(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``(T / N, *)`` -> ``(T, *)`` in rank order, without autograd (for
    autograd Functions that gather in their own backward)."""
    return _gather_first_dim(x, group)


def start_all_gather_sequence(x: torch.Tensor, group: ProcessGroup):
    """Start :func:`all_gather_sequence` of ``x`` asynchronously; returns a
    function that waits for it and returns the ``(T, *)`` result, so that
    computation can run in between."""
    n = parallel_state.world_size(group)
    x = x.contiguous()
    if _native_tensor_collectives(group):
        out = x.new_empty((n * x.size(0),) + tuple(x.shape[1:]))
        work = dist.all_gather_into_tensor(out, x, group=group, async_op=True)
        return lambda: (work.wait(), out)[1]
    parts = [torch.empty_like(x) for _ in range(n)]
    work = dist.all_gather(parts, x, group=group, async_op=True)
    return lambda: (work.wait(), torch.cat(parts, dim=0))[1]


def reduce_scatter_sequence(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``(T, *)`` partial sums -> this rank's ``(T / N, *)`` of their sum, without autograd.

    Raises:
        ValueError: T is not divisible by the group size N.
    """
    return _reduce_scatter_first_dim(x, group)


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first_dim(grad, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, to_tensor_parallel_region):
        ctx.group = group
        ctx.to_tensor_parallel_region = to_tensor_parallel_region
        return _gather_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.to_tensor_parallel_region:
            return _reduce_scatter_first_dim(grad, ctx.group), None, None
        return _split_first_dim(grad, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first_dim(grad, ctx.group), None


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Enter a parallel region with a replicated input: ``f`` in the paper.

    Forward is the identity; backward sums the input gradient over the group,
    because every rank's shard of the next layer contributed to it.
    Shape: any; unchanged.
    """
    if parallel_state.world_size(group) == 1:
        return x
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Leave a parallel region by summing partial results: ``g`` in the paper.

    Shape: any; unchanged. Every rank ends with the same (replicated) sum.
    """
    if parallel_state.world_size(group) == 1:
        return x
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Keep this rank's chunk of the last dimension: ``(..., C) -> (..., C / N)``.

    Rank r keeps columns ``[r*C/N, (r+1)*C/N)``. Backward all-gathers.

    Raises:
        ValueError: C is not divisible by the group size N.
    """
    if parallel_state.world_size(group) == 1:
        return x
    return _ScatterToRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Concatenate the shards of the last dimension: ``(..., C / N) -> (..., C)``.

    Rank order along the dimension; every rank gets the full tensor. Backward
    keeps this rank's chunk of the gradient.
    """
    if parallel_state.world_size(group) == 1:
        return x
    return _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Enter the sequence-parallel residual stream: ``(T, *) -> (T / N, *)``.

    The input is replicated; rank r keeps positions ``[r*T/N, (r+1)*T/N)``.
    Backward all-gathers the gradient (every rank then holds the full,
    identical gradient of the replicated input).

    Raises:
        ValueError: T is not divisible by the group size N.
    """
    if parallel_state.world_size(group) == 1:
        return x
    return _ScatterToSequenceRegion.apply(x, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: ProcessGroup, to_tensor_parallel_region: bool = True
) -> torch.Tensor:
    """All-gather sequence shards: ``(T / N, *) -> (T, *)`` in rank order.

    ``to_tensor_parallel_region=True``: the result feeds column-parallel
    layers, whose input gradients are partial sums over the group, so the
    backward reduce-scatters (sums, then keeps this rank's positions); this
    replaces the all-reduce of :func:`copy_to_tensor_model_parallel_region`.
    ``False``: the result feeds replicated computation (the final layer norm),
    whose gradient is already complete on every rank; backward keeps this
    rank's chunk.
    """
    if parallel_state.world_size(group) == 1:
        return x
    return _GatherFromSequenceRegion.apply(x, group, to_tensor_parallel_region)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum partial results over the group and keep this rank's positions:
    ``(T, *)`` partial -> ``(T / N, *)`` complete; replaces the all-reduce of
    :func:`reduce_from_tensor_model_parallel_region`. Backward all-gathers.

    Raises:
        ValueError: T is not divisible by the group size N.
    """
    if parallel_state.world_size(group) == 1:
        return x
    return _ReduceScatterToSequenceRegion.apply(x, group)
