"""Per-step logging of :class:`~fairseq_megatron.fairseq_integration.trainer.MegatronTrainer`
that reads nothing from the device.

fairseq's ``Trainer._reduce_and_log_stats`` (``fairseq/trainer.py``) waited
on the device twice per step: it tested the finiteness of a gradient norm
``train_step`` had already tested, and rounded the step's meter values into
a dictionary that ``fairseq-train`` only compares with None.
"""

import collections.abc
import logging

import torch
from fairseq.logging import metrics
from fairseq.trainer import Trainer

logger = logging.getLogger(__name__)


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


class StepLogging:
    """The trainer's ``_reduce_and_log_stats``, mixed into
    :class:`~fairseq_megatron.fairseq_integration.trainer.MegatronTrainer`
    (before fairseq's ``Trainer``)."""

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
