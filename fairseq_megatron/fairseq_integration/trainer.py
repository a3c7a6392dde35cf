"""fairseq's ``Trainer`` around each update: the fused AdamW, per-step
logging and padding tests that do not wait for the GPU, non-finite
gradients skipped on the device, prefetch threads stopped at exit, and a
finished run left as it is (steps 8 to 12 and 25 of
:mod:`fairseq_megatron.fairseq_integration`).

8. :func:`fused_adam_without_apex` -- ``--optimizer adam`` uses a fused
   kernel (torch's fused AdamW) when apex is absent, and that kernel also
   applies fairseq's gradient multiply and clipping; see
   :mod:`fairseq_megatron.training.fused_adam`.

9. :func:`step_log_without_device_wait` -- after every optimizer step the
   trainer's ``_reduce_and_log_stats`` waited for the GPU twice: it tested
   the gradient norm for finiteness (train_step had tested it before the
   step) and rounded the step's loss into a dictionary that
   ``fairseq-train`` only compares with None. The host then sat idle until
   the optimizer's kernels finished, and the GPU sat idle while the host
   prepared the next batch. The same meters are logged; the dictionary is
   rounded when first read.

10. :func:`quiet_prefetch_threads_at_exit` -- fairseq's ``BufferedIterator``
   prefetches batches in a daemon thread that is still collating (torch
   code) when a run stops before the end of its epoch; the process then
   sometimes aborted at exit ("terminate called without an active
   exception", exit code -6) after a successful run. Those threads are now
   stopped and joined before the interpreter shuts down.

11. :func:`padding_known_on_the_host` -- our decoder asks whether a batch
   holds padding (to build an attention mask only then), and on the GPU that
   question waited for the previous step's optimizer to finish. The trainer
   now answers it while the batch is still on the CPU and marks the GPU copy
   (:mod:`fairseq_megatron.training.padding`).

12. :func:`nonfinite_gradients_skipped_on_the_device` -- before every
   update the trainer tested the gradient norm on the host
   (``torch.isfinite(grad_norm)``, to raise FloatingPointError before the
   weights change), which waited for the whole backward pass. With our fused
   AdamW (``--bf16-autocast`` or fp32 training with ``--optimizer adam``)
   the kernel now skips such an update on the device, and the error is
   raised at the next update (or when a checkpoint would be saved) with the
   number of the update skipped. ``--fp16`` and ``--amp`` keep fairseq's
   test: their loss scaler reads the norm anyway; with several data-parallel
   groups, fairseq's check that they all got the same norm still reads it.

25. :func:`finished_training_left_as_it_is` -- fairseq-train resumed from a
   checkpoint that has reached ``--max-update`` (the same command run again,
   a requeued job) trained one more update before testing the limit, and
   saved it over ``checkpoint_last`` (and an interval checkpoint): each
   rerun moved the finished model on by one update. It now logs that there
   is nothing to train and stops without saving.
"""

import atexit
import collections.abc
import functools
import logging
import threading
import time
import weakref

import torch

from fairseq_megatron.fairseq_integration.patching import TorchStandIn, replace_in_cli_module

logger = logging.getLogger(__name__)


def fused_adam_without_apex() -> None:
    import fairseq.optim.adam

    from fairseq_megatron.training.fused_adam import fused_adam_class, route_to_fused

    fairseq.optim.adam.get_fused_adam_class = fused_adam_class(fairseq.optim.adam.get_fused_adam_class)
    route_to_fused(fairseq.optim.adam.FairseqAdam)


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


def step_log_without_device_wait() -> None:
    from fairseq.logging import metrics
    from fairseq.trainer import Trainer

    original = Trainer._reduce_and_log_stats

    @functools.wraps(original)
    def reduce_and_log_stats(self, logging_outputs, sample_size, grad_norm=None):
        if self.tpu or not torch.is_tensor(grad_norm):  # validation passes no norm
            return original(self, logging_outputs, sample_size, grad_norm)
        # fairseq's body without its two waits. train_step calls this with a
        # norm it found finite (after an fp16 overflow it does not call it).
        metrics.log_speed("ups", 1.0, priority=100, round=2)
        metrics.log_scalar("gnorm", grad_norm, priority=400, round=3)
        clip_norm = self.cfg.optimization.clip_norm
        if clip_norm > 0:
            # fairseq builds 100 and 0 with new_tensor: host-to-device copies,
            # each a wait on the GPU
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

    Trainer._reduce_and_log_stats = reduce_and_log_stats


_prefetch_threads = weakref.WeakSet()


_stop_prefetching = threading.Event()


def _until_stopped(items):
    for item in items:
        if _stop_prefetching.is_set():
            return
        yield item


def stop_prefetch_threads(timeout: float = 10.0) -> None:
    """Make every live ``BackgroundConsumer`` finish: it produces no new
    item once the stop is set, and its queue is emptied so that a pending
    ``put`` returns. Waits at most ``timeout`` seconds in all."""
    import queue

    _stop_prefetching.set()
    deadline = time.monotonic() + timeout
    for thread in list(_prefetch_threads):
        while thread.is_alive() and time.monotonic() < deadline:
            try:
                while True:
                    thread._queue.get_nowait()
            except queue.Empty:
                pass
            thread.join(timeout=0.05)


def quiet_prefetch_threads_at_exit() -> None:
    from fairseq.data import iterators

    original_init = iterators.BackgroundConsumer.__init__

    @functools.wraps(original_init)
    def __init__(self, queue, source, max_len, cuda_device):
        original_init(self, queue, _until_stopped(source), max_len, cuda_device)
        _prefetch_threads.add(self)

    iterators.BackgroundConsumer.__init__ = __init__
    atexit.register(stop_prefetch_threads)


def _source_tokens(sample):
    """``sample["net_input"]["src_tokens"]``, or None for any other shape of batch."""
    if isinstance(sample, dict) and isinstance(sample.get("net_input"), dict):
        tokens = sample["net_input"].get("src_tokens")
        if torch.is_tensor(tokens):
            return tokens
    return None


def padding_known_on_the_host() -> None:
    from fairseq.trainer import Trainer

    from fairseq_megatron.training.padding import mark_padding

    original = Trainer._prepare_sample

    @functools.wraps(original)
    def prepare_sample(self, sample, is_dummy=False):
        tokens = _source_tokens(sample)
        dictionary = getattr(self.task, "source_dictionary", None)
        if tokens is None or tokens.device.type != "cpu" or dictionary is None:
            return original(self, sample, is_dummy)
        pad = dictionary.pad()
        holds_padding = bool(tokens.eq(pad).any())  # on the CPU: no wait
        sample, is_dummy = original(self, sample, is_dummy)
        moved = _source_tokens(sample)
        if moved is not None:
            mark_padding(moved, pad, holds_padding)
        return sample, is_dummy

    Trainer._prepare_sample = prepare_sample


_CHECKED_ON_THE_DEVICE = "_fairseq_megatron_finite_checked_on_the_device"


class _CheckedOnTheDevice:
    """``torch.isfinite(grad_norm)`` for a norm that step 12 marked: fairseq
    asks ``.all()`` of it and gets True without any tensor being read (the
    optimizer skips a non-finite update by itself)."""

    @staticmethod
    def all() -> bool:
        return True


class _TorchWithNormsCheckedOnTheDevice(TorchStandIn):
    """``torch`` inside ``fairseq.trainer``: ``isfinite`` of a gradient norm
    marked by step 12 answers without reading it; any other tensor gets
    torch's answer."""

    @staticmethod
    def isfinite(tensor):
        if torch.is_tensor(tensor) and getattr(tensor, _CHECKED_ON_THE_DEVICE, None) == tensor._version:
            return _CheckedOnTheDevice()
        return torch.isfinite(tensor)


def nonfinite_gradients_skipped_on_the_device() -> None:
    from fairseq import trainer as trainer_module
    from fairseq.model_parallel.megatron_trainer import MegatronTrainer
    from fairseq.optim.adam import FairseqAdam

    from fairseq_megatron.training.fused_adam import FusedAdamW

    def checked_on_the_device(clip_grad_norm):
        @functools.wraps(clip_grad_norm)
        def method(self, clip_norm):
            optimizer = self.optimizer  # FP16Optimizer, AMPOptimizer: not a FairseqAdam, unchanged
            fused = optimizer._optimizer if isinstance(optimizer, FairseqAdam) else None
            if not isinstance(fused, FusedAdamW):
                return clip_grad_norm(self, clip_norm)
            if fused.last_step_skipped():
                raise FloatingPointError(f"gradients are Nan/Inf in update {self.get_num_updates()} (skipped: "
                                         "weights and Adam moments unchanged)")
            grad_norm = clip_grad_norm(self, clip_norm)
            fused.skip_step_if_nonfinite(grad_norm)
            setattr(grad_norm, _CHECKED_ON_THE_DEVICE, grad_norm._version)
            return grad_norm

        return method

    for cls in (trainer_module.Trainer, MegatronTrainer):
        cls.clip_grad_norm = checked_on_the_device(cls.__dict__["clip_grad_norm"])
    trainer_module.torch = _TorchWithNormsCheckedOnTheDevice()


def finished_training_left_as_it_is() -> None:
    def wrap(train):
        @functools.wraps(train)
        def train_unless_finished(cfg, trainer, task, epoch_itr):
            """fairseq_cli.train's ``train`` (one epoch), which tests
            ``--max-update`` only after each update; every rank has loaded the
            same update count, so all of them stop here alike."""
            max_update = cfg.optimization.max_update
            if max_update and trainer.get_num_updates() >= max_update:
                logger.info(f"nothing to train: the checkpoint is at update {trainer.get_num_updates()}, "
                            f"--max-update is {max_update}; no checkpoint saved")
                return [None], True  # (validation losses, stop), as after an update that reached the limit
            return train(cfg, trainer, task, epoch_itr)

        return train_unless_finished

    replace_in_cli_module("fairseq_cli.train", "train", wrap)
