#!/usr/bin/env python
"""The main job: train a model-parallel LM on real text and report its perplexity.

On 2 CPU processes (torchrun, gloo), with no download:
  1. corpus   English docstrings of Python's standard library, split by file
              into train/valid/test (scripts/make_corpus.py);
  2. binarize fairseq-preprocess --only-source;
  3. train    fairseq-train --arch transformer_lm_megatron_11b (small
              dimension overrides) --criterion vocab_parallel_cross_entropy
              --model-parallel-size 2, saving checkpoint_*-model_part-{0,1}.pt;
  4. evaluate fairseq-eval-lm --model-parallel-size 2 on the test split;
and compares the perplexities with the unigram baseline.

    python scripts/demo.py [--work-dir demo_work] [--max-update 400]
        [--model-parallel-size 2] [--pipeline-model-parallel-size 1]

With ``--pipeline-model-parallel-size P`` each update's 16 sequences are
trained as P micro-batches of 16 / P (``--update-freq P``) through P
pipeline stages, one process per stage and model part; fairseq-eval-lm
then loads the stage files at one stage.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_corpus  # noqa: E402

import fairseq_megatron  # noqa: E402

VOCAB_SIZE = 8000  # words kept by fairseq-preprocess; the rest become <unk>

# Lines of fairseq's log worth showing while it runs.
_PROGRESS = re.compile(r"train_inner|\| valid \||\| train \||Loss \(base 2\)|Evaluated|Saved checkpoint|Error|error")


_TIMESTAMP = re.compile(r"^[0-9-]+ [0-9:]+ \| [A-Z]+ \| ")


def run(cmd, log_path, env=None):
    """Run ``cmd``, stream the interesting lines, keep the whole log; exit on failure."""
    print("$ " + " ".join(cmd), flush=True)
    lines = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for line in proc.stdout:
            log.write(line)
            lines.append(line)
            if _PROGRESS.search(line):
                print("  " + _TIMESTAMP.sub("", line.rstrip()), flush=True)
        proc.wait()
    if proc.returncode != 0:
        tail = "".join(lines[-30:])
        sys.exit(f"{tail}\nerror: command failed with exit code {proc.returncode} (full log: {log_path})")
    return "".join(lines)


def last_valid_ppl(train_log: str):
    found = re.findall(r"\| valid \|.*?\| ppl ([0-9.]+)", train_log)
    return float(found[-1]) if found else None


def eval_ppl(eval_log: str) -> float:
    found = re.findall(r"Loss \(base 2\): ([0-9.]+), Perplexity: ([0-9.]+)", eval_log)
    if not found:
        sys.exit("error: fairseq-eval-lm printed no perplexity")
    return float(found[-1][1])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default="demo_work")
    parser.add_argument("--max-update", type=int, default=400)
    parser.add_argument("--corpus-mb", type=float, default=3.0)
    parser.add_argument("--model-parallel-size", type=int, default=2)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    stages = args.pipeline_model_parallel_size
    if stages < 1 or 16 % stages or 4 % stages:
        parser.error(f"--pipeline-model-parallel-size {stages}: the demo's 4 layers and 16 sequences per update "
                     f"split over 1, 2 or 4 stages")

    start = time.time()
    work = os.path.abspath(args.work_dir)
    text_dir, bin_dir, ckpt_dir = (os.path.join(work, d) for d in ("text", "bin", "checkpoints"))
    if os.path.isdir(ckpt_dir):
        shutil.rmtree(ckpt_dir)  # a fresh run each time; the corpus is rebuilt too
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    py = sys.executable
    size = args.model_parallel_size
    nproc = size * stages

    print("[1/4] corpus: docstrings of the Python standard library", flush=True)
    corpus, unigram_ppl = make_corpus.main(
        ["--out-dir", text_dir, "--max-mb", str(args.corpus_mb), "--vocab-size", str(VOCAB_SIZE)]
    )

    print("[2/4] binarize (fairseq-preprocess)", flush=True)
    run([py, "-m", "fairseq_cli.preprocess", "--only-source",
         "--trainpref", f"{text_dir}/train.txt", "--validpref", f"{text_dir}/valid.txt",
         "--testpref", f"{text_dir}/test.txt", "--destdir", bin_dir,
         "--nwordssrc", str(VOCAB_SIZE), "--workers", "2"], os.path.join(work, "preprocess.log"), env)

    layout = f"model-parallel size {size}" + (f" x {stages} pipeline stages" if stages > 1 else "")
    print(f"[3/4] train: transformer_lm_megatron_11b (4 x 256), {layout} on {nproc} CPU processes", flush=True)
    user_dir = fairseq_megatron.USER_DIR
    train_log = run([
        py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
        "-m", "fairseq_cli.train", bin_dir, "--user-dir", user_dir, "--cpu",
        "--task", "language_modeling", "--arch", "transformer_lm_megatron_11b",
        "--decoder-layers", "4", "--decoder-embed-dim", "256", "--decoder-ffn-embed-dim", "1536",
        "--decoder-attention-heads", "8", "--share-decoder-input-output-embed",
        "--criterion", "vocab_parallel_cross_entropy", "--model-parallel-size", str(size),
        "--pipeline-model-parallel-size", str(stages), "--update-freq", str(stages),
        "--sample-break-mode", "none", "--tokens-per-sample", "128", "--batch-size", str(16 // stages),
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--weight-decay", "0.01", "--clip-norm", "1.0",
        "--lr", "0.002", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "100",
        "--max-update", str(args.max_update), "--validate-interval-updates", "200",
        "--save-interval-updates", "200", "--keep-interval-updates", "1", "--no-epoch-checkpoints",
        "--save-dir", ckpt_dir, "--log-format", "simple", "--log-interval", "50", "--seed", "1",
    ], os.path.join(work, "train.log"), env)
    parts = sorted(f for f in os.listdir(ckpt_dir) if "model_part" in f)
    print(f"  part checkpoints: {', '.join(parts)}", flush=True)

    print(f"[4/4] evaluate: fairseq-eval-lm on the test split, model-parallel size {size}", flush=True)
    eval_log = run([
        py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(size),
        "-m", "fairseq_cli.eval_lm", bin_dir, "--user-dir", user_dir, "--cpu",
        "--task", "language_modeling", "--path", os.path.join(ckpt_dir, "checkpoint_best.pt"),
        "--model-parallel-size", str(size), "--gen-subset", "test",
        "--sample-break-mode", "none", "--tokens-per-sample", "128", "--context-window", "64",
        "--batch-size", "16",
    ], os.path.join(work, "eval.log"), env)

    valid_ppl = last_valid_ppl(train_log)
    test_ppl = eval_ppl(eval_log)
    print()
    print(f"unigram baseline perplexity (valid): {unigram_ppl:8.1f}")
    if valid_ppl is not None:
        print(f"model validation perplexity:         {valid_ppl:8.1f}")
    print(f"model test perplexity (eval-lm):     {test_ppl:8.1f}")
    print(f"done in {time.time() - start:.0f} s; logs and checkpoints in {work}")
    if valid_ppl is not None and valid_ppl > 0.5 * unigram_ppl:
        sys.exit("error: the model did not get well below the unigram baseline")
    return valid_ppl, test_ppl, unigram_ppl


if __name__ == "__main__":
    main()
