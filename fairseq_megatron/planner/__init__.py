"""Parallelism planner: which (tensor, pipeline, context, data) parallel
layout to train a model with on a cluster, from the memory each GPU needs
and the predicted time of a step.

* :mod:`~fairseq_megatron.planner.shape`: the model's parameters and FLOPs;
* :mod:`~fairseq_megatron.planner.memory`: bytes per GPU of a pipeline stage;
* :mod:`~fairseq_megatron.planner.hardware`: GPU presets and what collectives cost;
* :mod:`~fairseq_megatron.planner.step_time`: the predicted step, by cost;
* :mod:`~fairseq_megatron.planner.layouts`: every valid layout, with both;
* :mod:`~fairseq_megatron.planner.recommendation`: the fastest that fits, and why;
* :mod:`~fairseq_megatron.planner.dry_run`: one rank's training step at full
  size under fake tensors, its memory beside the prediction.

``fairseq-megatron-plan`` (:mod:`fairseq_megatron.cli.plan_parallelism`) is
the command line over these.
"""

from fairseq_megatron.planner.errors import PlanError
from fairseq_megatron.planner.hardware import GPUS, GPU, Cluster
from fairseq_megatron.planner.layouts import Layout, candidate_layouts, default_margin_gb, plan
from fairseq_megatron.planner.memory import (
    ACTIVATION_BYTES,
    BYTES_PER_PARAM,
    FULLY_SHARDED,
    Training,
    activation_bytes_per_layer,
    adafactor_state_elements,
    stage_memory,
)
from fairseq_megatron.planner.recommendation import recommend, training_flags
from fairseq_megatron.planner.shape import ModelShape, humanize, megatron_arch_shape, model_tflops_per_step
from fairseq_megatron.planner.step_time import COSTS, StepTime, step_time

__all__ = [
    "ACTIVATION_BYTES", "BYTES_PER_PARAM", "COSTS", "Cluster", "FULLY_SHARDED", "GPU", "GPUS", "Layout", "ModelShape",
    "PlanError", "StepTime", "Training", "activation_bytes_per_layer", "adafactor_state_elements",
    "candidate_layouts", "default_margin_gb", "humanize", "megatron_arch_shape", "model_tflops_per_step", "plan",
    "recommend", "stage_memory", "step_time", "training_flags",
]
