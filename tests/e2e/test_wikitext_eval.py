"""The Wikitext-103 evaluation pipeline (examples/megatron_11b), on small data made here.

A byte-level BPE vocabulary in GPT-2's file format (encoder.json + vocab.bpe)
is trained with HF tokenizers; a small checkpoint is trained with the plugin
at model-parallel size 2 on text encoded with it."""

import math
import os
import shutil
import sys

import pytest

from tests.e2e.common import DETOK, RAW
from tests.support.bpe_text import VARIED

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "examples", "megatron_11b"))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import bpe_encode  # noqa: E402  isort:skip  (from the folders above)
import detok  # noqa: E402  isort:skip
import eval_wikitext103  # noqa: E402  isort:skip
import renormalize_ppl  # noqa: E402  isort:skip

# Whitespace tokens + 1 end-of-sentence per non-empty line, counted by hand:
# "= Valkyria Chronicles III =" 5+1; "It sold 2 @,@ 000 copies in 2011 – 2012 , they said ." 14+1;
# "The game 's battle system is a role @-@ playing one ." 12+1; "= = Gameplay = =" 5+1;
# "Its score was 7 @.@ 5 out of 10 ." 10+1
ORIG_TOKENS = 6 + 15 + 13 + 6 + 11


def _args(gpt2_files, small_megatron, work, **changes):
    encoder_json, vocab_bpe, _ = gpt2_files
    opts = {"--raw-dir": small_megatron["raw_dir"], "--checkpoint-dir": small_megatron["folder"],
            "--encoder-json": encoder_json, "--vocab-bpe": vocab_bpe, "--split": "test",
            "--model-parallel-size": 2, "--work-dir": work, "--context-window": 16,
            "--tokens-per-sample": 32, "--batch-size": 4, "--workers": 1, "--cpu": None}
    opts.update(changes)
    argv = []
    for k, v in opts.items():
        argv += [k] if v is None else [k, str(v)]
    return argv


def test_detokenizer_on_wikitext_lines():
    assert [detok.detokenize_line(line) for line in RAW] == DETOK


def test_detok_cli_reads_compressed_files(tmp_path):
    import gzip

    src = tmp_path / "wiki.test.raw.gz"
    with gzip.open(src, "wt", encoding="utf-8") as f:
        f.write("\n".join(RAW) + "\n")
    out = tmp_path / "out.txt"
    assert detok.main([str(src), "--output", str(out), "--workers", "2"]) == 0
    assert out.read_text(encoding="utf-8").split("\n")[:-1] == DETOK


def test_renormalization_reproduces_the_published_number():
    assert round(renormalize_ppl.renormalized_ppl(8.46, 270847, 245566), 2) == 10.54
    assert renormalize_ppl.renormalized_ppl(8.46, 1000, 1000) == pytest.approx(8.46, rel=1e-12)
    assert renormalize_ppl.renormalized_ppl(8.46, 1100, 1000) > 8.46 > renormalize_ppl.renormalized_ppl(8.46, 900, 1000)
    # same total log-likelihood in both units
    ppl = renormalize_ppl.renormalized_ppl(20.0, 270847, 245566)
    assert math.log2(ppl) * 245566 == pytest.approx(math.log2(20.0) * 270847, rel=1e-12)
    with pytest.raises(ValueError):
        renormalize_ppl.renormalized_ppl(8.46, 0, 10)


def test_token_counts(tmp_path):
    raw = tmp_path / "wiki.test.raw"
    raw.write_text("\n".join(RAW) + "\n", encoding="utf-8")
    assert renormalize_ppl.count_orig_tokens(str(raw)) == ORIG_TOKENS
    bpe = tmp_path / "x.bpe"
    bpe.write_text("1 2 3\n4\n", encoding="utf-8")
    assert renormalize_ppl.count_bpe_tokens(str(bpe)) == 3 + 1 + 1 + 1


def test_bpe_ids_equal_fairseqs_gpt2_encoder(gpt2_files):
    from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

    encoder_json, vocab_bpe, _ = gpt2_files
    reference = get_encoder(encoder_json, vocab_bpe)
    ours = bpe_encode.GPT2BPE(encoder_json, vocab_bpe)
    for text in VARIED + DETOK:
        assert ours.encode(text) == reference.encode(text), text
    assert ours.encode_batch(VARIED, workers=2) == [reference.encode(t) for t in VARIED]
    assert len(set(ours.encode(" ".join(VARIED)))) > 50  # a real vocabulary, not bytes only


def test_bpe_cli_drops_empty_lines_like_fairseq(gpt2_files, tmp_path):
    from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

    encoder_json, vocab_bpe, _ = gpt2_files
    src = tmp_path / "in.txt"
    src.write_text("\n".join(DETOK) + "\n", encoding="utf-8")
    out, out_keep = tmp_path / "out.bpe", tmp_path / "keep.bpe"
    base = ["--encoder-json", encoder_json, "--vocab-bpe", vocab_bpe, "--inputs", str(src)]
    assert bpe_encode.main(base + ["--outputs", str(out)]) == 0
    assert bpe_encode.main(base + ["--outputs", str(out_keep), "--keep-empty"]) == 0
    reference = get_encoder(encoder_json, vocab_bpe)
    expected = [" ".join(map(str, reference.encode(l.strip()))) for l in DETOK if l.strip()]
    assert out.read_text().split("\n")[:-1] == expected
    assert len(out_keep.read_text().split("\n")[:-1]) == len(DETOK)


def _text_clis(gpt2_files, src, output):
    """(main, argv, output flag) of detok.py and bpe_encode.py reading ``src`` into ``output``."""
    encoder_json, vocab_bpe, _ = gpt2_files
    return [(detok.main, [str(src), "--output", str(output)], "--output"),
            (bpe_encode.main, ["--encoder-json", encoder_json, "--vocab-bpe", vocab_bpe, "--inputs", str(src),
                               "--outputs", str(output)], "--outputs")]


def _usage_error(main, argv, capsys):
    """The last line ``main(argv)`` wrote to standard error, after it exited with argparse's status 2."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_detok_and_bpe_clis_refuse_bad_files_and_outputs_in_one_line(gpt2_files, tmp_path, capsys):
    """An output in a directory that does not exist was a traceback after
    the work (detok), and an output that is a directory an error after it;
    a malformed encoder.json or vocab.bpe was a bare JSON
    message or a KeyError traceback. Each is now one line naming the file,
    before any output is written."""
    encoder_json, vocab_bpe, _ = gpt2_files
    src = tmp_path / "in.txt"
    src.write_text("\n".join(RAW) + "\n", encoding="utf-8")
    missing = tmp_path / "missing" / "out.txt"
    a_directory = tmp_path / "a_directory"  # was found at the final rename, after the work
    a_directory.mkdir()
    for output, said in [(missing, f"{missing}: no such directory"),
                         (a_directory, f"{a_directory} is a directory: name a file in it")]:
        for main, argv, flag in _text_clis(gpt2_files, src, output):
            assert _usage_error(main, argv, capsys).endswith(f"error: {flag} {said}")
    assert os.listdir(a_directory) == [] and sorted(os.listdir(tmp_path)) == ["a_directory", "in.txt"]

    not_json, a_list, bad_merge = tmp_path / "e.txt", tmp_path / "list.json", tmp_path / "vocab.bpe"
    not_json.write_text("Ġt 1\n")
    a_list.write_text("[1, 2]")
    lines = open(vocab_bpe, encoding="utf-8").read().split("\n")
    bad_merge.write_text("\n".join(lines[:3] + ["Ġ t h"] + lines[3:]), encoding="utf-8")
    for encoder, merges, message in [
        (str(not_json), vocab_bpe, f"error: --encoder-json {not_json} is not JSON: Expecting value"),
        (str(a_list), vocab_bpe, f"error: --encoder-json {a_list} is not a JSON object of symbol -> id"),
        (encoder_json, str(bad_merge),
         f"error: --vocab-bpe {bad_merge} line 4 is not a merge of two GPT-2 byte symbols: 'Ġ t h'"),
    ]:
        out = tmp_path / "out.bpe"
        assert bpe_encode.main(["--encoder-json", encoder, "--vocab-bpe", merges, "--inputs", str(src),
                                "--outputs", str(out)]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith(message) and len(err.splitlines()) == 1, err
        assert not out.exists()


def test_detok_and_bpe_clis_leave_a_file_named_as_their_old_temporary_name(gpt2_files, tmp_path):
    """The input named as the output plus ``.tmp`` (``detok.py x.txt.tmp
    --output x.txt``): both tools wrote their output to ``x.txt.tmp`` and
    renamed it, so the input was gone and the output was the tool's own
    text. The temporary file is now a name of its own: the input stays,
    byte for byte, the output is written, and nothing else is left."""
    src = tmp_path / "x.txt.tmp"
    src.write_text("\n".join(RAW) + "\n", encoding="utf-8")
    before = src.read_bytes()
    out = tmp_path / "x.txt"
    for main, argv, _ in _text_clis(gpt2_files, src, out):
        assert main(argv) == 0
        assert src.read_bytes() == before and out.stat().st_size > 0
        assert sorted(os.listdir(tmp_path)) == ["x.txt", "x.txt.tmp"]
        out.unlink()


def test_detok_and_bpe_clis_never_overwrite_their_input_and_name_bad_bytes(gpt2_files, tmp_path, capsys):
    """The output named as the input replaced the input text, exit 0; a
    merges file that is empty, only its header or another file (encoder.json)
    encoded with no merges ("some text here" -> 14 ids instead of 4), exit 0;
    a byte that is not UTF-8 was "position 0" of some chunk. Each is now one
    line before any output is written, naming the file (and the line and
    byte offset of the bad byte)."""
    encoder_json, vocab_bpe, _ = gpt2_files
    src = tmp_path / "in.txt"
    src.write_text("\n".join(RAW) + "\n", encoding="utf-8")
    before = src.read_bytes()
    for main, argv, flag in _text_clis(gpt2_files, src, src):
        assert _usage_error(main, argv, capsys).endswith(
            f"error: {flag} {src} is the input {src}: writing it would replace the input; name another file")
        assert src.read_bytes() == before

    empty, header_only, strings = tmp_path / "empty.bpe", tmp_path / "header.bpe", tmp_path / "strings.json"
    empty.write_text("")
    header_only.write_text("#version: 0.2\n")
    strings.write_text('{"a": "b"}')
    out = tmp_path / "out.bpe"
    for encoder, merges, message in [
        (encoder_json, str(empty), f"error: --vocab-bpe {empty} does not start with the '#version' line of GPT-2's "
                                   f"merges file: ''"),
        (encoder_json, encoder_json, f"error: --vocab-bpe {encoder_json} does not start with the '#version' line"),
        (encoder_json, str(header_only), f"error: --vocab-bpe {header_only} holds no merges"),
        (str(strings), vocab_bpe, f"error: --encoder-json {strings} is not a JSON object of symbol -> id"),
    ]:
        assert bpe_encode.main(["--encoder-json", encoder, "--vocab-bpe", merges, "--inputs", str(src),
                                "--outputs", str(out)]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith(message) and len(err.splitlines()) == 1, err
        assert not out.exists()

    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"first line\nsecond\nthe third \xff line\n")
    said = f"error: {bad}: line 3, byte 28: not UTF-8 (invalid start byte: b'\\xff')"
    assert detok.main([str(bad), "--output", str(out)]) == 1
    assert capsys.readouterr().err.strip() == said and not out.exists()
    assert bpe_encode.main(["--encoder-json", encoder_json, "--vocab-bpe", vocab_bpe, "--inputs", str(bad),
                            "--outputs", str(out)]) == 1
    assert capsys.readouterr().err.strip() == said and not out.exists()


def test_whole_pipeline_end_to_end(gpt2_files, small_megatron, tmp_path, capsys):
    from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

    work = tmp_path / "work"
    assert eval_wikitext103.main(_args(gpt2_files, small_megatron, work)) == 0
    out = capsys.readouterr().out
    reference = get_encoder(*gpt2_files[:2])
    expected_new = sum(len(reference.encode(l)) + 1 for l in DETOK * 3 if l)  # fairseq's encoder, + eos per line
    ppl = float(out.split("unnormalized perplexity ")[1].split()[0])
    assert f"over {expected_new:,} BPE tokens" in out
    assert f"over {3 * ORIG_TOKENS:,} original tokens" in out
    renormalized = float(out.split("renormalized perplexity ")[1].split()[0])
    assert renormalized == pytest.approx(renormalize_ppl.renormalized_ppl(ppl, expected_new, 3 * ORIG_TOKENS), abs=0.01)
    assert 1 < ppl < 700  # a trained model over a ~600-symbol vocabulary

    # Second run, on 4 processes (two data-parallel groups at model-parallel
    # size 2): every step's output exists and is reused, and the groups'
    # scores are summed into the same perplexity over the same token counts
    # (printed with 2 decimals; fp32 summation order differs by ~1e-6).
    assert eval_wikitext103.main(_args(gpt2_files, small_megatron, work, **{"--gpus": 4})) == 0
    again = capsys.readouterr().out
    assert again.count("exists, skipped") == 3
    assert "2 data-parallel group(s)" in again
    assert f"over {expected_new:,} BPE tokens" in again
    for key in ("unnormalized perplexity ", "renormalized perplexity "):
        assert float(again.split(key)[1].split()[0]) == pytest.approx(float(out.split(key)[1].split()[0]), abs=0.011)

    # Third run, one process at model-parallel size 1 on the same 2 part
    # files (as the 8 published parts on one GPU): eval-lm builds the whole
    # model in memory; same perplexity, same tolerance.
    assert eval_wikitext103.main(_args(gpt2_files, small_megatron, work, **{"--model-parallel-size": 1})) == 0
    merged = capsys.readouterr().out
    assert "model-parallel size 1, 1 data-parallel group(s)" in merged
    assert f"over {expected_new:,} BPE tokens" in merged
    for key in ("unnormalized perplexity ", "renormalized perplexity "):
        assert float(merged.split(key)[1].split()[0]) == pytest.approx(float(out.split(key)[1].split()[0]), abs=0.011)


def test_bad_inputs_give_one_error_line(gpt2_files, small_megatron, tmp_path, capsys):
    def run(**changes):
        rc = eval_wikitext103.main(_args(gpt2_files, small_megatron, tmp_path / "w", **changes))
        err = capsys.readouterr().err.strip()
        return rc, err

    rc, err = run(**{"--raw-dir": tmp_path / "nowhere"})
    assert rc == 1 and err.startswith("error: missing raw file: ") and len(err.splitlines()) == 1

    rc, err = run(**{"--model-parallel-size": 3})
    assert rc == 1 and err == "error: model-parallel size 3 does not divide the attention heads (4)"

    rc, err = run(**{"--gpus": 3})
    assert rc == 1 and err == "error: --gpus 3 is not a multiple of --model-parallel-size 2"

    not_json = tmp_path / "encoder.txt"
    not_json.write_text("Ġt 1\n")
    rc, err = run(**{"--encoder-json": not_json, "--work-dir": tmp_path / "w_json"})
    assert rc == 1 and err.startswith(f"error: --encoder-json {not_json} is not JSON") and len(err.splitlines()) == 1
    assert os.listdir(tmp_path / "w_json") == []  # refused before detokenizing

    bad = tmp_path / "bad_dict"
    shutil.copytree(small_megatron["folder"], bad)
    with open(bad / "dict.txt", "a") as f:
        f.writelines(f"{100000 + i} 1\n" for i in range(40))
    rc, err = run(**{"--checkpoint-dir": bad})
    assert rc == 1 and "does not belong to this checkpoint" in err and len(err.splitlines()) == 1

    empty = tmp_path / "empty_raw"
    empty.mkdir()
    (empty / "wiki.test.raw").write_text("\n \n\n", encoding="utf-8")
    rc, err = run(**{"--raw-dir": empty})
    assert rc == 1 and "empty" in err and len(err.splitlines()) == 1
