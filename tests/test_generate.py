"""fairseq-generate's output over data-parallel shards: scores merged, batches interleaved.

The end-to-end runs (tests/test_end_to_end.py) compare whole outputs of
torchrun and spawned processes with one process; here each part is checked
against fairseq's own scorer run once over all sentences.
"""

import random

import pytest
import torch
from fairseq.scoring.bleu import BleuConfig, SacrebleuConfig, SacrebleuScorer, Scorer
from fairseq.scoring.chrf import ChrFScorer, ChrFScorerConfig
from omegaconf import OmegaConf

from fairseq_megatron.generate import (
    BatchwiseOutput,
    GenerationTimer,
    ShardScorer,
    _interleaved,
    merge_scorer_statistics,
    scorer_statistics,
)

rng = random.Random(0)
WORDS = "the a model parallel rank group shard token layer head".split()
PAIRS = [(" ".join(rng.choices(WORDS, k=rng.randint(3, 12))), " ".join(rng.choices(WORDS, k=rng.randint(1, 12))))
         for _ in range(40)]


def add(scorer, pairs):
    for ref, pred in pairs:
        if hasattr(scorer, "add_string"):
            scorer.add_string(ref, pred)
        else:  # fairseq's "bleu" scores token ids (pad 1, eos 2, unk 3; words from 4)
            def ids(s):
                return torch.IntTensor([4 + WORDS.index(w) for w in s.split()])

            scorer.add(ids(ref), ids(pred))


SCORERS = {  # fairseq's --scoring choices, as fairseq_cli.generate builds them
    "bleu": lambda: Scorer(BleuConfig(pad=1, eos=2, unk=3)),
    "sacrebleu": lambda: SacrebleuScorer(SacrebleuConfig()),
    "chrf": lambda: ChrFScorer(ChrFScorerConfig()),
}


@pytest.mark.parametrize("scoring", sorted(SCORERS))
@pytest.mark.parametrize("shards", [2, 3])
def test_merged_scorer_scores_the_whole_subset(scoring, shards):
    """Shard g gets sentences g, g + D, ...; shard 2 of 3 none for the BLEU
    of 2 sentences. The merged score is fairseq's score of all sentences,
    exactly: the same counts (bleu) or the same strings in another order
    (corpus statistics are sums over sentences)."""
    for pairs in (PAIRS, PAIRS[:2]):
        whole = SCORERS[scoring]()
        add(whole, pairs)
        parts = []
        for g in range(shards):
            part = SCORERS[scoring]()
            add(part, pairs[g::shards])
            parts.append(part)
        merged = parts[0]
        assert merge_scorer_statistics(merged, [scorer_statistics(p) for p in parts])
        assert merged.result_string() == whole.result_string()
        if len(pairs) > shards:  # each shard alone scores differently: the merge did something
            assert parts[1].result_string() != whole.result_string()


def test_a_scorer_of_unknown_statistics_keeps_each_shards_line():
    class Perplexity:  # a user's scorer that fairseq_megatron cannot merge
        def __init__(self, value):
            self.value = value

        def result_string(self):
            return f"PPL {self.value}"

    shards = [Perplexity(3.0), Perplexity(5.0)]
    assert scorer_statistics(shards[0]) is None
    assert not merge_scorer_statistics(shards[0], [scorer_statistics(s) for s in shards])
    assert ShardScorer(shards[1]).result_string() == "PPL 5.0"  # its own, not a placeholder
    cfg = OmegaConf.create({"dataset": {"gen_subset": "test"}, "generation": {"beam": 1}})
    texts = [["", "H-0\n", f"Generate test with beam=1: {s.result_string()}\n"] for s in shards]
    assert _interleaved(texts, cfg, None).splitlines() == [
        "H-0", "H-0",
        "Generate test with beam=1: PPL 3.0 (data-parallel group 0 of 2 only)",
        "Generate test with beam=1: PPL 5.0 (data-parallel group 1 of 2 only)"]


def test_batches_are_printed_in_the_order_they_were_dealt():
    """5 batches over 2 shards: shard 0 got 0, 2, 4 and shard 1 got 1, 3
    and an empty batch (fairseq's padding, no "net_input"). What each shard
    printed before its batches comes from shard 0, the score line is
    recomputed, other closing lines are shard 0's."""
    dealt = [[0, 2, 4], [1, 3, None]]
    shards = []
    for g, batches in enumerate(dealt):
        out = BatchwiseOutput()
        print(f"config of shard {g}", file=out)
        samples = [{"id": [b], "net_input": {}} if b is not None else {} for b in batches]
        for sample in out.batches(samples):
            if "net_input" in sample:
                print(f"H-{sample['id'][0]}", file=out)
        print("Generate test with beam=1: BLEU of this shard", file=out)
        print(f"closing line of shard {g}", file=out)
        assert len(out.texts()) == 1 + 3 + 1 and out.sentences == sum(b is not None for b in batches)
        shards.append(out.texts())

    class Whole:
        def result_string(self):
            return "BLEU of all"

    cfg = OmegaConf.create({"dataset": {"gen_subset": "test"}, "generation": {"beam": 1}})
    assert _interleaved(shards, cfg, Whole()).splitlines() == [
        "config of shard 0", "H-0", "H-1", "H-2", "H-3", "H-4",
        "Generate test with beam=1: BLEU of all", "closing line of shard 0"]


def test_the_rate_of_a_shard_without_batches_is_nan():
    """fairseq-generate's closing line divides by the timer's seconds on
    every rank; a shard without batches has none."""
    timer = GenerationTimer()
    rates = (0 / timer.sum, 1.0 / timer.avg)
    assert all(rate != rate for rate in rates)  # nan
    timer.start()
    timer.stop(7)
    assert timer.sum > 0 and 7 / timer.sum > 0
