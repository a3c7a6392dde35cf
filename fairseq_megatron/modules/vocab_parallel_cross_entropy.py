"""Cross entropy over vocabulary-sharded logits, without gathering them.

Shoeybi et al. 2019, section 3 ("we fuse the output embedding GEMM with the
cross entropy loss"): each rank holds logits for its V/N vocabulary entries;
the loss needs only three all-reduces of (N_tok,) vectors: the max (for
stability), the sum of exponentials, and the target logit (found on exactly
one rank). Mirrors Megatron-LM ``tensor_parallel/cross_entropy.py``, but
never writes into the caller's logits, and saves the logits (not an fp32
softmax) for the backward, which recomputes the softmax.
"""

import torch
import torch.distributed as dist

from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.parallel.parallel_state import ProcessGroup


def _all_reduce_(x: torch.Tensor, group: ProcessGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of a tensor this module allocated itself."""
    if parallel_state.world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _exp_shifted(logits: torch.Tensor, logits_max: torch.Tensor) -> torch.Tensor:
    """``exp(logits_ij - max_i)`` in fp32 (the fp32 max promotes half-precision
    logits): ``(N, V_local)``, ``(N,)`` -> ``(N, V_local)``."""
    return torch.sub(logits, logits_max.unsqueeze(-1)).exp_()


def _sum_exp(logits: torch.Tensor, logits_max: torch.Tensor) -> torch.Tensor:
    """``sum_j exp(logits_ij - max_i)`` in fp32: ``(N, V_local)``, ``(N,)`` -> ``(N,)``."""
    return _exp_shifted(logits, logits_max).sum(dim=-1)


def _logits_grad(logits, logits_max, sum_exp, local_target, valid, grad_loss) -> torch.Tensor:
    """``(softmax_ij - [j == target_i]) * grad_loss_i``, in the logits' dtype.

    The softmax is recomputed from the logits rather than saved from the
    forward: compiled, this is one pass that reads the half-precision logits
    and writes their gradient (no fp32 ``(N, V_local)`` tensor is kept from
    forward to backward); eager, it is a few in-place passes over one fp32
    temporary.
    """
    grad = _exp_shifted(logits, logits_max).div_(sum_exp.unsqueeze(-1))  # softmax, fp32
    columns = torch.arange(logits.size(-1), device=logits.device)
    is_target = (columns == local_target.unsqueeze(-1)) & valid.unsqueeze(-1)  # (N, V_local) bool
    grad.add_(is_target, alpha=-1).mul_(grad_loss.unsqueeze(-1))
    return grad.to(logits.dtype)


_COMPILED = {}


def _maybe_compiled(fn, compiled: bool):
    """``fn`` itself, or its ``torch.compile`` (built once per function; the
    token count may vary between calls)."""
    if not compiled:
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=None)
    return _COMPILED[fn]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, group, compiled):
        # logits: (N_tok, V_local), any float dtype; target: (N_tok,) global ids.
        # All arithmetic is fp32: subtracting the fp32 max promotes
        # half-precision logits, so no separate fp32 copy of them is made.
        v_local = logits.size(-1)
        start = parallel_state.rank(group) * v_local

        logits_max = _all_reduce_(logits.max(dim=-1).values.float(), group, dist.ReduceOp.MAX)

        local_target = target - start
        outside = (local_target < 0) | (local_target >= v_local)
        local_target = local_target.masked_fill(outside, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float() - logits_max
        target_logit = _all_reduce_(target_logit.masked_fill(outside, 0.0), group)

        sum_exp = _all_reduce_(_maybe_compiled(_sum_exp, compiled)(logits, logits_max), group)
        loss = sum_exp.log() - target_logit

        ignored = target.eq(ignore_index) if ignore_index is not None else torch.zeros_like(outside)
        loss = loss.masked_fill(ignored, 0.0)

        ctx.save_for_backward(logits, logits_max, sum_exp, local_target, ~outside, ignored)
        ctx.compiled = compiled
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, logits_max, sum_exp, local_target, valid, ignored = ctx.saved_tensors
        grad_loss = grad_loss.float().masked_fill(ignored, 0.0)
        grad = _maybe_compiled(_logits_grad, ctx.compiled)(logits, logits_max, sum_exp, local_target, valid, grad_loss)
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index=None,
    group=parallel_state.DEFAULT_GROUP,
    compiled: bool = False,
) -> torch.Tensor:
    """Per-token negative log-likelihood (nats) from vocabulary-sharded logits.

    Args:
        logits: ``(*, V / N)``, this rank's vocabulary shard (rank r holds ids
            ``[r*V/N, (r+1)*V/N)``); computed in fp32 whatever the input dtype.
        target: ``(*)`` int64 global token ids, identical on every rank.
        ignore_index: targets equal to it get loss 0 and no gradient.
        group: tensor-model-parallel group (default: this rank's).
        compiled: run the two ``(N, V / N)`` passes (sum of exponentials;
            gradient) through ``torch.compile``, one fused kernel each
            (``--compile-layers``); the first call pays the compilation.

    Returns:
        ``(*)`` fp32 loss, identical on every rank; equals
        ``F.cross_entropy(full_logits, target, reduction="none")``.
    """
    group = parallel_state.resolve_tensor_parallel(group).group
    shape = target.shape
    loss = _VocabParallelCrossEntropy.apply(
        logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index, group, compiled
    )
    return loss.view(shape)
