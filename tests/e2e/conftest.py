"""The checkpoints the end-to-end tests share, each made once per pytest
worker (session scope); tests that change one copy it first.

- ``trained``: one small run of fairseq-train at model-parallel size 2 on
  text from the standard library's docstrings.
- ``gpt2_files`` and ``small_megatron``: a byte-level BPE vocabulary in
  GPT-2's file format, and a folder laid out like the published
  Megatron-11b (``dict.txt`` listing every GPT-2 id, as fairseq's GPT-2
  dictionary does, and ``model-model_part-{0,1}.pt`` trained on text encoded
  with it), with Wikitext-style raw text and a held-out binarized test split.
"""

import json
import shutil

import pytest
from fairseq.data import Dictionary

from fairseq_megatron import USER_DIR
from tests.e2e.common import DETOK, RAW, binarized_corpus, bpe_encode, make_corpus, train_args
from tests.helpers import fairseq


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    data, ckpt = binarized_corpus(root, max_bytes=300_000), str(root / "ckpt")
    # fresh interpreters under torchrun, as a user runs it; the tests' own runs fork theirs (tests.helpers.fairseq)
    _, log = fairseq("train", train_args(data, ckpt, max_update=4), nproc=2, preloaded=False)
    return {"root": root, "data": data, "ckpt": ckpt, "first_log": log}


@pytest.fixture(scope="session")
def gpt2_files(tmp_path_factory):
    """A byte-level BPE vocabulary saved in GPT-2's format, trained on stdlib docstrings + RAW."""
    from tokenizers import ByteLevelBPETokenizer

    root = tmp_path_factory.mktemp("bpe")
    stdlib = make_corpus.sysconfig.get_paths()["stdlib"]
    text = make_corpus.build_corpus(make_corpus.stdlib_files(stdlib), stdlib, max_bytes=200_000)["train"]
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(text + DETOK + ["naïve café — Zürich 東京 😀"], vocab_size=600, min_frequency=2,
                            show_progress=False)
    tok.save_model(str(root))
    return str(root / "vocab.json"), str(root / "merges.txt"), root


@pytest.fixture(scope="session")
def small_megatron(gpt2_files, tmp_path_factory):
    encoder_json, vocab_bpe, _ = gpt2_files
    root = tmp_path_factory.mktemp("megatron")
    stdlib = make_corpus.sysconfig.get_paths()["stdlib"]
    corpus = make_corpus.build_corpus(make_corpus.stdlib_files(stdlib), stdlib, max_bytes=150_000)
    bpe = bpe_encode.GPT2BPE(encoder_json, vocab_bpe)
    for split, lines in (("train", corpus["train"] + DETOK), ("test", corpus["test"][:40])):
        (root / f"{split}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        bpe_encode.encode_files(bpe, [str(root / f"{split}.txt")], [str(root / f"{split}.bpe")])
    # every GPT-2 id, the most frequent in training first, padded as fairseq-preprocess pads
    dictionary = Dictionary()
    for line in (root / "train.bpe").read_text().splitlines():
        for gpt2_id in line.split():
            dictionary.add_symbol(gpt2_id)
    for gpt2_id in sorted(json.load(open(encoder_json)).values()):
        dictionary.add_symbol(str(gpt2_id), n=0)
    dictionary.finalize(padding_factor=8)
    dictionary.save(str(root / "dict.txt"))
    fairseq("preprocess", ["--only-source", "--srcdict", str(root / "dict.txt"), "--trainpref",
                           str(root / "train.bpe"), "--testpref", str(root / "test.bpe"), "--destdir",
                           str(root / "bin")])
    ckpt = root / "ckpt"
    fairseq("train", [str(root / "bin"), "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling",
                      "--arch", "transformer_lm_megatron_11b", "--decoder-layers", "2", "--decoder-embed-dim", "64",
                      "--decoder-ffn-embed-dim", "256", "--decoder-attention-heads", "4",
                      "--share-decoder-input-output-embed", "--criterion", "vocab_parallel_cross_entropy",
                      "--model-parallel-size", "2", "--tokens-per-sample", "64", "--batch-size", "4",
                      "--optimizer", "adam", "--lr", "0.002", "--max-update", "10", "--save-dir", str(ckpt),
                      "--no-epoch-checkpoints", "--disable-validation", "--seed", "2"], nproc=2)
    folder = root / "megatron_small"
    folder.mkdir()
    shutil.copy(root / "bin" / "dict.txt", folder / "dict.txt")
    for r in (0, 1):
        shutil.copy(ckpt / f"checkpoint_last-model_part-{r}.pt", folder / f"model-model_part-{r}.pt")
    raw_dir = root / "wikitext-103-raw"
    raw_dir.mkdir()
    (raw_dir / "wiki.test.raw").write_text("\n".join(RAW * 3) + "\n", encoding="utf-8")
    return {"folder": folder, "raw_dir": raw_dir, "root": root, "data": str(root / "bin"),
            "test_lines": corpus["test"][:40]}
