#!/usr/bin/env python
"""GPT-2 BPE encoding, id for id what fairseq's ``multiprocessing_bpe_encoder`` writes, fast.

    python examples/megatron_11b/bpe_encode.py --encoder-json encoder.json --vocab-bpe vocab.bpe \\
        --inputs wiki.test.detok --outputs wiki.test.bpe [--keep-empty] [--workers 4]

Each input line is stripped and written as space-separated token ids.
Empty lines are dropped unless ``--keep-empty``; with several input/output
pairs, a line number whose line is empty in *any* input is dropped from all
of them (as fairseq's encoder does). The byte-pair merges run in tiktoken
(Rust) with a rank table built from the two GPT-2 files; the ids are those of
``encoder.json``, and a test checks them against
``fairseq.data.encoders.gpt2_bpe_utils``. Prints the throughput (MB/s).
"""

import argparse
import contextlib
import io
import json
import sys
import time
from typing import Dict, List, Sequence

import tiktoken
from output_files import check_output, utf8_text, write_whole

# GPT-2's pre-tokenizer (fairseq gpt2_bpe_utils.Encoder.pat), in tiktoken's syntax.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (openai/gpt-2 encoder.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class GPT2BPE:
    """GPT-2 byte-level BPE over tiktoken.

    tiktoken merges the adjacent pair whose *result* has the lowest rank;
    GPT-2 merges the pair listed first in ``vocab.bpe``. Ranking every merge
    result by its line in ``vocab.bpe`` (single bytes first) makes the two
    procedures identical; ``ids`` maps ranks back to ``encoder.json`` ids.

    Raises:
        ValueError: ``encoder.json`` is not a JSON object of symbol -> id;
            ``vocab.bpe`` is not UTF-8, lacks its ``#version`` header or
            holds no merges, a line of it is not a merge of two GPT-2 byte
            symbols, or a merge or byte of it is missing from ``encoder.json``.
    """

    def __init__(self, encoder_json: str, vocab_bpe: str):
        with open(encoder_json, encoding="utf-8") as f:
            try:
                encoder = json.load(f)
            except ValueError as e:
                raise ValueError(f"--encoder-json {encoder_json} is not JSON: {e}") from None
        if not isinstance(encoder, dict) or not all(type(i) is int for i in encoder.values()):
            raise ValueError(f"--encoder-json {encoder_json} is not a JSON object of symbol -> id")
        with open(vocab_bpe, "rb") as f:
            lines = utf8_text(f.read(), vocab_bpe).split("\n")
        if not lines[0].startswith("#version"):
            raise ValueError(f"--vocab-bpe {vocab_bpe} does not start with the '#version' line of GPT-2's "
                             f"merges file: {lines[0][:80]!r}")
        if not any(line.strip() for line in lines[1:]):
            raise ValueError(f"--vocab-bpe {vocab_bpe} holds no merges")
        byte_decoder = {c: b for b, c in bytes_to_unicode().items()}

        def to_bytes(symbol: str) -> bytes:
            return bytes(byte_decoder[c] for c in symbol)

        ranks: Dict[bytes, int] = {bytes([b]): b for b in range(256)}
        for number, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            merge = line.split()
            if len(merge) != 2 or not all(c in byte_decoder for c in "".join(merge)):
                raise ValueError(f"--vocab-bpe {vocab_bpe} line {number} is not a merge of two GPT-2 byte "
                                 f"symbols: {line[:80]!r}")
            merged = to_bytes("".join(merge))
            if merged not in ranks:
                ranks[merged] = len(ranks)
        ids = [0] * len(ranks)  # rank -> encoder.json id
        by_bytes = {}
        for symbol, i in encoder.items():
            if all(c in byte_decoder for c in symbol):  # skips special tokens such as <|endoftext|>
                by_bytes.setdefault(to_bytes(symbol), i)
        for token, rank in ranks.items():
            if token not in by_bytes:
                raise ValueError(f"{vocab_bpe}: token {token!r} is not in {encoder_json}")
            ids[rank] = by_bytes[token]
        self.ids = ids
        self.encoding = tiktoken.Encoding("gpt2-files", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                          special_tokens={})

    def encode(self, text: str) -> List[int]:
        ids = self.ids
        return [ids[r] for r in self.encoding.encode_ordinary(text)]

    def encode_batch(self, texts: Sequence[str], workers: int = 1) -> List[List[int]]:
        """Encode many texts; ``workers`` > 1 uses tiktoken's threads (with one
        thread its batch call is slower than a plain loop)."""
        if workers <= 1:
            return [self.encode(t) for t in texts]
        ids = self.ids
        ranks = self.encoding.encode_ordinary_batch(list(texts), num_threads=workers)
        return [[ids[r] for r in row] for row in ranks]


def encode_files(bpe: GPT2BPE, inputs: Sequence[str], outputs: Sequence[str], keep_empty: bool = False,
                 workers: int = 1) -> Dict[str, float]:
    """Encode ``inputs[i]`` into ``outputs[i]`` ("-" = stdin/stdout); returns counts and timing.

    Outputs are written to temporary files of their own and renamed at the end
    (:func:`output_files.write_whole`).

    Raises:
        OSError: a file cannot be read or written.
        ValueError: the inputs' line counts differ; an input is not UTF-8
            (naming the file, line and byte offset).
    """
    texts = []
    for path in inputs:
        with (contextlib.nullcontext(sys.stdin.buffer) if path == "-" else open(path, "rb")) as f:
            # lines as a text file reads them (universal newlines), not str.splitlines(): that also
            # splits at \x0c, \u2028 and others, as fairseq's encoder does not
            texts.append([line.strip() for line in io.StringIO(utf8_text(f.read(), path), newline=None)])
    n = len(texts[0])
    if any(len(t) != n for t in texts):
        raise ValueError("the --inputs have different numbers of lines")
    keep = [i for i in range(n) if keep_empty or all(t[i] for t in texts)]
    n_bytes = sum(len(t[i].encode("utf-8")) for t in texts for i in keep)

    start = time.perf_counter()
    encoded = [bpe.encode_batch([t[i] for i in keep], workers) for t in texts]
    seconds = time.perf_counter() - start

    for out, lines in zip(outputs, encoded):
        text = "".join(" ".join(map(str, ids)) + "\n" for ids in lines)
        if out == "-":
            sys.stdout.write(text)
            continue
        write_whole(out, text)
    return {"lines": len(keep), "tokens": sum(len(ids) for ids in encoded[0]), "bytes": n_bytes,
            "seconds": seconds, "mb_per_s": n_bytes / 1e6 / max(seconds, 1e-9)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--encoder-json", required=True)
    parser.add_argument("--vocab-bpe", required=True)
    parser.add_argument("--inputs", nargs="+", default=["-"])
    parser.add_argument("--outputs", nargs="+", default=["-"])
    parser.add_argument("--keep-empty", action="store_true", help="keep empty lines")
    parser.add_argument("--workers", type=int, default=1,
                        help="encoding threads (tiktoken's batch threads; one thread is fastest for small files)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if len(args.inputs) != len(args.outputs):
        print("error: --inputs and --outputs need the same number of files", file=sys.stderr)
        return 1
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    for out in args.outputs:
        if out != "-":
            check_output(parser, "--outputs", out, args.inputs)
    try:
        bpe = GPT2BPE(args.encoder_json, args.vocab_bpe)
        stats = encode_files(bpe, args.inputs, args.outputs, args.keep_empty, args.workers)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"encoded {stats['lines']:,} lines, {stats['bytes'] / 1e6:.2f} MB into {stats['tokens']:,} tokens "
          f"in {stats['seconds']:.3f} s of encoding ({stats['mb_per_s']:.1f} MB/s, {args.workers} thread(s))",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
