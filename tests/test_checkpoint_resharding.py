"""Resharding checkpoint files between model-parallel sizes, and export to stock fairseq.

Logit tolerance (fp32): rtol=atol=1e-5, as in test_model_parity.py: the
weights are bitwise the same at every size; only the order of the fp32 sums
in row-parallel layers and the gathered vocabulary changes (~1e-6).
"""

import copy
import os
import re
import subprocess
import sys
from argparse import Namespace

import pytest
import torch

from fairseq_megatron.checkpoint.layout import CheckpointError, split_model_state
from fairseq_megatron.checkpoint.export import export_to_fairseq
from fairseq_megatron.checkpoint.part_files import find_part_files, output_paths, part_path
from fairseq_megatron.checkpoint.resharding import PartFiles, reshard, resharded_model
from fairseq_megatron.cli import reshard_checkpoint
from fairseq_megatron.models.model_parallel_transformer_lm import ModelParallelTransformerLanguageModel
from fairseq_megatron.parallel import parallel_state
from tests.helpers import LMTask, make_batch, make_dictionary, model_args, run_distributed

TOL = dict(rtol=1e-5, atol=1e-5)
# 4 specials + 50 words = 54 symbols: padded to 56 at size 1, to 64 at size 2.
WORDS = 50


def _build(size, args=None, seed=0):
    torch.manual_seed(seed)
    args = args or model_args(size)
    model = ModelParallelTransformerLanguageModel.build_model(args, LMTask(make_dictionary(WORDS)))
    return model, args


def optimizer_states(names, moments, num_parts, layout):
    """``last_optimizer_state`` of each of ``num_parts`` model parts for Adam
    with the given full-size moments ``{parameter name: (exp_avg,
    exp_avg_sq)}``, as fairseq saves it: ``"per-parameter"`` (torch's
    optimizer state dict, one entry per parameter in ``model.parameters()``
    order) or ``"flat"`` (fairseq's FP16Optimizer: one fp32 tensor of all
    parameters, and the loss scale)."""
    split = [split_model_state({n: moments[n][which] for n in names}, num_parts) for which in (0, 1)]
    states = []
    for rank in range(num_parts):
        avg, avg_sq = split[0][rank], split[1][rank]
        if layout == "per-parameter":
            state = {i: {"step": torch.tensor(5.0), "exp_avg": avg[n], "exp_avg_sq": avg_sq[n]}
                     for i, n in enumerate(names)}
            groups = [{"lr": 1e-3, "betas": (0.9, 0.98), "params": list(range(len(names)))}]
            states.append({"state": state, "param_groups": groups})
        else:
            flat = {"step": 5, "exp_avg": torch.cat([avg[n].reshape(-1) for n in names]),
                    "exp_avg_sq": torch.cat([avg_sq[n].reshape(-1) for n in names])}
            groups = [{"lr": 1e-3, "betas": (0.9, 0.98), "params": [0]}]
            states.append({"state": {0: flat}, "param_groups": groups, "loss_scale": 64.0})
    return states


def save_checkpoint(path, num_parts, style="cfg", seed=0, legacy_format=False, optimizer="placeholder", ema=False):
    """A checkpoint as fairseq-train writes it at ``num_parts`` model parts.

    The weights come from a model built at size 2 in this process (so the
    vocabulary is padded to 64 = a multiple of 16), split into parts.
    ``legacy_format``: saved as PyTorch < 1.6 did (not a zip archive).
    ``optimizer``: ``"per-parameter"`` or ``"flat"`` writes Adam moments
    (see :func:`optimizer_states`) and returns them with the weights,
    ``None`` no optimizer state; the default a placeholder. ``ema``: also
    the EMA state dicts of fairseq-train ``--store-ema --ema-fp32`` (an EMA
    model with other weights, tied like the model's), returned as
    ``(weights, EMA weights)``.
    """
    import fairseq_megatron.parallel.parallel_state as ps

    assert ps.get_tensor_model_parallel_world_size() == 1
    # build "as if" at size 2: pad the vocabulary the way size 2 would
    args = model_args(1, padded_vocab_size=64)
    model, args = _build(1, args, seed)
    with torch.no_grad():  # move layer norms away from their init, as training would
        for n, p in model.named_parameters():
            if "layer_norm" in n or n.endswith("out_proj.bias") or n.endswith("fc2.bias"):
                p.add_(torch.randn_like(p) * 0.1)
    args.model_parallel_size = num_parts
    full = model.state_dict()
    if ema:
        ema_model = copy.deepcopy(model)
        with torch.no_grad():
            for p in ema_model.parameters():
                p.mul_(0.5).add_(0.25)
        ema_full = ema_model.state_dict()
        ema_parts = split_model_state(ema_full, num_parts)
    names = [n for n, _ in model.named_parameters()]  # the order fairseq's trainer gives the optimizer
    generator = torch.Generator().manual_seed(seed + 100)
    moments = {n: (torch.randn(p.shape, generator=generator), torch.rand(p.shape, generator=generator))
               for n, p in model.named_parameters()}
    if optimizer in ("per-parameter", "flat"):
        optimizer_state = optimizer_states(names, moments, num_parts, optimizer)
    else:
        optimizer_state = [{"state": {0: torch.zeros(3)}} if optimizer else None] * num_parts
    for rank, (out, part) in enumerate(zip(output_paths(path, num_parts), split_model_state(full, num_parts))):
        state = {
            "model": part,
            "optimizer_history": [{"num_updates": 5}],
            "extra_state": {"rng_tracker_states": {"model-parallel-rng": {"seed": rank}}, "epoch": 1},
        }
        if optimizer_state[rank] is not None:
            state["last_optimizer_state"] = optimizer_state[rank]
        if ema:
            state["extra_state"]["ema"] = ema_parts[rank]
            state["extra_state"]["ema_fp32_params"] = {k: v.clone() for k, v in ema_parts[rank].items()}
        if style == "cfg":
            state["cfg"] = {"common": {"model_parallel_size": num_parts}, "model": Namespace(**vars(args))}
        else:
            state["args"] = Namespace(**vars(args))
        torch.save(state, out, _use_new_zipfile_serialization=not legacy_format)
    if optimizer in ("per-parameter", "flat"):
        return full, names, moments
    return (full, ema_full) if ema else full


def _models(path):
    return [torch.load(f, weights_only=False)["model"] for f in find_part_files(path)]


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


def _logits_worker(rank, world_size, path, tokens):
    from tests.helpers import init_model_parallel

    init_model_parallel(world_size)
    state = torch.load(part_path(path, rank) if world_size > 1 else path, weights_only=False)
    model, _ = _build(world_size, state["cfg"]["model"])
    model.load_state_dict(state["model"], strict=True)
    model.eval()
    with torch.no_grad():
        return {"tp": parallel_state.get_tensor_model_parallel_world_size(), "logits": model(tokens)[0]}


def test_resharded_parts_give_the_same_logits_at_sizes_1_2_4(tmp_path):
    src = str(tmp_path / "src" / "model.pt")
    os.makedirs(os.path.dirname(src))
    save_checkpoint(src, 2)
    paths = {n: str(tmp_path / f"mp{n}" / "model.pt") for n in (1, 2, 4)}
    for n, p in paths.items():
        reshard(src, p, n)
    tokens, _ = make_batch(make_dictionary(WORDS), seed=4)

    # size 1 in this process: the model pads 54 symbols to the recorded 64
    state = torch.load(paths[1], weights_only=False)
    model, args = _build(1, state["cfg"]["model"])
    assert args.padded_vocab_size == 64
    model.load_state_dict(state["model"], strict=True)
    model.eval()
    with torch.no_grad():
        reference = model(tokens)[0]
    for n in (2, 4):
        for r in run_distributed(_logits_worker, n, tmp_path / f"run{n}", paths[n], tokens):
            assert r["tp"] == n
            torch.testing.assert_close(r["logits"], reference, **TOL)


STOCK_FAIRSEQ = r"""
import sys, torch
from omegaconf import OmegaConf
import fairseq.models
from fairseq.data import Dictionary
assert "fairseq_megatron" not in sys.modules
path, tokens_path, out_path, words = sys.argv[1:5]
state = torch.load(path, weights_only=True)  # plain tensors and Python values only
d = Dictionary()
for i in range(int(words)):
    d.add_symbol(f"w{i}")
class Task:
    source_dictionary = target_dictionary = d
cfg = OmegaConf.create(state["cfg"])
model = fairseq.models.build_model(cfg.model, Task(), from_checkpoint=True)
model.load_state_dict(state["model"], strict=True)
model.eval()
with torch.no_grad():
    torch.save(model(torch.load(tokens_path))[0], out_path)
print(type(model).__name__)
"""


@pytest.mark.parametrize("cut_vocab", [False, True], ids=["all-rows", "cut-to-dictionary"])
def test_export_to_fairseq_loads_in_stock_transformer_lm(tmp_path, cut_vocab):
    src = str(tmp_path / "src" / "model.pt")
    os.makedirs(os.path.dirname(src))
    save_checkpoint(src, 2)
    merged = str(tmp_path / "mp1" / "model.pt")
    reshard(src, merged, 1)
    exported = str(tmp_path / "plain" / "model.pt")
    vocab = 4 + WORDS if cut_vocab else None
    export_to_fairseq(src, exported, vocab_size=vocab)

    tokens, _ = make_batch(make_dictionary(WORDS), seed=5)
    torch.save(tokens, tmp_path / "tokens.pt")
    # stock fairseq builds len(dictionary) rows: pad the test dictionary like the data's would be
    words = WORDS if cut_vocab else 64 - 4
    proc = subprocess.run([sys.executable, "-c", STOCK_FAIRSEQ, exported, str(tmp_path / "tokens.pt"),
                           str(tmp_path / "stock.pt"), str(words)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("TransformerLanguageModel")
    stock = torch.load(tmp_path / "stock.pt")

    state = torch.load(merged, weights_only=False)
    model, _ = _build(1, state["cfg"]["model"])
    model.load_state_dict(state["model"], strict=True)
    model.eval()
    with torch.no_grad():
        ours = model(tokens)[0]
    rows = 4 + WORDS if cut_vocab else 64
    assert stock.shape[-1] == rows
    torch.testing.assert_close(stock, ours[..., :rows], **TOL)


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
        1, "error: --dict is read only with --to-fairseq: resharding keeps every vocabulary row")
    assert run("--to-fairseq", "--model-parallel-size", "2") == (  # was: exit 0, the size ignored
        1, "error: --to-fairseq writes one checkpoint for fairseq's transformer_lm: --model-parallel-size 2 "
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
    assert rc == 1 and err.startswith("error: cannot read ") and "model-model_part-1.pt" in err
    assert len(err.splitlines()) == 1

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
