"""Activation checkpointing for model-parallel layers (``--checkpoint-activations``).

fairseq's model-parallel decoder never checkpointed its layers, and fairseq's
own ``checkpoint_wrapper`` restores only the default CPU/CUDA generators on
recompute. Dropout inside a model-parallel region draws from the tracker's
stream (:mod:`fairseq_megatron.rng_tracker`), so the recomputed forward would
drop different units than the original one and the gradients would be wrong.
This wrapper snapshots the tracker before the forward, replays the snapshot
during the recompute and puts the tracker back afterwards (as Megatron-LM's
``tensor_parallel/random.py:CheckpointFunction`` does).
"""

import functools

import torch
import torch.nn as nn
import torch.utils.checkpoint

from fairseq_megatron.rng_tracker import get_rng_tracker


def _checkpointed_forward(original_forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return original_forward(*args, **kwargs)
    tracker = get_rng_tracker()
    snapshot = tracker.get_states()
    calls = 0

    def run(*inputs):
        nonlocal calls
        calls += 1
        if calls == 1:  # the real forward: let the tracker advance
            return original_forward(*inputs, **kwargs)
        current = tracker.get_states()  # recompute: replay, then restore
        tracker.set_states(snapshot)
        try:
            return original_forward(*inputs, **kwargs)
        finally:
            tracker.set_states(current)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)


def checkpoint_wrapper(module: nn.Module) -> nn.Module:
    """Recompute ``module``'s forward during backward instead of storing its activations.

    Replaces ``module.forward`` in place, so parameter names (state-dict keys)
    do not change. Without autograd (eval, generation) it runs normally.
    """
    module.forward = functools.partial(_checkpointed_forward, module.forward)
    return module
