"""fairseq's ``language_modeling`` task, taken over for our models.

:class:`LanguageModelingTask` subclasses fairseq's and is registered under
its name (as :mod:`fairseq_megatron.models.registry` takes over the model
names), with fairseq's config. Until it has built one of our models it is
fairseq's task unchanged: every method below checks :attr:`builds_our_model`
and otherwise calls fairseq's. For our models:

- :meth:`build_model` tells the model when a checkpoint's weights will fill
  it (every load of a checkpoint), so that it draws no initial weights for
  them.
- Data is sharded by data-parallel rank, not by global rank: fairseq-eval-lm
  and fairseq-generate shard by world size and rank, so the ranks of one
  model-parallel group saw different batches. Every sample is scored once, by
  a whole model-parallel group.
- Evaluation scores every sample: fairseq's ``batch_by_size`` drops a last
  batch whose size is not a multiple of ``--required-batch-size-multiple``
  (8 by default; facebookresearch/fairseq issue 5036), so validation and
  fairseq-generate skipped up to 7 samples of every subset. Training batches
  are left as fairseq makes them.
- Samples longer than the model's positions are refused in one line unless
  ``--skip-invalid-size-inputs-valid-test`` (fairseq: a bare Exception's
  traceback; fairseq-eval-lm skipped them whatever the flag said and printed
  the loss of the others), and a run where every sample is skipped stops with
  one line (fairseq: an IndexError in ``batch_by_size``).
- fairseq-eval-lm's ``--context-window`` dataset gives every block the
  context that precedes it in the data, under any sharding
  (:class:`~fairseq_megatron.fairseq_integration.eval_lm.ContextWindowDataset`).
- The empty batch that fairseq pads a short data shard with scores nothing
  (fairseq-validate failed on it with ``KeyError: 'net_input'``), and
  fairseq-validate, which resets logging, prints from rank 0 only.
"""

import contextlib
import logging

import numpy as np
import torch.distributed as dist
from fairseq.data import BaseWrapperDataset
from fairseq.tasks.language_modeling import LanguageModelingConfig
from fairseq.tasks.language_modeling import LanguageModelingTask as FairseqLanguageModelingTask

from fairseq_megatron.errors import UsageError
from fairseq_megatron.fairseq_integration.patching import fairseq_tool
from fairseq_megatron.models.registry import take_over_task
from fairseq_megatron.parallel import parallel_state


def _arch(cfg):
    """The architecture a model config names (``arch`` in fairseq's flat
    namespace, ``_name`` in a Hydra config)."""
    return getattr(cfg, "_name", None) or getattr(cfg, "arch", None)


class KeepLastBatch(BaseWrapperDataset):
    """``dataset`` whose ``batch_by_size`` also returns the last batch that
    fairseq's drops for not being a multiple of ``required_batch_size_multiple``.
    fairseq fills the batches in the order of ``indices`` (unless given fixed
    shapes, left as they are), so the dropped batch is the indices after the
    others."""

    def batch_by_size(self, indices, max_tokens=None, max_sentences=None, required_batch_size_multiple=1):
        batches = self.dataset.batch_by_size(indices, max_tokens=max_tokens, max_sentences=max_sentences,
                                             required_batch_size_multiple=required_batch_size_multiple)
        if required_batch_size_multiple <= 1 or self.get_batch_shapes() is not None:
            return batches
        indices = np.fromiter(indices, dtype=np.int64, count=-1)
        batched = sum(len(batch) for batch in batches)
        if batched < len(indices):
            batches = list(batches) + [indices[batched:]]
        return batches


@take_over_task("language_modeling", LanguageModelingConfig)
class LanguageModelingTask(FairseqLanguageModelingTask):
    """fairseq's ``language_modeling`` (``fairseq/tasks/language_modeling.py``),
    changed only for our models (see the module docstring)."""

    builds_our_model = False
    """Whether the last model this task built is one of ours."""

    initial_weights_may_be_loaded = False
    """Read by our model's ``build_model``: a checkpoint's weights will fill
    the model, so drawing its own can wait (set while :meth:`build_model`
    builds one for a checkpoint)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._training_batches = False
        self._evaluation_datasets = {}

    # ------------------------------------------------------------ model

    def build_model(self, cfg, from_checkpoint=False):
        from fairseq_megatron.models.model_parallel_transformer_lm import is_model_parallel_arch

        if not is_model_parallel_arch(_arch(cfg)):
            self.builds_our_model = False
            return super().build_model(cfg, from_checkpoint)
        self.initial_weights_may_be_loaded = from_checkpoint
        try:
            model = super().build_model(cfg, from_checkpoint)
        finally:
            self.initial_weights_may_be_loaded = False
        self.builds_our_model = True
        if dist.is_initialized() and dist.get_rank() != 0:
            logging.getLogger().setLevel(logging.WARNING)  # fairseq's rule, which fairseq-validate resets
        return model

    # ------------------------------------------------------------ batches

    @contextlib.contextmanager
    def training_batches(self):
        """Within this context :meth:`get_batch_iterator` batches as fairseq
        does (the trainer's training iterator); elsewhere our models'
        evaluation keeps fairseq's dropped last batch."""
        previous, self._training_batches = self._training_batches, True
        try:
            yield
        finally:
            self._training_batches = previous

    def _data_parallel_shard(self, num_shards: int, shard_id: int):
        """fairseq-eval-lm and fairseq-generate pass ``num_shards`` = world
        size and ``shard_id`` = global rank; under model parallelism these
        become the data-parallel size and rank. The trainer already passes
        data-parallel values, which differ from those."""
        if (parallel_state.model_parallel_is_initialized()
                and parallel_state.get_tensor_model_parallel_world_size() > 1
                and num_shards == dist.get_world_size() and shard_id == dist.get_rank()):
            return parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        return num_shards, shard_id

    def get_batch_iterator(self, dataset, max_tokens=None, max_sentences=None, max_positions=None,
                           ignore_invalid_inputs=False, required_batch_size_multiple=1, seed=1, num_shards=1,
                           shard_id=0, num_workers=0, epoch=1, data_buffer_size=0, disable_iterator_cache=False,
                           skip_remainder_batch=False, grouped_shuffling=False, update_epoch_batch_itr=False):
        """fairseq's (``fairseq/tasks/fairseq_task.py``); for our models the
        shards follow the data-parallel rank, and evaluation keeps the last
        batch."""
        if self.builds_our_model:
            num_shards, shard_id = self._data_parallel_shard(num_shards, shard_id)
            if not self._training_batches:
                dataset = self._evaluation_datasets.setdefault(id(dataset), KeepLastBatch(dataset))
        return super().get_batch_iterator(
            dataset, max_tokens, max_sentences, max_positions, ignore_invalid_inputs, required_batch_size_multiple,
            seed, num_shards, shard_id, num_workers, epoch, data_buffer_size, disable_iterator_cache,
            skip_remainder_batch, grouped_shuffling, update_epoch_batch_itr)

    def filter_indices_by_size(self, indices, dataset, max_positions=None, ignore_invalid_inputs=False):
        """fairseq's, with one-line refusals for our models.

        Raises:
            UsageError: a sample is too long and ``ignore_invalid_inputs`` is
                false, or every sample is too long (except in
                fairseq-interactive, where a skipped prompt is one of many).
        """
        if not self.builds_our_model:
            return super().filter_indices_by_size(indices, dataset, max_positions, ignore_invalid_inputs)
        interactive = fairseq_tool() == "interactive"
        if ignore_invalid_inputs:
            kept = super().filter_indices_by_size(indices, dataset, max_positions, ignore_invalid_inputs)
            if len(kept) == 0 and len(indices) > 0 and not interactive:
                raise UsageError(f"all {len(indices):,} samples are longer than the model's positions "
                                 f"(max_positions={max_positions}): lower --tokens-per-sample")
            return kept
        kept, too_long = dataset.filter_indices_by_size(indices, max_positions)
        if len(too_long) == 0:
            return kept
        if interactive:  # the user's own lines
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

    def eval_lm_dataloader(self, dataset, max_tokens=36000, batch_size=None, max_positions=None, num_shards=1,
                           shard_id=0, num_workers=1, data_buffer_size=10, context_window=0):
        """fairseq's (``fairseq/tasks/language_modeling.py``) for our models:
        shards by data-parallel rank, a context-window dataset that does not
        depend on the order batches are read in, and samples longer than the
        model's positions refused unless fairseq-eval-lm was given
        ``--skip-invalid-size-inputs-valid-test`` (fairseq always skipped
        them). Records on the run the data-parallel group the shards are
        split over, for its sum (:mod:`fairseq_megatron.fairseq_integration.eval_lm`)."""
        if not self.builds_our_model:
            return super().eval_lm_dataloader(dataset, max_tokens, batch_size, max_positions, num_shards, shard_id,
                                              num_workers, data_buffer_size, context_window)
        from fairseq_megatron.fairseq_integration.eval_lm import ContextWindowDataset, current_run

        num_shards, shard_id = self._data_parallel_shard(num_shards, shard_id)
        run = current_run()
        if run is not None and num_shards > 1 and parallel_state.model_parallel_is_initialized() and (
                num_shards, shard_id) == (parallel_state.get_data_parallel_world_size(),
                                          parallel_state.get_data_parallel_rank()):
            run.sharded_over = parallel_state.get_data_parallel_group()
        if context_window > 0:
            dataset = ContextWindowDataset(dataset, tokens_per_sample=self.args.tokens_per_sample,
                                           context_window=context_window, pad_idx=self.source_dictionary.pad())
        return self.get_batch_iterator(
            dataset=dataset, max_tokens=max_tokens, max_sentences=batch_size, max_positions=max_positions,
            ignore_invalid_inputs=True if run is None else run.skip_invalid_size_inputs, num_shards=num_shards,
            shard_id=shard_id, num_workers=num_workers, data_buffer_size=data_buffer_size,
        ).next_epoch_itr(shuffle=False)

    def valid_step(self, sample, model, criterion):
        """fairseq's; for our models the empty batch that pads a short data
        shard (``{}``) scores nothing. Every rank of a model-parallel group
        reads the same shard, so all of them skip it and no collective waits."""
        if self.builds_our_model and not sample:
            return 0, 0, {}  # (loss, sample size, logging output)
        return super().valid_step(sample, model, criterion)
