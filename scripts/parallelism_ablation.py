#!/usr/bin/env python
"""The same model trained at each parallel layout, side by side: time per
iteration and memory per rank.

    python scripts/parallelism_ablation.py --cpu --quick --csv ablation.csv --png ablation.png
    python scripts/parallelism_ablation.py --csv ablation.csv --png ablation.png   # GPT-2 large, 2 GPUs

Rows (Megatron-LM's parallelism ablation, with its names): ``baseline`` (one
rank), ``DP2`` (two model copies), ``TP2`` (``--model-parallel-size 2``),
``SP2`` (TP2 with ``--sequence-parallel``), ``CP2``
(``--context-parallel-size 2``), ``PP2`` (``--pipeline-model-parallel-size
2``, the batch as 4 micro-batches) and ``FSDP2`` (``--ddp-backend
fully_sharded`` at two model copies). Every row trains the same model
(``--seed``, ``--padded-vocab-size`` fixed) on the same global batch per
iteration, each rank reading its share of it, for ``--iterations``
iterations of our ``MegatronTrainer`` (fairseq's trainer, built from
fairseq-train's flags; fp32 on CPU, ``--bf16-autocast`` on GPUs), and
reports per row:

- ``iteration_ms``: the median time of one update (the first two are not
  timed, nor is their memory counted: the pipeline schedule runs a forward
  to infer its shapes, allocators warm up);
- ``cpu_ms``: the most CPU time a rank's process spent on one update (the
  median over the timed updates; its threads together): the work, without
  the waits, which on a machine loaded by other programs moves less than
  the time;
- ``loss``: fairseq's training loss (base 2) of the last iteration;
- per rank, in MiB: the parameters, gradients and optimizer state it holds
  (counted from its tensors), the most activation bytes autograd kept at
  once (:class:`fairseq_megatron.training.memory.SavedActivations`), and its
  peak: on a GPU ``torch.cuda.max_memory_allocated``, on CPU the sum of the
  four, each at its most (an upper bound of what the rank held at once);
  ``peak_memory_mib`` is the most any rank held.

- ``predicted_ms``: the planner's predicted time of the row's update
  (:mod:`fairseq_megatron.planner.step_time`) on this machine's measured
  rates: one process's matrix-product FLOP/s and memory-copy bandwidth,
  measured here before the rows, and the bandwidth of the rows' gloo
  all-reduces, measured by their ranks after training; printed beside the
  measured times with both orderings, and with how many of the pairs of
  rows predicted at least 10% apart were measured in the predicted order
  (closer predictions are within the spread of one row's runs on a shared
  CPU). ``--rounds N`` runs every row N times in turn and keeps each row's
  fastest round, the one least slowed by other work on the machine.

``--csv PATH`` writes one line per row, ``--png PATH`` plots each layout's
time per iteration (measured and predicted), the model state (parameters,
gradients, optimizer state) of each rank and, on an axis of their own,
its activations, every layout labelled with what it splits (both files
written under a temporary name, then renamed); the script ends by printing
where they are written and where the two questions a reader asks of them
(where is the split? why is memory uneven?) are answered. A row that cannot run (a layout
refused by the launch checks fairseq-train runs first, or a failed rank) is
reported with its error line, in the table and the CSV's ``status``, and the
script exits 1 after the other rows.

The ``PP2-*`` rows run PP2 under each other ``--pipeline-schedule``
(``PP2`` itself is 1F1B): ``interleaved-1f1b`` at 2 chunks per stage,
``interleaved-zb`` at 1 (ZB-1P), ``zbv`` and ``dualpipev`` (2 chunks in a
V); the planner predicts each rank's activations (what autograd saves,
``rank{r}_predicted_saved_activations_mib``, the measured count; and with
what it does not, ``rank{r}_predicted_activations_mib``) and peak
(``rank{r}_predicted_peak_mib``), printed beside the measured ones after
the table; the first is drawn as a mark on the activations' axis.

``--cpu --quick``: a 4 x 128 decoder (4 heads, FFN 512) on 8 sequences of 256
tokens per iteration, 2 CPU processes per row (gloo, one thread each), a few
minutes in all. ``--cpu --shape compute``: a 4 x 512 decoder (8 heads, FFN
2048) on 8 sequences of 512 tokens, where the matrix products take most of
each update (the shape the predicted ordering is checked at). Without ``--quick``: GPT-2 large (36 layers, hidden 1280, 20
heads, FFN 5120, sequences of 1024 tokens, a 50,304-row vocabulary), 8
sequences per iteration, for a node with 2 GPUs. The tokens follow a fixed
random bigram chain (8 likely successors per token), so the loss falls.
"""

import argparse
import csv
import datetime
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SCHEDULE_ROWS = {  # the PP2 row under each --pipeline-schedule: (schedule, chunks per stage)
    "PP2-interleaved-1f1b": ("interleaved-1f1b", 2), "PP2-interleaved-zb": ("interleaved-zb", 1),
    "PP2-zbv": ("zbv", 2), "PP2-dualpipev": ("dualpipev", 2),
}
LAYOUTS = ("baseline", "DP2", "TP2", "SP2", "CP2", "PP2", "FSDP2", *SCHEDULE_ROWS)
SPLITS = {  # what each layout splits over its ranks
    "baseline": "nothing", "DP2": "the batch (model copies)", "TP2": "heads and FFN units",
    "SP2": "heads, FFN units; sequence", "CP2": "the sequence", "PP2": "the layers (1F1B)",
    "FSDP2": "the batch; shards of every tensor", "PP2-interleaved-1f1b": "the layers, 2 chunks per stage",
    "PP2-interleaved-zb": "the layers; backward split (ZB-1P)", "PP2-zbv": "the layers, 2 chunks in a V; split",
    "PP2-dualpipev": "the layers, 2 chunks in a V; DualPipeV",
}
ANSWERS = "docs/benchmarks.md#parallelism-ablation"  # where is the split? why is memory uneven?
RANKS = 2  # the most ranks a row uses: the CSV has their columns
PARTS = ("parameters", "gradients", "optimizer", "activations")
PREDICTED = ("saved_activations", "activations", "peak")  # each rank's memory as the planner predicts it
CSV_FIELDS = (["layout", "iteration_ms", "cpu_ms", "predicted_ms", "peak_memory_mib", "loss", "world_size", "device"]
              + [f"rank{r}_{part}_mib" for r in range(RANKS) for part in PARTS + ("peak",)]
              + [f"rank{r}_predicted_{part}_mib" for r in range(RANKS) for part in PREDICTED]
              + ["status"])
UNTIMED = 2  # iterations before timing starts
PAD, SPECIALS = 1, 4  # fairseq's padding index and number of special symbols
SUCCESSORS = 8  # likely successors of each token in the synthetic data


@dataclass(frozen=True)
class Shape:
    """A decoder and its data: ``batch`` sequences of ``seq_len`` tokens per
    iteration (the global batch), ``words`` symbols besides fairseq's special
    ones in ``padded_vocab`` embedding rows."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    seq_len: int
    batch: int
    words: int
    padded_vocab: int


SHAPES = {
    "quick": Shape(layers=4, hidden=128, heads=4, ffn=512, seq_len=256, batch=8, words=1000, padded_vocab=1024),
    "compute": Shape(layers=4, hidden=512, heads=8, ffn=2048, seq_len=512, batch=8, words=1000, padded_vocab=1024),
    "gpt2-large": Shape(layers=36, hidden=1280, heads=20, ffn=5120, seq_len=1024, batch=8, words=50253,
                        padded_vocab=50304),
}


@dataclass(frozen=True)
class Layout:
    """One row: its ranks, parallel sizes and fairseq-train flags; each of
    its ``data`` model copies reads ``micro_batches`` micro-batches of
    ``rows`` sequences per iteration."""

    name: str
    world_size: int
    tensor: int = 1
    context: int = 1
    pipeline: int = 1
    data: int = 1
    micro_batches: int = 1
    flags: tuple = ()
    schedule: Optional[str] = None  # --pipeline-schedule (None: fairseq-train's default)
    chunks: int = 1  # model chunks per pipeline stage

    def rows(self, shape: Shape) -> int:
        return shape.batch // (self.data * self.micro_batches)


def layout(name: str) -> Layout:
    """The row called ``name`` (one of :data:`LAYOUTS`)."""
    layouts = {
        "baseline": Layout("baseline", 1),
        "DP2": Layout("DP2", 2, data=2),
        "TP2": Layout("TP2", 2, tensor=2),
        "SP2": Layout("SP2", 2, tensor=2, flags=("--sequence-parallel",)),
        "CP2": Layout("CP2", 2, context=2),
        "PP2": Layout("PP2", 2, pipeline=2, micro_batches=4),
        "FSDP2": Layout("FSDP2", 2, data=2, flags=("--ddp-backend", "fully_sharded")),
    }
    for row, (schedule, chunks) in SCHEDULE_ROWS.items():
        flags = ("--pipeline-schedule", schedule) + (("--virtual-pipeline-model-parallel-size", str(chunks))
                                                     if schedule.startswith("interleaved") else ())
        layouts[row] = Layout(row, 2, pipeline=2, micro_batches=4, flags=flags, schedule=schedule, chunks=chunks)
    return layouts[name]


def fairseq_flags(row: Layout, shape: Shape, cpu: bool, seed: int) -> List[str]:
    """fairseq-train's flags for ``row`` (without the launch's)."""
    return [
        "--task", "dummy_lm", "--dict-size", str(shape.words), "--tokens-per-sample", str(shape.seq_len),
        "--arch", "transformer_lm_megatron", "--decoder-layers", str(shape.layers),
        "--decoder-embed-dim", str(shape.hidden), "--decoder-ffn-embed-dim", str(shape.ffn),
        "--decoder-attention-heads", str(shape.heads), "--share-decoder-input-output-embed",
        "--padded-vocab-size", str(shape.padded_vocab), "--dropout", "0.1", "--attention-dropout", "0.1",
        "--criterion", "vocab_parallel_cross_entropy", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
        "--lr", "3e-4", "--clip-norm", "1.0", "--seed", str(seed), "--batch-size", str(row.rows(shape)),
        "--update-freq", str(row.micro_batches), "--model-parallel-size", str(row.tensor),
        "--context-parallel-size", str(row.context), "--pipeline-model-parallel-size", str(row.pipeline),
        "--ddp-backend", "legacy_ddp" if row.pipeline > 1 else "pytorch_ddp",
        *row.flags, *(["--cpu"] if cpu else ["--bf16-autocast"]),
    ]


def _parse(flags: List[str]):
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    import fairseq_megatron  # noqa: F401  (registers our model, criterion and trainer)

    return convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), flags))


def refusal(row: Layout, shape: Shape, cpu: bool, seed: int) -> Optional[str]:
    """Why fairseq-train would refuse ``row`` before any work (its option
    checks and the launch checks of its ``main``), as its one error line; None."""
    from fairseq_megatron.errors import UsageError
    from fairseq_megatron.parallel.layout import ParallelLayout
    from fairseq_megatron.training.data_parallel import data_parallel_class
    from fairseq_megatron.training.options import check_training_precision

    try:
        cfg = _parse(fairseq_flags(row, shape, cpu, seed))
        grid = ParallelLayout(row.world_size, row.tensor, row.pipeline, row.context)
        data_parallel = data_parallel_class(cfg.distributed_training)
        data_parallel.check(cfg, grid.pipeline, grid.data, grid.context)
        check_training_precision(cfg.common, fp32_parameters=data_parallel.keeps_fp32_parameters)
    except UsageError as e:
        return str(e)
    return None


# ----------------------------------------------------------------- data


def global_batch(iteration: int, shape: Shape, seed: int):
    """The iteration's ``(batch, seq_len + 1)`` tokens: a random walk on a
    bigram chain that gives each word :data:`SUCCESSORS` likely successors
    (the chain is drawn from ``seed``, the walk from ``seed`` and ``iteration``)."""
    import torch

    successors = torch.randint(SPECIALS, SPECIALS + shape.words, (shape.words, SUCCESSORS),
                               generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 1_000_003 + iteration)
    tokens = torch.empty(shape.batch, shape.seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(SPECIALS, SPECIALS + shape.words, (shape.batch,), generator=g)
    choices = torch.randint(0, SUCCESSORS, (shape.batch, shape.seq_len), generator=g)
    for t in range(shape.seq_len):
        tokens[:, t + 1] = successors[tokens[:, t] - SPECIALS, choices[:, t]]
    return tokens


def rank_samples(tokens, row: Layout, shape: Shape, data_rank: int) -> List[dict]:
    """This model copy's micro-batches of the global batch ``tokens``, as
    fairseq's language-modeling samples."""
    import torch

    rows = row.rows(shape)
    samples = []
    for m in range(row.micro_batches):
        start = (data_rank * row.micro_batches + m) * rows
        block = tokens[start: start + rows]
        src, tgt = block[:, :-1].contiguous(), block[:, 1:].contiguous()
        samples.append({"id": torch.arange(start, start + rows), "nsentences": rows, "ntokens": tgt.numel(),
                        "net_input": {"src_tokens": src, "src_lengths": torch.full((rows,), shape.seq_len)},
                        "target": tgt})
    return samples


# ----------------------------------------------------------------- one rank


def _torch_optimizer(optimizer):
    """The torch optimizer inside fairseq's wrappers (whose state holds the moments)."""
    import torch

    for _ in range(4):
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
    raise TypeError("no torch optimizer inside the trainer's optimizer")


def _train_rank(rank: int, row: Layout, shape: Shape, cpu: bool, iterations: int, seed: int, init_file: str,
                out_dir: str) -> None:
    """One rank of ``row``: fairseq's launch (``distributed_init``, then the
    layout, as fairseq-train with our plugin), the trainer, ``iterations``
    updates; writes ``rank{rank}.json``."""
    logging.basicConfig(level=logging.WARNING)
    warnings.simplefilter("ignore")  # fairseq's and fairscale's deprecation warnings at import (see pytest.ini)
    try:
        result = _measure(rank, row, shape, cpu, iterations, seed, init_file)
    except Exception as e:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"error": f"{type(e).__name__}: {e}".splitlines()[0]}, f)
        raise
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _measure(rank, row, shape, cpu, iterations, seed, init_file) -> dict:
    import torch
    import torch.distributed as dist
    from fairseq import tasks, utils
    from fairseq.distributed import utils as distributed_utils

    from fairseq_megatron.fairseq_integration.trainer import build_trainer
    from fairseq_megatron.parallel import parallel_state
    from fairseq_megatron.training import memory

    if cpu:
        torch.set_num_threads(1)  # the row's ranks share the machine's cores
    else:
        torch.cuda.set_device(rank)
    cfg = _parse(fairseq_flags(row, shape, cpu, seed) + [
        "--distributed-world-size", str(row.world_size), "--distributed-rank", str(rank),
        "--distributed-init-method", f"file://{init_file}", "--distributed-backend", "gloo" if cpu else "nccl",
        "--device-id", str(0 if cpu else rank)])
    sizes = (row.tensor, row.pipeline, row.context)
    parallel_state.launch_layout(*sizes)  # fairseq's distributed_init builds the layout of these sizes
    if row.world_size > 1:
        distributed_utils.distributed_init(cfg)
    parallel_state.ensure_model_parallel(*sizes)
    utils.set_torch_seed(seed)
    task = tasks.setup_task(cfg.task)
    trainer = build_trainer(cfg, task, task.build_model(cfg.model), task.build_criterion(cfg.criterion))
    model = trainer.get_model()
    data_rank = parallel_state.get_data_parallel_rank()
    times, cpu_times, activations, loss = [], [], 0, None
    for iteration in range(iterations):
        samples = rank_samples(global_batch(iteration, shape, seed), row, shape, data_rank)
        _wait_for_all(cpu, row)
        if iteration == UNTIMED and not cpu:
            torch.cuda.reset_peak_memory_stats()  # measured, as the times, after the warm-up
        saved = memory.SavedActivations(model)  # after the trainer moved the model to its device
        start, cpu_start = time.perf_counter(), time.process_time()
        with saved:
            logged = trainer.train_step(samples)
        _wait_for_all(cpu, row)
        if iteration >= UNTIMED:  # the first update of a pipeline also runs a forward to infer shapes
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
            activations = max(activations, saved.peak)
        loss = float(logged["loss"])
    parts = {
        "parameters": memory.parameter_bytes(model),
        "gradients": memory.gradient_bytes(model),
        "optimizer": memory.optimizer_state_bytes(_torch_optimizer(trainer.optimizer).state),
        "activations": activations,
    }
    peak = sum(parts.values()) if cpu else torch.cuda.max_memory_allocated()
    ran_at = {"world_size": dist.get_world_size() if dist.is_initialized() else 1,
              "tensor": parallel_state.get_tensor_model_parallel_world_size(),
              "context": parallel_state.get_context_parallel_world_size(),
              "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
              "data": parallel_state.get_data_parallel_world_size()}
    result = {"times": times, "cpu_times": cpu_times, "loss": loss, "peak": peak, "ran_at": ran_at, **parts}
    if dist.is_initialized():
        result["all_reduce"] = _all_reduce_seconds(cpu)
        dist.barrier()
        dist.destroy_process_group()
    return result


ALL_REDUCE_BYTES = 2 ** 24  # the all-reduce each rank of a row times after training: 16 MiB of fp32


def _all_reduce_seconds(cpu: bool) -> float:
    """The median of 5 all-reduces of :data:`ALL_REDUCE_BYTES` over the row's ranks, seconds."""
    import torch
    import torch.distributed as dist

    x = torch.ones(ALL_REDUCE_BYTES // 4, device="cpu" if cpu else "cuda")
    times = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        if not cpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _wait_for_all(cpu: bool, row: Layout) -> None:
    import torch
    import torch.distributed as dist

    if not cpu:
        torch.cuda.synchronize()
    if row.world_size > 1:
        dist.barrier()


# ----------------------------------------------------------------- rows


def run_layout(row: Layout, shape: Shape, cpu: bool, iterations: int, seed: int) -> dict:
    """``row`` trained in ``row.world_size`` spawned processes: its CSV line
    (``status`` "ok", or the error line of the check or the rank that failed)."""
    import torch.multiprocessing as mp

    line = {"layout": row.name, "world_size": row.world_size, "device": _device(cpu), "status": "ok"}
    refused = refusal(row, shape, cpu, seed)
    if refused is not None:
        return dict(line, status=f"refused: {refused}")
    if cpu:  # ranks forked from a server that imported torch, fairseq and the plugin once (seconds per rank)
        start_method = "forkserver"
        mp.set_forkserver_preload(["fairseq_megatron.fairseq_integration.trainer"])
    else:
        start_method = "spawn"  # CUDA must not have been touched in a forked process
    with tempfile.TemporaryDirectory(prefix="ablation-") as tmp:
        try:
            mp.start_processes(_train_rank, args=(row, shape, cpu, iterations, seed, os.path.join(tmp, "init"), tmp),
                               nprocs=row.world_size, join=True, start_method=start_method)
        except Exception as e:  # a rank failed: its own error line, if it wrote one
            errors = [_read(tmp, r).get("error") for r in range(row.world_size)]
            message = next((m for m in errors if m), str(e).strip().splitlines()[-1])
            return dict(line, status=f"failed: {message}")
        ranks = [_read(tmp, r) for r in range(row.world_size)]
    sizes = {"world_size": row.world_size, "tensor": row.tensor, "context": row.context, "pipeline": row.pipeline,
             "data": row.data}
    wrong = [r for r, result in enumerate(ranks) if result["ran_at"] != sizes]
    if wrong:
        return dict(line, status=f"failed: rank {wrong[0]} ran at {ranks[wrong[0]]['ran_at']}, not {sizes}")
    if "all_reduce" in ranks[0]:
        line["all_reduce_seconds"] = ranks[0]["all_reduce"]
    line.update(iteration_ms=round(statistics.median(ranks[0]["times"]) * 1e3, 1), loss=round(ranks[0]["loss"], 4),
                cpu_ms=round(max(statistics.median(r["cpu_times"]) for r in ranks) * 1e3, 1),
                peak_memory_mib=_mib(max(r["peak"] for r in ranks)))
    for r, result in enumerate(ranks):
        for part in PARTS + ("peak",):
            line[f"rank{r}_{part}_mib"] = _mib(result[part])
    return line


def _read(directory: str, rank: int) -> dict:
    path = os.path.join(directory, f"rank{rank}.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _mib(nbytes: int) -> float:
    return round(nbytes / 2 ** 20, 2)


def _device(cpu: bool) -> str:
    import torch

    if cpu:
        return f"CPU ({os.cpu_count()} cores)"
    return torch.cuda.get_device_name(0)


# ----------------------------------------------------------------- predictions


def measured_cpu(all_reduce_seconds: Optional[float]):
    """This machine as the planner's hardware (``fairseq_megatron.planner.GPU``),
    from rates measured in this process with one thread: fp32 matrix
    products (1024 x 1024), a 256 MiB copy, and the rows' gloo all-reduce of
    :data:`ALL_REDUCE_BYTES` between two processes (a ring over two ranks
    moves it once each way). Each rate is divided by the fraction of the
    peak the planner assumes programs reach, so that the planner's rates
    are the measured ones."""
    import torch

    from fairseq_megatron.planner import GPU
    from fairseq_megatron.planner.hardware import COMPUTE_EFFICIENCY, LINK_EFFICIENCY, MEMORY_EFFICIENCY

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(1024, 1024)
        a @ a
        start = time.perf_counter()
        for _ in range(8):
            a @ a
        flops = 8 * 2 * 1024 ** 3 / (time.perf_counter() - start)
        big = torch.empty(2 ** 26)
        big.copy_(torch.ones(2 ** 26))
        start = time.perf_counter()
        torch.ones(2 ** 26).copy_(big)
        copy = 3 * big.numel() * 4 / (time.perf_counter() - start)  # written once (ones), read and written once
    finally:
        torch.set_num_threads(threads)
    link = ALL_REDUCE_BYTES / all_reduce_seconds / 1e9 if all_reduce_seconds else 1.0
    return GPU("this CPU, one thread per rank", 1e6, flops / COMPUTE_EFFICIENCY / 1e12,
               flops / COMPUTE_EFFICIENCY / 1e12, copy / MEMORY_EFFICIENCY / 1e9, link / LINK_EFFICIENCY,
               link / LINK_EFFICIENCY)


def predicted_ms(row: Layout, shape: Shape, hardware, cpu: bool) -> float:
    """The planner's predicted time of ``row``'s update on ``hardware``, ms
    (fp32 on CPU, whose attention with dropout keeps its scores; bf16
    autocast and flash attention on GPUs)."""
    from fairseq_megatron.planner import ModelShape, plan

    model = ModelShape(shape.layers, shape.hidden, shape.heads, shape.ffn, shape.padded_vocab, shape.seq_len)
    layouts = plan(model, row.world_size, row.world_size, hardware.memory_gb, row.rows(shape), shape.batch,
                   precision="fp32" if cpu else "bf16-autocast", flash_attention=not cpu, tp=row.tensor,
                   pp=row.pipeline, cp=row.context, vp=row.chunks, gpu=hardware, schedule=row.schedule,
                   fully_sharded="zero3" if "fully_sharded" in row.flags else None,
                   sequence_parallel="--sequence-parallel" in row.flags)
    return round(layouts[0].predicted_step_seconds * 1e3, 1)


def predicted_memory(row: Layout, shape: Shape, cpu: bool) -> List[dict]:
    """The planner's memory of each of ``row``'s ranks
    (:func:`fairseq_megatron.planner.memory.stage_memory`; rank 0 the first
    pipeline stage, rank 1 the last), bytes: ``saved_activations`` (what
    autograd saves, the measured ``activations``' count), ``activations``
    (with the stage's outputs in flight and the gradients of the backward
    and of the weight passes) and ``peak`` (weights, gradients, optimizer
    state, what full sharding gathers, and activations), as the rows run: fp32 on CPU with its dropout masks in
    fp32 and attention that keeps its probabilities (dropout), bf16
    autocast and flash attention on GPUs."""
    from fairseq_megatron.planner import ModelShape, Training, stage_memory

    model = ModelShape(shape.layers, shape.hidden, shape.heads, shape.ffn, shape.padded_vocab, shape.seq_len)
    precision = "fp32" if cpu else "bf16-autocast"
    training = Training(row.rows(shape), precision, sequence_parallel="--sequence-parallel" in row.flags,
                        flash_attention=not cpu,
                        fully_sharded="zero3" if "fully_sharded" in row.flags else None)
    found = []
    for rank in range(row.world_size):
        stage = "last" if row.pipeline > 1 and rank == row.pipeline - 1 else "first"
        held = stage_memory(model, row.tensor, row.pipeline, row.data, row.micro_batches, training, row.context,
                            row.chunks, stage, mask_bytes=4 if cpu else 1, schedule=row.schedule)
        found.append({"saved_activations": held.activations - held.unsaved, "activations": held.activations,
                      "peak": held.total})
    return found


def add_predictions(lines: List[dict], shape: Shape, cpu: bool) -> None:
    """``predicted_ms`` of every row that ran, on the rates :func:`measured_cpu` measures,
    and each rank's predicted memory (:func:`predicted_memory`)."""
    measured = [line["all_reduce_seconds"] for line in lines if "all_reduce_seconds" in line]
    hardware = measured_cpu(statistics.median(measured) if measured else None) if cpu else None
    if hardware is None:
        from fairseq_megatron.planner import GPUS

        hardware = GPUS["h100-80gb"]
    for line in lines:
        if line["status"] == "ok":
            line["predicted_ms"] = predicted_ms(layout(line["layout"]), shape, hardware, cpu)
            for r, held in enumerate(predicted_memory(layout(line["layout"]), shape, cpu)):
                for part, value in held.items():
                    line[f"rank{r}_predicted_{part}_mib"] = _mib(value)


APART = 0.10  # predicted times closer than this are within the spread of one row's runs on a shared CPU


def orderings(lines: List[dict]) -> str:
    """The rows from fastest to slowest, measured and predicted, and how
    many of the pairs predicted at least :data:`APART` apart were measured
    in the predicted order (:func:`ordered_pairs`)."""
    ran = [line for line in lines if line["status"] == "ok" and line.get("predicted_ms")]
    measured = [line["layout"] for line in sorted(ran, key=lambda line: line["iteration_ms"])]
    predicted = [line["layout"] for line in sorted(ran, key=lambda line: line["predicted_ms"])]
    agree, pairs = ordered_pairs(ran)
    return (f"fastest first, measured:  {' < '.join(measured)}\nfastest first, predicted: {' < '.join(predicted)}\n"
            f"pairs of rows predicted at least {APART:.0%} apart: {agree} of {len(pairs)} measured in that order"
            + "".join(f"\n  {a} < {b} predicted ({pa:.0f} < {pb:.0f} ms), measured {ma:.0f} {'<' if ma < mb else '>='} "
                      f"{mb:.0f} ms" for a, b, pa, pb, ma, mb in pairs))


def ordered_pairs(lines: List[dict]):
    """Of ``lines`` (rows with ``iteration_ms`` and ``predicted_ms``), the
    pairs whose predicted times differ by at least :data:`APART` of the
    faster, as ``(faster, slower, predicted ms of each, measured ms of
    each)``, and how many of them were measured faster first."""
    pairs = []
    for i, a in enumerate(lines):
        for b in lines[i + 1:]:
            fast, slow = sorted((a, b), key=lambda line: line["predicted_ms"])
            if slow["predicted_ms"] >= (1 + APART) * fast["predicted_ms"]:
                pairs.append((fast["layout"], slow["layout"], fast["predicted_ms"], slow["predicted_ms"],
                              fast["iteration_ms"], slow["iteration_ms"]))
    return sum(1 for pair in pairs if pair[4] < pair[5]), pairs


# ----------------------------------------------------------------- output


def format_table(lines: List[dict]) -> str:
    """The rows as a text table (failed rows with their status)."""
    out = [f"{'layout':<9}{'ranks':>6}{'iteration ms':>14}{'CPU ms':>9}{'predicted':>11}{'peak MiB':>10}{'loss':>8}   "
           f"per rank MiB: parameters / gradients / optimizer / activations"]
    for line in lines:
        if line["status"] != "ok":
            out.append(f"{line['layout']:<9}{line['world_size']:>6}   {line['status']}")
            continue
        ranks = "   ".join(" / ".join(f"{line[f'rank{r}_{part}_mib']:g}" for part in PARTS)
                           for r in range(line["world_size"]))
        predicted = f"{line['predicted_ms']:.1f}" if line.get("predicted_ms") else "-"
        cpu = f"{line['cpu_ms']:.1f}" if line.get("cpu_ms") else "-"
        out.append(f"{line['layout']:<9}{line['world_size']:>6}{line['iteration_ms']:>14.1f}{cpu:>9}{predicted:>11}"
                   f"{line['peak_memory_mib']:>10.1f}{line['loss']:>8.3f}   {ranks}")
    return "\n".join(out)


def memory_table(lines: List[dict]) -> str:
    """Each rank's activations (what autograd saved) and peak, measured
    beside the planner's prediction (MiB; the activations also with what
    autograd does not save), for the rows that ran with predictions."""
    out = [f"{'layout':<22}{'rank':>5}{'activations MiB':>17}{'predicted':>11}{'with unsaved':>14}"
           f"{'peak MiB':>10}{'predicted':>11}"]
    for line in lines:
        if line["status"] != "ok" or "rank0_predicted_peak_mib" not in line:
            continue
        for r in range(line["world_size"]):
            out.append(f"{line['layout']:<22}{r:>5}{line[f'rank{r}_activations_mib']:>17.2f}"
                       f"{line[f'rank{r}_predicted_saved_activations_mib']:>11.2f}"
                       f"{line[f'rank{r}_predicted_activations_mib']:>14.2f}{line[f'rank{r}_peak_mib']:>10.2f}"
                       f"{line[f'rank{r}_predicted_peak_mib']:>11.2f}")
    return "\n".join(out)


def write_csv(path: str, lines: List[dict]) -> None:
    """``lines`` under :data:`CSV_FIELDS`, written under a temporary name of its own and renamed."""
    from fairseq_megatron.files import written_whole

    with written_whole(path) as partial, open(partial, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(lines)


def draw_png(path: str, lines: List[dict]) -> None:
    """Per layout, labelled with what it splits (:data:`SPLITS`): the time
    per iteration, measured and predicted; then each rank's model state
    (parameters, gradients, optimizer state: what tensor parallelism and
    fully sharded data parallelism halve) and, on an axis of its own, its
    activations (what data, sequence, context and pipeline parallelism
    split); a row that did not run is labelled so. Written to a temporary
    name, then renamed."""
    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # importing fairseq set the root logger to DEBUG
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{line['layout']}\n{SPLITS.get(line['layout'], '')}" for line in lines]
    ran = [line["status"] == "ok" for line in lines]
    fig, (time_axis, state_axis, act_axis) = plt.subplots(3, 1, figsize=(14, 12))
    x = range(len(lines))
    time_axis.bar([i - 0.2 for i in x], [line["iteration_ms"] if ok else 0 for line, ok in zip(lines, ran)],
                  width=0.4, color="tab:blue", label="measured")
    time_axis.bar([i + 0.2 for i in x], [line.get("predicted_ms") or 0 if ok else 0 for line, ok in zip(lines, ran)],
                  width=0.4, color="tab:gray", label="predicted (planner)")
    for i, ok in enumerate(ran):
        if not ok:
            time_axis.text(i, 0, "did not run", rotation=90, ha="center", va="bottom", fontsize=8)
    time_axis.set_xticks(list(x), names, fontsize=8)
    time_axis.set_ylabel("time per iteration, ms")
    time_axis.legend(fontsize=8)
    labels, position = [], 0
    colors = {"parameters": "tab:blue", "gradients": "tab:green", "optimizer": "tab:purple",
              "activations": "tab:orange"}
    for line in lines:
        for r in range(line["world_size"] if line["status"] == "ok" else 0):
            bottom = 0.0
            for part in PARTS[:3]:
                value = line[f"rank{r}_{part}_mib"]
                state_axis.bar(position, value, bottom=bottom, color=colors[part],
                               label=part if position == 0 else None)
                bottom += value
            act_axis.bar(position, line[f"rank{r}_activations_mib"], color=colors["activations"],
                         label="activations" if position == 0 else None)
            if line.get(f"rank{r}_predicted_saved_activations_mib") is not None:
                act_axis.scatter(position, line[f"rank{r}_predicted_saved_activations_mib"], color="black",
                                 marker="_", s=300, label="predicted (planner)" if position == 0 else None, zorder=3)
            labels.append(f"{line['layout']} rank {r}")
            position += 1
    for axis, what in ((state_axis, "model state"), (act_axis, "activations (most alive at once)")):
        axis.set_xticks(range(len(labels)), labels, fontsize=7, rotation=30, ha="right")
        axis.set_ylabel(f"{what}, MiB per rank")
        axis.legend(fontsize=8)
    fig.suptitle(f"parallelism ablation ({lines[0]['device']}): what each layout splits, and what each rank holds")
    fig.tight_layout()
    from fairseq_megatron.files import written_whole

    try:
        with written_whole(path, suffix=".png") as partial:
            fig.savefig(partial, dpi=100)
    finally:
        plt.close(fig)


# ----------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="CPU processes with gloo (default: one GPU per rank, NCCL)")
    p.add_argument("--quick", action="store_true", help="the small shape (the same as --shape quick)")
    p.add_argument("--shape", choices=sorted(SHAPES), help="the model and batch (default: gpt2-large, or quick with "
                                                            "--quick); compute: where matrix products dominate")
    p.add_argument("--rows", nargs="+", choices=LAYOUTS, default=list(LAYOUTS), metavar="LAYOUT",
                   help=f"the layouts to run, of {', '.join(LAYOUTS)} (default: all, in that order)")
    p.add_argument("--iterations", type=int, default=6,
                   help=f"updates per row; the first {UNTIMED} are not timed (default: 6)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every row this many times in turn and keep each row's fastest round (default: 1): "
                        "on a shared machine, the round least slowed by other work")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--csv", metavar="PATH", help="write one line per row to this CSV file")
    p.add_argument("--png", metavar="PATH", help="plot the rows into this PNG file")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1")
    if args.iterations <= UNTIMED:
        parser.error(f"--iterations {args.iterations}: the first {UNTIMED} are not timed; give at least {UNTIMED + 1}")
    for flag, path in (("--csv", args.csv), ("--png", args.png)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if path and os.path.isdir(path):
            example = os.path.join(path, "ablation." + flag[2:])
            parser.error(f"{flag} {path}: a directory; give a file name in it, e.g. {example}")
        if path and not os.path.isdir(folder):
            parser.error(f"{flag} {path}: no directory {folder}")
        if path and not os.access(folder, os.W_OK | os.X_OK):
            parser.error(f"{flag} {path}: cannot write in {folder}")
    import torch

    if not args.cpu and torch.cuda.device_count() < RANKS:
        parser.error(f"{torch.cuda.device_count()} CUDA GPU(s) here, the rows need {RANKS}: pass --cpu "
                     f"(and --quick) to run on CPU processes")
    shape = SHAPES[args.shape or ("quick" if args.quick else "gpt2-large")]
    print(f"{shape.layers} layers x {shape.hidden} hidden ({shape.heads} heads, FFN {shape.ffn}), "
          f"{shape.batch} x {shape.seq_len} tokens per iteration, {args.iterations} iterations, "
          f"{'fp32 on CPU' if args.cpu else 'bf16 autocast'}; {_device(args.cpu)}, "
          f"{datetime.date.today().isoformat()}", flush=True)
    load = os.getloadavg()[0]
    lines = []
    for round_ in range(args.rounds):
        for i, name in enumerate(args.rows):
            line = run_layout(layout(name), shape, args.cpu, args.iterations, args.seed)
            print(format_table([line]).splitlines()[-1], flush=True)
            if round_ == 0:
                lines.append(line)
            elif line["status"] == "ok" and lines[i]["status"] == "ok" and \
                    line["iteration_ms"] < lines[i]["iteration_ms"]:  # the round least disturbed by other load
                lines[i] = line
    add_predictions(lines, shape, args.cpu)
    print()
    print(f"load average (1 minute) at the start {load:.1f}, at the end {os.getloadavg()[0]:.1f}"
          + (f"; each row's fastest of {args.rounds} rounds" if args.rounds > 1 else ""))
    print(format_table(lines))
    print(orderings(lines))
    print(memory_table(lines))
    if args.csv:
        write_csv(args.csv, lines)
    if args.png:
        draw_png(args.png, lines)
    written = [f"{path} ({what})" for path, what in ((args.csv, "one line per row"), (args.png, "the chart")) if path]
    print(f"written: {', '.join(written) or 'nothing (give --csv and --png)'}; where each layout splits the model "
          f"and why memory is uneven across ranks: {ANSWERS}")
    failed = [line["layout"] for line in lines if line["status"] != "ok"]
    if failed:
        print(f"error: {len(failed)} of {len(lines)} rows did not run: {', '.join(failed)} (see above)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
