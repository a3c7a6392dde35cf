"""The gradient norm of a tensor-model-parallel model, every parameter counted once.

fairseq's ``MegatronTrainer.clip_grad_norm``
(``fairseq/model_parallel/megatron_trainer.py``) squares each rank's local
gradient norm, all-reduces the squares over the model-parallel group and
takes the root. The parameters that every rank holds in full (layer norms,
row-parallel biases, learned positions: those tagged
``tensor_model_parallel=False``) then count N times, so at
model-parallel size N the logged ``gnorm`` and the ``--clip-norm``
coefficient differ from those of the same model at size 1. Megatron-LM
counts such a parameter on one rank only (``megatron/core/optimizer/clip_grads.py``,
``param_is_not_tensor_parallel_duplicate``); :func:`model_parallel_norm_aggregator`
gives fairseq's optimizers an ``aggregate_norm_fn`` that does the same.

fairseq's optimizer wrappers compute the local norm over their own copy of
the gradients (a flat fp32 master buffer with ``--fp16``, the fp16 gradients
with ``--memory-efficient-fp16``, fp32 gradients with a pending
``1 / sample_size`` factor in :class:`~fairseq_megatron.training.fused_adam.FusedAdamW`),
but always one scalar times the model's own ``p.grad``. So the aggregator
measures, on the model's gradients, which share of this rank's squared norm
belongs to replicated parameters, and scales that share by ``1 / N`` before
the all-reduce; the scalar cancels. The price, at model-parallel size > 1
only, is one more read of every gradient per step (two multi-tensor norms).
"""

from typing import Callable, Iterable, List

import torch
import torch.distributed as dist
import torch.nn as nn

from fairseq_megatron.parallel import parallel_state


def _squared_norm(grads: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of ``grads`` in fp32 (fp16 loss-scaled gradients would
    overflow a norm kept in fp16), a 0-dim tensor on ``device``."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # a DTensor's shard
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    return torch.stack(norms).square().sum()


def split_grads(parameters: Iterable[nn.Parameter]):
    """``(sharded, replicated, elsewhere)`` lists of this rank's gradients, by
    what each parameter says of itself
    (:mod:`fairseq_megatron.modules.parameter_attributes`): ``shared`` (the
    last pipeline stage's copy of a tied embedding, counted on the first
    stage), else ``tensor_model_parallel`` True or False. Parameters
    without a gradient are skipped.

    Raises:
        ValueError: a parameter that does not say how it is split.
    """
    sharded, replicated, elsewhere = [], [], []
    for p in parameters:
        if p.grad is None:
            continue
        if getattr(p, "shared", False):
            elsewhere.append(p.grad)
        elif not hasattr(p, "tensor_model_parallel"):
            raise ValueError(f"a parameter of shape {tuple(p.shape)} does not say how it is split "
                             f"(no tensor_model_parallel attribute): not one of this package's models")
        else:
            (sharded if p.tensor_model_parallel else replicated).append(p.grad)
    return sharded, replicated, elsewhere


def model_parallel_norm_aggregator(model: nn.Module, group=None,
                                   reduce_group=None) -> Callable[[torch.Tensor], torch.Tensor]:
    """An ``aggregate_norm_fn`` for fairseq's ``optimizer.clip_grad_norm``.

    Call it after the backward pass (it reads ``model``'s gradients). The
    returned function maps this rank's local norm ``L`` (0-dim tensor, any
    float dtype; ``L = c * ||local p.grad||`` for a scalar ``c``) to the norm
    of the whole model, in the same units as ``L``:
    ``sqrt(sum over ranks of L^2 * (S + R / N) / (S + R + E))``, with ``S``,
    ``R`` and ``E`` this rank's squared norms of sharded, replicated and
    ``shared`` gradients (:func:`split_grads`) and ``N`` the size of the
    tensor-model-parallel ``group`` (default: the current one). The sum runs
    over ``reduce_group`` (default: ``group``): with pipeline stages, every
    rank of the model copy, each stage's parameters counted on their stage
    and the last stage's copy of a tied embedding counted on the first.
    Returns fp32.

    Non-finite gradients (fp16 overflow) leave ``L^2`` unscaled, so an
    overflow still shows as an infinite or NaN norm; all-zero gradients give 0.

    With sharded data parallelism the gradients are ``DTensor`` shards over
    the data-parallel ranks: fairseq's ``L`` is then already the norm over
    all shards (a replicated DTensor), and ``S``, ``R`` and ``E`` are summed
    over the shards' group, each element counted once.
    """
    group = parallel_state.resolve_tensor_parallel(group).group
    reduce_group = group if reduce_group is None else reduce_group
    n = parallel_state.world_size(group)
    sharded, replicated, elsewhere = split_grads(model.parameters())
    shards_group = next((g.device_mesh.get_group() for g in sharded + replicated + elsewhere
                         if hasattr(g, "device_mesh")), None)

    def aggregate(local_norm: torch.Tensor) -> torch.Tensor:
        if hasattr(local_norm, "full_tensor"):  # a DTensor: the norm over every shard
            local_norm = local_norm.full_tensor()
        total = local_norm.float().square()
        if n > 1 or elsewhere:
            squares = torch.stack([_squared_norm(grads, total.device) for grads in (sharded, replicated, elsewhere)])
            if shards_group is not None:
                dist.all_reduce(squares, group=shards_group)
            s, r, e = squares
            share = (s + r / n) / (s + r + e)
            total = total * torch.where(torch.isfinite(share), share, torch.ones_like(share))
        if parallel_state.world_size(reduce_group) > 1:
            dist.all_reduce(total, group=reduce_group)
        return total.sqrt()

    return aggregate
