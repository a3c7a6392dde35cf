"""One Transformer decoder block with tensor-model-parallel attention and FFN."""

from typing import Optional

import torch.nn as nn
import torch.nn.functional as F
from fairseq import utils
from fairseq.modules import LayerNorm
from torch import Tensor

from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.modules.column_parallel_linear import ColumnParallelLinear
from fairseq_megatron.modules.forward_wrappers import rewrap
from fairseq_megatron.parallel.mappings import copy_to_tensor_model_parallel_region
from fairseq_megatron.modules.model_parallel_multihead_attention import (
    IncrementalState,
    ModelParallelMultiheadAttention,
)
from fairseq_megatron.modules.parameter_attributes import KeepsParameterAttributes
from fairseq_megatron.modules.row_parallel_linear import RowParallelLinear
from fairseq_megatron.modules.sharding import DeferredInitialisation
from fairseq_megatron.parallel.rng_tracker import get_rng_tracker


class ModelParallelTransformerDecoderLayer(KeepsParameterAttributes, nn.Module):
    """Decoder block (self-attention + FFN, no encoder attention).

    Pre-norm (``normalize_before``, as every Megatron arch sets) computes::

        x = x + dropout(self_attn(self_attn_layer_norm(x)))
        x = x + dropout(fc2(activation_dropout(act(fc1(final_layer_norm(x))))))

    ``fc1`` is column-parallel (rank r keeps FFN units ``[r*F/N, (r+1)*F/N)``),
    ``fc2`` row-parallel, so the FFN costs one all-reduce forward and one
    backward (Shoeybi et al. 2019, Fig. 3a). Layer norms and the residual
    stream are replicated. Dropout on the replicated stream uses the default
    generator (same mask on all ranks); activation dropout, on the sharded FFN
    activation, uses the model-parallel stream.

    Same call signature and parameter names as fairseq's
    ``TransformerDecoderLayerBase`` (``models/transformer/transformer_layer.py``),
    so fairseq's ``TransformerDecoderBase`` drives it unchanged.

    Shapes: ``x`` ``(T, B, C)`` -> ``(T, B, C)``. With ``sequence_parallel=True``
    (Korthikanti et al. 2022, section 4.2.2) ``x`` and the output are this
    rank's ``(T / N, B, C)`` sequence shard: layer norms, dropout and residual
    adds run on T / N positions, and each block's all-reduce becomes an
    all-gather before fc1 / q,k,v and a reduce-scatter after fc2 / out_proj.
    Residual dropout then draws from the model-parallel RNG stream, since
    ranks hold different positions.

    ``initialisation``: where given, the attention's and FFN's weights on ``meta``, their draws
    queued on it (:mod:`~fairseq_megatron.modules.sharding`); None draws now.

    Raises:
        ValueError: heads or ``decoder_ffn_embed_dim`` not divisible by the
            model-parallel size.
    """

    def __init__(self, cfg, group=parallel_state.DEFAULT_GROUP,
                 initialisation: Optional[DeferredInitialisation] = None):
        super().__init__()
        tensor_parallel = parallel_state.resolve_tensor_parallel(group)
        self.tensor_parallel = tensor_parallel
        embed_dim = cfg.decoder.embed_dim
        self.embed_dim = embed_dim
        self.normalize_before = cfg.decoder.normalize_before
        self.dropout_p = cfg.dropout
        activation_dropout = cfg.activation_dropout or cfg.relu_dropout or 0.0
        self.activation_dropout_p = activation_dropout
        # fairseq's "gelu" upcasts to fp32 and back (two extra copies of the
        # largest activation); F.gelu computes in fp32 internally on fp16/bf16
        # inputs and rounds once, which gives the same values.
        activation = str(cfg.activation_fn)
        self.activation_fn = F.gelu if activation == "gelu" else utils.get_activation_fn(activation=activation)

        self.self_attn = ModelParallelMultiheadAttention(
            embed_dim, cfg.decoder.attention_heads, dropout=cfg.attention_dropout, group=tensor_parallel,
            initialisation=initialisation,
        )
        self.self_attn_layer_norm = LayerNorm(embed_dim, export=cfg.export)
        self.fc1 = ColumnParallelLinear(embed_dim, cfg.decoder.ffn_embed_dim, group=tensor_parallel,
                                        initialisation=initialisation)
        self.fc2 = RowParallelLinear(cfg.decoder.ffn_embed_dim, embed_dim, group=tensor_parallel,
                                     initialisation=initialisation)
        self.final_layer_norm = LayerNorm(embed_dim, export=cfg.export)
        self.need_attn = False
        self.tag_parameters()  # the layer norms' weights are replicated

    def _dropout(self, x: Tensor, sequence_parallel: bool) -> Tensor:
        if not sequence_parallel or not self.training or self.dropout_p == 0:
            return F.dropout(x, p=self.dropout_p, training=self.training)
        # Each rank holds different positions: draw from the per-rank stream.
        with get_rng_tracker().fork(x.device):
            return F.dropout(x, p=self.dropout_p, training=True)

    def _layer_norm(self, norm: nn.Module, x: Tensor, sequence_parallel: bool) -> Tensor:
        if not sequence_parallel:
            return norm(x)
        # On a sequence shard each rank sees only its positions: the weight and
        # bias gradients are partial sums, all-reduced by the copy's backward.
        weight = copy_to_tensor_model_parallel_region(norm.weight, self.tensor_parallel.group)
        bias = copy_to_tensor_model_parallel_region(norm.bias, self.tensor_parallel.group)
        return F.layer_norm(x, norm.normalized_shape, weight, bias, norm.eps)

    def forward(
        self,
        x: Tensor,
        encoder_out: Optional[Tensor] = None,
        encoder_padding_mask: Optional[Tensor] = None,
        incremental_state: IncrementalState = None,
        prev_self_attn_state=None,
        prev_attn_state=None,
        self_attn_mask: Optional[Tensor] = None,
        self_attn_padding_mask: Optional[Tensor] = None,
        need_attn: bool = False,
        need_head_weights: bool = False,
        sequence_parallel: bool = False,
    ):
        if encoder_out is not None:
            raise NotImplementedError("ModelParallelTransformerDecoderLayer has no encoder attention")

        sp = sequence_parallel
        residual = x
        if self.normalize_before:
            x = self._layer_norm(self.self_attn_layer_norm, x, sp)
        # fairseq's decoder passes its future mask here for full-sequence
        # passes and None for incremental steps (where T = 1 needs no mask).
        x = self.self_attn(
            x,
            attn_mask=self_attn_mask,
            key_padding_mask=self_attn_padding_mask,
            incremental_state=incremental_state,
            is_causal=self_attn_mask is not None,
            sequence_parallel=sp,
        )
        x = residual + self._dropout(x, sp)
        if not self.normalize_before:
            x = self._layer_norm(self.self_attn_layer_norm, x, sp)

        residual = x
        if self.normalize_before:
            x = self._layer_norm(self.final_layer_norm, x, sp)
        x = self.activation_fn(self.fc1(x, sequence_parallel=sp))
        if self.activation_dropout_p > 0 and self.training:
            with get_rng_tracker().fork(x.device):
                x = F.dropout(x, p=self.activation_dropout_p, training=True)
        x = self.fc2(x, sequence_parallel=sp)
        x = residual + self._dropout(x, sp)
        if not self.normalize_before:
            x = self._layer_norm(self.final_layer_norm, x, sp)
        return x, None, None

    def __deepcopy__(self, memo):
        """A copy with its own ``--compile-layers`` / ``--checkpoint-activations``
        wrappers (:func:`~fairseq_megatron.modules.forward_wrappers.rewrap`)."""
        copied = super().__deepcopy__(memo)
        rewrap(copied)
        return copied

    def make_generation_fast_(self, need_attn: bool = False, **kwargs):
        self.need_attn = need_attn
