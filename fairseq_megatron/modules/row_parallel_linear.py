"""Row-parallel linear layer (Shoeybi et al. 2019, section 3, Eq. 3)."""

from typing import Callable, Optional

import torch
import torch.nn as nn

from fairseq_megatron.modules import float8
from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from fairseq_megatron.modules.parameter_attributes import KeepsParameterAttributes
from fairseq_megatron.modules.sharding import DeferredInitialisation, divide, init_shard_, new_shard


class RowParallelLinear(KeepsParameterAttributes, nn.Module):
    """``Y = X A + b`` with A split along its input (row) dimension.

    Rank r of N holds ``weight`` of shape ``(out_features, in_features / N)``
    (columns ``[r*in/N, (r+1)*in/N)`` of the full ``(out, in)`` weight). The
    partial products are summed over the group, then the full ``bias``
    (replicated, identical on every rank) is added once. The weight carries
    ``tensor_model_parallel=True, partition_dim=1``, the bias
    ``tensor_model_parallel=False``. ``group`` as in
    :class:`~fairseq_megatron.modules.column_parallel_linear.ColumnParallelLinear`. In a group of one
    the bias is passed to ``F.linear`` itself (one ``addmm``, as in
    ``nn.Linear``, instead of a GEMM and a separate add; docs/benchmarks.md
    has the measurement).

    Shapes: input ``(*, in_features / N)`` with ``input_is_parallel=True``
    (the output of a :class:`ColumnParallelLinear`), else ``(*, in_features)``
    replicated and scattered here; output ``(*, out_features)`` replicated.

    Mirrors Megatron-LM ``tensor_parallel/layers.py:RowParallelLinear``. With
    ``--fp8`` training passes compute the product in float8
    (:mod:`fairseq_megatron.modules.float8`).

    ``initialisation``: where given, the weight on ``meta``, its draw
    queued on it (:mod:`~fairseq_megatron.modules.sharding`); None draws now.

    Raises:
        ValueError: ``in_features`` is not divisible by the group size.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        init_method: Callable[[torch.Tensor], None] = nn.init.xavier_normal_,
        group=parallel_state.DEFAULT_GROUP,
        initialisation: Optional[DeferredInitialisation] = None,
    ):
        super().__init__()
        self.tensor_parallel = parallel_state.resolve_tensor_parallel(group)
        world_size = self.tensor_parallel.size
        self.in_features = in_features
        self.out_features = out_features
        self.in_features_per_partition = divide(in_features, world_size, "input features")
        self.input_is_parallel = input_is_parallel

        self.weight = nn.Parameter(new_shard(out_features, self.in_features_per_partition, initialisation=initialisation))
        init_shard_(self.weight, (out_features, in_features), 1, self.tensor_parallel.rank, world_size, init_method,
                    initialisation)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features))
        else:
            self.register_parameter("bias", None)
        self.set_tensor_parallel_split("weight", 1)
        self.set_tensor_parallel_split("bias", None)

    def forward(self, x: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        """``(*, in / N)`` -> ``(*, out)`` replicated, or with ``sequence_parallel``
        ``(T, *, in / N)`` -> this rank's ``(T / N, *, out)`` sequence shard
        (reduce-scatter instead of all-reduce; the bias gradient, a sum over
        this rank's positions only, is all-reduced in backward)."""
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tensor_parallel.group)
        if self.in_features_per_partition == self.in_features and not sequence_parallel:
            return float8.linear(self, x, self.weight, self.bias)  # a group of one: nothing to reduce
        y = float8.linear(self, x, self.weight)
        bias = self.bias
        if sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tensor_parallel.group)
            if bias is not None:
                bias = copy_to_tensor_model_parallel_region(bias, self.tensor_parallel.group)
        else:
            y = reduce_from_tensor_model_parallel_region(y, self.tensor_parallel.group)
        if bias is not None:
            y = y + bias
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"in_features_per_partition={self.in_features_per_partition}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}"
        )
