"""``fairseq-megatron-reshard --to-hf``: a checkpoint saved in 2 model parts,
exported and loaded by transformers' ``XGLMForCausalLM``, computes what our
model computes at size 1 on the same ids (a full pass with right padding,
20 incremental steps through transformers' KV cache, greedy ``generate()``
on left-padded prompts), and bad input is one line with nothing written.

Tolerance (fp32): logits within 1e-5 of the logit scale (the largest
absolute logit). The weights are the same numbers; transformers' attention
(``bmm`` of pre-scaled queries, an additive mask) and ours (torch's
``scaled_dot_product_attention``) sum in another order, a few ULP per layer;
a wrong weight, position or mask is off by far more than 1e-3 of the scale.
"""

import json
import os

import pytest
import torch

from fairseq_megatron.checkpoint.hf_export import export_to_transformers, require_transformers
from fairseq_megatron.cli import reshard_checkpoint
from tests.helpers import make_dictionary
from tests.support.checkpoint_resharding import WORDS, build_at_size, save_checkpoint
from tests.support.full_disk import FullDiskAt

transformers = require_transformers()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Our model at size 1 and its export, made from the same 2 part files."""
    root = tmp_path_factory.mktemp("hf")
    src = str(root / "src" / "model.pt")
    os.makedirs(os.path.dirname(src))
    full = save_checkpoint(src, 2)
    out = str(root / "hf")
    dictionary = make_dictionary(WORDS)
    export_to_transformers(src, out, dictionary, max_shard_bytes=20_000)  # several shards
    args = torch.load(src.replace(".pt", "-model_part-0.pt"), weights_only=False)["cfg"]["model"]
    args.model_parallel_size = 1  # the same model in one process (its padded vocabulary, 64, recorded)
    ours, _ = build_at_size(1, args)
    ours.load_state_dict(full, strict=True)
    ours.eval()
    hf, loading = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    hf.eval()
    return {"dir": out, "src": src, "ours": ours, "hf": hf, "vocab": len(dictionary), "full": full,
            "loading": loading}


def _close(a, b):
    scale = b.abs().max().item()
    assert (a - b).abs().max().item() <= 1e-5 * scale, ((a - b).abs().max().item(), scale)


def _ours(exported, tokens):
    with torch.no_grad():
        return exported["ours"](tokens)[0][..., : exported["vocab"]]


def test_the_directory_is_what_transformers_writes(exported):
    files = sorted(os.listdir(exported["dir"]))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors", files
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "README.md"} <= set(files)
    config = json.load(open(os.path.join(exported["dir"], "config.json")))
    assert (config["model_type"], config["vocab_size"], config["tie_word_embeddings"]) == ("xglm", 4 + WORDS, True)
    generation = json.load(open(os.path.join(exported["dir"], "generation_config.json")))
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (2, 2, 1)
    assert generation["decoder_start_token_id"] == 2 and generation["suppress_tokens"] == [1]
    # every weight of the checkpoint, once, nothing else (the tied head is the embedding)
    index = json.load(open(os.path.join(exported["dir"], "model.safetensors.index.json")))["weight_map"]
    expected = {k.replace("decoder.", "model.", 1) for k in exported["full"] if k != "decoder.version"}
    assert set(index) == expected - {"model.output_projection.weight"}
    assert sorted(os.listdir(os.path.dirname(exported["dir"]))) == ["hf", "src"]  # no temporary directory left
    # transformers found every weight it expects, and no other
    assert type(exported["hf"]).__name__ == "XGLMForCausalLM"
    assert all(not keys for keys in exported["loading"].values()), exported["loading"]


def test_logits_equal_ours_with_right_padding(exported):
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(4, exported["vocab"], (3, 12), generator=generator)
    tokens[:, 0] = 2  # fairseq's LMs read </s> first
    lengths = [12, 9, 5]
    mask = torch.zeros_like(tokens)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
        tokens[row, length:] = 1  # right padding
    with torch.no_grad():
        theirs = exported["hf"](input_ids=tokens, attention_mask=mask).logits
    for row, length in enumerate(lengths):
        _close(theirs[row, :length], _ours(exported, tokens[row: row + 1, :length])[0])


def test_twenty_incremental_steps_through_the_kv_cache(exported):
    generator = torch.Generator().manual_seed(4)
    tokens = torch.randint(4, exported["vocab"], (2, 24), generator=generator)
    tokens[:, 0] = 2
    full = _ours(exported, tokens)  # 24 positions: past the 16 the model was built for, as both extend
    with torch.no_grad():
        out = exported["hf"](input_ids=tokens[:, :4], use_cache=True)
        _close(out.logits, full[:, :4])
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        for step in range(4, 24):
            out = exported["hf"](input_ids=tokens[:, step: step + 1], cache=cache, use_cache=True)
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            _close(out.logits[:, 0], full[:, step])


def _our_greedy(exported, prompt, steps):
    tokens = torch.tensor([prompt])
    for _ in range(steps):
        logits = _ours(exported, tokens)[0, -1]
        logits[1] = float("-inf")  # fairseq's generator never emits pad
        tokens = torch.cat([tokens, logits.argmax().view(1, 1)], dim=1)
        if tokens[0, -1].item() == 2:
            break
    return tokens[0, len(prompt):].tolist()


def test_greedy_generate_on_left_padded_prompts_equals_ours(exported):
    prompts = [[2, 10, 11, 12, 13, 14], [2, 20, 21], [2, 30, 31, 32, 33]]
    width = max(map(len, prompts))
    input_ids = torch.tensor([[1] * (width - len(p)) + p for p in prompts])
    mask = (input_ids != 1).long()
    with torch.no_grad():
        generated = exported["hf"].generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=8,
                                            do_sample=False)
    for row, prompt in enumerate(prompts):
        theirs = generated[row, width:].tolist()
        ours = _our_greedy(exported, prompt, 8)
        assert theirs[: len(ours)] == ours, (row, theirs, ours)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_pipelined_checkpoints_export_with_the_logits_of_one_stage(tmp_path, tied):
    """A checkpoint in 2 model parts x 2 pipeline stages, and the same
    resharded to one stage first: ``--to-hf`` of either stopped with "the
    config says the output projection is not tied to the embedding, and the
    weights say otherwise" for a model trained tied (the last stage holds its
    own copy of the embedding for the projection). Both now export, tied or
    not: transformers' model and fairseq's own ``transformer_lm`` loaded
    from ``--to-fairseq`` give the logits of our model at one stage with
    the same weights (tolerance: the module docstring's)."""
    from argparse import Namespace

    from fairseq.models.transformer_lm import TransformerLanguageModel

    from fairseq_megatron.checkpoint.export import export_to_fairseq
    from fairseq_megatron.checkpoint.resharding import reshard
    from tests.helpers import LMTask

    src, stages, one = (str(tmp_path / d / "model.pt") for d in ("src", "stages", "one"))
    os.makedirs(os.path.dirname(src))
    full = save_checkpoint(src, 2, share_decoder_input_output_embed=tied)
    reshard(src, stages, 2, new_stages=2)
    reshard(stages, one, 1)
    args = torch.load(src.replace(".pt", "-model_part-0.pt"), weights_only=False)["cfg"]["model"]
    args.model_parallel_size = 1
    ours, _ = build_at_size(1, args)
    ours.load_state_dict(full, strict=True)
    ours.eval()
    dictionary = make_dictionary(WORDS)
    tokens = torch.randint(4, len(dictionary), (2, 10), generator=torch.Generator().manual_seed(5))
    tokens[:, 0] = 2
    with torch.no_grad():
        expected = ours(tokens)[0]
    for path in (stages, one):
        name = os.path.basename(os.path.dirname(path))
        hf_dir = str(tmp_path / f"hf-{name}")
        export_to_transformers(path, hf_dir, dictionary)
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
        assert hf.config.tie_word_embeddings == tied
        with torch.no_grad():
            _close(hf(input_ids=tokens).logits, expected[..., : len(dictionary)])
        plain = str(tmp_path / f"plain-{name}" / "model.pt")
        export_to_fairseq(path, plain)
        state = torch.load(plain, weights_only=True)
        padded = make_dictionary(WORDS)
        padded.pad_to_multiple_(64)  # all 64 rows exported: a dictionary of that many symbols
        stock = TransformerLanguageModel.build_model(Namespace(**state["cfg"]["model"]), LMTask(padded))
        stock.load_state_dict(state["model"], strict=True)
        stock.eval()
        with torch.no_grad():
            _close(stock(tokens)[0], expected)
        # the dictionary's rows only (the CLI's export, --dict or the recorded size): each weight its own rows,
        # the untied projection not replaced by the embedding
        export_to_fairseq(path, plain, vocab_size=len(dictionary))
        state = torch.load(plain, weights_only=True)
        stock = TransformerLanguageModel.build_model(Namespace(**state["cfg"]["model"]), LMTask(dictionary))
        stock.load_state_dict(state["model"], strict=True)
        stock.eval()
        with torch.no_grad():
            _close(stock(tokens)[0], expected[..., : len(dictionary)])


def test_bad_input_is_one_line_and_writes_nothing(exported, tmp_path, capsys):
    out = tmp_path / "out"

    def refused(*argv):
        assert reshard_checkpoint.main(["--input", exported["src"], "--output", str(out), "--to-hf", *argv]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: "), err
        assert not out.exists() and [f for f in os.listdir(tmp_path) if f.startswith("out")] == []
        return err

    short = tmp_path / "short.txt"
    make_dictionary(WORDS - 1).save(str(short))
    assert "trained with" in refused("--dict", str(short))
    assert "--encoder-json and --vocab-bpe go together" in refused("--encoder-json", "e.json")
    full = tmp_path / "dict.txt"
    make_dictionary(WORDS).save(str(full))
    missing = refused("--dict", str(full), "--encoder-json", str(tmp_path / "no.json"), "--vocab-bpe",
                      str(tmp_path / "no.bpe"))
    assert "no.json" in missing
    assert "--to-fairseq and --to-hf" in refused("--to-fairseq")
    assert "--model-parallel-size 2" in refused("--model-parallel-size", "2")
    # an option XGLM cannot express: the checkpoint's config says learned positions
    learned = tmp_path / "learned" / "model.pt"
    os.makedirs(learned.parent)
    save_checkpoint(str(learned), 2)
    for part in (0, 1):
        path = str(learned).replace(".pt", f"-model_part-{part}.pt")
        state = torch.load(path, weights_only=False)
        state["cfg"]["model"].decoder_learned_pos = True
        torch.save(state, path)
    assert reshard_checkpoint.main(["--input", str(learned), "--output", str(out), "--to-hf"]) == 1
    assert "XGLM cannot express learned positions" in capsys.readouterr().err
    # an output directory that holds another model is left as it was
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert reshard_checkpoint.main(["--input", exported["src"], "--output", str(out), "--to-hf"]) == 1
    assert "holds files" in capsys.readouterr().err and os.listdir(out) == ["config.json"]


def test_a_directory_named_as_the_old_temporary_one_is_left_alone(exported, tmp_path):
    """``--to-hf --output D`` wrote into ``D.tmp/`` and removed whatever was
    there first without a word: a user's directory of that name, and the
    input itself when the checkpoint lived in it. The export now writes into
    a new directory of its own: ``D.tmp/`` and the input in it stay as they
    were."""
    import shutil

    user = tmp_path / "hf.tmp"
    user.mkdir()
    (user / "notes.txt").write_text("the user's\n")
    for name in os.listdir(os.path.dirname(exported["src"])):
        shutil.copy(os.path.join(os.path.dirname(exported["src"]), name), user / name)
    before = {name: (user / name).read_bytes() for name in os.listdir(user)}
    assert reshard_checkpoint.main(["--input", str(user / "model.pt"), "--output", str(tmp_path / "hf"),
                                    "--to-hf"]) == 0
    assert {name: (user / name).read_bytes() for name in os.listdir(user)} == before
    assert sorted(os.listdir(tmp_path)) == ["hf", "hf.tmp"] and "config.json" in os.listdir(tmp_path / "hf")


@pytest.mark.parametrize("error", ["ENOSPC", "safetensors"])
def test_a_full_disk_is_one_line_and_leaves_nothing(exported, tmp_path, capsys, monkeypatch, error):
    """safetensors fails to write the second shard (the disk filled), with
    an OSError or with the ``SafetensorError`` it raises on a full disk: one
    line with the reason and the bytes free, no output and no temporary
    directory (it was a traceback; the SafetensorError one still was)."""
    import safetensors.torch

    save = FullDiskAt(safetensors.torch.save_file, call=2, error=error)
    monkeypatch.setattr(safetensors.torch, "save_file", save)
    out = tmp_path / "out"
    dictionary = tmp_path / "dict.txt"
    make_dictionary(WORDS).save(str(dictionary))
    argv = ["--input", exported["src"], "--output", str(out), "--to-hf", "--dict", str(dictionary),
            "--max-shard-size", "0.00002"]
    assert reshard_checkpoint.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: cannot write {out}: No space left on device (") and err.endswith(
        " free there); nothing was written") and "\n" not in err, err
    assert len(save.calls) == 2 and os.listdir(tmp_path) == ["dict.txt"]


def test_every_file_of_the_export_has_the_mode_of_a_new_file(tmp_path):
    """safetensors writes its files 0o600: in a shared model directory only
    their owner could read the weights; every file now has the mode any new
    file gets under the umask (0o640 here, 0o644 under the usual 0o022)."""
    src = str(tmp_path / "src" / "model.pt")
    os.makedirs(os.path.dirname(src))
    save_checkpoint(src, 2)
    previous = os.umask(0o027)
    try:
        export_to_transformers(src, str(tmp_path / "hf"), make_dictionary(WORDS), max_shard_bytes=20_000)
    finally:
        os.umask(previous)
    modes = {name: os.stat(tmp_path / "hf" / name).st_mode & 0o777 for name in os.listdir(tmp_path / "hf")}
    assert any(name.endswith(".safetensors") for name in modes)
    assert set(modes.values()) == {0o640}, modes


def test_an_export_without_a_tokenizer_says_so(exported, tmp_path, capsys):
    """Without GPT-2's BPE files no tokenizer is written, and transformers'
    AutoTokenizer would then make an XGLM tokenizer of nothing (every word
    <unk>): the command says so in a line, with what to pass."""
    assert reshard_checkpoint.main(["--input", exported["src"], "--output", str(tmp_path / "hf"), "--to-hf"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("no tokenizer written: AutoTokenizer.from_pretrained(") and "--encoder-json" in err[-1]
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
