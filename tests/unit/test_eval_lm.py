"""fairseq-eval-lm's context-window batches (in one process; the distributed
runs are in tests/e2e/).

:class:`ContextWindowDataset` must produce exactly the batches of fairseq's
``LMContextWindowDataset`` when batches are collated in order (the only
order that dataset gets right), and the same batches in any other order.
Token ids are compared exactly: no arithmetic is involved."""

import random

import pytest
import torch
from fairseq.data import LMContextWindowDataset, MonolingualDataset, TokenBlockDataset

from fairseq_megatron.fairseq_integration.eval_lm import ContextWindowDataset
from tests.helpers import make_dictionary
from tests.support.eval_lm import CONTEXT, batches, fake_samples


def monolingual(break_mode: str, tokens_per_sample: int):
    dictionary = make_dictionary()
    gen = torch.Generator().manual_seed(0)
    lines = [torch.cat([torch.randint(4, len(dictionary), (int(n),), generator=gen), torch.tensor([dictionary.eos()])])
             for n in torch.randint(1, 9, (20,), generator=gen)]
    blocks = TokenBlockDataset(lines, [len(line) for line in lines], tokens_per_sample, pad=dictionary.pad(),
                               eos=dictionary.eos(), break_mode=break_mode, include_targets=True)
    dataset = MonolingualDataset(blocks, blocks.sizes, dictionary, dictionary, add_eos_for_other_targets=False,
                                 shuffle=False, targets=["future"])
    return dataset, dictionary.pad()


def collate(dataset, indices):
    return dataset.collater([dataset[i] for i in indices])


def assert_same_batch(ours, theirs):
    assert ours["id"].tolist() == theirs["id"].tolist()
    assert ours["start_indices"] == theirs["start_indices"]
    for key in ("src_tokens", "src_lengths"):
        assert torch.equal(ours["net_input"][key], theirs["net_input"][key]), key
    assert torch.equal(ours["target"], theirs["target"])
    assert ours["ntokens"] == theirs["ntokens"]


def run_fairseqs_eval_lm(monkeypatch, post_process, remove_bos_token, seed, keep_words=False, **flags):
    """fairseq's own ``eval_lm`` over 4 batches of :func:`fake_hypos`
    through a stubbed scorer, and a tally fed the same hypotheses:
    ``(tally, fairseq's result, tokens in all hypotheses)``."""
    from fairseq.sequence_scorer import SequenceScorer

    from fairseq_megatron.fairseq_integration import eval_lm
    from fairseq_megatron.fairseq_integration.patching import original

    dictionary, samples = fake_samples(seed, remove_bos_token)
    monkeypatch.setattr(SequenceScorer, "generate", lambda self, models, sample: sample["hypos"])
    fairseq_eval_lm = original(eval_lm._cli(), "eval_lm")
    result = fairseq_eval_lm([torch.nn.Linear(1, 1)], dictionary, samples, post_process=post_process,
                             target_dictionary=dictionary, remove_bos_token=remove_bos_token, **flags)
    tally = eval_lm._ScoreTally(dictionary, post_process, remove_bos_token, torch.device("cpu"), keep_words)
    for sample in samples:
        tally.add(sample["hypos"], sample["id"].tolist())
    return tally, result, sum(hypo[0]["tokens"].numel() for sample in samples for hypo in sample["hypos"])


@pytest.mark.parametrize("break_mode", ["none", "eos"])
def test_same_batches_as_fairseq_in_any_order(break_mode):
    tokens_per_sample = 5
    base, pad = monolingual(break_mode, tokens_per_sample)
    plan = batches(base, batch_size=3)
    assert len(plan) >= 5
    fairseq_ctx = LMContextWindowDataset(base, tokens_per_sample, CONTEXT, pad)
    in_order = [collate(fairseq_ctx, b) for b in plan]
    assert max(s for batch in in_order for s in batch["start_indices"]) == CONTEXT  # full windows occur

    ours = ContextWindowDataset(base, tokens_per_sample, CONTEXT, pad)
    for batch, expected in zip(plan, in_order):
        assert_same_batch(collate(ours, batch), expected)

    # Shards and workers see every other batch, or batches out of order.
    order = list(range(len(plan)))
    random.Random(0).shuffle(order)
    for shuffled_order in (order, order[::2] + order[1::2]):
        fresh = ContextWindowDataset(base, tokens_per_sample, CONTEXT, pad)
        for k in shuffled_order:
            assert_same_batch(collate(fresh, plan[k]), in_order[k])

    # Read backwards, every sample's context is rebuilt from the samples before it.
    backwards = ContextWindowDataset(base, tokens_per_sample, CONTEXT, pad)
    forwards = ContextWindowDataset(base, tokens_per_sample, CONTEXT, pad)
    expected = [forwards[i]["context"] for i in range(len(base))]
    for i in reversed(range(len(base))):
        assert torch.equal(backwards[i]["context"], expected[i]), i

    # fairseq's dataset carries its context from the batch it collated last:
    # the same out-of-order reading gives different source tokens.
    stale = LMContextWindowDataset(base, tokens_per_sample, CONTEXT, pad)
    differs = [not torch.equal(collate(stale, plan[k])["net_input"]["src_tokens"], in_order[k]["net_input"]["src_tokens"])
               for k in order]
    assert any(differs)


def test_empty_batch_collates_to_nothing():
    """fairseq pads short shards with empty batches; eval-lm skips ``{}``
    (fairseq's context dataset raised KeyError 'net_input' instead)."""
    base, pad = monolingual("none", 5)
    assert ContextWindowDataset(base, 5, CONTEXT, pad).collater([]) == {}
    with pytest.raises(KeyError):
        LMContextWindowDataset(base, 5, CONTEXT, pad).collater([])


def test_context_window_must_be_positive():
    base, pad = monolingual("none", 5)
    with pytest.raises(ValueError, match="context_window must be positive"):
        ContextWindowDataset(base, 5, 0, pad)


@pytest.mark.parametrize("post_process,remove_bos_token", [(None, False), (None, True), ("@@ ", False)])
def test_tally_reproduces_fairseqs_loss(monkeypatch, post_process, remove_bos_token):
    """The sum and count the tally takes from the scorer's hypotheses give
    the loss fairseq's own ``eval_lm`` prints, under its BOS and BPE rules
    (fed the same hypotheses through a stubbed scorer). Tolerance 1e-6
    relative: fairseq sums in float32, the tally in float64."""
    import math

    tally, result, all_tokens = run_fairseqs_eval_lm(monkeypatch, post_process, remove_bos_token, seed=0)
    count = tally.count.item()
    assert count > 0 and math.isfinite(tally.log_prob_sum.item())
    tally_loss = -tally.log_prob_sum.item() / count / math.log(2)
    assert tally_loss == pytest.approx(float(result["loss"]), rel=1e-6)
    if post_process:  # continuations were there to skip
        assert count < all_tokens


@pytest.mark.parametrize("post_process,remove_bos_token", [(None, False), (None, True), ("@@ ", False)])
def test_word_lines_reproduce_fairseqs(monkeypatch, caplog, post_process, remove_bos_token):
    """The ``--output-word-probs`` and ``--output-word-stats`` lines rebuilt
    from the words the tally keeps equal, character for character, the
    lines fairseq's own ``eval_lm`` logs for the same hypotheses (BPE
    continuations joined into words, BOS removed). fairseq-eval-lm prints
    these rebuilt lines for two or more data-parallel groups."""
    from fairseq_megatron.fairseq_integration import eval_lm

    with caplog.at_level("INFO", logger="fairseq_cli.eval_lm"):
        tally, _, _ = run_fairseqs_eval_lm(monkeypatch, post_process, remove_bos_token, seed=1, keep_words=True,
                                           output_word_probs=True, output_word_stats=True)
    theirs = [r.getMessage() for r in caplog.records
              if r.name == "fairseq_cli.eval_lm" and not r.getMessage().startswith("Evaluated")]
    ours = eval_lm.word_lines(tally.batches, output_word_probs=True, output_word_stats=True)
    assert len(ours) > 12 and ours == theirs  # 12 samples' lines, then one line per word
    if post_process:  # words were joined from pieces
        assert any(line.split("\t")[3] == "True" for line in ours[12:]), ours[12:]
