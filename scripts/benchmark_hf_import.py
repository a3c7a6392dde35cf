#!/usr/bin/env python
"""Peak memory and time of importing a large transformers checkpoint (``fairseq-megatron-reshard --from-hf``).

    python scripts/benchmark_hf_import.py --work-dir /tmp/import_bench [--layers 24 --hidden 1024]

Writes a random fp32 ``GPT2LMHeadModel`` checkpoint directory of the given
shape (GPT-2 medium's by default: 24 x 1024, vocabulary 50257, 1024
positions; 355M parameters, 1.42 GB) as transformers saves it
(``config.json``, ``model.safetensors`` in shards of ``--shard-gb``), then
imports it at each ``--sizes`` in a child process and prints the wall time,
the child's peak RSS (``ru_maxrss``), how far that is above an interpreter
with the package imported, and what the import should hold: one output part
(the largest part file) plus one layer of the source (its largest group,
the token embedding, read whole and laid out as the padded vocabulary).
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_reshard import timed_child  # noqa: E402  isort:skip

from fairseq_megatron.checkpoint.names import output_paths  # noqa: E402


def gpt2_tensors(layers: int, hidden: int, vocab: int, positions: int):
    """(name, shape) of ``GPT2LMHeadModel``'s tensors, as transformers saves them."""
    shapes = [("transformer.wte.weight", (vocab, hidden)), ("transformer.wpe.weight", (positions, hidden))]
    for i in range(layers):
        p = f"transformer.h.{i}."
        shapes += [(p + "ln_1.weight", (hidden,)), (p + "ln_1.bias", (hidden,)),
                   (p + "attn.c_attn.weight", (hidden, 3 * hidden)), (p + "attn.c_attn.bias", (3 * hidden,)),
                   (p + "attn.c_proj.weight", (hidden, hidden)), (p + "attn.c_proj.bias", (hidden,)),
                   (p + "ln_2.weight", (hidden,)), (p + "ln_2.bias", (hidden,)),
                   (p + "mlp.c_fc.weight", (hidden, 4 * hidden)), (p + "mlp.c_fc.bias", (4 * hidden,)),
                   (p + "mlp.c_proj.weight", (4 * hidden, hidden)), (p + "mlp.c_proj.bias", (hidden,))]
    return shapes + [("transformer.ln_f.weight", (hidden,)), ("transformer.ln_f.bias", (hidden,))]


def write_gpt2(directory: str, layers: int, hidden: int, heads: int, vocab: int, positions: int,
               shard_bytes: int) -> int:
    """A random GPT-2 checkpoint in ``directory``, a shard in memory at a time; returns its parameter count."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    shards, shard, size, total = [], {}, 0, 0
    g = torch.Generator().manual_seed(0)

    def flush():
        nonlocal shard, size
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(shard, os.path.join(directory, name), metadata={"format": "pt"})
        shards.append((name, list(shard)))
        shard, size = {}, 0

    for name, shape in gpt2_tensors(layers, hidden, vocab, positions):
        tensor = torch.randn(shape, generator=g) * 0.02
        if shard and size + tensor.nbytes > shard_bytes:
            flush()
        shard[name], size, total = tensor, size + tensor.nbytes, total + tensor.numel()
    flush()
    weight_map = {}
    for k, (name, names) in enumerate(shards):  # transformers' names: model-0000K-of-0000N
        final = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(os.path.join(directory, name), os.path.join(directory, final))
        weight_map.update(dict.fromkeys(names, final))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total * 4}, "weight_map": weight_map}, f)
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": layers, "n_embd": hidden,
              "n_head": heads, "n_positions": positions, "vocab_size": vocab, "eos_token_id": vocab - 1,
              "bos_token_id": vocab - 1, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
              "tie_word_embeddings": True}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return total


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--positions", type=int, default=1024)
    parser.add_argument("--shard-gb", type=float, default=0.5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args(argv)

    source = os.path.join(args.work_dir, "gpt2")
    t = time.time()
    n = write_gpt2(source, args.layers, args.hidden, args.heads, args.vocab, args.positions, int(args.shard_gb * 1e9))
    print(f"generated a GPT-2 of {n / 1e6:.0f}M parameters ({n * 4 / 1e9:.2f} GB fp32) in {time.time() - t:.0f}s",
          flush=True)
    _, baseline = timed_child([sys.executable, "-c", "import fairseq_megatron"])
    print(f"baseline: a Python process that imports the package peaks at {baseline / 1e9:.2f} GB", flush=True)
    padded = -(-(args.vocab + 4) // (8 * args.heads)) * 8 * args.heads  # 8 x gcd(heads, 4 x hidden) = 8 x heads
    layer = max(padded * args.hidden * 4 + args.vocab * args.hidden * 4, 12 * args.hidden ** 2 * 4)
    print(f"\n{'T':>3} | {'time s':>7} | {'peak RSS GB':>11} | {'above baseline GB':>17} | "
          f"{'part + layer GB':>15} | ratio")
    for size in args.sizes:
        out = os.path.join(args.work_dir, f"mp{size}", "model.pt")
        seconds, peak = timed_child([sys.executable, "-m", "fairseq_megatron.cli.reshard_checkpoint", "--from-hf",
                                     source, "--output", out, "--model-parallel-size", str(size)])
        part = max(os.path.getsize(f) for f in output_paths(out, size))
        expected = part + layer
        print(f"{size:>3} | {seconds:7.1f} | {peak / 1e9:11.2f} | {(peak - baseline) / 1e9:17.2f} | "
              f"{expected / 1e9:15.2f} | {(peak - baseline) / expected:5.2f}", flush=True)


if __name__ == "__main__":
    main()
