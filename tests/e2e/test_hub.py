"""The Python hub interface (fairseq_megatron.hub) under torchrun."""

import os
import subprocess
import sys

import pytest

from tests.e2e.common import HUB_SCRIPT
from tests.helpers import ENV


@pytest.mark.parametrize("model_parallel_size", [2, 1])
def test_hub_interface_in_a_world_of_2(trained, tmp_path, model_parallel_size):
    """Two processes under torchrun: one model in two parts, or (size 1) a
    whole model on each rank, which failed to build before the plugin gave
    each rank a model-parallel group of one; at size 1 each rank merges the
    two part files in memory."""
    path = os.path.join(trained["ckpt"], "checkpoint_last.pt")
    script = str(tmp_path / "hub_script.py")
    out_dir = tmp_path / "hub_out"
    out_dir.mkdir()
    with open(script, "w") as f:
        f.write(HUB_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           script, path, trained["data"], str(out_dir), str(model_parallel_size)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    rank0 = (out_dir / "rank0.txt").read_text().splitlines()
    rank1 = (out_dir / "rank1.txt").read_text().splitlines()
    assert len(rank0) == 3 and rank0 == rank1  # greedy, beam and sampled text identical on both ranks
    assert all(l.startswith("size=2 ") and l.split(": ", 1)[1].startswith("return the") for l in rank0)
