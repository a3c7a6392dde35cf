#!/usr/bin/env python
"""Why our training runs at lower GPU clocks than the compiled minimal GPT,
and ``--fp8`` beside it: one prepared experiment for a GPU machine.

    python scripts/gpu_clock_experiment.py --parts clocks,loss --budget 400   # first device call
    python scripts/gpu_clock_experiment.py --parts fp8,11b --budget 280       # second device call
    python scripts/gpu_clock_experiment.py --shape tiny                       # any machine: checks the script

Each configuration is one run of ``scripts/benchmark.py`` (ours through
fairseq-train, or the GPU kit's compiled minimal GPT, "the anchor"), one
after another on one GPU, while ``nvidia-smi`` samples the SM clock, the
power draw, the temperature and the active clock-event reasons five times a
second in the background. For each configuration the script takes the
samples inside the host-clock window of its timed steps (``benchmark.py
--record``) and reports the mean SM clock and power, the peak temperature,
and how often each reason was active, the bitmask decoded per sample: 0x4
software power cap, 0x8 hardware slowdown, 0x20 / 0x40 software / hardware
thermal slowdown, 0x80 hardware power brake (and the others nvidia-smi
defines: 0x1 idle, 0x2 application clocks, 0x10 sync boost, 0x100 display
clocks).

The parts, their configurations in the order they run:

- ``clocks`` (1.31B, 30 updates): ``anchor-old`` (``ANCHOR_INIT=torch
  ANCHOR_DATA=fixed``: torch's default initialisation and one fixed batch,
  the anchor's earlier version), ``anchor`` (GPT-2's initialisation and a
  fresh batch per step), ``ours`` (bf16 autocast, compiled layer stack, CUDA
  graphs), ``ours-no-graphs``, ``ours-gpt2-init`` (the anchor's
  initialisation and no embedding scale: ``--init gpt2
  --no-scale-embedding``). Hypotheses: the data a kernel multiplies sets
  its power (the old anchor's N(0, 1) embedding against GPT-2's 0.02; ours
  scales its embedding by sqrt(C)), or CUDA graphs' denser launches do.
- ``loss`` (350M, 200 updates, the same seed): ``ours-loss-bf16`` and
  ``ours-loss-fp8-tensorwise``; the last logged loss of each (the target:
  within 1%).
- ``fp8`` (1.31B, 30 updates): ``anchor-bf16``, ``ours-fp8-tensorwise``,
  ``anchor-fp8-tensorwise``, ``ours-fp8-rowwise``, ``anchor-fp8-rowwise``
  (the anchor under ``ANCHOR_FLOAT8``: torchao's float8 training of its
  ``nn.Linear`` layers; ours with ``--fp8``, compiled, CUDA graphs).
- ``11b`` (the Megatron-11b layer shape, 30 updates): ``anchor``, ``ours``,
  ``ours-fp8-tensorwise``, ``anchor-fp8-tensorwise``.

``--budget SECONDS`` skips (with a line, and a ``skipped`` row) each
configuration whose estimated duration no longer fits: the longest run so
far of the same part and kind, else a prior (:data:`PRIOR_S`, from the GPU
timings in docs/benchmarks.md). Results are written after every configuration, so
a call cut short keeps what it measured.

Written to ``--out`` (default ``$OUT``, else /tmp/gpu_clock_experiment),
named after the device and the date (``h200-2026-12-01``): ``.csv`` and
``.png``, benchmark.py's rows of every configuration; ``-clocks.csv``, one
row per configuration (tokens/s, precision, clock, power, reasons, last
loss, status); ``-clock-samples.csv``, every sample decoded; and
``-experiment.log``, what the script printed. ``--continue-from DIR``
starts from files of the same names in DIR (the first call's, committed to
docs/benchmarks/), so the second call's files hold both.

Without a GPU (no ``nvidia-smi`` that answers): no sampling and no anchor,
each said in one line; ours runs without compilation and CUDA graphs, and
``--fp8`` in torchao's emulation (the test mode
``FAIRSEQ_MEGATRON_FP8_EMULATE=1``). With ``--shape tiny`` that checks the
script end to end in a few minutes on 2 cores; its figures mean nothing.
"""

import argparse
import csv
import datetime
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# nvidia-smi's clocks_event_reasons bits (nvidia-smi --help-query-gpu)
REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}
# the reasons that lower the clock under load, each a column of the -clocks.csv
WATCHED = {"sw_power_cap": 0x4, "hw_slowdown": 0x8, "thermal": 0x20 | 0x40, "power_brake": 0x80}
SAMPLE_MS = 200

CLOCK_FIELDS = [
    "date", "device", "part", "config", "status", "label", "impl", "shape", "precision", "updates",
    "tokens_per_s", "timed_s", "samples", "sm_mhz_mean", "sm_mhz_min", "power_w_mean", "temp_c_max",
    "share_sw_power_cap", "share_hw_slowdown", "share_thermal", "share_power_brake", "reasons",
    "last_update", "last_loss", "wall_s", "command",
]
SAMPLE_FIELDS = ["time", "config", "sm_mhz", "power_w", "temp_c", "event_reasons", "reasons"]

# Seconds per configuration before one of its part and kind has run, from
# the H200 timings of a whole benchmark.py run in docs/benchmarks.md (start,
# data, compilation, steps); float8 compiles more kernels.
PRIOR_S = {"clocks": 65, "fp8": 80, "loss": 70, "11b": 70}
PRIOR_TINY_S = 12  # a fresh fairseq-train on 2 CPU cores


@dataclass(frozen=True)
class Config:
    """One run of benchmark.py: ``kind`` ``ours`` or ``anchor``; ``flags``
    for benchmark.py beyond shape, updates and outputs; ``env`` the
    anchor's knobs."""

    part: str
    name: str
    shape: str
    kind: str
    flags: Tuple[str, ...] = ()
    env: Tuple[Tuple[str, str], ...] = ()
    updates: int = 30


def decode_reasons(mask: Optional[int]) -> List[str]:
    """The names of the bits set in an nvidia-smi clock-event-reasons mask
    (unknown bits as hex); [] for None."""
    if mask is None:
        return []
    names = [name for bit, name in REASONS.items() if mask & bit]
    unknown = mask & ~sum(REASONS)
    return names + ([hex(unknown)] if unknown else [])


def plan(parts, gpu: bool, shape: Optional[str] = None, updates: Optional[int] = None) -> List[Config]:
    """The configurations of ``parts`` in order (module docstring). On a GPU
    ours trains with bf16 autocast, the compiled stack and CUDA graphs
    (``--cuda-graphs`` left out where a configuration says so); without one,
    uncompiled. ``shape`` and ``updates`` override every part's."""
    compiled = ("--compile-layers", "--cuda-graphs") if gpu else ()
    no_graphs = ("--compile-layers",) if gpu else ()
    ours = ("--precision", "bf16-autocast")
    configs = []

    def add(part, name, default_shape, kind, flags=(), env=(), default_updates=30):
        configs.append(Config(part, name, shape or default_shape, kind, tuple(flags), tuple(env),
                              updates or default_updates))

    for part in parts:
        if part == "clocks":
            add(part, "anchor-old", "1p3b", "anchor", env=(("ANCHOR_INIT", "torch"), ("ANCHOR_DATA", "fixed")))
            add(part, "anchor", "1p3b", "anchor")
            add(part, "ours", "1p3b", "ours", ours + compiled)
            add(part, "ours-no-graphs", "1p3b", "ours", ours + no_graphs)
            add(part, "ours-gpt2-init", "1p3b", "ours", ours + compiled + ("--init", "gpt2",
                                                                        "--extra=--no-scale-embedding"))
        elif part == "loss":
            add(part, "ours-loss-bf16", "350m", "ours", ours + compiled, default_updates=200)
            add(part, "ours-loss-fp8-tensorwise", "350m", "ours", ours + compiled + ("--fp8", "tensorwise"),
                default_updates=200)
        elif part == "fp8":
            add(part, "anchor-bf16", "1p3b", "anchor")
            for recipe in ("tensorwise", "rowwise"):
                add(part, f"ours-fp8-{recipe}", "1p3b", "ours", ours + compiled + ("--fp8", recipe))
                add(part, f"anchor-fp8-{recipe}", "1p3b", "anchor", env=(("ANCHOR_FLOAT8", recipe),))
        elif part == "11b":
            add(part, "anchor", "11b_8layers", "anchor")
            add(part, "ours", "11b_8layers", "ours", ours + compiled)
            add(part, "ours-fp8-tensorwise", "11b_8layers", "ours", ours + compiled + ("--fp8", "tensorwise"))
            add(part, "anchor-fp8-tensorwise", "11b_8layers", "anchor", env=(("ANCHOR_FLOAT8", "tensorwise"),))
        else:
            raise ValueError(f"unknown part {part}")
    return configs


def log_interval(updates: int) -> int:
    """benchmark.py's interval for ``updates`` (as gpu_check.sh picks it):
    at least four intervals, so the median of the last three skips the first
    (start-up and compilation); 7 for 30 updates, 10 from 40 on."""
    return min(10, max(1, updates // 4))


def estimate_s(config: Config, finished: List[dict], tiny: bool) -> float:
    """Seconds ``config`` is expected to take: the longest finished run of
    its part and kind, else :data:`PRIOR_S` (:data:`PRIOR_TINY_S` for the
    tiny shape)."""
    same = [r["wall_s"] for r in finished if r["part"] == config.part and r["kind"] == config.kind]
    if same:
        return max(same)
    return PRIOR_TINY_S if tiny else PRIOR_S[config.part]


# ----------------------------------------------------------------- sampling


def query_nvidia_smi(fields: str) -> Optional[List[str]]:
    """One ``nvidia-smi --query-gpu`` of GPU 0, its values; None where
    nvidia-smi is missing or refuses the query."""
    if shutil.which("nvidia-smi") is None:
        return None
    proc = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", "0"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    return [v.strip() for v in proc.stdout.strip().splitlines()[0].split(",")]


class ClockSampler:
    """``nvidia-smi`` in loop mode (every :data:`SAMPLE_MS` ms) in the
    background; each line is stamped with the host clock when it arrives.
    ``reasons_field`` is ``clocks_event_reasons.active`` (drivers since
    2023) or the older ``clocks_throttle_reasons.active``, or None."""

    def __init__(self, reasons_field: Optional[str]):
        self.reasons_field = reasons_field
        self.samples: List[dict] = []
        self._proc = None
        self._thread = None

    def start(self) -> None:
        fields = "clocks.sm,power.draw,temperature.gpu" + (f",{self.reasons_field}" if self.reasons_field else "")
        self._proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", "0",
             "-lms", str(SAMPLE_MS)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            sample = parse_sample(line, time.time())
            if sample is not None:
                self.samples.append(sample)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait()
        if self._thread is not None:
            self._thread.join(timeout=5)


def parse_sample(line: str, when: float) -> Optional[dict]:
    """One line of the sampler (``MHz, W, C[, 0x...]``) -> a sample dict,
    None for a line that is not one; values nvidia-smi reports as N/A are
    None."""
    values = [v.strip() for v in line.split(",")]
    if len(values) < 3:
        return None

    def number(text, kind=float):
        try:
            return kind(text, 16) if kind is int else kind(text)
        except ValueError:
            return None

    sample = {"time": when, "sm_mhz": number(values[0]), "power_w": number(values[1]),
              "temp_c": number(values[2]), "mask": number(values[3], int) if len(values) > 3 else None}
    if sample["sm_mhz"] is None and sample["power_w"] is None:
        return None
    return sample


def summarize(samples: List[dict], window) -> dict:
    """Mean and minimum SM clock, mean power, peak temperature and each
    watched reason's share of the samples inside ``window`` (``[start,
    end]`` host clock); blank values where no sample falls inside."""
    inside = [s for s in samples if window and window[0] <= s["time"] <= window[1]]
    summary = {"samples": len(inside)}

    def values(key):
        return [s[key] for s in inside if s[key] is not None]

    clocks, power, temps = values("sm_mhz"), values("power_w"), values("temp_c")
    summary["sm_mhz_mean"] = round(sum(clocks) / len(clocks)) if clocks else ""
    summary["sm_mhz_min"] = round(min(clocks)) if clocks else ""
    summary["power_w_mean"] = round(sum(power) / len(power), 1) if power else ""
    summary["temp_c_max"] = round(max(temps)) if temps else ""
    masks = [s["mask"] for s in inside if s["mask"] is not None]
    for name, bits in WATCHED.items():
        summary[f"share_{name}"] = round(sum(bool(m & bits) for m in masks) / len(masks), 3) if masks else ""
    counts = {}
    for m in masks:
        for name in decode_reasons(m):
            counts[name] = counts.get(name, 0) + 1
    summary["reasons"] = ", ".join(f"{name} {n}/{len(masks)}" for name, n in counts.items()) or (
        "none" if masks else "")
    return summary


# ----------------------------------------------------------------- output


class Output:
    """The files of one device and date in ``directory``, and the log."""

    def __init__(self, directory: str, device_slug: str, date: str):
        self.directory = directory
        self.stem = os.path.join(directory, f"{device_slug}-{date}")
        self.csv, self.png = self.stem + ".csv", self.stem + ".png"
        self.clocks, self.samples = self.stem + "-clocks.csv", self.stem + "-clock-samples.csv"
        self.log_path = self.stem + "-experiment.log"

    def files(self):
        return [self.csv, self.png, self.clocks, self.samples, self.log_path]

    def say(self, text: str = "") -> None:
        print(text, flush=True)
        with open(self.log_path, "a") as f:
            f.write(text + "\n")


def read_rows(path: str) -> List[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_rows(path: str, fields: List[str], rows: List[dict]) -> None:
    """The whole CSV under a temporary name of its own, then renamed."""
    from fairseq_megatron.files import written_whole

    with written_whole(path) as partial, open(partial, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def device_slug(name: str) -> str:
    """``NVIDIA H200`` -> ``h200``, ``NVIDIA H100 80GB HBM3`` -> ``h100``."""
    words = name.lower().replace("nvidia", "").split()
    return words[0] if words else "gpu"


# ----------------------------------------------------------------- runs


def benchmark_command(config: Config, args, out: Output, record: str) -> List[str]:
    """The benchmark.py command line of ``config``."""
    cmd = [sys.executable, args.benchmark, "--shape", config.shape, "--updates", str(config.updates),
           "--log-interval", str(log_interval(config.updates)), "--work-dir", args.work_dir,
           "--csv", out.csv, "--png", out.png, "--record", record, "--label", f"[{config.part}/{config.name}]",
           *config.flags]
    if config.kind == "anchor":
        cmd += ["--only-anchor", "--with-anchor", args.anchor]
    return cmd


def run_config(config: Config, args, out: Output, gpu: bool) -> dict:
    """Run one configuration; its row of the -clocks.csv without the
    clock columns (``status`` ok, or failed with benchmark.py's last lines)."""
    record_path = os.path.join(args.work_dir, f"record-{config.part}-{config.name}.jsonl")
    if os.path.exists(record_path):
        os.remove(record_path)
    cmd = benchmark_command(config, args, out, record_path)
    env = dict(os.environ, **dict(config.env))
    if not gpu and "--fp8" in config.flags:
        env["FAIRSEQ_MEGATRON_FP8_EMULATE"] = "1"
    started = time.monotonic()
    # in the work dir: fairseq-train makes its --save-dir ("checkpoints") in the current directory, even unused
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          cwd=args.work_dir)
    with open(out.log_path, "a") as f:
        f.write(proc.stdout)
    row = {"part": config.part, "config": config.name, "kind": config.kind, "shape": config.shape,
           "updates": config.updates, "wall_s": round(time.monotonic() - started, 1),
           "command": " ".join([f"{k}={v}" for k, v in config.env] + cmd[1:])}
    records = [json.loads(line) for line in open(record_path)] if os.path.exists(record_path) else []
    if proc.returncode != 0 or not records:
        tail = " | ".join(proc.stdout.strip().splitlines()[-3:])
        return {**row, "status": f"failed (exit {proc.returncode}): {tail}"}
    record = records[-1]
    last = record["losses"][-1] if record["losses"] else ["", ""]
    return {**row, "status": "ok", "label": record["label"], "impl": record["impl"],
            "precision": record["precision"], "tokens_per_s": record["tokens_per_s"],
            "window": record["window"], "last_update": last[0], "last_loss": last[1],
            "timed_s": round(record["window"][1] - record["window"][0], 2) if record["window"] else ""}


def summary_lines(rows: List[dict]) -> List[str]:
    """A table per part (tokens/s, against the part's bf16 anchor and the
    anchor of the same precision, clock, power, reasons) and the loss
    comparison."""
    lines = []

    def ratio(a, b):
        return f"{a / b:.3f}" if b else ""

    for part in dict.fromkeys(r["part"] for r in rows):
        ran = [r for r in rows if r["part"] == part]
        # the part's anchors by precision (the old anchor is a variant, not the reference)
        anchors = {r["precision"]: float(r["tokens_per_s"]) for r in ran
                   if r.get("impl") == "anchor" and r["status"] == "ok" and r["config"] != "anchor-old"}
        lines += [f"{part}:", "| config | precision | tokens/s | / anchor bf16 | / anchor, same precision | SM MHz "
                              "| W | reasons (samples) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in ran:
            if r["status"] != "ok":
                lines.append(f"| {r['config']} | | {r['status']} | | | | | |")
                continue
            tps = float(r["tokens_per_s"])
            cells = [r["config"], r["precision"], f"{tps / 1e3:.1f}k", ratio(tps, anchors.get("bf16-autocast")),
                     ratio(tps, anchors.get(r["precision"])), r.get("sm_mhz_mean", ""), r.get("power_w_mean", ""),
                     r.get("reasons", "")]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    losses = {r["config"]: r for r in rows if r["part"] == "loss" and r["status"] == "ok" and r.get("last_loss") != ""}
    if "ours-loss-bf16" in losses and "ours-loss-fp8-tensorwise" in losses:
        bf16, fp8 = losses["ours-loss-bf16"], losses["ours-loss-fp8-tensorwise"]
        change = float(fp8["last_loss"]) / float(bf16["last_loss"]) - 1
        lines.append(f"loss at update {fp8['last_update']} (same seed): fp8 tensorwise {fp8['last_loss']} against "
                     f"bf16 {bf16['last_loss']}: {100 * change:+.2f}% (target: within 1%)")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="clocks,loss,fp8,11b",
                   help="comma-separated, run in this order: clocks, loss, fp8, 11b (default: all)")
    p.add_argument("--shape", choices=["tiny", "350m", "1p3b", "11b_8layers"],
                   help="every configuration at this shape instead of its part's (tiny: a check on any machine)")
    p.add_argument("--updates", type=int, help="every configuration's updates instead of its part's (30; loss: 200)")
    p.add_argument("--budget", type=float, help="seconds for the whole call: skip a configuration whose estimate no "
                                                "longer fits (default: run every one)")
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu_clock_experiment",
                   help="where the CSVs, the chart and the log go (default: $OUT, else /tmp/gpu_clock_experiment)")
    p.add_argument("--continue-from", metavar="DIR",
                   help="start from this device's and date's files in DIR (an earlier call's): the new rows follow")
    p.add_argument("--work-dir", default="/tmp/gpu_clock_experiment_work", help="benchmark.py's data and logs")
    p.add_argument("--anchor", default=os.path.join(REPO, ".gpu", "sdpa_gpt_anchor.py"),
                   help="the compiled minimal GPT (default: .gpu/sdpa_gpt_anchor.py, from gpu_check.sh --prepare)")
    p.add_argument("--benchmark", default=os.path.join(HERE, "benchmark.py"), help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    parts = [part for part in args.parts.split(",") if part]
    unknown = [part for part in parts if part not in PRIOR_S]
    if unknown or not parts:
        p.error(f"--parts {args.parts}: choose from {', '.join(PRIOR_S)}")
    if args.updates is not None and args.updates < 4:
        p.error("--updates must be at least 4 (the median of the last three of four or more log intervals)")
    if args.continue_from and not os.path.isdir(args.continue_from):
        p.error(f"--continue-from {args.continue_from}: no such directory")
    args.out, args.work_dir, args.anchor = map(os.path.abspath, (args.out, args.work_dir, args.anchor))
    for directory, flag in ((args.out, "--out"), (args.work_dir, "--work-dir")):
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            p.error(f"{flag} {directory}: {e.strerror}")

    name = query_nvidia_smi("name")
    gpu = name is not None
    if gpu and not os.path.isfile(args.anchor):
        p.error(f"--anchor {args.anchor}: no such file (bash scripts/gpu_check.sh --prepare puts the GPU kit's in .gpu/)")
    date = datetime.date.today().isoformat()
    out = Output(args.out, device_slug(name[0]) if gpu else "cpu", date)
    if args.continue_from:
        for path in out.files():
            earlier = os.path.join(args.continue_from, os.path.basename(path))
            if os.path.exists(earlier) and not os.path.exists(path):
                shutil.copyfile(earlier, path)
    start = time.monotonic()
    out.say(f"gpu_clock_experiment {date}: parts {', '.join(parts)} on {name[0] if gpu else 'the CPU'}"
            + (f", budget {args.budget:g} s" if args.budget else ""))
    configs = plan(parts, gpu, args.shape, args.updates)
    sampler = None
    if gpu:
        reasons_field = next((f for f in ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
                              if query_nvidia_smi(f) is not None), None)
        if reasons_field is None:
            out.say("nvidia-smi reports no clock-event reasons here: the reasons columns stay empty")
        sampler = ClockSampler(reasons_field)
        sampler.start()
    else:
        out.say("no GPU (no nvidia-smi that answers): no clock, power or clock-event-reason samples")
        out.say("no GPU: the anchor (the compiled minimal GPT) needs CUDA; its configurations are skipped")
        out.say("no GPU: ours runs uncompiled, --fp8 in torchao's emulation (FAIRSEQ_MEGATRON_FP8_EMULATE=1); "
                "the figures only show that the script runs")
    rows = read_rows(out.clocks)  # a continued call's earlier rows
    new_rows: List[dict] = []
    samples_of = {}
    try:
        for config in configs:
            row = {"date": date, "device": name[0] if gpu else "CPU", "part": config.part, "config": config.name,
                   "kind": config.kind, "shape": config.shape, "updates": config.updates}
            elapsed = time.monotonic() - start
            estimate = estimate_s(config, [r for r in new_rows if r["status"] == "ok"], config.shape == "tiny")
            if not gpu and config.kind == "anchor":
                row["status"] = "skipped: no GPU"
            elif args.budget and elapsed + estimate > args.budget:
                row["status"] = f"skipped: about {estimate:.0f} s to run, {args.budget - elapsed:.0f} s of the budget left"
            else:
                out.say(f"== {config.part}/{config.name}: {config.kind} at {config.shape}, {config.updates} updates "
                        f"(about {estimate:.0f} s; {elapsed:.0f} s in)")
                row.update(run_config(config, args, out, gpu))
                if sampler is not None and row.get("window"):
                    row.update(summarize(sampler.samples, row["window"]))
                    samples_of[f"{config.part}/{config.name}"] = row["window"]
            if row["status"] != "ok":
                out.say(f"== {config.part}/{config.name}: {row['status']}")
            else:
                out.say(f"== {config.part}/{config.name}: {float(row['tokens_per_s']):.0f} tokens/s "
                        f"({row['precision']}), {row['wall_s']} s"
                        + (f"; timed steps at {row['sm_mhz_mean']} MHz, {row['power_w_mean']} W, reasons: "
                           f"{row['reasons']}" if row.get("samples") else ""))
            new_rows.append(row)
            write_rows(out.clocks, CLOCK_FIELDS, rows + [{k: r.get(k, "") for k in CLOCK_FIELDS} for r in new_rows])
            if sampler is not None:
                write_samples(out.samples, sampler.samples, samples_of)
    finally:
        if sampler is not None:
            sampler.stop()
            write_samples(out.samples, sampler.samples, samples_of)
    out.say(f"== done in {time.monotonic() - start:.0f} s; files: "
            + ", ".join(os.path.basename(f) for f in out.files() if os.path.exists(f)))
    for line in summary_lines(new_rows):
        out.say(line)
    return 1 if any(r["status"].startswith("failed") for r in new_rows) else 0


def write_samples(path: str, samples: List[dict], windows: dict) -> None:
    """Every sample (the earlier ones of a continued file first), with its
    mask decoded and the configuration whose timed steps it falls in."""
    rows = []
    for s in samples:
        inside = next((name for name, w in windows.items() if w[0] <= s["time"] <= w[1]), "")
        rows.append({"time": f"{s['time']:.3f}", "config": inside, "sm_mhz": s["sm_mhz"], "power_w": s["power_w"],
                     "temp_c": s["temp_c"], "event_reasons": "" if s["mask"] is None else hex(s["mask"]),
                     "reasons": "+".join(decode_reasons(s["mask"]))})
    first = samples[0]["time"] if samples else float("inf")
    earlier = [r for r in read_rows(path) if float(r["time"]) < first]
    write_rows(path, SAMPLE_FIELDS, earlier + rows)


if __name__ == "__main__":
    sys.exit(main())
