"""The whole model: tensor-parallel sizes 2 and 4 against size 1, and size 1
against fairseq's own non-parallel ``transformer_lm``.

Tolerances (fp32):
* logits, loss: rtol=atol=1e-5. Row-parallel layers sum N partial GEMMs
  (and the loss sums per-shard exponentials) where size 1 runs one GEMM; the
  reassociated fp32 sums differ by a few ULP per layer (~1e-6 after two
  layers); a wrong shard or reduction is off by > 1e-2.
* gradients: rtol=1e-4, atol=1e-5. The backward adds one more all-reduce per
  layer and summation over B*T positions; measured differences stay below
  1e-6, and gradients are O(1e-1), so 1e-4 relative is still tight.
* fairseq transformer_lm: rtol=atol=1e-5. Same weights, but
  scaled_dot_product_attention versus fairseq's explicit
  ``softmax(q * d**-0.5 @ k^T)`` changes the order of fp32 operations.
"""

import os
from argparse import Namespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fairseq.models.transformer_lm import TransformerLanguageModel, base_lm_architecture

from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.checkpoint.layout import partition_dim, split_model_state
from fairseq_megatron.modules import vocab_parallel_cross_entropy
from tests.helpers import DIMS, SEQ_LEN, LMTask, build_model, init_model_parallel, make_batch, run_distributed

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
    expected_part = split_model_state(reference_state, model_parallel_size)[tp_rank]
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
        dim = partition_dim(name)
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


def test_size_1_matches_fairseq_transformer_lm():
    ours, dictionary = build_model(1)
    ours.eval()

    args = Namespace(**DIMS, share_decoder_input_output_embed=True, dropout=0.0, attention_dropout=0.0,
                     activation_fn="gelu", tokens_per_sample=SEQ_LEN, max_target_positions=SEQ_LEN)
    base_lm_architecture(args)
    fairseq_lm = TransformerLanguageModel.build_model(args, LMTask(dictionary))
    fairseq_lm.load_state_dict(ours.state_dict(), strict=True)
    fairseq_lm.eval()

    tokens, _ = make_batch(dictionary, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens)[0], fairseq_lm(tokens)[0], **FWD_TOL)


def test_bf16_autocast_training_pass_tracks_fp32():
    """``--bf16-autocast``: a training pass over the same fp32 weights, with
    GEMMs in bf16 (CPU autocast here, the same dtype rules as on CUDA).

    bf16 keeps 8 significant bits: each GEMM rounds its inputs and output by
    up to 2**-9 (0.2%) relative, and two layers plus the output projection
    stack several such roundings, so logits are held to 2% of their range,
    the summed loss to 0.1% (per-token errors average out), and each weight
    gradient to 3% of that gradient's largest entry; a skipped layer norm, a
    loss computed in bf16 or a wrong cast is off by far more. k_proj.bias is
    left out: its gradient is zero in exact arithmetic (softmax does not
    change when one vector is added to every key), so only rounding remains.
    Evaluation passes are untouched: fp32 logits, identical bits.
    """
    mixed, dictionary = build_model(1, bf16_autocast=True)
    full, _ = build_model(1)
    tokens, target = make_batch(dictionary)
    losses, logits = [], []
    for model in (mixed, full):
        model.train()
        out, _ = model(tokens, gather_logits=False)
        loss = vocab_parallel_cross_entropy(out, target, ignore_index=dictionary.pad()).sum()
        loss.backward()
        logits.append(out)
        losses.append(loss.detach())
    assert logits[0].dtype == torch.bfloat16 and logits[1].dtype == torch.float32
    span = logits[1].abs().max().item()
    torch.testing.assert_close(logits[0].float(), logits[1], rtol=0, atol=0.02 * span)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-3, atol=0)
    for (name, p), (_, q) in zip(mixed.named_parameters(), full.named_parameters()):
        assert p.dtype == p.grad.dtype == torch.float32, name
        if not name.endswith("k_proj.bias"):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0.03 * q.grad.abs().max().item(), msg=name)

    for model in (mixed, full):
        model.eval()
    with torch.no_grad():
        assert torch.equal(mixed(tokens)[0], full(tokens)[0])
        assert mixed(tokens)[0].dtype == torch.float32
