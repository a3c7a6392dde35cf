"""The fused Adam that replaces fairseq's Python Adam when apex is absent."""

import torch
from fairseq.optim.adam import Adam

import fairseq_megatron  # noqa: F401  (installs the lookup)
from fairseq_megatron.fused_adam import FusedAdamW, _build


def _steps(optimizer_cls, steps=5):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000))
    opt = optimizer_cls([p], lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        p.grad = torch.randn(1000, generator=g)
        opt.step()
    return p.detach()


def test_same_updates_as_fairseq_adam():
    """Five AdamW steps (lr 1e-2, weight decay 0.01): fused torch matches
    fairseq's Adam within atol 1e-5, a thousandth of one step's update. The
    one algebraic difference is where eps enters: fairseq's effective eps is
    eps / sqrt(1 - beta2^t), up to 7x larger in the first steps, which moves
    small-gradient elements by ~1e-6 over five steps (measured). A wrong
    bias correction, beta or weight decay moves them by 1e-4 or more."""
    torch.testing.assert_close(_steps(FusedAdamW), _steps(Adam), rtol=0, atol=1e-5)


def test_fairseq_adam_gets_the_lookup_and_falls_back_off_gpu():
    import fairseq.optim.adam

    build = fairseq.optim.adam.get_fused_adam_class()
    assert build is not None, "fairseq would run its unfused Python Adam"
    # CPU or fp16 parameters (--memory-efficient-fp16) keep fairseq's own Adam,
    # which keeps fp32 moments for fp16 weights.
    assert type(_build([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)) is Adam
    assert type(_build([torch.nn.Parameter(torch.zeros(3, dtype=torch.half))], lr=1e-3)) is Adam


def test_step_with_scale_divides_gradients():
    """fairseq passes the loss scale to optimizers that take it: scaled
    gradients with ``scale=s`` give the update of unscaled gradients (1024 is
    a power of two, so the division is exact and the results are equal).
    eps = 1 makes the update depend on the gradients' magnitude (Adam alone
    is nearly scale-invariant), so an ignored scale would show."""
    results = []
    for scale in (1.0, 1024.0):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(100))
        opt = FusedAdamW([p], lr=1e-2, eps=1.0)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            p.grad = torch.randn(100, generator=g) * scale
            opt.step(scale=scale)
        results.append(p.detach())
    assert torch.equal(results[0], results[1])
