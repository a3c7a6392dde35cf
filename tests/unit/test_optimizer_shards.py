"""Optimizer state in shards (fairseq_megatron/checkpoint/optimizer_shards.py)
in one process: torch's Adam state by parameter key and back, shards joined
as ``torch.chunk`` cut them, the shard files of one save found under their
staged or final names, and the manifest that lists them. The sharded runs
themselves are tests/e2e/test_fully_sharded.py."""

import json
import os

import pytest
import torch

from fairseq_megatron.checkpoint import optimizer_shards as shards
from fairseq_megatron.checkpoint.commit import read_manifest, write_manifest
from fairseq_megatron.checkpoint.layout import CheckpointError
from fairseq_megatron.checkpoint.names import staged_name


def _adam_state():
    """torch's Adam after one step of a two-layer model: entries numbered by torch in parameter order."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer.state_dict()


def test_adam_state_by_key_and_back():
    model, state = _adam_state()
    keys = [name for name, _ in model.named_parameters()]
    entries, rest = shards.by_key(state, keys)
    # torch numbers the parameters in model.parameters() order: entry i is named_parameters()'s i-th
    for index, (name, param) in enumerate(model.named_parameters()):
        assert entries[name]["exp_avg"] is state["state"][index]["exp_avg"]
        assert entries[name]["exp_avg"].shape == param.shape
    assert rest == {"param_groups": state["param_groups"]}
    again = shards.as_optimizer_state(entries, keys, rest)
    assert again["param_groups"] == state["param_groups"] and again["state"].keys() == state["state"].keys()
    with pytest.raises(ValueError, match="for 4 parameters, the model has 3"):
        shards.by_key(state, keys[:3])


def test_shards_cut_by_torch_chunk_join_whole_at_any_count():
    """FSDP2 gives rank r the r-th ``torch.chunk`` of dimension 0 (fewer
    rows on the last ranks, none where the rows run out); joined in rank
    order the shards are the whole value, whatever their number."""
    model, state = _adam_state()
    keys = [name for name, _ in model.named_parameters()]
    entries, rest = shards.by_key(state, keys)
    for count in (1, 2, 4, 8):  # 8 > the 6 rows of the first weight: ranks without rows
        saved = []
        for rank in range(count):
            local = {key: {name: (torch.chunk(v, count)[rank] if rank < len(torch.chunk(v, count))
                                  else v.narrow(0, 0, 0)) if torch.is_tensor(v) and v.dim() else v
                           for name, v in values.items()} for key, values in entries.items()}
            shapes = {f"{key}.{name}": tuple(v.shape) for key, values in entries.items()
                      for name, v in values.items() if torch.is_tensor(v) and v.dim()}
            saved.append({"entries": local, "shapes": shapes, "rest": rest})
        for key in keys:
            joined = shards.join_one(saved, key)
            assert torch.equal(joined["exp_avg"], entries[key]["exp_avg"])
            assert torch.equal(joined["exp_avg_sq"], entries[key]["exp_avg_sq"])
            assert torch.equal(joined["step"], entries[key]["step"])  # not sharded: rank 0's
    saved[0]["entries"][keys[0]]["exp_avg"] = saved[0]["entries"][keys[0]]["exp_avg"][:0]
    with pytest.raises(ValueError, match=r"join to \(5, 4\), not its \(6, 4\)"):
        shards.join_one(saved, keys[0])


def _save_shards(part, count, token, staged=()):
    model, state = _adam_state()
    keys = [name for name, _ in model.named_parameters()]
    for rank in range(count):
        path = shards.shard_path(part, rank)
        torch.save(shards.shard_state(state, keys, token, rank, count), staged_name(path, token) if rank in staged
                   else path)
    return model, state, keys


def test_the_shards_of_one_save_read_under_staged_or_final_names(tmp_path):
    part = str(tmp_path / "checkpoint_last-model_part-1.pt")
    token = "0" * 32
    model, state, keys = _save_shards(part, 2, token, staged=(1,))  # a kill left shard 1 under its staged name
    assert shards.shard_path(part, 1) == str(tmp_path / "checkpoint_last-model_part-1-optimizer-1.pt")
    assert shards.part_of_shard(shards.shard_path(part, 1)) == part
    read = shards.read_shards(part, 2, token)
    assert [r["rank"] for r in read] == [0, 1]
    placed = shards.optimizer_state_for({"optimizer_shards": 2}, part, token, dict(model.named_parameters()))
    for index in range(len(keys)):  # plain parameters: the whole state, numbered as torch numbers it
        assert torch.equal(placed["state"][index]["exp_avg"], state["state"][index]["exp_avg"])
    with pytest.raises(CheckpointError, match="is not rank 0 of the 2 shards of the save of"):
        shards.read_shards(part, 2, "1" * 32)  # another save's token
    os.remove(shards.shard_path(part, 0))
    with pytest.raises(CheckpointError, match=r"optimizer shard .*-optimizer-0.pt of .* is missing \(the part was "
                                              r"saved with 2\): restore it, or resume with --reset-optimizer"):
        shards.read_shards(part, 2, token)
    with pytest.raises(CheckpointError, match="the model has 3"):  # a state of other parameters
        shards.optimizer_state_for({"last_optimizer_state": state}, part, token,
                                   dict(list(model.named_parameters())[:3]))


def test_a_manifest_lists_the_shards_of_its_parts_only(tmp_path):
    checkpoint = str(tmp_path / "checkpoint_last.pt")
    token = "a" * 32
    # a model in one part: the manifest lists the checkpoint itself, and its shards
    write_manifest(checkpoint, token, 4, [checkpoint], [shards.shard_path(checkpoint, r) for r in range(2)])
    assert read_manifest(checkpoint)["optimizer_shards"] == ["checkpoint_last-optimizer-0.pt",
                                                             "checkpoint_last-optimizer-1.pt"]
    parts = [str(tmp_path / f"checkpoint_last-model_part-{k}.pt") for k in range(2)]
    write_manifest(checkpoint, token, 4, parts, shards.shard_paths(parts, 2))
    assert len(read_manifest(checkpoint)["optimizer_shards"]) == 4
    for name in ("../checkpoint_last-model_part-0-optimizer-0.pt", "checkpoint_best-model_part-0-optimizer-0.pt",
                 "checkpoint_last-model_part-2-optimizer-0.pt", "checkpoint_last-model_part-0.pt"):
        record = {"token": token, "updates": 4, "parts": [os.path.basename(p) for p in parts],
                  "optimizer_shards": [name]}
        with open(checkpoint + ".manifest.json", "w") as f:
            json.dump(record, f)
        with pytest.raises(CheckpointError, match="which is not the name of an optimizer shard of a part of"):
            read_manifest(checkpoint)


def test_a_shard_cut_short_or_corrupted_is_one_line_before_it_is_read(tmp_path):
    """Every shard file's CRC-32s are checked before its state is used:
    flipped bytes in a moment would otherwise be trained on; an empty or
    cut file is named as such (torch's own message speaks of mmap)."""
    part = str(tmp_path / "checkpoint_last-model_part-0.pt")
    token = "0" * 32
    _save_shards(part, 2, token)
    path = shards.shard_path(part, 1)
    whole = open(path, "rb").read()
    advice = "restore it, or resume with --reset-optimizer to start the optimizer afresh"
    for cut in (whole[:0], whole[:len(whole) // 2], whole[:-30]):
        with open(path, "wb") as f:
            f.write(cut)
        with pytest.raises(CheckpointError) as e:
            shards.read_shards(part, 2, token)
        assert str(e.value) == f"optimizer shard {path} is cut short or not a checkpoint ({len(cut)} bytes): {advice}"
    # one byte of a moment flipped: the file is whole, its record no longer matches its CRC-32
    with open(path, "wb") as f:
        f.write(whole)
    moment = torch.load(path, weights_only=True)["entries"]["0.weight"]["exp_avg"]
    data = moment.flatten().numpy().tobytes()
    offset = whole.index(data)
    flipped = bytearray(whole)
    flipped[offset + 3] ^= 0xFF
    with open(path, "wb") as f:
        f.write(flipped)
    with pytest.raises(CheckpointError, match=rf"^optimizer shard {path} is corrupted: its record .* does not match "
                                              rf"the CRC-32 stored when it was saved \(the file changed since\): "
                                              rf"{advice}$"):
        shards.read_shards(part, 2, token)


def test_a_save_of_fewer_shards_removes_the_shards_beyond_them(tmp_path):
    """A run resumed at a smaller data-parallel size saves fewer shards
    under the same name: the shards of the larger size's other ranks go,
    and nothing else does."""
    from fairseq_megatron.checkpoint.saving import remove_optimizer_shards

    part = str(tmp_path / "checkpoint_last-model_part-0.pt")
    names = [shards.shard_path(part, rank) for rank in range(4)] + [
        str(tmp_path / "checkpoint_last-model_part-0-optimizer-notes.pt"),  # not a shard's name
        shards.shard_path(str(tmp_path / "checkpoint_last-model_part-1.pt"), 3)]  # another part's
    for name in names:
        open(name, "w").close()
    remove_optimizer_shards(part, beyond=2)
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(n) for n in names[:2] + names[4:])
    remove_optimizer_shards(part)
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(n) for n in names[4:])


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch ran-from-a-shard",))


def test_a_shard_that_would_run_code_names_what_it_holds(tmp_path, monkeypatch):
    """A ``__reduce__`` payload in an optimizer shard was refused with
    torch's "Re-running torch.load with weights_only set to False will
    likely succeed"; it is refused as a part file is: the class named, and
    the variable that opts in for files one trusts. Nothing runs."""
    monkeypatch.chdir(tmp_path)
    part = str(tmp_path / "checkpoint_last-model_part-0.pt")
    token = "0" * 32
    _save_shards(part, 2, token)
    shard = torch.load(shards.shard_path(part, 1), weights_only=False)
    shard["payload"] = _RunsCode()
    torch.save(shard, shards.shard_path(part, 1))
    with pytest.raises(CheckpointError) as refused:
        shards.read_shards(part, 2, token)
    said = str(refused.value)
    assert "posix.system" in said and "FAIRSEQ_MEGATRON_TRUST_CHECKPOINTS=1" in said and "will likely" not in said
    assert not os.path.exists(tmp_path / "ran-from-a-shard")
