#!/usr/bin/env python
"""The pipeline bubble of each schedule of ``--pipeline-schedule``, measured on CPU.

    python scripts/benchmark_pipeline_bubble.py [--stages 2] [--micro-batches 2 4 8]
        [--schedules 1f1b interleaved-1f1b interleaved-zb zbv dualpipev] [--steps 4] [--repeats 2]
        [--layers 16] [--vocab 1000] [--account-for-loss] [--trace] [--system-malloc]

For each number of micro-batches ``m`` this times one update of our
``MegatronTrainer`` (fairseq's dummy_lm task; a 16 x 256 decoder by default,
a 1000-symbol vocabulary, micro-batches of 8 x 128 tokens, fp32: the same
work for every schedule) at one stage in
one process and, under each schedule, at ``--stages P`` stages in ``P``
processes (gloo), each process on one CPU thread; the interleaved schedules
run 2 model chunks per stage (``interleaved-zb`` at ``V = 1`` is ZB-1P; the
V-shaped ``zbv`` and ``dualpipev`` always run 2). Each configuration runs
``--repeats`` times in fresh processes; each run's figure is the median of
its ``--steps`` updates after the first (which builds the schedule).

It prints per schedule the median update time over the runs and their
spread (lowest to highest), the speed-up, and the idle share: the share
of the pipeline's span (from the first rank entering the schedule's
``step`` to the last leaving it) that a rank spends outside its chunks'
forward and backward passes, the mean over the ranks; beside it the share
the schedule cannot avoid at equal forward, input-backward and
weight-backward times
(:func:`fairseq_megatron.training.pipeline_schedules.idle_share_bound`: 1F1B
``(P - 1) / (m + P - 1)``, interleaved ``(P - 1) / (V m + P - 1)``, ZB-1P,
ZB-V and DualPipeV from their papers). A split backward adds work (two
walks of the graph where there was one), which the idle share does not
count as idle: a lower idle share at a longer update is no win, so the
update time stands beside it, and so does ``lost``, ``1 - (t1 / P) / tP``
for the update's time ``t1`` at one stage and ``tP`` at ``P``: the share of
the ``P`` ranks' time that does not go to the one-stage work (the idle
share, the added work, the optimizer's share). Where no schedule adds work,
the two differ by the optimizer's and fairseq's share of the update.

Each rank also times its own stage's work: the forward and backward passes
of its chunks (``compute``), the waits for its point-to-point messages
(``p2p wait``, the bubble and the transfers: a rank waits for a message
that is not yet sent) and the rest of the update (``other``: the
optimizer, gradient norm and data-parallel steps, fairseq's bookkeeping),
printed per rank, in ms per update (median of the runs).
Needs ``P`` free cores for the times to mean anything.

Memory: every process runs with glibc's malloc told to keep what it frees
(:data:`KEEP_FREED_MEMORY`, unless ``--system-malloc``), as a GPU's caching
allocator does. By default glibc returns each large freed block to the
kernel and takes fresh pages for the next, each page faulted in on first
touch; a split backward holds more gradients at once, so it pays more of
that than the whole backward does: a cost of the CPU's allocator, not of
the schedule (measured in docs/benchmarks.md, "Pipeline bubble").
"""

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

LAYERS, HIDDEN, FFN, HEADS, ROWS, LENGTH, VOCAB = 16, 256, 1024, 8, 8, 128, 1000
SCHEDULES = ("1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")
CHUNKED = {"interleaved-1f1b": 2, "interleaved-zb": 2}  # the model chunks per stage of the loop-placed schedules
# glibc malloc's tunables (mallopt(3)): no block mapped on its own below 32 MiB (the largest threshold
# glibc takes), freed memory not trimmed back to the kernel, and 512 MiB more taken each time the heap grows
KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2 ** 20), "MALLOC_TRIM_THRESHOLD_": str(16 * 2 ** 30),
                     "MALLOC_TOP_PAD_": str(512 * 2 ** 20)}


def _trainer(stages: int, micro_batches: int, schedule: str, virtual: int, shape: dict):
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    import fairseq_megatron  # noqa: F401  (registers the model, the task and the trainer)
    from fairseq_megatron.fairseq_integration.trainer import build_trainer
    from fairseq_megatron.parallel import parallel_state
    from fairseq_megatron.parallel.rng_tracker import model_parallel_manual_seed

    parallel_state.initialize_model_parallel(1, stages)
    model_parallel_manual_seed(1)
    layout = ["--pipeline-model-parallel-size", str(stages)]
    if stages > 1:
        layout += ["--pipeline-schedule", schedule, "--virtual-pipeline-model-parallel-size", str(virtual)]
        layout += ["--account-for-loss-in-pipeline-split"] if shape["account_for_loss"] else []
    args = options.parse_args_and_arch(options.get_training_parser(), input_args=[
        "--task", "dummy_lm", "--tokens-per-sample", str(LENGTH), "--dict-size", str(shape["vocab"]),
        "--batch-size", str(ROWS), "--arch", "transformer_lm_megatron", "--decoder-layers", str(shape["layers"]),
        "--decoder-embed-dim", str(HIDDEN), "--decoder-ffn-embed-dim", str(FFN), "--decoder-attention-heads",
        str(HEADS), "--share-decoder-input-output-embed", "--criterion", "vocab_parallel_cross_entropy",
        "--optimizer", "adam", "--lr", "1e-4", "--update-freq", str(micro_batches), *layout, "--cpu", "--seed", "1",
        "--distributed-world-size", str(stages)])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    trainer = build_trainer(cfg, task, task.build_model(cfg.model), task.build_criterion(cfg.criterion))
    trainer.get_model().run_deferred_initialisation()
    task.load_dataset("train")
    return trainer, trainer.get_train_iterator(epoch=1).next_epoch_itr(shuffle=False)


class _Intervals:
    """Seconds this rank spent in its chunks' passes and in waits for its
    point-to-point messages, from torch's pipelining functions wrapped; the
    waits also by phase of the update (``warm-up``: before this rank's
    first backward; ``cool-down``: after its last forward; ``steady``: in
    between) with their count, for ``--trace``."""

    PHASES = ("warm-up", "steady", "cool-down")

    def __init__(self, forwards_per_update: int):
        from torch.distributed.pipelining import schedules, stage

        self.forwards_per_update = forwards_per_update
        self.reset()
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage._PipelineStageBase, name, self._timed(getattr(stage._PipelineStageBase, name), name))
        schedules._wait_batch_p2p = self._timed(schedules._wait_batch_p2p, "wait")
        for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
            cls.step = self._spanned(cls.step)

    def _spanned(self, step):
        def spanned(*args, **kwargs):
            self.span_start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
            try:
                return step(*args, **kwargs)
            finally:
                self.span_end = time.monotonic()
        return spanned

    def _phase(self) -> str:
        if not self.backwards:
            return "warm-up"
        return "cool-down" if self.forwards >= self.forwards_per_update else "steady"

    def _timed(self, function, what):
        def timed(*args, **kwargs):
            phase = self._phase()
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - start
                if what == "wait":
                    self.wait += seconds
                    self.waits[phase][0] += 1
                    self.waits[phase][1] += seconds
                else:
                    self.compute += seconds
                    self.forwards += what == "forward_one_chunk"
                    self.backwards += what == "backward_one_chunk"
        return timed

    def reset(self):
        self.compute = self.wait = 0.0
        self.span_start = self.span_end = 0.0
        self.forwards = self.backwards = 0
        self.waits = {phase: [0, 0.0] for phase in self.PHASES}  # count, seconds


def _p2p_one_way(rank: int, init_file: str, out: str, repeats: int = 40) -> None:
    """Half the round trip of one micro-batch's activations (``ROWS x LENGTH x
    HIDDEN`` fp32) between two gloo processes, median over ``repeats``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    x = torch.randn(ROWS, LENGTH, HIDDEN)
    trips = []
    for _ in range(repeats + 5):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)
        trips.append(time.perf_counter() - start)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(statistics.median(trips[5:]) / 2, f)
    dist.destroy_process_group()


def p2p_one_way_seconds() -> float:
    """:func:`_p2p_one_way` in two fresh processes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "seconds")
        mp.spawn(_p2p_one_way, args=(os.path.join(tmp, "init"), out), nprocs=2, join=True)
        with open(out) as f:
            return json.load(f)


def _time_updates(rank: int, stages: int, micro_batches: int, steps: int, schedule: str, virtual: int, shape: dict,
                  init_file: str, out: str) -> None:
    logging.basicConfig(level=logging.WARNING)  # fairseq's INFO lines, once per process and configuration
    warnings.simplefilter("ignore")  # fairseq's and fairscale's deprecation warnings at import (see pytest.ini)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=stages)
    trainer, batches = _trainer(stages, micro_batches, schedule, virtual, shape)
    intervals = _Intervals(micro_batches * virtual) if stages > 1 else None
    updates = []
    for step in range(steps + 1):  # the first update builds the schedule and infers shapes: not timed
        samples = [next(batches) for _ in range(micro_batches)]
        dist.barrier()
        if intervals:
            intervals.reset()
        start = time.perf_counter()
        trainer.train_step(samples)
        dist.barrier()
        if step:
            seconds = time.perf_counter() - start
            updates.append((seconds, intervals.compute if intervals else seconds, intervals.wait if intervals else 0.0,
                            intervals.waits if intervals else {},
                            (intervals.span_start, intervals.span_end) if intervals else (0.0, seconds)))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(updates, f)
    dist.destroy_process_group()


def time_run(stages: int, micro_batches: int, steps: int, schedule: str = "1f1b", virtual: int = 1,
             shape: Optional[dict] = None) -> dict:
    """One run in fresh processes: the median update seconds, the median
    idle share of the pipeline's span (see the module's docstring), and per
    rank the median seconds of compute and of point-to-point waits per
    update."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "seconds")
        shape = shape or dict(layers=LAYERS, vocab=VOCAB, account_for_loss=False)
        mp.spawn(_time_updates, args=(stages, micro_batches, steps, schedule, virtual, shape,
                                      os.path.join(tmp, "init"), out), nprocs=stages, join=True)
        ranks = []
        for rank in range(stages):
            with open(f"{out}.{rank}") as f:
                ranks.append(json.load(f))
    idle = []
    for updates in zip(*ranks):  # one update, every rank's figures
        span = max(u[4][1] for u in updates) - min(u[4][0] for u in updates)
        idle.append(statistics.mean(1 - u[1] / span for u in updates))
    return {"update": statistics.median(u[0] for u in ranks[0]), "idle": statistics.median(idle),
            "compute": [statistics.median(u[1] for u in r) for r in ranks],
            "wait": [statistics.median(u[2] for u in r) for r in ranks],
            "phases": [{phase: (statistics.median(u[3][phase][0] for u in r), statistics.median(u[3][phase][1] for u in r))
                        for phase in _Intervals.PHASES} for r in ranks] if stages > 1 else []}


def _spread(values) -> str:
    return f"{min(values) * 1e3:.0f}-{max(values) * 1e3:.0f}"


def _chunks(schedule: str) -> int:
    """The model chunks per stage this script runs ``schedule`` with."""
    from fairseq_megatron.training.pipeline_schedules import SCHEDULES as KNOWN

    return CHUNKED.get(schedule, 2 if KNOWN[schedule].chunks == 2 else 1)


def main(argv=None) -> int:
    from fairseq_megatron.errors import UsageError
    from fairseq_megatron.models.pipeline_stage import PipelineStageLayout
    from fairseq_megatron.training.pipeline_schedules import SCHEDULES as KNOWN, idle_share_bound, \
        micro_batches_needed

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    p.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--steps", type=int, default=4, help="timed updates per run (the median is the run's figure)")
    p.add_argument("--repeats", type=int, default=2, help="runs per configuration, each in fresh processes")
    p.add_argument("--trace", action="store_true",
                   help="also print each rank's point-to-point waits by phase of the update (warm-up, steady, "
                        "cool-down: count and ms) and gloo's one-way time for one micro-batch's activations")
    p.add_argument("--system-malloc", action="store_true",
                   help="leave glibc's malloc at its defaults (each large freed block returned to the kernel) rather "
                        "than keeping freed memory for reuse, as a GPU's caching allocator does")
    p.add_argument("--layers", type=int, default=LAYERS, help="decoder layers")
    p.add_argument("--vocab", type=int, default=VOCAB, help="dictionary size (dummy_lm's --dict-size)")
    p.add_argument("--account-for-loss", action="store_true",
                   help="count the output projection and the loss as a layer in the pipeline's split "
                        "(--account-for-loss-in-pipeline-split): the last model chunk holds one layer fewer")
    args = p.parse_args(argv)
    if args.stages < 2 or args.steps < 1 or args.repeats < 1 or args.layers < 1 or args.vocab < 1:
        p.error("--stages at least 2; --steps, --repeats, --layers and --vocab at least 1")
    shape = dict(layers=args.layers, vocab=args.vocab, account_for_loss=args.account_for_loss)
    for name in args.schedules:  # fairseq-train's own check of the split, one line
        try:
            PipelineStageLayout(0, args.stages, args.layers, True, _chunks(name), KNOWN[name].placement, False,
                                args.account_for_loss)
        except UsageError as e:
            p.error(f"--pipeline-schedule {name}: {e}")
    for m in args.micro_batches:
        for name in args.schedules:
            needed = micro_batches_needed(KNOWN[name], args.stages)
            if m < needed or (name in CHUNKED and m % args.stages):
                p.error(f"--micro-batches {m}: {name} needs at least {needed} at --stages {args.stages}"
                        + (", a multiple of the stages" if name in CHUNKED else "") + "; leave it out")
    if not args.system_malloc:  # read by each process glibc starts, so set before the runs spawn theirs
        for name, value in KEEP_FREED_MEMORY.items():
            os.environ.setdefault(name, value)
    kept = ", ".join(f"{name}={os.environ.get(name)}" for name in KEEP_FREED_MEMORY)
    print("malloc: glibc's defaults" if args.system_malloc else f"malloc: freed memory kept for reuse ({kept})")
    counted = ", the loss counted as a layer in the split" if args.account_for_loss else ""
    print(f"{args.layers} layers x {HIDDEN} hidden, vocabulary {args.vocab}{counted}, micro-batch {ROWS} x {LENGTH} tokens, fp32, 1 thread per process, "
          f"P = {args.stages}, {args.repeats} run(s) of {args.steps} timed updates each; times in ms per update "
          f"(median of the runs, then lowest-highest)")
    print(f"{'m':>3} {'schedule':<17}{'V':>2} {'1 stage':>8} {'P stages':>9} {'spread':>11} {'speed-up':>8} "
          f"{'lost':>6} {'idle':>6} {'bound':>6}  per rank: compute / p2p wait / other")
    if args.trace:
        one_way = p2p_one_way_seconds()
        print(f"gloo, one micro-batch's activations ({ROWS} x {LENGTH} x {HIDDEN} fp32, "
              f"{ROWS * LENGTH * HIDDEN * 4 / 2 ** 20:.1f} MiB) one way: {one_way * 1e3:.2f} ms (half the median "
              f"round trip)")
    for m in args.micro_batches:
        one = [time_run(1, m, args.steps, shape=shape)["update"] for _ in range(args.repeats)]
        t1 = statistics.median(one)
        print(f"{m:>3} {'(one stage)':<17}{1:>2} {t1 * 1e3:>8.0f} {'':>9} {_spread(one):>11}")
        for name in args.schedules:
            v = _chunks(name)
            runs = [time_run(args.stages, m, args.steps, name, v, shape) for _ in range(args.repeats)]
            tp = statistics.median(r["update"] for r in runs)
            lost = 1 - (t1 / args.stages) / tp
            idle = statistics.median(r["idle"] for r in runs)
            bound = idle_share_bound(KNOWN[name], args.stages, v, m)
            ranks = []
            for rank in range(args.stages):
                compute = statistics.median(r["compute"][rank] for r in runs)
                wait = statistics.median(r["wait"][rank] for r in runs)
                ranks.append(f"{compute * 1e3:.0f} / {wait * 1e3:.0f} / {(tp - compute - wait) * 1e3:.0f}")
            print(f"{m:>3} {name:<17}{v:>2} {'':>8} {tp * 1e3:>9.0f} {_spread([r['update'] for r in runs]):>11} "
                  f"{t1 / tp:>8.2f} {lost:>6.1%} {idle:>6.1%} {bound:>6.1%}  " + "; ".join(ranks), flush=True)
            if args.trace:
                for rank in range(args.stages):
                    phases = [(phase, statistics.median(r["phases"][rank][phase][0] for r in runs),
                               statistics.median(r["phases"][rank][phase][1] for r in runs))
                              for phase in _Intervals.PHASES]
                    print(f"{'':>33}rank {rank} waits: " + ", ".join(
                        f"{phase} {count:.0f} / {seconds * 1e3:.0f} ms" for phase, count, seconds in phases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
