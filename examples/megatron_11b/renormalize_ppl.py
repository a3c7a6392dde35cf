#!/usr/bin/env python
"""Renormalize a BPE-level perplexity to the original word-level tokens.

    python examples/megatron_11b/renormalize_ppl.py --ppl 8.46 --new-token-count 270847 --orig-token-count 245566
    python examples/megatron_11b/renormalize_ppl.py --eval-log eval.log --raw wiki.test.raw --bpe wiki.test.bpe

The model's log-likelihood of the test set is the same however it is cut into
tokens, so the perplexity per original token is
``2 ^ (log2(ppl) * new_token_count / orig_token_count)``
(fairseq ``examples/megatron_11b/README.md``: 8.46, 270847, 245566 -> 10.54).

Counting rules (both include one end-of-sentence symbol per line, as fairseq
scores one after every line of binarized data):
* new (BPE) tokens: ids in the BPE file plus one per line; the BPE file has
  no empty lines (the encoder drops them). This is also the number
  ``fairseq-eval-lm`` reports as "Evaluated N tokens".
* original tokens: whitespace-separated tokens of the Wikitext (tokenized)
  file plus one per non-empty line.
"""

import argparse
import math
import re
import sys


def renormalized_ppl(ppl: float, new_token_count: int, orig_token_count: int) -> float:
    """``2 ^ (log2(ppl) * new / orig)``.

    Raises:
        ValueError: a count is not positive or ``ppl`` < 1.
    """
    if new_token_count <= 0 or orig_token_count <= 0:
        raise ValueError("token counts must be positive")
    if ppl < 1:
        raise ValueError(f"a perplexity is at least 1, got {ppl}")
    return 2 ** (math.log2(ppl) * new_token_count / orig_token_count)


def count_tokens_with_eos(path: str) -> int:
    """Whitespace-separated tokens plus one end-of-sentence per non-empty line.

    The rule for both counts: on a Wikitext file it gives the original count,
    on a BPE file (which has no empty lines) the BPE count.
    """
    total = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            tokens = line.split()
            if tokens:
                total += len(tokens) + 1
    return total


count_orig_tokens = count_bpe_tokens = count_tokens_with_eos


_EVAL = re.compile(r"Evaluated ([0-9,]+) tokens.*?Loss \(base 2\): ([0-9.]+), Perplexity: ([0-9.]+)", re.S)
_ALL_GROUPS = re.compile(r"data-parallel groups scored ([0-9,]+) tokens together")


def parse_eval_lm_log(text: str):
    """(tokens evaluated, base-2 loss, perplexity) from fairseq-eval-lm's output.

    With several data-parallel groups, "Evaluated N tokens" counts rank 0's
    share only; the token count is then the one fairseq_megatron logs for
    all groups together (the loss and perplexity are already over all).

    Raises:
        ValueError: the log has no result.
    """
    found = _EVAL.findall(text)
    if not found:
        raise ValueError("no 'Evaluated N tokens ... Loss (base 2): L, Perplexity: P' in the eval-lm log")
    tokens, loss, ppl = found[-1]
    all_groups = _ALL_GROUPS.findall(text)
    if all_groups:
        tokens = all_groups[-1]
    return int(tokens.replace(",", "")), float(loss), float(ppl)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ppl", type=float, help="unnormalized perplexity")
    p.add_argument("--eval-log", help="fairseq-eval-lm output to read the perplexity (and token count) from")
    p.add_argument("--new-token-count", type=int)
    p.add_argument("--orig-token-count", type=int)
    p.add_argument("--raw", help="Wikitext file to count original tokens in")
    p.add_argument("--bpe", help="BPE-encoded file to count new tokens in")
    args = p.parse_args(argv)
    try:
        ppl, new = args.ppl, args.new_token_count
        if args.eval_log:
            with open(args.eval_log, encoding="utf-8") as f:
                evaluated, _, logged_ppl = parse_eval_lm_log(f.read())
            ppl = ppl or logged_ppl
            new = new or evaluated
        if new is None and args.bpe:
            new = count_bpe_tokens(args.bpe)
        orig = args.orig_token_count or (count_orig_tokens(args.raw) if args.raw else None)
        if ppl is None or new is None or orig is None:
            raise ValueError("need a perplexity (--ppl/--eval-log) and both token counts (or files to count)")
        result = renormalized_ppl(ppl, new, orig)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"unnormalized ppl {ppl:.2f} over {new:,} BPE tokens -> renormalized ppl {result:.2f} "
          f"over {orig:,} original tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
