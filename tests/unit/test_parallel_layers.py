"""The vocab-parallel cross entropy in one process (group of one) against
``torch.nn.functional.cross_entropy``: fp32, bf16 logits, compiled.

Tolerance: rtol=atol=1e-5 in fp32: the same sums in another order (log-sum-
exp by max subtraction) move results by a few ULP; a wrong target or ignored
index is off by > 1e-1."""

import importlib

import torch
import torch.nn.functional as F

from fairseq_megatron.modules import vocab_parallel_cross_entropy

TOL = dict(rtol=1e-5, atol=1e-5)


def test_cross_entropy_single_process_matches_torch():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(7, 50, generator=g) * 5).requires_grad_()
    target = torch.randint(0, 50, (7,), generator=g)
    target[3] = 0
    ref_logits = logits.detach().clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, target, ignore_index=0, group=None)
    ref = F.cross_entropy(ref_logits, target, ignore_index=0, reduction="none")
    torch.testing.assert_close(loss, ref, **TOL)
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, **TOL)


def test_cross_entropy_on_bf16_logits_computes_in_fp32():
    """bf16 logits (what --bf16-autocast produces): the loss is fp32 and equals
    F.cross_entropy on the same values widened to fp32 (tolerance as above:
    both compute in fp32 from identical inputs); the gradient comes back in
    bf16, equal to the fp32 gradient rounded to bf16 (rtol 2**-8 = half a
    bf16 unit in the last place, plus rounding of the subtraction)."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(9, 64, generator=g) * 5).bfloat16().requires_grad_()
    target = torch.randint(0, 64, (9,), generator=g)
    ref_logits = logits.detach().float().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, target, group=None)
    ref = F.cross_entropy(ref_logits, target, reduction="none")
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, **TOL)
    loss.sum().backward()
    ref.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad, rtol=2**-8, atol=1e-6)


def test_cross_entropy_compiled_passes_match_eager():
    """The two (N, V) passes that --compile-layers compiles give the eager
    results (aot_eager traces them through dynamo and AOT autograd without a
    C++ compiler; GPUs use inductor). Same fp32 operations: rtol 1e-6."""
    module = importlib.import_module("fairseq_megatron.modules.vocab_parallel_cross_entropy")

    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(6, 40, generator=g) * 4).bfloat16()
    logits_max = logits.max(-1).values.float()
    target = torch.randint(0, 40, (6,), generator=g)
    valid = torch.tensor([True, True, False, True, True, True])
    grad_loss = torch.rand(6, generator=g)
    sum_exp = module._sum_exp(logits, logits_max)
    torch.testing.assert_close(torch.compile(module._sum_exp, backend="aot_eager")(logits, logits_max),
                               sum_exp, rtol=1e-6, atol=0)
    args = (logits, logits_max, sum_exp, target, valid, grad_loss)
    torch.testing.assert_close(torch.compile(module._logits_grad, backend="aot_eager")(*args),
                               module._logits_grad(*args), rtol=1e-6, atol=0)
