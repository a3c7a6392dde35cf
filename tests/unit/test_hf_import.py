"""``fairseq-megatron-reshard --from-hf``, in one process: the dictionary it
writes and the ids our BPE pipeline gets from it, the model at size 1
through the hub, the round trip through ``--to-hf``, and every refusal
(one line, exit 1, nothing written).

Tolerance of the log-probabilities: 1e-5 (max abs), fp32 on both sides: the
same weights, summed in another order (a few fp32 ulps of logits of
magnitude ~20); a row out of place or left unmasked is off by far more.
"""

import json
import os
import shutil

import pytest
import torch
from fairseq.data import Dictionary

from fairseq_megatron.checkpoint import safe_loading
from fairseq_megatron.checkpoint.hf_export import export_to_transformers, require_transformers
from fairseq_megatron.checkpoint.hf_import import import_from_transformers
from fairseq_megatron.checkpoint.hf_vocabulary import same_rows_plan, shifted_plan
from fairseq_megatron.cli import reshard_checkpoint
from fairseq_megatron.models.masked_vocab_rows import format_rows, parse_rows
from tests.e2e.common import bpe_encode
from tests.helpers import make_dictionary
from tests.support import hf_models
from tests.support.bpe_text import VARIED
from tests.support.checkpoint_resharding import WORDS, save_checkpoint
from tests.support.files import file_contents
from tests.support.partition import expected_partition_dim

require_transformers()

pytestmark = pytest.mark.slow  # seconds each (models built, processes started): left out of make test-fast
TOLERANCE = 1e-5  # see the module docstring


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    encoder_json, vocab_bpe = hf_models.small_bpe(root / "bpe")
    dirs = {}
    for name, build in hf_models.BUILDERS.items():
        dirs[name] = str(root / name)
        build(dirs[name], encoder_json, vocab_bpe)
    return {"root": root, "encoder_json": encoder_json, "vocab_bpe": vocab_bpe, **dirs}


def _bpe(sources):
    return ["--encoder-json", sources["encoder_json"], "--vocab-bpe", sources["vocab_bpe"]]


def test_the_two_vocabulary_plans_row_by_row():
    # GPT-2 with 6 rows (ids 0-5), end-of-text 5, padded to 16: fairseq's specials, then the rows shifted by 4
    plan = shifted_plan(rows=6, tokens=6, eos_row=5, symbols=[str(k) for k in range(6)], multiple=16)
    assert plan.source_rows == [-1, -1, 5, -1, 0, 1, 2, 3, 4, 5] + [-1] * 6
    assert plan.masked == [0, 1, 3, 9, 10, 11, 12, 13, 14, 15]  # no source row, and end-of-text's second row (9)
    assert (plan.dictionary_size, plan.padded_vocab_size) == (10, 16)
    # OPT-like: 10 rows of which 8 tokens, padded to 16: the rows as they are, the source's 2 extra rows kept
    plan = same_rows_plan(rows=10, symbols=["7", "8", "9", "<mask>"], multiple=16)
    assert plan.source_rows == list(range(10)) + [-1] * 6 and plan.masked == list(range(10, 16))
    assert format_rows(plan.masked) == "10-15" and format_rows([0, 1, 3, 9, 10, 11]) == "0-1,3,9-11"
    assert [list(r) for r in parse_rows("0-1,3,9-11")] == [[0, 1], [3], [9, 10, 11]]


@pytest.mark.parametrize("name", ["gpt2", "opt", "xglm"])
def test_our_bpe_and_the_imported_dictionary_give_the_tokenizers_ids(sources, name, tmp_path):
    """examples/megatron_11b/bpe_encode.py (GPT-2 BPE ids), then the imported
    dict.txt as fairseq-preprocess reads it, against the model's own
    transformers tokenizer without special tokens: GPT-2's ids shifted past
    fairseq's 4 special symbols, OPT's and XGLM's the same ids."""
    import_from_transformers(sources[name], str(tmp_path / "model.pt"), 1, 1, sources["encoder_json"],
                             sources["vocab_bpe"])
    dictionary = Dictionary.load(str(tmp_path / "dict.txt"))
    bpe = bpe_encode.GPT2BPE(sources["encoder_json"], sources["vocab_bpe"])
    shift = 4 if name == "gpt2" else 0
    for line, theirs in zip(VARIED, hf_models.source_ids(sources[name], VARIED)):
        ours = [dictionary.index(str(i)) for i in bpe.encode(line)]
        assert ours == [i + shift for i in theirs], line
        assert dictionary.unk() not in ours


def test_size_1_in_one_process_through_the_hub(sources, tmp_path):
    """GPT-2 whose logits sit far below 0, imported at size 1 and loaded by
    the hub in this process: transformers' log-softmax over the whole output."""
    from fairseq_megatron.hub import from_pretrained

    path = str(tmp_path / "model.pt")
    import_from_transformers(sources["gpt2"], path, 1)
    ids = torch.tensor([hf_models.source_ids(sources["gpt2"], [" ".join(VARIED)])[0][:40]])
    theirs = hf_models.source_log_probs(sources["gpt2"], ids)
    model = list(from_pretrained(path, cpu=True).models)[0]
    model.eval()
    with torch.no_grad():
        logits = model(ids + 4)[0]
        ours = torch.log_softmax(logits.double(), -1)
    rows = theirs.size(-1)  # 301: the BPE's 300 pieces and end-of-text
    assert logits[..., 4:4 + rows - 1].max() < -5  # as real models' logits: a zero row would take it all
    assert (ours[..., 4:4 + rows - 1] - theirs[..., :rows - 1]).abs().max() <= TOLERANCE
    assert (ours[..., 2] - theirs[..., rows - 1]).abs().max() <= TOLERANCE  # </s> is end-of-text
    masked = [0, 1, 3, 4 + rows - 1] + list(range(4 + rows, ours.size(-1)))
    assert torch.isneginf(ours[..., masked]).all()


def test_to_hf_then_from_hf_gives_back_the_checkpoint_bitwise(tmp_path):
    """Our checkpoint (2 parts) exported to transformers with its dictionary,
    imported again at size 2: every weight bitwise, the vocabulary rows up
    to the dictionary's size; the same dict.txt order; the padding rows the
    export dropped come back zero and masked."""
    src = str(tmp_path / "src" / "model.pt")
    os.makedirs(os.path.dirname(src))
    full = save_checkpoint(src, 2)
    dictionary = make_dictionary(WORDS)
    dictionary.save(str(tmp_path / "src" / "dict.txt"))
    export_to_transformers(src, str(tmp_path / "hf"), dictionary)
    assert Dictionary.load(str(tmp_path / "hf" / "dict.txt")).symbols == dictionary.symbols
    back = str(tmp_path / "back" / "model.pt")
    import_from_transformers(str(tmp_path / "hf"), back, 2)
    parts = [safe_loading.load(back.replace(".pt", f"-model_part-{r}.pt"))["model"] for r in (0, 1)]
    rows = len(dictionary)  # 54
    for key, expected in full.items():
        if key.endswith("version") or key == "decoder.embed_positions._float_tensor":
            continue
        dim = expected_partition_dim(key)
        whole = parts[0][key] if dim is None else torch.cat([p[key] for p in parts], dim)
        if key in ("decoder.embed_tokens.weight", "decoder.output_projection.weight"):
            assert torch.equal(whole[:rows], expected[:rows]) and not whole[rows:].any(), key
        else:
            assert torch.equal(whole, expected), key
    assert Dictionary.load(os.path.join(os.path.dirname(back), "dict.txt")).symbols == dictionary.symbols
    config = torch.load(back.replace(".pt", "-model_part-0.pt"), weights_only=False)["cfg"]["model"]
    assert config.masked_vocab_rows == f"{rows}-{config.padded_vocab_size - 1}"


def _copy(sources, name, tmp_path) -> str:
    directory = str(tmp_path / f"source-{name}")
    shutil.copytree(sources[name], directory)
    return directory


def _edit_config(directory, **fields):
    path = os.path.join(directory, "config.json")
    config = json.load(open(path))
    config.update(fields)
    json.dump(config, open(path, "w"))


def test_bad_input_is_one_line_and_writes_nothing(sources, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("the user's file")

    def refused(directory, *argv, size="2"):
        before = file_contents(tmp_path)
        rc = reshard_checkpoint.main(["--from-hf", directory, "--output", str(out / "model.pt"),
                                      "--model-parallel-size", size, *argv])
        err = capsys.readouterr().err.strip()
        assert rc == 1 and len(err.splitlines()) == 1 and err.startswith("error: "), err
        assert file_contents(tmp_path) == before  # nothing written, nothing left half-written
        return err

    gpt2, opt = _copy(sources, "gpt2", tmp_path), _copy(sources, "opt", tmp_path)
    # the architecture, and each configuration field fairseq's decoder cannot express, named
    other = _copy(sources, "gpt2", tmp_path / "llama")
    _edit_config(other, architectures=["LlamaForCausalLM"], model_type="llama")
    assert "LlamaForCausalLM is not imported" in refused(other)
    for field, value in (("scale_attn_by_inverse_layer_idx", True), ("reorder_and_upcast_attn", True),
                         ("activation_function", "relu"), ("layer_norm_epsilon", 1e-6)):
        edited = _copy(sources, "gpt2", tmp_path / field)
        _edit_config(edited, **{field: value})
        assert f"GPT2LMHeadModel with {field} = {value!r}" in refused(edited)
    for field, value in (("do_layer_norm_before", False), ("word_embed_proj_dim", 16), ("enable_bias", False),
                         ("layer_norm_elementwise_affine", False), ("_remove_final_layer_norm", True)):
        edited = _copy(sources, "opt", tmp_path / field)
        _edit_config(edited, **{field: value})
        assert f"OPTForCausalLM with {field} = {value!r}" in refused(edited, *_bpe(sources))
    # the weights: a tensor of the wrong shape, a truncated file, an index naming a missing shard
    from safetensors.torch import load_file, save_file

    weights = load_file(os.path.join(gpt2, "model.safetensors"))
    weights["transformer.h.1.mlp.c_fc.weight"] = weights["transformer.h.1.mlp.c_fc.weight"][:, :64].contiguous()
    wrong = _copy(sources, "gpt2", tmp_path / "wrong")
    save_file(weights, os.path.join(wrong, "model.safetensors"), metadata={"format": "pt"})
    assert "transformer.h.1.mlp.c_fc.weight has shape (32, 64), its config.json gives (32, 128)" in refused(wrong)
    cut = _copy(sources, "gpt2", tmp_path / "cut")
    data = open(os.path.join(cut, "model.safetensors"), "rb").read()
    open(os.path.join(cut, "model.safetensors"), "wb").write(data[: len(data) // 2])
    said = refused(cut)
    assert "cannot read" in said and "model.safetensors" in said
    sharded = _copy(sources, "gpt2", tmp_path / "sharded")
    os.remove(os.path.join(sharded, "model.safetensors"))
    json.dump({"metadata": {}, "weight_map": {"transformer.wte.weight": "model-00001-of-00002.safetensors"}},
              open(os.path.join(sharded, "model.safetensors.index.json"), "w"))
    assert "model-00001-of-00002.safetensors is missing" in refused(sharded)
    # sizes, tokenizers and BPE files
    assert "--model-parallel-size 8 does not divide the attention heads (4)" in refused(gpt2, size="8")
    fewer = _copy(sources, "opt", tmp_path / "fewer")
    _edit_config(fewer, vocab_size=100)
    weights = load_file(os.path.join(fewer, "model.safetensors"))
    weights["model.decoder.embed_tokens.weight"] = weights["model.decoder.embed_tokens.weight"][:100].contiguous()
    save_file(weights, os.path.join(fewer, "model.safetensors"), metadata={"format": "pt"})
    assert "100 embedding rows (vocab_size) for the 307 entries of its tokenizer" in refused(fewer, *_bpe(sources))
    assert "pass --encoder-json" in refused(opt)
    encoder = json.load(open(sources["encoder_json"]))
    lacking = tmp_path / "lacking.json"
    json.dump({piece: i for piece, i in encoder.items() if piece != "Ġcapital"}, open(lacking, "w"))
    assert "lacks the token 'Ġcapital'" in refused(opt, "--encoder-json", str(lacking), "--vocab-bpe",
                                                  sources["vocab_bpe"])
    assert "--encoder-json and --vocab-bpe go together" in refused(opt, "--encoder-json", sources["encoder_json"])
    sentencepiece = _copy(sources, "xglm", tmp_path / "sentencepiece")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(os.path.join(sentencepiece, name))
    open(os.path.join(sentencepiece, "sentencepiece.bpe.model"), "wb").write(b"\0")
    assert "SentencePiece vocabulary (facebook/xglm-*), which is not imported" in refused(sentencepiece)
    no_config = _copy(sources, "gpt2", tmp_path / "no-config")
    os.remove(os.path.join(no_config, "config.json"))
    assert "holds no config.json" in refused(no_config)
    assert "--to-hf cannot apply" in refused(gpt2, "--to-hf")
    # an output directory whose dict.txt is another vocabulary's
    (out / "dict.txt").write_text("hello 1\n")
    assert "holds another vocabulary" in refused(gpt2)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch ran",))


def test_pytorch_model_bin_is_read_without_running_code(sources, tmp_path, capsys):
    """transformers' older ``pytorch_model.bin`` imports as its safetensors
    do, bitwise, read with the weights-only unpickler: a file that would run
    code is one line, and nothing ran."""
    from safetensors.torch import load_file

    binary = _copy(sources, "gpt2", tmp_path / "bin")
    weights = load_file(os.path.join(binary, "model.safetensors"))
    os.remove(os.path.join(binary, "model.safetensors"))
    torch.save(weights, os.path.join(binary, "pytorch_model.bin"))
    import_from_transformers(sources["gpt2"], str(tmp_path / "a" / "model.pt"), 2)
    import_from_transformers(binary, str(tmp_path / "b" / "model.pt"), 2)
    for part in (0, 1):
        a, b = (safe_loading.load(str(tmp_path / d / f"model-model_part-{part}.pt"))["model"] for d in "ab")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    torch.save({**weights, "payload": _RunsCode()}, os.path.join(binary, "pytorch_model.bin"))
    rc = reshard_checkpoint.main(["--from-hf", binary, "--output", str(tmp_path / "c" / "model.pt"),
                                  "--model-parallel-size", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and "pytorch_model.bin" in err, err
    assert not os.path.exists("ran") and not (tmp_path / "c").exists()


def test_an_import_writes_a_new_checkpoint_alone_and_leaves_nothing_when_stopped(sources, tmp_path, capsys,
                                                                                monkeypatch):
    """An import over an existing checkpoint replaced it (a fine-tuned one
    too) and two at once into one directory left two layouts; one stopped
    by an error or Ctrl-C left its new directory behind."""
    from fairseq_megatron.checkpoint import hf_import
    from fairseq_megatron.fairseq_integration.save_dir import one_writer

    def run(output, *argv):
        rc = reshard_checkpoint.main(["--from-hf", sources["gpt2"], "--output", str(output),
                                      "--model-parallel-size", "2", *argv])
        return rc, capsys.readouterr().err.strip()

    out = tmp_path / "first" / "model.pt"
    assert run(out)[0] == 0
    before = file_contents(tmp_path / "first")
    rc, err = run(out)
    assert rc == 1 and err == (f"error: {tmp_path / 'first' / 'model-model_part-0.pt'} exists: the import writes a "
                               f"new checkpoint and replaces none; choose another --output, or remove the checkpoint "
                               f"that is there")
    assert file_contents(tmp_path / "first") == before
    with one_writer(str(tmp_path / "busy"), "--save-dir busy"):  # a training, or another import, writing there
        rc, err = run(tmp_path / "busy" / "model.pt")
    assert rc == 1 and "is in use: another fairseq-train run or import holds its lock" in err
    assert os.listdir(tmp_path / "busy") == []

    def stopped(error):
        def write(*args, **kwargs):
            raise error
        return write

    from fairseq_megatron.checkpoint.part_files import write_error

    for error, code, said in ((write_error(str(tmp_path / "x"), OSError(28, "No space left on device")), 1,
                               "error: cannot write "),
                              (KeyboardInterrupt(), 130, "interrupted: ")):
        monkeypatch.setattr(hf_import, "save_verified", stopped(error))
        rc, err = run(tmp_path / "new" / "deeper" / "model.pt")
        assert rc == code and err.splitlines()[-1].startswith(said), err
        assert not (tmp_path / "new").exists()  # the directories it made went with it


def test_weights_that_are_not_floating_point_or_finite_and_a_foreign_tokenizer_are_refused(sources, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    def refused(directory, *argv):
        rc = reshard_checkpoint.main(["--from-hf", str(directory), "--output", str(tmp_path / "out" / "model.pt"),
                                      "--model-parallel-size", "1", *argv])
        err = capsys.readouterr().err.strip()
        assert rc == 1 and len(err.splitlines()) == 1 and not (tmp_path / "out").exists(), err
        return err

    for name, change, said in (("int", lambda t: t.to(torch.int32), "are int32, not floating point"),
                               ("nan", lambda t: t.index_fill(0, torch.tensor([3]), float("nan")),
                                "hold NaN or infinite values")):
        edited = _copy(sources, "gpt2", tmp_path / name)
        weights = load_file(os.path.join(edited, "model.safetensors"))
        weights["transformer.wte.weight"] = change(weights["transformer.wte.weight"])
        save_file(weights, os.path.join(edited, "model.safetensors"), metadata={"format": "pt"})
        assert said in refused(edited)
    foreign = _copy(sources, "gpt2", tmp_path / "foreign")
    tokenizer = json.load(open(os.path.join(foreign, "tokenizer.json")))
    tokenizer["model"]["vocab"] = {"a": 0}
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["id"] < 1]
    json.dump(tokenizer, open(os.path.join(foreign, "tokenizer.json"), "w"))
    assert "eos_token_id = 300: the directory's tokenizer has 1 tokens and none of that id" in refused(foreign)
    assert "is a file: give the directory" in refused(os.path.join(sources["gpt2"], "model.safetensors"))
    assert refused(sources["opt"], "--encoder-json", "/no.json", "--vocab-bpe", sources["vocab_bpe"]) == \
        "error: --encoder-json /no.json: no such file"


def test_resharding_an_import_carries_its_dictionary_and_an_export_keeps_the_sources_rows(sources, tmp_path):
    """The resharding tool writes dict.txt beside its output (the hub read
    the output's directory and failed); --to-hf of an imported XGLM with
    rows beyond its tokenizer keeps them, so the export computes the
    source's log-probabilities (it dropped them: another softmax)."""
    from fairseq_megatron.checkpoint.hf_export import export_to_transformers

    source = str(tmp_path / "xglm")
    hf_models.xglm(source, sources["encoder_json"], sources["vocab_bpe"], extra_rows=8)
    ours = str(tmp_path / "ours" / "model.pt")
    import_from_transformers(source, ours, 2, 1, sources["encoder_json"], sources["vocab_bpe"])
    assert reshard_checkpoint.main(["--input", ours, "--output", str(tmp_path / "one" / "model.pt"),
                                    "--model-parallel-size", "1"]) == 0
    assert (tmp_path / "one" / "dict.txt").read_bytes() == (tmp_path / "ours" / "dict.txt").read_bytes()
    dictionary = Dictionary.load(str(tmp_path / "one" / "dict.txt"))
    export_to_transformers(str(tmp_path / "one" / "model.pt"), str(tmp_path / "export"), dictionary,
                           sources["encoder_json"], sources["vocab_bpe"])
    ids = torch.tensor([hf_models.source_ids(source, [" ".join(VARIED)])[0][:40]])
    theirs, exported = (hf_models.source_log_probs(d, ids) for d in (source, str(tmp_path / "export")))
    assert exported.shape == theirs.shape and theirs.size(-1) == len(dictionary) + 8  # 8 rows beyond the tokens
    assert (exported - theirs).abs().max() <= TOLERANCE
