"""Activation checkpointing (``--checkpoint-activations``) of model-parallel decoder layers.

fairseq's model-parallel decoder never checkpointed its layers, and fairseq's
own ``checkpoint_wrapper`` restores only the default CPU/CUDA generators on
recompute. Dropout inside a model-parallel region draws from the tracker's
stream (:mod:`fairseq_megatron.parallel.rng_tracker`), so the recomputed forward would
drop different units than the original one and the gradients would be wrong.
This wrapper snapshots the tracker before the forward, replays the snapshot
during the recompute and puts the tracker back afterwards (as Megatron-LM's
``tensor_parallel/random.py:CheckpointFunction`` does).

``--offload-activations`` (fairseq's flag; it implies checkpointing) keeps
what checkpointing stores of each layer, its input, in host memory from the
layer's forward to its recompute, as fairseq's
``checkpoint_wrapper(offload_to_cpu=True)``
(``fairseq/modules/checkpoint_activations.py``) does for its own layers.
"""

import functools
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.utils.checkpoint

from fairseq_megatron.modules.forward_wrappers import record_wrapper
from fairseq_megatron.parallel.rng_tracker import get_rng_tracker


def _checkpointed_forward(original_forward, offload_to_cpu, *args, **kwargs):
    if not torch.is_grad_enabled():
        return original_forward(*args, **kwargs)
    tracker = get_rng_tracker()
    snapshot = tracker.get_states()
    calls = 0
    if offload_to_cpu:
        stored = _InputsInHostMemory(args)
        args = stored.device_hints

    def run(*inputs):
        nonlocal calls
        calls += 1
        if offload_to_cpu:
            inputs = stored.take_forward_inputs() if calls == 1 else stored.copies_on_device()
        if calls == 1:  # the real forward: let the tracker advance
            return original_forward(*inputs, **kwargs)
        current = tracker.get_states()  # recompute: replay, then restore
        tracker.set_states(snapshot)
        try:
            return original_forward(*inputs, **kwargs)
        finally:
            tracker.set_states(current)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)


class _HostCopy(NamedTuple):
    tensor: torch.Tensor  # in host memory
    device: torch.device  # the original's
    requires_grad: bool  # the original's

    @classmethod
    def of(cls, t: torch.Tensor) -> "_HostCopy":
        """``t`` copied to host memory; pinned when ``t`` is on a GPU, so the copy is asynchronous."""
        host = torch.empty_like(t, device="cpu", pin_memory=t.is_cuda)
        return cls(host.copy_(t.detach(), non_blocking=t.is_cuda), t.device, t.requires_grad)

    def on_device(self) -> torch.Tensor:
        return self.tensor.to(self.device, non_blocking=True).requires_grad_(self.requires_grad)


class _InputsInHostMemory:
    """A checkpointed call's positional arguments with their tensors copied
    to host memory (pinned for GPU tensors: both copies run asynchronously).

    The forward takes the originals once (:meth:`take_forward_inputs`); from
    then on only the host copies are held, and the recompute gets device
    copies with the originals' ``requires_grad`` (so that it stores what the
    forward stored).

    ``device_hints``, a zero-size tensor on each input tensor's device, go to
    ``torch.utils.checkpoint`` in place of the inputs: the non-reentrant
    checkpoint keeps its arguments alive until the recompute, and from its
    arguments' devices it learns which generators to stash and replay and
    which autocast to re-enter."""

    def __init__(self, args):
        self._forward_inputs = args
        self._stored = [_HostCopy.of(a) if torch.is_tensor(a) else a for a in args]
        self.device_hints = tuple(torch.empty(0, device=a.device) for a in args if torch.is_tensor(a))

    def take_forward_inputs(self):
        args, self._forward_inputs = self._forward_inputs, None
        return args

    def copies_on_device(self):
        return tuple(a.on_device() if isinstance(a, _HostCopy) else a for a in self._stored)


def checkpoint_wrapper(module: nn.Module, offload_to_cpu: bool = False) -> nn.Module:
    """Recompute ``module``'s forward during backward instead of storing its activations.

    Replaces ``module.forward`` in place (wrapping whatever it is now, e.g. a
    compiled forward), so parameter names (state-dict keys) do not change.
    Without autograd (eval, generation) it runs normally.

    ``offload_to_cpu``: the only tensors kept per call, its positional
    tensor inputs (for a decoder layer its input ``(T, B, C)``, or the
    ``(T / N, B, C)`` sequence shard), are kept in host memory (pinned when
    they come from a GPU) and copied back for the recompute. For the
    device copy to be freed, the caller must not hold it either
    (:func:`apply_activation_checkpointing` makes the decoder keep no inner states).
    """
    module.forward = functools.partial(_checkpointed_forward, module.forward, offload_to_cpu)
    record_wrapper(module, "forward", checkpoint_wrapper, offload_to_cpu=offload_to_cpu)
    return module


def apply_activation_checkpointing(decoder: nn.Module, offload_to_cpu: bool = False) -> None:
    """Checkpoint every decoder layer that ``decoder`` holds
    (``--checkpoint-activations``; ``offload_to_cpu``: ``--offload-activations``,
    which then also makes the decoder keep no per-layer outputs, see
    :func:`checkpoint_wrapper`). Apply after any per-layer compilation, so
    that the recompute replays the compiled forward. torchtitan's
    ``parallelize`` functions do the reverse, ``apply_ac`` then
    ``apply_compile`` of the wrapped block (dynamo traces torch's checkpoint
    into the compiled region); here the recompute swaps the RNG tracker's
    streams in and out, Python state that dynamo does not trace, so the
    checkpoint stays outside the compiled layer."""
    for layer in decoder.held_layers():
        checkpoint_wrapper(layer, offload_to_cpu=offload_to_cpu)
    if offload_to_cpu:
        decoder.keep_inner_states = False
