#!/usr/bin/env python
"""Time fairseq's ``load_model_ensemble_and_task`` on a large checkpoint, with and without drawing initial weights.

    python scripts/benchmark_model_loading.py --work-dir /tmp/load_bench [--layers 8 --repeats 2]

fairseq-eval-lm, -generate, -interactive, -validate and the hub load a
checkpoint through ``fairseq.checkpoint_utils.load_model_ensemble_and_task``:
it builds the model, then loads every parameter from the file. Building
draws random initial weights that the load overwrites; the plugin skips
them (``fairseq_integration`` step 26). This script writes a random fp16
checkpoint of the given ``transformer_lm_megatron`` shape at model-parallel
size 1 (default: 8 layers of Megatron-11b, 3072 hidden, FFN 18432, 32 heads,
vocabulary 51200: 1.37B parameters), with the dict.txt of its task, reads it
once into the page cache, then loads it ``--repeats`` times each way in
fresh child processes, alternating: "skipped" is the plugin as installed,
"drawn" the same with fairseq's function under step 26 (every other step in
place). Prints each load's seconds and the median of each way.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from argparse import Namespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_reshard import model_shapes  # noqa: E402

from fairseq_megatron.checkpoint_resharding import save_verified  # noqa: E402

_LOAD = (
    "import sys, time, torch\n"
    "torch.set_num_threads(int(sys.argv[3]))\n"
    "import fairseq_megatron\n"
    "from fairseq import checkpoint_utils\n"
    "load = checkpoint_utils.load_model_ensemble_and_task\n"
    "if sys.argv[2] == 'drawn':\n"
    "    load = load.__wrapped__  # the function step 26 wraps: the other steps stay\n"
    "start = time.perf_counter()\n"
    "load([sys.argv[1]])\n"
    "print(time.perf_counter() - start)\n"
)


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
    save_verified({"args": args, "model": model, "optimizer_history": history, "extra_state": {},
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
    times = {"drawn": [], "skipped": []}
    for repeat in range(args.repeats):
        for way in times:
            out = subprocess.run([sys.executable, "-c", _LOAD, path, way, str(args.threads)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if out.returncode != 0:
                sys.exit(f"error: the {way} load failed:\n{out.stderr.strip()[-2000:]}")
            times[way].append(float(out.stdout.split()[-1]))
            print(f"load {repeat + 1}, initial weights {way}: {times[way][-1]:.1f} s", flush=True)
    drawn, skipped = statistics.median(times["drawn"]), statistics.median(times["skipped"])
    print(f"median: drawn {drawn:.1f} s, skipped {skipped:.1f} s ({drawn / skipped:.1f}x), "
          f"{args.threads} torch thread(s)")


if __name__ == "__main__":
    main()
