#!/usr/bin/env python
"""Choose tensor/pipeline/data-parallel sizes and batch settings before launching.

    fairseq-megatron-plan --arch transformer_lm_megatron_11b --gpus 16 --gpus-per-node 8 \\
        --gpu-memory 80 --micro-batch 2 --global-batch 512 --seq-len 1024 [--optimizer adafactor] \\
        [--checkpoint-activations] [--offload-activations] [--sequence-parallel] [--zero-sharding]
        [--fully-sharded [zero3|zero2]] [--json] [--png layouts.png]

Lists every valid (TP, PP, DP) layout with gradient accumulation steps,
parameters and memory per GPU (weights, gradients, optimizer state,
activations), model FLOPs per step and a recommendation: without
--fully-sharded it also plans each layout under fully sharded data
parallelism, and recommends that where it fits with fewer pipeline stages.
The formulas are in
fairseq_megatron/planner.py. Exit status 1 when no layout fits the GPU memory
(the table is still printed, and the PNG written; stderr says what the
smallest layout needs), as for a request that allows no layout at all.
"""

import argparse
import json
import math
import sys

from fairseq_megatron.files import written_whole
from fairseq_megatron.planner import (
    ModelShape,
    PlanError,
    humanize,
    megatron_arch_shape,
    model_tflops_per_step,
    plan,
    recommend,
)


def positive(kind):
    """An argparse type: ``kind`` (int or float) of the text, refused unless a
    finite number > 0 (``nan`` compares false with everything, and passed)."""
    def convert(text: str):
        value = kind(text)
        if not (0 < value < math.inf):
            raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
        return value
    convert.__name__ = kind.__name__  # argparse's "invalid int value" for text that is no number
    return convert


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", help="an arch of this package, e.g. transformer_lm_megatron_11b")
    for name in ("layers", "hidden", "heads", "ffn"):
        p.add_argument(f"--{name}", type=positive(int), help=f"{name} (overrides --arch)")
    p.add_argument("--vocab", type=positive(int), default=51200, help="padded vocabulary size")
    p.add_argument("--seq-len", type=positive(int), default=1024)
    p.add_argument("--learned-positions", action="store_true")
    p.add_argument("--gpus", type=positive(int), required=True)
    p.add_argument("--gpus-per-node", type=positive(int), default=8)
    p.add_argument("--gpu-memory", type=positive(float), default=80.0, help="GB per GPU")
    p.add_argument("--micro-batch", type=positive(int), default=1)
    p.add_argument("--global-batch", type=positive(int), required=True)
    p.add_argument("--precision", choices=["fp16", "bf16", "fp32", "memory-efficient-fp16", "bf16-autocast"],
                   default="fp16",
                   help="fp16/bf16: 16-bit weights with fp32 master weights (2+2+12 bytes per parameter); "
                        "memory-efficient-fp16: fairseq's flag, no master weights (2+2+8); fp32: 4+4+8; "
                        "bf16-autocast: this package's flag, fp32 weights (4+4+8) and 16-bit activations")
    p.add_argument("--optimizer", choices=["adam", "adafactor"], default="adam",
                   help="adafactor: fairseq's, without --beta1 (factored second moment, no first)")
    p.add_argument("--checkpoint-activations", action="store_true")
    p.add_argument("--offload-activations", action="store_true",
                   help="checkpointing with each layer's kept input in host memory (reported as host GB)")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--zero-sharding", action="store_true",
                   help="fairseq's --zero-sharding os: Adam's moments split over the data-parallel ranks")
    p.add_argument("--fully-sharded", nargs="?", const="zero3", choices=["zero3", "zero2"],
                   help="fairseq-train's --ddp-backend fully_sharded (torch's FSDP2): weights, gradients and "
                        "optimizer state split over the data-parallel ranks; zero2: with "
                        "--no-reshard-after-forward (each layer's weights stay gathered until its backward)")
    p.add_argument("--no-flash-attention", dest="flash_attention", action="store_false",
                   help="count the stored attention matrix (5*a*s^2*b bytes per layer)")
    p.add_argument("--tp", type=positive(int), help="only this tensor-parallel size")
    p.add_argument("--pp", type=positive(int), help="only this pipeline-parallel size")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--png", help="write a chart of memory per GPU by layout (needs matplotlib)")
    return p


def shape_from_args(args) -> ModelShape:
    if args.arch:
        shape = megatron_arch_shape(args.arch, args.vocab, args.seq_len)
    elif None in (args.layers, args.hidden, args.heads):
        raise PlanError("give --arch, or --layers, --hidden and --heads (and --ffn, default 4 x hidden)")
    else:
        shape = ModelShape(args.layers, args.hidden, args.heads, args.ffn or 4 * args.hidden, args.vocab, args.seq_len)
    for name in ("layers", "hidden", "heads", "ffn"):
        if getattr(args, name):
            setattr(shape, name, getattr(args, name))
    shape.learned_positions = shape.learned_positions or args.learned_positions
    if shape.hidden % shape.heads:
        raise PlanError(f"hidden {shape.hidden} is not divisible by heads {shape.heads}")
    return shape


def write_png(layouts, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"TP{l.tp} PP{l.pp}" for l in layouts]
    parts = [("weights", "weights_gb"), ("gradients", "gradients_gb"), ("optimizer", "optimizer_gb"),
             ("activations", "activations_gb")]
    fig, ax = plt.subplots(figsize=(max(6, len(layouts) * 0.6), 4))
    bottom = [0.0] * len(layouts)
    for name, attr in parts:
        values = [getattr(l, attr) for l in layouts]
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("GB per GPU")
    ax.legend()
    plt.xticks(rotation=45, ha="right")
    fig.tight_layout()
    try:
        with written_whole(path, suffix=".png") as partial:  # the format is read from the name
            fig.savefig(partial)
    finally:
        plt.close(fig)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        shape = shape_from_args(args)
        request = dict(gpus=args.gpus, gpus_per_node=args.gpus_per_node, gpu_memory_gb=args.gpu_memory,
                       micro_batch=args.micro_batch, global_batch=args.global_batch, precision=args.precision,
                       checkpointing=args.checkpoint_activations, sequence_parallel=args.sequence_parallel,
                       flash_attention=args.flash_attention, tp=args.tp, pp=args.pp,
                       offloading=args.offload_activations, zero_sharding=args.zero_sharding,
                       optimizer=args.optimizer)
        layouts = plan(shape, **request, fully_sharded=args.fully_sharded)
        alternative = None
        if not (args.fully_sharded or args.zero_sharding or args.precision == "bf16"):
            alternative = plan(shape, **request, fully_sharded="zero3")
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    best, reason = recommend(layouts, alternative)
    tflops = model_tflops_per_step(shape, args.global_batch)
    if args.json:
        print(json.dumps({"parameters": shape.parameters(), "model_tflops_per_step": tflops,
                          "layouts": [l.as_dict() for l in layouts],
                          "recommended": best.as_dict() if best else None, "reason": reason}, indent=2))
    else:
        print(f"model: {shape.layers} layers x {shape.hidden} hidden, {shape.heads} heads, FFN {shape.ffn}, "
              f"vocab {shape.vocab}, seq {shape.seq_len}: {humanize(shape.parameters())} parameters, "
              f"{tflops:,.0f} model TFLOPs per step of {args.global_batch} x {shape.seq_len} tokens")
        host, gathered = args.offload_activations, bool(args.fully_sharded)
        print(f"{'TP':>3} {'PP':>3} {'DP':>4} {'accum':>5} {'params/GPU':>10} {'weights':>8} {'grads':>7} "
              f"{'optim':>7} {'activ':>7}" + (f" {'gathered':>8}" if gathered else "")
              + f" {'total GB':>9}  fits {args.gpu_memory:g} GB" + ("  host GB" if host else ""))
        for l in layouts:
            print(f"{l.tp:>3} {l.pp:>3} {l.dp:>4} {l.grad_accumulation:>5} {humanize(l.params_per_gpu):>10} "
                  f"{l.weights_gb:8.1f} {l.gradients_gb:7.1f} {l.optimizer_gb:7.1f} {l.activations_gb:7.1f}"
                  + (f" {l.gathered_gb:8.1f}" if gathered else "")
                  + f" {l.total_gb:9.1f}  {'yes' if l.fits else 'no':>{len(f'fits {args.gpu_memory:g} GB')}}"
                  + (f"  {l.host_activations_gb:7.1f}" if host else ""))
        print(f"recommended: {reason if best else 'none'}")
    if args.png:
        try:
            write_png(layouts, args.png)
        except ImportError:
            print("error: --png needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 1
        except OSError as e:  # a missing directory, no permission
            print(f"error: --png {args.png}: {e.strerror}", file=sys.stderr)
            return 1
    if best is None:
        print(f"error: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
