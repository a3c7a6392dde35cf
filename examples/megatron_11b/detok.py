#!/usr/bin/env python
"""Wikitext detokenization of fairseq's Megatron-11b recipe, line for line.

    python examples/megatron_11b/detok.py wiki.test.raw [--output wiki.test.detok] [--workers 4]

Wikitext ships tokenized text (``2 @,@ 000 @-@ year``, ``= = Title = =``);
Megatron-11b's byte-level BPE expects raw text. Each line is split on single
spaces, detokenized with sacremoses' ``MosesDetokenizer`` (English), then the
recipe's replacements apply, in order: ``" @"`` -> ``""``, ``"@ "`` -> ``""``,
``" ="`` -> ``"="``, ``"= "`` -> ``"="``, ``" – "`` -> ``"–"``
(fairseq ``examples/megatron_11b/detok.py``). Reads plain, .gz or .bz2 files;
the output has exactly one line per input line.
"""

import argparse
import fileinput
import functools
import sys
from multiprocessing import Pool
from typing import Iterable, List

import sacremoses
from output_files import check_output, utf8_text, write_whole
from tqdm import tqdm

REPLACEMENTS = ((" @", ""), ("@ ", ""), (" =", "="), ("= ", "="), (" – ", "–"))


@functools.lru_cache(maxsize=1)
def _detokenizer() -> sacremoses.MosesDetokenizer:
    return sacremoses.MosesDetokenizer(lang="en")


def detokenize_line(line: str) -> str:
    """One Wikitext line (without its newline) -> the recipe's raw text."""
    text = _detokenizer().detokenize(line.strip().split(" "))
    for old, new in REPLACEMENTS:
        text = text.replace(old, new)
    return text


def read_lines(paths: Iterable[str]) -> List[str]:
    """The lines of every file of ``paths`` (plain, .gz or .bz2), in order.

    Raises:
        OSError: a file cannot be read.
        ValueError: a file is not UTF-8 (naming the file, line and byte offset).
    """
    lines = []
    for path in paths:
        with fileinput.hook_compressed(path, "rb") as f:
            text = utf8_text(f.read(), path)
        lines.extend(text[:-1].split("\n") if text.endswith("\n") else text.split("\n") if text else [])
    return lines


def detokenize_lines(lines: List[str], workers: int = 1, progress: bool = True) -> List[str]:
    if workers <= 1:
        return [detokenize_line(l) for l in tqdm(lines, desc="detokenize", unit="line", disable=not progress)]
    with Pool(workers) as pool:
        it = pool.imap(detokenize_line, lines, chunksize=256)
        return list(tqdm(it, total=len(lines), desc="detokenize", unit="line", disable=not progress))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="input files (plain, .gz or .bz2)")
    parser.add_argument("--output", help="output file (default: stdout); written to a temporary file, then renamed")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.output:
        check_output(parser, "--output", args.output, args.files)
    try:
        lines = detokenize_lines(read_lines(args.files), args.workers, progress=sys.stderr.isatty())
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    text = "".join(l + "\n" for l in lines)
    if args.output:
        try:
            write_whole(args.output, text)
        except OSError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
