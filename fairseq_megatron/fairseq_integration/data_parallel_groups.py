"""The data-parallel ranks of :class:`~fairseq_megatron.fairseq_integration.trainer.MegatronTrainer`,
answered from its data parallelism (:mod:`fairseq_megatron.training.data_parallel`).

fairseq's ``Trainer`` asks one set of names for two groups:
``data_parallel_world_size``, ``data_parallel_rank`` and
``data_parallel_process_group`` both average the gradients (and sum the
logging outputs) and shard the data loader's batches. Here they are the ranks
that average gradients (``gradients``: ``D x C``, with context parallelism
Megatron-Core's data-and-context-parallel group), and the batches are
sharded over the ``D`` model copies (``data``: the ``C`` ranks of a sequence
read the same batches) by this mixin's iterators. fairseq knows only the
tensor-parallel size (``fairseq/distributed/utils.py``:
``get_data_parallel_group``) and would take pipeline stages and
context-parallel ranks for model copies.
"""

import contextlib

from fairseq import utils


class DataParallelGroups:
    """The data-parallel properties, wrapping and iterators of the trainer,
    mixed into :class:`~fairseq_megatron.fairseq_integration.trainer.MegatronTrainer`
    (before fairseq's ``Trainer``). Reads ``self.data_parallel``, set by its
    constructor."""

    # fairseq's branches for fairscale's FSDP (``fairseq/trainer.py``) that are taken while the trainer and its
    # optimizer are built (no cast to fp16; the fp16 loss scaler without an fp32 copy) are what parameters kept in
    # fp32 need; those taken later call fairscale's own methods, and the data parallelism does their work itself
    is_fsdp = property(lambda self: self.data_parallel.keeps_fp32_parameters and self._lr_scheduler is None)

    _lr_scheduler = None  # fairseq's constructor sets it after it first asks is_fsdp

    @property
    def data_parallel_world_size(self) -> int:
        """The ``D x C`` ranks whose gradients are averaged."""
        return self.data_parallel.gradients.size

    @property
    def data_parallel_process_group(self):
        return self.data_parallel.gradients.group

    @property
    def data_parallel_rank(self) -> int:
        return self.data_parallel.gradients.rank

    @property
    def data_shards(self) -> int:
        """The number of shards the data loader splits the data into: ``D``."""
        return self.data_parallel.data.size

    @property
    def model(self):
        """fairseq's wrapped model, wrapped by the data parallelism where it
        has a wrapper of its own (:meth:`~fairseq_megatron.training.data_parallel.DataParallel.wrap`)."""
        if self._wrapped_model is None and self.use_distributed_wrapper:
            self._wrapped_model = self.data_parallel.wrap(self._model, self.device, self.cfg.distributed_training)
        return super().model

    def _batch_iterator(self, subset: str, sharded: bool = True, **options):
        """``task.get_batch_iterator`` of dataset ``subset``, sharded over the
        ``D`` model copies where ``sharded``, with ``options`` as fairseq's
        ``get_train_iterator`` and ``get_valid_iterator`` (``fairseq/trainer.py``)
        give them."""
        data, dataset = self.data_parallel.data, self.cfg.dataset
        iterator = self.task.get_batch_iterator(
            dataset=self.task.dataset(subset), required_batch_size_multiple=dataset.required_batch_size_multiple,
            num_workers=dataset.num_workers, data_buffer_size=dataset.data_buffer_size,
            num_shards=data.size if sharded else 1, shard_id=data.rank if sharded else 0, **options)
        self.reset_dummy_batch(iterator.first_batch)
        return iterator

    def get_train_iterator(self, epoch, combine=True, load_dataset=True, data_selector=None, shard_batch_itr=True,
                           disable_iterator_cache=False):
        """fairseq's, its batches sharded over the model copies; the task
        batches the training data as fairseq does (evaluation keeps a last
        batch fairseq drops)."""
        training_batches = getattr(self.task, "training_batches", contextlib.nullcontext)  # our task's
        if load_dataset:
            self.task.load_dataset(self.cfg.dataset.train_subset, epoch=epoch, combine=combine,
                                   data_selector=data_selector, tpu=self.tpu)
        cfg = self.cfg
        options = dict(
            max_tokens=cfg.dataset.max_tokens, max_sentences=cfg.dataset.batch_size,
            max_positions=utils.resolve_max_positions(self.task.max_positions(), self.model.max_positions(),
                                                      cfg.dataset.max_tokens),
            ignore_invalid_inputs=True,
            seed=(cfg.common.seed + epoch) if cfg.dataset.update_ordered_indices_seed else cfg.common.seed,
            epoch=epoch, disable_iterator_cache=disable_iterator_cache,
            skip_remainder_batch=cfg.optimization.skip_remainder_batch,
            grouped_shuffling=cfg.dataset.grouped_shuffling, update_epoch_batch_itr=cfg.dataset.update_epoch_batch_itr)
        with training_batches():
            return self._batch_iterator(cfg.dataset.train_subset, sharded=shard_batch_itr, **options)

    def get_valid_iterator(self, subset, disable_iterator_cache=False):
        """fairseq's, its batches sharded over the model copies."""
        cfg = self.cfg
        return self._batch_iterator(
            subset, max_tokens=cfg.dataset.max_tokens_valid, max_sentences=cfg.dataset.batch_size_valid,
            max_positions=utils.resolve_max_positions(self.task.max_positions(), self.model.max_positions()),
            ignore_invalid_inputs=cfg.dataset.skip_invalid_size_inputs_valid_test, seed=cfg.common.seed,
            epoch=1,  # fairseq's fixed "epoch": the same validation batches every epoch
            disable_iterator_cache=disable_iterator_cache, skip_remainder_batch=False)
