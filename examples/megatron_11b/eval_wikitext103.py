#!/usr/bin/env python
"""Wikitext-103 perplexity of a Megatron-11b checkpoint, every step in one command.

    python examples/megatron_11b/eval_wikitext103.py --raw-dir wikitext-103-raw \\
        --checkpoint-dir megatron_11b --encoder-json encoder.json --vocab-bpe vocab.bpe \\
        --split test --model-parallel-size 8 --work-dir wt103_work

Steps (fairseq ``examples/megatron_11b/README.md``), each skipped when its
output exists (outputs are written under temporary names, so an existing one
is complete; ``--force`` redoes them):
  1. detokenize ``wiki.<split>.raw``                    -> ``<work>/wiki.<split>.detok``
  2. GPT-2 BPE (empty lines dropped)                    -> ``<work>/wiki.<split>.bpe``
  3. binarize with the checkpoint's ``dict.txt``        -> ``<work>/bin/<split>.{bin,idx}``
  4. ``fairseq-eval-lm --path <checkpoint-dir>/model.pt --context-window 992``
     (torchrun with ``--gpus`` processes, by default one per model part at
     ``--model-parallel-size``; the checkpoint may have been saved at another
     size, the parts are then built in memory; more processes form
     data-parallel groups that split the set, and the plugin sums their
     scores into one perplexity)
and prints the unnormalized perplexity over BPE tokens, the renormalized one
over the original tokens and both token counts (see renormalize_ppl.py).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bpe_encode  # noqa: E402
import detok  # noqa: E402
import renormalize_ppl  # noqa: E402


class InputError(Exception):
    """Bad input: reported as one line, exit status 1."""


def check_inputs(args) -> dict:
    """Validate files and the checkpoint/dictionary/model-parallel-size match before any work.

    Raises:
        InputError: a missing or unreadable file, a ``--model-parallel-size``
            that does not divide the model (any other size works: eval-lm
            reshards in memory), ``--gpus`` not a multiple of it, or a
            dict.txt whose size does not match the checkpoint's embedding.
    """
    from fairseq_megatron.checkpoint.layout import CheckpointError
    from fairseq_megatron.checkpoint.part_files import find_part_files
    from fairseq_megatron.checkpoint.resharding import (
        check_divisible,
        config_value,
        model_config,
        read_checkpoint,
    )

    paths = {
        "raw": os.path.join(args.raw_dir, f"wiki.{args.split}.raw"),
        "dict": os.path.join(args.checkpoint_dir, "dict.txt"),
        "checkpoint": os.path.join(args.checkpoint_dir, "model.pt"),
    }
    for name, path in (("raw", paths["raw"]), ("dict", paths["dict"]),
                       ("encoder-json", args.encoder_json), ("vocab-bpe", args.vocab_bpe)):
        if not os.path.isfile(path):
            raise InputError(f"missing {name} file: {path}")
    if args.gpus < 1 or args.gpus % args.model_parallel_size:
        raise InputError(f"--gpus {args.gpus} is not a multiple of --model-parallel-size {args.model_parallel_size}")
    try:
        parts = find_part_files(paths["checkpoint"])
        state = read_checkpoint(parts[0])
        rows = state["model"]["decoder.embed_tokens.weight"].size(0) * len(parts)
        # any size that divides the model: eval-lm builds each rank's part in memory
        check_divisible(model_config(state), rows, args.model_parallel_size)
    except (FileNotFoundError, CheckpointError) as e:
        raise InputError(str(e)) from None
    with open(paths["dict"], encoding="utf-8") as f:
        symbols = 4 + sum(1 for line in f if line.strip())  # fairseq's 4 special symbols + one per line
    multiple = 8 * len(parts)
    padded = config_value(model_config(state), "padded_vocab_size") or -(-symbols // multiple) * multiple
    if symbols > rows or padded != rows:
        raise InputError(
            f"{paths['dict']} has {symbols} symbols (padded: {padded}) but the checkpoint's embedding "
            f"has {rows} rows: this dict.txt does not belong to this checkpoint"
        )
    return paths


def binarize(bpe_path: str, dict_path: str, split: str, dest: str) -> None:
    """fairseq-preprocess --only-source --srcdict, into a temporary folder, then moved into ``dest``."""
    os.makedirs(dest, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        subprocess.run([sys.executable, "-m", "fairseq_cli.preprocess", "--only-source", f"--{split}pref",
                        bpe_path, "--srcdict", dict_path, "--destdir", tmp, "--workers", "2"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        shutil.copy(dict_path, os.path.join(dest, "dict.txt"))
        for ext in ("idx", "bin"):  # the .bin last: its presence marks a complete step
            os.replace(os.path.join(tmp, f"{split}.{ext}"), os.path.join(dest, f"{split}.{ext}"))


def eval_lm_command(args, data: str, checkpoint: str):
    import torch

    from fairseq_megatron import USER_DIR

    cmd = [sys.executable]
    if args.gpus > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.gpus)]
    cmd += ["-m", "fairseq_cli.eval_lm", data, "--user-dir", USER_DIR, "--path", checkpoint,
            "--task", "language_modeling", "--gen-subset", args.split, "--batch-size", str(args.batch_size),
            "--tokens-per-sample", str(args.tokens_per_sample), "--context-window", str(args.context_window),
            "--model-parallel-size", str(args.model_parallel_size)]
    cmd += ["--fp16"] if torch.cuda.is_available() and not args.cpu else ["--cpu"]
    return cmd


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--raw-dir", required=True, help="folder with wiki.{test,valid}.raw")
    p.add_argument("--checkpoint-dir", required=True, help="folder with dict.txt and model[-model_part-K].pt")
    p.add_argument("--encoder-json", required=True)
    p.add_argument("--vocab-bpe", required=True)
    p.add_argument("--split", choices=["test", "valid"], default="test")
    p.add_argument("--model-parallel-size", type=int, default=8)
    p.add_argument("--gpus", type=int, help="processes for eval-lm, a multiple of --model-parallel-size "
                   "(each group of that many scores its share of the set); default: the model-parallel size")
    p.add_argument("--work-dir", default="wikitext103_work")
    p.add_argument("--context-window", type=int, default=992)
    p.add_argument("--tokens-per-sample", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=4, help="detokenizer processes")
    p.add_argument("--orig-token-count", type=int, help="use this instead of counting wiki.<split>.raw")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--force", action="store_true", help="redo steps whose outputs exist")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    args.gpus = args.gpus or args.model_parallel_size
    if args.workers < 1:
        p.error("--workers must be at least 1")

    try:
        paths = check_inputs(args)
        os.makedirs(args.work_dir, exist_ok=True)
        detok_path = os.path.join(args.work_dir, f"wiki.{args.split}.detok")
        bpe_path = os.path.join(args.work_dir, f"wiki.{args.split}.bpe")
        bin_dir = os.path.join(args.work_dir, "bin")

        encode = args.force or not os.path.exists(bpe_path)
        bpe = bpe_encode.GPT2BPE(args.encoder_json, args.vocab_bpe) if encode else None  # read before the work
        if args.force or not os.path.exists(detok_path):
            print(f"[1/4] detokenize {paths['raw']}", flush=True)
            if detok.main([paths["raw"], "--output", detok_path, "--workers", str(args.workers)]):
                return 1  # detok printed its error line
        else:
            print(f"[1/4] detokenize: {detok_path} exists, skipped", flush=True)

        if encode:
            print("[2/4] GPT-2 BPE", flush=True)
            stats = bpe_encode.encode_files(bpe, [detok_path], [bpe_path], workers=1)
            print(f"  {stats['lines']:,} lines, {stats['bytes'] / 1e6:.2f} MB -> {stats['tokens']:,} tokens, "
                  f"{stats['mb_per_s']:.1f} MB/s", flush=True)
        else:
            print(f"[2/4] GPT-2 BPE: {bpe_path} exists, skipped", flush=True)
        new_count = renormalize_ppl.count_bpe_tokens(bpe_path)
        if new_count == 0:
            raise InputError(f"the {args.split} set is empty after detokenization and BPE: {paths['raw']}")

        if args.force or not os.path.exists(os.path.join(bin_dir, f"{args.split}.bin")):
            print(f"[3/4] binarize with {paths['dict']}", flush=True)
            binarize(bpe_path, paths["dict"], args.split, bin_dir)
        else:
            print(f"[3/4] binarize: {bin_dir}/{args.split}.bin exists, skipped", flush=True)

        groups = args.gpus // args.model_parallel_size
        print(f"[4/4] fairseq-eval-lm, model-parallel size {args.model_parallel_size}, {groups} "
              f"data-parallel group(s)", flush=True)
        proc = subprocess.run(eval_lm_command(args, bin_dir, paths["checkpoint"]), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        with open(os.path.join(args.work_dir, f"eval_lm.{args.split}.log"), "w") as f:
            f.write(proc.stdout)
        if proc.returncode != 0:
            raise InputError(f"fairseq-eval-lm failed; see {args.work_dir}/eval_lm.{args.split}.log:\n"
                             + proc.stdout[-2000:])
        evaluated, _, ppl = renormalize_ppl.parse_eval_lm_log(proc.stdout)
        if evaluated != new_count:
            print(f"warning: eval-lm scored {evaluated:,} tokens, the BPE file has {new_count:,}", file=sys.stderr)
        orig_count = args.orig_token_count or renormalize_ppl.count_orig_tokens(paths["raw"])
        renormalized = renormalize_ppl.renormalized_ppl(ppl, evaluated, orig_count)
    except (InputError, OSError, ValueError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None)
        print(f"error: {e}" + (f" {detail.strip().splitlines()[-1]}" if detail else ""), file=sys.stderr)
        return 1

    print(f"{args.split}: unnormalized perplexity {ppl:.2f} over {evaluated:,} BPE tokens")
    print(f"{args.split}: renormalized perplexity {renormalized:.2f} over {orig_count:,} original tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
