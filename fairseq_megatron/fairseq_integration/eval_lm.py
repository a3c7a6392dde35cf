"""``fairseq-eval-lm`` (``fairseq_cli/eval_lm.py``) for our models: one
perplexity, the same at every world size.

Found at world size 4 and model-parallel size 2 on CPU (two data-parallel
groups):

1. ``--context-window`` crashed with ``KeyError: 'net_input'`` when the
   number of batches is not a multiple of the number of shards: fairseq pads
   the short shards with empty batches, which
   ``fairseq/data/lm_context_window_dataset.py`` cannot collate.
2. The context itself was wrong as soon as batches are split. That dataset
   keeps the previous tokens as state of its collater, so a shard that gets
   batches 0, 2, 4, ... (or a DataLoader worker that does, with
   ``--num-workers 2``) prefixes batch 2 with the end of batch 0 instead of
   batch 1.
3. Each group computed the perplexity of its own shard, and only global
   rank 0 logged it, from half of the tokens. So were ``--output-word-probs``
   and ``--output-word-stats``.

:class:`ContextWindowDataset` computes each sample's context from the
samples before it in the dataset, not from what the collater saw last, so any
sharding and any number of workers give the single-process batches (the
task's ``eval_lm_dataloader`` uses it); :func:`eval_lm` sums the
log-probabilities and token counts of all groups before the loss is
printed, and prints the words of all groups in one process's order.

Every token is scored, or the run stops with one error line: samples longer
than the model's positions are refused unless
``--skip-invalid-size-inputs-valid-test`` is given (fairseq skipped them
with a warning and printed the loss of the others: "Loss (base 2): 0.0000,
Perplexity: 1.00" with all of them skipped), and so are a run that scored no
token and a ``--context-window`` as long as the blocks (a ZeroDivisionError
in fairseq's block dataset). fairseq's ``main`` and ``eval_lm`` are
replaced (:func:`install`); both call fairseq's own for other models.
"""

import contextvars
import logging
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from fairseq import utils
from fairseq.data import FairseqDataset
from fairseq.logging.meters import StopwatchMeter
from fairseq.sequence_scorer import SequenceScorer

from fairseq_megatron.errors import UsageError
from fairseq_megatron.fairseq_integration.patching import original, replace_in_cli_module
from fairseq_megatron.parallel import parallel_state

logger = logging.getLogger(__name__)


class ContextWindowDataset(FairseqDataset):
    """Prefix every block with the ``context_window`` tokens that precede it in the dataset.

    Produces the batches of fairseq's ``LMContextWindowDataset``
    (``fairseq/data/lm_context_window_dataset.py``) as one process collating
    every batch in order would: for a batch of B blocks of at most T tokens,
    ``net_input.src_tokens`` is B x (T + context_window), each row holding its
    context, its block and right padding; ``target`` is padding over the
    context; ``start_indices[i]`` is row i's context length, which
    fairseq's ``SequenceScorer`` skips. Unlike that dataset, the context is a
    function of the sample index alone, so batches may go to any shard or
    DataLoader worker in any order. The last context is cached, so reading
    the samples in order costs one extra read per sample.

    Args:
        dataset: a ``MonolingualDataset`` (items with a 1-D ``source``).
        tokens_per_sample: the longest block (``--tokens-per-sample`` minus
            the context window, as fairseq-eval-lm sets it).
        context_window: tokens of context per block (``--context-window``).
        pad_idx: the padding symbol.
    """

    def __init__(self, dataset, tokens_per_sample: int, context_window: int, pad_idx: int):
        if context_window <= 0:
            raise ValueError(f"context_window must be positive, got {context_window}")
        self.dataset = dataset
        self.tokens_per_sample = tokens_per_sample
        self.context_window = context_window
        self.pad_idx = pad_idx
        self._cache = (0, np.empty(0, dtype=np.int64))  # (index, context of that index)

    def _context(self, index: int) -> np.ndarray:
        """The last ``context_window`` source tokens of samples ``0 .. index - 1``."""
        cached_index, cached = self._cache
        if cached_index == index:
            return cached
        if cached_index == index - 1:
            pieces = [cached, self.dataset[index - 1]["source"].numpy()]
        else:  # read backwards until the window is full or the data starts
            pieces, length, j = [], 0, index - 1
            while j >= 0 and length < self.context_window:
                pieces.insert(0, self.dataset[j]["source"].numpy())
                length += len(pieces[0])
                j -= 1
        context = np.concatenate(pieces)[-self.context_window:] if pieces else np.empty(0, dtype=np.int64)
        self._cache = (index, context)
        return context

    def __getitem__(self, index):
        item = dict(self.dataset[index])
        context = self._context(index)
        # fairseq trims the context of a block so that context + block fit in
        # tokens_per_sample + context_window (never binding when blocks are at
        # most tokens_per_sample long, as fairseq-eval-lm makes them).
        extra = len(context) + len(item["source"]) - (self.tokens_per_sample + self.context_window)
        item["context"] = torch.from_numpy(context[max(extra, 0):])
        return item

    def __len__(self):
        return len(self.dataset)

    def collater(self, samples: List[Dict]) -> Dict:
        if not samples:  # what fairseq pads short shards with; eval-lm skips it
            return {}
        batch = self.dataset.collater(samples)
        tokens, target = batch["net_input"]["src_tokens"], batch["target"]
        bsz, width = tokens.shape
        pad = self.pad_idx
        new_tokens = tokens.new_full((bsz, width + self.context_window), pad)
        new_target = target.new_full((bsz, width + self.context_window), pad)
        start_indices = []
        for i, sample in enumerate(samples):
            n = len(sample["context"])
            new_tokens[i, :n] = sample["context"]
            new_tokens[i, n:n + width] = tokens[i]
            new_target[i, n:n + width] = target[i]
            start_indices.append(n)
        batch["net_input"]["src_tokens"] = new_tokens
        batch["net_input"]["src_lengths"] = batch["net_input"]["src_lengths"] + torch.tensor(start_indices)
        batch["target"] = new_target
        batch["start_indices"] = start_indices
        return batch

    def num_tokens(self, index):
        return self.dataset.num_tokens(index)

    def size(self, index):
        return self.dataset.size(index)

    def ordered_indices(self):
        return np.arange(len(self.dataset))  # in text order, like fairseq's

    @property
    def supports_prefetch(self):
        return getattr(self.dataset, "supports_prefetch", False)

    def prefetch(self, indices):
        return self.dataset.prefetch(indices)


@dataclass
class EvalLmRun:
    """What one fairseq-eval-lm run tells its task and its ``eval_lm``:
    whether samples longer than the model's positions are skipped (the
    task's ``eval_lm_dataloader`` refuses them otherwise) and the
    data-parallel group the data was sharded over (None: one shard)."""

    skip_invalid_size_inputs: bool
    sharded_over: Optional[object] = None


# The run in progress in this process. fairseq-eval-lm's main builds the task
# and calls eval_lm itself, with no argument to hand them the run's settings;
# main (replaced below) sets this, the task and eval_lm read it.
_run: contextvars.ContextVar[Optional[EvalLmRun]] = contextvars.ContextVar("fairseq_eval_lm_run", default=None)


def current_run() -> Optional[EvalLmRun]:
    """The fairseq-eval-lm run in progress, or None outside one."""
    return _run.get()


def main(cfg, **kwargs):
    """fairseq-eval-lm's ``main``, for the run's settings to reach its task
    and :func:`eval_lm`.

    Raises:
        UsageError: ``0 < context_window >= tokens_per_sample``.
    """
    window = getattr(getattr(cfg, "eval_lm", cfg), "context_window", 0) or 0
    block = getattr(getattr(cfg, "task", cfg), "tokens_per_sample", None)
    if window > 0 and block is not None and window >= block:
        raise UsageError(
            f"--context-window {window} leaves no token to score in blocks of --tokens-per-sample {block}: "
            f"each block scores tokens-per-sample minus context-window tokens"
        )
    skip = bool(getattr(getattr(cfg, "dataset", cfg), "skip_invalid_size_inputs_valid_test", False))
    token = _run.set(EvalLmRun(skip_invalid_size_inputs=skip))
    try:
        return original(_cli(), "main")(cfg, **kwargs)
    finally:
        _run.reset(token)


def _cli():
    import fairseq_cli.eval_lm

    return fairseq_cli.eval_lm


def eval_lm(models, source_dictionary, batch_iterator, post_process=None, output_word_probs=False,
            output_word_stats=False, target_dictionary=None, softmax_batch=0, remove_bos_token=False, device=None):
    """fairseq's ``eval_lm`` over the data-parallel groups of our models.

    With one shard it is fairseq's (the run only checks that a token was
    scored). When the data was split over a data-parallel group of D > 1
    ranks, the log-probabilities and token counts of every rank are summed
    over the group before the loss, and ``--output-word-probs`` /
    ``--output-word-stats`` print the words of the whole subset, as one
    process would (:func:`_log_words_of_the_group`). The scoring rules are
    fairseq's (:class:`_ScoreTally`); the sum is kept in float64.

    Raises:
        UsageError: no token was scored (in all shards).
    """
    from fairseq_megatron.models.model_parallel_transformer_lm import is_our_model

    fairseq_eval_lm = original(_cli(), "eval_lm")
    run = current_run()
    group = run.sharded_over if run is not None else None
    if not is_our_model(models[0]):
        return fairseq_eval_lm(models, source_dictionary, batch_iterator, post_process, output_word_probs,
                               output_word_stats, target_dictionary, softmax_batch, remove_bos_token, device)
    if group is None:
        batches = _Counted(batch_iterator)
        results = fairseq_eval_lm(models, source_dictionary, batches, post_process, output_word_probs,
                                  output_word_stats, target_dictionary, softmax_batch, remove_bos_token, device)
        _refuse_nothing_scored(batches.scored, models)
        return results
    target_dictionary = target_dictionary or source_dictionary
    device = device or next(models[0].parameters()).device
    scorer = SequenceScorer(target_dictionary, softmax_batch)
    words = output_word_probs or output_word_stats
    tally = _ScoreTally(source_dictionary, post_process, remove_bos_token, device, keep_words=words)
    timer = StopwatchMeter()
    for sample in batch_iterator:
        if "net_input" not in sample:
            continue
        sample = utils.move_to_cuda(sample, device=device)
        timer.start()
        hypos = scorer.generate(models, sample)
        timer.stop(sample["ntokens"])
        tally.add(hypos, sample["id"].tolist())
    logger.info("Evaluated {:,} tokens in {:.1f}s ({:.2f} tokens/s)".format(
        timer.n, timer.sum, 1.0 / timer.avg if timer.avg > 0 else 0))
    if words:
        _log_words_of_the_group(tally.batches, group, output_word_probs, output_word_stats)
    totals = torch.stack([tally.log_prob_sum, tally.count.to(torch.float64)])
    dist.all_reduce(totals, group=group)
    total_log_prob, total_count = totals.tolist()
    _refuse_nothing_scored(total_count, models)
    logger.info("eval-lm: %d data-parallel groups scored %s tokens together", dist.get_world_size(group),
                f"{int(total_count):,}")
    loss = -total_log_prob / total_count / math.log(2)
    return {"loss": loss, "perplexity": 2 ** loss}


class _Counted:
    """An iterable of batches that counts the non-empty ones it yields."""

    def __init__(self, batches):
        self.batches, self.scored = batches, 0

    def __iter__(self):
        for sample in self.batches:
            self.scored += "net_input" in sample
            yield sample

    def __len__(self):
        return len(self.batches)


def _refuse_nothing_scored(count, models) -> None:
    if count == 0:
        raise UsageError(
            "no token was scored: the subset is empty, or fairseq skipped every sample as longer than "
            f"the model's {models[0].max_positions()} positions (lower --tokens-per-sample)"
        )


# One scored word, as fairseq_cli/eval_lm.py's word loop sees it: the word
# (BPE continuations joined), its log-probability, that of the next word in
# the sample (None at the end) and whether it was joined from BPE pieces.
Word = Tuple[str, float, Optional[float], bool]


class _ScoreTally:
    """The sum of log-probabilities (natural log) and the token count that
    ``fairseq_cli/eval_lm.py:eval_lm`` divides, by its rules: the BOS token
    removed with ``--add-bos-token``; with ``--post-process`` a BPE
    continuation token's score moved to the next token and not counted;
    infinite scores left out after that move (NaN kept). Both stay on the
    scores' device (the sum in float64): no host read per batch.

    With ``keep_words``, it also keeps, per batch, ``(sample id, words)`` for
    every sample (:data:`Word`), which fairseq prints with
    ``--output-word-probs`` / ``--output-word-stats``."""

    def __init__(self, dictionary, post_process: Optional[str], remove_bos_token: bool, device: torch.device,
                 keep_words: bool = False):
        self.dictionary = dictionary
        self.remove_bos_token = remove_bos_token
        self.bpe_tokens, self.bpe_suffix_length = None, 0
        if post_process in {"subword_nmt", "@@ "}:
            suffix = post_process.rstrip()
            self.bpe_tokens = {i for i in range(len(dictionary)) if dictionary[i].endswith(suffix)}
            self.bpe_suffix_length = len(suffix)
        elif post_process is not None:
            raise NotImplementedError(f"--post-process={post_process} is not implemented")  # as fairseq's eval_lm
        self.batches: Optional[List[List[Tuple[int, List[Word]]]]] = [] if keep_words else None
        self.log_prob_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)

    def add(self, hypos, sample_ids=None) -> None:
        """One batch: ``hypos`` from the scorer, ``sample_ids`` (B,) its samples' ids."""
        if self.batches is not None:
            self.batches.append([])
        for i, hypos_i in enumerate(hypos):
            tokens, scores = hypos_i[0]["tokens"], hypos_i[0]["positional_scores"].float()
            if self.remove_bos_token:
                tokens, scores = tokens[1:], scores[1:]
            moved, skipped = scores, 0
            if self.bpe_tokens is not None:
                moved, ids = scores.cpu().clone(), tokens.tolist()
                for j in range(len(ids) - 1):
                    if ids[j] in self.bpe_tokens:
                        skipped += 1
                        moved[j + 1] += moved[j]
                        moved[j] = 0
                moved = moved.to(scores.device)
            infinite = moved.isinf()
            self.log_prob_sum += moved.masked_fill(infinite, 0).sum(dtype=torch.float64)
            self.count += moved.numel() - skipped - infinite.sum()
            if self.batches is not None:
                self.batches[-1].append((int(sample_ids[i]), self._words(tokens.tolist(), scores)))

    def _words(self, tokens: List[int], scores: torch.Tensor) -> List[Word]:
        """The words of one sample by the loop in ``fairseq_cli/eval_lm.py:eval_lm``,
        in float32 as there: a continuation's score is added to the next token's
        (and becomes 0), a word's "next" score is the next non-zero one."""
        scores = scores.cpu().numpy().copy()  # float32
        is_continuation = [self.bpe_tokens is not None and t in self.bpe_tokens for t in tokens]
        for i in range(len(tokens) - 1):
            if is_continuation[i]:
                scores[i + 1] += scores[i]
                scores[i] = 0
        words, word, is_bpe = [], "", False
        for i, token in enumerate(tokens):
            word += self.dictionary[token]
            if is_continuation[i]:
                word, is_bpe = word[:-self.bpe_suffix_length], True
                continue
            following = next((float(s) for s in scores[i + 1:] if s != 0), None)
            words.append((word, float(scores[i]), following, is_bpe))
            word, is_bpe = "", False
        return words


def _log_words_of_the_group(batches, group, output_word_probs: bool, output_word_stats: bool) -> None:
    """Print the words of every rank's shard as ``fairseq_cli/eval_lm.py:eval_lm``
    prints one process's: with its logger, its line formats, in its order.

    fairseq's sharded iterator hands batch ``j * D + k`` of the single-process
    order to rank ``k`` of the D ranks as its ``j``-th batch (the empty batches
    that pad short shards come last, and are not scored), so taking the
    gathered batches in turn restores that order. Only the group of
    model-parallel rank 0 gathers: the ranks of the others do not print.

    Args:
        batches: this rank's :attr:`_ScoreTally.batches`.
        group: the data-parallel group its shards were split over.
    """
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return
    destination = dist.get_global_rank(group, 0)
    gathered = [None] * dist.get_world_size(group) if dist.get_rank() == destination else None
    dist.gather_object(batches, gathered, dst=destination, group=group)
    if gathered is None:
        return
    in_order = [shard[j] for j in range(max(map(len, gathered))) for shard in gathered if j < len(shard)]
    cli_logger = logging.getLogger("fairseq_cli.eval_lm")
    for line in word_lines(in_order, output_word_probs, output_word_stats):
        cli_logger.info(line)


def word_lines(batches, output_word_probs: bool, output_word_stats: bool) -> List[str]:
    """The lines ``fairseq_cli/eval_lm.py:eval_lm`` logs for these batches
    (:attr:`_ScoreTally.batches`, in order) with ``--output-word-probs``
    (one per sample: its id, then ``word [log-prob]`` for each word) and
    ``--output-word-stats`` (one per word, most frequent first, from
    fairseq's ``WordStat``; summed in the same order and with the same types
    as there, the next word's score as a float32 tensor, so the lines equal
    fairseq's for the same scores)."""
    from fairseq_cli.eval_lm import WordStat

    lines, word_stats = [], {}
    for batch in batches:
        for sample_id, words in batch:
            for word, log_prob, next_log_prob, is_bpe in words if output_word_stats else ():
                following = None if next_log_prob is None else torch.tensor(next_log_prob, dtype=torch.float32)
                word_stats.setdefault(word, WordStat(word, is_bpe)).add(log_prob, following)
            if output_word_probs:
                lines.append(f"{sample_id} " + "\t".join(f"{w} [{p:2f}]" for w, p, _, _ in words))
    if output_word_stats:
        lines += [str(stat) for stat in sorted(word_stats.values(), key=lambda x: x.count, reverse=True)]
    return lines


def install() -> None:
    replace_in_cli_module("fairseq_cli.eval_lm", "main", main,
                          "the run's settings reach the task; a context window as long as the blocks refused")
    replace_in_cli_module("fairseq_cli.eval_lm", "eval_lm", eval_lm,
                          "one loss over all data-parallel groups; a run that scored nothing refused")
