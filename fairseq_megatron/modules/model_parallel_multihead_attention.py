"""Self-attention with heads split across the tensor-model-parallel group."""

from typing import Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq.incremental_decoding_utils import with_incremental_state
from torch import Tensor

from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.errors import UsageError
from fairseq_megatron.modules.column_parallel_linear import ColumnParallelLinear, column_parallel_product
from fairseq_megatron.modules.parameter_attributes import KeepsParameterAttributes
from fairseq_megatron.modules.row_parallel_linear import RowParallelLinear
from fairseq_megatron.modules.sharding import DeferredInitialisation, divide
from fairseq_megatron.modules.context_parallel_attention import attend_to_gathered_keys
from fairseq_megatron.parallel.rng_tracker import get_rng_tracker

IncrementalState = Optional[Dict[str, Dict[str, Optional[Tensor]]]]


@with_incremental_state
class ModelParallelMultiheadAttention(KeepsParameterAttributes, nn.Module):
    """Causal self-attention; rank r of N computes heads ``[r*H/N, (r+1)*H/N)``.

    ``q_proj``, ``k_proj``, ``v_proj`` are column-parallel (each rank produces
    the queries/keys/values of its local heads), ``out_proj`` is row-parallel
    (partial outputs summed over the group): one all-reduce in forward, one in
    backward (Shoeybi et al. 2019, section 3, Fig. 3b). Parameter names and
    per-rank shapes are those of fairseq's
    ``model_parallel/modules/multihead_attention.py``, so published part files
    load unchanged.

    Attention itself is ``F.scaled_dot_product_attention`` (flash/memory-
    efficient kernels on GPU); attention dropout draws from the model-parallel
    RNG stream because its input is sharded by head.

    Shapes: ``x`` ``(T, B, C)``; output ``(T, B, C)``, replicated. With
    ``sequence_parallel=True`` (training only) input and output are this
    rank's ``(T / N, B, C)`` sequence shard: the input is all-gathered before
    the q/k/v projection and the output reduce-scattered
    (Korthikanti et al. 2022, section 4.2.2).
    ``is_causal=True`` promises that ``attn_mask`` is the usual future mask.
    ``attn_mask`` ``(T, T_k)`` additive float (``-inf`` = blocked) or bool
    (True = blocked), ``key_padding_mask`` ``(B, T_k)`` bool (True = pad).

    Incremental decoding keeps, per layer and rank, keys and values of the
    local heads, ``(B, H/N, T_past, D)``, in ``incremental_state``.

    Context parallelism (:attr:`context_parallel` of ``C`` ranks, set by
    :func:`~fairseq_megatron.training.context_parallel.apply_context_parallel`):
    ``x`` holds this rank's ``T / C`` positions, whose queries attend to the
    keys and values of all ``T``, all-gathered within the group
    (:func:`~fairseq_megatron.modules.context_parallel_attention.attend_to_gathered_keys`);
    ``attn_mask`` ``(T / C, T)`` and ``key_padding_mask`` ``(B, T)`` follow
    the gathered keys' order. Not in incremental decoding.

    ``initialisation``: where given, the projections' weights on ``meta``, their draws
    queued on it (:mod:`~fairseq_megatron.modules.sharding`); None draws now.

    Raises:
        UsageError (a ValueError): ``embed_dim`` not divisible by
            ``num_heads``, or ``num_heads`` not divisible by the model-parallel size.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        group=parallel_state.DEFAULT_GROUP,
        initialisation: Optional[DeferredInitialisation] = None,
    ):
        super().__init__()
        self.tensor_parallel = parallel_state.resolve_tensor_parallel(group)
        world_size = self.tensor_parallel.size
        self.embed_dim = embed_dim
        self.num_heads = num_heads  # total, as fairseq's TransformerDecoderLayer expects
        if embed_dim % num_heads != 0:
            raise UsageError(f"embedding dim {embed_dim} is not divisible by the {num_heads} attention heads")
        self.head_dim = embed_dim // num_heads
        self.num_heads_partition = divide(num_heads, world_size, "number of attention heads")
        self.dropout_p = dropout

        built = dict(bias=bias, group=self.tensor_parallel, initialisation=initialisation)
        self.k_proj = ColumnParallelLinear(embed_dim, embed_dim, **built)
        self.v_proj = ColumnParallelLinear(embed_dim, embed_dim, **built)
        self.q_proj = ColumnParallelLinear(embed_dim, embed_dim, **built)
        self.out_proj = RowParallelLinear(embed_dim, embed_dim, **built)

    context_parallel = parallel_state.RankGroup()
    """The ranks that split the sequence (context parallelism): a group of
    one, or set on the module by training's ``apply_context_parallel``."""

    def _project_qkv(self, x: Tensor, sequence_parallel: bool = False):
        """Queries, keys and values of the local heads with one GEMM.

        The three column-parallel weights are concatenated at run time,
        ``(3 * C / N, C)``, so the state dict keeps fairseq's separate
        ``q_proj``/``k_proj``/``v_proj`` keys while the GPU runs a single
        larger matrix multiply (the copy is ``3 C^2 / N`` elements per call,
        small next to the ``T * B * 3 C^2 / N`` multiply-adds it feeds).
        Returns three ``(T, B, C / N)`` views. With ``sequence_parallel``, ``x``
        is this rank's ``(T / N, B, C)`` sequence shard, all-gathered for the
        product and kept as the shard for the backward
        (:func:`~fairseq_megatron.modules.column_parallel_linear.column_parallel_product`).
        """
        projections = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([p.weight for p in projections])
        bias = torch.cat([p.bias for p in projections]) if self.q_proj.bias is not None else None
        # in float8 with --fp8 (modules/float8.py)
        qkv = column_parallel_product(self, x, weight, bias, self.tensor_parallel.group, sequence_parallel)
        return qkv.split(self.q_proj.out_features_per_partition, dim=-1)

    def _heads(self, x: Tensor) -> Tensor:
        t, b, _ = x.shape
        return x.view(t, b, self.num_heads_partition, self.head_dim).permute(1, 2, 0, 3)  # (B, H/N, T, D)

    def forward(
        self,
        x: Tensor,
        attn_mask: Optional[Tensor] = None,
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: IncrementalState = None,
        is_causal: bool = False,
        sequence_parallel: bool = False,
    ) -> Tensor:
        q, k, v = self._project_qkv(x, sequence_parallel)
        if self.context_parallel.size > 1 and incremental_state is None:
            out = self._context_parallel_attention(q, k, v, attn_mask, key_padding_mask)
            return self.out_proj(out, sequence_parallel=sequence_parallel)
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        bsz, tgt_len = q.size(0), q.size(2)

        if incremental_state is not None:
            cache = self.get_incremental_state(incremental_state, "attn_state") or {}
            if "prev_key" in cache:
                k = torch.cat([cache["prev_key"], k], dim=2)
                v = torch.cat([cache["prev_value"], v], dim=2)
                prev_pad = cache.get("prev_key_padding_mask")
                if prev_pad is not None or key_padding_mask is not None:
                    past = k.size(2) - tgt_len
                    if prev_pad is None:
                        prev_pad = key_padding_mask.new_zeros(bsz, past)
                    if key_padding_mask is None:
                        key_padding_mask = prev_pad.new_zeros(bsz, tgt_len)
                    key_padding_mask = torch.cat([prev_pad, key_padding_mask], dim=1)
            new_cache = {"prev_key": k, "prev_value": v}
            if key_padding_mask is not None:
                new_cache["prev_key_padding_mask"] = key_padding_mask
            self.set_incremental_state(incremental_state, "attn_state", new_cache)

        dropout_p = self.dropout_p if self.training else 0.0
        # The plain causal case (training, eval-lm) takes SDPA's is_causal path,
        # which lets the GPU use flash attention; anything else gets an explicit mask.
        use_is_causal = is_causal and key_padding_mask is None and k.size(2) == tgt_len
        mask = None if use_is_causal else _combine_masks(attn_mask, key_padding_mask, q.dtype)

        if dropout_p > 0:  # dropout on the local heads draws from this rank's stream
            with get_rng_tracker().fork(x.device):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                     is_causal=use_is_causal)
        else:  # nothing drawn, no generator swap (under --compile-layers each swap breaks the graph)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=use_is_causal)

        out = out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, self.num_heads_partition * self.head_dim)
        return self.out_proj(out, sequence_parallel=sequence_parallel)  # (T, B, C) or (T / N, B, C)

    def _context_parallel_attention(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                                    key_padding_mask: Optional[Tensor]) -> Tensor:
        """This rank's ``T / C`` queries over the keys and values of all ``T``
        positions of the context-parallel group: ``(T / C, B, C / N)`` each ->
        ``(T / C, B, C / N)``. Masks as in :meth:`forward`."""
        tgt_len, bsz, _ = q.shape
        dropout_p = self.dropout_p if self.training else 0.0
        inputs = (self._heads(q), k, v, attn_mask, key_padding_mask, self.context_parallel.group,
                  self.num_heads_partition)
        if dropout_p > 0:  # dropout on the local heads draws from this rank's stream
            with get_rng_tracker().fork(q.device):
                out = attend_to_gathered_keys(*inputs, dropout_p)
        else:
            out = attend_to_gathered_keys(*inputs)
        return out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, self.num_heads_partition * self.head_dim)

    def reorder_incremental_state(self, incremental_state: IncrementalState, new_order: Tensor):
        """Select batch rows of the key/value cache (beam search)."""
        cache = self.get_incremental_state(incremental_state, "attn_state")
        if cache is not None:
            cache = {k: v.index_select(0, new_order) for k, v in cache.items() if v is not None}
            self.set_incremental_state(incremental_state, "attn_state", cache)


def _combine_masks(attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], dtype) -> Optional[Tensor]:
    """One additive mask broadcastable to ``(B, H, T, T_k)``, or None.

    Padded keys get the dtype's lowest finite value rather than ``-inf``, so a
    query whose keys are all padding (left-padded prompts) averages instead of
    producing NaN that would leak into later layers.
    """
    mask = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(
                attn_mask, float("-inf")
            )
        mask = attn_mask.to(dtype)  # (T, T_k)
    if key_padding_mask is not None:
        pad = torch.zeros(key_padding_mask.shape, dtype=dtype, device=key_padding_mask.device)
        pad = pad.masked_fill(key_padding_mask.bool(), torch.finfo(dtype).min)[:, None, None, :]  # (B, 1, 1, T_k)
        mask = pad if mask is None else mask + pad
    return mask
