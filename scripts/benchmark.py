#!/usr/bin/env python
"""Training throughput and memory inside unmodified ``fairseq-train``.

    python scripts/benchmark.py --shape 1p3b [--model-parallel-size 1] [--pipeline-model-parallel-size 1]
        [--update-freq 1] [--with-fairseq]
        [--precision fp16] [--checkpoint-activations] [--sequence-parallel]
        [--csv bench.csv] [--png bench.png]

For each configuration this runs ``fairseq_cli.train`` (under torchrun, one
process per model part of each pipeline stage, when there is more than one) on synthetic binarized data with a
50k-symbol vocabulary (1000 for ``tiny``), micro-batch 8 x 1024 tokens by
default, and prints:

- tokens/s per GPU (per process on a CPU): the median over the last three
  log intervals (steady state; the first intervals hold warm-up and
  compilation) of what fairseq-train logs: for ours ``tps``
  (:mod:`fairseq_megatron.training.throughput`), for fairseq's
  ``transformer_lm`` its ``wps`` over its one process
  (``FAIRSEQ_MEGATRON_PROFILE=table.txt`` also writes a torch.profiler
  kernel table of five steps per implementation, ``table-megatron.txt``
  and ``table-fairseq.txt``, each headed by :func:`gpu_busy_summary`, plus a
  Chrome trace ``table-megatron.trace.json``; ``FAIRSEQ_MEGATRON_PROFILE_STACKS=1``
  adds Python stacks to it, which finds the source of each device wait but
  slows the host several times, so the busy share then means little);
- model TFLOP/s per GPU: for ours the median of the log's ``tflops``;
  for the others tokens/s x (6 x params + 12 x layers x hidden x seq_len),
  the same count (``model_flops_per_token`` of that module: Narayanan et
  al. 2021, appendix; no recomputation counted), with params computed from
  the shape (checked against fairseq's log at one process, and equal to
  what our trainer counts on the model it builds);
- share of ``--peak-tflops`` (default 798: a dense fp16/bf16 matmul rate
  measured on an H100; the log's ``mfu`` is the vendor's peak instead);
- peak memory: the largest ``torch.cuda.max_memory_allocated`` of any rank
  over all steps, GiB (peak resident set size of the largest rank on CPU).

``--with-fairseq`` also runs fairseq's own non-parallel ``transformer_lm``
(same shape, data, batch, optimizer and precision) in the same invocation,
so ratios compare numbers taken on the same machine at the same time.
``--with-anchor FILE`` does the same for a compiled minimal GPT in plain
PyTorch, the speed target (``FILE``'s ``bench`` for this shape with
``compile_=True``, in a fresh process; no fairseq-train, its own 50,048-row
vocabulary and random tokens; ``scripts/gpu_check.sh`` passes the one of the
GPU kit).
``--csv`` adds one row per configuration to that file (the whole file is
written under a temporary name, then renamed; a file with other columns is
refused before anything runs); ``--png`` draws tokens/s and peak memory per
configuration from every row of that CSV (matplotlib).

``--fp8 tensorwise|rowwise`` trains ours with ``--fp8 --fp8-recipe``
(float8 products through torchao; its rows' precision reads ``fp8-<recipe>``
with ``--precision bf16-autocast``, else ``fp8-<recipe>/<precision>``, plus
``-emulated`` in the test mode ``FAIRSEQ_MEGATRON_FP8_EMULATE=1``); the
anchor's rows read ``fp8-<recipe>`` when ``ANCHOR_FLOAT8`` is set in the
environment, whose ``ANCHOR_*`` knobs also go into their label and
``command``. ``--init gpt2`` draws the weights of every fairseq-train run as
the anchor draws its own (GPT-2's: normal 0.02, the residual projections
0.02 / sqrt(2 x layers), biases 0), a benchmark-only switch; fairseq's
``--no-scale-embedding`` (through ``--extra``) drops the embedding scale as well.
``--record FILE`` adds one JSON line per timed run to FILE: its label,
precision and tokens/s, the host-clock window (``time.time()``) of the
steps its tokens/s measures (from when the log line before the last three
intervals arrived to when the last one did; for the anchor, the last line
minus its timed steps' duration), and the losses fairseq-train logged
(update, base-2 loss) -- what ``scripts/gpu_clock_experiment.py`` reads to
match GPU clock samples to runs.

``--shape tiny`` runs on a CPU in about a minute (CI runs it at
model-parallel size 2 with gloo).
"""

import argparse
import csv
import datetime
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# --user-dir of this checkout (= fairseq_megatron.USER_DIR; the parent process
# does not import the plugin, only the fairseq-train processes it launches do)
USER_DIR = os.path.join(REPO, "fairseq_megatron")

# layers, hidden, ffn, heads; seq_len, micro-batch, vocabulary words
SHAPES = {
    "tiny": dict(layers=2, hidden=64, ffn=256, heads=4, seq_len=64, batch=4, vocab=1000),
    "350m": dict(layers=24, hidden=1024, ffn=4096, heads=16, seq_len=1024, batch=8, vocab=50000),
    "1p3b": dict(layers=24, hidden=2048, ffn=8192, heads=16, seq_len=1024, batch=8, vocab=50000),
    "11b_8layers": dict(layers=8, hidden=3072, ffn=18432, heads=32, seq_len=1024, batch=8, vocab=50000),
    "11b": dict(layers=72, hidden=3072, ffn=18432, heads=32, seq_len=1024, batch=8, vocab=50000),
}
CSV_FIELDS = [
    "date", "device", "label", "impl", "shape", "model_parallel_size", "precision", "params",
    "tokens_per_s", "model_tflops", "share_of_peak", "peak_mem_gib", "world_size", "command",
    "eval_lm_tokens", "eval_lm_s", "eval_lm_tokens_per_s", "eval_lm_wikitext103_test_min",
]


def resolved_shape(args) -> dict:
    """The ``--shape`` entry with ``--seq-len`` and ``--batch-size`` applied."""
    shape = dict(SHAPES[args.shape])
    shape["seq_len"] = args.seq_len or shape["seq_len"]
    shape["batch"] = args.batch_size or shape["batch"]
    return shape


def padded_vocab(words: int, multiple: int) -> int:
    n = words + 4  # fairseq's <s> <pad> </s> <unk>
    return (n + multiple - 1) // multiple * multiple


def model_shape(shape: dict, vocab_size: int):
    """The planner's :class:`~fairseq_megatron.planner.ModelShape` of a
    ``--shape`` entry with ``vocab_size`` embedding rows: a pre-norm decoder
    with tied input/output embedding and sinusoidal positions. The planner
    owns the parameter and FLOP counts; this script only reports them."""
    sys.path.insert(0, REPO)  # the checkout this script belongs to, not an installed copy
    from fairseq_megatron.planner import ModelShape

    return ModelShape(shape["layers"], shape["hidden"], shape["heads"], shape["ffn"], vocab_size, shape["seq_len"])


def count_params(shape: dict, vocab_size: int) -> int:
    """Parameters at model-parallel size 1 (what fairseq logs as "num. shared
    model params"), by the planner's count."""
    return model_shape(shape, vocab_size).parameters()


# ----------------------------------------------------------------- data


def make_data(data_dir: str, vocab_words: int, split: str, num_tokens: int, seed: int = 0) -> None:
    """Binarized ``split`` of about ``num_tokens`` Zipf-distributed ids (lines of
    200 tokens + eos) and a dict.txt padded to a multiple of 8 as
    fairseq-preprocess pads it. Files that exist are kept; new ones are
    written under temporary names and renamed."""
    import numpy as np
    import torch
    from fairseq.data import indexed_dataset

    os.makedirs(data_dir, exist_ok=True)
    dict_path = os.path.join(data_dir, "dict.txt")
    if not os.path.exists(dict_path):
        with open(dict_path + ".tmp", "w") as f:
            for i in range(vocab_words):
                f.write(f"w{i} {vocab_words - i}\n")
            for i in range(padded_vocab(vocab_words, 8) - 4 - vocab_words):
                f.write(f"madeupword{i:04d} 0\n")
        os.replace(dict_path + ".tmp", dict_path)
    prefix = os.path.join(data_dir, split)
    if os.path.exists(prefix + ".idx"):
        return
    rng = np.random.default_rng(seed + len(split))
    nspecial, eos, line = 4, 2, 200
    builder = indexed_dataset.make_builder(prefix + ".tmp.bin", impl="mmap", vocab_size=vocab_words + nspecial)
    for _ in range(max(1, round(num_tokens / (line + 1)))):
        ids = np.minimum(rng.zipf(1.1, size=line) - 1, vocab_words - 1)
        ids = np.where(rng.random(line) < 0.3, rng.integers(0, vocab_words, line), ids) + nspecial
        builder.add_item(torch.from_numpy(np.append(ids, eos).astype(np.int64)))
    builder.finalize(prefix + ".tmp.idx")
    os.replace(prefix + ".tmp.bin", prefix + ".bin")
    os.replace(prefix + ".tmp.idx", prefix + ".idx")


# ----------------------------------------------------------------- one run


def _model_parallel_size(args, impl: str) -> int:
    return args.model_parallel_size if impl == "megatron" else 1  # fairseq's transformer_lm is not parallel


def _precision(args, impl: str, use_cuda: bool) -> str:
    """Ours runs ``args.precision``; fairseq's transformer_lm has no bf16 GPU
    path (its ``--bf16`` means TPU), so against ``bf16-autocast`` it runs
    ``--fp16``, its fastest GPU recipe."""
    if impl == "fairseq" and args.precision == "bf16-autocast":
        return "fp16" if use_cuda else "fp32"
    return args.precision


def precision_label(args, impl: str, use_cuda: bool) -> str:
    """The precision a row reports: :func:`_precision`, or for ours with
    ``--fp8`` the float8 recipe (with the precision of everything else when
    that is not bf16 autocast, and ``-emulated`` in the test mode), so that
    ratios compare like with like."""
    precision = _precision(args, impl, use_cuda)
    if impl != "megatron" or not args.fp8:
        return precision
    label = f"fp8-{args.fp8}" + ("" if precision == "bf16-autocast" else f"/{precision}")
    return label + ("-emulated" if os.environ.get("FAIRSEQ_MEGATRON_FP8_EMULATE", "") not in ("", "0") else "")


def _processes(args, impl: str) -> int:
    """Model parts times pipeline stages (ours; fairseq's transformer_lm: 1)."""
    return _model_parallel_size(args, impl) * (args.pipeline_model_parallel_size if impl == "megatron" else 1)


def _launcher(nproc: int):
    """Python, under torchrun when more than one process is needed."""
    if nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]


def train_command(args, impl: str, shape: dict, data_dir: str, result_file: str, use_cuda: bool,
                  save_dir: str = None):
    model_parallel_size = _model_parallel_size(args, impl)
    dims = ["--decoder-layers", shape["layers"], "--decoder-embed-dim", shape["hidden"],
            "--decoder-ffn-embed-dim", shape["ffn"], "--decoder-attention-heads", shape["heads"]]
    if impl == "megatron":
        model = ["--user-dir", USER_DIR, "--arch", "transformer_lm_megatron",
                 *dims, "--criterion", "vocab_parallel_cross_entropy",
                 "--model-parallel-size", model_parallel_size]
        if args.pipeline_model_parallel_size > 1:
            model += ["--pipeline-model-parallel-size", args.pipeline_model_parallel_size]
        if args.sequence_parallel:
            model.append("--sequence-parallel")
        if args.compile_layers:
            model.append("--compile-layers")
        if args.cuda_graphs:
            model.append("--cuda-graphs")
        if args.fp8:
            model += ["--fp8", "--fp8-recipe", args.fp8]
    else:  # fairseq's own transformer_lm, at the same shape
        model = ["--arch", "transformer_lm_gpt2_small", *dims, "--dropout", "0.1"]
    if args.checkpoint_activations:
        model.append("--checkpoint-activations")
    if args.offload_activations:
        model.append("--offload-activations")
    precision = {"fp16": ["--fp16"], "amp": ["--amp"], "memory-efficient-fp16": ["--memory-efficient-fp16"],
                 "fp32": [], "bf16-autocast": ["--bf16-autocast"]}[_precision(args, impl, use_cuda)]
    train = [
        data_dir, "--task", "language_modeling", "--sample-break-mode", "none",
        "--tokens-per-sample", shape["seq_len"], *model, "--share-decoder-input-output-embed",
        "--optimizer", args.optimizer, *(["--adam-betas", "(0.9, 0.98)"] if args.optimizer == "adam" else []),
        "--lr", "1e-4",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10", *precision,
        "--batch-size", shape["batch"], "--update-freq", _update_freq(args), "--max-update", args.updates,
        "--log-interval", args.log_interval, "--log-format", "json",
        *(["--save-dir", save_dir, "--no-epoch-checkpoints"] if save_dir else ["--no-save"]),
        "--disable-validation", "--num-workers", "2" if use_cuda else "0", "--seed", "1",
        *([] if use_cuda else ["--cpu"]), *shlex.split(args.extra),
    ]
    return _launcher(_processes(args, impl)) + [os.path.abspath(__file__), "--fairseq-train-child", result_file,
                                                "--"] + [str(a) for a in train]


def _update_freq(args) -> int:
    """``--update-freq``, by default one micro-batch per update, or per pipeline stage (1F1B's least)."""
    return args.update_freq or args.pipeline_model_parallel_size


def run_child(result_file: str, train_argv) -> None:
    """Inside the launched process: fairseq-train, then record this rank's peak memory.

    fairseq's trainer resets CUDA's peak-memory counter after every step (to
    log ``gb_free``), so the peak is read just before each reset.
    """
    import torch

    peak = [0]
    if torch.cuda.is_available():
        reset = torch.cuda.reset_peak_memory_stats

        def read_then_reset(*a, **k):
            peak[0] = max(peak[0], torch.cuda.max_memory_allocated())
            reset(*a, **k)

        torch.cuda.reset_peak_memory_stats = read_then_reset

    from fairseq_cli import train

    profile_to = os.environ.get("FAIRSEQ_MEGATRON_PROFILE")
    if profile_to:
        _profile_steps(profile_to)
    if os.environ.get(INIT_VARIABLE) == "gpt2":
        _gpt2_initialisation_before_the_first_step()
    sys.argv = ["fairseq-train"] + list(train_argv)
    train.cli_main()
    if torch.cuda.is_available():
        peak[0] = max(peak[0], torch.cuda.max_memory_allocated())
        kind = "cuda_max_memory_allocated"
    else:
        peak[0] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        kind = "peak_rss"
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    with open(f"{result_file}.rank{rank}", "w") as f:
        json.dump({"rank": rank, "world_size": world, "peak_bytes": peak[0], "kind": kind}, f)


def _profile_steps(path: str, first: int = 30, count: int = 5) -> None:
    """Profile ``count`` training steps after ``first`` with torch.profiler and
    write the kernel table (sorted by device time) to ``path`` (rank 0)."""
    from fairseq.trainer import Trainer

    original, seen, profiler = Trainer.train_step, [0], _StepProfiler(path, count)

    def train_step(self, *a, **k):
        seen[0] += 1
        if seen[0] == first:
            profiler.start()
        out = original(self, *a, **k)
        if seen[0] == first + count - 1:
            profiler.stop()
        return out

    Trainer.train_step = train_step


# --init gpt2 reaches the fairseq-train process through its environment
INIT_VARIABLE = "FAIRSEQ_MEGATRON_BENCH_INIT"


def gpt2_initialisation_(model, seed: int = 1) -> None:
    """Draw ``model``'s weights as the GPU kit's minimal GPT draws its own
    (GPT-2's initialisation): every matrix normal(0, 0.02), the residual
    projections (attention output, FFN out) normal(0, 0.02 / sqrt(2 L)) for
    L layers, biases 0; layer norms and buffers (sinusoidal positions) kept.
    In place, from a generator of its own on the parameters' device."""
    import torch

    names = [name for name, _ in model.named_parameters()]
    layers = len({name.split(".layers.")[1].split(".")[0] for name in names if ".layers." in name}) or 1
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                generator = torch.Generator(device=p.device).manual_seed(seed)
                std = 0.02 / (2 * layers) ** 0.5 if name.endswith(("out_proj.weight", "fc2.weight")) else 0.02
                p.normal_(0.0, std, generator=generator)
                seed += 1
            elif name.endswith("bias"):
                p.zero_()


def _gpt2_initialisation_before_the_first_step() -> None:
    """:func:`gpt2_initialisation_` of the trainer's model when its first
    training step starts: after fairseq-train drew (or loaded) the weights
    and before anything is compiled. The optimizer exists by then and holds
    the parameters themselves (fp32 weights, or fp16 ones with
    ``--memory-efficient-fp16``); fairseq's ``--fp16`` optimizer has copied
    them to its fp32 master weights already, so :func:`main` refuses that
    pair."""
    from fairseq.trainer import Trainer

    original, done = Trainer.train_step, []

    def train_step(self, *a, **k):
        if not done:
            gpt2_initialisation_(self._model)
            done.append(True)
        return original(self, *a, **k)

    Trainer.train_step = train_step


def profile_optimizer_steps(path: str, first: int = 3, count: int = 3) -> None:
    """The same table for a plain training loop with ``torch.optim.AdamW``
    (the compiled minimal GPT): steps ``first`` .. ``first + count - 1``,
    each from the end of the previous ``AdamW.step`` to the end of its own;
    with ``first`` = 3 these are warm-up steps of the anchor, outside its
    timed ones."""
    import torch

    original, seen, profiler = torch.optim.AdamW.step, [0], _StepProfiler(path, count)

    def step(self, *a, **k):
        out = original(self, *a, **k)
        seen[0] += 1
        if seen[0] == first - 1:
            profiler.start()
        elif seen[0] == first + count - 1:
            profiler.stop()
        return out

    torch.optim.AdamW.step = step


class _StepProfiler:
    """torch.profiler over a window of ``steps`` training steps, written on
    :meth:`stop` to ``path`` (global rank 0): :func:`gpu_busy_summary`, the
    kernel table by device time, the host-time table, and a Chrome trace
    beside it (``.trace.json``). ``FAIRSEQ_MEGATRON_PROFILE_STACKS=1`` adds
    Python stacks (which slow the host several times)."""

    def __init__(self, path: str, steps: int):
        self.path, self.steps, self.profile = path, steps, None

    def start(self) -> None:
        import torch

        stacks = bool(os.environ.get("FAIRSEQ_MEGATRON_PROFILE_STACKS"))
        self.profile = torch.profiler.profile(
            with_stack=stacks,
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
        self.profile.__enter__()

    def stop(self) -> None:
        import torch

        if self.profile is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.profile.__exit__(None, None, None)
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        with open(self.path, "w") as f:
            f.write(json.dumps(gpu_busy_summary(self.profile, self.steps)) + "\n\n")
            f.write(self.profile.key_averages().table(sort_by="self_device_time_total", row_limit=70))
            f.write("\n\nby host time\n")
            f.write(self.profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
        self.profile.export_chrome_trace(os.path.splitext(self.path)[0] + ".trace.json")


def gpu_busy_summary(prof, steps: int) -> dict:
    """How much of the profiled window the GPU spent running kernels.

    ``busy_share``: the union of all device-activity intervals divided by
    the span from the first to the last (1.0 = never idle); ``host_waits``:
    per step, how often the host called something that waits for the device
    (stream/device synchronize, a device-to-host copy, ``.item()``)."""
    import torch

    intervals = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA
                       and not getattr(e, "is_user_annotation", False))  # record_function spans
    busy, start, end = 0, None, None
    for s, e in intervals:
        if end is None or s > end:
            busy += 0 if end is None else end - start
            start, end = s, e
        else:
            end = max(end, e)
    busy += 0 if end is None else end - start
    span = intervals[-1][1] - intervals[0][0] if intervals else 0
    waits = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and any(
                k in e.name for k in ("Synchronize", "_local_scalar_dense", "cudaMemcpy")):
            waits[e.name] = waits.get(e.name, 0) + 1
    return {"steps": steps, "span_ms_per_step": round(span / 1e3 / steps, 2),
            "busy_ms_per_step": round(busy / 1e3 / steps, 2),
            "busy_share": round(busy / span, 3) if span else None,
            "device_events_per_step": round(len(intervals) / steps),
            "host_waits_per_step": {k: v / steps for k, v in sorted(waits.items())}}


def why_it_failed(output: str) -> str:
    """The ``error: ...`` lines of a failed fairseq run, once each and without
    torchrun's rank prefix; the last 5 lines of its output where it printed
    none (a traceback: its last lines say most)."""
    errors = dict.fromkeys(re.findall(r"^(?:\[rank\d+\]: )?(error: .*)$", output, re.M))
    return "\n".join(errors or output.strip().splitlines()[-5:])


def train_inner_record(line: str):
    """The json record of a fairseq ``train_inner`` log line (one log
    interval: ``wps``, ``loss``, ``num_updates``, ...), or None."""
    start = line.find("{")
    if start < 0 or '"wps"' not in line:
        return None
    try:
        record = json.loads(line[start:])
    except ValueError:
        return None
    return record if "train_inner" in line or "update" in record else None


def parse_log(output: str):
    """fairseq's json ``train_inner`` records -> (the values of each key in
    order, e.g. ``"wps"``, ``"tps"``, ``"tflops"``; logged param count or None)."""
    logged, params = {}, None
    for line in output.splitlines():
        if "num. shared model params:" in line and params is None:
            params = int(line.split("num. shared model params:")[1].split()[0].replace(",", ""))
        record = train_inner_record(line)
        for key, value in (record or {}).items():
            try:
                logged.setdefault(key, []).append(float(value))
            except (TypeError, ValueError):
                pass
    return logged, params


def logged_losses(output: str) -> list:
    """``[update, loss]`` of each ``train_inner`` record (fairseq's base-2
    loss, the mean over the interval ending at that update)."""
    losses = []
    for line in output.splitlines():
        record = train_inner_record(line)
        if record is not None and "loss" in record:
            losses.append([int(record.get("num_updates", 0)), float(record["loss"])])
    return losses


def run_with_line_times(cmd, env):
    """``cmd`` with its standard output and error as one stream:
    ``(returncode, output, line_times)``, where ``line_times[i]`` is the host
    clock (``time.time()``) when line ``i`` of the output arrived."""
    lines, times = [], []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        for line in proc.stdout:
            times.append(time.time())
            lines.append(line)
    return proc.returncode, "".join(lines), times


def timed_window(output: str, line_times, intervals: int = 3):
    """``[start, end]`` on the host clock of the last ``intervals`` log
    intervals, which the tokens/s is the median of: from when the output
    line before the first of them arrived (the previous interval's, or
    fairseq's last line before training) to when the last one did. fairseq
    reads its meters back from the GPU when it logs, so a line arrives once
    the GPU has finished that interval's steps. None without that many."""
    # split as run_with_line_times read it (universal newlines: "\n" ends every line)
    marks = [i for i, line in enumerate(output.split("\n")) if train_inner_record(line) is not None]
    if len(marks) < intervals or marks[-intervals] == 0:
        return None
    return [line_times[marks[-intervals] - 1], line_times[marks[-1]]]


def portable_command(argv, work_dir: str) -> str:
    """``argv`` as one shell line for the CSV, without the paths of the
    machine that ran it: files of this checkout relative to it, files of
    ``--work-dir`` under ``<work-dir>/``."""
    places = ((os.path.abspath(work_dir) + os.sep, "<work-dir>/"), (REPO + os.sep, ""))
    words = []
    for arg in map(str, argv):
        absolute = os.path.abspath(arg) if os.path.isabs(arg) else None
        for place, name in places if absolute else ():
            if absolute.startswith(place):
                arg = name + absolute[len(place):]
                break
        words.append(shlex.quote(arg))
    return " ".join(words)


def run_one(args, impl: str, work_dir: str, use_cuda: bool, device: str):
    shape = resolved_shape(args)
    data_dir = os.path.join(work_dir, f"data-v{shape['vocab']}")
    make_data(data_dir, shape["vocab"], "train",
              num_tokens=max(4_000_000 if use_cuda else 0, 2 * args.updates * shape["batch"] * shape["seq_len"]))
    save_dir = None
    if args.eval_lm_tokens:
        make_data(data_dir, shape["vocab"], f"valid{args.eval_lm_tokens}", args.eval_lm_tokens)
        save_dir = os.path.join(work_dir, f"checkpoints-{impl}")
    result_file = os.path.join(work_dir, f"result-{impl}-{os.getpid()}")
    cmd = train_command(args, impl, shape, data_dir, result_file, use_cuda, save_dir)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if env.get("FAIRSEQ_MEGATRON_PROFILE"):  # one table per implementation
        root, ext = os.path.splitext(env["FAIRSEQ_MEGATRON_PROFILE"])
        env["FAIRSEQ_MEGATRON_PROFILE"] = f"{root}-{impl}{ext}"
    if not use_cuda:
        env.setdefault("OMP_NUM_THREADS", "1")
    env[INIT_VARIABLE] = args.init
    returncode, output, line_times = run_with_line_times(cmd, env)
    log_path = os.path.join(work_dir, f"{impl}-{args.shape}-mp{args.model_parallel_size}.log")
    with open(log_path, "w") as f:
        f.write(output)
    if returncode != 0:
        raise SystemExit(f"error: fairseq-train ({impl}) failed, exit {returncode}; log {log_path}:\n"
                         f"{why_it_failed(output)}")
    logged, logged_params = parse_log(output)
    if len(logged.get("wps", [])) < 3:
        raise SystemExit(f"error: fewer than 3 log intervals in {log_path}: raise --updates or lower --log-interval")
    ranks = []
    for name in sorted(os.listdir(work_dir)):
        if name.startswith(os.path.basename(result_file) + ".rank"):
            with open(os.path.join(work_dir, name)) as f:
                ranks.append(json.load(f))
            os.remove(os.path.join(work_dir, name))
    model_parallel_size = _model_parallel_size(args, impl)
    multiple = 8 * model_parallel_size  # fairseq-preprocess pads to 8; our model to 8 x its size
    params = count_params(shape, padded_vocab(shape["vocab"], multiple))
    flops_per_token = model_shape(shape, padded_vocab(shape["vocab"], multiple)).flops_per_token()
    if _processes(args, impl) == 1 and logged_params is not None and logged_params != params:  # one rank: all
        raise SystemExit(f"error: shape formula gives {params} parameters, fairseq logged {logged_params}")
    if impl == "megatron":  # our trainer logs them per GPU
        tokens_per_s, tflops = (statistics.median(logged[key][-3:]) for key in ("tps", "tflops"))
    else:
        tokens_per_s = statistics.median(logged["wps"][-3:]) / _processes(args, impl)
        tflops = tokens_per_s * flops_per_token / 1e12
    record = {"window": timed_window(output, line_times), "losses": logged_losses(output)}
    eval_lm = run_eval_lm(args, impl, shape, data_dir, save_dir, use_cuda, model_parallel_size) if save_dir else {}
    precision = precision_label(args, impl, use_cuda)
    label = f"{'ours' if impl == 'megatron' else 'fairseq'} {args.shape} mp{model_parallel_size} {precision}"
    if impl == "megatron" and args.pipeline_model_parallel_size > 1:
        label += f" pp{args.pipeline_model_parallel_size}"
    if _update_freq(args) > 1:
        label += f" x{_update_freq(args)} micro-batches"
    if impl == "megatron" and args.sequence_parallel:
        label += " sp"
    if impl == "megatron" and args.compile_layers:
        label += " compiled"
    if impl == "megatron" and args.cuda_graphs:
        label += " cudagraphs"
    if args.checkpoint_activations:
        label += " ckpt"
    if args.offload_activations:
        label += " offload"
    if args.init != "fairseq":
        label += f" {args.init}-init"
    if args.label:
        label += f" {args.label}"
    return {
        "date": datetime.date.today().isoformat(), "device": device, "label": label, "impl": impl,
        "shape": args.shape, "model_parallel_size": model_parallel_size, "precision": precision,
        "params": params, "tokens_per_s": round(tokens_per_s, 1), "model_tflops": round(tflops, 6),
        "share_of_peak": round(tflops / args.peak_tflops, 6),
        "peak_mem_gib": round(max(r["peak_bytes"] for r in ranks) / 2**30, 3) if ranks else "",
        "world_size": max((r["world_size"] for r in ranks), default=""),
        "command": portable_command(cmd[cmd.index("--") + 1:], work_dir),
        **eval_lm, "_record": record,
    }


def run_eval_lm(args, impl, shape, data_dir, save_dir, use_cuda, model_parallel_size):
    """fairseq-eval-lm on the checkpoint just trained, over the synthetic
    ``valid{N}`` split, with ``--context-window`` (each block of
    ``seq_len - context_window`` new tokens costs one ``seq_len``-token
    forward). Returns its tokens/s and the time it implies for the 270,847
    tokens of the Wikitext-103 test set (cost is linear in tokens). The
    checkpoint is deleted afterwards."""
    import re
    import shutil

    cmd = _launcher(model_parallel_size) + ["-m", "fairseq_cli.eval_lm", data_dir, "--path", os.path.join(save_dir, "checkpoint_last.pt"),
            "--gen-subset", f"valid{args.eval_lm_tokens}", "--sample-break-mode", "none",
            "--tokens-per-sample", str(shape["seq_len"]), "--context-window", str(args.context_window),
            "--batch-size", str(args.eval_batch_size), "--num-workers", "2",
            *(["--fp16"] if use_cuda and args.precision != "fp32" else []), *([] if use_cuda else ["--cpu"])]
    if impl == "megatron":
        cmd += ["--user-dir", USER_DIR, "--model-parallel-size", str(model_parallel_size)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    shutil.rmtree(save_dir, ignore_errors=True)
    found = re.findall(r"Evaluated ([0-9,]+) tokens in ([0-9.]+)s \(([0-9.]+) tokens/s\)", proc.stdout)
    if proc.returncode != 0 or not found:
        log_path = os.path.join(args.work_dir, f"eval_lm-{impl}-{args.shape}.log")
        with open(log_path, "w") as f:
            f.write(proc.stdout)
        print(f"error: fairseq-eval-lm ({impl}) failed, exit {proc.returncode}; log {log_path}:\n"
              f"{why_it_failed(proc.stdout)}", file=sys.stderr, flush=True)
        return {"eval_lm_failed": True}  # the training figures are still reported; main() exits 1
    tokens, seconds, tokens_per_s = found[-1]
    return {"eval_lm_tokens": int(tokens.replace(",", "")), "eval_lm_s": float(seconds),
            "eval_lm_tokens_per_s": float(tokens_per_s),
            "eval_lm_wikitext103_test_min": round(270847 / float(tokens_per_s) / 60, 2)}


# The anchor file benchmarks every shape when run; its definitions end where
# that loop starts. The child runs them, then bench() for one shape, timing
# this many steps (bench's default) after its warm-up.
ANCHOR_TIMED_STEPS = 30
_ANCHOR_LOOP = "\nfor c in (False, True):"
_ANCHOR_CHILD = """
import os
import sys
path, name, layers, hidden, heads, ffn, batch, seq_len = sys.argv[1:]
source = open(path).read()
cut = source.find(%r)
if cut < 0:
    sys.exit(f"error: {path} does not end in the loop this script expects; cannot run one shape")
namespace = {"__name__": "sdpa_gpt_anchor"}
profile_to = os.environ.get("FAIRSEQ_MEGATRON_PROFILE")
if profile_to:
    sys.path.insert(0, os.path.dirname(%r))
    from benchmark import profile_optimizer_steps
    root, ext = os.path.splitext(profile_to)
    profile_optimizer_steps(f"{root}-anchor{ext}")
exec(compile(source[:cut], path, "exec"), namespace)
namespace["bench"](name, int(layers), int(hidden), int(heads), int(ffn), compile_=True,
                   steps=%d, B=int(batch), T=int(seq_len))
""" % (_ANCHOR_LOOP, os.path.abspath(__file__), ANCHOR_TIMED_STEPS)
ANCHOR_VOCAB = 50048  # the anchor's embedding rows, whatever the shape's vocabulary
# The anchor's environment knobs (its docstring): initialisation, data, float8 training
ANCHOR_KNOBS = ("ANCHOR_INIT", "ANCHOR_DATA", "ANCHOR_FLOAT8")
_ANCHOR_LINE = re.compile(
    r"compiled: ([0-9]+)M params, ([0-9.]+) tokens/s, [0-9.]+ TFLOP/s, peak mem ([0-9.]+) GiB")


def run_anchor(args, work_dir: str, device: str):
    """``bench(..., compile_=True)`` of the ``--with-anchor`` file for this shape,
    in its own process; returns a CSV row like :func:`run_one`'s (model FLOPs
    from this script's formula with the anchor's vocabulary, which is also how
    the anchor counts them). The ``ANCHOR_*`` knobs of this environment reach
    it and are named in the row's label and command; with ``ANCHOR_FLOAT8``
    its precision is ``fp8-<recipe>``."""
    shape = resolved_shape(args)
    argv = [args.with_anchor, f"anchor {args.shape}", shape["layers"], shape["hidden"], shape["heads"],
            shape["ffn"], shape["batch"], shape["seq_len"]]
    returncode, output, line_times = run_with_line_times([sys.executable, "-c", _ANCHOR_CHILD, *map(str, argv)],
                                                         dict(os.environ, PYTHONWARNINGS="ignore"))
    log_path = os.path.join(work_dir, f"anchor-{args.shape}.log")
    with open(log_path, "w") as f:
        f.write(output)
    found = [(i, m) for i, line in enumerate(output.split("\n")) for m in _ANCHOR_LINE.findall(line)]
    if returncode != 0 or not found:
        tail = "\n".join(output.strip().splitlines()[-5:])
        raise SystemExit(f"error: the anchor {args.with_anchor} failed, exit {returncode}; log {log_path}:\n{tail}")
    line, (_, tokens_per_s, peak_gib) = found[-1]
    params = count_params(shape, ANCHOR_VOCAB)
    tflops = float(tokens_per_s) * model_shape(shape, ANCHOR_VOCAB).flops_per_token() / 1e12
    # it prints once its timed steps are done: they took steps x tokens per step / tokens per second
    timed_s = ANCHOR_TIMED_STEPS * shape["batch"] * shape["seq_len"] / float(tokens_per_s)
    knobs = {k: os.environ[k] for k in ANCHOR_KNOBS if os.environ.get(k)}
    float8 = knobs.get("ANCHOR_FLOAT8")
    return {
        "date": datetime.date.today().isoformat(), "device": device,
        "label": " ".join([f"compiled minimal GPT {args.shape}"] + [f"{k}={v}" for k, v in knobs.items()]
                          + ([args.label] if args.label else [])),
        "impl": "anchor", "shape": args.shape, "model_parallel_size": 1,
        "precision": f"fp8-{float8}" if float8 else "bf16-autocast",
        "params": params, "tokens_per_s": round(float(tokens_per_s), 1), "model_tflops": round(tflops, 6),
        "share_of_peak": round(tflops / args.peak_tflops, 6), "peak_mem_gib": float(peak_gib),
        "world_size": 1,
        "command": " ".join([f"{k}={shlex.quote(v)}" for k, v in knobs.items()]
                            + [shlex.quote(str(a)) for a in argv]),
        "_record": {"window": [line_times[line] - timed_s, line_times[line]], "losses": []},
    }


# ----------------------------------------------------------------- output


def describe(row: dict, peak_tflops: float) -> str:
    return (f"{row['label']}: {row['params'] / 1e6:.1f}M params, {row['tokens_per_s']:.0f} tokens/s per GPU, "
            f"{row['model_tflops']:.1f} model TFLOP/s per GPU = {100 * row['share_of_peak']:.1f}% of "
            f"{peak_tflops:g}, peak memory {row['peak_mem_gib']} GiB (world size {row['world_size']})")


def read_csv_rows(path: str) -> list:
    """The rows already in the ``--csv`` file (none if it does not exist yet).

    Raises ValueError when the file's header is not :data:`CSV_FIELDS`
    (a file written by another version of this script, or not by it):
    appended rows would land under the wrong columns.
    """
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames != CSV_FIELDS:
            raise ValueError(f"--csv {path} has other columns than this script writes "
                             f"({','.join(reader.fieldnames or [])!r}): name a new file")
        return list(reader)


def write_csv(path: str, rows) -> None:
    """Write the header and ``rows`` to ``path``: under a temporary name of
    its own, then renamed, so an interrupted run leaves the old file whole."""
    from fairseq_megatron.files import written_whole

    with written_whole(path) as partial, open(partial, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def run_record(row: dict) -> dict:
    """What ``--record`` keeps of a run (and takes off its CSV row): label,
    implementation, shape, precision, tokens/s, ``window`` (host-clock
    seconds of the timed steps, or None) and ``losses`` (``[update, loss]``)."""
    extra = row.pop("_record", None) or {}
    return {**{k: row[k] for k in ("label", "impl", "shape", "precision", "tokens_per_s")},
            "window": extra.get("window"), "losses": extra.get("losses", [])}


def append_records(path: str, records) -> None:
    """Add ``records`` to the JSON-lines file ``path`` (written whole under a
    temporary name, then renamed)."""
    from fairseq_megatron.files import written_whole

    old = open(path).read() if os.path.exists(path) else ""
    with written_whole(path) as partial, open(partial, "w") as f:
        f.write(old + "".join(json.dumps(r) + "\n" for r in records))


def draw_png(csv_path: str, png_path: str) -> None:
    """Tokens/s and peak memory per configuration, from every row of the CSV."""
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # importing fairseq set the root logger to DEBUG
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    labels = [r["label"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 1.5), sharey=True)
    left.barh(labels, [float(r["tokens_per_s"]) for r in rows], color="tab:blue")
    left.set_xlabel("tokens/s (fairseq-train wps)")
    left.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / 1e3:g}k" if x else "0"))
    right.barh(labels, [float(r["peak_mem_gib"] or 0) for r in rows], color="tab:orange")
    right.set_xlabel("peak memory per rank, GiB")
    left.invert_yaxis()
    fig.suptitle(f"fairseq_megatron benchmark ({rows[-1]['device']})")
    fig.tight_layout()
    from fairseq_megatron.files import written_whole

    with written_whole(png_path, suffix=".png") as partial:
        fig.savefig(partial, dpi=100)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline stages of our model (one process per stage and model part)")
    p.add_argument("--update-freq", type=int,
                   help="micro-batches per update (default: 1, or the pipeline size); tokens/s counts them all")
    p.add_argument("--with-fairseq", action="store_true", help="also time fairseq's own transformer_lm")
    p.add_argument("--only-fairseq", action="store_true", help="time only fairseq's transformer_lm")
    p.add_argument("--only-anchor", action="store_true", help="time only the --with-anchor GPT")
    p.add_argument("--with-anchor", metavar="FILE",
                   help="also time the compiled minimal GPT of FILE (a script defining bench(name, L, d, h, f, compile_, B, T))")
    p.add_argument("--precision", choices=["fp16", "amp", "memory-efficient-fp16", "fp32", "bf16-autocast"],
                   help="default: fp16 on GPU, fp32 on CPU. bf16-autocast: fp32 weights, bf16 "
                        "autocast (ours only; fairseq's transformer_lm then runs --fp16)")
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--checkpoint-activations", action="store_true")
    p.add_argument("--offload-activations", action="store_true",
                   help="fairseq's flag: checkpointing, with each layer's input kept in host memory")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--compile-layers", action="store_true", help="torch.compile our decoder layers")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="our layer stack replayed as CUDA graphs (needs --compile-layers at model-parallel size 1; "
                        "our model refuses it otherwise)")
    p.add_argument("--fp8", choices=["tensorwise", "rowwise"],
                   help="ours with --fp8 --fp8-recipe RECIPE (float8 products through torchao; a GPU of compute "
                        "capability 8.9 or newer, or the test mode FAIRSEQ_MEGATRON_FP8_EMULATE=1)")
    p.add_argument("--init", choices=["fairseq", "gpt2"], default="fairseq",
                   help="gpt2: draw the weights of every fairseq-train run as the GPU kit's minimal GPT does "
                        "(normal 0.02, residual projections 0.02 / sqrt(2 layers), biases 0); benchmark only")
    p.add_argument("--record", metavar="FILE",
                   help="add a JSON line per timed run to FILE: label, precision, tokens/s, the host-clock window "
                        "of the timed steps, the logged losses")
    p.add_argument("--batch-size", type=int, help="micro-batch in sequences (default: the shape's)")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default: the shape's)")
    p.add_argument("--updates", type=int, default=60)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--eval-lm-tokens", type=int, default=0,
                   help="then run fairseq-eval-lm on a synthetic split of this many tokens")
    p.add_argument("--context-window", type=int, default=992, help="for --eval-lm-tokens")
    p.add_argument("--eval-batch-size", type=int, default=8, help="for --eval-lm-tokens")
    p.add_argument("--peak-tflops", type=float, default=798.0, help="peak to report a share of (TFLOP/s)")
    p.add_argument("--extra", default="", help="more fairseq-train arguments, one string: --extra='--use-old-adam'")
    p.add_argument("--label", default="", help="appended to the configuration's label")
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "fairseq_megatron_bench"))
    p.add_argument("--csv", help="add the results to this CSV (made if missing)")
    p.add_argument("--png", help="chart of every row of --csv (needs --csv and matplotlib)")
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--fairseq-train-child":
        return run_child(argv[1], argv[3:])
    p = build_parser()
    args = p.parse_args(argv)
    if args.png and not args.csv:
        p.error("--png draws the rows of --csv; pass --csv too")
    if args.with_anchor and not os.path.isfile(args.with_anchor):
        p.error(f"--with-anchor: no such file: {args.with_anchor}")
    for name in ("model_parallel_size", "pipeline_model_parallel_size", "update_freq", "batch_size", "seq_len",
                 "updates", "log_interval", "eval_batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:  # 0 was a ZeroDivisionError, or ignored
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.eval_lm_tokens < 0 or args.context_window < 0 or args.peak_tflops <= 0:
        p.error("--eval-lm-tokens and --context-window cannot be negative, --peak-tflops must be positive")
    if args.updates // args.log_interval < 3:  # the median is over the last three intervals
        p.error(f"--updates {args.updates} gives fewer than 3 intervals of --log-interval {args.log_interval}: "
                f"raise --updates or lower --log-interval")
    seq_len = resolved_shape(args)["seq_len"]
    if args.eval_lm_tokens and args.context_window >= seq_len:
        p.error(f"--context-window {args.context_window} leaves no token to score in blocks of {seq_len} "
                f"(--seq-len): each block scores seq-len minus context-window new tokens")
    # Checked before the runs (which may take an hour of GPU time), not after.
    if args.csv:
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.csv))):
            p.error(f"--csv {args.csv}: no such directory")
        try:
            read_csv_rows(args.csv)
        except (ValueError, OSError, UnicodeDecodeError, csv.Error) as e:
            p.error(str(e))
    if args.png:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            p.error("--png needs matplotlib (pip install matplotlib)")

    import torch

    use_cuda = torch.cuda.is_available()
    args.precision = args.precision or ("fp16" if use_cuda else "fp32")
    if not use_cuda and args.precision not in ("fp32", "bf16-autocast"):
        p.error(f"--precision {args.precision} needs a GPU")
    if args.init == "gpt2" and args.precision == "fp16":
        p.error("--init gpt2 draws the weights at the first step, after fairseq's --fp16 optimizer copied them "
                "to its fp32 master weights; use --precision bf16-autocast or memory-efficient-fp16")
    if args.fp8 and not use_cuda and os.environ.get("FAIRSEQ_MEGATRON_FP8_EMULATE", "") in ("", "0"):
        p.error("--fp8 needs a GPU with float8 matrix multiplies (or the test mode FAIRSEQ_MEGATRON_FP8_EMULATE=1)")
    gpus = args.model_parallel_size * args.pipeline_model_parallel_size
    if use_cuda and gpus > torch.cuda.device_count():
        p.error(f"--model-parallel-size {args.model_parallel_size} x --pipeline-model-parallel-size "
                f"{args.pipeline_model_parallel_size} needs {gpus} GPUs; this machine has {torch.cuda.device_count()}")
    device = torch.cuda.get_device_name() if use_cuda else "CPU"
    try:
        os.makedirs(args.work_dir, exist_ok=True)
    except OSError as e:
        p.error(f"--work-dir {args.work_dir}: {e.strerror}")
    if args.only_anchor and not args.with_anchor:
        p.error("--only-anchor times the --with-anchor file; pass --with-anchor too")
    impls = ["fairseq"] if args.only_fairseq else (["megatron", "fairseq"] if args.with_fairseq else ["megatron"])
    if args.only_anchor:
        impls = []
    rows = []
    eval_lm_failed = False
    records = []
    for impl in impls:
        row = run_one(args, impl, args.work_dir, use_cuda, device)
        eval_lm_failed |= row.pop("eval_lm_failed", False)
        records.append(run_record(row))
        rows.append(row)
        print(describe(row, args.peak_tflops), flush=True)
        if "eval_lm_s" in row:
            print(f"{row['label']}: fairseq-eval-lm --context-window {args.context_window}: "
                  f"{row['eval_lm_tokens']} tokens in {row['eval_lm_s']} s = {row['eval_lm_tokens_per_s']:.0f} "
                  f"tokens/s -> {row['eval_lm_wikitext103_test_min']} min for the 270,847-token "
                  f"Wikitext-103 test set", flush=True)
    if args.with_anchor:
        row = run_anchor(args, args.work_dir, device)
        records.append(run_record(row))
        rows.append(row)
        print(describe(row, args.peak_tflops), flush=True)
    by_impl = {row["impl"]: row["tokens_per_s"] for row in rows}
    for a, b, name in (("megatron", "fairseq", "ours / fairseq"), ("megatron", "anchor", "ours / compiled minimal GPT"),
                       ("anchor", "fairseq", "compiled minimal GPT / fairseq")):
        if a in by_impl and b in by_impl:
            print(f"{name}: {by_impl[a] / by_impl[b]:.2f}x tokens/s")
    if args.record:
        append_records(args.record, records)
    if args.csv:
        write_csv(args.csv, read_csv_rows(args.csv) + rows)  # read again: another run may have added rows
    if args.png:
        draw_png(args.csv, args.png)
    return 1 if eval_lm_failed else 0


if __name__ == "__main__":
    sys.exit(main())
