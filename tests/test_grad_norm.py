"""The gradient norm at model-parallel size N equals the size-1 model's.

fairseq's MegatronTrainer sums squared local norms over the group, so the
replicated parameters (layer norms, row-parallel biases) count N times; the
tests show that this differs from size 1 by more than the tolerance (so the
comparison can fail) and that :mod:`fairseq_megatron.grad_norm` does not.

Tolerance: rtol=1e-5 (fp32). The size-N norm sums the same squares in a
different order and from gradients that themselves differ by a few ULP
(see test_model_parity.py); the upstream error in these tests is > 1e-2.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fairseq_megatron import parallel_state
from fairseq_megatron.checkpoint_layout import split_model_state
from fairseq_megatron.grad_norm import model_parallel_norm_aggregator
from fairseq_megatron.modules import vocab_parallel_cross_entropy
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
    model.load_state_dict(split_model_state(state, model_parallel_size)[parallel_state.rank(group)])
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
