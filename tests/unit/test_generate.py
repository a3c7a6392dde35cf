"""fairseq-generate's output over data-parallel shards: scores merged, batches interleaved;
fairseq-interactive's input over data-parallel groups.

The end-to-end runs (tests/e2e/test_generate.py) compare whole outputs of
torchrun and spawned processes with one process; here each part is checked
against fairseq's own scorer run once over all sentences."""

import os
import random

import pytest
import torch
from fairseq.scoring.bleu import BleuConfig, SacrebleuConfig, SacrebleuScorer, Scorer
from fairseq.scoring.chrf import ChrFScorer, ChrFScorerConfig
from omegaconf import OmegaConf

from fairseq_megatron.fairseq_integration.generate import (
    GenerationTimer,
    ShardScorer,
    _closing_text,
    _ResultsFile,
    merge_scorer_statistics,
    scorer_statistics,
)

rng = random.Random(0)
WORDS = "the a model parallel rank group shard token layer head".split()
PAIRS = [(" ".join(rng.choices(WORDS, k=rng.randint(3, 12))), " ".join(rng.choices(WORDS, k=rng.randint(1, 12))))
         for _ in range(40)]
SCORERS = {  # fairseq's --scoring choices, as fairseq_cli.generate builds them
    "bleu": lambda: Scorer(BleuConfig(pad=1, eos=2, unk=3)),
    "sacrebleu": lambda: SacrebleuScorer(SacrebleuConfig()),
    "chrf": lambda: ChrFScorer(ChrFScorerConfig()),
}


def add(scorer, pairs):
    for ref, pred in pairs:
        if hasattr(scorer, "add_string"):
            scorer.add_string(ref, pred)
        else:  # fairseq's "bleu" scores token ids (pad 1, eos 2, unk 3; words from 4)
            def ids(s):
                return torch.IntTensor([4 + WORDS.index(w) for w in s.split()])

            scorer.add(ids(ref), ids(pred))


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
    closings = [f"Generate test with beam=1: {s.result_string()}\nclosing line of shard {g}\n"
                for g, s in enumerate(shards)]
    assert _closing_text(closings, cfg, None).splitlines() == [
        "Generate test with beam=1: PPL 3.0 (data-parallel group 0 of 2 only)",
        "Generate test with beam=1: PPL 5.0 (data-parallel group 1 of 2 only)",
        "closing line of shard 0"]


def test_a_results_file_appears_only_when_complete(tmp_path):
    """fairseq's results file: written under a temporary name, renamed when
    the run ends; a run that fails leaves the last run's file as it was."""
    path = tmp_path / "results" / "generate-test.txt"
    with _ResultsFile(str(tmp_path / "results"), "test") as out:
        out.write("H-0\n")
        assert not path.exists()
    assert path.read_text() == "H-0\n"
    with pytest.raises(RuntimeError):
        with _ResultsFile(str(tmp_path / "results"), "test") as out:
            out.write("H-0 of a run that fails\n")
            raise RuntimeError("generation failed")
    assert path.read_text() == "H-0\n" and os.listdir(tmp_path / "results") == ["generate-test.txt"]


def test_the_rate_of_a_shard_without_batches_is_nan():
    """fairseq-generate's closing line divides by the timer's seconds on
    every rank; a shard without batches has none."""
    timer = GenerationTimer()
    rates = (0 / timer.sum, 1.0 / timer.avg)
    assert all(rate != rate for rate in rates)  # nan
    timer.start()
    timer.stop(7)
    assert timer.sum > 0 and 7 / timer.sum > 0
