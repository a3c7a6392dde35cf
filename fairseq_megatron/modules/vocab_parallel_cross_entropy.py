"""Cross entropy over vocabulary-sharded logits, without gathering them.

Shoeybi et al. 2019, section 3 ("we fuse the output embedding GEMM with the
cross entropy loss"): each rank holds logits for its V/N vocabulary entries;
the loss needs only three all-reduces of (N_tok,) vectors: the max (for
stability), the sum of exponentials, and the target logit (found on exactly
one rank). Mirrors Megatron-LM ``tensor_parallel/cross_entropy.py``, but
never writes into the caller's logits.
"""

import torch
import torch.distributed as dist

from fairseq_megatron import parallel_state
from fairseq_megatron.parallel_state import ProcessGroup


def _all_reduce_(x: torch.Tensor, group: ProcessGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of a tensor this module allocated itself."""
    if parallel_state.world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, group):
        # logits: (N_tok, V_local) fp32; target: (N_tok,) global ids
        v_local = logits.size(-1)
        start = parallel_state.rank(group) * v_local

        logits_max = _all_reduce_(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)

        local_target = target - start
        outside = (local_target < 0) | (local_target >= v_local)
        local_target = local_target.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = _all_reduce_(target_logit.masked_fill(outside, 0.0), group)

        exp = shifted.exp()
        sum_exp = _all_reduce_(exp.sum(dim=-1), group)
        loss = sum_exp.log() - target_logit

        ignored = target.eq(ignore_index) if ignore_index is not None else torch.zeros_like(outside)
        loss = loss.masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))  # exp is ours: reuse its memory
        ctx.save_for_backward(softmax, local_target, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside, ignored = ctx.saved_tensors
        # d loss_i / d logit_ij = softmax_ij - [j == target_i]
        grad = softmax.clone()
        rows = torch.arange(grad.size(0), device=grad.device)
        grad[rows, local_target] -= (~outside).to(grad.dtype)
        scale = grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)
        return grad * scale, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index=None,
    group=parallel_state.DEFAULT_GROUP,
) -> torch.Tensor:
    """Per-token negative log-likelihood (nats) from vocabulary-sharded logits.

    Args:
        logits: ``(*, V / N)``, this rank's vocabulary shard (rank r holds ids
            ``[r*V/N, (r+1)*V/N)``); computed in fp32 whatever the input dtype.
        target: ``(*)`` int64 global token ids, identical on every rank.
        ignore_index: targets equal to it get loss 0 and no gradient.
        group: tensor-model-parallel group (default: this rank's).

    Returns:
        ``(*)`` fp32 loss, identical on every rank; equals
        ``F.cross_entropy(full_logits, target, reduction="none")``.
    """
    group = parallel_state.resolve_group(group)
    shape = target.shape
    loss = _VocabParallelCrossEntropy.apply(
        logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1), ignore_index, group
    )
    return loss.view(shape)
