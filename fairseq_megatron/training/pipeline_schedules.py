"""The pipeline schedules, by the name ``--pipeline-schedule`` gives them:
where each puts the model chunks, how many it needs, and what it costs.

Every schedule runs one update's ``m`` micro-batches (``--update-freq``)
through ``P`` pipeline stages (``--pipeline-model-parallel-size``), each
stage holding ``V`` model chunks of ``L / (P x V)`` consecutive layers;
torch's ``torch.distributed.pipelining`` runs them
(:mod:`fairseq_megatron.training.pipeline_schedule`):

================  =================================  ========  ======================================
name              torch's class                      chunks V  placement of the ``P x V`` chunks
================  =================================  ========  ======================================
1f1b              ``Schedule1F1B``                   1         stage s: chunk s
interleaved-1f1b  ``ScheduleInterleaved1F1B``        any       loop: stage s: chunks s, s + P, ...
interleaved-zb    ``ScheduleInterleavedZeroBubble``  any       loop
zbv               ``ScheduleZBVZeroBubble``          2         V: stage s: chunks s and 2P - 1 - s
dualpipev         ``ScheduleDualPipeV``              2         V
================  =================================  ========  ======================================

The zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline
Parallelism") split each backward into the gradient of the chunk's input
(B, which the previous stage waits for) and of its weights (W, which no
one waits for), and run the W passes where 1F1B idles. In the V placement
the first and the last chunk sit on stage 0, which then holds the token
embedding and the output projection (one tensor where they are tied).

The layers a stage holds follow from the schedule, never from a
checkpoint: checkpoints keep each layer's global number
(:mod:`fairseq_megatron.models.pipeline_stage`), so any checkpoint loads at
any schedule (:func:`stage_layout`: what a stage holds).

**Idle share** (:func:`idle_share_bound`): the share of the pipeline's
span (its forward and backward passes of one update, first pass to last)
that a stage spends outside its chunks' passes (what
``scripts/benchmark_pipeline_bubble.py`` measures, the mean over the
stages), for a perfectly balanced pipeline with free communication. With
``F``, ``B`` and ``W`` the times of one micro-batch's forward, input
backward and weight backward over a whole stage, the update's work is
``m (F + B + W)`` and the bubble

- 1F1B: ``(P - 1)(F + B + W)`` (Narayanan et al. 2021, section 2.2.1);
- interleaved 1F1B: ``(P - 1)(F + B + W) / V`` (section 2.2.2);
- ZB-1P, torch's interleaved zero bubble at ``V = 1``: ``(P - 1)(F + B - W)``
  (Qi et al. 2024, section 3, ZB-H1; the DualPipe repository's table writes
  it ``(PP - 1)(F + B_full - 2W)``), and ``/ V`` interleaved;
- ZB-V: ``(P - 1)(F + B - 2W) / 2`` (Qi et al. 2024, section 6, chunks of
  half a stage): none where ``F = B = W``;
- DualPipeV: ``(2P / 2 - 1)(F&B + B_full - 3W)`` over chunks of half a stage
  (DeepSeek-AI 2024, DualPipe's table; ``F&B``, a forward overlapped with a
  backward, costs ``F + B + W`` where nothing overlaps them, as on a CPU):
  ``(P - 1)(F + 2B - W) / 2``.

The papers take ``F = B = W``; so does :func:`idle_share_bound` unless
given measured times. Splitting the backward does not change its FLOPs
(``B + W`` is the unsplit backward's work), but each half walks the
autograd graph on its own, which costs time on a CPU (measured in
docs/benchmarks.md, pipeline bubble). :func:`bubble` leaves that overhead out.

**Activations in flight** (:func:`activations_in_flight`): the chunk
forwards whose activations a stage holds at its peak, counted from the
order in which torch's schedule classes run each stage's passes (their
``_calculate_single_rank_operations``). A split backward keeps a chunk's
activations until its weight pass: torch's ``stage_backward_input``
retains the autograd graph, and keeps the gradient flowing into each
weight's operation (``param_groups``) for ``stage_backward_weight``. With
``m`` micro-batches, ``P`` stages, ``V`` chunks and stage ``s``:

- 1F1B: ``min(P - s, m)`` forwards of ``L / P`` layers: the first stage
  holds ``L`` layers' worth (Korthikanti et al. 2022, section 4.2.3);
- interleaved 1F1B: ``(V - 1) r + 2 (P - 1 - s) + 1`` chunk forwards of
  ``L / (P V)`` layers, ``r = m / max(1, m // P)`` per round, at most
  ``m V`` (torch's ``_get_warmup_ops``; Narayanan et al. 2021, section
  2.2.2: ``1 + (P - 1) / (P V)`` times 1F1B's first stage);
- interleaved zero bubble: ``(V - 1) r + P`` on every stage, at most
  ``m V`` (a warm-up of ``(V - 1) r + P - 1 - s``, then ``s`` input
  backwards before the first weight pass), ``s + 1`` of them waiting for
  their weight pass; at ``V = 1``, ZB-1P: ``P`` micro-batches, 1F1B's peak
  (Qi et al. 2024, section 3, ZB-H1);
- ZB-V: ``min(2P, m + 1 + s)`` chunk forwards of ``L / (2P)`` layers, at
  most ``L`` layers as 1F1B's first stage (Qi et al. 2024, section 6), at
  most ``min(2s + 1, 2(m - P) + 1)`` of them waiting for their weight pass
  (the cool-down's input backwards run ahead of their weight passes). The
  two peaks fall at different times: their sum is an upper bound, within
  one chunk's activations of the order's peak on the first and the last
  stage from ``m = 2P - 1`` on, looser below;
- DualPipeV: ``2P + 1`` chunk forwards of ``L / (2P)`` layers on every
  stage, none waiting (DeepSeek-AI's DualPipe repository, table "based on
  the same number of PP stages": ``PP + 1`` chunks for ``PP = 2P`` stages
  on ``P`` devices). DualPipe, the bidirectional schedule of DeepSeek-V3
  (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 3.2.1,
  Table 2), keeps two copies of the parameters; DualPipeV, its V-shaped
  half that torch's ``ScheduleDualPipeV`` runs, keeps one: each rank holds
  chunks ``s`` and ``2P - 1 - s`` (the table's "2x" counts against one of
  ``2P`` stages), the same ``L / P`` layers as 1F1B at ``P``.
"""

from typing import NamedTuple, Optional

import torch
from fairseq.utils import safe_getattr

from fairseq_megatron.errors import UsageError
from fairseq_megatron.models.pipeline_stage import LOOP, V_SHAPE, PipelineStageLayout, pipeline_stages
from fairseq_megatron.parallel import parallel_state


class Schedule(NamedTuple):
    """One pipeline schedule: its ``--pipeline-schedule`` name, torch's
    class, its chunk placement (:data:`LOOP` or :data:`V_SHAPE`), the model
    chunks per stage it fixes (None: ``--virtual-pipeline-model-parallel-size``),
    whether it splits the backward into input and weight passes, and its
    source."""

    name: str
    torch_class: str
    placement: str
    chunks: Optional[int]
    splits_backward: bool
    source: str


SCHEDULES = {s.name: s for s in (
    Schedule("1f1b", "Schedule1F1B", LOOP, 1, False, "Narayanan et al. 2021, section 2.2.1"),
    Schedule("interleaved-1f1b", "ScheduleInterleaved1F1B", LOOP, None, False, "Narayanan et al. 2021, section 2.2.2"),
    Schedule("interleaved-zb", "ScheduleInterleavedZeroBubble", LOOP, None, True, "Qi et al. 2024, ZB-1P"),
    Schedule("zbv", "ScheduleZBVZeroBubble", V_SHAPE, 2, True, "Qi et al. 2024, section 6, ZB-V"),
    Schedule("dualpipev", "ScheduleDualPipeV", V_SHAPE, 2, True, "DeepSeek-AI 2024, DualPipe; Sea AI Lab's cut-in-half"),
)}


def schedule_of(args) -> Schedule:
    """The schedule of model config ``args``: ``--pipeline-schedule``, by
    default ``interleaved-1f1b`` where ``--virtual-pipeline-model-parallel-size``
    is above 1 and ``1f1b`` otherwise (a checkpoint saved before the option
    existed records neither).

    Raises:
        UsageError: a name that is no schedule.
    """
    name = safe_getattr(args, "pipeline_schedule", None)
    if name is None:
        virtual = safe_getattr(args, "virtual_pipeline_model_parallel_size", None)
        return SCHEDULES["interleaved-1f1b" if virtual is not None and int(virtual) > 1 else "1f1b"]
    if name not in SCHEDULES:
        raise UsageError(f"--pipeline-schedule {name}: no such schedule (one of {', '.join(SCHEDULES)})")
    return SCHEDULES[name]


def chunks_per_stage(args) -> int:
    """``V``, the model chunks each stage holds under the schedule of
    ``args``: the number it fixes, else ``--virtual-pipeline-model-parallel-size``
    (1 where not given).

    Raises:
        UsageError: an unknown schedule; a ``--virtual-pipeline-model-parallel-size``
            other than the number the schedule fixes.
    """
    schedule = schedule_of(args)
    given = safe_getattr(args, "virtual_pipeline_model_parallel_size", None)
    given = None if given is None else int(given)
    if schedule.chunks is None:
        return 1 if given is None else given
    if given is not None and given != 1 and given != schedule.chunks:
        raise UsageError(f"--virtual-pipeline-model-parallel-size {given} with --pipeline-schedule {schedule.name}: "
                         f"that schedule gives each stage {schedule.chunks} model chunk(s); drop the option, or use "
                         f"--pipeline-schedule interleaved-1f1b or interleaved-zb, which take any number")
    return schedule.chunks


def stage_layout(args, stage: Optional[int] = None) -> PipelineStageLayout:
    """What ``stage`` (by default this rank's stage in its pipeline group)
    holds under model config ``args`` (``--pipeline-model-parallel-size``,
    ``--pipeline-schedule``, ``--virtual-pipeline-model-parallel-size``,
    ``--decoder-layers``, ``--share-decoder-input-output-embed``,
    ``--account-for-embedding-in-pipeline-split``,
    ``--account-for-loss-in-pipeline-split``): its chunks placed as the
    schedule places them.

    Raises:
        UsageError: an unknown schedule, a number of chunks it does not run,
            layers not divisible by the ``P x V`` chunks.
    """
    stages = pipeline_stages(args)
    if stage is None:
        stage = parallel_state.get_pipeline_model_parallel_rank() if stages > 1 else 0
    placement, chunks = (schedule_of(args).placement, chunks_per_stage(args)) if stages > 1 else (LOOP, 1)
    return PipelineStageLayout(stage, stages, int(args.decoder_layers),
                               bool(safe_getattr(args, "share_decoder_input_output_embed", False)), chunks, placement,
                               *(stages > 1 and bool(safe_getattr(args, f"account_for_{what}_in_pipeline_split", False))
                                 for what in ("embedding", "loss")))


def micro_batches_needed(schedule: Schedule, stages: int) -> int:
    """The fewest micro-batches per update ``schedule`` runs at ``stages``
    stages: one per stage, and DualPipeV one per model chunk (torch's
    ``ScheduleDualPipeV`` refuses fewer)."""
    return 2 * stages if schedule.name == "dualpipev" else stages


def check_schedule(args) -> None:
    """Refuse, from the options alone, a pipeline of more than one stage
    that the schedule of model config ``args`` cannot run: an unknown name;
    a number of model chunks it does not run; ``--decoder-layers`` not
    divisible by the ``P x V`` chunks; fewer micro-batches (``--update-freq``)
    than :func:`micro_batches_needed`, or, with chunks in the loop placement,
    a number not divisible by ``P`` (Megatron-Core's rule: the interleaved
    schedules run them in rounds of one per stage); compiled layers with a
    split backward (its input pass keeps the graph for the weight pass,
    which torch's compiled backward refuses where it donates its buffers:
    "This backward function was compiled with non-empty donated buffers",
    pytorch/pytorch#161904).

    Raises:
        UsageError: the first refusal, naming the option to change.
    """
    schedule = schedule_of(args)
    stages = pipeline_stages(args)
    virtual = stage_layout(args, 0).virtual  # refuses the chunks the schedule does not run, an uneven split
    micro_batches = safe_getattr(args, "update_freq", None)
    micro_batches = None if micro_batches is None else max(micro_batches)
    needed = micro_batches_needed(schedule, stages)
    if micro_batches is not None and micro_batches < needed:
        below, per = ((f"--pipeline-model-parallel-size {stages}", "stage") if needed == stages else
                      (f"{needed} ({virtual} x --pipeline-model-parallel-size {stages})", "model chunk"))
        raise UsageError(f"--update-freq {micro_batches} is below {below}: the {schedule.name} schedule runs the "
                         f"update's --update-freq micro-batches and needs at least one per {per}")
    if micro_batches is not None and schedule.placement == LOOP and virtual > 1 and micro_batches % stages:
        raise UsageError(f"--update-freq {micro_batches} is not divisible by --pipeline-model-parallel-size "
                         f"{stages}: the {schedule.name} schedule with {virtual} model chunks per stage runs the "
                         f"micro-batches in rounds of one per stage")
    if schedule.splits_backward and safe_getattr(args, "compile_layers", False):
        raise UsageError(f"--compile-layers with --pipeline-schedule {schedule.name}: its split backward keeps "
                         f"the graph after the input pass for the weight pass, which a compiled backward with "
                         f"donated buffers refuses in torch {torch.__version__.split('+')[0]} "
                         f"(pytorch/pytorch#161904); drop one, or use --pipeline-schedule 1f1b or interleaved-1f1b")


class InFlight(NamedTuple):
    """What one stage holds at its peak (module docstring): ``forwards``,
    chunk forwards whose activations it keeps, and ``weight_passes``, those
    of them whose input backward ran and whose weight pass has not (each
    keeps the gradients flowing into its weights' operations too; an upper
    bound where the two peaks fall apart, exact for 1F1B, interleaved 1F1B,
    interleaved zero bubble and DualPipeV)."""

    forwards: int
    weight_passes: int


def activations_in_flight(schedule: Schedule, stage: int, stages: int, chunks: int,
                          micro_batches: int) -> InFlight:
    """What ``stage`` of ``stages`` holds at its peak under ``schedule``
    with ``chunks`` model chunks per stage and ``micro_batches`` per update
    (module docstring: the formulas and their sources). One stage: one
    forward."""
    p, v, m, s = stages, chunks, micro_batches, stage
    if p == 1:
        return InFlight(1, 0)
    per_round = m // max(1, m // p)
    if schedule.name == "1f1b":
        return InFlight(min(p - s, m), 0)
    if schedule.name == "interleaved-1f1b":
        return InFlight(min((v - 1) * per_round + 2 * (p - 1 - s) + 1, m * v), 0)
    if schedule.name == "interleaved-zb":
        return InFlight(min((v - 1) * per_round + p, m * v), min(s + 1, m * v))
    if schedule.name == "zbv":
        return InFlight(min(2 * p, m + 1 + s), min(2 * s + 1, 2 * (m - p) + 1))
    return InFlight(2 * p + 1, 0)  # dualpipev


def bubble(schedule: Schedule, stages: int, chunks: int, forward: float = 1.0, backward_input: float = 1.0,
           backward_weight: float = 1.0) -> float:
    """The time a stage idles in an update under ``schedule`` at ``stages``
    stages of ``chunks`` model chunks, for a micro-batch's forward,
    input-backward and weight-backward times over one stage (module
    docstring: the formulas and their sources; any unit). A schedule that
    does not split the backward runs ``B + W`` as one pass. 0 at one stage;
    never below 0."""
    p, v, f, b, w = stages, chunks, forward, backward_input, backward_weight
    if p == 1:
        return 0.0
    idle = {
        "1f1b": (p - 1) * (f + b + w),
        "interleaved-1f1b": (p - 1) * (f + b + w) / v,
        "interleaved-zb": (p - 1) * (f + b - w) / v,
        "zbv": (p - 1) * (f + b - 2 * w) / 2,
        "dualpipev": (p - 1) * (f + 2 * b - w) / 2,
    }[schedule.name]
    return max(idle, 0.0)


def idle_share_bound(schedule: Schedule, stages: int, chunks: int, micro_batches: int,
                     forward: float = 1.0, backward_input: float = 1.0, backward_weight: float = 1.0) -> float:
    """The idle share of an update (module docstring) that ``schedule``
    cannot avoid at ``stages`` stages of ``chunks`` model chunks and
    ``micro_batches`` micro-batches: :func:`bubble` over the update's
    ``m (F + B + W)`` and the bubble. 0 at one stage."""
    idle = bubble(schedule, stages, chunks, forward, backward_input, backward_weight)
    return idle / (micro_batches * (forward + backward_input + backward_weight) + idle)
