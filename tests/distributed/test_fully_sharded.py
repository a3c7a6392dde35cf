"""Sharded data parallelism (``--ddp-backend fully_sharded``, torch's FSDP2)
against ``pytorch_ddp``: fairseq's trainer (our ``MegatronTrainer``) trains
a 4-layer model with tied embeddings and no dropout for 6 updates of 2
micro-batches on two data-parallel ranks, the last update ending an epoch,
with ``--clip-norm``.

One ``pytorch_ddp`` run at T 1 x D 2 is the reference for every sharded run:
T 1 x D 2 (ZeRO-3, and ZeRO-2 with ``--no-reshard-after-forward``),
and P 2 x D 2 (1F1B, and interleaved-zb, whose backward torch splits);
T 2 x D 2 against ``pytorch_ddp`` at T 2 x D 2. Pipeline
parallelism gives the same training as one stage up to the order of fp32
sums (tests/distributed/test_pipeline_parallel.py), and so does sharding
(reduce-scatter instead of all-reduce): the tolerances are those of
test_pipeline_parallel.py (``tests.support.pipeline.compare_runs``: losses
and norms rtol 1e-5, gradients atol 1e-7, weights atol 1e-6), whose control
run at twice the learning rate falls outside them.

The memory each rank reports holds 1 / D of the parameters, gradients and
optimizer state, counted from its tensors, as the planner predicts.
"""

import os

from fairseq_megatron.planner import ModelShape, plan
from tests.helpers import run_distributed
from tests.support.pipeline import LENGTH, ROWS, VOCAB, compare_runs, train

LAYERS, MICRO_BATCHES = 4, 2
# 6 in make test; docs/benchmarks.md runs 20 (FAIRSEQ_MEGATRON_TEST_UPDATES=20, pytest -s prints the differences)
UPDATES = int(os.environ.get("FAIRSEQ_MEGATRON_TEST_UPDATES", "6"))


def _run(tmp_path, name, tensor=1, stages=1, data=2, backend="fully_sharded", extra=()):
    results = run_distributed(train, tensor * stages * data, tmp_path / name, tensor, stages, MICRO_BATCHES, LAYERS,
                              UPDATES, ("--ddp-backend", backend, *extra))
    coordinates = sorted(r["coordinates"] for r in results)
    assert coordinates == sorted((t, d, p) for t in range(tensor) for d in range(data) for p in range(stages))
    return results


def test_fully_sharded_trains_as_pytorch_ddp(tmp_path):
    """One test, so that each reference runs once: ZeRO-3, ZeRO-2, P 2 and
    P 2 under interleaved-zb at 2 chunks per stage (whose split backward
    needs ``--no-reshard-after-forward``) against the T 1 reference, T 2
    against a T 2 reference (tensor parallelism changes the order of sums,
    and Adam moves the weights whose gradients are zero up to rounding
    differently)."""
    reference = _run(tmp_path, "ddp", backend="pytorch_ddp")
    zero_bubble = ("--pipeline-schedule", "interleaved-zb", "--virtual-pipeline-model-parallel-size", "2",
                   "--no-reshard-after-forward")
    for name, stages, extra in (("zero3", 1, ()), ("zero2", 1, ("--no-reshard-after-forward",)), ("p2", 2, ()),
                                ("p2-interleaved-zb", 2, zero_bubble)):
        results = _run(tmp_path, name, stages=stages, extra=extra)
        # every parameter a DTensor sharded over the data-parallel ranks
        assert all(r["sharded"] == r["names"] and r["names"] for r in results), name
        print(f"{name} against pytorch_ddp over {UPDATES} updates, largest differences:", compare_runs(results, reference))
    found = compare_runs(_run(tmp_path, "t2", tensor=2), _run(tmp_path, "ddp_t2", tensor=2, backend="pytorch_ddp"))
    print(f"t2 against pytorch_ddp at T 2 over {UPDATES} updates, largest differences:", found)


def test_each_rank_holds_one_data_parallel_share(tmp_path):
    """At D = 1, 2 and 4 (T 1, after one update) each rank's parameters,
    gradients and Adam state, counted from its tensors, are 1 / D of
    D = 1's within 5%: FSDP2 pads a first dimension to a multiple of D (every
    first dimension of this model divides by 4, so only the tied weight,
    counted once, could make a difference)."""
    memory = {data: [r["memory"] for r in run_distributed(train, data, tmp_path / f"d{data}", 1, 1, MICRO_BATCHES,
                                                         LAYERS, 1, ("--ddp-backend", "fully_sharded"))]
              for data in (1, 2, 4)}
    whole = memory[1][0]
    assert all(whole)
    for data in (2, 4):
        assert len(memory[data]) == data
        for rank_memory in memory[data]:
            for held, total in zip(rank_memory, whole):
                assert abs(held * data / total - 1) <= 0.05, (data, memory)
    # the planner's fully sharded model of the same run (fp32 Adam, sinusoidal positions), within the
    # same 5%: its weights, gradients and optimizer state are (4, 4, 8) bytes per parameter / D
    shape = ModelShape(layers=LAYERS, hidden=32, heads=4, ffn=64, vocab=VOCAB, seq_len=LENGTH)
    for data in (1, 2, 4):
        [predicted] = plan(shape, data, data, 80, ROWS, ROWS * MICRO_BATCHES * data, precision="fp32", tp=1, pp=1,
                           fully_sharded="zero3")
        for rank_memory in memory[data]:
            for held, gb in zip(rank_memory, (predicted.weights_gb, predicted.gradients_gb, predicted.optimizer_gb)):
                assert abs(held / (gb * 1e9) - 1) <= 0.05, (data, rank_memory, predicted)
