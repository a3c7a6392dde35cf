"""Deferred initial weights at model-parallel size 2: when the draws run,
each rank gets bitwise the shard, and the generator state, of a build that
drew them."""

import pytest

import fairseq_megatron  # noqa: F401  (installs the integration steps)
from tests.helpers import init_model_parallel, run_distributed
from tests.support.checkpoint_loading import built_both_ways


def _both_ways_in_a_group(rank, world_size):
    init_model_parallel(world_size, seed=0)
    return built_both_ways(world_size)


@pytest.mark.slow  # several seconds: left out of make test-fast
def test_deferred_draws_give_each_rank_its_shard_at_model_parallel_size_2(tmp_path):
    for rank, both in enumerate(run_distributed(_both_ways_in_a_group, 2, tmp_path)):
        assert not both["moved"] and both["queued"] == 14, rank
        assert both["nan_before"] == both["drawn_names"], rank
        assert both["different"] == [] and both["finite"] and both["same_generator"], rank
