#!/usr/bin/env python
"""Choose tensor/pipeline/context/data-parallel sizes and batch settings before launching.

    fairseq-megatron-plan --arch transformer_lm_megatron_11b --gpus 16 --gpus-per-node 8 \\
        --micro-batch 2 --global-batch 512 --seq-len 1024 [--gpu a100-80gb|h100-80gb|h200] \\
        [--gpu-memory GB] [--memory-margin GB] [--peak-tflops F] [--memory-bandwidth GB/s] \\
        [--intra-node-bandwidth GB/s] [--inter-node-bandwidth GB/s] [--optimizer adafactor] \\
        [--checkpoint-activations] [--offload-activations] [--sequence-parallel] [--zero-sharding] \\
        [--fully-sharded [zero3|zero2]] [--tp T] [--pp P] [--vp V] [--cp C] \\
        [--pipeline-schedule 1f1b|interleaved-1f1b|interleaved-zb|zbv|dualpipev] [--json] [--png layouts.png] \\
        [--dry-run]

Lists every valid (TP, PP, DP) layout (with the fastest number of model
chunks per pipeline stage, and the context-parallel size asked for) with
gradient accumulation steps, parameters and memory per GPU (weights,
gradients, optimizer state, activations), its predicted time per step, model
TFLOP/s per GPU and the share of each cost, and a recommendation: the
fastest predicted that fits the GPU's memory less a margin. With
--pipeline-schedule only layouts of several stages, each running that schedule
(fairseq-train's option: the same names and checks), its activations in
flight and its bubble as fairseq_megatron/training/pipeline_schedules.py
counts them. Without
--fully-sharded it also plans each layout under fully sharded data
parallelism. The formulas are in fairseq_megatron/planner/. Exit status 1
when no layout fits (the table is still printed, and the PNG written;
stderr says what the smallest layout needs), as for a request that allows
no layout at all.

--dry-run then builds the first rank of the recommended layout's first
stage (and of its last, with pipeline stages) with this package's code at
the full shape and runs one training step under fake tensors
(fairseq_megatron/planner/dry_run.py), and prints the memory it held beside
the prediction.
"""

import argparse
import dataclasses
import json
import math
import sys

from fairseq_megatron.files import written_whole
from fairseq_megatron.planner import (
    COSTS,
    GPUS,
    ModelShape,
    PlanError,
    Training,
    default_margin_gb,
    humanize,
    megatron_arch_shape,
    model_tflops_per_step,
    plan,
    recommend,
    stage_memory,
)

SHARE_COLUMNS = {"compute": "comp", "memory_bound": "mem", "tensor_parallel": "TP", "context_parallel": "CP",
                 "pipeline_transfers": "p2p", "pipeline_bubble": "bubble", "data_parallel": "DP",
                 "optimizer": "opt"}


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


def non_negative(text: str) -> float:
    """An argparse type: a finite float >= 0."""
    value = float(text)
    if not (0 <= value < math.inf):
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text}")
    return value


def _add_pipeline_arguments(p) -> None:
    """--tp, --pp, --vp and --pipeline-schedule."""
    p.add_argument("--tp", type=positive(int), help="only this tensor-parallel size")
    p.add_argument("--pp", type=positive(int), help="only this pipeline-parallel size")
    p.add_argument("--vp", "--virtual-pipeline-model-parallel-size", dest="vp", type=positive(int),
                   help="model chunks per pipeline stage (the interleaved schedules; default: the fastest that fits)")
    p.add_argument("--pipeline-schedule", metavar="NAME",
                   help="plan only layouts of several stages, each with this schedule of fairseq-train's "
                        "--pipeline-schedule: 1f1b, interleaved-1f1b, interleaved-zb, zbv or dualpipev (default: "
                        "1f1b, or interleaved-1f1b with more than one chunk per stage, as fairseq-train)")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", help="an arch of this package, e.g. transformer_lm_megatron_11b")
    for name in ("layers", "hidden", "heads", "ffn"):
        p.add_argument(f"--{name}", type=positive(int), help=f"{name} (overrides --arch)")
    # fairseq-train's name, which its checks of --pipeline-schedule print
    p.add_argument("--decoder-layers", dest="layers", type=positive(int), help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=positive(int), default=51200, help="padded vocabulary size")
    p.add_argument("--seq-len", type=positive(int), default=1024)
    p.add_argument("--learned-positions", action="store_true")
    p.add_argument("--gpus", type=positive(int), required=True)
    p.add_argument("--gpus-per-node", type=positive(int), default=8)
    p.add_argument("--gpu", choices=sorted(GPUS), default="a100-80gb",
                   help="the GPU's published peak, memory and bandwidths (fairseq_megatron/planner/hardware.py); "
                        "the flags below override them")
    p.add_argument("--gpu-memory", type=positive(float), help="GB per GPU (default: the --gpu's)")
    p.add_argument("--memory-margin", type=non_negative, metavar="GB",
                   help="GB of each GPU left free for the CUDA context, communication buffers and fragmentation "
                        "(default: 10%% of its memory, at least 2)")
    p.add_argument("--peak-tflops", type=positive(float), help="dense 16-bit matrix-product peak, TFLOP/s")
    p.add_argument("--memory-bandwidth", type=positive(float), help="GPU memory bandwidth, GB/s")
    p.add_argument("--intra-node-bandwidth", type=positive(float),
                   help="GB/s per GPU and direction between the GPUs of a node (NVLink)")
    p.add_argument("--inter-node-bandwidth", type=positive(float),
                   help="GB/s per GPU between nodes (its network adapter)")
    p.add_argument("--micro-batch", type=positive(int), default=1)
    p.add_argument("--global-batch", type=positive(int), required=True)
    p.add_argument("--precision", choices=["fp16", "bf16", "fp32", "memory-efficient-fp16", "bf16-autocast"],
                   default="fp16",
                   help="fp16/bf16: 16-bit weights with fairseq's fp32 copy and its gradient (2+6+12 bytes per "
                        "parameter); memory-efficient-fp16: fairseq's flag, no fp32 copy (2+2+8); fp32: 4+4+8; "
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
                   help="count the stored attention matrix (5*a*s^2*b bytes per layer) and its memory traffic")
    p.add_argument("--compile-layers", dest="fused_elementwise", action="store_true",
                   help="fairseq-train's --compile-layers: time each dropout and its residual add as one fused "
                        "kernel (as the Megatron-LM paper's fused bias-dropout-add)")
    _add_pipeline_arguments(p)
    p.add_argument("--cp", "--context-parallel-size", dest="cp", type=positive(int), default=1,
                   help="context-parallel size of every layout (default 1)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--png", help="write a chart of memory and predicted step time by layout (needs matplotlib)")
    p.add_argument("--dry-run", action="store_true",
                   help="build the recommended layout's first rank (of its first and last stage) at full size and "
                        "run one training step under fake tensors: its memory beside the prediction")
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


def gpu_from_args(args):
    """The ``--gpu`` preset with the flags that override it."""
    overrides = {"memory_gb": args.gpu_memory, "peak_tflops": args.peak_tflops,
                 "memory_bandwidth": args.memory_bandwidth, "intra_node_bandwidth": args.intra_node_bandwidth,
                 "inter_node_bandwidth": args.inter_node_bandwidth}
    return dataclasses.replace(GPUS[args.gpu], **{k: v for k, v in overrides.items() if v is not None})


def write_png(layouts, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [lay.name().replace(", ", " ") for lay in layouts]
    parts = [("weights", "weights_gb"), ("gradients", "gradients_gb"), ("optimizer", "optimizer_gb"),
             ("activations", "activations_gb")]
    fig, (memory, time) = plt.subplots(2, 1, figsize=(max(6, len(layouts) * 0.6), 7), sharex=True)
    bottom = [0.0] * len(layouts)
    for name, attr in parts:
        values = [getattr(lay, attr) for lay in layouts]
        memory.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    memory.set_ylabel("GB per GPU")
    memory.legend()
    time.bar(labels, [lay.predicted_step_seconds for lay in layouts], color="tab:gray")
    time.set_ylabel("predicted s per step")
    plt.xticks(rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    try:
        with written_whole(path, suffix=".png") as partial:  # the format is read from the name
            fig.savefig(partial)
    finally:
        plt.close(fig)


def print_table(shape, args, layouts, reason, best, gpu, margin):
    tflops = model_tflops_per_step(shape, args.global_batch)
    print(f"model: {shape.layers} layers x {shape.hidden} hidden, {shape.heads} heads, FFN {shape.ffn}, "
          f"vocab {shape.vocab}, seq {shape.seq_len}: {humanize(shape.parameters())} parameters, "
          f"{tflops:,.0f} model TFLOPs per step of {args.global_batch} x {shape.seq_len} tokens; {gpu.name}: "
          f"{gpu.peak_tflops:g} TFLOP/s, {gpu.memory_bandwidth:g} GB/s memory, {gpu.intra_node_bandwidth:g} / "
          f"{gpu.inter_node_bandwidth:g} GB/s within / across nodes, {gpu.memory_gb:g} GB less {margin:g} GB")
    host, gathered = args.offload_activations, bool(args.fully_sharded)
    fits = f"fits {gpu.memory_gb - margin:g} GB"
    shares = " ".join(f"{column:>6}" for column in SHARE_COLUMNS.values())
    print(f"{'TP':>3} {'PP':>3} {'VP':>3} {'CP':>3} {'DP':>5} {'accum':>5} {'params/GPU':>10} {'weights':>8} "
          f"{'grads':>7} {'optim':>7} {'activ':>7}" + (f" {'gathered':>8}" if gathered else "")
          + f" {'total GB':>9}  {fits}" + ("  host GB" if host else "")
          + f" {'step s':>8} {'TFLOP/s':>7}  share %: {shares}")
    for lay in layouts:
        print(f"{lay.tp:>3} {lay.pp:>3} {lay.vp:>3} {lay.cp:>3} {lay.dp:>5} {lay.grad_accumulation:>5} "
              f"{humanize(lay.params_per_gpu):>10} {lay.weights_gb:8.1f} {lay.gradients_gb:7.1f} "
              f"{lay.optimizer_gb:7.1f} {lay.activations_gb:7.1f}" + (f" {lay.gathered_gb:8.1f}" if gathered else "")
              + f" {lay.total_gb:9.1f}  {'yes' if lay.fits else 'no':>{len(fits)}}"
              + (f"  {lay.host_activations_gb:7.1f}" if host else "")
              + f" {lay.predicted_step_seconds:8.3g} {lay.predicted_tflops_per_gpu:7.1f}{' ' * len('  share %: ')}"
              + " ".join(f"{100 * lay.time_shares.get(cost, 0):6.1f}" for cost in COSTS))
    print(f"recommended: {reason if best else 'none'}")


def dry_runs(shape, layout, training) -> list:
    """The dry run of ``layout``'s first (and last) stage beside the
    planner's prediction for it: ``{stage, rank, world_size, measured,
    predicted}``, the last two by kind (weights, gradients, optimizer,
    activations; ``peak``: the most held at once, and the predicted total),
    in bytes."""
    from fairseq_megatron.planner.dry_run import dry_run

    found = []
    for stage in ("first", "last") if layout.pp > 1 else ("first",):
        held = dry_run(shape, layout, training, stage)
        # a CPU's dropout keeps its masks in the activations' dtype (a GPU's in one byte): predicted as they run
        predicted = stage_memory(shape, layout.tp, layout.pp, layout.dp, layout.grad_accumulation, training,
                                 layout.cp, layout.vp, stage, mask_bytes=training.activation_bytes)
        kinds = ("weights", "gradients", "optimizer", "activations")
        found.append({"stage": stage, "rank": held.rank, "world_size": held.world_size,
                      "measured": dict({kind: getattr(held, kind) for kind in kinds}, peak=held.peak),
                      "predicted": dict({kind: getattr(predicted, kind) for kind in kinds}, peak=predicted.total)})
    return found


def print_dry_runs(runs, layout) -> None:
    for run in runs:
        measured, predicted = run["measured"], run["predicted"]
        print(f"dry run of rank {run['rank']} of {run['world_size']} ({layout.name()}, {run['stage']} stage), GB: "
              + ", ".join(f"{kind} {measured[kind] / 1e9:.3g} (predicted {predicted[kind] / 1e9:.3g})"
                          for kind in ("weights", "gradients", "optimizer", "activations"))
              + f"; peak {measured['peak'] / 1e9:.3g} (predicted total {predicted['peak'] / 1e9:.3g})")


def _fully_sharded_alternative(shape, request, args):
    """The request's layouts fully sharded, where it asks for no sharding
    of its own; None where none runs (a --pipeline-schedule that splits the
    backward at a requested --pp)."""
    if args.fully_sharded or args.zero_sharding or args.precision == "bf16":
        return None
    try:
        return plan(shape, **request, fully_sharded="zero3")
    except PlanError:
        return None


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        shape = shape_from_args(args)
        gpu = gpu_from_args(args)
        margin = default_margin_gb(gpu.memory_gb) if args.memory_margin is None else args.memory_margin
        request = dict(gpus=args.gpus, gpus_per_node=args.gpus_per_node, gpu_memory_gb=gpu.memory_gb,
                       micro_batch=args.micro_batch, global_batch=args.global_batch, precision=args.precision,
                       checkpointing=args.checkpoint_activations, sequence_parallel=args.sequence_parallel,
                       flash_attention=args.flash_attention, tp=args.tp, pp=args.pp, offloading=args.offload_activations,
                       zero_sharding=args.zero_sharding, optimizer=args.optimizer, cp=args.cp, vp=args.vp, gpu=gpu,
                       margin_gb=margin, fused_elementwise=args.fused_elementwise,
                       schedule=args.pipeline_schedule)
        if args.dry_run and args.pipeline_schedule not in (None, "1f1b", "interleaved-1f1b"):
            raise PlanError(f"--dry-run runs the 1f1b and interleaved-1f1b schedules' order of passes, not "
                            f"--pipeline-schedule {args.pipeline_schedule}'s")
        layouts = plan(shape, **request, fully_sharded=args.fully_sharded)
        alternative = _fully_sharded_alternative(shape, request, args)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    best, reason = recommend(layouts, alternative)
    runs = None
    if args.dry_run and best is not None:
        training = Training(args.micro_batch, args.precision, args.checkpoint_activations or args.offload_activations,
                            args.sequence_parallel, args.flash_attention, args.offload_activations, args.zero_sharding,
                            args.optimizer, best.sharding if best.sharding in ("zero2", "zero3") else None)
        try:
            runs = dry_runs(shape, best, training)
        except PlanError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps({"parameters": shape.parameters(), "model_tflops_per_step": model_tflops_per_step(
            shape, args.global_batch), "gpu": dataclasses.asdict(gpu), "memory_margin_gb": margin,
            "layouts": [lay.as_dict() for lay in layouts],
            "fully_sharded_layouts": [lay.as_dict() for lay in alternative or []],
            "recommended": best.as_dict() if best else None, "reason": reason,
            **({"dry_runs": runs} if runs is not None else {})}, indent=2))
    else:
        print_table(shape, args, layouts, reason, best, gpu, margin)
        if runs is not None:
            print_dry_runs(runs, best)
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
