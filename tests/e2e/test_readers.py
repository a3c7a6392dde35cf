"""Readers never write, as users run the tools: a checkpoint on a
read-only file system, left by a save that a kill interrupted, is
evaluated, resharded, exported and fine-tuned from; readers beside a
training that saves every update read whole saves and never disturb it;
every class the files hold is one the loader allows; a file that would run
code is refused by fairseq-eval-lm. And the writer: one fairseq-train per
``--save-dir`` (a lock the kernel drops when the run is killed), a
read-only ``--save-dir`` in one line; a missing last stage named by
eval-lm, generate and train; fairseq's own impossible numbers in one line."""

import fcntl
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from fairseq_megatron import USER_DIR
from fairseq_megatron.checkpoint import safe_loading
from fairseq_megatron.checkpoint.commit import manifest_path, read_manifest
from fairseq_megatron.checkpoint.part_files import part_path, stage_path
from fairseq_megatron.checkpoint.resharding import PartFiles, model_part, reshard
from fairseq_megatron.checkpoint.names import staged_name
from tests.e2e.common import eval_args, eval_loss, train_args
from tests.helpers import ENV, fairseq
from tests.support.files import file_contents

pytestmark = pytest.mark.slow


def _digest(state_dict):
    """One hash of a state dict's tensors, key by key."""
    h = hashlib.blake2b(digest_size=16)
    for key, tensor in state_dict.items():
        if not key.endswith("_float_tensor"):  # fairseq's uninitialised buffer, not a weight
            h.update(key.encode())
            h.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_a_read_only_checkpoint_left_by_a_killed_save_is_evaluated_resharded_exported_and_fine_tuned(
        trained, tmp_path):
    """The trained checkpoint (2 parts, committed) as a kill after its
    commit point leaves it (part 1 under its staged name), in a directory
    mounted read-only for each tool. Readers completed the renames, and
    failed here with "cannot complete the save of ...: Read-only file
    system". Now fairseq-eval-lm (at the saved size, and at size 1), the
    resharding tool, both exports and fine-tuning read it as it is, with
    the same results as from the original files."""
    source = tmp_path / "shared"
    shutil.copytree(trained["ckpt"], source)
    path = str(source / "checkpoint_last.pt")
    token = read_manifest(path)["token"]
    os.replace(part_path(path, 1), staged_name(part_path(path, 1), token))
    before = file_contents(source)
    out = tmp_path / "out"
    out.mkdir()

    # at --model-parallel-size 2 eval-lm refuses one process: its loss is of two
    _, at_2 = fairseq("eval_lm", eval_args(trained["data"], path, 2), nproc=2, read_only=[source])
    _, at_1 = fairseq("eval_lm", eval_args(trained["data"], path, 1), read_only=[source])
    assert abs(eval_loss(at_1) - eval_loss(at_2)) <= 2e-4  # 4 printed decimals; fp32 sums in another order
    reshard_tool = "fairseq_megatron.cli.reshard_checkpoint"
    fairseq(reshard_tool, ["--input", path, "--output", str(out / "one.pt"), "--model-parallel-size", "1"],
            read_only=[source])
    fairseq(reshard_tool, ["--input", path, "--output", str(out / "plain.pt"), "--to-fairseq"], read_only=[source])
    fairseq(reshard_tool, ["--input", path, "--output", str(out / "hf"), "--to-hf"], read_only=[source])
    _, log = fairseq("train", train_args(trained["data"], str(out / "tuned"), max_update=1) + [
        "--finetune-from-model", path], nproc=2, read_only=[source])
    assert f"fine-tuning from {path}" in log and "training on 2 devices" in log and "done training" in log, \
        log[-3000:]
    assert file_contents(source) == before
    original = PartFiles(os.path.join(trained["ckpt"], "checkpoint_last.pt"))
    assert _digest(torch.load(out / "one.pt", weights_only=False)["model"]) == _digest(
        model_part(original, 0, 1, check_replicas=True, progress=None))
    assert sorted(os.listdir(out / "hf"))[:2] == ["README.md", "config.json"]


def test_fairseq_train_resumes_from_a_save_a_kill_left_unfinished(trained, tmp_path):
    """A fine-tuning run killed after its last save's commit point, before
    rank 1's rename, started again with its command: rank 1's part is only
    under its staged name, so fairseq alone would take it for a first launch
    there and fine-tune that rank afresh (it looks for the final name) while
    rank 0 resumes. Every rank resumes from that save, reading it as it is, and the
    run's next save replaces it: final names, one token, no staged file,
    and the weights of the same run resumed from the save whole (bitwise:
    the same updates from the same state; rank 1 afresh would differ)."""
    save_dir, whole = tmp_path / "ckpt", tmp_path / "whole"
    shutil.copytree(trained["ckpt"], save_dir)
    shutil.copytree(trained["ckpt"], whole)
    path = str(save_dir / "checkpoint_last.pt")
    token = read_manifest(path)["token"]
    os.replace(part_path(path, 1), staged_name(part_path(path, 1), token))
    for directory in (save_dir, whole):  # a fine-tuning job's command, run again: it resumes once it has saved
        _, log = fairseq("train", train_args(trained["data"], str(directory), max_update=5) + [
            "--finetune-from-model", os.path.join(trained["ckpt"], "checkpoint_last.pt")], nproc=2)
        assert "training on 2 devices" in log and "(epoch 1 @ 4 updates)" in log and "num_updates=5," in log, \
            log[-3000:]
    for rank in (0, 1):
        ours, reference = (torch.load(part_path(str(d / "checkpoint_last.pt"), rank), weights_only=False)["model"]
                           for d in (save_dir, whole))
        assert _digest(ours) == _digest(reference), rank
    assert sorted(os.listdir(save_dir)) == ["checkpoint_last-model_part-0.pt", "checkpoint_last-model_part-1.pt",
                                            "checkpoint_last.pt.manifest.json"]
    saved = read_manifest(path)
    assert saved["updates"] == 5 and [torch.load(part_path(path, r), weights_only=False)["extra_state"]["save"]
                                      for r in (0, 1)] == [{"token": saved["token"], "updates": 5}] * 2


def test_readers_beside_a_training_that_saves_every_update(trained, tmp_path):
    """fairseq-train at size 2 saving every update (an interval checkpoint,
    and checkpoint_last copied from it), and beside it, until it ends, a
    reader of checkpoint_last in this process (the resharding tool's
    reading: every part, layer by layer) and fairseq-eval-lm at size 2 run
    again and again. Readers completed the trainer's renames under it (the
    training died on its own staged file) and read parts of two saves ("not
    one save", "replicated tensor ... differs"). Now the training runs to
    its end, no read is refused, and every read is one save whole: its
    weights are bitwise those of the interval checkpoint of the save it
    names. FAIRSEQ_MEGATRON_READER_UPDATES sets the updates (200 is the
    documented check, docs/testing.md)."""
    updates = int(os.environ.get("FAIRSEQ_MEGATRON_READER_UPDATES", "40"))
    save_dir = tmp_path / "ckpt"
    args = train_args(trained["data"], str(save_dir), updates) + ["--save-interval-updates", "1"]
    last = str(save_dir / "checkpoint_last.pt")
    outcome = {}

    def train():
        outcome["train"] = fairseq("train", args, nproc=2, check=False, timeout=1200)

    def evaluate():
        runs = []
        while training.is_alive():
            if os.path.exists(manifest_path(last)):
                runs.append(fairseq("eval_lm", eval_args(trained["data"], last, 2), nproc=2, check=False))
            else:
                time.sleep(0.1)
        outcome["eval"] = runs

    training = threading.Thread(target=train)
    training.start()
    evaluating = threading.Thread(target=evaluate)
    evaluating.start()
    reads, refused = [], []
    while training.is_alive():
        try:
            parts = PartFiles(last)
            model = model_part(parts, 0, 1, check_replicas=True, progress=None)
        except FileNotFoundError:  # before the first save
            time.sleep(0.05)
            continue
        except Exception as e:
            refused.append(f"{type(e).__name__}: {e}")
            continue
        reads.append((parts.opened.manifest["token"], parts.opened.manifest["updates"], _digest(model)))
        del parts, model
    training.join()
    evaluating.join()
    rc, log = outcome["train"]
    assert rc == 0 and "training on 2 devices" in log and re.search(rf"num_updates={updates}\b", log), log[-3000:]
    assert refused == [], refused[:3]
    failed = [out[-2000:] for code, out in outcome["eval"] if code != 0]
    assert outcome["eval"] and not failed, failed[:1]
    seen = {u for _, u, _ in reads}
    print(f"{updates} updates saved every update; {len(reads)} reads of {len(seen)} saves, "
          f"{len(outcome['eval'])} fairseq-eval-lm runs, none refused")  # shown with pytest -s
    assert len(seen) >= 3, (len(reads), seen)  # the reads overlapped several saves
    for token, update, digest in reads:
        interval = str(save_dir / f"checkpoint_1_{update}.pt")
        parts = PartFiles(interval)
        assert parts.opened.manifest["token"] == token  # the copy is of the same save
        assert _digest(model_part(parts, 0, 1, check_replicas=True, progress=None)) == digest, update


def test_every_class_the_checkpoints_hold_is_allowed_and_no_other(trained, tmp_path):
    """The globals beyond torch's weights-only defaults in the files
    fairseq-train (the trained fixture, 2 parts), the resharding tool (both
    formats, and its --to-fairseq export) and fairseq's 2020 code (the
    published layout, torch's legacy format) write: ``argparse.Namespace``
    alone, which the allowlist holds. Each file loads with the allowlist and
    is refused without it."""
    from tests.e2e.test_published_layout import _release_2020

    published = _release_2020(trained["data"], str(tmp_path / "megatron_2020"))
    resharded, plain = str(tmp_path / "one" / "model.pt"), str(tmp_path / "plain" / "model.pt")
    reshard(published, resharded, 1)
    from fairseq_megatron.checkpoint.export import export_to_fairseq

    export_to_fairseq(published, plain)
    trained_parts = [os.path.join(trained["ckpt"], f"checkpoint_last-model_part-{r}.pt") for r in (0, 1)]
    legacy = [part_path(published, r) for r in range(8)]
    for path in trained_parts + [resharded]:
        assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == ["argparse.Namespace"], path
    assert torch.serialization.get_unsafe_globals_in_checkpoint(plain) == []
    assert [g.__module__ + "." + g.__qualname__ for g in safe_loading.ALLOWED_GLOBALS] == ["argparse.Namespace"]
    for path in trained_parts + [resharded] + legacy:
        safe_loading.load(path)
        with pytest.raises(Exception, match="argparse.Namespace"):
            torch.load(path, weights_only=True)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_eval_lm_refuses_a_checkpoint_that_would_run_code(trained, tmp_path):
    """A checkpoint whose pickle calls ``open`` when unpickled, given to
    fairseq-eval-lm: it was unpickled in full (the call ran) before any
    check. Now one line names the call, and it never runs."""
    path = tmp_path / "model.pt"
    reshard(os.path.join(trained["ckpt"], "checkpoint_last.pt"), str(path), 1)
    state = torch.load(path, weights_only=False)
    state["extra_state"]["payload"] = _Payload(str(tmp_path / "ran"))
    torch.save(state, path)
    rc, out = fairseq("eval_lm", eval_args(trained["data"], str(path), 1), check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1].startswith(f"error: {path} holds io.open, which no checkpoint"), \
        out[-3000:]
    assert "Traceback" not in out and not (tmp_path / "ran").exists()


# ---------------------------------------------------------------- the writer


def _lock_held(directory) -> bool:
    """Whether another process holds ``directory``'s lock (tried without waiting, released at once)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def test_one_fairseq_train_per_save_dir(trained, tmp_path):
    """Two runs with one --save-dir both ran, the second resuming from the
    first's saves. The first now holds the directory's lock: the second is
    one line and writes nothing; once the first is killed with SIGKILL the
    kernel has dropped the lock, and a third run trains."""
    save_dir = tmp_path / "ckpt"
    args = train_args(trained["data"], str(save_dir), max_update=1000)
    args[args.index("--model-parallel-size") + 1] = "1"
    log = tmp_path / "first.log"
    with open(log, "w") as output:
        first = subprocess.Popen([sys.executable, "-m", "fairseq_cli.train", *args], stdout=output,
                                 stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "num_updates=1," not in log.read_text():  # training: it holds the save dir
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        second = list(args)
        second[second.index("--max-update") + 1] = "2"
        rc, out = fairseq("train", second, check=False)
        assert out.rstrip().splitlines()[-1] == (
            f"error: --save-dir {save_dir} is in use: another fairseq-train run holds its lock; one run writes a "
            f"save dir at a time: wait for that run to end, or pass another --save-dir"), out[-3000:]
        assert rc == 1 and "num_updates" not in out
        assert _lock_held(save_dir)  # on the directory itself, where the file system can lock one (as here)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    # fairseq's data-loader workers inherited the open directory; the kernel
    # drops the lock when the last of them has exited, a moment after the leader
    deadline = time.monotonic() + 30
    while _lock_held(save_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _lock_held(save_dir)
    rc, out = fairseq("train", second, check=False)
    assert rc == 0, out[-3000:]


def test_a_read_only_save_dir_is_one_line(trained, tmp_path):
    """fairseq's probe of a read-only --save-dir logged "Unable to access
    checkpoint save directory" and raised with a traceback; now one line
    before anything runs, and nothing at all under --no-save."""
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    args = train_args(trained["data"], str(save_dir), 1)
    args[args.index("--model-parallel-size") + 1] = "1"
    rc, out = fairseq("train", args, check=False, read_only=[save_dir])
    assert rc == 1 and out.rstrip().splitlines()[-1] == (
        f"error: --save-dir {save_dir}: cannot write in {save_dir}: Read-only file system"), out[-3000:]
    assert "Traceback" not in out and "Unable to access" not in out
    assert os.listdir(save_dir) == []
    # under --no-save the run writes nothing there (fairseq's own probe refused it too): it trains
    rc, out = fairseq("train", args + ["--no-save"], check=False, read_only=[save_dir])
    assert rc == 0 and "done training" in out, out[-3000:]
    assert os.listdir(save_dir) == []


def test_a_missing_last_stage_is_named_and_the_advice_of_a_layout_error_works(trained, tmp_path):
    """The trained checkpoint in 1 part x 2 pipeline stages. With every
    stage-1 file gone, fairseq-eval-lm and fairseq-generate at size 1 ended
    in "Model file not found" tracebacks, and fairseq-train at one stage in
    the layout error whose advice (--reset-optimizer) then failed on the
    same missing file; each now names the file. Whole, fairseq-train at one
    stage says to add --reset-optimizer, and with it trains."""
    path = str(tmp_path / "stages" / "model.pt")
    reshard(os.path.join(trained["ckpt"], "checkpoint_last.pt"), path, 1, new_stages=2)
    os.rename(stage_path(path, 0, 1), tmp_path / "kept")
    missing = f"error: pipeline stage file {stage_path(path, 0, 1)} is missing: {path} was saved in 2 pipeline stages"
    rc, out = fairseq("eval_lm", eval_args(trained["data"], path, 1), check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == missing and "Traceback" not in out, out[-3000:]
    generate = [trained["data"], "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling", "--path", path,
                "--gen-subset", "test", "--sample-break-mode", "none", "--tokens-per-sample", "32", "--max-len-b",
                "4", "--batch-size", "4", "--beam", "1"]
    rc, out = fairseq("generate", generate, check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == missing and "Traceback" not in out, out[-3000:]
    train = [*train_args(trained["data"], str(tmp_path / "run"), 5), "--restore-file", path]
    train[train.index("--model-parallel-size") + 1] = "1"
    for extra in ([], ["--reset-optimizer"]):
        rc, out = fairseq("train", train + extra, check=False)
        assert rc == 1 and out.rstrip().splitlines()[-1] == missing, out[-3000:]
    os.rename(tmp_path / "kept", stage_path(path, 0, 1))
    rc, out = fairseq("train", train, check=False)
    assert rc == 1 and "or start from its weights with --reset-optimizer (as --finetune-from-model)" in out, \
        out[-3000:]
    rc, out = fairseq("train", train + ["--reset-optimizer"], check=False)
    assert rc == 0 and "1 model part(s) x 2 pipeline stages, loaded at model-parallel size 1" in out, out[-3000:]


@pytest.mark.parametrize("tool,flag,value,line", [
    ("train", "--update-freq", "0", "--update-freq 0: at least 1 (batches accumulated per update)"),
    ("train", "--tokens-per-sample", "0", "--tokens-per-sample 0: at least 1 (tokens per block)"),
    ("train", "--dropout", "1.5", "--dropout 1.5: a probability, from 0 to 1"),
    ("train", "--batch-size", "-1", "--batch-size -1: at least 1 (sentences per batch)"),
    ("generate", "--beam", "0", "--beam 0: at least 1 (hypotheses kept per step)"),
    ("generate", "--temperature", "-1", "--temperature -1.0: above 0"),
])
def test_fairseqs_impossible_numbers_are_one_line_at_launch(trained, tmp_path, tool, flag, value, line):
    """fairseq's own numeric flags with values no run can use, in runs of
    our models: each ended in a traceback (an assertion, a division by
    zero, torch's dropout) or ran on (``--batch-size -1``); each is now one
    line before any process works, and --save-dir is not made."""
    if tool == "train":
        args = train_args(trained["data"], str(tmp_path / "ckpt"), 2)
        args[args.index("--model-parallel-size") + 1] = "1"
    else:
        args = [trained["data"], "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling", "--path",
                os.path.join(trained["ckpt"], "checkpoint_last.pt"), "--gen-subset", "test", "--sample-break-mode",
                "none", "--tokens-per-sample", "32", "--max-len-b", "4", "--batch-size", "4"]
    args = [a for i, a in enumerate(args) if not (a == flag or (i and args[i - 1] == flag))] + [flag, value]
    rc, out = fairseq(tool, args, check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == f"error: {line}", out[-3000:]
    assert "Traceback" not in out and not (tmp_path / "ckpt").exists()
