"""fairseq-eval-lm's context-window batches (in one process; the distributed
runs are in tests/e2e/).

:class:`ContextWindowDataset` must produce exactly the batches of fairseq's
``LMContextWindowDataset`` when batches are collated in order (the only
order that dataset gets right), and the same batches in any other order.
Token ids are compared exactly: no arithmetic is involved."""

import pytest

from tests.helpers import run_distributed
from tests.support.eval_lm import fake_samples


def _sum_worker(rank, world_size):
    """Our ``eval_lm`` on this rank's shard (its own fake hypotheses), the
    data sharded over the data-parallel group of all ranks; and fairseq's
    own loss and token count of the same shard."""
    import math

    from fairseq.sequence_scorer import SequenceScorer

    from fairseq_megatron.fairseq_integration import eval_lm
    from fairseq_megatron.fairseq_integration.patching import original
    from fairseq_megatron.parallel import parallel_state
    from tests.helpers import build_model, init_model_parallel

    init_model_parallel(1)
    model, _ = build_model(1)
    dictionary, samples = fake_samples(seed=10 + rank)
    SequenceScorer.generate = lambda self, models, sample: sample["hypos"]
    own = original(eval_lm._cli(), "eval_lm")([model], dictionary, samples, target_dictionary=dictionary)
    count = sum(hypo[0]["tokens"].numel() for sample in samples for hypo in sample["hypos"])
    token = eval_lm._run.set(eval_lm.EvalLmRun(False, sharded_over=parallel_state.get_data_parallel_group()))
    try:
        summed = eval_lm.eval_lm([model], dictionary, samples, target_dictionary=dictionary)
    finally:
        eval_lm._run.reset(token)
    return summed["loss"], float(own["loss"]) * count * math.log(2), count


def test_the_loss_is_over_all_groups(tmp_path):
    """Two ranks (two data-parallel groups of one), each scoring its own
    shard: both return the loss of all tokens together, from fairseq's own
    per-shard losses and counts. Tolerance 1e-6 relative: fairseq sums each
    shard in float32, ours in float64."""
    import math

    results = run_distributed(_sum_worker, 2, tmp_path)
    total = sum(nll for _, nll, _ in results) / sum(count for _, _, count in results) / math.log(2)
    assert [loss for loss, _, _ in results] == pytest.approx([total] * 2, rel=1e-6)
    assert results[0][1] / results[0][2] != pytest.approx(results[1][1] / results[1][2], rel=1e-3)  # shards differ
