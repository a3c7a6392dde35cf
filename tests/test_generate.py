"""fairseq-generate's output over data-parallel shards: scores merged, batches interleaved;
fairseq-interactive's input over data-parallel groups.

The end-to-end runs (tests/test_end_to_end.py) compare whole outputs of
torchrun and spawned processes with one process; here each part is checked
against fairseq's own scorer run once over all sentences.
"""

import io
import os
import random

import pytest
import torch
from fairseq.scoring.bleu import BleuConfig, SacrebleuConfig, SacrebleuScorer, Scorer
from fairseq.scoring.chrf import ChrFScorer, ChrFScorerConfig
from omegaconf import OmegaConf

from fairseq_megatron.fairseq_integration.generate import (
    BatchwiseOutput,
    GenerationTimer,
    RoundWriter,
    ShardScorer,
    _closing_text,
    _ResultsFile,
    merge_scorer_statistics,
    scorer_statistics,
)
from tests.helpers import init_model_parallel, run_distributed

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
    closings = [f"Generate test with beam=1: {s.result_string()}\nclosing line of shard {g}\n"
                for g, s in enumerate(shards)]
    assert _closing_text(closings, cfg, None).splitlines() == [
        "Generate test with beam=1: PPL 3.0 (data-parallel group 0 of 2 only)",
        "Generate test with beam=1: PPL 5.0 (data-parallel group 1 of 2 only)",
        "closing line of shard 0"]


def _dealt_worker(rank, world_size, dealt):
    """Shard ``rank`` prints its batches ``dealt[rank]`` (None: an empty
    batch) through a BatchwiseOutput into a RoundWriter over the
    data-parallel group of ``world_size`` (model-parallel size 1); returns
    what rank 0 had written when its loop reached each batch, and at the end."""
    from fairseq_megatron.parallel import parallel_state

    init_model_parallel(1)
    assert parallel_state.get_data_parallel_world_size() == world_size
    out = io.StringIO() if rank == 0 else None
    output = BatchwiseOutput(RoundWriter(out, parallel_state.get_data_parallel_group()).piece)
    print(f"config of shard {rank}", file=output)
    written_before = []
    samples = [{"id": [b], "net_input": {}} if b is not None else {} for b in dealt[rank]]
    for sample in output.batches(samples):
        written_before.append(out.getvalue() if out is not None else None)
        if "net_input" in sample:
            print(f"H-{sample['id'][0]}", file=output)
    print("Generate test with beam=1: BLEU of this shard", file=output)
    return written_before, out.getvalue() if out is not None else None, output.rest(), output.sentences


def test_batches_are_printed_in_the_order_they_were_dealt_while_generating(tmp_path):
    """5 batches over 2 shards (2 processes): shard 0 got 0, 2, 4 and shard
    1 got 1, 3 and an empty batch (fairseq's padding, no "net_input").
    Rank 0 writes what shard 0 printed before its batches, then each round
    of batches as soon as both shards finished it: when its loop reaches
    batch 2k, batches 0 .. 2k - 1 are written. The closing lines stay with
    each shard (merged by _closing_text at the end)."""
    results = run_distributed(_dealt_worker, 2, tmp_path, [[0, 2, 4], [1, 3, None]])
    written_before, written, closing, sentences = results[0]
    assert written_before == ["config of shard 0\n", "config of shard 0\nH-0\nH-1\n",
                              "config of shard 0\nH-0\nH-1\nH-2\nH-3\n"]
    assert written == "config of shard 0\nH-0\nH-1\nH-2\nH-3\nH-4\n"
    assert closing == "Generate test with beam=1: BLEU of this shard\n" and sentences == 3
    assert results[1][1] is None and results[1][3] == 2  # rank 1 writes nothing


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


def _interactive_worker(rank, world_size, path):
    import inspect

    from fairseq_cli import interactive

    from fairseq_megatron.parallel import parallel_state

    init_model_parallel(2)
    read = interactive.buffered_read  # the plugin's (installed on import), over fairseq's own
    assert inspect.unwrap(read) is not read
    return parallel_state.get_data_parallel_rank(), list(read(path, 2))


def test_interactive_input_goes_to_data_parallel_group_0_only(tmp_path):
    """fairseq-interactive at model-parallel size 2 in a world of 4 (two
    groups): rank 0 reads the input and both ranks of its group get every
    buffer of lines; the other group's ranks get none (they computed the
    same answers, which only rank 0 prints) and still end with rank 0."""
    path = tmp_path / "prompts.txt"
    path.write_text("one\ntwo\nthree\n")
    results = run_distributed(_interactive_worker, 4, tmp_path, str(path))
    assert [group for group, _ in results] == [0, 0, 1, 1]
    assert [buffers for _, buffers in results] == [[["one", "two"], ["three"]]] * 2 + [[]] * 2
