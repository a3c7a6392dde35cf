"""The model-parallel RNG tracker and activation checkpointing with dropout."""

import functools
import gc
import weakref

import torch
import torch.nn.functional as F

from fairseq_megatron.parallel.rng_tracker import MODEL_PARALLEL_RNG, RNGStatesTracker, get_rng_tracker
from fairseq_megatron.training.activation_checkpointing import checkpoint_wrapper
from fairseq_megatron.training.compile import compile_layer_stack
from tests.helpers import build_model, make_batch
from tests.support.rng_and_checkpointing import training_pass


def _build_with_layers(model_parallel_size, wrap=None, **overrides):
    """``build_model`` (seed 0), then ``wrap(layer)`` on every decoder layer
    when given (checkpointing, compilation)."""
    model, dictionary = build_model(model_parallel_size, seed=0, **overrides)
    if wrap is not None:
        for layer in model.decoder.layers:
            wrap(layer)
    return model, dictionary


def _training_pass_watching_layer_inputs(model, dictionary):
    """``training_pass``, plus: after the forward (before backward), which
    layer inputs are still alive, and how many inner states it returned."""
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda _, args: seen.append(weakref.ref(args[0])))
             for layer in model.decoder.layers]
    model.train()
    tokens, target = make_batch(dictionary, seed=2)
    logits, extra = model(tokens)
    gc.collect()
    alive = [ref() is not None for ref in seen]
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1), ignore_index=dictionary.pad())
    loss.backward()
    for hook in hooks:
        hook.remove()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, alive, len(extra["inner_states"])


def test_fork_is_a_separate_reproducible_stream():
    tracker = RNGStatesTracker()
    tracker.add(MODEL_PARALLEL_RNG, 1234)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork("cpu"):
        a = torch.rand(5)
    assert torch.equal(torch.get_rng_state(), before), "fork leaked into the default generator"
    saved = tracker.get_states()
    with tracker.fork("cpu"):
        b = torch.rand(5)
    assert not torch.equal(a, b), "the stream did not advance"
    tracker.set_states(saved)
    with tracker.fork("cpu"):
        assert torch.equal(torch.rand(5), b), "restored states do not replay the stream"
    # a fresh tracker with the same seed starts the same stream
    other = RNGStatesTracker()
    other.add(MODEL_PARALLEL_RNG, 1234)
    with other.fork("cpu"):
        assert torch.equal(torch.rand(5), a)


def test_megatron_checkpoint_format_is_accepted():
    tracker = RNGStatesTracker()
    cpu_state = torch.Generator().manual_seed(5).get_state()
    tracker.set_states({MODEL_PARALLEL_RNG: {"seed": 5, "cpu": cpu_state}})
    with tracker.fork("cpu"):
        x = torch.rand(3)
    assert torch.equal(x, torch.rand(3, generator=torch.Generator().manual_seed(5)))


def test_checkpointed_layer_replays_model_parallel_dropout():
    """With dropout on (hidden, attention and activation dropout), a
    checkpointed model must produce the same loss and gradients as the plain
    one from the same generator states: the recompute has to draw the same
    masks from both the default generator and the tracker's stream."""
    overrides = dict(dropout=0.2, attention_dropout=0.2, activation_dropout=0.2)
    results = []
    for checkpointed in (False, True):
        model, dictionary = _build_with_layers(1, checkpoint_wrapper if checkpointed else None, **overrides)
        tracker = get_rng_tracker()
        tracker.reset()
        tracker.add(MODEL_PARALLEL_RNG, 99)
        torch.manual_seed(5)
        loss, grads = training_pass(model, dictionary)
        # what the tracker holds afterwards must not depend on checkpointing either
        with tracker.fork("cpu"):
            after = torch.rand(4)
        results.append((loss, grads, after))
        tracker.reset()
    (loss0, grads0, after0), (loss1, grads1, after1) = results
    # identical arithmetic in the same order: bitwise equal is expected
    assert torch.equal(loss0, loss1)
    for name in grads0:
        assert torch.equal(grads0[name], grads1[name]), name
    assert torch.equal(after0, after1)


def test_checkpoint_activations_flag_wraps_layers():
    model, _ = build_model(1, checkpoint_activations=True)
    assert all(isinstance(layer.forward, functools.partial) for layer in model.decoder.layers)
    assert "decoder.layers.0.fc1.weight" in model.state_dict()


def test_offload_activations_keeps_no_layer_input_on_the_device():
    """``--offload-activations`` (fairseq's flag, which implies checkpointing;
    our layers checkpointed but offloaded nothing): after the forward no
    layer input is referenced any more (the layers keep host copies; on a
    GPU the device memory is freed), where plain checkpointing keeps every
    one. The loss, the gradients and the tracker's stream afterwards equal
    the model without checkpointing bitwise, with every dropout on: the same
    arithmetic on copies of the same values, the same masks replayed.
    Without autograd (validation) the inner states are all kept."""
    overrides = dict(dropout=0.2, attention_dropout=0.2, activation_dropout=0.2, decoder_layers=3)
    runs = {}
    tracker = get_rng_tracker()
    for flag in ("none", "checkpoint_activations", "offload_activations"):
        model, dictionary = build_model(1, seed=0, **overrides, **({flag: True} if flag != "none" else {}))
        tracker.reset()
        tracker.add(MODEL_PARALLEL_RNG, 99)
        torch.manual_seed(5)
        loss, grads, alive, inner_states = _training_pass_watching_layer_inputs(model, dictionary)
        with tracker.fork("cpu"):
            after = torch.rand(4)
        runs[flag] = loss, grads, after
        assert alive == [flag != "offload_activations"] * 3, (flag, alive)
        assert inner_states == (1 if flag == "offload_activations" else 4), (flag, inner_states)
        tracker.reset()
    (loss0, grads0, after0) = runs["none"]
    for flag in ("checkpoint_activations", "offload_activations"):
        loss, grads, after = runs[flag]
        assert torch.equal(loss, loss0) and torch.equal(after, after0), flag
        for name in grads0:
            assert torch.equal(grads[name], grads0[name]), (flag, name)
    with torch.no_grad():
        _, extra = model.eval()(make_batch(dictionary)[0])
    assert len(extra["inner_states"]) == 4


def test_offloaded_compiled_layers_match_eager():
    """``--compile-layers`` with ``--offload-activations`` (each layer
    compiled, then checkpointed, as the decoder builds them): the forward
    and the recompute from the host copy both run the compiled graph; loss
    and gradients equal the eager model's within 1e-5, the tolerance of
    the compile tests above (fused kernels reorder fp32 sums)."""
    from fairseq_megatron.training.compile import compile_for_training

    torch._dynamo.reset()
    results = []
    for offloaded in (False, True):
        model, dictionary = build_model(1, seed=0, decoder_layers=3)
        if offloaded:
            for layer in model.decoder.layers:
                checkpoint_wrapper(compile_for_training(layer, backend="aot_eager"), offload_to_cpu=True)
        results.append(training_pass(model, dictionary))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"


def test_compiled_layers_match_eager():
    """``--compile-layers`` changes no numbers beyond fp32 reassociation: loss
    and gradients of a training pass (dropout 0) equal the eager model's
    within 1e-5 (fused kernels reorder sums; a wrong graph is off by far
    more). The aot_eager backend exercises dynamo tracing and the autograd
    graph without needing a C++ compiler; GPUs use the default (inductor)."""
    from fairseq_megatron.training.compile import compile_for_training

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    results = []
    for compiled in (False, True):
        wrap = functools.partial(compile_for_training, backend="aot_eager") if compiled else None
        model, dictionary = _build_with_layers(1, wrap, decoder_layers=3)
        results.append(training_pass(model, dictionary))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"


def test_compiled_layer_stack_matches_eager():
    """At model-parallel size 1 ``--compile-layers`` compiles all layers as one
    region (:func:`fairseq_megatron.training.compile.compile_layer_stack`): the
    same 1e-5 agreement with the eager model as per-layer compilation, and
    the stack is one graph (a break would show as more)."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    results = []
    for compiled in (False, True):
        model, dictionary = build_model(1, seed=0, decoder_layers=3)
        if compiled:
            compile_layer_stack(model.decoder, backend="aot_eager")
        results.append(training_pass(model, dictionary))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_compiled_layer_stack_backward_takes_one_gradient():
    """The compiled stack's one output is the last layer's: its backward
    graph takes one incoming gradient, whatever the depth. When every
    layer's output left the region, the backward took one per layer, L - 1
    of them zeros (a fill and, under CUDA graphs, a copy each per step). The
    eager model's inner states are still every layer's; a compiled training
    pass keeps the last."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)  # the calling convention AOT autograd expects

    torch._dynamo.reset()
    model, dictionary = build_model(1, seed=0, decoder_layers=3)
    compile_layer_stack(model.decoder, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture))
    model.train()
    tokens, target = make_batch(dictionary, pad_tail=0)
    logits, extra = model(tokens)
    F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1)).backward()
    assert len(graphs) == 2, "expected one forward and one backward graph"
    gradients_in = [n.name for n in graphs[1].graph.nodes if n.op == "placeholder" and "tangent" in n.name]
    assert gradients_in == ["tangents_1"], gradients_in
    assert len(extra["inner_states"]) == 1
    model.eval()
    with torch.no_grad():
        _, eager_extra = model(tokens)
    assert len(eager_extra["inner_states"]) == 4  # the input and each of the 3 layers' outputs


def test_compile_layers_picks_the_stack_or_each_layer():
    """The whole stack at size 1; each layer under --checkpoint-activations
    (whose recompute replays RNG states outside any graph)."""
    stack, _ = build_model(1, compile_layers=True)
    assert "run_layer_stack" in vars(stack.decoder) and hasattr(stack.decoder, "compiled_layer_stack")
    assert all("forward" not in vars(layer) for layer in stack.decoder.layers)
    per_layer, _ = build_model(1, compile_layers=True, checkpoint_activations=True)
    assert "run_layer_stack" not in vars(per_layer.decoder)
    assert all("forward" in vars(layer) for layer in per_layer.decoder.layers)


def test_cuda_graphs_compile_the_stack_in_reduce_overhead_mode(monkeypatch):
    """--cuda-graphs asks inductor for CUDA graphs (mode reduce-overhead) for
    the layer stack; without it, plain inductor. Other backends (the tests'
    aot_eager) take no mode."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    build_model(1, compile_layers=True, cuda_graphs=True)
    build_model(1, compile_layers=True)
    compile_layer_stack(build_model(1)[0].decoder, backend="aot_eager", cuda_graphs=True)
    assert calls == [{"mode": "reduce-overhead"}, {"backend": "inductor"}, {"backend": "aot_eager"}]


def test_attention_without_dropout_keeps_the_compiled_layer_one_graph():
    """Once the tracker is seeded (every run at model-parallel size > 1), each
    swap of the default generator is a graph break under ``--compile-layers``.
    Attention without dropout draws nothing and must not swap: the layer is
    then one graph. With attention dropout the swap is needed and the layer
    is split, which also shows that this count can fail."""
    tracker = get_rng_tracker()
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, 99)
    graphs = {}
    try:
        for attention_dropout in (0.0, 0.1):
            model, _ = build_model(1, dropout=0.1, attention_dropout=attention_dropout)
            model.train()
            x = torch.randn(16, 2, 32, requires_grad=True)  # (T, B, C)
            mask = model.decoder.buffered_future_mask(x)
            explained = torch._dynamo.explain(model.decoder.layers[0].forward)(
                x, None, None, None, self_attn_mask=mask, self_attn_padding_mask=None)
            graphs[attention_dropout] = explained.graph_count
    finally:
        tracker.reset()
    assert graphs[0.0] == 1, graphs
    assert graphs[0.1] > 1, graphs
