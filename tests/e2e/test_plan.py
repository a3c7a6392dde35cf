"""fairseq-megatron-plan as a user runs it: the installed command, in its own
process (the in-process checks of the estimates are in tests/unit/test_planner.py)."""

import json
import os
import subprocess
import sys

from tests.helpers import ENV

PLAN = os.path.join(os.path.dirname(sys.executable), "fairseq-megatron-plan")


def plan(*args):
    return subprocess.run([PLAN, *args], capture_output=True, text=True, env=ENV, timeout=120)


def test_the_documented_plan_for_megatron_11b_on_two_nodes():
    proc = plan("--arch", "transformer_lm_megatron_11b", "--gpus", "16", "--gpus-per-node", "8", "--gpu-memory", "80",
                "--micro-batch", "2", "--global-batch", "512", "--precision", "memory-efficient-fp16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("model: 72 layers x 3072 hidden, 32 heads, FFN 18432")
    # every (TP, PP, DP) with TP * PP * DP = 16 and TP within a node of 8
    layouts = {tuple(int(x) for x in line.split()[:3]) for line in lines[2:] if line.split()[0].isdigit()}
    assert layouts and all(tp * pp * dp == 16 and tp <= 8 for tp, pp, dp in layouts)
    # the recommendation documented in docs/planning.md: no pipeline stage, one model-parallel rank, sharded
    assert lines[-1] == (
        "recommended: fully sharded data parallelism fits TP=1, PP=1, DP=16 (31.7 GB per GPU), fewer "
        "model-parallel ranks than TP=2, PP=1 without it (78.2 GB per GPU) (fairseq-train --model-parallel-size 1 "
        "--ddp-backend fully_sharded)"), lines[-1]


def test_json_rows_and_one_error_line():
    proc = plan("--arch", "transformer_lm_megatron_11b", "--gpus", "8", "--global-batch", "64", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)

    proc = plan("--layers", "2", "--hidden", "70", "--heads", "4", "--gpus", "4", "--global-batch", "4")
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", "error: hidden 70 is not divisible by heads 4\n")
