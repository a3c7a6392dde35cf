"""What the ``--fp8`` tests share: torchao's float8 training emulated on the
CPU (the test mode of :mod:`fairseq_megatron.modules.float8`), one training
pass of a small model, and the norm-wise comparison with its tolerances.

What is compared, and why norm-wise: the summed loss of a batch, and each
parameter's gradient as a whole, ``||a - b|| / ||b||``. Float8 rounds every
operand of a product (e4m3 keeps 3 mantissa bits: up to 2^-4 relative error
per element; e5m2, the output gradients of the tensorwise recipe, 2 bits:
2^-3); single elements of a sum that nearly cancels can then change by more
than their size, so elementwise tolerances would have to be meaningless to
pass, while a whole gradient stays within a few roundings.
"""

import torch
import torch.nn.functional as F

from fairseq_megatron.modules.float8 import EMULATE_VARIABLE
from tests.helpers import build_model, make_batch

RECIPES = ("tensorwise", "rowwise")

# The loss is a sum over the batch's tokens of -log softmax(logits); the
# logits come from features that went through the layers' float8 products,
# each operand rounded by at most 2^-4 (e4m3), and the sum over 45 tokens
# averages independent roundings: 2^-7, an eighth of one worst-case
# rounding, still leaves ten times the measured error (2e-4 tensorwise,
# 7e-4 rowwise). (At initialisation the loss is nearly that of uniform
# predictions and moves little; the gradients carry these tests.)
LOSS_RTOL = 2 ** -7
# A weight or input gradient is a product of an output gradient (e5m2 in the
# tensorwise recipe, up to 2^-3 off per element) and an e4m3 operand (2^-4),
# and the backward pass goes through both layers, whose input gradients
# carry the first layer's error into the second: 2^-2 leaves room for that
# compounding of about 2^-3 + 2^-4 per product (measured: at most 0.17, the
# queries' and keys' gradients, which pass through the softmax's backward).
GRAD_RTOL = 2 ** -2
# fp32-tight, the model-parity tests' tolerances: what the control
# comparison uses to show that float8 really changed the numbers.
FP32_TIGHT = dict(rtol=1e-4, atol=1e-5)

# The key projection's bias has no gradient in exact arithmetic: it adds the
# same q . b to every score of a query, which softmax ignores. What autograd
# returns for it is rounding noise, larger in float8, and not compared.
NOISE_ONLY = (".self_attn.k_proj.bias",)


def emulated(monkeypatch) -> None:
    """Turn on the test mode (torchao's emulation of float8 on any device)
    for this test and the processes it starts."""
    monkeypatch.setenv(EMULATE_VARIABLE, "1")


def random_biases(model, seed: int = 3) -> None:
    """Give every bias a random value (they start at zero, where a product
    that dropped its bias would go unnoticed)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def single_model_pass(fp8_recipe=None, batch_seed: int = 10, **overrides):
    """The model at size 1 (seed 0, random biases), one training pass:
    ``(summed loss, {name: gradient}, model)``; with ``fp8_recipe`` it trains
    with ``--fp8 --fp8-recipe fp8_recipe``."""
    model, dictionary = build_model(1, seed=0, fp8=fp8_recipe is not None, fp8_recipe=fp8_recipe, **overrides)
    random_biases(model)
    model.train()
    tokens, target = make_batch(dictionary, seed=batch_seed)
    logits, _ = model(tokens)
    loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), target.view(-1), ignore_index=dictionary.pad(),
                           reduction="sum")  # in fp32, as the criteria compute it
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, model


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in fp64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def normwise_errors(loss, grads, ref_loss, ref_grads) -> dict:
    """Relative error of the loss and of each compared gradient."""
    assert set(grads) == set(ref_grads)
    errors = {"loss": relative_error(loss, ref_loss)}
    errors.update({name: relative_error(g, ref_grads[name]) for name, g in grads.items()
                   if not name.endswith(NOISE_ONLY)})
    return errors


def assert_normwise_close(loss, grads, ref_loss, ref_grads, loss_rtol=LOSS_RTOL, grad_rtol=GRAD_RTOL) -> dict:
    """The loss within ``loss_rtol`` and every compared gradient within
    ``grad_rtol`` of the reference's, norm-wise. Returns the errors."""
    errors = normwise_errors(loss, grads, ref_loss, ref_grads)
    assert errors["loss"] <= loss_rtol, errors["loss"]
    too_far = {name: e for name, e in errors.items() if name != "loss" and e > grad_rtol}
    assert not too_far, too_far
    return errors


def differs_beyond_fp32(loss, grads, ref_loss, ref_grads) -> bool:
    """The control: whether the fp32-tight comparison of the parity tests
    (:data:`FP32_TIGHT`, elementwise) fails somewhere."""
    pairs = [(loss, ref_loss)] + [(g, ref_grads[name]) for name, g in grads.items()
                                  if not name.endswith(NOISE_ONLY)]
    for a, b in pairs:
        try:
            torch.testing.assert_close(a, b, **FP32_TIGHT)
        except AssertionError:
            return True
    return False


def training_pass_in_group(model, dictionary, group, batch_seed: int = 10):
    """One training pass of a model-parallel ``model`` (vocab-parallel loss):
    ``(summed loss, {name: gradient gathered to the size-1 shape})``."""
    import torch.distributed as dist

    from tests.support.partition import expected_partition_dim
    from fairseq_megatron.modules import vocab_parallel_cross_entropy
    from fairseq_megatron.parallel import parallel_state

    model.train()
    tokens, target = make_batch(dictionary, seed=batch_seed)
    shard_logits, _ = model(tokens, gather_logits=False)
    loss = vocab_parallel_cross_entropy(shard_logits, target, ignore_index=dictionary.pad(), group=group).sum()
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        dim = expected_partition_dim(name)
        if dim is None:
            grads[name] = p.grad.clone()
            continue
        parts = [torch.empty_like(p.grad) for _ in range(parallel_state.world_size(group))]
        dist.all_gather(parts, p.grad.contiguous(), group=group)
        grads[name] = torch.cat(parts, dim=dim)
    return loss.detach(), grads
