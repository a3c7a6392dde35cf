"""Attention of one context-parallel rank's queries over the keys and
values of the whole sequence.

Each of the ``C`` ranks of a context-parallel group holds ``T / C``
positions of a sequence (:mod:`fairseq_megatron.parallel.context_parallel`).
Its queries attend to the keys and values of all ``T``, all-gathered within
the group (Llama 3's all-gather variant of context parallelism; Dubey et al.
2024, section 3.3.2): exact attention, one all-gather forward.

Kept for the backward pass are this rank's own queries, keys and values and
the mask, not the gathered keys and values: the backward gathers them
again, recomputes the attention and reduce-scatters the gradients of the
keys and values to the ranks that own them. Each rank then holds the
activations of its ``T / C`` positions alone, as in ring attention (Liu et
al. 2023), where keys and values pass each rank by in both passes; the
price is a second all-gather and a second attention forward per layer.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from fairseq_megatron.parallel.context_parallel import gather_keys_and_values
from fairseq_megatron.parallel.parallel_state import ProcessGroup


def additive_mask(attn_mask: Optional[torch.Tensor], key_padding_mask: Optional[torch.Tensor],
                  dtype) -> Optional[torch.Tensor]:
    """One additive mask broadcastable to ``(B, h, T_q, T_k)``, or None, from
    ``attn_mask`` ``(T_q, T_k)`` (bool, True = blocked, or additive) and
    ``key_padding_mask`` ``(B, T_k)`` (bool, True = padding). Blocked keys get
    ``-inf``, padded keys the dtype's lowest finite value, so that a query
    whose keys are all padding averages instead of producing NaN (the rule of
    the tensor-parallel attention's own masks)."""
    mask = None
    if attn_mask is not None:
        mask = attn_mask.to(dtype) if attn_mask.dtype != torch.bool else torch.zeros(
            attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill_(attn_mask, float("-inf"))
    if key_padding_mask is not None:
        pad = torch.zeros(key_padding_mask.shape, dtype=dtype, device=key_padding_mask.device)
        pad = pad.masked_fill_(key_padding_mask.bool(), torch.finfo(dtype).min)[:, None, None, :]  # (B, 1, 1, T_k)
        mask = pad if mask is None else mask + pad
    return mask


def _attend(q, k, v, attn_mask, key_padding_mask, group, heads: int, dropout_p: float):
    k, v = gather_keys_and_values(k, v, group)  # (T, B, H) each
    t, b, _ = k.shape
    k, v = (y.view(t, b, heads, -1).permute(1, 2, 0, 3) for y in (k, v))  # (B, h, T, d)
    mask = additive_mask(attn_mask, key_padding_mask, q.dtype)  # made for this call, not kept
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def _generator_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_generator_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class _AttendToGatheredKeys(torch.autograd.Function):
    """See :func:`attend_to_gathered_keys`."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, key_padding_mask, group, heads, dropout_p):
        ctx.group, ctx.heads, ctx.dropout_p = group, heads, dropout_p
        ctx.generator_state = _generator_state(q.device) if dropout_p > 0 else None  # replayed in the recompute
        ctx.save_for_backward(q, k, v, attn_mask, key_padding_mask)
        # autograd records nothing inside a Function's forward
        return _attend(q, k, v, attn_mask, key_padding_mask, group, heads, dropout_p)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, attn_mask, key_padding_mask = ctx.saved_tensors
        q, k, v = (y.detach().requires_grad_() for y in (q, k, v))
        replay = ctx.generator_state is not None
        devices = [q.device] if q.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=replay), torch.enable_grad():
            if replay:
                _set_generator_state(q.device, ctx.generator_state)
            out = _attend(q, k, v, attn_mask, key_padding_mask, ctx.group, ctx.heads, ctx.dropout_p)
        grad_q, grad_k, grad_v = torch.autograd.grad(out, (q, k, v), grad_out)  # k, v: reduce-scattered
        return grad_q, grad_k, grad_v, None, None, None, None, None


def attend_to_gathered_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                            key_padding_mask: Optional[torch.Tensor], group: ProcessGroup, heads: int,
                            dropout_p: float = 0.0) -> torch.Tensor:
    """Scaled dot-product attention of this rank's queries over the keys and
    values of every rank of the context-parallel ``group`` (see the module
    docstring for what the backward keeps and recomputes).

    Shapes: ``q`` ``(B, h, T / C, d)``, this rank's queries of its ``heads``
    = ``h`` heads; ``k``, ``v`` ``(T / C, B, h x d)``, its keys and values;
    ``attn_mask`` ``(T / C, T)`` (bool, True = blocked: what is kept, one
    byte a pair, shared by the layers; or additive) and ``key_padding_mask``
    ``(B, T)`` (bool, True = padding), or None, whose key axis follows the
    gathered keys' order
    (:meth:`~fairseq_megatron.parallel.context_parallel.ContextSplit.gathered_positions`);
    output ``(B, h, T / C, d)``. Dropout draws from the default generator as
    the caller set it (the backward replays the same draws).
    """
    return _AttendToGatheredKeys.apply(q, k, v, attn_mask, key_padding_mask, group, heads, dropout_p)
