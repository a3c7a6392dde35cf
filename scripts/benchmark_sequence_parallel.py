#!/usr/bin/env python
"""What sequence parallelism's second all-gather costs, measured on CPU.

    python scripts/benchmark_sequence_parallel.py [--tp 2] [--repeats 10]

With ``--sequence-parallel`` the column-parallel layers (the fused q/k/v
projection and fc1) all-gather their input's sequence shards for the
product, keep only this rank's shard for the backward, and all-gather it
again there for the weight's gradient (Korthikanti et al. 2022, section
4.2.2; :func:`fairseq_megatron.modules.column_parallel_linear.column_parallel_product`).
This times one decoder layer's forward and backward (a 512-wide layer, 8
heads, FFN 2048, 4 sequences of 1024 tokens, fp32, dropout 0.1, attention
dropout 0; ``--tp`` gloo processes of one thread each) that way, and the
way that keeps the gathered input instead (no second gather, ``T x B x C``
kept per column-parallel layer instead of ``T / N x B x C``), alternating,
and prints the median of each, their difference, the bytes each keeps
beside the planner's formula for them (:func:`fairseq_megatron.planner.activation_bytes_per_layer`,
with CPU's dropout masks in fp32), and the time of the all-gather alone
(twice per layer in the backward).
"""

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import warnings
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

HIDDEN, HEADS, FFN, LENGTH, ROWS = 512, 8, 2048, 1024, 4


def _layer(tp: int):
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    import fairseq_megatron  # noqa: F401  (registers the model and the task)
    from fairseq_megatron.parallel import parallel_state
    from fairseq_megatron.parallel.rng_tracker import model_parallel_manual_seed

    parallel_state.initialize_model_parallel(tp)
    model_parallel_manual_seed(1)
    args = options.parse_args_and_arch(options.get_training_parser(), input_args=[
        "--task", "dummy_lm", "--tokens-per-sample", str(LENGTH), "--dict-size", "1000", "--batch-size", str(ROWS),
        "--arch", "transformer_lm_megatron", "--decoder-layers", "1", "--decoder-embed-dim", str(HIDDEN),
        "--decoder-ffn-embed-dim", str(FFN), "--decoder-attention-heads", str(HEADS), "--dropout", "0.1",
        "--attention-dropout", "0", "--model-parallel-size", str(tp), "--sequence-parallel", "--cpu",
        "--criterion", "vocab_parallel_cross_entropy", "--distributed-world-size", str(tp)])
    cfg = convert_namespace_to_omegaconf(args)
    model = tasks.setup_task(cfg.task).build_model(cfg.model)
    model.materialize()
    return model.decoder.layers[0].train(), model.decoder.buffered_future_mask(torch.empty(LENGTH, ROWS, HIDDEN))


@contextlib.contextmanager
def keeping_the_gathered_input():
    """The column-parallel layers as they were: the all-gathered input goes to
    ``F.linear``, which keeps it for the weight's gradient."""
    from fairseq_megatron.modules import column_parallel_linear as column
    from fairseq_megatron.modules import float8
    from fairseq_megatron.modules.column_parallel_linear import column_parallel_input

    def product(module, x, weight, bias, group, sequence_parallel=False):
        return float8.linear(module, column_parallel_input(x, group, sequence_parallel), weight, bias)

    with mock.patch.object(column, "column_parallel_product", product), \
            mock.patch("fairseq_megatron.modules.model_parallel_multihead_attention.column_parallel_product", product):
        yield


def _pass(layer, mask, x) -> tuple:
    """One forward and backward of ``layer``: seconds, and the bytes autograd kept."""
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    dist.barrier()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _, _ = layer(x, self_attn_mask=mask, sequence_parallel=True)
    out.sum().backward()
    dist.barrier()
    parameters = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {mask.untyped_storage().data_ptr()}
    return time.perf_counter() - start, sum(n for ptr, n in kept.items() if ptr not in parameters)


def _rank(rank: int, tp: int, repeats: int, init_file: str, out_dir: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=tp)
    layer, mask = _layer(tp)
    x = torch.randn(LENGTH // tp, ROWS, HIDDEN, requires_grad=True)
    times = {"shard kept": [], "gathered input kept": []}
    kept = {}
    for _ in range(repeats + 1):  # the first of each is not timed
        for way in times:
            with keeping_the_gathered_input() if way == "gathered input kept" else contextlib.nullcontext():
                seconds, kept[way] = _pass(layer, mask, x)
            times[way].append(seconds)
    gathers = []
    for _ in range(repeats):
        parts = [torch.empty_like(x) for _ in range(tp)]
        dist.barrier()
        start = time.perf_counter()
        dist.all_gather(parts, x.detach())
        gathers.append(time.perf_counter() - start)
    if rank == 0:
        with open(os.path.join(out_dir, "result.txt"), "w") as f:
            f.write(repr({"times": {way: statistics.median(t[1:]) for way, t in times.items()}, "kept": kept,
                          "gather": statistics.median(gathers), "world_size": dist.get_world_size()}))
    dist.destroy_process_group()


def measure(tp: int, repeats: int) -> dict:
    """The medians ``_rank`` measured, as a dict."""
    import ast

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(tp, repeats, os.path.join(tmp, "init"), tmp), nprocs=tp, join=True,
                           start_method="spawn")
        with open(os.path.join(tmp, "result.txt")) as f:
            return ast.literal_eval(f.read())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size, one CPU process each (default 2)")
    p.add_argument("--repeats", type=int, default=10, help="timed passes of each way (default 10)")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.tp < 2 or args.repeats < 1:
        p.error("--tp must be at least 2 and --repeats at least 1")
    result = measure(args.tp, args.repeats)
    assert result["world_size"] == args.tp
    from fairseq_megatron.planner import ModelShape, activation_bytes_per_layer

    shape = ModelShape(1, HIDDEN, HEADS, FFN, 1024, LENGTH)
    formula = {sp: activation_bytes_per_layer(shape, ROWS, args.tp, sequence_parallel=sp, checkpointing=False,
                                              precision="fp32", mask_bytes=4) for sp in (True, False)}
    shard, gathered = result["times"]["shard kept"], result["times"]["gathered input kept"]
    print(f"one decoder layer ({HIDDEN} wide, FFN {FFN}, {ROWS} x {LENGTH} tokens, fp32), sequence parallel over "
          f"{args.tp} CPU processes, forward + backward, median of {args.repeats}:")
    print(f"  keeping the shard, gathering it again in the backward: {shard * 1e3:.1f} ms, "
          f"{result['kept']['shard kept'] / 2 ** 20:.2f} MiB kept")
    print(f"  keeping the gathered input:                            {gathered * 1e3:.1f} ms, "
          f"{result['kept']['gathered input kept'] / 2 ** 20:.2f} MiB kept")
    print(f"  the planner's formula: {formula[True] / 2 ** 20:.2f} MiB with sequence parallelism "
          f"({result['kept']['shard kept'] / formula[True] - 1:+.1%}), {formula[False] / 2 ** 20:.2f} MiB "
          f"without it")
    print(f"  difference {(shard - gathered) * 1e3:+.1f} ms ({shard / gathered - 1:+.1%}); one all-gather of the "
          f"shard alone: {result['gather'] * 1e3:.2f} ms (the backward runs two)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
