#!/usr/bin/env python
"""Time fairseq's ``load_model_ensemble_and_task`` on a large checkpoint, with and without drawing initial weights.

    python scripts/benchmark_model_loading.py --work-dir /tmp/load_bench [--layers 8 --repeats 2]
    python scripts/benchmark_model_loading.py --work-dir /tmp/load_bench --fairseq-train

fairseq-eval-lm, -generate, -interactive, -validate and the hub load a
checkpoint through ``fairseq.checkpoint_utils.load_model_ensemble_and_task``:
it builds the model, then loads every parameter from the file. Building
draws random initial weights that the load overwrites; our model defers
them, and a strict load drops them (``ModelParallelTransformerLanguageModel.build_model``). This script writes a random fp16
checkpoint of the given ``transformer_lm_megatron`` shape at model-parallel
size 1 (default: 8 layers of Megatron-11b, 3072 hidden, FFN 18432, 32 heads,
vocabulary 51200: 1.37B parameters), with the dict.txt of its task, reads it
once into the page cache, then loads it ``--repeats`` times each way in
fresh child processes, alternating: "skipped" is the plugin as installed,
"drawn" the same with the model built as if no checkpoint could fill it
(everything else in place). Prints each load's seconds and the median of each way.

With ``--fairseq-train`` it times fairseq-train instead, from the start of
its model build to the end of its ``Trainer.load_checkpoint`` (the process
then exits, before any update), resuming from the same checkpoint with
``--restore-file`` on fairseq's dummy_lm task: "skipped" builds with the
draws deferred and never runs them, "drawn" builds drawing them.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from argparse import Namespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_reshard import model_shapes  # noqa: E402

from fairseq_megatron.checkpoint.resharding import save_verified  # noqa: E402

_LOAD = (
    "import sys, time, torch\n"
    "torch.set_num_threads(int(sys.argv[3]))\n"
    "import fairseq_megatron\n"
    "from fairseq import checkpoint_utils\n"
    "from fairseq_megatron.models import ModelParallelTransformerLanguageModel as LM\n"
    "load = checkpoint_utils.load_model_ensemble_and_task\n"
    "if sys.argv[2] == 'drawn':  # built as if no checkpoint could fill the weights\n"
    "    LM.build_model = classmethod(lambda cls, args, task: cls._build(args, task))\n"
    "start = time.perf_counter()\n"
    "load([sys.argv[1]])\n"
    "print(time.perf_counter() - start)\n"
)

# argv: checkpoint, way, threads, then fairseq-train's arguments
_TRAIN = (
    "import logging, os, sys, time, torch\n"
    "logging.basicConfig(level=logging.INFO)  # before any import configures it: the trainer's line\n"
    "torch.set_num_threads(int(sys.argv[3]))\n"
    "import fairseq_megatron\n"
    "from fairseq import models\n"
    "from fairseq_megatron.fairseq_integration.trainer import MegatronTrainer as Trainer\n"
    "from fairseq_megatron.models import ModelParallelTransformerLanguageModel as LM\n"
    "build, load, start = models.build_model, Trainer.load_checkpoint, []\n"
    "if sys.argv[2] == 'drawn':  # built as if no checkpoint could fill the weights\n"
    "    LM.build_model = classmethod(lambda cls, args, task: cls._build(args, task))\n"
    "def timed_build(*args, **kwargs):\n"
    "    start.append(time.perf_counter())\n"
    "    return build(*args, **kwargs)\n"
    "def timed_load(self, *args, **kwargs):\n"
    "    load(self, *args, **kwargs)\n"
    "    print(time.perf_counter() - start[0], flush=True)\n"
    "    os._exit(0)  # the build and the load are what is timed: no update\n"
    "models.build_model, Trainer.load_checkpoint = timed_build, timed_load\n"
    "from fairseq_cli.train import cli_main\n"
    "sys.argv = ['fairseq-train'] + sys.argv[4:]\n"
    "cli_main()\n"
)


def fairseq_train_args(path: str, save_dir: str, layers: int, hidden: int, ffn: int, heads: int,
                       vocab: int) -> list:
    """fairseq-train resuming the checkpoint ``path`` (weights only) on
    dummy_lm; it makes ``save_dir`` and saves nothing there."""
    return ["--task", "dummy_lm", "--dict-size", str(vocab - 4), "--tokens-per-sample", "8", "--batch-size", "1",
            "--arch", "transformer_lm_megatron", "--decoder-layers", str(layers), "--decoder-embed-dim",
            str(hidden), "--decoder-ffn-embed-dim", str(ffn), "--decoder-attention-heads", str(heads),
            "--share-decoder-input-output-embed", "--criterion", "vocab_parallel_cross_entropy",
            "--optimizer", "adam", "--lr", "1e-4", "--cpu", "--restore-file", path, "--reset-optimizer",
            "--reset-dataloader", "--reset-lr-scheduler", "--reset-meters", "--max-update", "1",
            "--disable-validation", "--no-save", "--save-dir", save_dir]


def write_checkpoint(directory: str, layers: int, hidden: int, ffn: int, heads: int, vocab: int) -> int:
    """A size-1 checkpoint ``directory/model.pt`` as fairseq-train saves it,
    random fp16 weights, and ``directory/dict.txt`` with ``vocab - 4`` words
    (fairseq adds 4 special symbols). Written under temporary names, then
    renamed (no partial file stays on failure). Returns the parameter count."""
    dict_path = os.path.join(directory, "dict.txt")
    with open(dict_path + ".tmp", "w") as f:
        f.writelines(f"w{i} 1\n" for i in range(vocab - 4))
    os.replace(dict_path + ".tmp", dict_path)
    args = Namespace(task="language_modeling", data=directory, arch="transformer_lm_megatron",
                     criterion="cross_entropy", decoder_layers=layers, decoder_embed_dim=hidden,
                     decoder_ffn_embed_dim=ffn, decoder_attention_heads=heads, model_parallel_size=1,
                     share_decoder_input_output_embed=True, tokens_per_sample=1024)
    generator = torch.Generator().manual_seed(0)
    model = {key: torch.randn(shape, generator=generator).to(torch.float16)
             for key, shape in model_shapes(layers, hidden, ffn, vocab)}
    count = sum(t.numel() for t in model.values())
    model["decoder.output_projection.weight"] = model["decoder.embed_tokens.weight"]
    history = [{"num_updates": 0, "best_loss": None, "criterion_name": "CrossEntropyCriterion",
                "optimizer_name": "Adam", "lr_scheduler_state": {}}]
    # fairseq-train reads the epoch from extra_state whenever it loads a checkpoint
    extra_state = {"train_iterator": {"epoch": 1, "iterations_in_epoch": 0, "version": 2}}
    save_verified({"args": args, "model": model, "optimizer_history": history, "extra_state": extra_state,
                   "last_optimizer_state": None}, os.path.join(directory, "model.pt"), verify=False)
    return count


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--ffn", type=int, default=18432)
    parser.add_argument("--vocab", type=int, default=51200, help="rows, a multiple of 8")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads per load")
    parser.add_argument("--fairseq-train", action="store_true",
                        help="time fairseq-train's build and load of the checkpoint (--restore-file) instead")
    args = parser.parse_args(argv)
    if args.vocab % 8 or args.vocab <= 4:
        parser.error("--vocab must be a multiple of 8 above 4 (the model pads the dictionary to a multiple of 8)")
    if min(args.layers, args.hidden, args.heads, args.ffn, args.repeats, args.threads) < 1:
        parser.error("--layers, --hidden, --heads, --ffn, --repeats and --threads must be positive")
    try:
        os.makedirs(args.work_dir, exist_ok=True)
    except OSError as e:
        parser.error(f"--work-dir {args.work_dir}: {e.strerror}")

    start = time.time()
    count = write_checkpoint(args.work_dir, args.layers, args.hidden, args.ffn, args.heads, args.vocab)
    path = os.path.join(args.work_dir, "model.pt")
    print(f"wrote {count / 1e9:.2f}B parameters (fp16, {os.path.getsize(path) / 1e9:.2f} GB) "
          f"in {time.time() - start:.0f} s", flush=True)
    with open(path, "rb") as f:  # into the page cache, so that no way pays for the first read
        while f.read(1 << 26):
            pass
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    child, child_args = _LOAD, []
    if args.fairseq_train:
        save_dir = tempfile.mkdtemp(prefix="fairseq-train-", dir=args.work_dir)
        child, child_args = _TRAIN, fairseq_train_args(path, save_dir, args.layers, args.hidden, args.ffn,
                                                       args.heads, args.vocab)
    try:
        times = time_each_way(child, path, args.threads, child_args, args.repeats, env)
    finally:
        if args.fairseq_train:
            shutil.rmtree(save_dir, ignore_errors=True)
    drawn, skipped = statistics.median(times["drawn"]), statistics.median(times["skipped"])
    what = "fairseq-train's build and load" if args.fairseq_train else "load_model_ensemble_and_task"
    print(f"median: drawn {drawn:.1f} s, skipped {skipped:.1f} s ({drawn / skipped:.1f}x), "
          f"{args.threads} torch thread(s), {what}")


def time_each_way(child: str, path: str, threads: int, child_args: list, repeats: int, env: dict) -> dict:
    """Seconds of each run of ``child``, by way ("drawn", "skipped"), alternating."""
    times = {"drawn": [], "skipped": []}
    for repeat in range(repeats):
        for way in times:
            out = subprocess.run([sys.executable, "-c", child, path, way, str(threads), *child_args], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if out.returncode != 0:
                sys.exit(f"error: the {way} load failed:\n{out.stderr.strip()[-2000:]}")
            # fairseq-train: the trainer logs when the checkpoint made the draws needless
            if child == _TRAIN and (way == "skipped") != ("initial weights were not drawn" in out.stderr):
                sys.exit(f"error: the {way} run did not build as expected:\n{out.stderr.strip()[-2000:]}")
            times[way].append(float(out.stdout.split()[-1]))
            print(f"load {repeat + 1}, initial weights {way}: {times[way][-1]:.1f} s", flush=True)
    return times


if __name__ == "__main__":
    main()
