"""Clear errors for impossible configurations and bad checkpoints."""

import os

import pytest
import torch

from fairseq_megatron import parallel_state
from fairseq_megatron.checkpoint_resharding import CheckpointError, find_part_files, load_parts, part_path, reshard
from fairseq_megatron.cli import reshard_checkpoint
from tests.helpers import build_model, init_model_parallel, run_distributed


def _bad_dims_worker(rank, world_size):
    init_model_parallel(2)
    errors = {}
    for name, overrides in {
        "heads": dict(decoder_attention_heads=3, decoder_embed_dim=24),
        "ffn": dict(decoder_ffn_embed_dim=129),
    }.items():
        try:
            build_model(2, **overrides)
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    try:
        build_model(1)  # claims size 1 inside a group of 2
        errors["size"] = None
    except ValueError as e:
        errors["size"] = str(e)
    return {"tp": parallel_state.get_tensor_model_parallel_world_size(), "errors": errors}


def test_heads_and_ffn_must_divide_by_model_parallel_size(tmp_path):
    results = run_distributed(_bad_dims_worker, 2, tmp_path)
    for r in results:
        assert r["tp"] == 2
        assert r["errors"]["heads"] == "--decoder-attention-heads 3 is not divisible by --model-parallel-size 2"
        assert r["errors"]["ffn"] == "--decoder-ffn-embed-dim 129 is not divisible by --model-parallel-size 2"
        assert "configured for model-parallel size 1" in r["errors"]["size"]


def _world_not_divisible_worker(rank, world_size):
    try:
        parallel_state.initialize_model_parallel(2)
    except ValueError as e:
        return str(e)
    return None


def test_world_size_must_divide(tmp_path):
    results = run_distributed(_world_not_divisible_worker, 3, tmp_path)
    assert results == ["world size 3 is not divisible by --model-parallel-size 2"] * 3


def test_model_parallel_size_without_distributed_init():
    with pytest.raises(ValueError, match="configured for model-parallel size 2 but this run's model-parallel group has 1"):
        build_model(2)


def _save_parts(tmp_path, num_parts=2):
    """A real size-2 checkpoint, made by splitting a size-1 model's weights."""
    from argparse import Namespace

    from fairseq_megatron.checkpoint_resharding import split_model_state

    model, _ = build_model(1)
    path = str(tmp_path / "model.pt")
    for rank, part in enumerate(split_model_state(model.state_dict(), num_parts)):
        args = Namespace(model_parallel_size=num_parts, decoder_attention_heads=8, decoder_ffn_embed_dim=128)
        torch.save({"args": args, "model": part}, part_path(path, rank))
    return path


def test_reshard_errors(tmp_path, capsys):
    path = _save_parts(tmp_path)
    assert find_part_files(path) == [part_path(path, 0), part_path(path, 1)]

    # size that does not divide the heads (8) -> one line, exit 1, nothing written
    assert reshard_checkpoint.main(["--input", path, "--output", str(tmp_path / "out" / "m.pt"),
                                    "--model-parallel-size", "3"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: model-parallel size 3 does not divide the attention heads (8)"
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")

    # refuses to overwrite its input
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        reshard(path, path, 2)

    # truncated part
    with open(part_path(path, 1), "rb") as f:
        data = f.read()
    with open(part_path(path, 1), "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cannot read .*model-model_part-1.pt"):
        load_parts(path)

    # missing part
    os.remove(part_path(path, 1))
    with pytest.raises(CheckpointError, match="saved at model-parallel size 2 but 1 part file"):
        load_parts(path)
    os.remove(part_path(path, 0))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        find_part_files(path)


def test_mixed_parts_from_two_checkpoints(tmp_path):
    from argparse import Namespace

    from fairseq_megatron.checkpoint_resharding import split_model_state

    (tmp_path / "a").mkdir()
    path = _save_parts(tmp_path / "a")
    # part 1 of another (trained) checkpoint: its layer norms moved away from init
    other, _ = build_model(1, seed=99)
    with torch.no_grad():
        other.decoder.layers[0].final_layer_norm.weight.mul_(1.5)
    other_part = split_model_state(other.state_dict(), 2)[1]
    torch.save({"args": Namespace(model_parallel_size=2), "model": other_part}, part_path(path, 1))
    with pytest.raises(CheckpointError, match="final_layer_norm.weight differs between model part 0 and part 1"):
        reshard(path, str(tmp_path / "m.pt"), 1)
