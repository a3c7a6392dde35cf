"""``--fp8`` in one process: the layers compute what torchao's own
``Float8Linear`` computes, float8 stays a compute mode of training passes
(evaluation, the output projection, parameters and checkpoints unchanged),
it composes with the compiled layer stack, activation checkpointing and
bf16 autocast, and what it refuses, in one line each. torchao's float8
training is emulated on the CPU (:mod:`tests.support.float8`)."""

import re
import sys
from argparse import Namespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fairseq_megatron.errors import UsageError
from fairseq_megatron.modules import ColumnParallelLinear, RowParallelLinear
from fairseq_megatron.modules.float8 import EMULATE_VARIABLE, Float8Training
from fairseq_megatron.training.float8 import use_float8
from fairseq_megatron.modules.model_parallel_multihead_attention import ModelParallelMultiheadAttention
from fairseq_megatron.models.model_parallel_transformer_lm import ModelParallelTransformerLanguageModel
from fairseq_megatron.training.float8 import check_fp8_environment
from fairseq_megatron.training.compile import compile_layer_stack
from tests.helpers import LMTask, build_model, make_batch, make_dictionary, model_args, parallelized
from tests.support.float8 import (
    RECIPES,
    assert_normwise_close,
    differs_beyond_fp32,
    emulated,
    random_biases,
    single_model_pass,
)


def _torchao_reference(weight, bias, recipe):
    """torchao's ``Float8Linear`` (what ``convert_to_float8_training`` puts in
    place of an ``nn.Linear``) holding ``weight`` and ``bias``, emulated."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    return Float8Linear.from_float(linear, config)


def _forward_backward(module, x, *args, **kwargs):
    x = x.detach().clone().requires_grad_()
    y = module(x, *args, **kwargs)
    y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
    return y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recipe", RECIPES)
def test_parallel_linears_compute_what_torchao_float8_linear_computes(recipe):
    """In a group of one, the column- and row-parallel linears with
    float8 give torchao's ``Float8Linear`` output and gradients bitwise
    (the same function on the same values: nothing of ours is between),
    and so does attention's fused q/k/v projection against one
    ``Float8Linear`` over the three concatenated weights."""
    torch.manual_seed(0)
    float8 = Float8Training.of_recipe(recipe, emulate=True)
    x = torch.randn(16, 2, 32)
    for layer in (ColumnParallelLinear(32, 64), RowParallelLinear(32, 48)):
        with torch.no_grad():
            layer.bias.normal_()
        reference = _torchao_reference(layer.weight, layer.bias, recipe)
        layer.float8 = float8
        y, dx, grads = _forward_backward(layer, x)
        y_ref, dx_ref, grads_ref = _forward_backward(reference, x)
        assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
        assert torch.equal(grads["weight"], grads_ref["weight"]) and torch.equal(grads["bias"], grads_ref["bias"])
        assert not torch.equal(y, F.linear(x, layer.weight, layer.bias))  # float8 rounding happened

    attention = ModelParallelMultiheadAttention(32, 4)
    with torch.no_grad():
        for p in (attention.q_proj.bias, attention.k_proj.bias, attention.v_proj.bias):
            p.normal_()
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    reference = _torchao_reference(torch.cat([p.weight for p in projections]),
                                   torch.cat([p.bias for p in projections]), recipe)
    assert use_float8(attention, float8) == 5  # the attention and its 4 projections
    qkv = torch.cat(attention._project_qkv(x), dim=-1)
    assert torch.equal(qkv, reference(x))


def test_evaluation_output_projection_and_checkpoints_stay_in_high_precision(monkeypatch):
    """A model with ``--fp8`` gets float8 from what training applies to it
    (:func:`fairseq_megatron.training.parallelize.parallelize`; the model as
    built, as the evaluation tools load it, has none: evaluating needs no
    torchao), in its decoder layers only (an untied output projection keeps
    none), computes evaluation passes exactly as the model without it, and
    keeps every parameter an fp32 ``nn.Parameter`` with the same state-dict
    keys, also after a training pass."""
    emulated(monkeypatch)
    plain, dictionary = build_model(1, seed=0, share_decoder_input_output_embed=False)
    as_built = ModelParallelTransformerLanguageModel.build_model(
        model_args(1, share_decoder_input_output_embed=False, fp8=True, fp8_recipe="rowwise"),
        LMTask(make_dictionary()))
    assert not any(getattr(m, "float8", None) is not None for m in as_built.modules())
    fp8, _ = build_model(1, seed=0, share_decoder_input_output_embed=False, fp8=True, fp8_recipe="rowwise")
    fp8.train()
    settings = {m.float8 for m in fp8.decoder.layers.modules() if getattr(m, "float8", None) is not None}
    assert len(settings) == 1 and next(iter(settings)).recipe == "rowwise" and next(iter(settings)).config.emulate
    assert getattr(fp8.decoder.output_projection, "float8", None) is None
    assert sum(getattr(m, "float8", None) is not None for m in fp8.decoder.layers.modules()) == 2 * 7
    tokens, target = make_batch(dictionary)
    logits, _ = fp8(tokens)
    F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1), ignore_index=dictionary.pad()).backward()
    fp8.eval()
    plain.eval()
    with torch.no_grad():
        assert torch.equal(fp8(tokens)[0], plain(tokens)[0])
    assert plain.state_dict().keys() == fp8.state_dict().keys()
    for name, p in fp8.named_parameters():
        assert type(p) is nn.Parameter and p.dtype == torch.float32 and p.grad.dtype == torch.float32, name


def test_compiled_layer_stack_in_float8_is_one_graph_and_matches_eager(monkeypatch):
    """``--compile-layers`` with ``--fp8``: the stack stays one graph
    (torchao's float8 matmul is allowed in graphs; our helper adds no
    break), and its loss and gradients equal the eager float8 model's to
    fp32 reassociation (the compiled-stack tests' 1e-5; both round the
    same values to float8)."""
    emulated(monkeypatch)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    loss, grads, _ = single_model_pass("tensorwise", decoder_layers=1)  # one layer: half the tracing
    model, dictionary = build_model(1, seed=0, fp8=True, fp8_recipe="tensorwise", decoder_layers=1)
    compile_layer_stack(model.decoder, backend="aot_eager")
    random_biases(model)
    model.train()
    tokens, target = make_batch(dictionary, seed=10)
    logits, _ = model(tokens)
    compiled_loss = F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1),
                                    ignore_index=dictionary.pad(), reduction="sum")
    compiled_loss.backward()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_activation_checkpointing_and_bf16_autocast_with_float8(monkeypatch):
    """Checkpointed layers recompute the same float8 products in backward:
    gradients equal the plain float8 model's bitwise. Under
    ``--bf16-autocast`` the products take bf16 inputs, as ``F.linear``
    does under autocast, and the fp32 weights go to float8 directly; the
    result stays within float8's tolerance of the fp32 model without
    float8 (bf16's rounding, 2^-9, is far below float8's) and away from
    it by more than fp32's."""
    emulated(monkeypatch)
    ref_loss, ref_grads, _ = single_model_pass()
    loss, grads, _ = single_model_pass("rowwise")
    checkpointed_loss, checkpointed_grads, _ = single_model_pass("rowwise", checkpoint_activations=True)
    assert torch.equal(checkpointed_loss, loss)
    for name, g in grads.items():
        assert torch.equal(checkpointed_grads[name], g), name
    bf16_loss, bf16_grads, model = single_model_pass("tensorwise", bf16_autocast=True)
    assert all(g.dtype == torch.float32 for g in bf16_grads.values())
    assert_normwise_close(bf16_loss.float(), bf16_grads, ref_loss, ref_grads)
    assert differs_beyond_fp32(bf16_loss.float(), bf16_grads, ref_loss, ref_grads)
    seen = []
    model.decoder.layers[0].fc1.register_forward_hook(lambda m, a, y: seen.append((a[0].dtype, y.dtype)))
    with torch.autocast("cpu", torch.bfloat16):
        model(make_batch(model.decoder.dictionary)[0])
    assert seen == [(torch.float32, torch.bfloat16)]  # fp32 layer-norm output in, bf16 out


@pytest.mark.parametrize("flags,refused", [
    (dict(fp16=True), "--fp8 with --fp16: torchao's float8 training takes bf16 or fp32 operands; "
                      "train with --bf16-autocast (fp32 weights) instead"),
    (dict(memory_efficient_fp16=True, fp16=True), "--fp8 with --fp16 --memory-efficient-fp16:"),
    (dict(amp=True), "--fp8 with --amp:"),
    (dict(pipeline_model_parallel_size=2), "--fp8 with --pipeline-model-parallel-size 2: float8 is untested "
                                           "with pipeline stages; drop one of the two"),
    (dict(decoder_embed_dim=40, decoder_attention_heads=8),
     "--fp8 needs the linears' features on each rank a multiple of 16 (float8 GEMMs): --decoder-embed-dim 40 "
     "at --model-parallel-size 1 gives 40"),
    (dict(decoder_ffn_embed_dim=72), "--fp8 needs the linears' features on each rank a multiple of 16 (float8 GEMMs): "
                                     "--decoder-ffn-embed-dim 72 at --model-parallel-size 1 gives 72"),
    (dict(sample_break_mode="eos"), "--fp8 with --sample-break-mode eos: float8 GEMMs need each batch's token "
                                    "count a multiple of 16; use --sample-break-mode none"),
    (dict(tokens_per_sample=24, max_target_positions=24), "--fp8 with --tokens-per-sample 24:"),
])
def test_fp8_refuses_what_it_cannot_run_from_the_options(flags, refused):
    """Checked while fairseq-train parses its command line (the
    architecture function), before anything is written."""
    with pytest.raises(UsageError, match="^" + re.escape(refused)):
        model_args(1, fp8=True, **flags)
    model_args(1, **flags)  # without --fp8 the model takes them


def test_fp8_at_model_parallel_size_4_refuses_shards_below_16():
    """C = 32 at size 4 leaves 8 features per rank; size 2 leaves 16."""
    model_args(2, fp8=True)
    with pytest.raises(UsageError, match=re.escape("--decoder-embed-dim 32 at --model-parallel-size 4 gives 8")):
        model_args(4, fp8=True)


def test_fp8_needs_torchao_and_a_float8_gpu(monkeypatch):
    """fairseq-train's start refuses ``--fp8`` without torchao, on the CPU
    and on a GPU without float8 products, unless the test mode emulates
    it; a model told ``--fp8`` without torchao still builds and evaluates,
    and what training applies to it says so in one line."""
    monkeypatch.delenv(EMULATE_VARIABLE, raising=False)
    args = Namespace(fp8=True, fp8_recipe="tensorwise")
    needs = ("--fp8 needs a GPU with float8 matrix multiplies (compute capability 8.9 or newer: Ada, Hopper, "
             "Blackwell)")
    with pytest.raises(UsageError, match=re.escape(f"{needs}; this run is on the CPU") + "$"):
        check_fp8_environment(args, cpu=True)
    check_fp8_environment(Namespace(fp8=False), cpu=True)
    with monkeypatch.context() as gpu:
        gpu.setattr(torch.cuda, "is_available", lambda: True)
        gpu.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
        gpu.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
        with pytest.raises(UsageError, match=re.escape(f"{needs}; NVIDIA A100-SXM4-80GB has 8.0") + "$"):
            check_fp8_environment(args, cpu=False)
        gpu.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
        check_fp8_environment(args, cpu=False)  # an H100
        with pytest.raises(UsageError, match=re.escape(f"{needs}; this run is on the CPU")):
            check_fp8_environment(args, cpu=True)  # --cpu on a GPU machine
    emulated(monkeypatch)
    check_fp8_environment(args, cpu=True)  # the test mode

    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # what an environment without torchao imports
    with pytest.raises(UsageError, match=r"^--fp8 needs torchao's float8 training \(.*\): pip install "
                                         r"'fairseq_megatron\[fp8\]' \(torchao==0.18.0\)$"):
        check_fp8_environment(args, cpu=True)
    args = model_args(1, fp8=True)
    model = ModelParallelTransformerLanguageModel.build_model(args, LMTask(make_dictionary()))
    model.eval()
    with torch.no_grad():
        model(make_batch(make_dictionary())[0])
    with pytest.raises(UsageError, match=r"^--fp8 needs torchao's float8 training"):
        parallelized(model, args)
