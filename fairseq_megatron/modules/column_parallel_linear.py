"""Column-parallel linear layer (Shoeybi et al. 2019, section 3, Eq. 3)."""

from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fairseq_megatron.modules import float8
from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.parallel.mappings import (
    all_gather_sequence,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_scatter_sequence,
    start_all_gather_sequence,
)
from fairseq_megatron.modules.parameter_attributes import KeepsParameterAttributes
from fairseq_megatron.modules.sharding import DeferredInitialisation, divide, init_shard_, new_shard


def column_parallel_input(x: torch.Tensor, group, sequence_parallel: bool = False) -> torch.Tensor:
    """The input of column-parallel layers as they need it: the replicated
    ``x`` (identity forward, gradient all-reduced over the group), or with
    ``sequence_parallel`` this rank's ``(T / N, ...)`` shard all-gathered to
    ``(T, ...)`` (gradient reduce-scattered)."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, group)
    return copy_to_tensor_model_parallel_region(x, group)


class _LinearOfGatheredSequence(torch.autograd.Function):
    """``Y = all_gather(X) A^T + b`` for this rank's sequence shard ``X``
    ``(T / N, *, in)``: the product of the whole ``(T, *, in)`` input, of
    which only the shard is kept for the backward, where it is all-gathered
    again for the weight's gradient while the input's gradient is computed,
    and that gradient reduce-scattered back to the shard (Korthikanti et al.
    2022, section 4.2.2; Megatron-Core's
    ``LinearWithGradAccumulationAndAsyncCommunication``). Under autocast the
    operands are cast to its dtype first, as ``F.linear`` would."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        device = x.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        with torch.autocast(device, enabled=False):
            return F.linear(all_gather_sequence(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gathered = start_all_gather_sequence(x, ctx.group)
        grad_input = grad.matmul(weight)  # (T, *, in), while the input is gathered
        rows = grad.flatten(0, -2)  # (T * B, out)
        grad_weight = rows.t().matmul(gathered().flatten(0, -2))
        grad_bias = rows.sum(0) if ctx.has_bias else None
        return reduce_scatter_sequence(grad_input, ctx.group), grad_weight, grad_bias, None


def column_parallel_product(module: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias, group,
                            sequence_parallel: bool = False) -> torch.Tensor:
    """``Y = X A^T + b`` of column-parallel weights ``A`` ``(out / N, in)``
    for ``module``'s forward: ``x`` replicated ``(*, in)`` (its gradient
    all-reduced), or with ``sequence_parallel`` this rank's ``(T / N, *, in)``
    shard, all-gathered for the product and kept as the shard
    (:class:`_LinearOfGatheredSequence`); with ``--fp8`` training the
    gathered input goes to the float8 product, which keeps its own operands.
    Output ``(T, *, out / N)``."""
    if sequence_parallel and parallel_state.world_size(group) > 1 and not float8.active(module):
        return _LinearOfGatheredSequence.apply(x, weight, bias, group)
    return float8.linear(module, column_parallel_input(x, group, sequence_parallel), weight, bias)


class ColumnParallelLinear(KeepsParameterAttributes, nn.Module):
    """``Y = X A + b`` with A split along its output (column) dimension.

    Rank r of N holds ``weight`` of shape ``(out_features / N, in_features)``
    (rows ``[r*out/N, (r+1)*out/N)`` of the full ``(out, in)`` weight) and the
    matching slice of ``bias``; both carry ``tensor_model_parallel=True,
    partition_dim=0`` (:mod:`~fairseq_megatron.modules.parameter_attributes`).
    ``group``: this rank's tensor-parallel group (default), a process group,
    or a :class:`~fairseq_megatron.parallel.parallel_state.RankGroup` (rank
    ``k`` of ``T`` without a process group builds that rank's shard, e.g.
    on the ``meta`` device).

    Shapes: input ``(*, in_features)`` replicated on all ranks; output
    ``(*, out_features / N)`` (this rank's columns), or ``(*, out_features)``
    on every rank with ``gather_output=True``.

    Mirrors Megatron-LM ``tensor_parallel/layers.py:ColumnParallelLinear`` and
    fairscale ``nn/model_parallel/layers.py``. With ``--fp8`` training passes
    compute the product in float8 (:mod:`fairseq_megatron.modules.float8`).

    ``initialisation``: where given, the weight on ``meta``, its draw
    queued on it (:mod:`~fairseq_megatron.modules.sharding`); None draws now.

    Raises:
        ValueError: ``out_features`` is not divisible by the group size.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        init_method: Callable[[torch.Tensor], None] = nn.init.xavier_normal_,
        group=parallel_state.DEFAULT_GROUP,
        initialisation: Optional[DeferredInitialisation] = None,
    ):
        super().__init__()
        self.tensor_parallel = parallel_state.resolve_tensor_parallel(group)
        world_size = self.tensor_parallel.size
        self.in_features = in_features
        self.out_features = out_features
        self.out_features_per_partition = divide(out_features, world_size, "output features")
        self.gather_output = gather_output

        self.weight = nn.Parameter(new_shard(self.out_features_per_partition, in_features, initialisation=initialisation))
        init_shard_(self.weight, (out_features, in_features), 0, self.tensor_parallel.rank, world_size, init_method,
                    initialisation)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_features_per_partition))
        else:
            self.register_parameter("bias", None)
        self.set_tensor_parallel_split("weight", 0)
        self.set_tensor_parallel_split("bias", 0)

    def forward(self, x: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        """``x`` ``(*, in)`` replicated, or with ``sequence_parallel`` this rank's
        ``(T / N, *, in)`` sequence shard, all-gathered here to ``(T, *, in)``
        (:func:`column_parallel_product`)."""
        y = column_parallel_product(self, x, self.weight, self.bias, self.tensor_parallel.group, sequence_parallel)
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.tensor_parallel.group)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"out_features_per_partition={self.out_features_per_partition}, "
            f"bias={self.bias is not None}, gather_output={self.gather_output}"
        )
