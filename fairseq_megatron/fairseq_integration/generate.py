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

:func:`main` now launches fairseq-generate as fairseq launches
fairseq-eval-lm (one process per rank of the world size; 1 and 2 above),
and :func:`generate_over_data_parallel_groups` makes the groups' output one
(3): each group's lines are cut where its batches begin, and
after every round of batches (one per group) global rank 0 prints that
round's (or writes them to a temporary file, renamed when complete) in the
order the batches were dealt out, which is the order of a run in one
process; at the end, one score line computed from the statistics of all
groups (:func:`merge_scorer_statistics`). :class:`GenerationTimer` and
:class:`ShardScorer` fix 4. ``--results-path`` goes through the same
writer in one process too: fairseq emptied the file before it loaded the
model and wrote it line by line, so a failed run left an empty or partial
file in place of the last run's.
"""

import contextlib
import contextvars
import logging
import os
import sys
from typing import Callable, Iterable, List, Optional, TextIO

import torch.distributed as dist
from fairseq.logging.meters import StopwatchMeter
from fairseq.scoring import BaseScorer
from fairseq.scoring.bleu import Scorer as BleuScorer
from fairseq.scoring.wer import WerScorer

from fairseq_megatron.files import new_temporary
from fairseq_megatron.fairseq_integration.patching import (
    ModuleWith,
    original,
    plugin_on_command_line,
    replace_in_cli_module,
)
from fairseq_megatron.parallel import parallel_state

logger = logging.getLogger(__name__)


class BatchwiseOutput:
    """The text fairseq-generate prints for one shard, cut where each batch begins.

    A write-only text file for ``fairseq_cli.generate._main``. Iterating
    through :meth:`batches` cuts the text: what was printed before the first
    batch, then what was printed for each batch of this shard (nothing for
    the empty batches that pad a short shard), each handed to
    ``deliver(text)`` once complete, in that order. A shard without batches
    delivers only the first piece, when its iteration ends. :meth:`rest`
    is what was printed since the last cut (the closing and score lines).
    ``sentences`` counts the samples of the non-empty batches.
    """

    def __init__(self, deliver: Optional[Callable[[str], None]] = None):
        self.deliver = deliver
        self.sentences = 0
        self._piece: List[str] = []

    def write(self, text: str) -> int:
        self._piece.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def rest(self) -> str:
        """The text since the last cut, which starts a new piece."""
        text, self._piece = "".join(self._piece), []
        return text

    def _cut(self) -> None:
        text = self.rest()
        if self.deliver is not None:
            self.deliver(text)

    def batches(self, iterator: Iterable) -> Iterable:
        """``iterator``'s batches, cutting before each and after the last."""
        for sample in iterator:
            self._cut()
            if "net_input" in sample:
                self.sentences += len(sample["id"])
            yield sample
        self._cut()


class RoundWriter:
    """Writes the pieces of all shards in the order of one process, round by round.

    Every printing rank (model-parallel rank 0 of each data-parallel group)
    passes its :class:`BatchwiseOutput` pieces to :meth:`piece`. The first
    is what fairseq printed before its batches: shard 0's is written. Each
    later call is one round: batch i of every shard, gathered over the
    data-parallel ``group`` (None: one shard) and written in shard order,
    g = 0 .. D - 1, which is the order of batch i * D + g in one process
    (fairseq's ``ShardedIterator`` deals batch k to shard k mod D and pads
    the short shards with empty batches, so every shard delivers as many
    pieces). ``out`` is where global rank 0 writes, None on the other ranks.
    """

    def __init__(self, out: Optional[TextIO], group=None):
        self.out = out
        self.group = group
        self.rounds = -1  # the first piece is no round

    def piece(self, text: str) -> None:
        self.rounds += 1
        if self.rounds == 0:
            self._write(text)
            return
        texts = [text]
        if self.group is not None:
            texts = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(texts, text, group=self.group)
        self._write("".join(texts))

    def _write(self, text: str) -> None:
        if self.out is not None and text:
            self.out.write(text)
            self.out.flush()


class _NoSeconds(float):
    """Zero seconds, by which a number divides to nan (a rate of nothing in
    no time) instead of raising ZeroDivisionError. fairseq-generate's
    ``_main`` divides by the timer's ``sum`` and ``avg`` itself, in its
    closing log line; the timer's class is the only part of that line a
    replacement reaches, and its seconds the only value it can give."""

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
    :func:`scorer_statistics` does not know keep their own.

    A wrapper, as fairseq offers no other way: ``_main`` builds the scorer
    the user names from fairseq's registry (any class) and calls its methods
    itself, ``add_string`` or ``add`` (whichever the class has) for each
    sentence and ``result_string`` in its closing line."""

    def __init__(self, scorer):
        self.scorer = scorer

    def __getattr__(self, name):
        return getattr(self.scorer, name)

    def result_string(self, *args, **kwargs) -> str:
        if scorer_statistics(self.scorer) is None:
            return self.scorer.result_string(*args, **kwargs)
        return "(this shard's part of the score over all shards)"


class BatchesCut:
    """The batch iterator fairseq-generate hands its progress bar, its
    batches going through :meth:`BatchwiseOutput.batches`: what fairseq's
    progress bars read of the iterator they wrap (``fairseq/logging/progress_bar.py``:
    its length and position ``n``), and its batches."""

    def __init__(self, iterator, output: BatchwiseOutput):
        self.n = getattr(iterator, "n", 0)
        self._length = len(iterator)
        self._batches = output.batches(iterator)

    def __len__(self) -> int:
        return self._length

    def __iter__(self):
        return self._batches


# The output being collected by this process's fairseq-generate, if any: set
# by generate_over_data_parallel_groups around fairseq's main, read by the
# progress bar, timer and scorer that fairseq's _main builds (it takes no
# argument through which they could be handed the output).
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
    """Run fairseq-generate's ``main(cfg)`` on this rank's shard, printing the
    output of all data-parallel groups once, from global rank 0.

    Every rank's output goes to a :class:`BatchwiseOutput` (fairseq's
    ``main`` runs with ``--results-path`` unset, so it opens no file); on
    model-parallel rank 0 of each group its pieces go to a
    :class:`RoundWriter`, which gathers each round of batches over the
    data-parallel group while generation goes on, and global rank 0 writes
    them in the order of one process. At the end the closing lines and
    scorer statistics of all groups are gathered: rank 0 writes shard 0's
    closing lines with the score line recomputed over all shards (if the
    scorer's statistics are unknown, each shard's score line, marked as
    such). With ``--results-path`` the text goes to ``generate-<subset>.txt``
    through a temporary file that is renamed when complete and removed if
    the run fails, also from one process or one group (fairseq truncated
    the file first, then wrote line by line: a run that failed left a
    partial file, or an empty one in place of the last run's).

    Returns rank 0's scorer (merged) on model-parallel rank 0 of every
    group; the other ranks return their own shard's scorer, as fairseq's
    ``main``.
    """
    distributed = dist.is_initialized()
    printing = not distributed or parallel_state.get_tensor_model_parallel_rank() == 0
    shards = parallel_state.get_data_parallel_world_size() if distributed else 1
    group = parallel_state.get_data_parallel_group() if shards > 1 else None
    results_path = cfg.common_eval.results_path
    writing = not distributed or dist.get_rank() == 0
    with _ResultsFile(results_path, cfg.dataset.gen_subset) if writing else contextlib.nullcontext() as out:
        writer = RoundWriter(out, group) if printing else None
        output = BatchwiseOutput(writer.piece if writer is not None else None)
        cfg.common_eval.results_path = None
        token = collecting.set(output)
        try:
            with contextlib.redirect_stdout(output):  # fairseq's main hands _main sys.stdout as its output file
                scorer = original_main(cfg)
            scorer = scorer.scorer if isinstance(scorer, ShardScorer) else scorer
        finally:
            collecting.reset(token)
            cfg.common_eval.results_path = results_path
        if not printing:
            return scorer
        mine = (output.rest(), scorer_statistics(scorer), output.sentences)
        gathered = [mine]
        if group is not None:
            gathered = [None] * shards
            dist.all_gather_object(gathered, mine, group=group)
        merged = merge_scorer_statistics(scorer, [statistics for _, statistics, _ in gathered])
        if out is not None:
            out.write(_closing_text([closing for closing, _, _ in gathered], cfg, scorer if merged else None))
            out.flush()
            if shards > 1:
                sentences = sum(count for _, _, count in gathered)
                logger.info("generate: %d data-parallel groups translated %s sentences together", shards,
                            f"{sentences:,}")
    return scorer


def _closing_text(closings: List[str], cfg, merged_scorer) -> str:
    """Shard 0's closing lines (``closings``: each shard's text after its
    last batch) with fairseq's score line recomputed by ``merged_scorer``,
    or, without one, each shard's own score line marked as such."""
    lines = []
    score_line = f"Generate {cfg.dataset.gen_subset} with beam={cfg.generation.beam}: "
    for line in closings[0].splitlines(keepends=True):
        if not line.startswith(score_line):
            lines.append(line)
        elif merged_scorer is not None:
            lines.append(score_line + merged_scorer.result_string() + "\n")
        else:
            for g, closing in enumerate(closings):
                lines += [f"{own.rstrip()} (data-parallel group {g} of {len(closings)} only)\n"
                          for own in closing.splitlines() if own.startswith(score_line)]
    return "".join(lines)


class _ResultsFile(contextlib.AbstractContextManager):
    """Standard output, or with ``results_path`` fairseq's results file
    ``<results_path>/generate-<subset>.txt``, written under a temporary name
    of its own (:func:`~fairseq_megatron.files.new_temporary`) that is
    renamed when the ``with`` block ends without an error and removed when
    it fails: a run never leaves a partial file under that name, nor spoils
    the last run's, nor any other file. The temporary file is made at the
    first write."""

    def __init__(self, results_path: Optional[str], subset: str):
        self.path = None if results_path is None else os.path.join(results_path, f"generate-{subset}.txt")
        self._file: Optional[TextIO] = None
        self._tmp: Optional[str] = None

    def _open(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._tmp = new_temporary(self.path)
        self._file = open(self._tmp, "w", encoding="utf-8")

    def write(self, text: str) -> None:
        if self.path is None:
            sys.stdout.write(text)
            return
        if self._file is None:
            self._open()
        self._file.write(text)

    def flush(self) -> None:
        if self.path is None:
            sys.stdout.flush()
        elif self._file is not None:
            self._file.flush()

    def __exit__(self, kind, error, traceback):
        if self.path is None:
            sys.stdout.flush()
            return None
        try:
            if self._file is None and error is None:  # nothing written, but a complete (empty) result
                self._open()
            if self._file is not None:
                self._file.close()
            if error is None:
                os.replace(self._tmp, self.path)
        finally:
            if self._tmp is not None and os.path.exists(self._tmp):
                os.remove(self._tmp)
        return None


# ------------------------------------------------------------------ fairseq_cli.generate


def _cli():
    import fairseq_cli.generate

    return fairseq_cli.generate


def _not_model_parallel_rank_0() -> bool:
    return parallel_state.model_parallel_is_initialized() and parallel_state.get_tensor_model_parallel_rank() != 0


def main(cfg):
    """fairseq-generate's ``main`` over all ranks of the world, with
    ``--user-dir`` of this package (fairseq's own otherwise).

    ``fairseq_cli/generate.py`` calls ``main(args)`` directly, never
    fairseq's distributed launcher, yet shards its batches by the world
    size: at a world size above 1 (fairseq's default is the number of
    visible GPUs) one process generated shard 0 alone, under torchrun every
    process generated everything, and with model parallelism no
    model-parallel group (and no ``-model_part-K`` checkpoint suffix) would
    exist. It now goes through ``distributed_utils.call_main`` first, as
    fairseq-eval-lm and fairseq-interactive do: one process per rank, the
    data sharded over the data-parallel groups by the task. Every rank of a
    group computes the same hypotheses; model-parallel rank 0 prints them (or
    writes ``--results-path``), the others write to /dev/null. With two or
    more groups, :func:`generate_over_data_parallel_groups` gathers their
    output round by round of batches, and rank 0 prints it once, as it
    comes, in the order of a run in one process, with one score line; a
    ``--results-path`` file is always written whole, under a temporary name
    first, and a ``--results-path`` with a file in its path is one error
    line before the model loads (it was a traceback after generating).

    Raises:
        UsageError: a file in the path of ``--results-path``.
    """
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.distributed import utils as distributed_utils

    from fairseq_megatron.errors import check_directory_can_be_made
    from fairseq_megatron.fairseq_integration.distributed import launch_sizes, main_in_its_layout

    if not plugin_on_command_line():  # fairseq-generate without our --user-dir: fairseq's
        return original(_cli(), "main")(cfg)
    if not hasattr(cfg, "common_eval"):  # an argparse Namespace
        cfg = convert_namespace_to_omegaconf(cfg)
    if cfg.common_eval.results_path is not None:  # before the model is loaded, or processes spawned
        check_directory_can_be_made(cfg.common_eval.results_path, f"--results-path {cfg.common_eval.results_path}")
    if dist.is_initialized():  # a caller started torch.distributed already
        return main_in_its_layout(generate_on_this_rank, launch_sizes(cfg), cfg)
    # in each process call_main starts, or here at world size 1
    return distributed_utils.call_main(cfg, generate_on_this_rank)


def generate_on_this_rank(cfg):
    """fairseq's ``main`` on this rank's shard: printed by model-parallel
    rank 0 alone, through :func:`generate_over_data_parallel_groups` for
    several groups or a ``--results-path``."""
    fairseq_main = original(_cli(), "main")
    if cfg.common_eval.results_path is not None or (
            dist.is_initialized() and parallel_state.get_data_parallel_world_size() > 1):
        return generate_over_data_parallel_groups(fairseq_main, cfg)
    if _not_model_parallel_rank_0():
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            return fairseq_main(cfg)
    return fairseq_main(cfg)


def progress_bar(iterator, *args, **kwargs):
    """fairseq's ``progress_bar.progress_bar`` in fairseq_cli.generate: while
    its output is collected, the batches pass through the collector
    (:class:`BatchesCut`) on their way to the bar."""
    from fairseq.logging import progress_bar as fairseq_progress_bar

    output = collecting.get()
    return fairseq_progress_bar.progress_bar(iterator if output is None else BatchesCut(iterator, output), *args,
                                             **kwargs)


def build_scorer(*args, **kwargs):
    """fairseq's ``scoring.build_scorer``: while the output is collected, a
    :class:`ShardScorer`."""
    from fairseq import scoring

    scorer = scoring.build_scorer(*args, **kwargs)
    return scorer if collecting.get() is None else ShardScorer(scorer)


def install() -> None:
    from fairseq import scoring
    from fairseq.logging import progress_bar as fairseq_progress_bar

    module = "fairseq_cli.generate"
    replace_in_cli_module(module, "main", main, "launched over all ranks; one output for all data-parallel groups")
    replace_in_cli_module(module, "progress_bar", ModuleWith(fairseq_progress_bar, progress_bar=progress_bar),
                          "batches cut while the output of several groups is collected")
    replace_in_cli_module(module, "StopwatchMeter", GenerationTimer, "a shard with no batch divides by no time")
    replace_in_cli_module(module, "scoring", ModuleWith(scoring, build_scorer=build_scorer),
                          "one score over all shards")
