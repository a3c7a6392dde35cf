"""Checks that only a CUDA GPU can make; skipped without one (CI is CPU-only).

* ``--cuda-graphs`` (the compiled layer stack replayed as CUDA graphs)
  trains to the same losses and weights as the same stack compiled without
  graphs, and really replays graphs;
* our FusedAdamW skips an update with a non-finite gradient norm on the GPU
  and reports it through its pinned host copy;
* a training step of fairseq's own trainer synchronizes with the GPU
  nowhere (torch's sync debug mode reports every stream synchronization,
  ``.item()`` and blocking copy, each with its Python stack), and fairseq's ``--optimizer
  adam`` picks our FusedAdamW for the fp32 weights of ``--bf16-autocast``;
* ``--offload-activations`` frees the layer inputs' device memory until
  backward and trains to the same gradients;
* ``--fp8`` (on a GPU of compute capability 8.9 or newer) runs real float8
  GEMMs (``torch._scaled_mm``, three per linear), composes with the
  compiled stack and CUDA graphs, stays within float8's distance of bf16,
  and a training step with it does not synchronize either."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import build_model, build_trainer, init_model_parallel, make_batch, run_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _train_compiled_stack(rank, world_size, cuda_graphs: bool, steps: int = 6, flags=None):
    """``steps`` updates of a 2 x 32 model (dropout 0; more model options in
    ``flags``, such as ``{"fp8": True}``) with the layer stack compiled,
    with or without CUDA graphs; returns the losses, the weights and whether
    the last step launched a CUDA graph."""
    init_model_parallel(1)
    model, dictionary = build_model(1, compile_layers=True, cuda_graphs=cuda_graphs, bf16_autocast=True,
                                    **(flags or {}))
    model = model.cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    losses = []

    def step(seed):
        tokens, target = make_batch(dictionary, batch=4, seed=seed, pad_tail=0)  # one shape: one graph
        logits, _ = model(tokens.cuda())
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), target.cuda().view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())

    for seed in range(steps - 1):  # warm-up, recording, replays
        step(seed)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        step(steps - 1)
    replayed = any("cudaGraphLaunch" in event.name for event in profile.events())
    return losses, {n: p.detach().cpu() for n, p in model.named_parameters()}, replayed


def _step_without_sync(rank, world_size, save_dir, extra_args):
    """Two training steps after warm-up with torch's sync debug mode on;
    returns the optimizer class fairseq picked and the Python stack of every
    synchronizing call (all of them, not only the first, so one GPU run
    names every site)."""
    import traceback
    import warnings

    from fairseq_megatron.training.fused_adam import FusedAdamW

    trainer, batches = build_trainer(save_dir, fused=False, extra_args=extra_args, cpu=False)
    picked = type(trainer.optimizer._optimizer).__name__
    for _ in range(4):  # warm-up: the first steps build, compile, record graphs, empty caches
        trainer.train_step([next(batches)])
    torch.cuda.synchronize()
    sites = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" in str(message):
            sites.append("".join(traceback.format_stack(limit=8)[:-1]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(2):
                trainer.train_step([next(batches)])
            in_steps = list(sites)
            torch.ones(1, device="cuda").item()  # the detector's control: a wait it must see
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return picked, FusedAdamW.__name__, in_steps, len(sites) - len(in_steps)


def _float8_gemms_of_one_pass(rank, world_size, recipe: str):
    """One eager training pass of the 2 x 32 model with ``--fp8`` on the GPU:
    how many times torchao called ``torch._scaled_mm``."""
    init_model_parallel(1)
    calls = []
    scaled_mm = torch._scaled_mm

    def counted(*args, **kwargs):
        calls.append(1)
        return scaled_mm(*args, **kwargs)

    torch._scaled_mm = counted  # torchao looks it up on each call
    model, dictionary = build_model(1, bf16_autocast=True, fp8=True, fp8_recipe=recipe)
    model = model.cuda().train()
    tokens, target = make_batch(dictionary, batch=4, pad_tail=0)
    logits, _ = model(tokens.cuda())
    F.cross_entropy(logits.float().view(-1, logits.size(-1)), target.cuda().view(-1)).backward()
    torch._scaled_mm = scaled_mm
    return len(calls), model.decoder.float8.config.emulate


def _skip_without_float8():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"float8 GEMMs need compute capability 8.9 or newer; {torch.cuda.get_device_name()} has "
                    f"{torch.cuda.get_device_capability()}")


def _memory_after_forward(rank, world_size, flag: str):
    """A 6-layer model on the GPU with ``flag`` (dropout 0); one batch of
    1024 sequences: (bytes allocated after the forward, bytes of one layer
    input, the gradients)."""
    init_model_parallel(1)
    model, dictionary = build_model(1, decoder_layers=6, **{flag: True})
    model = model.cuda().train()
    tokens, target = make_batch(dictionary, batch=1024, seed=3, pad_tail=0)
    logits, _ = model(tokens.cuda())
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    F.cross_entropy(logits.view(-1, logits.size(-1)), target.cuda().view(-1)).backward()
    layer_input_bytes = tokens.numel() * model.decoder.embed_dim * 4  # (T, B, C) fp32
    return allocated, layer_input_bytes, {n: p.grad.cpu() for n, p in model.named_parameters()}


def test_cuda_graphs_train_like_the_compiled_stack(tmp_path):
    """Same inductor kernels, launched one by one or replayed from a graph:
    equal losses and weights after 6 updates. Tolerance rtol 1e-5 / atol
    1e-6: the kernels are the same, but reductions in backward may add in
    another order from run to run; one Adam update moves a weight by about
    lr = 1e-3, so a stale or overwritten gradient in a replay shows."""
    (plain_losses, plain, plain_replayed), = run_distributed(_train_compiled_stack, 1, tmp_path / "plain", False)
    (graph_losses, graphs, graph_replayed), = run_distributed(_train_compiled_stack, 1, tmp_path / "graphs", True)
    assert graph_replayed and not plain_replayed
    torch.testing.assert_close(graph_losses, plain_losses, rtol=1e-5, atol=0)
    for name in plain:
        torch.testing.assert_close(graphs[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)
    assert plain_losses[-1] < plain_losses[0]  # it trained


def test_fused_adamw_skips_a_nonfinite_update_on_the_gpu():
    from fairseq_megatron.training.fused_adam import FusedAdamW

    p = torch.nn.Parameter(torch.ones(1000, device="cuda"))
    optimizer = FusedAdamW([p], lr=1e-2)
    p.grad = torch.full_like(p, 0.5)
    optimizer.skip_step_if_nonfinite(optimizer.clip_grad_norm(1.0))
    optimizer.step()
    assert not optimizer.last_step_skipped()
    after_first = p.detach().clone()
    assert not torch.equal(after_first, torch.ones_like(after_first))
    p.grad = torch.full_like(p, 0.5)
    p.grad[7] = float("inf")
    optimizer.skip_step_if_nonfinite(optimizer.clip_grad_norm(1.0))
    optimizer.step()
    assert optimizer.last_step_skipped()
    assert torch.equal(p.detach(), after_first)
    assert optimizer.state[p]["step"].item() == 1


@pytest.mark.parametrize("extra_args", [[], ["--compile-layers"], ["--compile-layers", "--cuda-graphs"],
                                        ["--compile-layers", "--cuda-graphs", "--fp8"]],
                         ids=["eager", "compiled-stack", "cuda-graphs", "fp8-cuda-graphs"])
def test_a_training_step_never_synchronizes(tmp_path, extra_args, monkeypatch):
    if "--fp8" in extra_args:
        _skip_without_float8()
        monkeypatch.delenv("FAIRSEQ_MEGATRON_FP8_EMULATE", raising=False)
    picked, expected, sites, control = run_distributed(
        _step_without_sync, 1, tmp_path, str(tmp_path / "ckpt"), extra_args)[0]
    assert control == 1  # the recording sees a deliberate .item()
    distinct = "\n---\n".join(dict.fromkeys(sites))
    assert not sites, f"{len(sites)} synchronizing calls in two steps, at:\n{distinct}"
    assert picked == expected


def test_offload_activations_frees_the_layer_inputs_on_the_gpu(tmp_path):
    """After the forward, plain checkpointing holds each layer's input on
    the device; with ``--offload-activations`` they are in host memory, so
    at least 5 of the 6 inputs' bytes are not allocated (the first may still
    be referenced by the caller until the forward returns; what else the
    two runs allocate is the same). Gradients: rtol 1e-5 / atol 1e-6, the
    same kernels on the same values, but GPU reductions (embedding
    gradients) may add in another order from run to run."""
    (kept, input_bytes, grads_kept), = run_distributed(_memory_after_forward, 1, tmp_path / "kept",
                                                       "checkpoint_activations")
    (offloaded, _, grads_offloaded), = run_distributed(_memory_after_forward, 1, tmp_path / "offloaded",
                                                       "offload_activations")
    assert kept - offloaded >= 5 * input_bytes, (kept, offloaded, input_bytes)
    for name in grads_kept:
        torch.testing.assert_close(grads_offloaded[name], grads_kept[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_runs_float8_gemms_and_composes_with_cuda_graphs(tmp_path, recipe, monkeypatch):
    """``--fp8`` on a float8 GPU, not emulated: one training pass calls
    ``torch._scaled_mm`` three times per linear (output, input gradient,
    weight gradient; 2 layers x q/k/v, attention output, fc1, fc2 = 24).
    With the compiled stack replayed as CUDA graphs it trains to the losses
    and weights of the same float8 stack without graphs (the graphs test's
    tolerances: the same kernels). Its first loss (before any update) is
    within 2^-7 of bf16's (tests/support/float8.py: float8 rounds each
    operand by at most 2^-4, and the loss averages the roundings of its 64
    tokens) and differs from it by more than the 1e-5 that separates two
    runs of the same kernels (float8 ran); it trains."""
    _skip_without_float8()
    monkeypatch.delenv("FAIRSEQ_MEGATRON_FP8_EMULATE", raising=False)
    (gemms, emulated), = run_distributed(_float8_gemms_of_one_pass, 1, tmp_path / "count", recipe)
    assert (gemms, emulated) == (24, False)
    flags = dict(fp8=True, fp8_recipe=recipe)
    (plain_losses, plain, _), = run_distributed(_train_compiled_stack, 1, tmp_path / "plain", False, 6, flags)
    (graph_losses, graphs, replayed), = run_distributed(_train_compiled_stack, 1, tmp_path / "graphs", True, 6, flags)
    (bf16_losses, _, _), = run_distributed(_train_compiled_stack, 1, tmp_path / "bf16", True)
    assert replayed
    torch.testing.assert_close(graph_losses, plain_losses, rtol=1e-5, atol=0)
    for name in plain:
        torch.testing.assert_close(graphs[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)
    first_change = abs(graph_losses[0] / bf16_losses[0] - 1)
    assert 1e-5 < first_change <= 2 ** -7, (graph_losses[0], bf16_losses[0])
    assert graph_losses[-1] < graph_losses[0]
