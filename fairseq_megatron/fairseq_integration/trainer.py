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
  The log also gives tokens/s, model TFLOP/s and MFU per GPU, and peak memory
  (:mod:`fairseq_megatron.training.throughput`).
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
  samples go through torch's schedule of ``--pipeline-schedule`` (1F1B by
  default) as micro-batches
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
  active exception"; :mod:`~fairseq_megatron.fairseq_integration.prefetch`).

The class is fairseq's ``Trainer`` with one mixin per concept: the
data-parallel groups and wrapping (:mod:`~fairseq_megatron.fairseq_integration.data_parallel_groups`),
the checkpoint of this rank's part (:mod:`~fairseq_megatron.fairseq_integration.trainer_checkpoints`),
per-step logging (:mod:`~fairseq_megatron.fairseq_integration.step_logging`);
this file holds the step itself.
"""

import logging

import torch
import torch.distributed as dist
from fairseq.trainer import Trainer

from fairseq_megatron.errors import UsageError
from fairseq_megatron.fairseq_integration.data_parallel_groups import DataParallelGroups
from fairseq_megatron.fairseq_integration.prefetch import stop_prefetch_threads_at_exit
from fairseq_megatron.fairseq_integration.step_logging import StepLogging
from fairseq_megatron.fairseq_integration.trainer_checkpoints import TrainerCheckpoints
from fairseq_megatron.models.model_parallel_transformer_lm import is_our_model, leave_initial_weights_to_the_trainer
from fairseq_megatron.training.pipeline_schedules import schedule_of
from fairseq_megatron.modules.padding import mark_padding
from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.parallel.grad_norm import model_parallel_norm_aggregator
from fairseq_megatron.training.context_parallel import count_own_share
from fairseq_megatron.training.fused_adam import FairseqFusedAdam, fused_adam_applies
from fairseq_megatron.training.memory import log_memory_report
from fairseq_megatron.training.parallelize import Parallelized, parallelize
from fairseq_megatron.training.pipeline_schedule import PipelineSchedule
from fairseq_megatron.training.throughput import Throughput

logger = logging.getLogger(__name__)


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


class MegatronTrainer(TrainerCheckpoints, StepLogging, DataParallelGroups, Trainer):
    """fairseq's ``Trainer`` for :class:`~fairseq_megatron.models.model_parallel_transformer_lm.ModelParallelTransformerLanguageModel`
    at any model-parallel size (the module docstring says what differs).

    Raises (from :meth:`load_checkpoint`): UsageError for a checkpoint of
    another size without ``--reset-optimizer``, one whose vocabulary rows
    differ from this model's, or a part file that is cut short.
    """

    def __init__(self, cfg, task, model, criterion, quantizer=None):
        leave_initial_weights_to_the_trainer(cfg.model, False)  # this trainer now draws them (load_checkpoint)
        groups = parallel_state.get_process_groups()  # this rank's layout, built once at launch
        self.throughput = Throughput.of(model, groups.tensor.size, groups.layout.world_size, cfg)  # model still whole
        self.parallelized = parallelize(model, groups, cfg)
        self.data_parallel = self.parallelized.data_parallel
        self.context_split = self.parallelized.context_split  # None, or how this rank's C ranks split sequences
        if cfg.ema.store_ema:  # fairseq's EMA copies the model in the constructor, before any load
            model.run_deferred_initialisation()
        # before fairseq's constructor, which reads the data-parallel size
        stage = self.parallelized.stage
        self.pipeline = _pipeline_schedule(cfg, task, model, self.parallelized) if stage.stages > 1 else None
        self._memory_reported = False
        super().__init__(cfg, task, model, criterion, quantizer)
        stop_prefetch_threads_at_exit()

    def _build_optimizer(self):
        """fairseq's optimizer; ``--optimizer adam`` on fp32 CUDA weights then
        runs :class:`~fairseq_megatron.training.fused_adam.FusedAdamW` inside
        fairseq's wrappers. fairseq builds it again after loading a
        checkpoint's optimizer state: it is chosen as the first
        (:attr:`~fairseq_megatron.fairseq_integration.data_parallel_groups.DataParallelGroups.is_fsdp`)."""
        self._lr_scheduler = None
        super()._build_optimizer()
        outer = self._optimizer
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
        dictionary = getattr(self.task, "source_dictionary", None)
        if self.context_split is not None and isinstance(sample, dict) and "target" in sample:
            sample = count_own_share(sample, self.context_split, dictionary.pad())
        tokens = _source_tokens(sample)
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
        schedule as one batch of micro-batches (:mod:`fairseq_megatron.training.pipeline_schedule`);
        the log interval's throughput per GPU joins fairseq's meters
        (:mod:`fairseq_megatron.training.throughput`). After the first update
        each rank logs what it holds (:func:`~fairseq_megatron.training.memory.memory_report`)."""
        if self.pipeline is None:
            result = super().train_step(samples, raise_oom)
        else:
            with self.pipeline.steps_of(self.task):
                result = super().train_step([self.pipeline.micro_batches_of(samples)], raise_oom)
        self.throughput.log()
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

def _pipeline_schedule(cfg, task, model, parallelized: Parallelized) -> PipelineSchedule:
    """The schedule of this rank's stage, over the modules of its model
    chunks that :func:`~fairseq_megatron.training.parallelize.parallelize`
    made: ``--update-freq`` micro-batches of ``--batch-size`` (or
    ``--max-tokens / --tokens-per-sample``) rows of ``--tokens-per-sample`` tokens.

    Raises:
        UsageError: neither ``--batch-size`` nor ``--max-tokens``.
    """
    length = cfg.task.tokens_per_sample
    rows = cfg.dataset.batch_size or (cfg.dataset.max_tokens or 0) // length
    if rows < 1:
        raise UsageError(f"--pipeline-model-parallel-size needs --batch-size, or --max-tokens of at least "
                         f"--tokens-per-sample {length}: they set the micro-batch shape")
    return PipelineSchedule(model, parallelized.stage, parallelized.chunk_modules, cfg.optimization.update_freq[0],
                            rows, length, task.source_dictionary.pad(), schedule_of(cfg.model))


