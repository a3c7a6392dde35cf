"""fairseq-megatron-plan as a user runs it: the installed command, in its own
process (the in-process checks of the estimates are in tests/unit/test_planner.py)."""

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.common import REPO
from tests.helpers import ENV

PLAN = os.path.join(os.path.dirname(sys.executable), "fairseq-megatron-plan")


def plan(*args):
    return subprocess.run([PLAN, *args], capture_output=True, text=True, env=ENV, timeout=300)


def test_the_documented_plan_for_megatron_11b_on_two_nodes():
    proc = plan("--arch", "transformer_lm_megatron_11b", "--gpus", "16", "--gpus-per-node", "8", "--gpu-memory", "80",
                "--micro-batch", "2", "--global-batch", "512", "--precision", "memory-efficient-fp16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("model: 72 layers x 3072 hidden, 32 heads, FFN 18432")
    # every (TP, PP, DP) with TP * PP * DP = 16 and TP within a node of 8
    layouts = {tuple(int(x) for x in line.split()[:5]) for line in lines[2:] if line.split()[0].isdigit()}
    assert layouts and all(tp * pp * cp * dp == 16 and tp <= 8 and vp >= 1 for tp, pp, vp, cp, dp in layouts)
    # the recommendation docs/planning.md shows for this command
    with open(os.path.join(REPO, "docs", "planning.md")) as f:
        documented = [line for line in f.read().splitlines() if line.startswith("recommended: ")]
    assert lines[-1] == documented[0], lines[-1]


def test_json_rows_and_one_error_line():
    proc = plan("--arch", "transformer_lm_megatron_11b", "--gpus", "8", "--global-batch", "64", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    for row in out["layouts"]:
        assert row["predicted_step_seconds"] > 0 and row["predicted_tflops_per_gpu"] > 0

    proc = plan("--layers", "2", "--hidden", "70", "--heads", "4", "--gpus", "4", "--global-batch", "4")
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", "error: hidden 70 is not divisible by heads 4\n")


@pytest.mark.slow
def test_dry_run_of_the_first_and_last_stage_agrees_with_the_prediction():
    """``--dry-run`` at a small shape, T2 x P2 x D2 with two model chunks per
    stage (8 ranks, interleaved schedule, checkpointing): it builds rank 0
    (first stage) and rank 4 (the last stage's first) of a world of 8 and
    trains one step under fake tensors. Weights, gradients and optimizer
    state within 1% of the prediction (the same tensors: the layer norms'
    and biases' rounding in the shards is the rest); activations and the
    peak within 10% (the formula leaves out the layer norms' statistics and
    the small tensors of the model's ends; seen: 4%)."""
    proc = plan("--layers", "4", "--hidden", "256", "--heads", "8", "--seq-len", "256", "--vocab", "1024", "--gpus",
                "8", "--global-batch", "16", "--micro-batch", "2", "--tp", "2", "--pp", "2", "--vp", "2",
                "--precision", "fp32", "--checkpoint-activations", "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout)["dry_runs"]
    assert [(run["stage"], run["rank"], run["world_size"]) for run in runs] == [("first", 0, 8), ("last", 4, 8)]
    for run in runs:
        measured, predicted = run["measured"], run["predicted"]
        for kind in ("weights", "gradients", "optimizer"):
            assert abs(measured[kind] / predicted[kind] - 1) < 0.01, (run["stage"], kind, measured, predicted)
        for kind in ("activations", "peak"):
            assert abs(measured[kind] / predicted[kind] - 1) < 0.10, (run["stage"], kind, measured, predicted)
