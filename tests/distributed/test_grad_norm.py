"""The gradient norm at model-parallel size N equals the size-1 model's.

fairseq's MegatronTrainer sums squared local norms over the group, so the
replicated parameters (layer norms, row-parallel biases) count N times; the
tests show that this differs from size 1 by more than the tolerance (so the
comparison can fail) and that :mod:`fairseq_megatron.parallel.grad_norm` does not,
also inside fairseq's FP16Optimizer (flat fp32 master gradients, loss scale,
pending multiply factor).

Tolerance: rtol=1e-5 (fp32). The size-N norm sums the same squares in a
different order and from gradients that themselves differ by a few ULP
(see test_model_parity.py); the upstream error in these tests is > 1e-2."""

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fairseq.optim.fairseq_optimizer import FairseqOptimizer
from fairseq.optim.fp16_optimizer import FP16Optimizer

from fairseq_megatron.checkpoint.layout import split_model_state
from tests.support.partition import expected_partition_dim, expected_partition_dims
from fairseq_megatron.modules import vocab_parallel_cross_entropy
from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.parallel.grad_norm import model_parallel_norm_aggregator
from tests.helpers import build_model, init_model_parallel, make_batch, run_distributed

NORM_TOL = dict(rtol=1e-5, atol=0.0)
# A stand-in for the scalar that fairseq's optimizer wrappers put between
# their local norm and the model's p.grad (loss scale, 1 / sample_size).
SCALE = 8.0


def _size_1_norm(batch_seed):
    model, dictionary = build_model(1)
    tokens, target = make_batch(dictionary, seed=batch_seed)
    logits, _ = model(tokens)
    F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1), ignore_index=dictionary.pad(),
                    reduction="sum").backward()
    grads = [p.grad for p in model.parameters()]
    return model.state_dict(), torch.nn.utils.get_total_norm(grads) * SCALE


def _norm_worker(rank, world_size, model_parallel_size, reference_path):
    init_model_parallel(model_parallel_size)
    group = parallel_state.get_tensor_model_parallel_group()
    model, dictionary = build_model(model_parallel_size)
    state = torch.load(reference_path)
    parts = split_model_state(state, model_parallel_size, expected_partition_dims(state))
    model.load_state_dict(parts[parallel_state.rank(group)])
    tokens, target = make_batch(dictionary, seed=10 + parallel_state.get_data_parallel_rank())
    shard_logits, _ = model(tokens, gather_logits=False)
    vocab_parallel_cross_entropy(shard_logits, target, ignore_index=dictionary.pad(), group=group).sum().backward()

    local = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]) * SCALE
    ours = model_parallel_norm_aggregator(model, group)(local)
    upstream = local.square()
    dist.all_reduce(upstream, group=group)  # fairseq's _aggregate_model_parallel_grad_norm

    # An overflow on one rank must still read as a non-finite norm on all of them.
    if parallel_state.rank(group) == 0:
        model.decoder.layers[0].fc1.weight.grad[0, 0] = float("inf")
        local = torch.tensor(float("inf"))
    overflow = model_parallel_norm_aggregator(model, group)(local)
    return {"dp_rank": parallel_state.get_data_parallel_rank(), "tp": parallel_state.world_size(group),
            "ours": ours, "upstream": upstream.sqrt(), "overflow": overflow}


def _fp16_optimizer_worker(rank, world_size):
    """fairseq's FP16Optimizer (the Megatron-11b recipe's ``--fp16``): the norm
    over its flat fp32 master gradients, with a loss scale and a pending
    ``multiply_grads`` factor, against the norm gathered from the model's own
    fp16 gradients with every parameter counted once."""
    init_model_parallel(2)
    group = parallel_state.get_tensor_model_parallel_group()
    model, dictionary = build_model(2)
    model.half()
    params = list(model.parameters())
    # fairseq's flat master buffer is keyed by CUDA device index, None on CPU.
    torch.cuda.current_device = lambda: None
    fp32_params = FP16Optimizer.build_fp32_params(SimpleNamespace(), params, flatten=True)

    class Plain(FairseqOptimizer):  # any inner optimizer: only its clip_grad_norm is used
        def __init__(self, flat):
            super().__init__(None)
            self._optimizer = torch.optim.SGD(flat, lr=0.1)

    common = SimpleNamespace(fp16_scale_window=128, fp16_init_scale=128.0, fp16_scale_tolerance=0.0,
                             threshold_loss_scale=None, min_loss_scale=1e-4, bf16=False)
    optimizer = FP16Optimizer(SimpleNamespace(optimizer=None, common=common), params,
                              Plain([fp32_params[None]]), fp32_params)

    tokens, target = make_batch(dictionary, seed=10)
    shard_logits, _ = model(tokens, gather_logits=False)
    optimizer.backward(  # scales the loss by 128
        vocab_parallel_cross_entropy(shard_logits, target, ignore_index=dictionary.pad(), group=group).sum())
    multiply = 1.0 / 3
    optimizer.multiply_grads(multiply)  # pending, applied after the norm
    norm = optimizer.clip_grad_norm(0.0, aggregate_norm_fn=model_parallel_norm_aggregator(model, group))

    # Independent reference from the model's fp16 gradients: squares of the
    # sharded ones summed over the group, plus the replicated ones once.
    sharded_sq = torch.zeros((), dtype=torch.float64)
    replicated_sq = torch.zeros((), dtype=torch.float64)
    for name, p in model.named_parameters():
        sq = p.grad.double().square().sum()
        if expected_partition_dim(name) is None:
            replicated_sq += sq
        else:
            sharded_sq += sq
    dist.all_reduce(sharded_sq, group=group)
    expected = (sharded_sq + replicated_sq).sqrt() * multiply
    return {"tp": parallel_state.world_size(group), "norm": norm.double(), "expected": expected,
            "flat": fp32_params[None].numel() == sum(p.numel() for p in params)}


@pytest.mark.parametrize(
    "world_size,model_parallel_size", [(2, 2), (4, 4), (4, 2)],
    ids=["mp2", "mp4", "world4-two-groups-of-2"],
)
def test_norm_at_size_n_equals_size_1(tmp_path, world_size, model_parallel_size):
    """Every rank gets its group's size-1 norm (with two groups, each of its
    own batch: the all-reduce stays inside the group)."""
    groups = world_size // model_parallel_size
    references = [_size_1_norm(batch_seed=10 + g) for g in range(groups)]
    reference_path = os.path.join(tmp_path, "reference.pt")
    torch.save(references[0][0], reference_path)
    results = run_distributed(_norm_worker, world_size, tmp_path, model_parallel_size, reference_path)
    for r in results:
        expected = references[r["dp_rank"]][1]
        assert r["tp"] == model_parallel_size
        torch.testing.assert_close(r["ours"], expected, **NORM_TOL)
        assert (r["upstream"] - expected).abs() > 1e-2 * expected, "replicated parameters barely count here"
        assert not torch.isfinite(r["overflow"])


@pytest.mark.slow  # several seconds: left out of make test-fast
def test_fp16_optimizer_flat_master_gradients(tmp_path):
    """Tolerance rtol=1e-5: both sides sum the same fp16 values in fp32 or
    fp64 in different orders."""
    for r in run_distributed(_fp16_optimizer_worker, 2, tmp_path):
        assert r["tp"] == 2 and r["flat"]
        torch.testing.assert_close(r["norm"], r["expected"], **NORM_TOL)
