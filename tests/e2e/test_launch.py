"""How fairseq's tools start their processes: fairseq's own spawn, SLURM,
torchrun, world sizes the model-parallel size does not divide. The launches
tested are fresh interpreters (not forked from :mod:`tests.preloaded`): the
start-up is what these tests are about; the runs they are compared with are
forked."""

import functools
import os
import signal
import subprocess
import sys
import time

import pytest

from fairseq_megatron import USER_DIR
from tests import helpers
from tests.e2e.common import eval_args, eval_loss, evaluated_tokens, hypotheses, per_update, train_args
from tests.helpers import ENV, free_port

fairseq = functools.partial(helpers.fairseq, preloaded=False)
# runs whose start-up is not what the test is about (the runs a launch is compared with, refusals that
# come after the launch): forked from tests.preloaded as the other end-to-end tests' are
forked = helpers.fairseq


def _under_slurm(tmp_path, args, nodes, tasks_per_node):
    """Run ``fairseq-train args`` as SLURM would start it on ``nodes`` x
    ``tasks_per_node`` tasks, all on this machine: SLURM's variables per
    task, and an ``scontrol`` that names this machine as the first node.
    Returns each task's (rc, output), in SLURM_PROCID order."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")  # fairseq runs: scontrol show hostnames
    (bin_dir / "scontrol").chmod(0o755)
    port = free_port()
    tasks, logs = [], []
    for node in range(nodes):
        for local in range(tasks_per_node):
            env = dict(ENV, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_NODELIST=f"node[1-{nodes}]",
                       SLURM_NNODES=str(nodes), SLURM_NTASKS_PER_NODE=str(tasks_per_node), SLURM_NODEID=str(node),
                       SLURM_PROCID=str(node * tasks_per_node + local), SLURM_LOCALID=str(local))
            logs.append(tmp_path / f"slurm-task-{len(logs)}.log")
            with open(logs[-1], "w") as log:
                tasks.append(subprocess.Popen([sys.executable, "-m", "fairseq_cli.train", *args, "--distributed-port",
                                               str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
    deadline = time.monotonic() + 300
    while None in (codes := [task.poll() for task in tasks]):
        if time.monotonic() > deadline or any(codes):
            for task in tasks:  # as srun does: one task failed, the others would wait for it
                if task.poll() is None:
                    os.killpg(task.pid, signal.SIGKILL)  # with the processes it spawned
        time.sleep(0.1)
    return [(task.returncode, log.read_text()) for task, log in zip(tasks, logs)]


@pytest.mark.minutes
def test_fairseq_spawning_its_processes(trained, tmp_path):
    """Without torchrun fairseq starts the processes itself
    (``torch.multiprocessing.spawn``), as ``fairseq-train
    --distributed-world-size 8`` does on a GPU machine, and under SLURM. Those
    processes imported fairseq afresh and looked for the mpu module before
    fairseq imported the user dir: "Please install the megatron submodule"
    (and on CPU fairseq spawned no process: one per GPU). Spawned at world
    size 2, the run logs the same losses as the fixture's torchrun run (same
    seed, data and per-rank dropout streams: the same computation, so the
    same printed values); fairseq-eval-lm (with two data-parallel groups)
    prints the loss, and fairseq-generate the hypotheses, that torchrun's
    processes print;
    fairseq-interactive answers prompts from ``--input``, and from standard
    input, which the launching process passes on to rank 0. A bad
    input in the spawned processes is one line each, and the launching
    process reports their exit."""
    def launch(world_size=2):
        return ["--distributed-world-size", str(world_size), "--distributed-init-method",
                f"tcp://127.0.0.1:{free_port()}", "--distributed-backend", "gloo"]

    _, log = fairseq("train", train_args(trained["data"], str(tmp_path / "spawned"), max_update=4) + launch())
    assert "training on 2 devices" in log and "torch.distributed.run" not in log, log[-3000:]
    expected = per_update(trained["first_log"], "loss")
    assert len(expected) == 4 and per_update(log, "loss") == expected, (per_update(log, "loss"), expected)
    assert sorted(os.listdir(tmp_path / "spawned")) == [
        "checkpoint_last-model_part-0.pt", "checkpoint_last-model_part-1.pt", "checkpoint_last.pt.manifest.json"]
    # fairseq-eval-lm (docs/evaluation.md's command for the published model spawns 8), here with two
    # data-parallel groups (the 2 parts read at size 1 by each): the plugin's tally over the groups must
    # reach the spawned processes too
    path = str(tmp_path / "spawned" / "checkpoint_last.pt")
    _, spawned = fairseq("eval_lm", eval_args(trained["data"], path, 1) + launch(world_size=2))
    _, torchrun = forked("eval_lm", eval_args(trained["data"], path, 2), nproc=2)
    assert spawned.count("Loss (base 2)") == 1, spawned[-3000:]
    assert f"2 data-parallel groups scored {evaluated_tokens(torchrun):,} tokens together" in spawned, spawned[-3000:]
    # 4 printed decimals; fp32 sums in another order across the groups
    assert abs(eval_loss(spawned) - eval_loss(torchrun)) <= 2e-4, (eval_loss(spawned), eval_loss(torchrun))
    # fairseq-generate: greedy, the same hypotheses as under torchrun, each printed once
    generate = [trained["data"], "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling", "--path", path,
                "--gen-subset", "test", "--sample-break-mode", "none", "--tokens-per-sample", "32",
                "--prefix-size", "2", "--max-len-b", "12", "--batch-size", "8", "--beam", "1",
                "--model-parallel-size", "2"]
    spawned = hypotheses(fairseq("generate", generate + launch())[1])
    assert len(spawned) >= 10 and spawned == hypotheses(forked("generate", generate, nproc=2)[1])
    # fairseq-interactive: spawned processes get /dev/null as standard input (upstream it answered
    # nothing, exit 0); the launching process passes its standard input on to rank 0
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("return the value\n")
    interactive = [trained["data"], "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling", "--path", path,
                   "--tokens-per-sample", "32", "--max-len-b", "8", "--beam", "1", "--model-parallel-size", "2"]
    _, piped = fairseq("interactive", interactive + launch(), stdin="return the\nis the\n")
    _, torchrun = forked("interactive", interactive, nproc=2, stdin="return the\nis the\n")
    assert "as rank 1" in piped and sorted(hypotheses(piped)) == ["H-0", "H-1"], piped[-3000:]
    assert hypotheses(piped) == hypotheses(torchrun)
    _, log = fairseq("interactive", interactive + launch() + ["--input", str(prompts)])
    assert [line.split("\t")[0] for line in log.splitlines() if line.startswith("H-")] == ["H-0"], log[-3000:]

    part = os.path.join(trained["ckpt"], "checkpoint_last-model_part-0.pt")
    args = train_args(trained["data"], str(tmp_path / "refused"), max_update=4) + launch()
    rc, log = fairseq("train", args + ["--finetune-from-model", part], check=False)
    line = (f"error: --finetune-from-model {part} is one of 2 model part files: pass the checkpoint's name, "
            f"--finetune-from-model {os.path.join(trained['ckpt'], 'checkpoint_last.pt')}")
    assert rc == 1 and line in log and "Traceback" not in log, log[-3000:]
    assert log.rstrip().splitlines()[-1].startswith("error: process "), log[-3000:]


def test_fairseq_train_under_slurm(trained, tmp_path):
    """fairseq reads SLURM's variables itself (``srun fairseq-train ...
    --distributed-port P``, no torchrun). One task per process, 2 on one
    node: the same losses as the fixture's torchrun run (the same
    computation); on a machine without GPUs fairseq set the task's device
    to SLURM_LOCALID and task 1 failed in ``torch.cuda.set_device``. One task
    per node, as docs/training.md's SLURM command runs: 2 nodes spawning 2 processes each
    (world size 4, two data-parallel groups at model-parallel size 2), the
    same losses as torchrun with 4 processes; on CPU fairseq counted each
    node's GPUs, none, so it spawned nothing and exited 0 with nothing
    trained. A world size that the nodes do not divide is one error line."""
    args = train_args(trained["data"], str(tmp_path / "per-process"), max_update=4) + ["--distributed-world-size", "2"]
    (rc0, log), (rc1, other) = _under_slurm(tmp_path, args, nodes=1, tasks_per_node=2)
    assert rc0 == rc1 == 0 and "training on 2 devices" in log, (log + other)[-3000:]
    expected = per_update(trained["first_log"], "loss")
    assert len(expected) == 4 and per_update(log, "loss") == expected, (per_update(log, "loss"), expected)

    args = train_args(trained["data"], str(tmp_path / "per-node"), max_update=4)
    [(rc0, log), (rc1, other)] = _under_slurm(tmp_path, args + ["--distributed-world-size", "4"], 2, 1)
    assert rc0 == rc1 == 0 and "training on 4 devices" in log, (log + other)[-3000:]
    _, torchrun = forked("train", train_args(trained["data"], str(tmp_path / "torchrun"), max_update=4), nproc=4)
    expected = per_update(torchrun, "loss")
    assert len(expected) == 4 and per_update(log, "loss") == expected, (per_update(log, "loss"), expected)
    assert sorted(os.listdir(tmp_path / "per-node")) == [
        "checkpoint_last-model_part-0.pt", "checkpoint_last-model_part-1.pt", "checkpoint_last.pt.manifest.json"]

    line = ("error: --distributed-world-size 3 is not divisible by the 2 SLURM nodes (one task per node spawns "
            "the same number on each)")
    ended = _under_slurm(tmp_path, args + ["--distributed-world-size", "3"], 2, 1)  # the first to fail stops both
    assert all(rc for rc, _ in ended) and any(rc == 1 and log.rstrip().splitlines()[-1] == line
                                              for rc, log in ended), ended


def test_world_size_not_divisible_by_model_parallel_size(trained, tmp_path):
    """Refused before fairseq-train writes anything: the save dir is not
    created (the one-process case created it, empty, before fairseq-train's main checked the launch)."""
    save_dir = tmp_path / "never"
    args = train_args(trained["data"], str(save_dir), max_update=1)
    rc, out = forked("train", args, nproc=3, check=False)
    assert rc != 0
    assert "[rank0]: error: world size 3 is not divisible by --model-parallel-size 2" in out, out[-3000:]
    assert not save_dir.exists()
    # one process, no launcher (the commonest slip): it said the model's size differed from the group's
    rc, out = forked("train", args, check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == (
        "error: --model-parallel-size 2 needs 2 processes, one per model part, and this run is one process: "
        "launch it with torchrun --nproc_per_node 2 (or give fairseq --distributed-world-size 2 on a machine "
        "with 2 GPUs)"), out[-3000:]
    assert not save_dir.exists()


def _alive(pid):
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _children(pid):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's parent-death signal")
def test_ranks_end_when_their_torchrun_is_killed(trained, tmp_path):
    """torchrun killed with SIGKILL (an out-of-memory kill, a job
    scheduler's hard stop) cannot stop its ranks; they trained on and wrote
    checkpoints. Each rank of a run of our models now asks Linux to kill it
    when its launcher dies: both are gone within seconds."""
    args = train_args(trained["data"], str(tmp_path / "run"), max_update=100_000) + ["--no-save"]
    log = tmp_path / "torchrun.log"
    with open(log, "w") as out:
        torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                     "--nproc_per_node", "2", "-m", "fairseq_cli.train", *args],
                                    stdout=out, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    ranks = []
    try:
        deadline = time.monotonic() + 180
        while "num_updates" not in log.read_text():  # both ranks are training
            assert torchrun.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        ranks[:] = _children(torchrun.pid)  # each in a session of its own (torchrun starts them so)
        assert len(ranks) == 2, ranks
        torchrun.kill()
        torchrun.wait()
        deadline = time.monotonic() + 20
        while any(map(_alive, ranks)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, ranks)), "ranks still running after their torchrun was killed"
    finally:
        for group in [torchrun.pid, *ranks]:  # whatever is left
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
