"""Which layout to start with, and why: the fastest predicted of those that
fit the GPU's memory less the margin, with the runner-up and how much
slower it is predicted, and fairseq-train's flags for it.

A fully sharded layout whose gathers cross nodes is recommended only where
no other layout is predicted within :data:`CLOSE` of it (the model's error
on the published Megatron-LM table is of that size, docs/planning.md):
such gathers are where measured runs fell furthest below what bandwidth
predicts. Fully sharded data parallelism without model parallelism reached
44 TFLOP/s per GPU on the 175B model at 1536 GPUs, against 141 for tensor
and pipeline parallelism (Narayanan et al. 2021, section 5.2, Table 2),
while the bandwidth of its gathers would allow it about the same as the
latter.
"""

from typing import List, Optional, Tuple

from fairseq_megatron.planner.layouts import Layout
from fairseq_megatron.planner.memory import FULLY_SHARDED

CLOSE = 0.05


def _lower_memory(sharding: str) -> str:
    """How to lower a layout's memory, for a layout of ``sharding`` (``Layout.sharding``):
    the sharding it already has is not advised again."""
    sharded = {"none": "fully sharded data parallelism or ZeRO sharding (several data-parallel ranks), ",
               "os": "fully sharded data parallelism (several data-parallel ranks), "}.get(sharding, "")
    return f"lower it with activation checkpointing, sequence parallelism, {sharded}Adafactor or a smaller micro batch"


def recommend(layouts: List[Layout], fully_sharded: Optional[List[Layout]] = None) -> Tuple[Optional[Layout], str]:
    """The layout to start with, and why: of ``layouts`` and ``fully_sharded``
    (the same request's layouts under fully sharded data parallelism, when
    the planner tried them too), the one of the shortest predicted step
    among those that fit (``Layout.fits``: within the GPU's memory less the
    margin), unless it gathers its weights across nodes and another is
    predicted within :data:`CLOSE` of it. The reason names the runner-up and
    how much slower it is predicted, and ends with fairseq-train's flags. Where none fits: None,
    and what the smallest needs and how to lower it."""
    # a fully sharded layout of one data-parallel rank shards nothing: the same as the one without
    candidates = list(layouts) + [lay for lay in fully_sharded or [] if lay.dp * lay.cp > 1]
    fitting = sorted((lay for lay in candidates if lay.fits), key=lambda lay: lay.predicted_step_seconds)
    if not fitting:
        smallest = min(layouts, key=lambda lay: lay.total_gb)
        sharding, tried = smallest.sharding, ""
        if fully_sharded:  # tried as well: not advised again
            sharded_smallest = min(fully_sharded, key=lambda lay: lay.total_gb)
            sharding, tried = sharded_smallest.sharding, (f", fully sharded {sharded_smallest.total_gb:.1f} GB "
                                                          f"(TP={sharded_smallest.tp}, PP={sharded_smallest.pp})")
        return None, (f"no layout fits; the smallest needs {smallest.total_gb:.1f} GB per GPU "
                      f"(TP={smallest.tp}, PP={smallest.pp}){tried}: {_lower_memory(sharding)}, or use more GPUs")
    fastest = fitting[0]
    close = [lay for lay in fitting if lay.predicted_step_seconds <= (1 + CLOSE) * fastest.predicted_step_seconds]
    best = min(close, key=lambda lay: (lay.gathers_across_nodes, lay.predicted_step_seconds))
    reason = (f"{best.name()}: {best.predicted_step_seconds:.3g} s per step, {best.predicted_tflops_per_gpu:.0f} "
              f"TFLOP/s per GPU, {best.total_gb:.1f} GB per GPU")
    if best is not fastest:
        reason += (f"; predicted within {best.predicted_step_seconds / fastest.predicted_step_seconds - 1:.1%} of "
                   f"the fastest that fits, {fastest.name()}, which gathers its weights across nodes "
                   f"({fastest.network_gb:.3g} GB per GPU per step through the network against "
                   f"{best.network_gb:.3g})")
    else:
        others = [lay for lay in fitting if lay is not best]
        if others:
            slower = others[0].predicted_step_seconds / best.predicted_step_seconds - 1
            reason += f"; predicted the fastest that fits, the runner-up, {others[0].name()}, {slower:.1%} slower"
        else:
            reason += "; the only layout that fits"
    if best.pp > 1:
        reason += f"; pipeline bubble {best.pipeline_bubble:.0%} with {best.grad_accumulation} micro batches"
    return best, f"{reason} (fairseq-train {' '.join(training_flags(best))})"


def training_flags(layout: Layout) -> List[str]:
    """fairseq-train's flags for ``layout``'s parallel sizes (the batch and
    precision flags are the run's own)."""
    flags = ["--model-parallel-size", str(layout.tp)]
    if layout.pp > 1:
        flags += ["--pipeline-model-parallel-size", str(layout.pp)]
        if layout.explicit:
            flags += ["--pipeline-schedule", layout.schedule]
        if layout.vp > 1 and layout.schedule not in ("zbv", "dualpipev"):  # those two fix their chunks
            flags += ["--virtual-pipeline-model-parallel-size", str(layout.vp)]
    if layout.cp > 1:
        flags += ["--context-parallel-size", str(layout.cp)]
    if layout.grad_accumulation > 1:
        flags += ["--update-freq", str(layout.grad_accumulation)]
    if layout.pp > 1 or layout.cp > 1:
        flags += ["--sample-break-mode", "none"]
    if layout.sharding in FULLY_SHARDED:
        flags += ["--ddp-backend", "fully_sharded"] + (["--no-reshard-after-forward"]
                                                       if layout.sharding == "zero2" else [])
    elif layout.pp > 1 and layout.dp * layout.cp > 1:
        flags += ["--ddp-backend", "legacy_ddp"]
    return flags
