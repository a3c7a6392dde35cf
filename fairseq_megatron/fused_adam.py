"""A fused Adam for fairseq when apex is not installed.

fairseq's ``--optimizer adam`` looks for apex's FusedAdam
(``fairseq/optim/fused_adam.py:get_fused_adam_class``) and otherwise runs its
own Python ``Adam``: about seven separate element-wise kernels over every
parameter per step. With ``--fp16`` that is one flat fp32 master tensor of
all parameters, so the step is memory-bound: roughly 90 GB of traffic for a
1.3B-parameter model against the 36 GB that one fused pass needs (read
param, grad, two moments; write param and moments).

:func:`fused_adam_class` hands fairseq ``torch.optim.AdamW(fused=True)``
instead, for fp32 parameters on CUDA: the same decoupled weight decay as
fairseq's Adam ("corresponds to AdamW", fairseq's docstring). One difference:
torch adds ``eps`` after dividing by the bias correction of the second
moment, fairseq before; with the default ``eps = 1e-8`` the update differs
only where ``sqrt(v)`` is itself of order ``eps``. Parameters that are not
fp32 (``--memory-efficient-fp16`` keeps fp16 weights), CPU tensors and
``--fp16-adam-stats`` get fairseq's own Adam, as before. ``--use-old-adam``
turns the lookup off altogether (fairseq's flag).
"""

from typing import Callable, Optional

import torch


class FusedAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW(fused=True)`` with the attributes fairseq's wrappers query."""

    supports_flat_params = True  # fp16 training keeps one flat fp32 master tensor
    supports_memory_efficient_fp16 = False
    supports_step_with_scale = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, fused=True)

    def step(self, closure=None, scale: float = 1.0):
        """One update; gradients are divided by ``scale`` first (fairseq's
        convention for the loss scale), inside the fused kernel, which saves
        FP16Optimizer a separate pass over all gradients."""
        if scale != 1.0:
            device = self.param_groups[0]["params"][0].device
            self.grad_scale = torch.tensor(float(scale), dtype=torch.float32, device=device)
        try:
            return super().step(closure)
        finally:
            self.grad_scale = None


def _build(params, use_fp16_stats: bool = False, **config):
    from fairseq.optim.adam import Adam

    params = list(params)
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    if use_fp16_stats or not all(p.is_cuda and p.dtype == torch.float32 for p in tensors):
        return Adam(params, **config)
    return FusedAdamW(params, **config)


def fused_adam_class(apex_lookup: Callable[[], Optional[type]]) -> Callable[[], Optional[Callable]]:
    """A replacement for fairseq's ``get_fused_adam_class``: apex's class when
    ``apex_lookup`` finds one, else a builder of :class:`FusedAdamW` (or of
    fairseq's ``Adam`` for parameters the fused kernel should not take)."""

    def lookup():
        return apex_lookup() or _build

    return lookup
