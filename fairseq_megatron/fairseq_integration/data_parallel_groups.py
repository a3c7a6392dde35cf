"""The data-parallel ranks of :class:`~fairseq_megatron.fairseq_integration.trainer.MegatronTrainer`:
whose gradients it averages, which shard of the data each reads, and how the
model is wrapped to average them.

fairseq knows only the tensor-parallel size (``--model-parallel-size``) and
takes every other rank for a model copy (``fairseq/distributed/utils.py``:
``get_data_parallel_group``). With pipeline stages or context parallelism
the groups are this package's (:mod:`fairseq_megatron.parallel.parallel_state`):
gradients are averaged over the ``D x C`` ranks of a stage (Megatron-Core's
data-and-context-parallel group), and the data loader shards over the ``D``
model copies (the ``C`` ranks of a sequence read the same batches).
``--ddp-backend fully_sharded`` is torch's FSDP2, applied to the model in
place (:mod:`fairseq_megatron.training.fully_sharded`), not fairscale's.
"""

import contextlib

import torch

from fairseq_megatron.parallel import parallel_state


class DataParallelGroups:
    """The data-parallel properties and wrapping of the trainer, mixed into
    :class:`~fairseq_megatron.fairseq_integration.trainer.MegatronTrainer`
    (before fairseq's ``Trainer``). Reads ``self.pipeline``,
    ``self.context_split`` and ``self.fully_sharded``, set by its constructor."""

    _sharding_data = False  # True while the data loader is made: its shards are the D model copies'

    @property
    def is_fsdp(self) -> bool:
        """fairseq's branches for fully sharded data parallelism are written
        for fairscale's FSDP (``local_metadata_dict``, ``gather_full_optim_state_dict``,
        ``use_sharded_state``); this trainer follows two of them, within
        :meth:`_fairseq_fsdp_branches` (fp32 parameters, not cast to half in
        the constructor; fairseq's loss scaler without an fp32 copy for
        ``--fp16``), and does the rest itself (:mod:`fairseq_megatron.training.fully_sharded`)."""
        return vars(self).get("_in_fsdp_branches", False)

    @contextlib.contextmanager
    def _fairseq_fsdp_branches(self):
        self._in_fsdp_branches = self.fully_sharded
        try:
            yield
        finally:
            self._in_fsdp_branches = False

    @property
    def _layout_groups(self) -> bool:
        """Whether the data-parallel groups are this package's own, not fairseq's."""
        return self.pipeline is not None or self.context_split is not None

    @property
    def data_parallel_world_size(self):
        """fairseq's, except with pipeline stages (fairseq knows only the
        tensor-parallel size, and took the other stages for model copies) and
        context parallelism: the ``D x C`` ranks whose gradients are
        averaged, or ``D`` while the data loader is made (:meth:`data_shards`)."""
        if not self._layout_groups:
            return super().data_parallel_world_size
        return parallel_state.get_data_parallel_world_size(with_context_parallel=not self._sharding_data)

    @property
    def data_parallel_process_group(self):
        if not self._layout_groups:
            return super().data_parallel_process_group
        return parallel_state.get_data_parallel_group(with_context_parallel=True)

    @property
    def data_parallel_rank(self):
        if not self._layout_groups:
            return super().data_parallel_rank
        return parallel_state.get_data_parallel_rank(with_context_parallel=not self._sharding_data)

    @contextlib.contextmanager
    def _reading_data_shards(self, reading: bool = True):
        """Within this context the data-parallel size and rank are the data
        loader's: the ``D`` model copies (the ``C`` ranks of a sequence read
        the same batches); with ``reading=False``, those of the ranks that
        average gradients again."""
        previous, self._sharding_data = self._sharding_data, reading
        try:
            yield
        finally:
            self._sharding_data = previous

    @property
    def data_shards(self) -> int:
        """The number of shards the data loader splits the data into: ``D``."""
        with self._reading_data_shards():
            return self.data_parallel_world_size

    @property
    def use_distributed_wrapper(self) -> bool:
        """fairseq's, for the ranks that average gradients, also while the data
        loader is made: fairseq builds the wrapper there, and by the loader's
        ``D = 1`` a run at ``C = 2`` would get none and never sum its
        context-parallel ranks' gradients."""
        with self._reading_data_shards(False):
            return super().use_distributed_wrapper

    @property
    def model(self):
        """fairseq's wrapped model; on CPU its ``pytorch_ddp`` wrapper gets no
        device ids (fairseq passed the GPU id, which torch's DDP refuses for
        a CPU module)."""
        cfg = self.cfg.distributed_training
        if self._wrapped_model is None and self.fully_sharded:
            self._wrapped_model = self._model  # FSDP2 shards the model in place
        if (self._wrapped_model is None and self.use_distributed_wrapper and self.device.type == "cpu"
                and cfg.ddp_backend in {"c10d", "pytorch_ddp"}):
            from fairseq.distributed import ModuleProxyWrapper

            self._wrapped_model = ModuleProxyWrapper(torch.nn.parallel.DistributedDataParallel(
                module=self._model.to(self.device),
                broadcast_buffers=cfg.broadcast_buffers,
                bucket_cap_mb=cfg.bucket_cap_mb,
                process_group=self.data_parallel_process_group,
                find_unused_parameters=cfg.find_unused_parameters,
                gradient_as_bucket_view=cfg.gradient_as_bucket_view,
            ))
        return super().model

    def get_train_iterator(self, *args, **kwargs):
        """fairseq's; the task batches the training data as fairseq does
        (evaluation keeps a last batch fairseq drops)."""
        training_batches = getattr(self.task, "training_batches", contextlib.nullcontext)  # our task's
        with training_batches(), self._reading_data_shards():
            return super().get_train_iterator(*args, **kwargs)

    def get_valid_iterator(self, *args, **kwargs):
        """fairseq's, sharded over the model copies (:meth:`data_shards`)."""
        with self._reading_data_shards():
            return super().get_valid_iterator(*args, **kwargs)
