"""Readers of a checkpoint write nothing and read one save, whole
(fairseq_megatron/checkpoint/reading.py), and open it without running code
(fairseq_megatron/checkpoint/safe_loading.py): a save whose renames a kill
interrupted is read through its staged names; a manifest is refused unless
every name it gives is a part file in the checkpoint's own directory; a save
that changes while it is opened is opened again, and once open the files
are read as they were; parts of two runs are refused without a manifest too;
a missing last pipeline stage stops every writer of new files; a part that
would call a function outside the allowlist when unpickled is refused, the
function never called."""

import json
import os
import re
import zipfile

import pytest
import torch

from fairseq_megatron.checkpoint import reading, safe_loading
from fairseq_megatron.checkpoint.commit import manifest_path, write_manifest
from fairseq_megatron.checkpoint.export import export_to_fairseq
from fairseq_megatron.checkpoint.layout import CheckpointError
from fairseq_megatron.checkpoint.part_files import all_files, find_part_files, part_path, stage_path
from fairseq_megatron.checkpoint.reading import ChangedWhileRead, open_save
from fairseq_megatron.checkpoint.resharding import PartFiles, model_part, reshard, resharded_model
from fairseq_megatron.checkpoint.names import staged_name
from fairseq_megatron.cli import reshard_checkpoint
from fairseq_megatron.fairseq_integration import checkpoint_utils
from tests.support.checkpoint_resharding import save_checkpoint
from tests.support.files import file_contents


def _commit(path, token, updates=5):
    """Make the files of checkpoint ``path`` one save as fairseq-train
    commits it: each records ``token``, and the manifest lists them all."""
    files = all_files(find_part_files(path, None), None)
    for f in files:
        state = torch.load(f, weights_only=False)
        state["extra_state"]["save"] = {"token": token, "updates": updates}
        state["optimizer_history"][-1]["num_updates"] = updates
        torch.save(state, f)
    write_manifest(path, token, updates, files)
    return files


def _reshard_cli(capsys, *argv):
    rc = reshard_checkpoint.main(list(argv))
    return rc, capsys.readouterr().err.strip()


# ---------------------------------------------------------------- an unfinished save


def test_an_unfinished_save_is_read_through_its_staged_names_and_nothing_is_written(tmp_path, capsys):
    """A save killed after its commit point, before rank 1's rename: part 1
    only under its staged name. Readers renamed it into place (and failed on
    a read-only file system, or raced the writer); now every reader reads it
    there and leaves every file as it was: the weights read are the save's."""
    source = tmp_path / "ckpt"
    os.makedirs(source)
    path = str(source / "checkpoint_last.pt")
    full = save_checkpoint(path, 2)
    token = "ab" * 16
    _commit(path, token)
    os.replace(part_path(path, 1), staged_name(part_path(path, 1), token))
    before = file_contents(source)

    assert find_part_files(path) == [part_path(path, 0), part_path(path, 1)]
    merged, _ = resharded_model(path, 0, 1)
    out = tmp_path / "out"
    rc, err = _reshard_cli(capsys, "--input", path, "--output", str(out / "one.pt"), "--model-parallel-size", "1")
    export_to_fairseq(path, str(out / "plain.pt"))
    assert file_contents(source) == before
    assert (rc, err) == (0, "")
    assert all(torch.equal(merged[k], full[k]) for k in full if not k.endswith("_float_tensor"))
    with open_save(path) as opened:
        assert opened.read_through(part_path(path, 1)).name == staged_name(part_path(path, 1), token)


# ---------------------------------------------------------------- manifests


@pytest.mark.parametrize("listed", ["../victim/notes.txt", "/tmp/checkpoint_last-model_part-1.pt",
                                    "other-model_part-1.pt", "checkpoint_last-model_part-7.pt", "token"])
def test_a_manifest_that_names_files_elsewhere_is_refused(tmp_path, capsys, listed):
    """A manifest is the reader's only map of the save: the names it gives
    (and the token that makes the staged names) must be the part files of
    the checkpoint in its own directory. A manifest naming
    ``../victim/notes.txt`` made fairseq-eval-lm rename
    ``victim/notes.txt.staged-TOKEN`` over ``victim/notes.txt``, outside the
    checkpoint's directory. Such a manifest is now one line, and nothing
    anywhere is renamed."""
    source, victim = tmp_path / "ckpt", tmp_path / "victim"
    os.makedirs(source)
    os.makedirs(victim)
    path = str(source / "checkpoint_last.pt")
    save_checkpoint(path, 2)
    token = "cd" * 16
    (victim / "notes.txt").write_text("the user's notes\n")
    (victim / f"notes.txt.staged-{token}").write_text("what the manifest's author wrote\n")
    names = ["checkpoint_last-model_part-0.pt", listed if listed != "token" else "checkpoint_last-model_part-1.pt"]
    with open(manifest_path(path), "w") as f:  # as write_manifest writes one, with these names
        json.dump({"token": "../../x" if listed == "token" else token, "updates": 5, "parts": names}, f)
    before = file_contents(tmp_path)
    rc, err = _reshard_cli(capsys, "--input", path, "--output", str(tmp_path / "out.pt"), "--model-parallel-size",
                           "1")
    assert file_contents(tmp_path) == before
    assert rc == 1 and err.startswith(f"error: {manifest_path(path)} is not a checkpoint manifest: "), err
    assert len(err.splitlines()) == 1


# ---------------------------------------------------------------- a writer meanwhile


def _save_again(path, token, updates, full_parts=2):
    """What fairseq-train's next save of ``path`` does, in one process: new
    parts under staged names, the manifest, the renames."""
    files = find_part_files(path, None)
    for f in files:
        state = torch.load(f, weights_only=False)
        state["extra_state"]["save"] = {"token": token, "updates": updates}
        state["optimizer_history"][-1]["num_updates"] = updates
        for v in state["model"].values():
            if v.is_floating_point():
                v.add_(1.0)
        torch.save(state, staged_name(f, token))
    write_manifest(path, token, updates, files)
    for f in files:
        os.replace(staged_name(f, token), f)


def test_a_save_that_changes_while_it_is_opened_is_opened_again(tmp_path, monkeypatch):
    """A training saves the checkpoint again between the reader's opening
    of part 0 and of part 1: the parts opened are of two saves. The reader
    sees the manifest changed and opens the new save, whole; a writer that
    saves again at every open is one line after reading.ATTEMPTS tries."""
    path = str(tmp_path / "checkpoint_last.pt")
    save_checkpoint(path, 2)
    _commit(path, "01" * 16)
    real_open, opens = reading._open, []

    def open_and_save_once(name, manifest, checkpoint):
        opens.append(name)
        if len(opens) == 2:  # after part 0 was opened, before part 1
            _save_again(path, "02" * 16, 6)
        return real_open(name, manifest, checkpoint)

    monkeypatch.setattr(reading, "_open", open_and_save_once)
    with open_save(path) as opened:
        assert opened.manifest["token"] == "02" * 16
        assert [torch.load(opened.source(f), weights_only=False)["extra_state"]["save"]["token"]
                for f in opened.every_file] == ["02" * 16] * 2

    saves = iter(range(3, 100))

    def save_at_every_open(name, manifest, checkpoint):
        if name == part_path(path, 1):
            _save_again(path, f"{next(saves):02d}" * 16, 7)
        return real_open(name, manifest, checkpoint)

    monkeypatch.setattr(reading, "_open", save_at_every_open)
    with pytest.raises(ChangedWhileRead, match=rf"^{re.escape(path)} was saved again each of the "
                                               rf"{reading.ATTEMPTS} times its files were opened"):
        open_save(path)


def test_the_files_opened_are_read_as_they_were(tmp_path):
    """The resharding reads a checkpoint layer by layer, opening the files
    again for each: a save in between gave it layers of two saves (the
    replicated weights then differed, or, where a layer had none, the mix
    went through). It now reads the files it opened, whatever was renamed
    over them since."""
    path = str(tmp_path / "checkpoint_last.pt")
    full = save_checkpoint(path, 2)
    _commit(path, "0a" * 16)
    parts = PartFiles(path)
    _save_again(path, "0b" * 16, 6)  # every weight + 1 on disk now
    merged = model_part(parts, 0, 1, check_replicas=True, progress=None)
    assert all(torch.equal(merged[k], full[k]) for k in full if not k.endswith("_float_tensor"))


def test_parts_of_two_runs_without_a_manifest_are_one_line(tmp_path, capsys):
    """Parts of two runs saved at the same update, no manifest (copied
    without it): only the save token each part records tells them apart,
    and they were evaluated and resumed as one model. Now one line, as with
    a manifest; the same token passes."""
    path = str(tmp_path / "model.pt")
    save_checkpoint(path, 2)
    for rank, token in enumerate(("11" * 16, "22" * 16)):
        state = torch.load(part_path(path, rank), weights_only=False)
        state["extra_state"]["save"] = {"token": token, "updates": 5}
        torch.save(state, part_path(path, rank))
    line = (f"the model parts of {path} are not one save: model-model_part-0.pt of save 11111111, "
            f"model-model_part-1.pt of save 22222222, at the same update (parts of two runs put together)")
    rc, err = _reshard_cli(capsys, "--input", path, "--output", str(tmp_path / "o.pt"), "--model-parallel-size", "1")
    assert (rc, err) == (1, f"error: {line}")
    with pytest.raises(CheckpointError, match=re.escape(line)):
        open_save(path)
    state = torch.load(part_path(path, 1), weights_only=False)
    state["extra_state"]["save"]["token"] = "11" * 16
    torch.save(state, part_path(path, 1))
    open_save(path).close()


# ---------------------------------------------------------------- stages


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("manifest", [False, True])
def test_a_missing_last_stage_stops_every_writer_before_it_writes(tmp_path, capsys, parts, manifest):
    """Every part's last stage file gone (``-stage-1`` of a checkpoint in
    2 stages): resharding to one file, ``--to-fairseq`` and ``--to-hf``
    exited 0 and wrote a model of the first stage's layers only
    (transformers then re-initialised the rest). Each is now one line naming
    a missing file, and writes nothing; with a manifest, the file it lists."""
    source = tmp_path / "src"
    os.makedirs(source)
    original, path = str(tmp_path / "orig.pt"), str(source / "checkpoint_last.pt")
    save_checkpoint(original, parts)
    reshard(original, path, parts, new_stages=2)
    if manifest:
        _commit(path, "3c" * 16)
    for rank in range(parts):
        os.remove(stage_path(path, rank, 1))
    missing = stage_path(path, 0, 1)
    out = tmp_path / "out"
    for argv in (["--model-parallel-size", "1"], ["--to-fairseq"], ["--to-hf"]):
        output = str(out / ("hf" if "--to-hf" in argv else "m.pt"))
        rc, err = _reshard_cli(capsys, "--input", path, "--output", output, *argv)
        assert rc == 1 and err.startswith("error: ") and len(err.splitlines()) == 1, err
        if manifest:
            assert f"model part file {missing} is missing: {manifest_path(path)} lists it" in err, err
        else:  # the stages the checkpoint records tell
            assert err == f"error: pipeline stage file {missing} is missing: {path} was saved in 2 pipeline stages"
        assert not out.exists()


# ---------------------------------------------------------------- code in a checkpoint


class _Payload:
    """Unpickling it creates the file ``marker``: what a malicious part file could do instead."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("legacy_format", [False, True])
def test_a_part_that_would_run_code_is_refused_without_running_it(tmp_path, capsys, monkeypatch, caplog,
                                                                  legacy_format):
    """A part file whose pickle calls ``open`` (it could call anything) was
    unpickled in full as soon as a tool opened it: the call ran before any
    check. It is now refused in one line naming what it calls, by the
    resharding tool and by fairseq's checkpoint loader, and the call never
    runs. ``FAIRSEQ_MEGATRON_TRUST_CHECKPOINTS=1`` unpickles in full, with
    a warning; a pickle that fails its CRC-32 is refused before that."""
    path = str(tmp_path / "model.pt")
    save_checkpoint(path, 2, legacy_format=legacy_format)
    marker = tmp_path / "ran"
    state = torch.load(part_path(path, 1), weights_only=False)
    state["extra_state"]["payload"] = _Payload(str(marker))
    state["optimizer_history"][-1].update(optimizer_name="FairseqAdam", lr_scheduler_state={"best": None},
                                          criterion_name="VocabParallelCrossEntropyCriterion")  # fairseq's fields
    torch.save(state, part_path(path, 1), _use_new_zipfile_serialization=not legacy_format)
    assert not marker.exists()

    rc, err = _reshard_cli(capsys, "--input", path, "--output", str(tmp_path / "o.pt"), "--model-parallel-size", "1")
    assert rc == 1 and err == (
        f"error: {part_path(path, 1)} holds io.open, which no checkpoint of fairseq or fairseq_megatron holds: "
        f"refused without unpickling it, as unpickling would call it (set FAIRSEQ_MEGATRON_TRUST_CHECKPOINTS=1 to "
        f"unpickle files you trust in full)"), err
    with pytest.raises(safe_loading.UnsafeCheckpoint, match="holds io.open"):
        checkpoint_utils.load_checkpoint_to_cpu(part_path(path, 1))
    assert not marker.exists()

    monkeypatch.setenv(safe_loading.TRUST_CHECKPOINTS, "1")
    safe_loading._warn_once.cache_clear()
    with caplog.at_level("WARNING"):
        checkpoint_utils.load_checkpoint_to_cpu(part_path(path, 1))
    assert marker.exists() and "checkpoint files are unpickled in full" in caplog.text
    if legacy_format:
        return  # no CRC-32 in the legacy format
    marker.unlink()
    with zipfile.ZipFile(part_path(path, 1)) as archive:  # the pickle's bytes: flip one in the payload's text
        info = next(i for i in archive.infolist() if i.filename.endswith("data.pkl"))
    data = bytearray(open(part_path(path, 1), "rb").read())
    start = data.index(str(marker).encode(), info.header_offset)
    data[start + len(str(marker)) - 1] ^= 1  # "ran" -> "rao": still a pickle, another path
    open(part_path(path, 1), "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"is corrupted: its record .*data.pkl does not match the CRC-32"):
        checkpoint_utils.load_checkpoint_to_cpu(part_path(path, 1))
    assert sorted(os.listdir(tmp_path)) == ["model-model_part-0.pt", "model-model_part-1.pt"]
