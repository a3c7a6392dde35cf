"""fairseq-generate over several data-parallel groups: one output, in the order one process prints it.

fairseq-generate (``fairseq_cli/generate.py``) is a one-process tool that
nevertheless shards its batches by ``--distributed-world-size`` and
``--distributed-rank``. Found on CPU with the demo checkpoint (172 validation
blocks of 64 tokens, ``--batch-size 16``):

1. Without a launcher and with a world size above 1 (fairseq's default is
   the number of visible GPUs) it generated shard 0 alone: 88 of the 172
   blocks at world size 2, with no word about the rest.
2. Under torchrun at model-parallel size 1 every process generated and
   printed the whole subset: 344 hypotheses for 172 blocks.
3. With two data-parallel groups (model-parallel size 2 in a world of 4)
   the model-parallel rank 0 of each group opened ``--results-path``'s
   ``generate-valid.txt`` for writing: the file held both groups' lines
   overwriting each other (85 source lines for 88 hypotheses, one line cut
   in half), and two BLEU lines, each of one group's shard.
4. A shard without a batch (more shards than batches: 3 processes, 2
   batches) failed with ZeroDivisionError, in fairseq's closing log line and
   in its BLEU of no sentences.

``fairseq_integration`` step 6 now launches fairseq-generate as fairseq
launches fairseq-eval-lm (one process per rank of the world size; 1 and 2
above), and :func:`generate_over_data_parallel_groups` makes the groups'
output one (3): each group's lines are collected batch by batch, and global
rank 0 prints them (or writes them under a temporary name, then renames)
interleaved as the batches were dealt out, which is the order of a run in
one process, followed by one score line computed from the statistics of all
groups (:func:`merge_scorer_statistics`). :class:`GenerationTimer` and
:class:`ShardScorer` fix 4. ``--results-path`` goes through the same
collection in one process too: fairseq emptied the file before it loaded
the model and wrote it line by line, so a failed run left an empty or
partial file in place of the last run's.
"""

import contextvars
import logging
import os
import sys
from typing import Iterable, List, Optional

import torch.distributed as dist
from fairseq.logging.meters import StopwatchMeter
from fairseq.scoring import BaseScorer
from fairseq.scoring.bleu import Scorer as BleuScorer
from fairseq.scoring.wer import WerScorer

from fairseq_megatron import parallel_state

logger = logging.getLogger(__name__)


class BatchwiseOutput:
    """The text fairseq-generate prints for one shard, cut where each batch begins.

    A write-only text file for ``fairseq_cli.generate._main``:
    ``pieces[0]`` holds what it printed before its first batch,
    ``pieces[1 + i]`` what it printed for batch i of this shard (nothing for
    the empty batches that pad a short shard), and the last piece what it
    printed after its last batch (the score line). :meth:`batches` marks the
    cuts; ``sentences`` counts the samples of the non-empty batches.
    """

    def __init__(self):
        self.pieces: List[List[str]] = [[]]
        self.sentences = 0

    def write(self, text: str) -> int:
        self.pieces[-1].append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def batches(self, iterator: Iterable) -> Iterable:
        """``iterator``'s batches, starting a piece before each and after the last."""
        for sample in iterator:
            self.pieces.append([])
            if "net_input" in sample:
                self.sentences += len(sample["id"])
            yield sample
        self.pieces.append([])

    def texts(self) -> List[str]:
        return ["".join(piece) for piece in self.pieces]


class _NoSeconds(float):
    """Zero seconds, by which a number divides to nan (a rate of nothing in
    no time) instead of raising ZeroDivisionError."""

    def __rtruediv__(self, other):
        return float("nan")


class GenerationTimer(StopwatchMeter):
    """fairseq-generate's ``gen_timer``. fairseq divides by its seconds for
    the "Translated N sentences" line on every rank, and a shard with no
    batch (more data-parallel groups than batches) failed there with
    ZeroDivisionError; its rates are now nan (that line is logged by rank 0
    only, whose shard holds the first batch)."""

    def __init__(self, round: Optional[int] = None):
        super().__init__(round)
        self.sum = _NoSeconds()

    def reset(self):
        super().reset()
        self.sum = _NoSeconds()


class ShardScorer:
    """One shard's scorer while its output is collected: fairseq's
    ``scorer`` for everything but ``result_string``, which
    :func:`generate_over_data_parallel_groups` computes over all shards (a
    shard's own is not printed, and fails for a shard without sentences:
    BLEU divides by their length). Scorers whose statistics
    :func:`scorer_statistics` does not know keep their own."""

    def __init__(self, scorer):
        self.scorer = scorer

    def __getattr__(self, name):
        return getattr(self.scorer, name)

    def result_string(self, *args, **kwargs) -> str:
        if scorer_statistics(self.scorer) is None:
            return self.scorer.result_string(*args, **kwargs)
        return "(this shard's part of the score over all shards)"


class BatchCuttingProgressBar:
    """A fairseq progress bar whose iteration goes through
    :meth:`BatchwiseOutput.batches`; anything else is the bar's."""

    def __init__(self, bar, output: BatchwiseOutput):
        self.bar = bar
        self.output = output

    def __iter__(self):
        return iter(self.output.batches(self.bar))

    def __getattr__(self, name):
        return getattr(self.bar, name)


# The output being collected by this process's fairseq-generate, if any:
# read by the stand-ins that fairseq_integration puts in fairseq_cli.generate.
collecting: contextvars.ContextVar[Optional[BatchwiseOutput]] = contextvars.ContextVar(
    "fairseq_generate_output", default=None)


def scorer_statistics(scorer) -> Optional[list]:
    """What :func:`merge_scorer_statistics` needs of one shard's fairseq scorer,
    picklable; None for a scorer whose statistics it does not know.

    ``bleu`` keeps n-gram counts in a C struct (``BleuStat``), ``wer`` an
    edit distance and a reference length, and the others (``sacrebleu``,
    ``chrf``, ``meteor``, ``bert_score``) the reference and hypothesis
    strings (``fairseq/scoring/``)."""
    if isinstance(scorer, BleuScorer):
        return [getattr(scorer.stat, name) for name, _ in scorer.stat._fields_]
    if isinstance(scorer, WerScorer):
        return [scorer.distance, scorer.ref_length]
    if isinstance(scorer, BaseScorer):
        return [scorer.ref, scorer.pred]
    return None


def merge_scorer_statistics(scorer, statistics: List[Optional[list]]) -> bool:
    """Give ``scorer`` the statistics of all shards, ``statistics`` (one
    :func:`scorer_statistics` per shard, in shard order), so that its
    ``result_string()`` scores the whole subset: counts are summed, strings
    concatenated (corpus scores do not depend on the order of sentences).
    Returns False, changing nothing, when any shard's statistics are unknown."""
    if any(s is None for s in statistics):
        return False
    if isinstance(scorer, BleuScorer):
        for k, (name, _) in enumerate(scorer.stat._fields_):
            setattr(scorer.stat, name, sum(s[k] for s in statistics))
    elif isinstance(scorer, WerScorer):
        scorer.distance = sum(s[0] for s in statistics)
        scorer.ref_length = sum(s[1] for s in statistics)
    else:
        scorer.ref = [line for s in statistics for line in s[0]]
        scorer.pred = [line for s in statistics for line in s[1]]
    return True


def generate_over_data_parallel_groups(original_main, cfg):
    """Run fairseq-generate's ``main(cfg)`` on this rank's shard, then print
    the output of all data-parallel groups once, from global rank 0.

    Every rank collects its output in a :class:`BatchwiseOutput` (fairseq's
    ``main`` runs with ``--results-path`` unset, so it opens no file); the
    pieces of each group's model-parallel rank 0 and every group's scorer
    statistics are gathered over the data-parallel group. Shard g of D holds
    batches g, g + D, g + 2D, ... (fairseq's ``ShardedIterator``, padded
    with empty batches to equal length), so batch i of shard g is printed
    at position i * D + g. Rank 0 then prints what shard 0 printed before
    its first batch, the batches, and shard 0's closing lines with the score
    line recomputed over all shards (if the scorer's statistics are unknown,
    each shard's score line, marked as such). With ``--results-path`` the
    text goes to ``generate-<subset>.txt`` through a temporary file that is
    renamed when complete, also from one process or one group (fairseq
    truncated the file first, then wrote line by line: a run that failed
    left a partial file, or an empty one in place of the last run's).

    Returns rank 0's scorer (merged) on every rank of model-parallel rank 0's
    group; the others return their own shard's scorer, as fairseq's ``main``.
    """
    output = BatchwiseOutput()
    results_path = cfg.common_eval.results_path
    cfg.common_eval.results_path = None
    token = collecting.set(output)
    try:
        scorer = original_main(cfg)
        scorer = scorer.scorer if isinstance(scorer, ShardScorer) else scorer
    finally:
        collecting.reset(token)
        cfg.common_eval.results_path = results_path

    distributed = dist.is_initialized()
    printing = not distributed or parallel_state.get_tensor_model_parallel_rank() == 0
    mine = (output.texts() if printing else None, scorer_statistics(scorer), output.sentences)
    shards = parallel_state.get_data_parallel_world_size() if distributed else 1
    gathered = [mine]
    if shards > 1:
        gathered = [None] * shards
        dist.all_gather_object(gathered, mine, group=parallel_state.get_data_parallel_group())
    if not printing:
        return scorer
    merged = merge_scorer_statistics(scorer, [statistics for _, statistics, _ in gathered])
    if not distributed or dist.get_rank() == 0:
        text = _interleaved([texts for texts, _, _ in gathered], cfg, scorer if merged else None)
        _write(text, results_path, cfg.dataset.gen_subset)
        if shards > 1:
            sentences = sum(count for _, _, count in gathered)
            logger.info("generate: %d data-parallel groups translated %s sentences together", shards,
                        f"{sentences:,}")
    return scorer


def _interleaved(shard_texts: List[List[str]], cfg, merged_scorer) -> str:
    """One text from the pieces of every shard (see
    :func:`generate_over_data_parallel_groups`)."""
    batches = [texts[1:-1] for texts in shard_texts]
    if len({len(b) for b in batches}) != 1:  # fairseq pads every shard to the same number of batches
        raise RuntimeError(f"the data-parallel groups generated {[len(b) for b in batches]} batches")
    lines = [shard_texts[0][0]]
    lines += [batches[g][i] for i in range(len(batches[0])) for g in range(len(batches))]
    score_line = f"Generate {cfg.dataset.gen_subset} with beam={cfg.generation.beam}: "
    for line in shard_texts[0][-1].splitlines(keepends=True):
        if not line.startswith(score_line):
            lines.append(line)
        elif merged_scorer is not None:
            lines.append(score_line + merged_scorer.result_string() + "\n")
        else:
            for g, texts in enumerate(shard_texts):
                lines += [f"{own.rstrip()} (data-parallel group {g} of {len(shard_texts)} only)\n"
                          for own in texts[-1].splitlines() if own.startswith(score_line)]
    return "".join(lines)


def _write(text: str, results_path: Optional[str], subset: str) -> None:
    """Print ``text``, or write it to fairseq's results file without ever
    leaving a partial file under that name."""
    if results_path is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    os.makedirs(results_path, exist_ok=True)
    path = os.path.join(results_path, f"generate-{subset}.txt")
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
