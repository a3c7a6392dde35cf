"""Tensor-model-parallel building blocks (Megatron-LM terms, fairseq parameter names)."""

from fairseq_megatron.modules.column_parallel_linear import ColumnParallelLinear
from fairseq_megatron.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from fairseq_megatron.modules.model_parallel_multihead_attention import ModelParallelMultiheadAttention
from fairseq_megatron.modules.model_parallel_transformer_decoder_layer import (
    ModelParallelTransformerDecoderLayer,
)
from fairseq_megatron.modules.row_parallel_linear import RowParallelLinear
from fairseq_megatron.modules.vocab_parallel_cross_entropy import vocab_parallel_cross_entropy
from fairseq_megatron.modules.vocab_parallel_embedding import VocabParallelEmbedding

__all__ = [
    "ColumnParallelLinear",
    "ModelParallelMultiheadAttention",
    "ModelParallelTransformerDecoderLayer",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "vocab_parallel_cross_entropy",
]
