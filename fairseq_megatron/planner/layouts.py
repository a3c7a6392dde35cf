"""The parallel layouts of a cluster: every valid (tensor, pipeline,
context, data) split of the GPUs for a model and batch, with the memory per
GPU of each (:mod:`~fairseq_megatron.planner.memory`) and its predicted
step time (:mod:`~fairseq_megatron.planner.step_time`)."""

import dataclasses
import math
from argparse import Namespace
from typing import Dict, List, Optional, Tuple

from fairseq_megatron.errors import UsageError
from fairseq_megatron.planner.errors import PlanError
from fairseq_megatron.planner.hardware import GPUS, GPU, Cluster
from fairseq_megatron.planner.memory import Training, default_schedule, stage_memory
from fairseq_megatron.planner.shape import ModelShape
from fairseq_megatron.planner.step_time import step_time


@dataclasses.dataclass
class Layout:
    """One (tensor, pipeline, data) parallel layout, with ``cp`` context-
    parallel ranks and ``vp`` model chunks per pipeline stage, and its cost
    per GPU: gradient accumulation steps per optimizer step, parameters,
    memory in GB (1e9 bytes) by kind (of the first pipeline stage, the one
    that holds the most), ``fits`` (``total_gb`` within the GPU's memory less
    the margin), the predicted seconds and model TFLOP/s per GPU of one step
    and each cost's share of it (:data:`~fairseq_megatron.planner.step_time.COSTS`),
    and the GB each GPU sends across nodes in a step. ``schedule``: the
    pipeline schedule planned (a ``--pipeline-schedule`` name; with one
    stage, none), ``explicit`` when the request named it; under a schedule
    the request named the memory is that of the stage that holds the most
    (first or last)."""

    tp: int
    pp: int
    dp: int
    grad_accumulation: int
    params_per_gpu: int
    weights_gb: float
    gradients_gb: float
    optimizer_gb: float
    activations_gb: float
    total_gb: float
    fits: bool
    pipeline_bubble: float  # the schedule's bubble over the ideal step at F = B = W; 1F1B: (PP - 1) / (VP x m)
    host_activations_gb: float = 0.0  # the layer inputs --offload-activations keeps in host memory
    gathered_gb: float = 0.0  # fully sharded: weights and gradients gathered whole while computing
    sharding: str = "none"  # of the data-parallel copies: none, os (--zero-sharding os), zero2 or zero3
    cp: int = 1
    vp: int = 1
    predicted_step_seconds: float = 0.0
    predicted_tflops_per_gpu: float = 0.0
    time_shares: Dict[str, float] = dataclasses.field(default_factory=dict)
    network_gb: float = 0.0  # what each GPU sends through its network adapter per step
    gathers_across_nodes: bool = False  # fully sharded over data-parallel ranks in several nodes
    schedule: str = ""
    explicit: bool = False

    def as_dict(self) -> Dict:
        return dataclasses.asdict(self)

    def name(self) -> str:
        """``TP=8, PP=16, DP=8`` (with ``CP``, ``VP`` and the sharding where they apply)."""
        parts = [f"TP={self.tp}", f"PP={self.pp}"] + ([f"VP={self.vp}"] if self.vp > 1 else [])
        parts += ([f"CP={self.cp}"] if self.cp > 1 else []) + [f"DP={self.dp}"]
        sharded = {"zero3": " fully sharded", "zero2": " fully sharded (ZeRO-2)", "os": " ZeRO-1"}
        scheduled = f" ({self.schedule})" if self.explicit and self.pp > 1 else ""
        return ", ".join(parts) + sharded.get(self.sharding, "") + scheduled


def default_margin_gb(memory_gb: float) -> float:
    """Memory left free for the CUDA context, communication buffers and
    fragmentation: 10% of the GPU's, at least 2 GB."""
    return max(2.0, 0.1 * memory_gb)


def plan(m: ModelShape, gpus: int, gpus_per_node: int, gpu_memory_gb: float, micro_batch: int,
         global_batch: int, precision: str = "fp16", checkpointing: bool = False,
         sequence_parallel: bool = False, flash_attention: bool = True, tp: Optional[int] = None,
         pp: Optional[int] = None, offloading: bool = False, zero_sharding: bool = False, optimizer: str = "adam",
         fully_sharded: Optional[str] = None, cp: int = 1, vp: Optional[int] = None, gpu: Optional[GPU] = None,
         margin_gb: Optional[float] = None, fused_elementwise: bool = False,
         schedule: Optional[str] = None) -> List[Layout]:
    """Every valid layout with its memory per GPU and predicted step time.

    ``offloading`` (``--offload-activations``) implies ``checkpointing``.
    ``zero_sharding`` (fairseq's ``--zero-sharding os``) divides the
    optimizer's own state (Adam's moments, Adafactor's statistics) by the
    data-parallel size. ``fully_sharded`` (``"zero3"``, ``"zero2"``) divides
    weights, gradients and optimizer state by it (:func:`~fairseq_megatron.planner.memory.stage_memory`).
    ``optimizer``: ``"adam"`` or ``"adafactor"``. ``cp``: the context-parallel
    size of every layout. ``gpu``: the hardware the steps are timed on
    (default: the ``a100-80gb`` preset); ``gpu_memory_gb`` is its memory, of
    which ``margin_gb`` (default :func:`default_margin_gb`) is kept free.
    ``fused_elementwise``: ``--compile-layers`` (``Training``). ``schedule``:
    a ``--pipeline-schedule`` name: only layouts of several stages, each
    running it where fairseq-train's checks pass (:func:`schedule_refusal`;
    :func:`fully_sharded_refusal`), at its chunks or the fastest it can run.

    Valid: TP divides the heads and the FFN size and stays within a node
    (TP divides ``gpus_per_node``), PP divides the layers, DP = gpus / (TP*PP*CP)
    is whole, the global batch is a whole number of micro batches per
    data-parallel rank (gradient accumulation = global / (micro * DP)), and
    with PP > 1 there are at least PP micro batches per update (torch's
    1F1B schedule needs one per stage). With PP > 1 each layout takes the
    fastest number of model chunks per stage ``VP`` that fits (the
    interleaved schedule: ``VP`` divides the layers per stage, and PP the
    micro batches); ``vp`` fixes it. ``tp`` / ``pp`` restrict the search
    to one tensor / pipeline size.

    Raises:
        PlanError: an unknown precision, optimizer or sharding; the global
            batch is not a multiple of the micro batch; a requested ``tp``
            does not divide the heads or FFN size (or exceeds a node), a
            requested ``pp`` does not divide the layers, ``vp`` does not
            divide the layers of a stage, ``cp`` does not divide the GPUs or
            half the sequence; a margin of all the memory; no layout is
            valid (the message says why); fairseq-train's refusal of ``schedule``.
    """
    training = Training(micro_batch, precision, checkpointing or offloading, sequence_parallel, flash_attention,
                        offloading, zero_sharding, optimizer, fully_sharded, fused_elementwise)
    training.check()
    cluster = Cluster(gpus, gpus_per_node, dataclasses.replace(gpu or GPUS["a100-80gb"], memory_gb=gpu_memory_gb))
    cluster.check()
    margin = _checked_margin(gpu_memory_gb, margin_gb)
    _check_context_parallel(m, gpus, cp)
    refused = schedule is not None and schedule_refusal(m, schedule, pp or 1, vp, None, fused_elementwise)
    if refused:
        raise PlanError(refused)
    candidates = candidate_layouts(m, gpus // cp, gpus_per_node, micro_batch, global_batch, tp, pp, stride=cp)
    layouts = [lay for lay in (_fastest_chunks(m, candidate, training, cluster, cp, vp, gpu_memory_gb - margin,
                                               schedule) for candidate in candidates) if lay is not None]
    if not layouts:
        raise PlanError(_why_no_layout(m, gpus, gpus_per_node, micro_batch, global_batch, vp, schedule,
                                       fully_sharded))
    return layouts


def schedule_refusal(m: ModelShape, schedule: str, pp: int, vp: Optional[int], accumulation: Optional[int],
                     compiled: bool) -> Optional[str]:
    """fairseq-train's one-line refusal of ``--pipeline-schedule schedule``
    at ``pp`` stages of ``vp`` chunks (None: the schedule's own number),
    ``accumulation`` micro-batches per update (None: not checked) and
    ``--compile-layers`` (``compiled``), from its own checks
    (:func:`~fairseq_megatron.training.pipeline_schedules.check_schedule`);
    None where it runs. The planner's ``--layers`` and ``--vp`` are
    fairseq-train's ``--decoder-layers`` and ``--virtual-pipeline-model-parallel-size``."""
    from fairseq_megatron.training.pipeline_schedules import chunks_per_stage, check_schedule, schedule_of

    args = Namespace(pipeline_schedule=schedule, virtual_pipeline_model_parallel_size=vp,
                     pipeline_model_parallel_size=pp, decoder_layers=m.layers, compile_layers=compiled,
                     update_freq=None if accumulation is None else [accumulation])
    try:
        schedule_of(args)
        chunks_per_stage(args)
        if pp > 1:
            check_schedule(args)
    except UsageError as e:
        return str(e)
    return None


def _fastest_chunks(m: ModelShape, candidate: Tuple[int, int, int, int], training: Training, cluster: Cluster,
                    cp: int, vp: Optional[int], usable_gb: float, schedule: Optional[str] = None) -> Optional[Layout]:
    """The ``(TP, PP, DP, accumulation)`` candidate with the number of
    model chunks per stage (``vp``, else each it can run) predicted fastest
    among those that fit ``usable_gb`` (the fewest if none fits); None when
    it cannot run ``vp`` (or ``schedule``, which one stage does not run)."""
    from fairseq_megatron.training.pipeline_schedules import SCHEDULES

    t, p, dp, accumulation = candidate
    if schedule is not None and p == 1:  # a schedule asks for a pipeline
        return None
    if schedule is not None and p > 1:
        fixed = SCHEDULES[schedule].chunks
        chunks = [vp or fixed] if fixed is not None or vp is not None else _divisors(m.layers // p)
        chunks = [v for v in chunks if schedule_refusal(m, schedule, p, v, accumulation,
                                                        training.fused_elementwise) is None]
        if fully_sharded_refusal(schedule, training.fully_sharded) is not None:
            chunks = []
    else:
        chunks = chunk_counts(m.layers // p, p, accumulation)
        if vp is not None:
            chunks = [vp] if vp in chunks else []
    options = [_layout(m, t, p, dp, accumulation, training, cluster, cp, v, usable_gb, schedule) for v in chunks]
    if not options:
        return None
    fitting = [lay for lay in options if lay.fits] or options[:1]
    return min(fitting, key=lambda lay: lay.predicted_step_seconds)


def chunk_counts(stage_layers: int, pp: int, accumulation: int) -> List[int]:
    """The numbers of model chunks a stage of ``stage_layers`` layers can
    run: 1, and with several stages each divisor of its layers when the
    ``accumulation`` micro batches are a multiple of the stages."""
    if pp == 1 or accumulation % pp:
        return [1]
    return _divisors(stage_layers)


def _checked_margin(gpu_memory_gb: float, margin_gb: Optional[float]) -> float:
    """The memory kept free (default :func:`default_margin_gb`); PlanError for all of it or less than none."""
    margin = default_margin_gb(gpu_memory_gb) if margin_gb is None else margin_gb
    if not 0 <= margin < gpu_memory_gb:
        raise PlanError(f"a memory margin of {margin:g} GB leaves nothing of the GPU's {gpu_memory_gb:g} GB")
    return margin


def _check_context_parallel(m: ModelShape, gpus: int, cp: int) -> None:
    if cp < 1 or gpus % cp:
        raise PlanError(f"context-parallel size {cp} does not divide the {gpus} GPUs")
    if m.seq_len % (2 * cp):
        raise PlanError(f"context-parallel size {cp} needs the sequence ({m.seq_len} tokens) divisible by {2 * cp} "
                        f"(each rank holds two of 2 x {cp} chunks)")


def _layout(m: ModelShape, t: int, p: int, dp: int, accumulation: int, training: Training, cluster: Cluster,
            cp: int, vp: int, usable_gb: float, schedule: Optional[str] = None) -> Layout:
    from fairseq_megatron.training.pipeline_schedules import SCHEDULES, bubble

    gb = 1e9
    chosen = SCHEDULES[schedule] if schedule else default_schedule(vp)
    first = stage_memory(m, t, p, dp, accumulation, training, cp, vp, "first", schedule=schedule)
    if schedule and p > 1:  # the split schedules load the last stage most
        first = max(first, stage_memory(m, t, p, dp, accumulation, training, cp, vp, "last", schedule=schedule),
                    key=lambda stage: stage.total)
    time = step_time(m, t, p, dp, accumulation, training, cluster, first.params, cp, vp, schedule=schedule)
    sharding = training.fully_sharded or ("os" if training.zero_sharding else "none")
    return Layout(t, p, dp, accumulation, first.params, first.weights / gb, first.gradients / gb,
                  first.optimizer / gb, first.activations / gb, first.total / gb, first.total / gb <= usable_gb,
                  bubble(chosen, p, vp) / (3 * accumulation), first.host / gb, first.gathered / gb, sharding, cp, vp,
                  time.seconds, time.tflops_per_gpu, time.shares(), time.network_bytes / gb,
                  bool(training.fully_sharded) and cluster.ranks_per_node(dp * cp, t) < dp * cp,
                  chosen.name if p > 1 else "", schedule is not None)


def candidate_layouts(m: ModelShape, gpus: int, gpus_per_node: int, micro_batch: int, global_batch: int,
                      tp: Optional[int] = None, pp: Optional[int] = None,
                      stride: int = 1) -> List[Tuple[int, int, int, int]]:
    """The valid ``(TP, PP, DP, gradient accumulation)`` of :func:`plan`
    for ``gpus`` model copies' worth of GPUs (``stride`` context-parallel
    ranks each: the tensor-parallel group still lies within a node).

    Raises:
        PlanError: as :func:`plan`, except for an empty list.
    """
    if global_batch % micro_batch != 0:
        raise PlanError(f"global batch {global_batch} is not a multiple of the micro batch {micro_batch}")
    if gpus * stride % gpus_per_node != 0 and gpus * stride > gpus_per_node:
        raise PlanError(f"{gpus * stride} GPUs are not a whole number of nodes of {gpus_per_node}")
    from fairseq_megatron.models.options import undivided_dimension  # the model's rule for what TP must divide

    def splits(t: int) -> bool:
        return undivided_dimension(t, m.heads, m.ffn) is None and gpus_per_node % t == 0

    if tp is not None and not splits(tp):
        raise PlanError(f"tensor-parallel size {tp} must divide heads {m.heads}, FFN {m.ffn} and the "
                        f"{gpus_per_node} GPUs of a node")
    if pp is not None and m.layers % pp:
        raise PlanError(f"pipeline-parallel size {pp} does not divide the {m.layers} layers")
    found = []
    for t in [tp] if tp else _divisors(min(gpus_per_node, gpus)):
        for p in [pp] if pp else _divisors(m.layers):
            if not splits(t) or gpus % (t * p) or global_batch % (micro_batch * gpus // (t * p)):
                continue
            dp = gpus // (t * p)
            accumulation = global_batch // (micro_batch * dp)
            if p == 1 or accumulation >= p:  # 1F1B needs a micro batch per stage
                found.append((t, p, dp, accumulation))
    return found


def fully_sharded_refusal(schedule: str, fully_sharded: Optional[str]) -> Optional[str]:
    """Why fairseq-train refuses ``schedule`` under ``fully_sharded``
    (``"zero3"``, ``"zero2"``) for the planner's models (tied embeddings):
    a split backward needs ``--no-reshard-after-forward`` (zero2), and the
    V placement cannot shard the embedding both chunks of stage 0 hold
    (:func:`~fairseq_megatron.training.fully_sharded.check_fully_sharded`);
    None where it runs."""
    from fairseq_megatron.models.pipeline_stage import V_SHAPE
    from fairseq_megatron.training.pipeline_schedules import SCHEDULES

    if not fully_sharded or not SCHEDULES[schedule].splits_backward:
        return None
    if SCHEDULES[schedule].placement == V_SHAPE:
        return (f"--pipeline-schedule {schedule} does not work with fully sharded data parallelism and tied "
                f"embeddings (fairseq-train refuses it: both model chunks of stage 0 hold the embedding); plan "
                f"without --fully-sharded, or with --pipeline-schedule interleaved-zb and --fully-sharded zero2")
    if fully_sharded != "zero2":
        return (f"--pipeline-schedule {schedule} with fully sharded data parallelism needs the weights kept "
                f"gathered from each forward to its weight pass (fairseq-train's --no-reshard-after-forward); "
                f"plan with --fully-sharded zero2")
    return None


def _divisors(n: int) -> List[int]:
    """The divisors of ``n``, ascending, in O(sqrt(n)) steps (a billion layers take 31,623)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _why_no_layout(m, gpus, gpus_per_node, micro_batch, global_batch, vp=None, schedule=None,
                   fully_sharded=None) -> str:
    from fairseq_megatron.training.pipeline_schedules import SCHEDULES

    refusal = fully_sharded_refusal(schedule, fully_sharded) if schedule is not None else None
    if refusal is not None:
        return refusal
    if schedule is not None:
        return (f"no layout runs --pipeline-schedule {schedule}" + (f" at --vp {vp}" if vp is not None else "")
                + ": it needs at least 2 pipeline stages, the layers of a stage divisible by its chunks and enough "
                  "micro batches per update (fairseq-train --pipeline-schedule)")
    if vp is not None:
        return (f"no layout gives its pipeline stages {vp} model chunks each (the interleaved schedule needs the "
                f"layers of a stage divisible by {vp} and the micro batches per update by the stages)")
    tps = [t for t in _divisors(min(gpus_per_node, gpus)) if m.heads % t == 0 and m.ffn % t == 0]
    if not tps:
        return f"no tensor-parallel size within a node of {gpus_per_node} divides heads {m.heads} and FFN {m.ffn}"
    return (f"no layout of {gpus} GPUs gives a whole number of micro batches of {micro_batch} per data-parallel "
            f"rank for global batch {global_batch}")
