"""scripts/benchmark.py on CPU: the tiny shape at model-parallel size 2 with
sequence parallelism, activation checkpointing and bf16 autocast, against fairseq's own
transformer_lm, through unmodified fairseq-train (torchrun, gloo), then
fairseq-eval-lm with a context window on each checkpoint; and
scripts/benchmark_model_loading.py on a tiny checkpoint."""

import csv
import os
import re
import subprocess
import sys

from tests.helpers import ENV

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Stands in for ../shared/gpu/sdpa_gpt_anchor.py (which needs a GPU): same
# bench() signature and output line, and the same closing loop over all
# shapes, which must not run.
FAKE_ANCHOR = """
def bench(name, L, d, h, f, compile_=False, steps=30, B=8, T=1024):
    assert compile_, "the anchor must be timed compiled"
    print(f"{name} compiled: 1M params, {L * 1000 + d}.0 tokens/s, 0 TFLOP/s, peak mem {B + T / 1000} GiB")

for c in (False, True):
    raise SystemExit("the loop over every shape ran")
"""


def test_tiny_benchmark_writes_csv_and_png(tmp_path):
    out_csv, out_png = str(tmp_path / "bench.csv"), str(tmp_path / "bench.png")
    anchor = tmp_path / "fake_anchor.py"
    anchor.write_text(FAKE_ANCHOR)
    cmd = [sys.executable, os.path.join(REPO, "scripts", "benchmark.py"), "--shape", "tiny",
           "--model-parallel-size", "2", "--sequence-parallel", "--checkpoint-activations",
           "--precision", "bf16-autocast", "--with-fairseq", "--updates", "9", "--log-interval", "3",
           "--eval-lm-tokens", "2000", "--context-window", "48", "--with-anchor", str(anchor),
           "--work-dir", str(tmp_path / "work"), "--csv", out_csv, "--png", out_png]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "ours / fairseq:" in proc.stdout and "ours / compiled minimal GPT:" in proc.stdout

    with open(out_csv) as f:
        ours, theirs, gpt = list(csv.DictReader(f))
    # the anchor ran once, for the tiny shape (2 layers, hidden 64, batch 4 x 64 tokens)
    assert gpt["impl"] == "anchor" and float(gpt["tokens_per_s"]) == 2064.0
    assert float(gpt["peak_mem_gib"]) == 4.064
    assert (ours["impl"], ours["model_parallel_size"], ours["world_size"]) == ("megatron", "2", "2")
    assert (theirs["impl"], theirs["model_parallel_size"], theirs["world_size"]) == ("fairseq", "1", "1")
    assert "--sequence-parallel" in ours["command"] and "--checkpoint-activations" in ours["command"]
    # bf16 autocast is ours alone; fairseq's transformer_lm has no such path (fp32 on CPU)
    assert (ours["precision"], theirs["precision"]) == ("bf16-autocast", "fp32")
    assert "--bf16-autocast" in ours["command"] and "--bf16-autocast" not in theirs["command"]
    # Same shape and padded vocabulary (1004 symbols -> 1008 at both sizes):
    # the benchmark checked its count against fairseq's log at size 1.
    assert ours["params"] == theirs["params"]
    for row in (ours, theirs):
        tokens_per_s, params = float(row["tokens_per_s"]), int(row["params"])
        assert tokens_per_s > 0 and float(row["peak_mem_gib"]) > 0
        flops_per_token = 6 * params + 12 * 2 * 64 * 64  # tiny: 2 layers, hidden 64, 64 tokens
        assert abs(float(row["model_tflops"]) - tokens_per_s * flops_per_token / 1e12) < 1e-5
    # fairseq-eval-lm ran on each trained checkpoint and scored the same tokens
    assert int(ours["eval_lm_tokens"]) == int(theirs["eval_lm_tokens"]) > 1900
    assert float(ours["eval_lm_tokens_per_s"]) > 0 and float(theirs["eval_lm_tokens_per_s"]) > 0
    with open(out_png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_loading_benchmark_runs_both_ways_on_a_tiny_shape(tmp_path):
    """scripts/benchmark_model_loading.py (its numbers are in docs/benchmarks.md)
    still runs: a tiny checkpoint, loaded once with the initial weights
    drawn and once skipped, each in its own process."""
    script = os.path.join(REPO, "scripts", "benchmark_model_loading.py")
    proc = subprocess.run([sys.executable, script, "--work-dir", str(tmp_path), "--layers", "1", "--hidden", "64",
                           "--heads", "4", "--ffn", "128", "--vocab", "64", "--repeats", "1"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert re.search(r"load 1, initial weights drawn: [0-9.]+ s\nload 1, initial weights skipped: [0-9.]+ s\n"
                     r"median: drawn [0-9.]+ s, skipped [0-9.]+ s", proc.stdout), proc.stdout
    assert sorted(os.listdir(tmp_path)) == ["dict.txt", "model.pt"]  # no temporary file left

    # --fairseq-train: fairseq-train resuming from it; the script checks that
    # the skipped way logged the trainer's line and the drawn way did not
    proc = subprocess.run([sys.executable, script, "--work-dir", str(tmp_path), "--layers", "1", "--hidden", "64",
                           "--heads", "4", "--ffn", "128", "--vocab", "64", "--repeats", "1", "--fairseq-train"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert re.search(r"median: drawn [0-9.]+ s, skipped [0-9.]+ s .*, fairseq-train's build and load",
                     proc.stdout), proc.stdout
    assert sorted(os.listdir(tmp_path)) == ["dict.txt", "model.pt"]  # its save dir removed
