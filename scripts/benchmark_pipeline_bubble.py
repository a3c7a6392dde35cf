#!/usr/bin/env python
"""The pipeline bubble of the 1F1B schedule, measured on CPU.

    python scripts/benchmark_pipeline_bubble.py [--stages 2] [--virtual 1 2] [--micro-batches 2 4 8] [--steps 6]

For each number of micro-batches ``m`` this times one update of our
``MegatronTrainer`` (fairseq's dummy_lm task; a 16 x 256 decoder, micro-batches
of 8 x 128 tokens, fp32) at one stage in one process and at ``--stages P``
stages in ``P`` processes (gloo), each with ``V`` model chunks for each
``--virtual V`` (the interleaved schedule for V > 1), each process on one
CPU thread, and prints the median update time of each, the speed-up, and
the share of the P-stage update that is not the one-stage work divided by
P: ``1 - (t1 / P) / tP``. A perfectly balanced 1F1B schedule loses exactly
its bubble, ``(P - 1) / (V m)`` of the ideal time (Narayanan et al. 2021,
sections 2.2.1 and 2.2.2), that is ``(P - 1) / (V m + P - 1)`` of the
update, printed beside it; the rest is communication (V times the
point-to-point messages) and the stages' imbalance (the first holds the
embedding, the last the output projection and the loss). Needs ``P`` free
cores for the times to mean anything.
"""

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

LAYERS, HIDDEN, FFN, HEADS, ROWS, LENGTH, VOCAB = 16, 256, 1024, 8, 8, 128, 1000


def _trainer(stages: int, micro_batches: int, virtual: int):
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    import fairseq_megatron  # noqa: F401  (registers the model, the task and the trainer)
    from fairseq_megatron.fairseq_integration.trainer import build_trainer
    from fairseq_megatron.parallel import parallel_state
    from fairseq_megatron.parallel.rng_tracker import model_parallel_manual_seed

    parallel_state.initialize_model_parallel(1, stages)
    model_parallel_manual_seed(1)
    args = options.parse_args_and_arch(options.get_training_parser(), input_args=[
        "--task", "dummy_lm", "--tokens-per-sample", str(LENGTH), "--dict-size", str(VOCAB),
        "--batch-size", str(ROWS), "--arch", "transformer_lm_megatron", "--decoder-layers", str(LAYERS),
        "--decoder-embed-dim", str(HIDDEN), "--decoder-ffn-embed-dim", str(FFN), "--decoder-attention-heads",
        str(HEADS), "--share-decoder-input-output-embed", "--criterion", "vocab_parallel_cross_entropy",
        "--optimizer", "adam", "--lr", "1e-4", "--update-freq", str(micro_batches), "--pipeline-model-parallel-size",
        str(stages), "--virtual-pipeline-model-parallel-size", str(virtual), "--cpu", "--seed", "1",
        "--distributed-world-size", str(stages)])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    trainer = build_trainer(cfg, task, task.build_model(cfg.model), task.build_criterion(cfg.criterion))
    trainer.get_model().run_deferred_initialisation()
    task.load_dataset("train")
    return trainer, trainer.get_train_iterator(epoch=1).next_epoch_itr(shuffle=False)


def _time_updates(rank: int, stages: int, micro_batches: int, steps: int, virtual: int, init_file: str,
                  out: str) -> None:
    logging.basicConfig(level=logging.WARNING)  # fairseq's INFO lines, once per process and configuration
    warnings.simplefilter("ignore")  # fairseq's and fairscale's deprecation warnings at import (see pytest.ini)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=stages)
    trainer, batches = _trainer(stages, micro_batches, virtual)
    times = []
    for step in range(steps + 1):  # the first update builds the schedule and infers shapes: not timed
        samples = [next(batches) for _ in range(micro_batches)]
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step(samples)
        dist.barrier()
        if step:
            times.append(time.perf_counter() - start)
    if rank == 0:
        with open(out, "w") as f:
            f.write(str(statistics.median(times)))
    dist.destroy_process_group()


def median_update_seconds(stages: int, micro_batches: int, steps: int, virtual: int = 1) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "seconds")
        mp.spawn(_time_updates, args=(stages, micro_batches, steps, virtual, os.path.join(tmp, "init"), out),
                 nprocs=stages, join=True)
        with open(out) as f:
            return float(f.read())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--virtual", type=int, nargs="+", default=[1, 2],
                   help="model chunks per stage (--virtual-pipeline-model-parallel-size), each value timed")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--steps", type=int, default=6, help="timed updates per configuration (the median is printed)")
    args = p.parse_args(argv)
    if args.stages < 2 or args.steps < 1 or any(v < 1 or LAYERS % (args.stages * v) for v in args.virtual):
        p.error(f"--stages must be at least 2 and --stages x --virtual divide {LAYERS}; --steps at least 1")
    too_few = [m for m in args.micro_batches if m < args.stages or (max(args.virtual) > 1 and m % args.stages)]
    if too_few:
        p.error(f"--micro-batches {too_few[0]}: 1F1B needs at least --stages {args.stages} micro-batches, and the "
                f"interleaved schedule a multiple of them")
    print(f"{LAYERS} layers x {HIDDEN} hidden, micro-batch {ROWS} x {LENGTH} tokens, fp32, 1 thread per process")
    print(f"{'m':>3} {'V':>2} {'1 stage ms':>11} {f'{args.stages} stages ms':>11} {'speed-up':>9} {'idle share':>11} "
          f"{'bubble':>7}")
    for m in args.micro_batches:
        one = median_update_seconds(1, m, args.steps)
        for v in args.virtual:
            many = median_update_seconds(args.stages, m, args.steps, v)
            idle = 1 - (one / args.stages) / many
            bound = (args.stages - 1) / (v * m + args.stages - 1)
            print(f"{m:>3} {v:>2} {one * 1e3:>11.1f} {many * 1e3:>11.1f} {one / many:>9.2f} {idle:>11.1%} "
                  f"{bound:>7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
