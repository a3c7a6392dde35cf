"""fairseq's ``Trainer`` for our models: :class:`MegatronTrainer`.

fairseq's own model parallelism subclasses its trainer
(``fairseq/model_parallel/megatron_trainer.py``); so does this package, and
its class takes that name. ``fairseq-train`` builds it for our architectures
at every model-parallel size, 1 included (fairseq would build its plain
``Trainer`` there), and fairseq's own classes for every other model
(:func:`build_trainer`, bound to the names ``Trainer`` and
``MegatronTrainer`` of ``fairseq_cli.train``).

What it does differently from fairseq's trainer, and why:

- Gradient norm: parameters every rank holds in full (layer norms,
  row-parallel biases) count once, not once per model-parallel rank
  (:mod:`fairseq_megatron.parallel.grad_norm`), so ``gnorm`` and clipping
  do not depend on the model-parallel size.
- Optimizer: ``--optimizer adam`` with fp32 weights on CUDA runs torch's
  fused AdamW (:mod:`fairseq_megatron.training.fused_adam`), with fairseq's
  gradient multiply and clipping applied inside its kernel, where fairseq
  without apex runs its Python Adam. An update with non-finite gradients is
  then skipped on the device: fairseq read the norm on the host before every
  update (a wait for the whole backward pass); the error comes one update
  later instead.
- Per-step logging reads nothing from the device (fairseq's
  ``_reduce_and_log_stats`` waited twice per step), and whether a batch
  holds padding is decided on its CPU copy (:mod:`fairseq_megatron.modules.padding`).
- Checkpoints: rank K writes ``-model_part-K`` files, its crash file too
  (fairseq wrote one ``crash.pt`` from every rank); the RNG tracker's streams
  are saved and restored (as fairseq's MegatronTrainer); a checkpoint saved at
  another model-parallel size is refused with the command that reshards it,
  or, with ``--reset-optimizer`` (and fine-tuning), resharded in memory; the
  epoch's position is converted when the number of data-parallel groups
  changed; every data-parallel rank reads its part itself (fairseq sent it
  from one rank with ``broadcast_object``, which names the source by its rank
  in the group where torch takes a global one: "Global rank 0 is not part of
  group" at model and data parallelism).
- Pipeline stages (``--pipeline-model-parallel-size``): an update's
  samples go through torch's 1F1B schedule as micro-batches
  (:mod:`fairseq_megatron.training.pipeline_schedule`): for the length of
  fairseq's ``train_step`` and ``valid_step`` the task's per-sample steps
  are the schedule's; the data-parallel group and size are this package's
  (fairseq knows only the tensor-parallel size, and would take the other
  stages for model copies); each stage's files are ``-model_part-K-stage-S``.
- Context parallelism (``--context-parallel-size C``): the ``C`` ranks of
  a sequence read the same batches (the data loader shards over the ``D``
  model copies), each counts the tokens of its own positions
  (:func:`fairseq_megatron.training.context_parallel.count_own_share`), and
  gradients, sample sizes and logging outputs are summed over the ``D x C``
  ranks (Megatron-Core's data-and-context-parallel group).
- Initial weights are drawn only if no checkpoint fills them
  (:class:`fairseq_megatron.modules.sharding.DeferredInitialisation`).
- Data-parallel wrapping on CPU (fairseq passed a GPU device id to torch's
  DDP), and prefetch threads stopped at exit (fairseq's ``BackgroundConsumer``
  could abort the interpreter's shutdown: "terminate called without an
  active exception").
"""

import atexit
import collections.abc
import contextlib
import logging
import os
import queue
import re
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist
from fairseq.logging import metrics
from fairseq.trainer import Trainer

from fairseq_megatron.checkpoint.part_files import is_write_failure, stage_suffix, write_error
from fairseq_megatron.errors import UsageError
from fairseq_megatron.files import written_whole
from fairseq_megatron.models.pipeline_stage import PipelineStageLayout
from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.parallel.grad_norm import model_parallel_norm_aggregator
from fairseq_megatron.parallel.rng_tracker import get_rng_tracker
from fairseq_megatron.modules.padding import mark_padding
from fairseq_megatron.training.context_parallel import count_own_share
from fairseq_megatron.training.fully_sharded import shard_model
from fairseq_megatron.training.fused_adam import FairseqFusedAdam, fused_adam_applies
from fairseq_megatron.training.memory import log_memory_report
from fairseq_megatron.training.parallelize import parallelize
from fairseq_megatron.training.pipeline_schedule import PipelineSchedule

logger = logging.getLogger(__name__)


def is_our_model(model) -> bool:
    """Whether ``model`` (possibly wrapped, e.g. in DDP) is one of our LMs."""
    from fairseq_megatron.models.model_parallel_transformer_lm import ModelParallelTransformerLanguageModel

    for _ in range(3):  # fairseq's ModuleProxyWrapper around torch's DDP around the model, at most
        if isinstance(model, ModelParallelTransformerLanguageModel):
            return True
        model = getattr(model, "module", None) if isinstance(model, torch.nn.Module) else None
    return False


def build_trainer(cfg, task, model, criterion, quantizer=None):
    """The trainer ``fairseq-train`` builds: :class:`MegatronTrainer` for our
    models, fairseq's own ``Trainer`` (model-parallel size 1) or
    ``MegatronTrainer`` (above) for any other, as fairseq chooses."""
    if is_our_model(model):
        return MegatronTrainer(cfg, task, model, criterion, quantizer)
    if cfg.common.model_parallel_size == 1:
        return Trainer(cfg, task, model, criterion, quantizer)
    from fairseq.model_parallel.megatron_trainer import MegatronTrainer as FairseqMegatronTrainer

    return FairseqMegatronTrainer(cfg, task, model, criterion)


class CheckpointInMemory(str):
    """A checkpoint's file name that carries the state to load instead of the
    file's: a part built in memory from the parts of another model-parallel
    size, or a state changed after reading. fairseq's ``Trainer.load_checkpoint``
    tests that the file exists, logs its name and reads it with
    ``checkpoint_utils.load_checkpoint_to_cpu``, which returns :attr:`state`
    for such a name (:mod:`.checkpoint_utils`)."""

    def __new__(cls, path: str, state: dict):
        name = super().__new__(cls, path)
        name.state = state
        return name


class _NormCheckedOnTheDevice(torch.Tensor):
    """A gradient norm whose finiteness the fused optimizer tests on the
    device. fairseq's ``train_step`` asks ``torch.isfinite(grad_norm).all()``
    to raise before a non-finite update; for this tensor the answer is True
    without reading it (the optimizer skips such an update itself, and
    :meth:`MegatronTrainer.clip_grad_norm` raises at the next update). Every
    other operation sees a plain tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.isfinite:
            return _FINITE
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class _Finite:
    """``torch.isfinite`` of a :class:`_NormCheckedOnTheDevice`."""

    @staticmethod
    def all() -> bool:
        return True

    def __bool__(self) -> bool:
        return True


_FINITE = _Finite()


class _SmoothedValuesOnRead(collections.abc.Mapping):
    """The dictionary ``Trainer._reduce_and_log_stats`` returns (one step's
    smoothed meter values and ``sample_size``, without ppl, wps, wpb and bsz),
    computed when first read instead of right away: rounding reads the loss
    from the GPU. The step's meters receive nothing after it returns."""

    def __init__(self, aggregator, sample_size):
        self._aggregator, self._sample_size, self._values = aggregator, sample_size, None

    def _computed(self) -> dict:
        if self._values is None:
            values = self._aggregator.get_smoothed_values()
            values["sample_size"] = self._sample_size
            for key in ("ppl", "wps", "wpb", "bsz"):
                values.pop(key, None)
            self._values, self._aggregator = values, None
        return self._values

    def __getitem__(self, key):
        return self._computed()[key]

    def __iter__(self):
        return iter(self._computed())

    def __len__(self):
        return len(self._computed())


def _source_tokens(sample):
    """``sample["net_input"]["src_tokens"]``, or None for any other shape of batch."""
    if isinstance(sample, dict) and isinstance(sample.get("net_input"), dict):
        tokens = sample["net_input"].get("src_tokens")
        if torch.is_tensor(tokens):
            return tokens
    return None


def padding_tested_on_the_host(tokens: torch.Tensor, pad: int) -> bool:
    """Whether CPU tensor ``tokens`` holds ``pad`` (a read that waits for nothing)."""
    return bool(tokens.eq(pad).any())


class MegatronTrainer(Trainer):
    """fairseq's ``Trainer`` for :class:`~fairseq_megatron.models.model_parallel_transformer_lm.ModelParallelTransformerLanguageModel`
    at any model-parallel size (the module docstring says what differs).

    Raises (from :meth:`load_checkpoint`): UsageError for a checkpoint of
    another size without ``--reset-optimizer``, one whose vocabulary rows
    differ from this model's, or a part file that is cut short.
    """

    def __init__(self, cfg, task, model, criterion, quantizer=None):
        stage = PipelineStageLayout.of(cfg.model)  # this rank's stage of the layout
        parallelize(model, cfg.model, stage)
        self.context_split = model.decoder.context_split  # None, or how this rank's C ranks split sequences
        self._sharding_data = False  # True while the data loader is made: its shards are the D model copies'
        if cfg.ema.store_ema:  # fairseq's EMA copies the model in the constructor, before any load
            model.run_deferred_initialisation()
        # before fairseq's constructor, which reads the data-parallel size
        self.pipeline = _pipeline_schedule(cfg, task, model, stage) if stage.stages > 1 else None
        self.fully_sharded = cfg.distributed_training.ddp_backend == "fully_sharded"
        if self.fully_sharded:  # with pipeline stages each model chunk's module is a root unit
            shard_model(model, self.pipeline.chunk_modules if self.pipeline else [model], cfg)
        self._memory_reported = False
        with self._fairseq_fsdp_branches():  # no .half() of the sharded fp32 parameters
            super().__init__(cfg, task, model, criterion, quantizer)
        _stop_prefetch_threads_at_exit()

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

    # ------------------------------------------------------------ groups

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
    def checkpoint_suffix(self) -> str:
        """fairseq's (``-model_part-K`` at model-parallel size > 1), and with
        pipeline stages ``-model_part-K-stage-S``."""
        if self.pipeline is None:
            return super().checkpoint_suffix
        base = re.sub(r"-model_part-\d+$", "", self.cfg.checkpoint.checkpoint_suffix or "")
        return base + stage_suffix(parallel_state.get_tensor_model_parallel_rank(), self.pipeline.stage.stage)

    # ------------------------------------------------------------ wrapping

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

    def _build_optimizer(self):
        """fairseq's optimizer; ``--optimizer adam`` on fp32 CUDA weights then
        runs :class:`~fairseq_megatron.training.fused_adam.FusedAdamW` inside
        fairseq's wrappers."""
        with self._fairseq_fsdp_branches():
            super()._build_optimizer()
        outer = self._optimizer
        if self.fully_sharded:
            return  # fairseq's Adam on the DTensor shards
        if fused_adam_applies(outer, self.cfg):
            self._optimizer = FairseqFusedAdam(outer)
            self._lr_scheduler.optimizer = self._optimizer
        elif fused_adam_applies(getattr(outer, "fp32_optimizer", None), self.cfg):
            outer.fp32_optimizer = FairseqFusedAdam(outer.fp32_optimizer)

    # ------------------------------------------------------------ one step

    def _prepare_sample(self, sample, is_dummy=False):
        """fairseq's, which also records on the device copy of the tokens
        whether they hold padding, tested on the CPU copy (no device wait);
        with context parallelism the sample's sizes are this rank's
        (:func:`~fairseq_megatron.training.context_parallel.count_own_share`,
        on the CPU copy)."""
        if self.context_split is not None and isinstance(sample, dict) and "target" in sample:
            sample = count_own_share(sample, self.context_split, self.get_model().decoder.padding_idx)
        tokens = _source_tokens(sample)
        dictionary = getattr(self.task, "source_dictionary", None)
        if tokens is None or tokens.device.type != "cpu" or dictionary is None:
            return Trainer._prepare_sample(self, sample, is_dummy)
        pad = dictionary.pad()
        holds_padding = padding_tested_on_the_host(tokens, pad)
        sample, is_dummy = Trainer._prepare_sample(self, sample, is_dummy)
        moved = _source_tokens(sample)
        if moved is not None:
            mark_padding(moved, pad, holds_padding)
        return sample, is_dummy

    def train_step(self, samples, raise_oom=False):
        """fairseq's; with pipeline stages the update's samples go to the
        schedule as one batch of micro-batches (:mod:`fairseq_megatron.training.pipeline_schedule`).
        After the first update each rank logs what it holds
        (:func:`~fairseq_megatron.training.memory.memory_report`)."""
        if self.pipeline is None:
            result = super().train_step(samples, raise_oom)
        else:
            with self.pipeline.steps_of(self.task):
                result = super().train_step([self.pipeline.micro_batches_of(samples)], raise_oom)
        if not self._memory_reported:
            self._memory_reported = True
            log_memory_report(dist.get_rank() if dist.is_initialized() else 0, self.get_model(), self.optimizer)
        return result

    def valid_step(self, sample, raise_oom=False):
        """fairseq's; with pipeline stages through the schedule's forward-only path."""
        if self.pipeline is None:
            return super().valid_step(sample, raise_oom)
        with self.pipeline.steps_of(self.task):
            return super().valid_step(sample, raise_oom)

    def clip_grad_norm(self, clip_norm):
        """The norm of the whole model, replicated parameters counted once.

        With the fused AdamW the returned norm answers fairseq's
        ``torch.isfinite`` test without a device read, and the optimizer
        skips the update on the device if it is not finite.

        Raises:
            FloatingPointError: the last update was skipped for a non-finite
                norm (fairseq raised before that update; here one later).
        """
        reduce_group = parallel_state.get_model_parallel_group() if self.pipeline is not None else None
        aggregate = model_parallel_norm_aggregator(self.model, parallel_state.get_tensor_model_parallel_group(),
                                                   reduce_group=reduce_group)
        fused = self.optimizer._optimizer if isinstance(self.optimizer, FairseqFusedAdam) else None
        if fused is None:
            return self.optimizer.clip_grad_norm(clip_norm, aggregate_norm_fn=aggregate)
        if fused.last_step_skipped():
            raise FloatingPointError(f"gradients are Nan/Inf in update {self.get_num_updates()} (skipped: "
                                     "weights and Adam moments unchanged)")
        grad_norm = self.optimizer.clip_grad_norm(clip_norm, aggregate_norm_fn=aggregate)
        fused.skip_step_if_nonfinite(grad_norm)
        return grad_norm.as_subclass(_NormCheckedOnTheDevice)

    def _reduce_and_log_stats(self, logging_outputs, sample_size, grad_norm=None):
        """fairseq's meters, without its two device reads per step: a
        finiteness test of a norm ``train_step`` already tested, and the
        rounding of the step's values into a dictionary that fairseq-train
        only compares with None (computed here when read)."""
        if self.tpu or not torch.is_tensor(grad_norm):  # validation passes no norm
            return Trainer._reduce_and_log_stats(self, logging_outputs, sample_size, grad_norm)
        metrics.log_speed("ups", 1.0, priority=100, round=2)
        metrics.log_scalar("gnorm", grad_norm, priority=400, round=3)
        clip_norm = self.cfg.optimization.clip_norm
        if clip_norm > 0:
            # fairseq builds 100 and 0 with new_tensor: host-to-device copies
            clipped = (grad_norm > clip_norm).to(grad_norm.dtype) * 100
            metrics.log_scalar("clip", clipped, priority=500, round=1)
        with metrics.aggregate() as aggregator:
            if logging_outputs is not None:
                self.task.reduce_metrics(logging_outputs, self.get_criterion())
            if "loss" not in aggregator:
                if "loss" not in self._warn_once:
                    self._warn_once.add("loss")
                    logger.warning("Criterion.reduce_metrics did not log a 'loss' value, "
                                   "which may break some functionality")
                metrics.log_scalar("loss", -1)
        return _SmoothedValuesOnRead(aggregator, sample_size)

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

    # ------------------------------------------------------------ checkpoints

    def save_checkpoint(self, filename, extra_state):
        """fairseq's, for this rank's part (``crash.pt`` too), recording the
        RNG tracker's streams and the number of data-parallel groups,
        written whole under a temporary name of its own
        (:func:`~fairseq_megatron.files.written_whole`; fairseq's
        ``torch_persistent_save`` writes ``<name>.tmp``, a name a file of the
        user's may have, and on a failed write retried twice, 2.5 s apart,
        and logged a traceback before the error went on). Remote paths and
        ``--write-checkpoints-asynchronously`` go through fairseq's.

        Raises:
            CheckpointError: the file system refused the write (a full disk):
                one line with the bytes free; the temporary file is removed,
                and the file of the previous save stays whole.
        """
        suffix = self.checkpoint_suffix  # "-model_part-K" (fairseq's distributed_init sets it)
        if suffix and filename.endswith(".pt") and not filename.endswith(suffix + ".pt"):
            filename = filename[: -len(".pt")] + suffix + ".pt"
        extra_state["rng_tracker_states"] = get_rng_tracker().get_states()
        extra_state["data_parallel_world_size"] = self.data_shards
        if self.cfg.checkpoint.write_checkpoints_asynchronously or "://" in filename:
            return super().save_checkpoint(filename, extra_state)
        if not self.should_save_checkpoint_on_current_rank:
            return None
        from fairseq import trainer as fairseq_trainer
        from fairseq import utils

        fairseq_trainer.logger.info(f"Saving checkpoint to {os.path.abspath(filename)}")  # fairseq's log lines
        state_dict = utils.move_to_cpu(self.state_dict())
        state_dict["extra_state"].update(extra_state)
        try:
            with written_whole(filename) as partial:
                torch.save(state_dict, partial)
        except (OSError, RuntimeError) as e:
            if not is_write_failure(e):
                raise
            raise write_error(filename, e) from None
        fairseq_trainer.logger.info(f"Finished saving checkpoint to {os.path.abspath(filename)}")
        return os.path.abspath(filename)

    def load_checkpoint(self, filename, reset_optimizer=False, reset_lr_scheduler=False, optimizer_overrides=None,
                        reset_meters=False):
        """fairseq's, for this rank's part of a checkpoint saved at any size.

        Every data-parallel rank reads the file itself. Afterwards the RNG
        tracker's streams are restored, the epoch's position is converted to
        this run's number of data-parallel groups, and, if nothing was
        loaded, the deferred initial weights are drawn.
        """
        from fairseq_megatron.checkpoint.reading import ChangedWhileRead, ReadThrough
        from fairseq_megatron.fairseq_integration.checkpoint_utils import part_name, checkpoint_for_rank

        filename = part_name(filename, self.checkpoint_suffix)
        model = self.get_model()
        deferred = model.deferred_initialisation is not None
        checkpoint = self.cfg.checkpoint
        on_all_ranks = checkpoint.load_checkpoint_on_all_dp_ranks
        checkpoint.load_checkpoint_on_all_dp_ranks = True
        try:
            given = checkpoint_for_rank(self, filename, reset_optimizer)
            extra_state = super().load_checkpoint(given, reset_optimizer, reset_lr_scheduler, optimizer_overrides,
                                                  reset_meters)
        finally:
            checkpoint.load_checkpoint_on_all_dp_ranks = on_all_ranks
        if extra_state is None and isinstance(given, (ReadThrough, CheckpointInMemory)):
            # fairseq found no file under the name it was handed: another process renamed it since it was opened
            raise ChangedWhileRead(f"{given} was renamed or removed while it was loaded (a run is saving this "
                                   f"checkpoint?): start again, or load a copy")
        if extra_state is not None and "rng_tracker_states" in extra_state:
            get_rng_tracker().set_states(extra_state["rng_tracker_states"])
        _continue_the_epoch(extra_state, self.data_shards)
        if model.run_deferred_initialisation():
            logger.info("no checkpoint to load: drew the initial weights (deferred from the build)")
        elif deferred:
            logger.info("the checkpoint filled every parameter: the initial weights were not drawn")
        return extra_state


def _continue_the_epoch(extra_state: Optional[dict], groups: int) -> None:
    """Convert a checkpoint's position in its epoch to ``groups`` data-parallel groups, in place.

    fairseq's ``EpochBatchIterator`` deals the epoch's batches (one order for
    any number of groups: shuffled by seed and epoch) round-robin to the D
    groups, so after ``iterations_in_epoch`` = k batches each, batches 0 ..
    kD - 1 have been trained (``fairseq/data/iterators.py``:
    ``ShardedIterator``). With G groups, each skips kD / G of its own; when
    G does not divide kD, the last kD mod G batches are trained once more
    (fewer than G). fairseq read the count as it was: with fewer groups it
    trained batches again, with more it skipped some. Checkpoints saved
    without ``data_parallel_world_size`` (by stock fairseq) are left as they are.
    """
    if not extra_state or "train_iterator" not in extra_state:
        return
    saved = extra_state.get("data_parallel_world_size")
    position = extra_state["train_iterator"]
    taken = position.get("iterations_in_epoch", 0) * (saved or 0)
    if saved is None or saved == groups or taken == 0:
        return
    position["iterations_in_epoch"] = taken // groups
    again = taken % groups
    logger.info(
        "resuming at %d data-parallel groups (saved at %d): epoch %d goes on after its first %d batches%s",
        groups, saved, position["epoch"], taken,
        f" ({again} of them trained once more: {taken} is not divisible by {groups})" if again else "")


def _pipeline_schedule(cfg, task, model, stage: PipelineStageLayout) -> PipelineSchedule:
    """The schedule of this rank's stage: ``--update-freq`` micro-batches of
    ``--batch-size`` (or ``--max-tokens / --tokens-per-sample``) rows of
    ``--tokens-per-sample`` tokens.

    Raises:
        UsageError: neither ``--batch-size`` nor ``--max-tokens``; fewer
            micro-batches than stages.
    """
    length = cfg.task.tokens_per_sample
    rows = cfg.dataset.batch_size or (cfg.dataset.max_tokens or 0) // length
    if rows < 1:
        raise UsageError(f"--pipeline-model-parallel-size needs --batch-size, or --max-tokens of at least "
                         f"--tokens-per-sample {length}: they set the micro-batch shape")
    return PipelineSchedule(model, stage, cfg.optimization.update_freq[0], rows, length,
                            task.source_dictionary.pad(), bf16_autocast=bool(getattr(cfg.model, "bf16_autocast", False)))


def _prefetch_threads():
    from fairseq.data.iterators import BackgroundConsumer

    return [t for t in threading.enumerate() if isinstance(t, BackgroundConsumer) and t.is_alive()]


def stop_prefetch_threads(timeout: float = 10.0) -> None:
    """Make every live fairseq ``BackgroundConsumer`` (the thread that
    prefetches batches) finish: its count limit is set to what it produced,
    so it stops after the item it is putting, and its queue is emptied so
    that the put returns. Waits at most ``timeout`` seconds in all. A daemon
    thread still collating (torch code) while the interpreter shut down
    sometimes aborted the process after a successful run."""
    deadline = time.monotonic() + timeout
    for thread in _prefetch_threads():
        thread._max_len = 0  # read after each put: `count >= max_len` ends its loop
        while thread.is_alive() and time.monotonic() < deadline:
            try:
                while True:
                    thread._queue.get_nowait()
            except queue.Empty:
                pass
            thread.join(timeout=0.05)


def _stop_prefetch_threads_at_exit() -> None:
    atexit.unregister(stop_prefetch_threads)  # once per process, whatever number of trainers
    atexit.register(stop_prefetch_threads)
