"""The model-parallel RNG tracker and activation checkpointing with dropout."""

import pytest
import torch
import torch.nn.functional as F

from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.parallel.rng_tracker import get_rng_tracker
from tests.helpers import build_model, init_model_parallel, run_distributed
from tests.support.rng_and_checkpointing import training_pass


def _dropout_worker(rank, world_size):
    init_model_parallel(2, seed=7)
    ones = torch.ones(1000)
    with get_rng_tracker().fork("cpu"):
        sharded = F.dropout(ones, 0.5)  # model-parallel region: per-rank stream
    replicated = F.dropout(ones, 0.5)  # default generator: same seed on all ranks
    group = parallel_state.get_tensor_model_parallel_group()
    both = [torch.empty(1000), torch.empty(1000)]
    torch.distributed.all_gather(both, sharded, group=group)
    reps = [torch.empty(1000), torch.empty(1000)]
    torch.distributed.all_gather(reps, replicated, group=group)
    return {"tp": parallel_state.world_size(group), "sharded_equal": torch.equal(*both),
            "replicated_equal": torch.equal(*reps)}


def _sequence_parallel_checkpoint_worker(rank, world_size):
    init_model_parallel(2, seed=7)
    tracker = get_rng_tracker()
    tracker_start, default_start = tracker.get_states(), torch.get_rng_state()
    overrides = dict(dropout=0.2, attention_dropout=0.2, activation_dropout=0.2, sequence_parallel=True)
    runs = []
    for checkpointing in ({}, {"checkpoint_activations": True}, {"offload_activations": True}):
        model, dictionary = build_model(2, seed=0, **overrides, **checkpointing)
        tracker.set_states(tracker_start)
        torch.set_rng_state(default_start)
        runs.append(training_pass(model, dictionary)[1])
    group = parallel_state.get_tensor_model_parallel_group()
    # residual dropout on sequence shards must differ between ranks
    with tracker.fork("cpu"):
        mask = F.dropout(torch.ones(64), 0.5)
    masks = [torch.empty(64), torch.empty(64)]
    torch.distributed.all_gather(masks, mask, group=group)
    return {"tp": parallel_state.world_size(group),
            "same_grads": [all(torch.equal(runs[0][n], run[n]) for n in runs[0]) for run in runs[1:]],
            "masks_differ": not torch.equal(*masks)}


def test_dropout_masks_differ_across_ranks_only_inside_the_region(tmp_path):
    for r in run_distributed(_dropout_worker, 2, tmp_path):
        assert r["tp"] == 2
        assert not r["sharded_equal"]
        assert r["replicated_equal"]


@pytest.mark.slow  # several seconds: left out of make test-fast
def test_sequence_parallel_checkpointing_replays_dropout(tmp_path):
    """Sequence parallelism at size 2 with every dropout on: the checkpointed
    model's gradients, with and without ``--offload-activations``, equal the
    plain one's bitwise (same arithmetic, same masks replayed from both
    generators on recompute)."""
    for r in run_distributed(_sequence_parallel_checkpoint_worker, 2, tmp_path):
        assert r["tp"] == 2
        assert r["same_grads"] == [True, True]
        assert r["masks_differ"]
