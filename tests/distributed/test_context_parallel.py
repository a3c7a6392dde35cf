"""Context parallelism against one rank.

fairseq's trainer (our ``MegatronTrainer``) trains a 2-layer model with tied
embeddings and no dropout for 20 updates of 2 samples (``--update-freq 2``)
at context-parallel size 2, with torch's DDP (``pytorch_ddp``) averaging the
gradients over the two ranks, with torch's FSDP2 (``fully_sharded``)
sharding the parameters over them, and at one rank: per-update loss and
gradient norm, the last update's gradients and the final weights are
compared. The epoch ends with a batch of a shorter block (13 tokens: padded
to 16, a multiple of 2C, with a row shorter still), so the padding path is
trained too. Each rank is shown to be one of the 2 context-parallel ranks
and its first layer to see 8 of the 16 positions (13 at one rank). ``T 2 x
C 2`` (with sequence parallelism and activation checkpointing) and ``C 2 x
P 2`` (4 processes, 3 updates, fairseq's ``legacy_ddp``, as the pipeline
tests) are compared the same way with one rank.

Tolerances: the runs compute the same sums in other orders (each rank's
loss over its positions, then over the ranks; attention over the keys in
the gathered order; the key and value gradients summed over the ranks'
queries; the tensor-parallel all-reduces), fp32: rtol 1e-5 on losses and
norms (seen: 1.0e-7), atol 1e-7 on gradients whose entries reach 5e-2 (seen:
1.7e-8). Weights: Adam divides each entry's step by that entry's own
gradient scale, so an entry whose gradient was, in some update, as small as
its rounding differences moves by a step that rounding decides; atol 1e-5,
1% of the learning rate (seen: 1.9e-6 after 3 updates at T 2 x C 2, 4.2e-7
after 20 at C 2). The attention's key bias is the extreme
case (as in ``test_pipeline_parallel.py``): its gradient is zero up to
rounding, and Adam moves it by up to about lr per update on the sign of
that rounding; it is compared at atol updates x lr (seen: 5.6e-5 after 20).
Control: the same run at context-parallel size 2 with the mask of SDPA's
``is_causal``, aligned top-left for a ``(T / C) x T`` problem, fails the
comparison on its first loss.

Activation memory: one training pass on 2 sequences of 2048 tokens keeps
at most 0.6 x the activation bytes per rank at context-parallel size 2 as
at one rank (counted by ``SavedActivations``; seen: 0.53), with the same
loss (rtol 1e-5, as above).
"""

import pytest
import torch

from tests.helpers import run_distributed
from tests.support.context_parallel import SHORT_BLOCK, activation_memory, epoch, train_with_top_left_mask
from tests.support.pipeline import LENGTH, train, whole_model

LAYERS, MICRO_BATCHES, UPDATES = 2, 2, 20
SHORT = 3  # updates of the 4-process layouts and their references (on 2 cores every collective waits)
LR = 1e-3  # tests.support.pipeline's --lr
LOSS_TOL = dict(rtol=1e-5, atol=0.0)
GRAD_TOL = dict(rtol=0.0, atol=1e-7)
WEIGHT_TOL = dict(rtol=0.0, atol=1e-5)


def _run(tmp_path, name, tensor=1, context=1, stages=1, extra=(), updates=UPDATES, worker=train):
    return run_distributed(worker, tensor * context * stages, tmp_path / name, tensor, stages, MICRO_BATCHES, LAYERS,
                           updates, extra, context, epoch)


def _check_layout(results, tensor, context, stages, positions_per_rank):
    """Every (tensor, context, pipeline) coordinate ran once, at this
    context-parallel size, each first layer seeing ``positions_per_rank``
    positions in the last pass."""
    seen = sorted((r["coordinates"][0], r["context"][0], r["coordinates"][2]) for r in results)
    assert seen == sorted((t, c, p) for t in range(tensor) for c in range(context) for p in range(stages))
    assert {r["context"][1] for r in results} == {context}
    assert {r["first_layer_input_length"] for r in results} == {positions_per_rank}


def _compare_losses(results, reference):
    for r in results:
        assert len(r["losses"]) == len(r["norms"]) == len(reference[0]["losses"])
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference[0]["losses"]), **LOSS_TOL)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(reference[0]["norms"]), **LOSS_TOL)


def _compare(results, reference):
    _compare_losses(results, reference)
    grads, ref_grads = whole_model(results, "grads"), whole_model(reference, "grads")
    assert sorted(grads) == sorted(ref_grads)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **GRAD_TOL, msg=name)
    params, ref_params = whole_model(results, "params"), whole_model(reference, "params")
    assert sorted(params) == sorted(ref_params)
    for name in ref_params:
        tol = dict(rtol=0.0, atol=len(reference[0]["losses"]) * LR) if name.endswith("k_proj.bias") else WEIGHT_TOL
        torch.testing.assert_close(params[name], ref_params[name], **tol, msg=name)


def test_context_parallel_matches_one_rank(tmp_path):
    reference = _run(tmp_path, "c1")
    _check_layout(reference, 1, 1, 1, SHORT_BLOCK)
    results = _run(tmp_path, "c2", context=2, extra=("--ddp-backend", "pytorch_ddp"))
    _check_layout(results, 1, 2, 1, LENGTH // 2)
    _compare(results, reference)
    # sharded data parallelism over the D x C = 2 ranks that average gradients: every parameter a DTensor
    sharded = _run(tmp_path, "c2-fsdp", context=2, extra=("--ddp-backend", "fully_sharded"))
    _check_layout(sharded, 1, 2, 1, LENGTH // 2)
    assert all(r["sharded"] == r["names"] and r["names"] for r in sharded)
    _compare(sharded, reference)
    # Control: a top-left causal mask changes the first loss already; the comparison refuses it.
    control = _run(tmp_path, "top-left", context=2, updates=1, worker=train_with_top_left_mask)
    first_update = [dict(reference[0], losses=reference[0]["losses"][:1], norms=reference[0]["norms"][:1])]
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        _compare_losses(control, first_update)


@pytest.mark.slow
def test_context_parallel_with_tensor_and_sequence_parallel_and_with_pipeline_stages(tmp_path):
    reference = _run(tmp_path, "c1", updates=SHORT)
    extra = ("--sequence-parallel", "--checkpoint-activations")
    tensor_context = _run(tmp_path, "t2c2", tensor=2, context=2, extra=extra, updates=SHORT)
    _check_layout(tensor_context, 2, 2, 1, LENGTH // 2 // 2)  # this rank's positions, then its sequence shard
    _compare(tensor_context, reference)
    context_pipeline = _run(tmp_path, "c2p2", context=2, stages=2, updates=SHORT)
    _check_layout(context_pipeline, 1, 2, 2, LENGTH // 2)
    _compare(context_pipeline, reference)


def test_activation_memory_per_rank_at_two_context_ranks(tmp_path):
    dims = dict(decoder_layers=2, decoder_embed_dim=128, decoder_ffn_embed_dim=512, decoder_attention_heads=4)
    length = 2048
    one = run_distributed(activation_memory, 1, tmp_path / "c1", 1, length, dims)[0]
    two = run_distributed(activation_memory, 2, tmp_path / "c2", 2, length, dims)
    assert one["context"] == (0, 1) and one["first_layer_input_length"] == length
    assert sorted(r["context"] for r in two) == [(0, 2), (1, 2)]
    assert all(r["first_layer_input_length"] == length // 2 for r in two)
    for r in two:
        torch.testing.assert_close(r["loss"], one["loss"], **LOSS_TOL)
        assert r["after_backward"] == 0  # everything kept was freed by the backward pass
        assert r["peak"] <= 0.6 * one["peak"], (r["peak"], one["peak"])
