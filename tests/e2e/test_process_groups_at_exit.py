"""No gloo thread outlives a tool's normal exit (parallel_state.release_process_groups).

A gloo worker thread that frees a finished collective's tensors while Python
finalizes aborts the process ("terminate called without an active
exception") after the tool's work is done. The groups must be gone, and
their threads joined, before that: the plugin's own, fairseq's cached
global group, and the world's group that torch's ``torch.distributed.nn``
functions keep as a default argument when imported during a run.
"""

import subprocess
import sys

from tests.e2e.common import GLOO_THREADS, train_args
from tests.helpers import ENV

# fairseq-train as a user runs it, with a report registered before anything of fairseq or the plugin is
# imported: atexit runs handlers last-in first-out, so it sees what is left as Python begins to finalize
SCRIPT = GLOO_THREADS + """

def report(moment):
    with open(os.path.join(OUT, f"threads{os.environ['RANK']}.txt"), "a") as f:
        print(f"{moment}: {gloo_threads()}", file=f)


OUT = sys.argv.pop(1)
atexit.register(report, "at exit")
from fairseq_cli.train import cli_main

sys.argv[0] = "fairseq-train"
cli_main()
report("after training")
"""


def test_fairseq_train_leaves_no_gloo_thread_at_exit(trained, tmp_path):
    script = tmp_path / "train_and_report.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    args = train_args(trained["data"], str(tmp_path / "ckpt"), max_update=2)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), str(out), *args],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "training on 2 devices" in proc.stdout, proc.stdout[-3000:]
    for rank in range(2):
        after_training, at_exit = (out / f"threads{rank}.txt").read_text().splitlines()
        # the threads existed while the groups did: the count below could have been otherwise
        assert int(after_training.split(": ")[1]) > 0 and at_exit == "at exit: 0", (rank, after_training, at_exit)
