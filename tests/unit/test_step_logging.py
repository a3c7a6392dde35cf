"""Our trainer's per-step statistics, without waiting for the device, log
what fairseq's own ``_reduce_and_log_stats`` logs and return the same
dictionary; prefetch threads stop before exit."""

import types

import pytest
import torch
from fairseq.criterions.cross_entropy import CrossEntropyCriterion
from fairseq.logging import metrics
from fairseq.trainer import Trainer

from fairseq_megatron.fairseq_integration.trainer import MegatronTrainer


def _fake_trainer(clip_norm: float):
    """What ``_reduce_and_log_stats`` touches on a Trainer."""
    task = types.SimpleNamespace(reduce_metrics=lambda outputs, criterion: CrossEntropyCriterion.reduce_metrics(outputs))
    return types.SimpleNamespace(
        tpu=False, _warn_once=set(), task=task, get_criterion=lambda: None,
        cfg=types.SimpleNamespace(optimization=types.SimpleNamespace(clip_norm=clip_norm)),
    )


def _one_step(reduce_and_log_stats, clip_norm: float):
    trainer = _fake_trainer(clip_norm)
    logging_outputs = [
        {"loss": torch.tensor(20.5), "ntokens": 8, "nsentences": 2, "sample_size": 8},
        {"loss": torch.tensor(11.25), "ntokens": 4, "nsentences": 1, "sample_size": 4},
    ]
    with metrics.aggregate(new_root=True) as step_meters:
        returned = reduce_and_log_stats(trainer, logging_outputs, 12, torch.tensor(3.75))
        returned = dict(returned)
    logged = step_meters.get_smoothed_values()
    logged.pop("ups", None)  # a rate measured in wall-clock time
    return returned, logged


@pytest.mark.parametrize("clip_norm", [0.0, 1.0, 5.0])  # no clipping; the norm 3.75 clipped; not
def test_same_meters_and_dictionary_as_fairseq(clip_norm):
    patched = MegatronTrainer._reduce_and_log_stats
    fairseq_own = Trainer._reduce_and_log_stats
    assert fairseq_own is not patched, "the trainer did not override the method"
    ours, ours_logged = _one_step(patched, clip_norm)
    theirs, theirs_logged = _one_step(fairseq_own, clip_norm)
    assert ours == theirs
    assert ours_logged == theirs_logged
    # the values themselves, so that two equal but empty results cannot pass
    assert theirs["sample_size"] == 12 and theirs["loss"] == round(31.75 / 12 / torch.log(torch.tensor(2.0)).item(), 3)
    assert theirs_logged["gnorm"] == 3.75
    assert ("clip" in theirs_logged) == (clip_norm > 0)
    if clip_norm > 0:
        assert theirs_logged["clip"] == (100 if 3.75 > clip_norm else 0)


def test_validation_calls_keep_fairseqs_body():
    """Without a gradient norm (valid_step) fairseq's own method runs."""
    trainer = _fake_trainer(0.0)
    outputs = [{"loss": torch.tensor(6.0), "ntokens": 3, "nsentences": 1, "sample_size": 3}]
    with metrics.aggregate(new_root=True):
        returned = MegatronTrainer._reduce_and_log_stats(trainer, outputs, 3)
    assert isinstance(returned, dict) and returned["sample_size"] == 3


def test_prefetch_threads_stop_before_exit():
    """fairseq's BufferedIterator keeps a daemon thread collating batches after
    a run stops early; the exit hook our trainer registers stops and joins
    it, also when its queue is full."""
    from fairseq.data import iterators

    from fairseq_megatron.fairseq_integration import prefetch

    produced = []

    def batches():
        for i in range(1000):
            produced.append(i)
            yield torch.full((4,), i)

    buffered = iterators.BufferedIterator(2, list(range(1000)))  # total 1000
    buffered._iterable = batches()
    first = next(buffered)
    assert torch.equal(first, torch.zeros(4))
    thread = buffered._consumer
    assert thread.is_alive()  # blocked on its full queue, as after a run that stopped early
    prefetch.stop_prefetch_threads(timeout=10)
    assert not thread.is_alive()
    assert len(produced) < 1000, "the thread ran to the end instead of stopping"
