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
    two part files in memory.

    At exit, before Python finalizes, no gloo thread is left although the
    script still holds the model: a gloo thread freeing a collective's
    tensors during finalization aborted the process now and then (SIGABRT
    after the last line)."""
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
    for rank in range(2):
        loaded, at_exit = (out_dir / f"threads{rank}.txt").read_text().splitlines()
        assert int(loaded.split(": ")[1]) > 0 and at_exit == "at exit: 0", (loaded, at_exit)


def test_hub_at_one_process_loads_pipeline_stage_files(trained, tmp_path):
    """A checkpoint of one model part in two pipeline stages (what
    fairseq-train writes at ``--pipeline-model-parallel-size 2``) loads in
    the hub of one process without torchrun, and its text is that of the
    same weights in one file (greedy, beam and seeded sampling): it ended in
    fairseq's "Model file not found" traceback, the stage files not being
    the file named."""
    from fairseq_megatron.checkpoint.resharding import reshard

    source = os.path.join(trained["ckpt"], "checkpoint_last.pt")
    texts = {}
    for name, stages in (("stages", 2), ("one", 1)):
        path = str(tmp_path / name / "checkpoint_last.pt")
        reshard(source, path, 1, new_stages=stages)
        out_dir = tmp_path / f"{name}_out"
        out_dir.mkdir()
        proc = subprocess.run([sys.executable, "-c", HUB_SCRIPT, path, trained["data"], str(out_dir), "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:]
        texts[name] = (out_dir / "rank0.txt").read_text().splitlines()
    assert sorted(os.listdir(tmp_path / "stages")) == ["checkpoint_last-model_part-0-stage-0.pt",
                                                       "checkpoint_last-model_part-0-stage-1.pt"]
    assert len(texts["one"]) == 3 and texts["stages"] == texts["one"], texts
