"""scripts/gpu_clock_experiment.py end to end, in seconds: each
configuration's benchmark.py run is a stand-in that parses the command line
with benchmark.py's own parser (a flag the real script lacks fails) and
writes what benchmark.py writes (a CSV row, a ``--record`` line); where the
test plays a GPU, a stand-in ``nvidia-smi`` answers the queries and streams
samples. A real run of the script (``--shape tiny`` on a CPU, fairseq-train
for every configuration of ours) takes minutes on 2 cores: docs/benchmarks.md
records one."""

import csv
import datetime
import os
import stat
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "gpu_clock_experiment.py")

BENCHMARK_STAND_IN = """
import csv, json, os, sys, time
sys.path.insert(0, {scripts!r})
import benchmark

args = benchmark.build_parser().parse_args(sys.argv[1:])
gpu = os.environ.get("STAND_IN_GPU") == "1"
started = time.time()
time.sleep(0.2)  # the timed steps: the stand-in nvidia-smi samples every 20 ms meanwhile
if args.only_anchor:
    assert gpu and os.path.isfile(args.with_anchor), "the anchor ran without a GPU"
    impl, float8 = "anchor", os.environ.get("ANCHOR_FLOAT8")
    precision = f"fp8-{{float8}}" if float8 else "bf16-autocast"
    label = " ".join(["compiled minimal GPT", args.shape] + [f"{{k}}={{os.environ[k]}}" for k in benchmark.ANCHOR_KNOBS
                                                              if k in os.environ] + [args.label])
else:
    impl, precision = "megatron", benchmark.precision_label(args, "megatron", use_cuda=gpu)
    assert args.compile_layers == gpu, "ours compiles on a GPU only"
    label = f"ours {{args.shape}} {{precision}} {{args.label}}"
tokens_per_s = 1000.0 + (500 if impl == "anchor" else 0) + (250 if args.fp8 else 0)
losses = [[u, round(5.0 * (1.002 if args.fp8 else 1.0), 3)] for u in range(args.log_interval, args.updates + 1,
                                                                           args.log_interval)]
row = dict.fromkeys(benchmark.CSV_FIELDS, "")
row.update(label=label, impl=impl, shape=args.shape, precision=precision, tokens_per_s=tokens_per_s)
# what benchmark.write_csv and append_records write, without their import of the package (seconds a run)
rows = benchmark.read_csv_rows(args.csv) + [row]
with open(args.csv, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=benchmark.CSV_FIELDS)
    writer.writeheader()
    writer.writerows(rows)
with open(args.record, "a") as f:
    f.write(json.dumps({{"label": label, "impl": impl, "shape": args.shape, "precision": precision,
                        "tokens_per_s": tokens_per_s, "window": [started + 0.05, time.time()],
                        "losses": losses}}) + "\\n")
"""

# Answers the probes (name, clock-event reasons) and, in loop mode, a sample
# every 20 ms: 1700 or 1800 MHz, 650.5 W, 60 C, the software power cap always
# active and a hardware slowdown in every other sample.
NVIDIA_SMI_STAND_IN = """#!{python}
import sys, time
query = next(a for a in sys.argv if a.startswith("--query-gpu="))[len("--query-gpu="):]
if "-lms" not in sys.argv:
    print({{"name": "NVIDIA H200", "clocks_event_reasons.active": "0x0000000000000004"}}[query])
    sys.exit(0)
i = 0
while True:
    print(f"{{1700 + 100 * (i % 2)}}, 650.5, 60, {{hex(0x4 | (0x8 if i % 2 else 0))}}", flush=True)
    i += 1
    time.sleep(0.02)
"""


def _run(tmp_path, argv, gpu: bool):
    stand_in = tmp_path / "benchmark_stand_in.py"
    stand_in.write_text(BENCHMARK_STAND_IN.format(scripts=os.path.join(REPO, "scripts")))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    env = dict(os.environ, PATH=str(bin_dir), STAND_IN_GPU="1" if gpu else "0")  # no real nvidia-smi either way
    env.pop("FAIRSEQ_MEGATRON_FP8_EMULATE", None)
    if gpu:
        smi = bin_dir / "nvidia-smi"
        smi.write_text(NVIDIA_SMI_STAND_IN.format(python=sys.executable))
        smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
        anchor = tmp_path / "anchor.py"
        anchor.write_text("")
        argv = argv + ["--anchor", str(anchor)]
    proc = subprocess.run([sys.executable, SCRIPT, "--benchmark", str(stand_in), "--work-dir", str(tmp_path / "work"),
                           *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          timeout=120)
    return proc.returncode, proc.stdout


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_on_a_gpu_each_configuration_gets_its_clocks_power_and_decoded_reasons(tmp_path):
    """The clock and loss parts on a (stand-in) H200: every configuration
    runs in order with the flags and anchor knobs of its plan, its
    -clocks.csv row holds the samples of its timed window (mean clock,
    power, each watched reason's share: the power cap in every sample, a
    hardware slowdown in about half), every sample is decoded, the loss
    comparison is printed, and a second call under a budget continues the
    files, skipping what does not fit."""
    out = tmp_path / "out"
    rc, log = _run(tmp_path, ["--parts", "clocks,loss", "--shape", "tiny", "--out", str(out)], gpu=True)
    assert rc == 0, log[-3000:]
    stem = out / f"h200-{datetime.date.today().isoformat()}"
    rows = _rows(f"{stem}-clocks.csv")
    assert [(r["part"], r["config"], r["status"]) for r in rows] == [
        ("clocks", "anchor-old", "ok"), ("clocks", "anchor", "ok"), ("clocks", "ours", "ok"),
        ("clocks", "ours-no-graphs", "ok"), ("clocks", "ours-gpt2-init", "ok"),
        ("loss", "ours-loss-bf16", "ok"), ("loss", "ours-loss-fp8-tensorwise", "ok")]
    by_name = {r["config"]: r for r in rows}
    assert by_name["anchor-old"]["command"].startswith("ANCHOR_INIT=torch ANCHOR_DATA=fixed ")
    assert "--only-anchor" in by_name["anchor"]["command"] and "ANCHOR_" not in by_name["anchor"]["command"]
    assert "--compile-layers --cuda-graphs" in by_name["ours"]["command"]
    assert "--compile-layers" in by_name["ours-no-graphs"]["command"]
    assert "--cuda-graphs" not in by_name["ours-no-graphs"]["command"]
    assert "--init gpt2 --extra=--no-scale-embedding" in by_name["ours-gpt2-init"]["command"]
    assert [r["precision"] for r in rows] == ["bf16-autocast"] * 6 + ["fp8-tensorwise"]
    assert [r["updates"] for r in rows] == ["30"] * 5 + ["200"] * 2
    for r in rows:
        assert int(r["samples"]) >= 3, r  # 0.15 s of samples every 20 ms, on a loaded machine
        assert 1700 <= float(r["sm_mhz_mean"]) <= 1800 and r["sm_mhz_min"] == "1700"
        assert (r["power_w_mean"], r["temp_c_max"]) == ("650.5", "60")
        assert (r["share_sw_power_cap"], r["share_thermal"], r["share_power_brake"]) == ("1.0", "0.0", "0.0")
        assert 0 < float(r["share_hw_slowdown"]) < 1
        assert r["reasons"].startswith("sw_power_cap ")
    assert (by_name["ours-loss-fp8-tensorwise"]["last_update"], by_name["ours-loss-fp8-tensorwise"]["last_loss"]) \
        == ("200", "5.01")
    assert "loss at update 200 (same seed): fp8 tensorwise 5.01 against bf16 5.0: +0.20% (target: within 1%)" in log
    assert "| ours | bf16-autocast | 1.0k | 0.667 | 0.667 |" in log  # ours / the anchor's 1500 tokens/s
    samples = _rows(f"{stem}-clock-samples.csv")
    assert {s["reasons"] for s in samples} == {"sw_power_cap", "sw_power_cap+hw_slowdown"}
    assert {s["event_reasons"] for s in samples} == {"0x4", "0xc"}
    assert {s["config"] for s in samples} >= {"clocks/anchor-old", "loss/ours-loss-fp8-tensorwise"}
    assert len(_rows(f"{stem}.csv")) == 7  # benchmark.py's rows

    # the second call: its rows follow the first's; nothing of 11b fits 1 s
    rc, log = _run(tmp_path, ["--parts", "11b", "--shape", "tiny", "--budget", "1", "--out", str(tmp_path / "out2"),
                              "--continue-from", str(out)], gpu=True)
    assert rc == 0, log[-3000:]
    rows = _rows(f"{tmp_path / 'out2' / stem.name}-clocks.csv")
    assert [r["config"] for r in rows[7:]] == ["anchor", "ours", "ours-fp8-tensorwise", "anchor-fp8-tensorwise"]
    assert all(r["status"].startswith("skipped: about 12 s to run, ") for r in rows[7:])
    assert not os.path.exists(tmp_path / "work" / "record-11b-ours.jsonl")


def test_without_a_gpu_the_anchor_is_skipped_and_float8_emulated(tmp_path):
    """No nvidia-smi: one line each for the samples and the anchor left
    out, the anchor's rows skipped, ours uncompiled and its ``--fp8`` in
    torchao's emulation (the stand-in sees the test mode)."""
    out = tmp_path / "out"
    rc, log = _run(tmp_path, ["--parts", "fp8", "--shape", "tiny", "--out", str(out)], gpu=False)
    assert rc == 0, log[-3000:]
    assert "no GPU (no nvidia-smi that answers): no clock, power or clock-event-reason samples" in log
    assert "no GPU: the anchor (the compiled minimal GPT) needs CUDA; its configurations are skipped" in log
    stem = out / f"cpu-{datetime.date.today().isoformat()}"
    rows = _rows(f"{stem}-clocks.csv")
    assert [(r["config"], r["status"], r["precision"]) for r in rows] == [
        ("anchor-bf16", "skipped: no GPU", ""), ("ours-fp8-tensorwise", "ok", "fp8-tensorwise-emulated"),
        ("anchor-fp8-tensorwise", "skipped: no GPU", ""), ("ours-fp8-rowwise", "ok", "fp8-rowwise-emulated"),
        ("anchor-fp8-rowwise", "skipped: no GPU", "")]
    assert all("--compile-layers" not in r["command"] and r["samples"] == "" for r in rows)
    assert not os.path.exists(f"{stem}-clock-samples.csv")
