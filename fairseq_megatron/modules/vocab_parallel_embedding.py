"""Vocabulary-parallel token embedding (Shoeybi et al. 2019, section 3, "input embedding")."""

from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.parallel.mappings import reduce_from_tensor_model_parallel_region
from fairseq_megatron.modules.parameter_attributes import KeepsParameterAttributes
from fairseq_megatron.modules.sharding import DeferredInitialisation, divide, init_shard_, new_shard


def vocab_range(vocab_size: int, rank: int, world_size: int):
    """``[start, end)`` of the token ids held by ``rank``: contiguous blocks of
    ``vocab_size / world_size`` rows, rank 0 first."""
    per_partition = divide(vocab_size, world_size, "padded vocabulary size")
    return rank * per_partition, (rank + 1) * per_partition


def fairseq_embedding_init(embedding_dim: int, padding_idx: Optional[int]) -> Callable:
    """fairseq's token-embedding init: N(0, embedding_dim ** -0.5), padding row zero."""

    def init(weight: torch.Tensor) -> None:
        nn.init.normal_(weight, mean=0.0, std=embedding_dim ** -0.5)
        if padding_idx is not None:
            nn.init.zeros_(weight[padding_idx])

    return init


class VocabParallelEmbedding(KeepsParameterAttributes, nn.Module):
    """Token embedding whose vocabulary is split across the tensor-model-parallel group.

    Rank r of N holds ``weight`` of shape ``(V / N, C)``: rows
    ``[r*V/N, (r+1)*V/N)`` of the full ``(V, C)`` table (V = padded
    vocabulary), tagged ``tensor_model_parallel=True, partition_dim=0``.
    Each rank looks up the ids it owns, writes zeros for the others, and the
    group sums the results.

    Shapes: ``tokens`` ``(B, T)`` int64, replicated; output ``(B, T, C)``,
    replicated. The same weight serves as the vocab-parallel output
    projection (logits ``(B, T, V / N)`` per rank).

    ``padding_idx`` behaves as in ``nn.Embedding``: its row starts at zero
    and gets no gradient. Mirrors Megatron-LM
    ``tensor_parallel/layers.py:VocabParallelEmbedding``.

    ``initialisation``: where given, the weight on ``meta``, its draw
    queued on it (:mod:`~fairseq_megatron.modules.sharding`); None draws now.

    Raises:
        ValueError: ``num_embeddings`` is not divisible by the group size.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        init_method: Optional[Callable[[torch.Tensor], None]] = None,
        group=parallel_state.DEFAULT_GROUP,
        initialisation: Optional[DeferredInitialisation] = None,
    ):
        super().__init__()
        self.tensor_parallel = parallel_state.resolve_tensor_parallel(group)
        world_size = self.tensor_parallel.size
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx  # fairseq's decoder reads this (global id)
        self.vocab_start_index, self.vocab_end_index = vocab_range(
            num_embeddings, self.tensor_parallel.rank, world_size
        )
        if padding_idx is not None and self.vocab_start_index <= padding_idx < self.vocab_end_index:
            self._local_padding_idx = padding_idx - self.vocab_start_index
        else:
            self._local_padding_idx = None

        self.weight = nn.Parameter(new_shard(self.vocab_end_index - self.vocab_start_index, embedding_dim,
                                           initialisation=initialisation))
        init_shard_(
            self.weight, (num_embeddings, embedding_dim), 0, self.tensor_parallel.rank, world_size,
            init_method or fairseq_embedding_init(embedding_dim, padding_idx), initialisation,
        )
        self.set_tensor_parallel_split("weight", 0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tensor_parallel.size == 1:
            return F.embedding(tokens, self.weight, self._local_padding_idx)
        outside = (tokens < self.vocab_start_index) | (tokens >= self.vocab_end_index)
        local_ids = (tokens - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, self._local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(out, self.tensor_parallel.group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, "
            f"vocab_range=[{self.vocab_start_index}, {self.vocab_end_index})"
        )
