"""Evaluation under model parallelism (fairseq-eval-lm, fairseq-validate,
fairseq-train's validation, fairseq-generate's batches): every sample is
scored, once, by a whole model-parallel group (steps 5, 18 and 19 of
:mod:`fairseq_megatron.fairseq_integration`).

5. :func:`shard_by_data_parallel_rank` -- ``fairseq-eval-lm`` and
   ``fairseq-generate`` shard the data by global rank, so the ranks of one
   model-parallel group would see different batches. With model parallelism
   the shards follow the data-parallel rank instead: every token is scored
   once, by a whole group. fairseq-eval-lm's ``--context-window`` dataset
   crashed on uneven shards and gave wrong contexts once batches were split
   over shards or workers, and each group printed its own shard's
   perplexity (and words, with ``--output-word-probs`` or
   ``--output-word-stats``); :mod:`fairseq_megatron.fairseq_integration.eval_lm` fixes the three, and
   refuses settings that leave no token to score (fairseq printed
   perplexity 1.00, or failed with ZeroDivisionError).

18. :func:`fairseq_validate_across_ranks` -- ``fairseq-validate`` under a
   distributed launch printed its configuration and result once per rank
   (it resets the logging that ``distributed_init`` had quieted on every
   rank but 0); now rank 0 prints. With two or more data-parallel groups on
   a machine without GPUs it failed gathering their results: fairseq's
   ``all_gather_list`` allocates a CUDA buffer. There it now gathers with
   torch's ``all_gather_object``. With a number of batches that the groups
   do not divide it failed on any machine (``KeyError: 'net_input'``): the
   empty batch that fairseq pads a short shard with now scores nothing.

19. :func:`evaluation_scores_every_sample` -- fairseq's ``batch_by_size``
   drops the last batch when its size is not a multiple of
   ``--required-batch-size-multiple`` (8 by default; facebookresearch/fairseq
   issue 5036), so fairseq-validate, fairseq-train's validation and
   fairseq-generate silently skipped up to 7 samples of every subset (with
   ``--batch-size 4``, 4 of the test model's 44 validation blocks; with
   ``--batch-size 6``, 2). There it is now kept. Training batches are left
   as fairseq makes them (fixed shapes for compiled steps). Samples longer
   than the model's positions are refused by evaluations without
   ``--skip-invalid-size-inputs-valid-test`` in one line (fairseq: a bare
   Exception's traceback), fairseq-eval-lm included, which skipped them
   whatever the flag said and printed the loss of the others. Where the
   samples are skipped (training, or with that flag) and none is left, the
   run stops with one line: fairseq failed with an IndexError in
   ``batch_by_size``.
"""

import contextvars
import functools
import logging

import numpy as np
import torch

from fairseq_megatron.fairseq_integration.patching import StandIn, fairseq_tool, patch_cli_main, replace_in_cli_module


def _data_parallel_shard(num_shards: int, shard_id: int):
    """Map fairseq's global-rank sharding onto data-parallel ranks under model parallelism.

    fairseq-eval-lm and fairseq-generate pass ``num_shards=world size,
    shard_id=global rank``; the trainer already passes data-parallel values
    (which differ from those whenever model parallelism is on), so only the
    global ones are rewritten.
    """
    import torch.distributed as dist

    from fairseq_megatron.parallel import parallel_state

    if (
        parallel_state.model_parallel_is_initialized()
        and parallel_state.get_tensor_model_parallel_world_size() > 1
        and num_shards == dist.get_world_size()
        and shard_id == dist.get_rank()
    ):
        return parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    return num_shards, shard_id


def shard_by_data_parallel_rank() -> None:
    from fairseq.tasks.fairseq_task import FairseqTask
    from fairseq.tasks.language_modeling import LanguageModelingTask

    from fairseq_megatron.fairseq_integration import eval_lm

    LanguageModelingTask.eval_lm_dataloader = eval_lm.eval_lm_dataloader
    replace_in_cli_module("fairseq_cli.eval_lm", "SequenceScorer", lambda _: eval_lm.TallyingSequenceScorer)
    replace_in_cli_module("fairseq_cli.eval_lm", "eval_lm", eval_lm.eval_lm_over_data_parallel_groups)
    patch_cli_main("fairseq_cli.eval_lm", eval_lm.with_settings_checked)

    def wrap(cls, name):
        original = getattr(cls, name)

        @functools.wraps(original)
        def method(self, *args, num_shards=1, shard_id=0, **kwargs):
            num_shards, shard_id = _data_parallel_shard(num_shards, shard_id)
            return original(self, *args, num_shards=num_shards, shard_id=shard_id, **kwargs)

        setattr(cls, name, method)

    wrap(LanguageModelingTask, "eval_lm_dataloader")  # fairseq-eval-lm
    wrap(FairseqTask, "get_batch_iterator")  # fairseq-generate


def _scoring_empty_batches_as_nothing(task):
    """``task``, whose ``valid_step`` scores an empty batch (``{}``, which
    fairseq's iterator pads a short data shard with) as nothing; it looked up
    ``sample["net_input"]``. Only the short shard's ranks see one; every rank
    of a model-parallel group reads the same shard, so all of them skip it
    and no collective is left waiting."""
    valid_step = task.valid_step

    @functools.wraps(valid_step)
    def valid_step_or_nothing(sample, model, criterion):
        if not sample:
            return 0, 0, {}  # (loss, sample size, logging output)
        return valid_step(sample, model, criterion)

    task.valid_step = valid_step_or_nothing
    return task


class _CheckpointUtilsInValidate(StandIn):
    """``fairseq.checkpoint_utils`` as ``fairseq_cli/validate.py`` sees it:
    the task it loads with the model scores empty batches as nothing."""

    def __init__(self):
        from fairseq import checkpoint_utils

        super().__init__(checkpoint_utils)

    def load_model_ensemble_and_task(self, *args, **kwargs):
        models, cfg, task = self.stands_for.load_model_ensemble_and_task(*args, **kwargs)
        return models, cfg, _scoring_empty_batches_as_nothing(task)


def fairseq_validate_across_ranks() -> None:
    import torch.distributed as dist
    from fairseq.distributed import utils as distributed_utils

    def quiet_on_other_ranks(reset_logging):
        @functools.wraps(reset_logging)
        def reset_logging_on_rank_0():
            """fairseq's reset, then ``distributed_init``'s rule: INFO on rank 0 only."""
            reset_logging()
            if dist.is_initialized() and dist.get_rank() != 0:
                logging.getLogger().setLevel(logging.WARNING)

        return reset_logging_on_rank_0

    replace_in_cli_module("fairseq_cli.validate", "reset_logging", quiet_on_other_ranks)
    replace_in_cli_module("fairseq_cli.validate", "checkpoint_utils", lambda _: _CheckpointUtilsInValidate())

    original = distributed_utils.all_gather_list

    @functools.wraps(original)
    def all_gather_list(data, group=None, max_size=16384):
        """fairseq's gather of any picklable ``data`` from every rank of
        ``group`` (a list in rank order); without GPUs, torch's
        ``all_gather_object`` (fairseq's stages it through a CUDA buffer)."""
        if torch.cuda.is_available() or distributed_utils.use_xla():
            return original(data, group=group, max_size=max_size)
        if group is None:
            group = distributed_utils.get_global_group()
        gathered = [None] * dist.get_world_size(group=group)
        dist.all_gather_object(gathered, data, group=group)
        return gathered

    distributed_utils.all_gather_list = all_gather_list


# Whether fairseq's batch_by_size keeps a last batch of any size (step 19):
# set while an evaluation builds its batches.
_keep_the_last_batch = contextvars.ContextVar("keep_the_last_batch", default=False)


def _evaluating(function):
    """``function``, building its batches with the last one kept."""

    @functools.wraps(function)
    def evaluating(*args, **kwargs):
        token = _keep_the_last_batch.set(True)
        try:
            return function(*args, **kwargs)
        finally:
            _keep_the_last_batch.reset(token)

    return evaluating


def evaluation_scores_every_sample() -> None:
    from fairseq import trainer
    from fairseq.data import data_utils
    from fairseq.tasks.fairseq_task import FairseqTask

    from fairseq_megatron.errors import UsageError

    original = data_utils.batch_by_size

    @functools.wraps(original)
    def batch_by_size(indices, num_tokens_fn, num_tokens_vec=None, max_tokens=None, max_sentences=None,
                      required_batch_size_multiple=1, fixed_shapes=None):
        """fairseq's batches; while evaluating, with the last batch that it
        drops for not being a multiple of ``required_batch_size_multiple``.
        fairseq fills the batches in the order of ``indices`` (unless given
        fixed shapes, left as they are), so the dropped batch is the indices
        after the others."""
        args = (num_tokens_fn, num_tokens_vec, max_tokens, max_sentences, required_batch_size_multiple,
                fixed_shapes)
        if not _keep_the_last_batch.get() or fixed_shapes is not None or required_batch_size_multiple <= 1:
            return original(indices, *args)
        indices = np.fromiter(indices, dtype=np.int64, count=-1)  # fairseq's conversion, kept for the tail
        batches = original(indices, *args)
        batched = sum(len(batch) for batch in batches)
        if batched < len(indices):
            batches = list(batches) + [indices[batched:]]
        return batches

    data_utils.batch_by_size = batch_by_size
    trainer.Trainer.get_valid_iterator = _evaluating(trainer.Trainer.get_valid_iterator)

    def filter_indices_by_size(self, indices, dataset, max_positions=None, ignore_invalid_inputs=False):
        """fairseq's ``FairseqTask.filter_indices_by_size``, whose refusal of
        samples longer than the model's positions (evaluations without
        ``--skip-invalid-size-inputs-valid-test``) is one line: fairseq
        raised a bare Exception, a traceback in every tool. In
        fairseq-interactive the sample is a prompt, and the line says so
        (fairseq's advice there was to skip the "example").

        Raises:
            UsageError: a sample is too long and ``ignore_invalid_inputs`` is
                false, or every sample is too long (except in
                fairseq-interactive, where a skipped prompt is one of many).
        """
        if ignore_invalid_inputs:
            kept = original_filter(self, indices, dataset, max_positions, ignore_invalid_inputs)
            if len(kept) == 0 and len(indices) > 0 and fairseq_tool() != "interactive":
                raise UsageError(f"all {len(indices):,} samples are longer than the model's positions "
                                 f"(max_positions={max_positions}): lower --tokens-per-sample")
            return kept
        kept, too_long = dataset.filter_indices_by_size(indices, max_positions)
        if len(too_long) == 0:
            return kept
        if fairseq_tool() == "interactive":  # the user's own lines
            raise UsageError(
                f"a prompt of {dataset.size(too_long[0])} tokens is longer than the model's positions "
                f"(max_positions={max_positions}): shorten it, or skip such prompts with "
                f"--skip-invalid-size-inputs-valid-test"
            )
        raise UsageError(
            f"{len(too_long):,} samples are longer than the model's positions (sample #{too_long[0]}: "
            f"{dataset.size(too_long[0])}, max_positions={max_positions}): lower --tokens-per-sample, "
            f"or skip them with --skip-invalid-size-inputs-valid-test"
        )

    original_filter = FairseqTask.filter_indices_by_size
    FairseqTask.filter_indices_by_size = functools.wraps(original_filter)(filter_indices_by_size)
    for name in ("fairseq_cli.validate", "fairseq_cli.generate"):
        patch_cli_main(name, lambda main, module: _evaluating(main))
