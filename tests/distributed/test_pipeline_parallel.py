"""Pipeline parallelism against the same model at one stage.

fairseq's trainer (our ``MegatronTrainer``) trains a 4-layer model with tied
embeddings, no dropout, for 20 updates of 4 micro-batches (3 for the layouts
of 4 processes, in half precision and untied), the last update
ending an epoch (a short last batch with a short last block, and one sample
fewer than ``--update-freq``), at P = 2, P = 3 (the embedding and the loss
each counted as a layer: 1, 2 and 1 decoder layers) and P = 4 (1F1B, and ZB-1P:
interleaved-zb at one chunk per stage), at P = 2 under ``--ddp-backend
fully_sharded`` with one model copy, at T 2 x P 2 (with
activation checkpointing and sequence parallelism; 1F1B and zbv) and at
D 2 x P 2 (1F1B and interleaved-zb). Each
run is compared with a one-stage run of the same tensor-parallel size,
and so is P = 2 with 2 model chunks per stage under each other schedule of
``--pipeline-schedule`` (interleaved 1F1B, and the zero-bubble ones, whose
backward is split into input and weight passes: interleaved-zb, zbv and
dualpipev, the last two placing the chunks in a V), same
options and data: per-update loss and gradient norm, the last update's gradients and
the final weights. Each rank is shown to hold only its stage's layers, and
the tied embedding's two copies (first and last stage) to be bitwise equal
after every update.

Tolerances: the losses, norms and gradients of a pipeline differ from one
stage's only in the order of fp32 sums (a loss summed per micro-batch,
then over them; the gradient norm summed per stage, then over stages):
rtol 1e-5 on losses and norms (seen: 1.1e-7); atol 1e-7 on gradients whose
entries reach 6e-2 (seen: 1.9e-8); atol 1e-6 on the weights after 20 Adam
updates (seen: 1.2e-7). One exception: the attention's key bias, whose
gradient is zero up to rounding (a query's softmax does not change when all
its key scores move by the same amount), so that Adam, which divides by the
gradient's own scale, moves it by up to about lr per update on the sign of
rounding noise: its gradients are compared as the others, its weights at
atol updates x lr (2e-2 for 20; seen: 5.4e-5). A control run at twice the
learning rate falls outside these tolerances.

With ``--memory-efficient-fp16`` (fp16 weights and activations, fairseq's
loss scaler; it runs on CPU) and with ``--bf16-autocast`` (bf16 matrix
products) the runs round differently wherever the order of sums differs;
one rounding is 2^-11 (fp16) or 2^-8 (bf16) of a value: losses and norms
at rtol 1e-3 (seen: 1.8e-4), gradients at atol 5e-4 for fp16 (seen: 6.1e-5)
and 1e-3 for bf16 (seen: 1.5e-4), entries reaching 6e-2; the weights are
not compared (they drift apart by roundings after each Adam step).
"""

from functools import partial

import pytest
import torch

from tests.helpers import run_distributed
from tests.support.pipeline import LOSS_TOL, LR, compare_runs, epoch, epoch_part, train

LAYERS, MICRO_BATCHES, UPDATES = 4, 4, 20
# The 4-process layouts (on 2 cores each tensor-parallel all-reduce waits for a
# rank that is not running), the half-precision runs and the untied ones, with
# their references, run fewer updates.
SHORT = 3
HALF = {"fp16": ("--memory-efficient-fp16", "--fp16-init-scale", "4"), "bf16": ("--bf16-autocast",)}
HALF_LOSS_TOL = {"fp16": dict(rtol=1e-3, atol=0.0), "bf16": dict(rtol=1e-3, atol=0.0)}
HALF_GRAD_TOL = {"fp16": dict(rtol=0.0, atol=5e-4), "bf16": dict(rtol=0.0, atol=1e-3)}


# --pipeline-schedule: torch's class, the options beside it, whether the chunks are placed in a V
SCHEDULE_RUNS = (("interleaved-zb", "ScheduleInterleavedZeroBubble", ("--virtual-pipeline-model-parallel-size", "2"),
                  False),
                 ("zbv", "ScheduleZBVZeroBubble", (), True),
                 ("dualpipev", "ScheduleDualPipeV", (), True))


def _run(tmp_path, name, tensor, stages, data=1, extra=(), updates=UPDATES, tied=True, batches=epoch, checkpoint=None,
         validate=False):
    return run_distributed(train, tensor * stages * data, tmp_path / name, tensor, stages, MICRO_BATCHES, LAYERS,
                           updates, extra, 1, batches, tied, checkpoint, validate)


INTERLEAVED = ("--virtual-pipeline-model-parallel-size", "2")
SAVED_AFTER = 15  # the interleaved run saves a checkpoint after this update; runs resumed from it train the rest


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The one-stage run, and the interleaved one (P 2 x V 2), which saves
    ``checkpoint.pt`` after update 15 of 20 and trains on."""
    root = tmp_path_factory.mktemp("pipeline")
    saved = str(root / "checkpoint.pt")
    interleaved = _run(root, "p2v2", 1, 2, extra=INTERLEAVED, checkpoint=dict(save_after=SAVED_AFTER, save_to=saved))
    return root, _run(root, "p1", 1, 1, validate=True), interleaved, saved


def _last(results, updates):
    """``results`` with the losses and norms of their last ``updates`` updates alone."""
    return [dict(r, losses=r["losses"][-updates:], norms=r["norms"][-updates:]) for r in results]


def _check_split(results, tensor, stages, data, virtual=1, v_shape=False, held=None):
    """Every (tensor, data, stage) coordinate ran once, each rank holding
    only its stage's layers: with ``virtual`` model chunks per stage, those
    of virtual stages s, s + P, ... (``v_shape``: s and 2P - 1 - s, stage 0
    holding the first chunk and the last); ``held``: each stage's layers,
    where the split is not even."""
    coordinates = sorted(r["coordinates"] for r in results)
    assert coordinates == sorted((t, d, p) for t in range(tensor) for d in range(data) for p in range(stages))
    per_chunk = LAYERS // (stages * virtual)
    last = 0 if v_shape else stages - 1
    for r in results:
        stage = r["coordinates"][2]
        chunks = (stage, 2 * stages - 1 - stage) if v_shape else range(stage, stages * virtual, stages)
        layers = sorted(i for c in chunks for i in range(c * per_chunk, (c + 1) * per_chunk))
        assert r["layers"] == (layers if held is None else held[stage]), r["coordinates"]
        has = {n.split(".")[1] for n in r["names"]}
        assert ("embed_tokens" in has) == (stage in (0, last)), r["names"]
        assert ("layer_norm" in has) == (stage == last), r["names"]


def _check_tied_copies(results, stages):
    """The first and last stage's embedding weights are bitwise equal after every update."""
    for t in {r["coordinates"][0] for r in results}:
        for d in {r["coordinates"][1] for r in results}:
            first, last = (next(r for r in results if r["coordinates"] == (t, d, s)) for s in (0, stages - 1))
            assert len(first["embedding_digests"]) == len(first["losses"]) > 1
            assert first["embedding_digests"] == last["embedding_digests"]


def test_stages_match_one_stage(tmp_path, runs):
    _, reference, interleaved, _ = runs
    for stages in (2, 4):
        results = _run(tmp_path, f"p{stages}", 1, stages)
        _check_split(results, 1, stages, 1)
        _check_tied_copies(results, stages)
        compare_runs(results, reference)
        assert {r["schedule"] for r in results} == {"Schedule1F1B"}
    # sharded data parallelism at one data-parallel rank: fairseq moves the model to its device itself
    # there (.to(), which converts the tied embedding once for each module that holds it)
    results = _run(tmp_path, "p2-fully-sharded", 1, 2, extra=("--ddp-backend", "fully_sharded"))
    _check_split(results, 1, 2, 1)
    _check_tied_copies(results, 2)
    compare_runs(results, reference)
    # the embedding and the loss counted as layers in the split: 4 + 2 over 3 stages, 1, 2 and 1 decoder layers
    results = _run(tmp_path, "p3-counted", 1, 3, extra=("--account-for-embedding-in-pipeline-split",
                                                        "--account-for-loss-in-pipeline-split"))
    assert sorted(len(r["layers"]) for r in results) == [1, 1, 2]
    _check_split(results, 1, 3, 1, held={0: [0], 1: [1, 2], 2: [3]})
    _check_tied_copies(results, 3)
    compare_runs(results, reference)
    # a zero-bubble schedule at 4 stages: interleaved-zb at one chunk per stage, ZB-1P
    results = _run(tmp_path, "p4-zb", 1, 4, extra=("--pipeline-schedule", "interleaved-zb"))
    _check_split(results, 1, 4, 1)
    _check_tied_copies(results, 4)
    compare_runs(results, reference)
    assert {r["schedule"] for r in results} == {"ScheduleInterleavedZeroBubble"}
    # the interleaved schedule: 2 stages of 2 model chunks, rank 0 holding layers 0 and 2, rank 1 layers 1 and 3
    results = interleaved
    _check_split(results, 1, 2, 1, virtual=2)
    _check_tied_copies(results, 2)
    compare_runs(results, reference)
    assert {r["schedule"] for r in results} == {"ScheduleInterleaved1F1B"}
    # the zero-bubble schedules' split backward (input and weight passes), 2 chunks per stage; under zbv and
    # dualpipev stage 0 holds both ends of the model and the tied embedding is one tensor there, no copy elsewhere
    for name, schedule_class, extra, v_shape in SCHEDULE_RUNS:
        results = _run(tmp_path, name, 1, 2, extra=("--pipeline-schedule", name, *extra), validate=True)
        assert {r["schedule"] for r in results} == {schedule_class}
        for r in results:  # the forward alone (a validation step) on every rank, after the last update
            torch.testing.assert_close(r["valid_loss"], reference[0]["valid_loss"], **LOSS_TOL)
        _check_split(results, 1, 2, 1, virtual=2, v_shape=v_shape)
        compare_runs(results, reference)
    # Control: the same run at twice the learning rate has the same first loss and then departs
    # from it; the comparison refuses it on the values.
    control = _run(tmp_path, "control", 1, 1, extra=("--lr", str(2 * LR)))
    assert control[0]["losses"][0] == reference[0]["losses"][0]
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        compare_runs(control, reference)


def test_a_checkpoint_of_two_stages_of_two_chunks_resumes_at_any_layout_and_schedule(runs):
    """The P 2 x V 2 checkpoint resumed with its optimizer state at P 2 x
    V 1, at one stage and under zbv (the weights and each parameter's Adam
    moments cut for the new stages) for the last 5 updates, against the run
    that went on unchanged, at the tolerances of the module docstring; and
    the zbv run's own checkpoint at one stage with --reset-optimizer (as
    --finetune-from-model: fairseq calls the same load with it): the first
    loss is the one the weights give, the optimizer starts again at step 1."""
    root, _, interleaved, saved = runs
    rest = UPDATES - SAVED_AFTER
    zbv_saved = str(root / "checkpoint_zbv.pt")
    for name, stages, extra, checkpoint in (
            ("p2v1", 2, (), dict(restore=saved)),
            ("p1", 1, (), dict(restore=saved)),
            ("zbv", 2, ("--pipeline-schedule", "zbv"), dict(restore=saved, save_after=2, save_to=zbv_saved))):
        results = _run(root, f"resumed-{name}", 1, stages, extra=extra, updates=rest, checkpoint=checkpoint,
                       batches=partial(epoch_part, UPDATES, SAVED_AFTER))
        assert {tuple(r["optimizer_steps"]) for r in results} == {(UPDATES,)}, name  # Adam's steps went on
        compare_runs(results, _last(interleaved, rest))
    # --reset-optimizer from the zbv run's checkpoint (P 2 x V 2 to zbv: tests/e2e/test_pipeline.py, fine-tuning)
    after = SAVED_AFTER + 2
    results = _run(root, "reset-p1-from-zbv", 1, 1, updates=1, checkpoint=dict(restore=zbv_saved, reset_optimizer=True),
                   batches=partial(epoch_part, UPDATES, after))
    assert results[0]["optimizer_steps"] == [1]
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(interleaved[0]["losses"][after:][:1]),
                               **LOSS_TOL)


@pytest.mark.slow
def test_zbv_without_tied_embeddings(tmp_path):
    """zbv with the embedding and the output projection two tensors on stage 0."""
    reference = _run(tmp_path, "p1", 1, 1, tied=False, updates=SHORT)
    results = _run(tmp_path, "zbv", 1, 2, extra=("--pipeline-schedule", "zbv"), tied=False, updates=SHORT)
    first = next(r for r in results if r["coordinates"][2] == 0)
    assert {"decoder.embed_tokens.weight", "decoder.output_projection.weight"} <= set(first["names"])
    compare_runs(results, reference)


@pytest.mark.slow
def test_tensor_and_pipeline_with_checkpointing_and_sequence_parallel(tmp_path):
    extra = ("--checkpoint-activations", "--sequence-parallel")
    results = _run(tmp_path, "tp_pp", 2, 2, extra=extra, updates=SHORT)
    _check_split(results, 2, 2, 1)
    _check_tied_copies(results, 2)
    reference = _run(tmp_path, "tp", 2, 1, extra=extra, updates=SHORT)
    compare_runs(results, reference)
    # zbv: each tensor rank's stage 0 holds both ends of the model, its vocabulary shard of the tied embedding
    results = _run(tmp_path, "tp_zbv", 2, 2, extra=(*extra, "--pipeline-schedule", "zbv"), updates=SHORT)
    assert {r["schedule"] for r in results} == {"ScheduleZBVZeroBubble"}
    _check_split(results, 2, 2, 1, virtual=2, v_shape=True)
    compare_runs(results, reference)


@pytest.mark.slow
def test_data_and_pipeline(tmp_path):
    results = _run(tmp_path, "dp_pp", 1, 2, data=2, updates=SHORT)
    _check_split(results, 1, 2, 2)
    _check_tied_copies(results, 2)
    reference = _run(tmp_path, "dp", 1, 1, data=2, updates=SHORT)
    compare_runs(results, reference)
    # a zero-bubble schedule: legacy_ddp all-reduces the gradients after the last weight pass
    results = _run(tmp_path, "dp_zb", 1, 2, data=2, updates=SHORT,
                   extra=("--pipeline-schedule", "interleaved-zb", *INTERLEAVED))
    assert {r["schedule"] for r in results} == {"ScheduleInterleavedZeroBubble"}
    _check_split(results, 1, 2, 2, virtual=2)
    compare_runs(results, reference)


@pytest.mark.slow
@pytest.mark.parametrize("half", sorted(HALF))
def test_half_precision(tmp_path, half):
    """fp16 weights with fairseq's loss scaler, and fp32 weights under bf16
    autocast: losses, norms and gradients compared."""
    results = _run(tmp_path, half, 1, 2, extra=HALF[half], updates=SHORT)
    _check_tied_copies(results, 2)
    dtype = torch.float16 if half == "fp16" else torch.float32
    assert all(p.dtype == dtype for r in results for p in r["params"].values())
    reference = _run(tmp_path, f"{half}-one-stage", 1, 1, extra=HALF[half], updates=SHORT)
    compare_runs(results, reference, HALF_LOSS_TOL[half], HALF_GRAD_TOL[half], weight_tol=None)
