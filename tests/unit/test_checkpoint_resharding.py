"""Resharding checkpoint files between model-parallel sizes, and export to stock fairseq.

Logit tolerance (fp32): rtol=atol=1e-5, as in test_model_parity.py: the
weights are bitwise the same at every size; only the order of the fp32 sums
in row-parallel layers and the gathered vocabulary changes (~1e-6)."""

import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

from fairseq_megatron.checkpoint import part_files
from fairseq_megatron.checkpoint.export import export_to_fairseq
from fairseq_megatron.checkpoint.layout import CheckpointError
from fairseq_megatron.checkpoint.integrity import check_integrity
from fairseq_megatron.checkpoint.part_files import check_complete, find_part_files, part_path
from fairseq_megatron.checkpoint.resharding import PartFiles, reshard, resharded_model
from fairseq_megatron.cli import reshard_checkpoint
from tests.helpers import make_dictionary
from tests.support.checkpoint_resharding import WORDS, save_checkpoint
from tests.support.full_disk import FullDiskAt


def _models(path):
    return [torch.load(f, weights_only=False)["model"] for f in find_part_files(path)]


def _optimizer_state(path):
    return [torch.load(f, weights_only=False)["last_optimizer_state"] for f in find_part_files(path)]


def _assert_same_optimizer_state(a, b):
    assert set(a) == set(b) and a["param_groups"] == b["param_groups"]
    assert a.get("loss_scale") == b.get("loss_scale")
    assert list(a["state"]) == list(b["state"])
    for index in a["state"]:
        assert list(a["state"][index]) == list(b["state"][index])
        for name, value in a["state"][index].items():
            if torch.is_tensor(value):
                assert torch.equal(value, b["state"][index][name]), (index, name)
            else:
                assert value == b["state"][index][name], (index, name)


@pytest.mark.slow  # several seconds: left out of make test-fast
@pytest.mark.parametrize("style", ["cfg", "args"])
def test_round_trip_2_1_4_2_is_bitwise_identical(tmp_path, style):
    src = str(tmp_path / "src" / "model.pt")
    os.makedirs(os.path.dirname(src))
    save_checkpoint(src, 2, style)
    one = str(tmp_path / "one" / "model.pt")
    four = str(tmp_path / "four" / "model.pt")
    back = str(tmp_path / "back" / "model.pt")
    assert reshard(src, one, 1) == [one]
    assert reshard(one, four, 4) == [part_path(four, r) for r in range(4)]
    assert reshard(four, back, 2) == [part_path(back, 0), part_path(back, 1)]

    for original, final in zip(_models(src), _models(back)):
        assert list(original) == list(final)
        for key in original:
            assert torch.equal(original[key], final[key]), key

    state = torch.load(one, weights_only=False)
    cfg = state["args"] if style == "args" else state["cfg"]["model"]
    assert (cfg.model_parallel_size, cfg.padded_vocab_size) == (1, 64)
    assert "last_optimizer_state" not in state and "rng_tracker_states" not in state["extra_state"]
    model = state["model"]
    assert model["decoder.embed_tokens.weight"].shape == (64, 32)
    # the tied output projection is saved as the same tensor, not a copy
    assert model["decoder.output_projection.weight"].data_ptr() == model["decoder.embed_tokens.weight"].data_ptr()


@pytest.mark.slow  # several seconds: left out of make test-fast
@pytest.mark.parametrize("layout", ["per-parameter", "flat"])
def test_optimizer_state_round_trip_2_1_4_2(tmp_path, layout):
    """``with_optimizer``: at size 1 the Adam moments are the full moments the
    parts were cut from, in ``model.parameters()`` order (flat: concatenated
    in that order, as fairseq's FP16Optimizer keeps them); 2 -> 1 -> 4 -> 2
    gives back the original parts' optimizer state bitwise."""
    src = str(tmp_path / "src" / "model.pt")
    os.makedirs(os.path.dirname(src))
    _, names, moments = save_checkpoint(src, 2, optimizer=layout)
    one, four, back = (str(tmp_path / d / "model.pt") for d in ("one", "four", "back"))
    reshard(src, one, 1, with_optimizer=True)
    reshard(one, four, 4, with_optimizer=True)
    reshard(four, back, 2, with_optimizer=True)

    (merged,) = _optimizer_state(one)
    if layout == "flat":
        (entry,) = merged["state"].values()
        assert entry["step"] == 5 and merged["loss_scale"] == 64.0
        for which, name in enumerate(("exp_avg", "exp_avg_sq")):
            assert torch.equal(entry[name], torch.cat([moments[n][which].reshape(-1) for n in names])), name
    else:
        assert len(merged["state"]) == len(names)
        for index, n in enumerate(names):
            assert torch.equal(merged["state"][index]["exp_avg"], moments[n][0]), n
            assert torch.equal(merged["state"][index]["exp_avg_sq"], moments[n][1]), n
            assert merged["state"][index]["step"] == 5.0
    assert len(_optimizer_state(four)) == 4
    for original, final in zip(_optimizer_state(src), _optimizer_state(back)):
        _assert_same_optimizer_state(original, final)
    state = torch.load(part_path(back, 1), weights_only=False)
    assert "rng_tracker_states" not in state["extra_state"]  # a rank of another size has its own stream


def test_optimizer_states_that_cannot_be_resharded(tmp_path):
    """Each refusal is one CheckpointError naming the file, and writes nothing."""
    path = str(tmp_path / "src" / "model.pt")
    out = tmp_path / "out"
    os.makedirs(os.path.dirname(path))

    def refused(match):
        with pytest.raises(CheckpointError, match=match):
            reshard(path, str(out / "model.pt"), 1, with_optimizer=True)
        assert not out.exists() or not os.listdir(out)

    save_checkpoint(path, 2, optimizer=None)
    refused(f"{part_path(path, 0)} holds no optimizer state")

    _, names, _ = save_checkpoint(path, 2, optimizer="per-parameter")
    state = torch.load(part_path(path, 1), weights_only=False)
    # Adafactor keeps factored second moments: a row and a column vector per matrix.
    assert names[1] == "decoder.layers.0.self_attn.k_proj.weight"
    state["last_optimizer_state"]["state"][1]["exp_avg_sq"] = torch.ones(16)
    torch.save(state, part_path(path, 1))
    refused(rf"{part_path(path, 1)}: optimizer state 'exp_avg_sq' of decoder.layers.0.self_attn.k_proj.weight "
            r"has shape \(16,\), not the parameter's \(16, 32\)")

    save_checkpoint(path, 2, optimizer="per-parameter")
    state = torch.load(part_path(path, 1), weights_only=False)
    state["last_optimizer_state"]["param_groups"][0]["params"].pop()
    torch.save(state, part_path(path, 1))
    refused(f"{part_path(path, 1)}: the optimizer state is for {len(names) - 1} parameters, the model has "
            f"{len(names)}")

    save_checkpoint(path, 2, optimizer="flat")
    state = torch.load(part_path(path, 0), weights_only=False)
    state["last_optimizer_state"]["state"][0]["exp_avg"] = state["last_optimizer_state"]["state"][0]["exp_avg"][1:]
    torch.save(state, part_path(path, 0))
    refused(f"{part_path(path, 0)}: flat optimizer state 'exp_avg' has [0-9]+ elements, the parameters [0-9]+")


@pytest.mark.slow  # several seconds: left out of make test-fast
@pytest.mark.parametrize("legacy_format", [False, True])
def test_ema_weights_reshard_like_the_weights(tmp_path, legacy_format):
    """fairseq-train ``--store-ema`` keeps the EMA model's state dict (and
    with ``--ema-fp32`` fp32 copies) in each part's ``extra_state``: 2 -> 1
    gives the whole EMA model, 1 -> 4 -> 2 the original parts, bitwise. Before,
    every output part got part 0's EMA tensors."""
    src = str(tmp_path / "src" / "model.pt")
    os.makedirs(os.path.dirname(src))
    full, ema_full = save_checkpoint(src, 2, ema=True, legacy_format=legacy_format)
    one, four, back = (str(tmp_path / d / "model.pt") for d in ("one", "four", "back"))
    reshard(src, one, 1)
    reshard(one, four, 4)
    reshard(four, back, 2)

    whole = torch.load(one, weights_only=False)
    for entry in ("ema", "ema_fp32_params"):
        merged = whole["extra_state"][entry]
        assert list(merged) == list(ema_full)
        for key in ema_full:
            assert torch.equal(merged[key], ema_full[key]), (entry, key)
    # the EMA weights are not the weights (which the round trip test covers)
    assert not torch.equal(ema_full["decoder.layers.0.fc1.weight"], full["decoder.layers.0.fc1.weight"])
    ema = whole["extra_state"]["ema"]  # the tied output projection stays one tensor
    assert ema["decoder.output_projection.weight"].data_ptr() == ema["decoder.embed_tokens.weight"].data_ptr()
    assert [torch.load(f, weights_only=False)["extra_state"]["ema"]["decoder.embed_tokens.weight"].shape
            for f in find_part_files(four)] == [(16, 32)] * 4

    for rank, f in enumerate(find_part_files(four)):  # built in memory (fairseq-train at another size)
        written = torch.load(f, weights_only=False)["extra_state"]["ema"]
        built, _ = resharded_model(src, rank, 4, entry="ema")
        assert list(built) == list(written) and all(torch.equal(built[k], written[k]) for k in written)

    original = [torch.load(f, weights_only=False)["extra_state"] for f in find_part_files(src)]
    final = [torch.load(f, weights_only=False)["extra_state"] for f in find_part_files(back)]
    for before, after in zip(original, final):
        for entry in ("ema", "ema_fp32_params"):
            assert list(before[entry]) == list(after[entry])
            for key in before[entry]:
                assert torch.equal(before[entry][key], after[entry][key]), (entry, key)


@pytest.mark.slow  # several seconds: left out of make test-fast
def test_parts_in_the_legacy_format_reshard_like_zip_files(tmp_path):
    """Checkpoints saved before PyTorch 1.6 are not zip archives and cannot be
    memory-mapped; they are read whole and give the same parts, bitwise."""
    outputs = {}
    for legacy in (False, True):
        src = str(tmp_path / f"src{legacy}" / "model.pt")
        os.makedirs(os.path.dirname(src))
        save_checkpoint(src, 2, legacy_format=legacy)
        assert PartFiles(src).mmap is not legacy
        out = str(tmp_path / f"four{legacy}" / "model.pt")
        assert len(reshard(src, out, 4)) == 4
        outputs[legacy] = _models(out)
    assert len(outputs[True]) == 4
    for zipped, legacy in zip(outputs[False], outputs[True]):
        assert list(zipped) == list(legacy)
        for key in zipped:
            assert torch.equal(zipped[key], legacy[key]), key


@pytest.mark.slow  # several seconds: left out of make test-fast
def test_parts_built_in_memory_equal_the_files_reshard_writes(tmp_path):
    src = str(tmp_path / "src" / "model.pt")
    os.makedirs(os.path.dirname(src))
    save_checkpoint(src, 2)
    listing = sorted(os.listdir(os.path.dirname(src)))
    for size in (1, 4):
        out = str(tmp_path / f"mp{size}" / "model.pt")
        reshard(src, out, size)
        written = _models(out)
        for rank in range(size):
            model, padded_vocab_size = resharded_model(src, rank, size)
            assert padded_vocab_size == 64
            assert list(model) == list(written[rank])
            for key in model:
                assert torch.equal(model[key], written[rank][key]), key
    assert sorted(os.listdir(os.path.dirname(src))) == listing
    with pytest.raises(CheckpointError, match="model-parallel size 3 does not divide the attention heads"):
        resharded_model(src, 0, 3)
    with pytest.raises(CheckpointError, match="model part 4 does not exist at model-parallel size 4"):
        resharded_model(src, 4, 4)
    os.remove(part_path(src, 1))
    with pytest.raises(CheckpointError, match=f"model part file {part_path(src, 1)} is missing: {src} was saved "
                                              "at model-parallel size 2"):
        resharded_model(src, 0, 1)


def test_export_cli_keeps_the_rows_of_the_trained_dictionary(tmp_path, capsys):
    """``--to-fairseq`` keeps the rows of the dictionary the checkpoint
    records (54 symbols of 64 rows), without ``--dict`` too: stock fairseq
    builds its embedding from the data's dict.txt and failed to load an
    export of all 64 rows ("size mismatch") unless told the size. A
    ``--dict`` other than the trained one is refused."""
    src = str(tmp_path / "src" / "model.pt")
    os.makedirs(os.path.dirname(src))
    save_checkpoint(src, 2)
    symbols = len(make_dictionary(WORDS))
    assert torch.load(part_path(src, 0), weights_only=False)["cfg"]["model"].dictionary_size == symbols

    def export(*argv):
        out = str(tmp_path / f"plain{len(argv)}" / "model.pt")
        rc = reshard_checkpoint.main(["--input", src, "--output", out, "--to-fairseq", *argv])
        err = capsys.readouterr().err.strip()
        if rc:
            return rc, err
        return rc, torch.load(out, weights_only=False)["model"]["decoder.embed_tokens.weight"].size(0)

    assert export() == (0, symbols)
    right, short = tmp_path / "dict.txt", tmp_path / "short.txt"
    make_dictionary(WORDS).save(str(right))
    make_dictionary(WORDS - 1).save(str(short))
    assert export("--dict", str(right)) == (0, symbols)
    assert export("--dict", str(short)) == (1, f"error: the dictionary has {symbols - 1} symbols but {src} was "
                                               f"trained with {symbols}: wrong dict.txt for this checkpoint")
    text = tmp_path / "train.txt"  # the raw text, a common slip for the dictionary beside it
    text.write_text("the cat sat on the mat\n")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 3\n".encode("latin-1"))
    for wrong, fairseq_says in [(text, "Incorrect dictionary format"), (latin1, "Incorrect encoding")]:
        rc, err = export("--dict", str(wrong))  # fairseq's own message follows ours, on the same line
        assert rc == 1 and err.startswith(f"error: --dict {wrong} is not a fairseq dict.txt: {fairseq_says}"), err
        assert len(err.splitlines()) == 1, err


def test_cli_errors_are_one_line(tmp_path, capsys):
    path = str(tmp_path / "model.pt")
    save_checkpoint(path, 2)
    out = tmp_path / "out"

    def run(*argv):
        rc = reshard_checkpoint.main(["--input", path, "--output", str(out / "m.pt"), *argv])
        return rc, capsys.readouterr().err.strip()

    assert run("--model-parallel-size", "3") == (1, "error: model-parallel size 3 does not divide the attention heads (8)")
    # save_checkpoint's placeholder optimizer state belongs to no parameter
    assert run("--model-parallel-size", "1", "--keep-optimizer") == (
        1, f"error: {part_path(path, 0)}: the optimizer state is for 0 parameters, the model has 35")
    assert run("--to-fairseq", "--keep-optimizer") == (
        1, "error: --keep-optimizer and --to-fairseq exclude each other: the export is for evaluation and "
           "holds no training state")
    assert run("--model-parallel-size", "1", "--dict", path) == (
        1, "error: --dict is read only with --to-fairseq or --to-hf: resharding keeps every vocabulary row")
    assert run("--to-fairseq", "--model-parallel-size", "2") == (  # was: exit 0, the size ignored
        1, "error: --to-fairseq writes one model without model parallelism: --model-parallel-size 2 "
           "cannot apply to it")
    assert not out.exists() or not os.listdir(out), "a failed run left files behind"

    # an output that is a directory is refused before any work, whole or one of the part names
    rc = reshard_checkpoint.main(["--input", path, "--output", str(tmp_path), "--model-parallel-size", "1"])
    assert (rc, capsys.readouterr().err.strip()) == (
        1, f"error: the output {tmp_path} is a directory: name a file in it, such as {tmp_path / 'model.pt'}")
    os.makedirs(part_path(str(out / "m.pt"), 1))
    assert run("--model-parallel-size", "2") == (1, f"error: the output {part_path(str(out / 'm.pt'), 1)} is a directory")
    assert sorted(os.listdir(out)) == ["m-model_part-1.pt"], "a refused run wrote a file"
    os.rmdir(part_path(str(out / "m.pt"), 1))
    # a file where the output's directory should be: os.makedirs said only "[Errno 17] File exists"
    in_the_way = tmp_path / "in_the_way"
    in_the_way.write_text("keep me\n")
    for argv in (["--model-parallel-size", "2"], ["--to-fairseq"]):
        rc = reshard_checkpoint.main(["--input", path, "--output", str(in_the_way / "sub" / "m.pt"), *argv])
        assert (rc, capsys.readouterr().err.strip()) == (
            1, f"error: cannot write the output {in_the_way / 'sub' / 'm.pt'}: {in_the_way} is a file, "
               "not a directory")
    assert in_the_way.read_text() == "keep me\n"

    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        reshard(path, path, 2)

    # truncated part
    data = open(part_path(path, 1), "rb").read()
    open(part_path(path, 1), "wb").write(data[: len(data) // 2])
    rc, err = run("--model-parallel-size", "1")
    assert (rc, err) == (1, f"error: {part_path(path, 1)} is truncated: the zip archive's directory, which torch "
                            f"writes last, is missing (was the file still being saved or copied?)")

    # missing part
    os.remove(part_path(path, 1))
    rc, err = run("--model-parallel-size", "1")
    assert (rc, err) == (1, f"error: model part file {part_path(path, 1)} is missing: {path} was saved at "
                            "model-parallel size 2")
    os.remove(part_path(path, 0))
    rc, err = run("--model-parallel-size", "1")
    assert rc == 1 and err.startswith("error: no checkpoint")


def test_mixed_parts_from_two_checkpoints(tmp_path):
    a = str(tmp_path / "a" / "model.pt")
    b = str(tmp_path / "b" / "model.pt")
    os.makedirs(os.path.dirname(a))
    os.makedirs(os.path.dirname(b))
    save_checkpoint(a, 2, seed=0)
    save_checkpoint(b, 2, seed=1)
    os.replace(part_path(b, 1), part_path(a, 1))
    with pytest.raises(CheckpointError, match="differs between model part 0 and part 1"):
        reshard(a, str(tmp_path / "m.pt"), 1)
    assert PartFiles(a).padded_vocab_size == 64


def _rewrite_part(path, rank, change):
    part = part_path(path, rank)
    state = torch.load(part, weights_only=False)
    change(state)
    torch.save(state, part, _use_new_zipfile_serialization=zipfile.is_zipfile(part))  # in the format it was


def test_parts_of_two_saves_are_refused_in_one_line(tmp_path, capsys):
    """Part 1 saved at another update than part 0 (what a save killed
    between its parts leaves): every reader refuses the set, naming each
    part's update, before reading a tensor; the same weights with equal
    update counts reshard."""
    path = str(tmp_path / "model.pt")
    save_checkpoint(path, 2)  # optimizer_history: update 5 in each part
    files = find_part_files(path)
    check_complete(files)
    _rewrite_part(path, 1, lambda state: state["optimizer_history"][-1].update(num_updates=8))
    line = (f"the model parts of {path} are not one save: model-model_part-0.pt at update 5, "
            f"model-model_part-1.pt at update 8 (a save interrupted between its parts, or parts of two runs)")
    with pytest.raises(CheckpointError) as raised:
        check_complete(files)
    assert str(raised.value) == line
    with pytest.raises(CheckpointError, match=re.escape(line)):
        PartFiles(path)
    out = tmp_path / "out"
    rc = reshard_checkpoint.main(["--input", path, "--output", str(out / "m.pt"), "--model-parallel-size", "1"])
    assert (rc, capsys.readouterr().err.strip()) == (1, f"error: {line}")
    assert not out.exists()
    _rewrite_part(path, 1, lambda state: state["optimizer_history"][-1].update(num_updates=5))
    check_complete(files)


def test_buffers_are_not_compared_between_parts(tmp_path):
    """The published Megatron-11b's parts, saved by 8 processes, each hold
    their own ``decoder.embed_positions._float_tensor``: a 1-element buffer
    fairseq creates uninitialised and drops on load. Such parts (0.0 in
    part 0, NaN in part 1; a different ``decoder.version`` too) reshard, the
    buffers taken from part 0; a replicated weight that is NaN in every
    part is the same weight; one that differs still refuses the set."""
    path = str(tmp_path / "model.pt")
    full = save_checkpoint(path, 2, style="args", legacy_format=True)

    def buffers(value, version):
        def change(state):
            state["model"]["decoder.embed_positions._float_tensor"] = torch.tensor([value])
            state["model"]["decoder.version"] = torch.tensor([version])
        return change

    _rewrite_part(path, 0, buffers(0.0, 3.0))
    _rewrite_part(path, 1, buffers(float("nan"), 2.0))
    merged = str(tmp_path / "merged" / "model.pt")
    reshard(path, merged, 1)
    out = torch.load(merged, weights_only=False)["model"]
    assert torch.equal(out.pop("decoder.embed_positions._float_tensor"), torch.tensor([0.0]))
    assert torch.equal(out.pop("decoder.version"), torch.tensor([3.0]))
    assert set(out) == set(full) - {"decoder.version"} and all(torch.equal(out[k], full[k]) for k in out)

    norm = "decoder.layers.0.final_layer_norm.weight"  # replicated in every part
    for rank in (0, 1):
        _rewrite_part(path, rank, lambda state: state["model"][norm].__setitem__(0, float("nan")))
    assert torch.isnan(resharded_model(path, 0, 1)[0][norm][0])
    _rewrite_part(path, 1, lambda state: state["model"][norm].__setitem__(1, 7.0))
    with pytest.raises(CheckpointError, match=f"replicated tensor {norm} differs between model part 0 and part 1"):
        resharded_model(path, 0, 1)


@pytest.mark.parametrize("error", ["ENOSPC", "torch"])
def test_a_full_disk_leaves_no_output_and_one_line(tmp_path, capsys, monkeypatch, error):
    """The disk fills while part 1 of 2 is written (an OSError ENOSPC, or
    torch's zip writer's "unexpected pos", as a real full disk gives it,
    after part of the file was written). It was a traceback, with part 0
    left without part 1; now it is one line naming the file, the bytes to
    write and the bytes free, and no output or temporary file is left (the
    parts are renamed only once all are written)."""
    path = str(tmp_path / "model.pt")
    save_checkpoint(path, 1)
    inputs = {f: open(f, "rb").read() for f in find_part_files(path)}
    save = FullDiskAt(torch.save, call=2, error=error)
    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(part_files.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**9, 10**9 - 4096, 4096))
    out = tmp_path / "out"
    rc = reshard_checkpoint.main(["--input", path, "--output", str(out / "m.pt"), "--model-parallel-size", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and re.fullmatch(
        rf"error: cannot write {re.escape(str(out / 'm-model_part-1.pt'))}: No space left on device "
        r"\(0\.\d\d MB to write, 0\.00 MB free there\); nothing was written", err), err
    assert len(save.calls) == 2 and os.listdir(out) == []
    assert {f: open(f, "rb").read() for f in find_part_files(path)} == inputs


def test_a_flipped_byte_is_refused_before_use(tmp_path, capsys, monkeypatch, caplog):
    """One byte of a weight in part 1 changed after the save: the
    resharding tool copied it into its output, and every tool loaded it.
    The CRC-32 that torch stores per record now refuses the file in one
    line before anything is written; FAIRSEQ_MEGATRON_SKIP_INTEGRITY_CHECK=1
    skips the check. Files that carry no CRCs (torch's legacy format,
    archives saved with CRCs off) are said to be unchecked, and load."""
    path = str(tmp_path / "model.pt")
    save_checkpoint(path, 2)
    part = part_path(path, 1)
    assert check_integrity(part)
    weight = torch.load(part, weights_only=False)["model"]["decoder.layers.0.fc1.weight"]
    data = bytearray(open(part, "rb").read())
    at = data.find(weight.numpy().tobytes())
    assert at > 0
    data[at + 13] ^= 0x10
    open(part, "wb").write(bytes(data))
    line = f"{os.path.realpath(part)} is corrupted: its record model-model_part-1/data/"
    with pytest.raises(CheckpointError, match=re.escape(line)):
        check_integrity(part)
    out = tmp_path / "out"
    argv = ["--input", path, "--output", str(out / "m.pt"), "--model-parallel-size", "1"]
    assert reshard_checkpoint.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {line}") and err.endswith(" does not match the CRC-32 stored when it was saved "
                                                              "(the file changed since)") and "\n" not in err, err
    assert not out.exists()
    with pytest.raises(CheckpointError, match=re.escape(line)):
        resharded_model(path, 0, 1)  # what the tools load at another size
    monkeypatch.setenv("FAIRSEQ_MEGATRON_SKIP_INTEGRITY_CHECK", "1")
    assert reshard_checkpoint.main(argv) == 0
    monkeypatch.delenv("FAIRSEQ_MEGATRON_SKIP_INTEGRITY_CHECK")

    legacy = str(tmp_path / "legacy" / "model.pt")
    os.makedirs(os.path.dirname(legacy))
    save_checkpoint(legacy, 1, legacy_format=True)
    no_crc = str(tmp_path / "no_crc.pt")
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(torch.load(legacy, weights_only=False), no_crc)
    finally:
        torch.serialization.set_crc32_options(True)
    with caplog.at_level("WARNING"):
        assert not check_integrity(legacy) and not check_integrity(no_crc)
    assert "saved by PyTorch before 1.6, a format without checksums" in caplog.text
    assert "saved without a CRC-32: their integrity cannot be checked" in caplog.text


def test_two_sizes_under_one_name_are_refused(tmp_path):
    """A name holding a whole file and part files (a size-1 checkpoint
    written beside size-2 parts): which one loaded depended on the size
    asked for. Reading refuses to choose; resharding refuses to create such
    a name, or to leave another size's parts beside its output, and writes
    nothing. A gap in the part numbers is a damaged checkpoint, not a
    missing one."""
    path = str(tmp_path / "model.pt")
    save_checkpoint(path, 2)
    other = str(tmp_path / "other" / "model.pt")
    os.makedirs(os.path.dirname(other))
    save_checkpoint(other, 4)

    def listing():
        return sorted((p, os.stat(p).st_mtime_ns) for p in map(str, tmp_path.rglob("*.pt")))

    before = listing()
    with pytest.raises(CheckpointError, match=re.escape(f"{part_path(path, 0)} exists under the output name {path}")):
        reshard(path, path, 1)
    with pytest.raises(CheckpointError, match=re.escape(f"{part_path(other, 2)} exists under the output name {other}")):
        reshard(path, other, 2)  # parts 2 and 3 of the size-4 checkpoint would stay
    assert listing() == before
    reshard(path, other.replace("model.pt", "fresh.pt"), 2)  # a clean name is written
    export_to_fairseq(path, str(tmp_path / "export.bin"))  # an export is one file, named freely

    os.link(part_path(path, 0), path)
    with pytest.raises(CheckpointError, match="both exist: checkpoints of two model-parallel sizes under one name"):
        find_part_files(path)
    os.remove(path)

    os.rename(part_path(other, 1), str(tmp_path / "aside.pt"))
    with pytest.raises(CheckpointError, match=re.escape(f"model part file {part_path(other, 1)} is missing")):
        find_part_files(other)


def test_skipping_the_integrity_check_says_so(tmp_path):
    """FAIRSEQ_MEGATRON_SKIP_INTEGRITY_CHECK=1 is documented, but a corrupted
    file then loaded without a word: every tool now warns once, in a fresh
    process of the command."""
    path = str(tmp_path / "model.pt")
    save_checkpoint(path, 2)
    env = dict(os.environ, FAIRSEQ_MEGATRON_SKIP_INTEGRITY_CHECK="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "fairseq_megatron.cli.reshard_checkpoint", "--input", path,
                           "--output", str(tmp_path / "out" / "m.pt"), "--model-parallel-size", "1"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = [line for line in proc.stderr.splitlines() if "FAIRSEQ_MEGATRON_SKIP_INTEGRITY_CHECK=1" in line]
    assert len(said) == 1 and "without their CRC-32 check" in said[0], proc.stderr[-2000:]


def test_a_write_stopped_by_the_file_size_limit_names_it(tmp_path):
    """A process under ``ulimit -f`` (Python ignores SIGXFSZ: the write fails
    with EFBIG, which torch's zip writer reports as "unexpected pos ..."):
    the line named a full disk with GBs free; it names the limit."""
    import resource

    path = str(tmp_path / "model.pt")
    save_checkpoint(path, 2)
    limit = os.path.getsize(part_path(path, 0)) // 2  # below the merged output's size

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    proc = subprocess.run([sys.executable, "-m", "fairseq_megatron.cli.reshard_checkpoint", "--input", path,
                           "--output", str(tmp_path / "out" / "m.pt"), "--model-parallel-size", "1"],
                          capture_output=True, text=True, timeout=300, preexec_fn=limited,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("error: cannot write ") and "ulimit -f" in last, proc.stderr[-2000:]
    assert not os.path.exists(tmp_path / "out" / "m.pt") and os.listdir(tmp_path / "out") == []


def test_the_model_parallel_size_is_required_to_reshard_and_its_help_says_so(tmp_path, capsys):
    path = str(tmp_path / "model.pt")
    save_checkpoint(path, 2)
    argv = ["--input", path, "--output", str(tmp_path / "out" / "m.pt"), "--pipeline-model-parallel-size", "2"]
    assert reshard_checkpoint.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --model-parallel-size T: the number of tensor parts to write") and "\n" not in err
    assert "unless --to-fairseq" not in err and not os.path.exists(tmp_path / "out")
    help_text = " ".join(reshard_checkpoint.build_parser().format_help().split())
    assert "--model-parallel-size T new model-parallel size (required, except with --to-" in help_text  # wrapped there


def _in_optimizer_shards(path, shards):
    """Checkpoint ``path``'s parts rewritten as ``--ddp-backend fully_sharded``
    saves them: each part's Adam moments cut along dimension 0 by
    ``torch.chunk`` into ``shards`` files beside it (FSDP2's rows), the part
    holding the number of shards in place of its optimizer state."""
    from fairseq_megatron.checkpoint import optimizer_shards
    from fairseq_megatron.checkpoint.layout import parameter_keys, tied_keys

    for part in find_part_files(path):
        state = torch.load(part, weights_only=False)
        keys = parameter_keys(list(state["model"]), tied_keys(state["model"]))
        entries, rest = optimizer_shards.by_key(state.pop("last_optimizer_state"), keys)
        for rank in range(shards):
            local = {key: {name: value.chunk(shards)[rank].clone() if torch.is_tensor(value) and value.dim() else value
                           for name, value in values.items()} for key, values in entries.items()}
            shapes = {f"{key}.{name}": tuple(value.shape) for key, values in entries.items()
                      for name, value in values.items() if torch.is_tensor(value) and value.dim()}
            torch.save({"entries": local, "shapes": shapes, "rest": rest, "keys": keys, "token": None, "rank": rank,
                        "shards": shards}, optimizer_shards.shard_path(part, rank))
        state["optimizer_shards"] = shards
        torch.save(state, part)


def test_optimizer_shards_reshard_with_keep_optimizer(tmp_path):
    """A checkpoint saved under fully_sharded (2 parts, each's optimizer
    state in 2 shards): resuming it at another size was refused with the
    advice to reshard it with --keep-optimizer, which refused optimizer
    shards. The shards are joined: the output's optimizer state is bitwise
    what resharding the same state saved whole gives."""
    whole, sharded = (str(tmp_path / d / "model.pt") for d in ("whole", "sharded"))
    for path in (whole, sharded):
        os.makedirs(os.path.dirname(path))
        save_checkpoint(path, 2, optimizer="per-parameter")
    _in_optimizer_shards(sharded, 2)
    assert "last_optimizer_state" not in torch.load(part_path(sharded, 0), weights_only=False)
    outputs = [str(tmp_path / "out" / d / "model.pt") for d in ("whole", "sharded")]
    assert reshard_checkpoint.main(["--input", whole, "--output", outputs[0], "--model-parallel-size", "1",
                                    "--keep-optimizer"]) == 0
    assert reshard_checkpoint.main(["--input", sharded, "--output", outputs[1], "--model-parallel-size", "1",
                                    "--keep-optimizer"]) == 0
    (a,), (b,) = (_optimizer_state(o) for o in outputs)
    _assert_same_optimizer_state(a, b)
    assert len(a["state"]) > 10
