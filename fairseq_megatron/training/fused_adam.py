"""A fused Adam for fairseq when apex is not installed.

fairseq's ``--optimizer adam`` looks for apex's FusedAdam
(``fairseq/optim/fused_adam.py:get_fused_adam_class``) and otherwise runs its
own Python ``Adam``: about seven separate element-wise kernels over every
parameter per step. With ``--fp16`` that is one flat fp32 master tensor of
all parameters, so the step is memory-bound: roughly 90 GB of traffic for a
1.3B-parameter model against the 36 GB that one fused pass needs (read
param, grad, two moments; write param and moments).

For our models the trainer hands fairseq ``torch.optim.AdamW(fused=True)``
instead (:class:`FairseqFusedAdam`), for fp32 parameters on CUDA: the same decoupled weight decay as
fairseq's Adam ("corresponds to AdamW", fairseq's docstring). One difference:
torch adds ``eps`` after dividing by the bias correction of the second
moment, fairseq before; with the default ``eps = 1e-8`` the update differs
only where ``sqrt(v)`` is itself of order ``eps``. Parameters that are not
fp32 (``--memory-efficient-fp16`` keeps fp16 weights), CPU tensors and
``--fp16-adam-stats`` keep fairseq's own Adam, and so does ``--use-old-adam``
(fairseq's flag).

It also lets the trainer skip an update with non-finite gradients on the
device instead of testing the norm on the host first (see
:meth:`FusedAdamW.skip_step_if_nonfinite`).
"""

import torch
from fairseq.optim import FairseqOptimizer
from fairseq.optim.adam import Adam, FairseqAdam


class FusedAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW(fused=True)`` with the attributes fairseq's wrappers query.

    It also keeps fairseq's gradient scalings out of separate passes over the
    gradients: :meth:`multiply_grads` (the trainer's ``1 / sample_size``) and
    the clipping coefficient of :meth:`clip_grad_norm` only update a pending
    factor, which the fused kernel applies while it reads the gradients in
    :meth:`step` (what fairseq's ``FP16Optimizer`` does for fp16 training, here
    for fp32 weights: ``--bf16-autocast``, ``--amp``, fp32). Until then
    ``p.grad`` holds the unscaled sums.
    """

    supports_flat_params = True  # fp16 training keeps one flat fp32 master tensor
    supports_memory_efficient_fp16 = False
    supports_step_with_scale = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, fused=True)
        self._grad_factor = 1.0  # float or 0-dim tensor; applied by the next step()
        self._found_inf = None  # 0-dim fp32 on the device (1.0: skip), for the next step()
        self._last_step_skipped = None  # _HostCopy of the last step's found_inf

    @property
    def _device(self) -> torch.device:
        """Where the parameters (and so the fused kernel's scalars) live."""
        return self.param_groups[0]["params"][0].device

    def multiply_grads(self, c) -> None:
        """Multiply every gradient by ``c`` (float or 0-dim tensor), lazily."""
        self._grad_factor = self._grad_factor * c

    def clip_grad_norm(self, max_norm: float, aggregate_norm_fn=None) -> torch.Tensor:
        """L2 norm of all gradients, pending factor included (one fused
        multi-tensor reduction, where fairseq's ``utils.clip_grad_norm_``
        launches one norm per parameter without apex); ``aggregate_norm_fn``
        combines it across model-parallel ranks. With ``max_norm > 0`` the
        clipping coefficient ``min(1, max_norm / (norm + 1e-6))`` joins the
        pending factor. Returns the norm before clipping (fp32, 0-dim)."""
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return torch.tensor(0.0)
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0).float() * self._grad_factor
        if aggregate_norm_fn is not None:
            norm = aggregate_norm_fn(norm)
        if max_norm > 0:
            self._grad_factor = self._grad_factor * (float(max_norm) / (norm + 1e-6)).clamp(max=1)
        return norm

    def skip_step_if_nonfinite(self, grad_norm: torch.Tensor) -> None:
        """Make the next :meth:`step` change nothing if ``grad_norm`` (0-dim,
        as :meth:`clip_grad_norm` returns it) is NaN or infinite, decided on
        the device: the fused kernel's ``found_inf`` leaves the parameters and
        moments as they were and the step count is restored.

        fairseq's trainer instead reads the norm on the host before every
        update (``torch.isfinite(grad_norm)`` in ``Trainer.train_step``) so as
        to raise before the weights change; that read waits for the whole
        backward pass, and the GPU then idles while the host queues the
        optimizer and the next forward. Here nothing waits: the step's
        outcome travels to the host while the GPU works on, and
        :meth:`last_step_skipped` reads it (``MegatronTrainer.clip_grad_norm`` raises
        fairseq's FloatingPointError one update later)."""
        self._found_inf = torch.isfinite(grad_norm).logical_not().to(device=self._device, dtype=torch.float32).reshape(())

    def last_step_skipped(self) -> bool:
        """Whether the last :meth:`step` was skipped for a non-finite
        gradient norm (:meth:`skip_step_if_nonfinite`); answers once, then
        False until the next such step. Waits for that step's kernel only,
        not for work queued after it."""
        outcome, self._last_step_skipped = self._last_step_skipped, None
        return outcome is not None and bool(outcome.read())

    def step(self, closure=None, scale: float = 1.0):
        """One update with gradients multiplied by the pending factor and
        divided by ``scale`` (fairseq's convention for the loss scale), both
        inside the fused kernel (its ``grad_scale`` divides); skipped on the
        device if :meth:`skip_step_if_nonfinite` saw a non-finite norm."""
        found_inf, self._found_inf = self._found_inf, None
        self.found_inf = found_inf  # read by torch's AdamW.step, like grad_scale
        divisor = scale / self._grad_factor
        if torch.is_tensor(divisor) or divisor != 1.0:
            if torch.is_tensor(divisor):
                self.grad_scale = divisor.to(device=self._device, dtype=torch.float32).reshape(())
            else:  # filled on the device: no host-to-device copy, which would wait for the GPU
                self.grad_scale = torch.full((), divisor, dtype=torch.float32, device=self._device)
        try:
            loss = super().step(closure)
        finally:
            self.grad_scale = self.found_inf = None
            self._grad_factor = 1.0
        if found_inf is not None:
            self._last_step_skipped = _HostCopy(found_inf)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grad_factor = 1.0
        self._found_inf = None  # a norm whose step never came (an exception between)
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        """torch's state dict; raises FloatingPointError instead if the last
        update was skipped for non-finite gradients and nobody has asked
        since (training that ends on such an update must not save as if it
        had succeeded)."""
        if self.last_step_skipped():
            raise FloatingPointError("gradients are Nan/Inf in the last update (skipped: weights and Adam moments "
                                     "unchanged); not saving")
        return super().state_dict()


class _HostCopy:
    """The value of a 0-dim tensor, copied to the host without waiting for the
    device: on CUDA a non-blocking copy into pinned memory and an event after
    it; :meth:`read` waits for that event only."""

    def __init__(self, tensor: torch.Tensor):
        self._done = None
        if tensor.is_cuda:
            self._value = torch.empty((), dtype=tensor.dtype, pin_memory=True)
            self._value.copy_(tensor, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._value = tensor.detach().clone()

    def read(self):
        if self._done is not None:
            self._done.synchronize()
        return self._value.item()


def fused_adam_applies(optimizer, cfg) -> bool:
    """Whether ``optimizer`` (a fairseq optimizer, or None) is fairseq's
    ``FairseqAdam`` running fairseq's Python ``Adam`` where
    :class:`FusedAdamW` can take over: fp32 parameters on CUDA, none of
    them sharded over data-parallel ranks (FSDP2's ``DTensor``: fairseq's
    Adam updates the shards), no ``--use-old-adam`` or ``--fp16-adam-stats``
    (fairseq's flags). An apex FusedAdam that fairseq found is kept."""
    if type(optimizer) is not FairseqAdam or type(optimizer._optimizer) is not Adam:
        return False
    if getattr(cfg.optimizer, "use_old_adam", False) or getattr(cfg.optimizer, "fp16_adam_stats", False):
        return False
    params = [p for group in optimizer._optimizer.param_groups for p in group["params"]]
    return bool(params) and all(p.is_cuda and p.dtype == torch.float32 and not hasattr(p, "device_mesh")
                                for p in params)


class FairseqFusedAdam(FairseqAdam):
    """fairseq's ``FairseqAdam`` (``--optimizer adam``) over :class:`FusedAdamW`,
    which takes fairseq's gradient multiply and clipping into its kernel:
    built from a ``FairseqAdam`` that fairseq made, keeping its parameter
    groups (and their learning rates), config and wrappers."""

    def __init__(self, adam):
        FairseqOptimizer.__init__(self, adam.cfg)
        self._optimizer = FusedAdamW(adam._optimizer.param_groups, **adam.optimizer_config)

    def multiply_grads(self, c) -> None:
        """Multiply every gradient by ``c``, in the next step's kernel."""
        self._optimizer.multiply_grads(c)

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        """:meth:`FusedAdamW.clip_grad_norm`: one multi-tensor norm, and the
        clipping coefficient applied by the next step's kernel."""
        return self._optimizer.clip_grad_norm(max_norm, aggregate_norm_fn)
