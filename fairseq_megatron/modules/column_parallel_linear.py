"""Column-parallel linear layer (Shoeybi et al. 2019, section 3, Eq. 3)."""

from typing import Callable

import torch
import torch.nn as nn

from fairseq_megatron.modules import float8
from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
)
from fairseq_megatron.modules.parameter_attributes import KeepsParameterAttributes
from fairseq_megatron.modules.sharding import divide, init_shard_, new_shard


def column_parallel_input(x: torch.Tensor, group, sequence_parallel: bool = False) -> torch.Tensor:
    """The input of column-parallel layers as they need it: the replicated
    ``x`` (identity forward, gradient all-reduced over the group), or with
    ``sequence_parallel`` this rank's ``(T / N, ...)`` shard all-gathered to
    ``(T, ...)`` (gradient reduce-scattered)."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, group)
    return copy_to_tensor_model_parallel_region(x, group)


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
    ):
        super().__init__()
        self.tensor_parallel = parallel_state.resolve_tensor_parallel(group)
        world_size = self.tensor_parallel.size
        self.in_features = in_features
        self.out_features = out_features
        self.out_features_per_partition = divide(out_features, world_size, "output features")
        self.gather_output = gather_output

        self.weight = nn.Parameter(new_shard(self.out_features_per_partition, in_features))
        init_shard_(self.weight, (out_features, in_features), 0, self.tensor_parallel.rank, world_size, init_method)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_features_per_partition))
        else:
            self.register_parameter("bias", None)
        self.set_tensor_parallel_split("weight", 0)
        self.set_tensor_parallel_split("bias", 0)

    def forward(self, x: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        """``x`` ``(*, in)`` replicated, or with ``sequence_parallel`` this rank's
        ``(T / N, *, in)`` sequence shard, all-gathered here to ``(T, *, in)``."""
        x = column_parallel_input(x, self.tensor_parallel.group, sequence_parallel)
        y = float8.linear(self, x, self.weight, self.bias)
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.tensor_parallel.group)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"out_features_per_partition={self.out_features_per_partition}, "
            f"bias={self.bias is not None}, gather_output={self.gather_output}"
        )
