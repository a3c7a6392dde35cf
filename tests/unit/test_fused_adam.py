"""The fused Adam that replaces fairseq's Python Adam for our models when apex is absent."""

import pytest
import torch
from fairseq.optim.adam import Adam

from fairseq_megatron.training.fused_adam import FairseqFusedAdam, FusedAdamW, fused_adam_applies


def _steps(optimizer_cls, steps=5):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000))
    opt = optimizer_cls([p], lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        p.grad = torch.randn(1000, generator=g)
        opt.step()
    return p.detach()


def _fairseq_adam(params, **flags):
    from argparse import Namespace

    from fairseq.optim.adam import FairseqAdam

    config = dict(lr=[1e-3], adam_betas="(0.9, 0.999)", adam_eps=1e-8, weight_decay=0.0, use_old_adam=False,
                  fp16_adam_stats=False, tpu=False)
    config.update(flags)
    return FairseqAdam(Namespace(**config), params), Namespace(optimizer=Namespace(**config))


def _two_steps(lazy: bool, max_norm: float):
    """Two updates of gradients that fairseq's trainer multiplies by
    1 / sample_size (a tensor, as the trainer may pass) and clips: lazily
    (FusedAdamW's pending factor) or eagerly (the gradients rewritten first,
    as fairseq's FairseqOptimizer and utils.clip_grad_norm_ do)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(7, 11))]
    opt = FusedAdamW(params, lr=1e-2, eps=1.0)  # eps = 1: the update depends on the gradients' size
    g = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 40.0
        c = torch.tensor(1 / 3)
        if lazy:
            opt.multiply_grads(c)
            norms.append(opt.clip_grad_norm(max_norm))
        else:
            torch._foreach_mul_([p.grad for p in params], c)
            norms.append(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf")))
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in params], torch.stack(norms)


def _run(bad_steps=(), skip_check=True, steps=4, nonfinite=float("nan"), omitted=()):
    """``steps`` updates of two parameters; gradients of the steps in
    ``bad_steps`` hold one ``nonfinite`` element; the steps in ``omitted``
    draw their gradients but make no update. Returns the parameters, the
    optimizer state and what ``last_step_skipped`` said after each update."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(50)), torch.nn.Parameter(torch.randn(5, 3))]
    opt = FusedAdamW(params, lr=1e-2, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    skipped = []
    for step in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        if step in omitted:
            continue
        if step in bad_steps:
            params[1].grad[2, 1] = nonfinite
        opt.multiply_grads(0.5)
        norm = opt.clip_grad_norm(1.0)
        if skip_check:
            opt.skip_step_if_nonfinite(norm)
        opt.step()
        skipped.append(opt.last_step_skipped())
        opt.zero_grad()
    state = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(params)}
    return [p.detach().clone() for p in params], state, skipped


def _assert_same_run(a, b):
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    for i in a[1]:
        for k in a[1][i]:
            assert torch.equal(a[1][i][k], b[1][i][k]), (i, k)


def test_same_updates_as_fairseq_adam():
    """Five AdamW steps (lr 1e-2, weight decay 0.01): fused torch matches
    fairseq's Adam within atol 1e-5, a thousandth of one step's update. The
    one algebraic difference is where eps enters: fairseq's effective eps is
    eps / sqrt(1 - beta2^t), up to 7x larger in the first steps, which moves
    small-gradient elements by ~1e-6 over five steps (measured). A wrong
    bias correction, beta or weight decay moves them by 1e-4 or more."""
    torch.testing.assert_close(_steps(FusedAdamW), _steps(Adam), rtol=0, atol=1e-5)


def test_fused_adamw_takes_over_fairseqs_adam_for_fp32_cuda_weights_only(monkeypatch):
    """fairseq's own lookup is left alone (without apex fairseq runs its
    Python Adam: stock fairseq unchanged); the trainer swaps in FusedAdamW
    for fp32 CUDA weights, and keeps fairseq's Adam for CPU or fp16 weights
    (--memory-efficient-fp16 keeps fp32 moments for fp16 weights) and for
    fairseq's --use-old-adam."""
    import fairseq.optim.adam

    assert fairseq.optim.adam.get_fused_adam_class() is None  # no apex here, and no lookup of ours
    cpu, cfg = _fairseq_adam([torch.nn.Parameter(torch.zeros(3))])
    assert type(cpu._optimizer) is Adam and not fused_adam_applies(cpu, cfg)
    half, cfg = _fairseq_adam([torch.nn.Parameter(torch.zeros(3, dtype=torch.half))])
    assert not fused_adam_applies(half, cfg)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # as the weights of a GPU run
    fp32, cfg = _fairseq_adam([torch.nn.Parameter(torch.zeros(3))])
    assert fused_adam_applies(fp32, cfg)
    assert not fused_adam_applies(fp32, _fairseq_adam([torch.nn.Parameter(torch.zeros(1))], use_old_adam=True)[1])
    assert not fused_adam_applies(half, cfg) and not fused_adam_applies(None, cfg)


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


def test_lazy_multiply_and_clip_match_eager():
    """The pending factor gives the updates and norms of rewriting the
    gradients first. Tolerance rtol 1e-6: the lazy path divides by 1 / factor
    inside the kernel where the eager one multiplies twice, a few fp32 ULP;
    a dropped factor changes the update by 3x, a dropped clip by more."""
    for max_norm in (0.0, 5.0):  # 5 < the norm (~230): clipping is active
        (lazy, lazy_norms), (eager, eager_norms) = _two_steps(True, max_norm), _two_steps(False, max_norm)
        torch.testing.assert_close(lazy_norms, eager_norms, rtol=1e-6, atol=0)
        for a, b in zip(lazy, eager):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert eager_norms.min() > 5.0


def test_fairseq_adam_routes_multiply_and_clip_to_fused():
    """fairseq's FairseqAdam wrapper over FusedAdamW (the trainer's fp32 path)
    hands both calls to it: the gradients are not rewritten, the norm
    includes the factor; with fairseq's Adam inside, the gradients are
    multiplied."""
    p = torch.nn.Parameter(torch.ones(4))
    wrapper, _ = _fairseq_adam([p], use_old_adam=True)
    p.grad = torch.full((4,), 2.0)
    wrapper.multiply_grads(0.5)  # fairseq's own Adam inside: applied now
    assert torch.equal(p.grad, torch.ones(4))

    fused = FairseqFusedAdam(wrapper)
    assert isinstance(fused._optimizer, FusedAdamW) and fused.param_groups[0]["params"] == [p]
    p.grad = torch.full((4,), 2.0)
    fused.multiply_grads(0.5)
    assert torch.equal(p.grad, torch.full((4,), 2.0))  # deferred to the step
    assert fused.clip_grad_norm(0.0).item() == 2.0  # norm of the multiplied gradients (1, 1, 1, 1)


def test_finite_norms_change_nothing():
    """With every norm finite, the check on the device leaves each update
    bitwise as it was and never reports a skipped step."""
    checked, unchecked = _run(skip_check=True), _run(skip_check=False)
    _assert_same_run(checked, unchecked)
    assert checked[2] == [False] * 4


def test_nonfinite_norm_skips_the_update_on_the_device():
    """A NaN or infinite gradient element makes the norm non-finite: that
    update leaves parameters, moments and step count as they were, so the
    run equals one whose bad step never happened (the same gradients drawn,
    the bad step's update dropped: bitwise equal, since nothing of it is
    applied). ``last_step_skipped`` says so once, right after it."""
    for nonfinite in (float("nan"), float("inf")):
        with_bad = _run(bad_steps=(1,), nonfinite=nonfinite)
        assert with_bad[2] == [False, True, False, False]
        reference = _run(omitted=(1,), skip_check=False)  # the same draws, the update of step 1 left out
        _assert_same_run(with_bad, reference)
        assert with_bad[1][0]["step"].item() == 3


def test_without_the_device_check_a_nonfinite_update_is_applied():
    """The control for the test above: without ``skip_step_if_nonfinite``
    the NaN reaches the weights, so that test's equality can fail."""
    params, _, skipped = _run(bad_steps=(1,), skip_check=False)
    assert not torch.isfinite(params[0]).all()
    assert skipped == [False] * 4


def test_saving_after_a_skipped_update_raises():
    """A run that ends on a skipped update must not save as if it had
    succeeded: ``state_dict`` raises then, once (the error was reported)."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = FusedAdamW([p], lr=1e-3)
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    opt.skip_step_if_nonfinite(opt.clip_grad_norm(0.0))
    opt.step()
    with pytest.raises(FloatingPointError, match="Nan/Inf in the last update"):
        opt.state_dict()
    assert torch.equal(p.detach(), torch.ones(3))
    assert "state" in opt.state_dict()
