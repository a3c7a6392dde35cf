"""The whole model in one process: size 1 against fairseq's own
non-parallel ``transformer_lm`` with the same weights, and the bf16 autocast
training pass against fp32.

Tolerance against ``transformer_lm`` (fp32): rtol=atol=1e-5. Same weights,
but scaled_dot_product_attention versus fairseq's explicit
``softmax(q * d**-0.5 @ k^T)`` changes the order of fp32 operations (a few
ULP); a wrong weight or layer order is off by > 1e-2."""

from argparse import Namespace

import torch
from fairseq.models.transformer_lm import TransformerLanguageModel, base_lm_architecture

from fairseq_megatron.modules import vocab_parallel_cross_entropy
from tests.helpers import DIMS, SEQ_LEN, LMTask, build_model, make_batch

FWD_TOL = dict(rtol=1e-5, atol=1e-5)


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


def test_no_tensor_the_model_returns_is_a_view():
    """FSDP2 registers its pre-backward hook on each tensor a sharded root
    module returns, and warns (on every rank, every step) of one that is a
    view: an in-place op on it would drop the hook. The first inner state,
    the embedding's output turned to ``(T, B, C)``, was one."""
    model, dictionary = build_model(1)
    tokens, _ = make_batch(dictionary)
    logits, extra = model(tokens)
    returned = [logits, *extra["inner_states"]]
    assert len(returned) == len(model.decoder.layers) + 2
    assert [t._is_view() for t in returned] == [False] * len(returned)
