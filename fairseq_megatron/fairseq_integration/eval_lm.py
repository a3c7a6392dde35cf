"""fairseq-eval-lm over several data-parallel groups: one perplexity, the same at every world size.

Three upstream problems, found at world size 4 and model-parallel size 2 on
CPU (two data-parallel groups), are fixed here:

1. ``--context-window`` crashes with ``KeyError: 'net_input'`` when the
   number of batches is not a multiple of the number of shards: fairseq pads
   the short shards with empty batches, which
   ``fairseq/data/lm_context_window_dataset.py`` cannot collate.
2. The context itself is wrong as soon as batches are split. That dataset
   keeps the previous tokens as state of its collater, so a shard that gets
   batches 0, 2, 4, ... (or a DataLoader worker that does, with
   ``--num-workers 2``) prefixes batch 2 with the end of batch 0 instead of
   batch 1. Measured on the demo checkpoint (model-parallel size 2, blocks of
   32 tokens, context 32, batch 8): base-2 loss 6.8070 in one process,
   6.8210 with ``--num-workers 2``.
3. Each group computes the perplexity of its own shard, and only global
   rank 0 logs it: 6.9099 instead of 6.8070 for the run above at world
   size 4, from half of the tokens. So were ``--output-word-probs`` and
   ``--output-word-stats``: on the demo's valid split at world size 4,
   5,884 of its 11,004 words in the word statistics.

:class:`ContextWindowDataset` computes each sample's context from the
samples before it in the dataset, not from what the collater saw last, so any
sharding and any number of workers give the single-process batches;
:func:`eval_lm_dataloader` uses it; :func:`eval_lm_over_data_parallel_groups`
sums the log-probabilities and token counts of all groups before the loss is
printed, and prints the words of all groups in one process's order.

Every token is scored, or the run stops with one error line
(:func:`with_settings_checked`): samples longer than the model's positions
are refused unless ``--skip-invalid-size-inputs-valid-test`` is given
(fairseq skipped them with a warning and printed the loss of the others:
"Loss (base 2): 0.0000, Perplexity: 1.00" with all of them skipped), and so
are a run that scored no token and a ``--context-window`` as long as the
blocks (a ZeroDivisionError in fairseq's block dataset).
"""

import contextvars
import functools
import logging
import math
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from fairseq.data import FairseqDataset
from fairseq.sequence_scorer import SequenceScorer

from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.errors import UsageError

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


# The group whose ranks got different shards of the last eval-lm data, set by
# eval_lm_dataloader and read by eval_lm_over_data_parallel_groups (both run
# once per fairseq-eval-lm process, in that order).
_sharded_over = None


# Whether eval_lm_dataloader skips the samples longer than the model's
# positions: fairseq-eval-lm's --skip-invalid-size-inputs-valid-test, set by
# with_settings_checked (fairseq's own dataloader always skipped them).
_skip_invalid_size_inputs = contextvars.ContextVar("skip_invalid_size_inputs", default=True)


def with_settings_checked(original_main, module=None):
    """Wrap fairseq-eval-lm's ``main(cfg)`` so that every token is scored, or
    the run stops with one line.

    fairseq-eval-lm skipped the samples longer than the model's positions
    with a warning, whatever ``--skip-invalid-size-inputs-valid-test`` said,
    and printed the loss of the others (fairseq-validate refuses them unless
    given that flag; so does this wrapper now). A ``--context-window`` as
    long as ``--tokens-per-sample`` left blocks of no token, and failed in
    fairseq's block dataset with ZeroDivisionError.

    Raises:
        UsageError: ``0 < context_window >= tokens_per_sample``; a sample too
            long, without the flag (from fairseq's ``filter_indices_by_size``,
            as fairseq_integration makes it raise).
    """

    @functools.wraps(original_main)
    def main(cfg, *args, **kwargs):
        window = getattr(getattr(cfg, "eval_lm", cfg), "context_window", 0) or 0
        block = getattr(getattr(cfg, "task", cfg), "tokens_per_sample", None)
        if window > 0 and block is not None and window >= block:
            raise UsageError(
                f"--context-window {window} leaves no token to score in blocks of --tokens-per-sample {block}: "
                f"each block scores tokens-per-sample minus context-window tokens"
            )
        skip = bool(getattr(getattr(cfg, "dataset", cfg), "skip_invalid_size_inputs_valid_test", False))
        token = _skip_invalid_size_inputs.set(skip)
        try:
            return original_main(cfg, *args, **kwargs)
        finally:
            _skip_invalid_size_inputs.reset(token)

    return main


def _data_parallel_group_of(num_shards: int, shard_id: int):
    """The data-parallel group when its ranks hold shards ``0 .. num_shards - 1``
    (this rank: ``shard_id``), else None: one process, or ``--num-shards``
    chosen by hand. (Under torch.distributed the groups always exist:
    fairseq_integration creates them at model-parallel size 1 too.)"""
    if num_shards <= 1 or not parallel_state.model_parallel_is_initialized():
        return None
    if (num_shards, shard_id) != (parallel_state.get_data_parallel_world_size(),
                                  parallel_state.get_data_parallel_rank()):
        return None
    return parallel_state.get_data_parallel_group()


def eval_lm_dataloader(
    task,
    dataset,
    max_tokens: Optional[int] = 36000,
    batch_size: Optional[int] = None,
    max_positions: Optional[int] = None,
    num_shards: int = 1,
    shard_id: int = 0,
    num_workers: int = 1,
    data_buffer_size: int = 10,
    context_window: int = 0,
):
    """``LanguageModelingTask.eval_lm_dataloader`` (fairseq/tasks/language_modeling.py)
    with :class:`ContextWindowDataset` in place of fairseq's context dataset.

    Under model parallelism, fairseq_integration maps fairseq-eval-lm's
    ``num_shards`` = world size and ``shard_id`` = global rank to the
    data-parallel size and rank before this runs. Returns fairseq's epoch
    iterator over this shard's batches, and records the group the shards are
    split over for :func:`eval_lm_over_data_parallel_groups`.
    """
    global _sharded_over
    _sharded_over = _data_parallel_group_of(num_shards, shard_id)
    if context_window > 0:
        dataset = ContextWindowDataset(
            dataset,
            tokens_per_sample=task.args.tokens_per_sample,
            context_window=context_window,
            pad_idx=task.source_dictionary.pad(),
        )
    return task.get_batch_iterator(
        dataset=dataset,
        max_tokens=max_tokens,
        max_sentences=batch_size,
        max_positions=max_positions,
        ignore_invalid_inputs=_skip_invalid_size_inputs.get(),
        num_shards=num_shards,
        shard_id=shard_id,
        num_workers=num_workers,
        data_buffer_size=data_buffer_size,
    ).next_epoch_itr(shuffle=False)


# One scored word, as fairseq_cli/eval_lm.py's word loop sees it: the word
# (BPE continuations joined), its log-probability, that of the next word in
# the sample (None at the end) and whether it was joined from BPE pieces.
Word = Tuple[str, float, Optional[float], bool]


class _ScoreTally:
    """The sum of log-probabilities (natural log) and the token count that
    ``fairseq_cli/eval_lm.py:eval_lm`` divides, rebuilt from the scorer's
    hypotheses by its rules: the BOS token removed with ``--add-bos-token``,
    a BPE continuation token's score moved to the next token and not counted
    with ``--post-process``. Non-finite scores (which fairseq drops after
    that move) are only counted here, and stop the sum over groups.

    With ``keep_words``, it also keeps, per batch, ``(sample id, words)`` for
    every sample (:data:`Word`), which fairseq prints with
    ``--output-word-probs`` / ``--output-word-stats``."""

    def __init__(self, dictionary, post_process: Optional[str], remove_bos_token: bool, device: torch.device,
                 keep_words: bool = False):
        self.dictionary = dictionary
        self.remove_bos_token = remove_bos_token
        self.bpe_tokens, self.bpe_suffix_length = None, 0
        if post_process in {"subword_nmt", "@@ "}:  # eval_lm raises for any other
            suffix = post_process.rstrip()
            self.bpe_tokens = {i for i in range(len(dictionary)) if dictionary[i].endswith(suffix)}
            self.bpe_suffix_length = len(suffix)
        self.batches: Optional[List[List[Tuple[int, List[Word]]]]] = [] if keep_words else None
        # float64 on the scores' device: no host sync per batch
        self.log_prob_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.non_finite = torch.zeros((), dtype=torch.float64, device=device)
        self.count = 0

    def add(self, hypos, sample_ids=None) -> None:
        """One batch: ``hypos`` from the scorer, ``sample_ids`` (B,) its samples' ids."""
        if self.batches is not None:
            self.batches.append([])
        for i, hypos_i in enumerate(hypos):
            tokens, scores = hypos_i[0]["tokens"], hypos_i[0]["positional_scores"].float()
            if self.remove_bos_token:
                tokens, scores = tokens[1:], scores[1:]
            self.log_prob_sum += scores.sum(dtype=torch.float64)
            self.non_finite += (~torch.isfinite(scores)).sum()
            skipped = 0
            if self.bpe_tokens is not None:
                skipped = sum(t in self.bpe_tokens for t in tokens[:-1].tolist())
            self.count += scores.numel() - skipped
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


_active_tally: Optional[_ScoreTally] = None


class TallyingSequenceScorer(SequenceScorer):
    """fairseq's ``SequenceScorer`` that also feeds the running :class:`_ScoreTally`."""

    def generate(self, models, sample, **kwargs):
        hypos = super().generate(models, sample, **kwargs)
        if _active_tally is not None:
            _active_tally.add(hypos, sample["id"].tolist())
        return hypos


def eval_lm_over_data_parallel_groups(original_eval_lm):
    """Wrap ``fairseq_cli.eval_lm.eval_lm`` so that its returned loss is over all shards.

    When :func:`eval_lm_dataloader` split the data over a data-parallel group
    of D > 1 ranks, each rank's sum of log-probabilities and token count are
    all-reduced over that group, and the returned ``loss`` (base 2) and
    ``perplexity`` are those of the whole split, which fairseq-eval-lm then
    logs; ``--output-word-probs`` and ``--output-word-stats`` print the words
    of the whole split, as one process would (:func:`_log_words_of_the_group`).
    Before that, each rank checks that its own sum and count give the
    loss fairseq computed for its shard (relative 1e-4: fairseq accumulates in
    float32, this tally in float64); if any rank's check fails or saw a
    non-finite score, every rank returns fairseq's own shard result with a
    warning instead.

    Raises:
        UsageError: no token was scored (in all shards). fairseq skips the
            samples longer than the model's positions with a warning, and
            with all of them skipped printed loss 0.0000 and perplexity 1.00.
    """

    @functools.wraps(original_eval_lm)
    def eval_lm(models, source_dictionary, batch_iterator, *args, **kwargs):
        global _active_tally, _sharded_over
        group, _sharded_over = _sharded_over, None
        word_output = {flag: bool(kwargs.get(flag)) for flag in ("output_word_probs", "output_word_stats")}
        words_over_group = group is not None and any(word_output.values())
        if words_over_group:  # printed below, for the whole group
            kwargs.update(dict.fromkeys(word_output, False))
        tally = _ScoreTally(
            source_dictionary,  # eval_lm finds the BPE continuations in it
            kwargs.get("post_process"),
            kwargs.get("remove_bos_token", False),
            device=next(models[0].parameters()).device,
            keep_words=words_over_group,
        )
        _active_tally = tally
        try:
            results = original_eval_lm(models, source_dictionary, batch_iterator, *args, **kwargs)
        finally:
            _active_tally = None
        count = tally.count
        if words_over_group:
            _log_words_of_the_group(tally.batches, group, **word_output)
        if group is not None:
            results, count = _sum_over_group(tally, results, group)
        if count == 0:
            raise UsageError(
                "no token was scored: the subset is empty, or fairseq skipped every sample as longer than "
                f"the model's {models[0].max_positions()} positions (lower --tokens-per-sample)"
            )
        return results

    return eval_lm


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


def _sum_over_group(tally: _ScoreTally, results: Dict, group) -> Tuple[Dict, int]:
    """``(results over the group, tokens scored in all of it)``."""
    own_loss = float(results["loss"])
    tally_loss = -tally.log_prob_sum.item() / tally.count / math.log(2) if tally.count else 0.0
    mismatch = abs(tally_loss - own_loss) > 1e-4 * max(abs(own_loss), 1e-8)
    totals = torch.stack([
        tally.log_prob_sum,
        torch.full_like(tally.log_prob_sum, float(tally.count)),
        tally.non_finite + float(mismatch),
    ])
    dist.all_reduce(totals, group=group)
    total_log_prob, total_count, problems = totals.tolist()
    groups = dist.get_world_size(group)
    if problems > 0:
        logger.warning(
            "eval-lm: could not sum the scores of the %d data-parallel groups (non-finite scores, or a "
            "count that differs from fairseq's); the loss below is this group's shard only", groups)
        return results, int(total_count)
    loss = -total_log_prob / total_count / math.log(2) if total_count else 0.0
    logger.info("eval-lm: %d data-parallel groups scored %s tokens together", groups, f"{int(total_count):,}")
    return {"loss": loss, "perplexity": 2 ** loss}, int(total_count)
