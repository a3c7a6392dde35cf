"""The tokenizer ``--to-hf`` writes: loaded by ``AutoTokenizer``, it gives for
each line the ids that fairseq's GPT-2 pipeline gives (our BPE encoder,
``examples/megatron_11b/bpe_encode.py``, which a test holds to fairseq's
own encoder, then the fairseq dictionary), behind the ``</s>`` a fairseq LM
reads first; dictionaries it cannot reproduce, and bad BPE files, are one
line."""

import json
import os
import sys

import pytest
from fairseq.data import Dictionary

from fairseq_megatron.checkpoint.hf_export import require_transformers
from fairseq_megatron.checkpoint.hf_tokenizer import fairseq_gpt2_tokenizer
from fairseq_megatron.errors import UsageError
from tests.support.bpe_text import VARIED

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "examples", "megatron_11b"))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import bpe_encode  # noqa: E402  isort:skip  (from the folders above)
import make_corpus  # noqa: E402  isort:skip

transformers = require_transformers()

LINES = VARIED + [""]  # and a blank line


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """GPT-2-format BPE files trained here, a dict.txt listing every id (as
    fairseq's GPT-2 dictionary does; in another order than encoder.json's,
    with counts), and a few thousand lines of text."""
    from tokenizers import ByteLevelBPETokenizer

    root = tmp_path_factory.mktemp("gpt2")
    stdlib = make_corpus.sysconfig.get_paths()["stdlib"]
    lines = make_corpus.build_corpus(make_corpus.stdlib_files(stdlib), stdlib, max_bytes=400_000)["train"]
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(lines[::2] + LINES, vocab_size=700, min_frequency=2, show_progress=False)
    tok.save_model(str(root))
    encoder_json, vocab_bpe = str(root / "vocab.json"), str(root / "merges.txt")
    with open(vocab_bpe) as f:  # GPT-2's vocab.bpe starts with a version line, as tokenizers writes it
        assert f.readline().startswith("#version")
    ids = sorted(json.load(open(encoder_json)).values(), key=lambda i: (i * 7919) % 1009)
    dict_path = root / "dict.txt"
    dict_path.write_text("".join(f"{i} {1000 - n}\n" for n, i in enumerate(ids)))
    text = lines + LINES * 20
    assert len(text) > 2000 and text.count("") >= 20
    return {"encoder_json": encoder_json, "vocab_bpe": vocab_bpe, "dict": str(dict_path), "text": text}


def test_ids_equal_fairseqs_line_by_line(gpt2, tmp_path):
    dictionary = Dictionary.load(gpt2["dict"])
    fairseq_gpt2_tokenizer(gpt2["encoder_json"], gpt2["vocab_bpe"], dictionary).save_pretrained(str(tmp_path))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    bpe = bpe_encode.GPT2BPE(gpt2["encoder_json"], gpt2["vocab_bpe"])
    differing = []
    for line in gpt2["text"]:
        # bpe_encode.py strips each line; fairseq-preprocess looks each id up and appends </s>
        expected = [2] + [dictionary.index(str(i)) for i in bpe.encode(line.strip())]
        if tokenizer(line.strip())["input_ids"] != expected:
            differing.append(line)
    assert differing == []
    ids = tokenizer("naïve café 😀")["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "naïve café 😀"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id) == (
        2, 2, 1, 3)


def test_dictionaries_and_files_it_cannot_use_are_one_line(gpt2, tmp_path):
    full = Dictionary.load(gpt2["dict"])
    short = Dictionary()
    for symbol in full.symbols[full.nspecial:-1]:  # one GPT-2 id left out: fairseq reads it as <unk>
        short.add_symbol(symbol)
    with pytest.raises(UsageError, match=r"^--dict lacks 1 of the \d+ GPT-2 ids .* cannot reproduce"):
        fairseq_gpt2_tokenizer(gpt2["encoder_json"], gpt2["vocab_bpe"], short)
    words = Dictionary()
    words.add_symbol("hello")
    with pytest.raises(UsageError, match="not a GPT-2 BPE dictionary"):
        fairseq_gpt2_tokenizer(gpt2["encoder_json"], gpt2["vocab_bpe"], words)
    no_header = tmp_path / "merges.txt"
    no_header.write_text("".join(open(gpt2["vocab_bpe"]).readlines()[1:]))
    with pytest.raises(UsageError, match="no '#version' header"):
        fairseq_gpt2_tokenizer(gpt2["encoder_json"], str(no_header), full)
    empty = tmp_path / "empty.bpe"
    empty.write_text("#version: 0.2\n")
    with pytest.raises(UsageError, match="holds no merges"):
        fairseq_gpt2_tokenizer(gpt2["encoder_json"], str(empty), full)
    not_encoder = tmp_path / "list.json"
    not_encoder.write_text("[1, 2]")
    with pytest.raises(UsageError, match="not a JSON object of piece -> id"):
        fairseq_gpt2_tokenizer(str(not_encoder), gpt2["vocab_bpe"], full)
