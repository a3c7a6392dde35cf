"""scripts/parallelism_ablation.py as a user runs it, on two of its rows
(``--cpu --quick --rows baseline CP2``; docs/benchmarks.md has the run of
all rows): the table, the CSV and the PNG.

The two rows train the same model on the same batches with dropout 0.1,
whose masks differ between one rank and two context-parallel ranks (the
draws fall on other positions), so their losses differ by a little: within
1% of the baseline's, the issue's bound for every row (seen: 0.1%). The
CP2 row's ranks each hold the activations of half of every sequence, and
the baseline's attention on CPU keeps its probabilities for the dropout
backward, so each CP2 rank keeps less than the baseline's activations and
peak (seen: a quarter and a third).
"""

import csv
import subprocess
import sys

import pytest

from tests.e2e.common import REPO
from tests.helpers import ENV

pytestmark = pytest.mark.slow


def test_two_rows_print_write_and_plot(tmp_path):
    csv_path, png_path = tmp_path / "ablation.csv", tmp_path / "ablation.png"
    run = subprocess.run([sys.executable, f"{REPO}/scripts/parallelism_ablation.py", "--cpu", "--quick", "--rows",
                          "baseline", "CP2", "--iterations", "3", "--csv", str(csv_path), "--png", str(png_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:]
    with open(csv_path) as f:
        rows = {r["layout"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["baseline", "CP2"]
    baseline, context = rows["baseline"], rows["CP2"]
    assert (baseline["world_size"], context["world_size"]) == ("1", "2")  # each rank checked its sizes
    assert baseline["status"] == context["status"] == "ok"
    assert baseline["rank1_peak_mib"] == "" and float(context["rank1_peak_mib"]) > 0
    assert abs(float(context["loss"]) - float(baseline["loss"])) <= 0.01 * float(baseline["loss"])
    for r in range(2):
        assert float(context[f"rank{r}_activations_mib"]) < float(baseline["rank0_activations_mib"])
        assert float(context[f"rank{r}_parameters_mib"]) == float(baseline["rank0_parameters_mib"])  # not split by C
    assert float(context["peak_memory_mib"]) < float(baseline["peak_memory_mib"])
    assert float(baseline["iteration_ms"]) > 0 and float(context["iteration_ms"]) > 0
    # a process's CPU time in an update: the baseline's one thread cannot spend more than the update's time
    assert 0 < float(baseline["cpu_ms"]) <= 1.05 * float(baseline["iteration_ms"]) and float(context["cpu_ms"]) > 0
    table = run.stdout[run.stdout.index("layout    ranks"):].splitlines()
    assert [line.split()[0] for line in table[1:3]] == ["baseline", "CP2"]
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png_path.stat().st_size > 10_000
    # the planner's prediction beside each measured time, and where the answers are
    assert float(baseline["predicted_ms"]) > 0 and float(context["predicted_ms"]) > 0
    assert run.stdout.splitlines()[-1] == (f"written: {csv_path} (one line per row), {png_path} (the chart); where "
                                           f"each layout splits the model and why memory is uneven across ranks: "
                                           f"docs/benchmarks.md#parallelism-ablation")
