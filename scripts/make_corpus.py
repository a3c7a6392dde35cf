#!/usr/bin/env python
"""Build a small English corpus from the docstrings of Python's standard library.

Real prose that every Python install carries, so the demo needs no download.
Each docstring paragraph becomes one line, word-tokenized and lowercased
(``"Return the sum."`` -> ``"return the sum ."``). Documents (one source file
each) are assigned to train/valid/test by a hash of their path, so the split
is the same on every machine with the same Python version.

    python scripts/make_corpus.py --out-dir data/stdlib_docs [--max-mb 4]

Writes ``train.txt``, ``valid.txt``, ``test.txt`` and prints line/token counts
and the unigram-model perplexity of valid/test (add-one smoothed train counts),
the baseline a trained LM must beat.
"""

import argparse
import ast
import collections
import hashlib
import math
import os
import re
import sys
import sysconfig
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

_TOKEN = re.compile(r"[a-z]+(?:'[a-z]+)?|[0-9]+|[^\sa-z0-9]")
SPLITS = ("train", "valid", "test")


def tokenize(text: str) -> List[str]:
    """Lowercase words, numbers and single punctuation marks."""
    return _TOKEN.findall(text.lower())


def docstrings(source: str) -> Iterator[str]:
    """Module, class and function docstrings of one Python source, in file order."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield doc


def paragraphs(doc: str) -> Iterator[str]:
    """Prose paragraphs of a docstring; code examples (``>>>``) are dropped."""
    for para in re.split(r"\n\s*\n", doc):
        lines = [ln.strip() for ln in para.splitlines()]
        if not lines or any(ln.startswith((">>>", "...")) for ln in lines):
            continue
        text = " ".join(ln for ln in lines if ln)
        if len(text.split()) >= 4:
            yield text


def split_of(path: str, valid_pct: int = 5, test_pct: int = 5) -> str:
    """Deterministic train/valid/test assignment of a document by path hash."""
    bucket = int(hashlib.md5(path.encode()).hexdigest(), 16) % 100
    if bucket < test_pct:
        return "test"
    if bucket < test_pct + valid_pct:
        return "valid"
    return "train"


def stdlib_files(root: str) -> List[str]:
    """Sorted ``.py`` files under the stdlib root, skipping tests and site-packages."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "idle_test", "__pycache__"))
        out.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return sorted(out)


def build_corpus(files: Iterable[str], root: str, max_bytes: int) -> Dict[str, List[str]]:
    """Tokenized lines per split, stopping once ``max_bytes`` of text are collected."""
    corpus = {s: [] for s in SPLITS}
    total = 0
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        split = split_of(os.path.relpath(path, root))
        for doc in docstrings(source):
            for para in paragraphs(doc):
                line = " ".join(tokenize(para))
                corpus[split].append(line)
                total += len(line) + 1
        if total >= max_bytes:
            break
    return corpus


def unigram_perplexity(train: List[str], evaluated: List[str], vocab_size: Optional[int] = None) -> float:
    """Perplexity of an add-one-smoothed unigram model of ``train`` on ``evaluated``.

    Counts one end-of-line symbol per line (as fairseq's LM does). With
    ``vocab_size``, words outside the ``vocab_size`` most frequent training
    words become ``<unk>``, as ``fairseq-preprocess --nwordssrc`` maps them,
    so the baseline sees the same vocabulary as the model.
    """
    counts = collections.Counter(tok for line in train for tok in line.split() + ["</s>"])
    if vocab_size is not None:
        keep = {w for w, _ in counts.most_common(vocab_size)}
        unk = sum(c for w, c in counts.items() if w not in keep)
        counts = collections.Counter({w: c for w, c in counts.items() if w in keep})
        counts["<unk>"] += unk

    def known(tok):
        return tok if vocab_size is None or tok in counts else "<unk>"

    evaluated_tokens = [known(tok) for line in evaluated for tok in line.split() + ["</s>"]]
    vocab = set(counts) | set(evaluated_tokens)
    total = sum(counts.values()) + len(vocab)
    nll = -sum(math.log((counts[tok] + 1) / total) for tok in evaluated_tokens)
    return math.exp(nll / max(len(evaluated_tokens), 1))


def write_splits(corpus: Dict[str, List[str]], out_dir: str) -> None:
    """Write ``<split>.txt`` files (temporary name, then rename)."""
    os.makedirs(out_dir, exist_ok=True)
    for split, lines in corpus.items():
        path = os.path.join(out_dir, f"{split}.txt")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(path + ".tmp", path)


def main(argv=None) -> Tuple[Dict[str, List[str]], float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--max-mb", type=float, default=4.0, help="stop after this much text (MB)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="for the baseline: map words outside the most frequent N to <unk>")
    parser.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="where to read .py files")
    args = parser.parse_args(argv)

    files = stdlib_files(args.stdlib)
    if not files:
        sys.exit(f"error: no .py files under {args.stdlib}")
    corpus = build_corpus(files, args.stdlib, int(args.max_mb * 1e6))
    if any(not corpus[s] for s in SPLITS):
        sys.exit("error: a split came out empty; raise --max-mb")
    write_splits(corpus, args.out_dir)
    for split in SPLITS:
        lines = corpus[split]
        print(f"{split}: {len(lines):,} lines, {sum(len(l.split()) for l in lines):,} tokens")
    baseline = unigram_perplexity(corpus["train"], corpus["valid"], args.vocab_size)
    print(f"unigram baseline perplexity (valid): {baseline:.1f}")
    return corpus, baseline


if __name__ == "__main__":
    main()
