#!/usr/bin/env python
"""Peak memory and time of resharding a large generated checkpoint (8 -> 1 -> 8 parts, on disk and in memory).

    python scripts/benchmark_reshard.py --work-dir /tmp/reshard_bench [--layers 24 --hidden 2048]

Writes a random fp16 checkpoint of the given transformer_lm_megatron shape as
8 part files (about 1.3B parameters by default: 24 x 2048, FFN 8192, vocab
51200), then runs ``fairseq-megatron-reshard`` 8 -> 1 and 1 -> 8 in child
processes and prints, for each, the wall time, the child's peak RSS
(``ru_maxrss``) and its ratio to the largest output file. The target is a
ratio below 1.5: resharding must work on a machine with less RAM than the
checkpoint. The interpreter with torch and fairseq imported is printed too
(about 0.33 GB): it is a fixed cost, so the ratio of small outputs is higher.

Then the in-memory path that fairseq-eval-lm and fairseq-generate take for a
checkpoint of another size (``resharded_model``: one rank's part built from
the 8 files, nothing written), next to ``torch.load`` of the merged file that
the offline tool wrote, each in a fresh child process.

Then ``fairseq-megatron-reshard --to-hf`` of the 8 parts with 1 GB shards
(when transformers is installed): its peak RSS against the largest shard,
which with one layer is what the export should hold.

``--with-optimizer`` adds Adam's two fp32 moments as fairseq's FP16Optimizer
saves them (one flat tensor per part, the ``--fp16`` layout) and reshards
with ``--keep-optimizer``; the in-memory loads are skipped then.
"""

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from argparse import Namespace

import torch

from fairseq_megatron.checkpoint.layout import partition_dims
from fairseq_megatron.checkpoint.part_files import part_path


def layer_shapes(hidden: int, ffn: int):
    """(name, full shape) of one layer's tensors, in fairseq's order."""
    shapes = []
    for p in ("k_proj", "v_proj", "q_proj", "out_proj"):
        shapes += [(f"self_attn.{p}.weight", (hidden, hidden)), (f"self_attn.{p}.bias", (hidden,))]
    shapes += [("self_attn_layer_norm.weight", (hidden,)), ("self_attn_layer_norm.bias", (hidden,)),
               ("fc1.weight", (ffn, hidden)), ("fc1.bias", (ffn,)),
               ("fc2.weight", (hidden, ffn)), ("fc2.bias", (hidden,)),
               ("final_layer_norm.weight", (hidden,)), ("final_layer_norm.bias", (hidden,))]
    return shapes


def model_shapes(layers: int, hidden: int, ffn: int, vocab: int):
    shapes = [("decoder.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        shapes += [(f"decoder.layers.{i}.{n}", s) for n, s in layer_shapes(hidden, ffn)]
    shapes += [("decoder.layer_norm.weight", (hidden,)), ("decoder.layer_norm.bias", (hidden,))]
    return shapes


def flat_adam_state(model: dict, keys, rank: int, dims: dict) -> dict:
    """Random Adam moments for the parameters ``keys`` of model part
    ``rank``, flat fp32 in parameter order, as fairseq's FP16Optimizer saves
    them; equal on every part for replicated parameters, as training leaves
    them (the tool checks)."""
    moments = {}
    for n, name in enumerate(("exp_avg", "exp_avg_sq")):
        pieces = []
        for i, key in enumerate(keys):
            seed = (i, n) if dims[key] is None else (i, n, rank)
            g = torch.Generator().manual_seed(hash(seed) % 2**31)
            pieces.append(torch.randn(model[key].numel(), generator=g))
        moments[name] = torch.cat(pieces)
        del pieces
    return {"state": {0: {"step": 1, **moments}}, "param_groups": [{"lr": 1e-4, "params": [0]}],
            "loss_scale": 128.0}


def write_parts(path: str, parts: int, layers: int, hidden: int, ffn: int, heads: int, vocab: int,
                dtype: torch.dtype = torch.float16, with_optimizer: bool = False) -> int:
    """Write a random checkpoint as ``parts`` part files, one part in memory at a time.
    Returns the parameter count."""
    shapes = model_shapes(layers, hidden, ffn, vocab)
    args = Namespace(arch="transformer_lm_megatron", decoder_layers=layers, decoder_embed_dim=hidden,
                     decoder_ffn_embed_dim=ffn, decoder_attention_heads=heads, model_parallel_size=parts,
                     share_decoder_input_output_embed=True)
    dims = partition_dims(args, vocab)  # how the model's parameters say they are split
    for rank in range(parts):
        model = {}
        for i, (key, shape) in enumerate(shapes):
            g = torch.Generator().manual_seed(i)  # same full tensor on every rank
            dim = dims[key]
            if dim is None:
                model[key] = torch.randn(shape, generator=g).to(dtype)
            else:
                local = list(shape)
                local[dim] //= parts
                g.manual_seed(i * 1000 + rank)
                model[key] = torch.randn(local, generator=g).to(dtype)
        state = {"args": args, "model": model, "optimizer_history": [{"num_updates": 0}]}
        if with_optimizer:
            state["last_optimizer_state"] = flat_adam_state(model, [key for key, _ in shapes], rank, dims)
        model["decoder.output_projection.weight"] = model["decoder.embed_tokens.weight"]
        torch.save(state, part_path(path, rank))
        del model, state
    return sum(torch.Size(s).numel() for _, s in shapes)


_MEASURE = (
    "import resource, subprocess, sys\n"
    "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
)


def timed_child(argv):
    """Run ``argv`` under a fresh intermediate process that reports the peak RSS
    of its only child (ru_maxrss is a maximum over all children ever waited for,
    so each measurement needs its own parent). Returns (seconds, bytes)."""
    start = time.time()
    out = subprocess.run([sys.executable, "-c", _MEASURE, *argv], check=True, capture_output=True, text=True)
    return time.time() - start, int(out.stdout.split()[-1]) * 1024  # Linux reports KiB


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=51200)
    parser.add_argument("--parts", type=int, default=8)
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    parser.add_argument("--with-optimizer", action="store_true",
                        help="add flat fp32 Adam moments (fairseq's --fp16 layout) and reshard them too")
    args = parser.parse_args(argv)

    os.makedirs(args.work_dir, exist_ok=True)
    src = os.path.join(args.work_dir, "src", "model.pt")
    os.makedirs(os.path.dirname(src), exist_ok=True)
    t = time.time()
    n_params = write_parts(src, args.parts, args.layers, args.hidden, args.ffn, args.heads, args.vocab,
                           getattr(torch, args.dtype), args.with_optimizer)
    print(f"generated {n_params / 1e9:.2f}B parameters ({args.dtype}"
          f"{', with fp32 Adam moments' if args.with_optimizer else ''}) as {args.parts} parts "
          f"in {time.time() - t:.0f}s", flush=True)
    _, baseline = timed_child([sys.executable, "-c", "import fairseq_megatron"])
    print(f"baseline: a Python process that imports the package peaks at {baseline / 1e9:.2f} GB", flush=True)

    one = os.path.join(args.work_dir, "mp1", "model.pt")
    back = os.path.join(args.work_dir, f"mp{args.parts}", "model.pt")
    tool = [sys.executable, "-m", "fairseq_megatron.cli.reshard_checkpoint"]
    rows = []
    for label, inp, out, size in ((f"{args.parts} -> 1", src, one, 1), (f"1 -> {args.parts}", one, back, args.parts)):
        seconds, peak = timed_child([*tool, "--input", inp, "--output", out, "--model-parallel-size", str(size),
                                     *(["--keep-optimizer"] if args.with_optimizer else [])])
        outputs = [out] if size == 1 else [part_path(out, r) for r in range(size)]
        largest = max(os.path.getsize(o) for o in outputs)
        rows.append((label, seconds, peak, largest))

    print()
    print(f"{'reshard':>8} | {'time s':>7} | {'peak RSS GB':>11} | {'largest output GB':>17} | ratio | target < 1.5")
    for label, seconds, peak, largest in rows:
        ratio = peak / largest
        print(f"{label:>8} | {seconds:7.1f} | {peak / 1e9:11.2f} | {largest / 1e9:17.2f} | {ratio:5.2f} | "
              f"{'ok' if ratio < 1.5 else 'ABOVE TARGET'}")

    if args.with_optimizer:
        return
    if importlib.util.find_spec("transformers") is None:
        print("transformers is not installed: no --to-hf row")
    else:
        hf = os.path.join(args.work_dir, "hf")
        seconds, peak = timed_child([*tool, "--input", src, "--output", hf, "--to-hf", "--max-shard-size", "1"])
        shards = [os.path.join(hf, f) for f in os.listdir(hf) if f.endswith(".safetensors")]
        largest = max(os.path.getsize(f) for f in shards)
        print(f"\n{args.parts} -> transformers, {len(shards)} shards: {seconds:.1f} s, peak RSS {peak / 1e9:.2f} GB, "
              f"largest shard {largest / 1e9:.2f} GB, above the baseline {(peak - baseline) / 1e9:.2f} GB")
    python = [sys.executable, "-c"]
    loads = [
        ("torch.load of the merged file", f"import torch; torch.load({one!r}, weights_only=False)",
         os.path.getsize(one)),
    ]
    for size in (1, 2):
        loads.append((f"{args.parts} parts -> part 0 of {size} in memory",
                      "from fairseq_megatron.checkpoint.resharding import resharded_model; "
                      f"resharded_model({src!r}, 0, {size})", os.path.getsize(one) / size))
    print()
    print(f"{'load':>36} | {'time s':>7} | {'peak RSS GB':>11} | {'part GB':>7} | ratio")
    for label, code, part_bytes in loads:
        seconds, peak = timed_child([*python, code])
        print(f"{label:>36} | {seconds:7.1f} | {peak / 1e9:11.2f} | {part_bytes / 1e9:7.2f} | {peak / part_bytes:5.2f}")


if __name__ == "__main__":
    main()
