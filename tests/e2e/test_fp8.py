"""fairseq-train with ``--fp8`` as a user runs it on a machine without
float8: refused in one line before anything is written. (Training in the
test mode through fairseq-train runs in scripts/gpu_clock_experiment.py's
CPU check, docs/benchmarks.md; evaluation of an ``--fp8`` model without
torchao in tests/unit/test_float8.py.)"""

from tests import helpers
from tests.e2e.common import train_args
from tests.helpers import fairseq

EMULATE = "FAIRSEQ_MEGATRON_FP8_EMULATE"


def test_fp8_on_the_cpu_stops_fairseq_train_before_it_writes(trained, tmp_path, monkeypatch):
    monkeypatch.delitem(helpers.ENV, EMULATE, raising=False)
    save_dir = tmp_path / "never"
    args = train_args(trained["data"], str(save_dir), max_update=1)
    args[args.index("--model-parallel-size") + 1] = "1"
    rc, out = fairseq("train", args + ["--fp8"], check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == (
        "error: --fp8 needs a GPU with float8 matrix multiplies (compute capability 8.9 or newer: Ada, Hopper, "
        "Blackwell); this run is on the CPU"), out[-3000:]
    assert not save_dir.exists()
