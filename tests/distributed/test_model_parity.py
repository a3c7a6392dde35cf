"""The whole model at tensor-parallel sizes 2 and 4 (with and without
sequence parallelism) against size 1 with the same weights, in gloo ranks.

Tolerances (fp32):
* logits, loss: rtol=atol=1e-5. Row-parallel layers sum N partial GEMMs
  (and the loss sums per-shard exponentials) where size 1 runs one GEMM; the
  reassociated fp32 sums differ by a few ULP per layer (~1e-6 after two
  layers); a wrong shard or reduction is off by > 1e-2.
* gradients: rtol=1e-4, atol=1e-5. The backward adds one more all-reduce per
  layer and summation over B*T positions; measured differences stay below
  1e-6, and gradients are O(1e-1), so 1e-4 relative is still tight."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fairseq_megatron.checkpoint.layout import split_model_state
from tests.support.partition import expected_partition_dim, expected_partition_dims
from fairseq_megatron.modules import vocab_parallel_cross_entropy
from fairseq_megatron.parallel import parallel_state
from tests.helpers import SEQ_LEN, build_model, init_model_parallel, make_batch, run_distributed

FWD_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-5)


def _reference(batch_seed):
    """Size-1 model in this (non-distributed) process: logits, loss, grads."""
    model, dictionary = build_model(1)
    model.eval()
    tokens, target = make_batch(dictionary, seed=batch_seed)
    logits, _ = model(tokens)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1),
                           ignore_index=dictionary.pad(), reduction="sum")
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return state, logits.detach(), loss.detach(), grads


def _gather(t, dim, group):
    n = parallel_state.world_size(group)
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _parallel_worker(rank, world_size, model_parallel_size, reference_path, sequence_parallel=False):
    init_model_parallel(model_parallel_size)
    group = parallel_state.get_tensor_model_parallel_group()
    tp_rank = parallel_state.rank(group)
    dp_rank = parallel_state.get_data_parallel_rank()
    reference_state = torch.load(reference_path)

    model, dictionary = build_model(model_parallel_size, sequence_parallel=sequence_parallel)
    # Same seed, master weights built once and sliced: the fresh size-N model
    # *is* the size-1 model, shard for shard.
    dims = expected_partition_dims(reference_state)
    expected_part = split_model_state(reference_state, model_parallel_size, dims)[tp_rank]
    init_matches = all(torch.equal(v, expected_part[k]) for k, v in model.state_dict().items())
    model.load_state_dict(expected_part, strict=True)
    # Sequence parallelism runs in training passes only; dropout is 0 here, so
    # a training pass computes the same function as an eval pass.
    model.train(sequence_parallel)
    layer_input_lengths = []
    model.decoder.layers[0].register_forward_pre_hook(lambda m, a: layer_input_lengths.append(a[0].size(0)))

    # Each model-parallel group gets its own batch (catches WORLD-wide collectives).
    tokens, target = make_batch(dictionary, seed=10 + dp_rank)
    logits, _ = model(tokens)  # gathered (B, T, V)
    shard_logits, _ = model(tokens, gather_logits=False)  # (B, T, V / N)
    loss = vocab_parallel_cross_entropy(shard_logits, target, ignore_index=dictionary.pad(), group=group).sum()
    loss.backward()

    grads = {}
    for name, p in model.named_parameters():
        dim = expected_partition_dim(name)
        grads[name] = p.grad if dim is None else _gather(p.grad, dim, group)
    return {
        "tp": parallel_state.world_size(group),
        "dp_rank": dp_rank,
        "local_vocab": shard_logits.size(-1),
        "init_matches": init_matches,
        "layer_input_lengths": layer_input_lengths,
        "logits": logits.detach(),
        "loss": loss.detach(),
        "grads": grads,
    }


@pytest.mark.parametrize(
    "world_size,model_parallel_size,sequence_parallel",
    [(2, 2, False), (4, 4, False), (4, 2, False), (2, 2, True), (4, 2, True)],
    ids=["mp2", "mp4", "world4-two-groups-of-2", "mp2-sequence-parallel", "world4-sequence-parallel"],
)
def test_tensor_parallel_matches_size_1(tmp_path, world_size, model_parallel_size, sequence_parallel):
    """Logits, loss and every gradient at size N (optionally with sequence
    parallelism) equal the size-1 model's; the first layer saw T / N positions
    exactly when sequence parallelism was on."""
    num_groups = world_size // model_parallel_size
    references = [_reference(batch_seed=10 + g) for g in range(num_groups)]
    reference_path = os.path.join(tmp_path, "reference.pt")
    torch.save(references[0][0], reference_path)

    results = run_distributed(_parallel_worker, world_size, tmp_path, model_parallel_size, reference_path,
                              sequence_parallel)

    vocab = references[0][1].size(-1)
    for rank, r in enumerate(results):
        assert r["tp"] == model_parallel_size and r["dp_rank"] == rank // model_parallel_size
        assert r["local_vocab"] == vocab // model_parallel_size, "logits were not vocab-sharded"
        assert r["init_matches"], "size-N initialisation is not the shard of the size-1 one"
        local_len = SEQ_LEN // model_parallel_size if sequence_parallel else SEQ_LEN
        assert r["layer_input_lengths"] == [local_len, local_len], r["layer_input_lengths"]
        _, ref_logits, ref_loss, ref_grads = references[r["dp_rank"]]
        torch.testing.assert_close(r["logits"], ref_logits, **FWD_TOL)
        torch.testing.assert_close(r["loss"], ref_loss, **FWD_TOL)
        assert set(r["grads"]) == set(ref_grads)
        for name, g in ref_grads.items():
            torch.testing.assert_close(r["grads"][name], g, **GRAD_TOL, msg=lambda m: f"{name}: {m}")
