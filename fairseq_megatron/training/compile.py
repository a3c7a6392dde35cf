"""Compilation (``--compile-layers``) and CUDA graphs (``--cuda-graphs``) of a
built decoder, for training passes.

Two granularities (torchtitan's ``apply_compile`` compiles each block; a
whole stack of small layers pays more in host calls than it saves):

* :func:`compile_for_training`, one layer at a time: every decoder layer
  gets the same code, so dynamo traces it once and the layers share the
  compiled graph (parameters are graph inputs). Used at model-parallel size
  > 1, where the layers swap random generators around sharded dropout,
  which dynamo cannot trace, and with activation checkpointing, whose
  recompute replays that swap.
* :func:`compile_layer_stack`, the whole stack as one region
  (``ModelParallelTransformerDecoder.run_layer_stack``): compiled one layer
  at a time, every layer costs the host a guard check and a compiled-graph
  call forward and backward, and for smaller models the GPU then waits for
  the host; as one region the host queues the whole stack at once
  (docs/benchmarks.md). With ``--cuda-graphs`` the region is compiled in
  torch.compile's ``reduce-overhead`` mode: after warm-up and recording
  calls for each new batch shape, each training pass replays one CUDA graph
  forward and one backward. The weight gradients then live in the graphs'
  memory pool until the next replay, which is why gradient accumulation
  (``--update-freq`` > 1) is refused with it (:mod:`fairseq_megatron.training.options`).

Evaluation and incremental decoding stay eager: their shapes change every
step and they gain nothing from fusion (:func:`runs_compiled`).
"""

import torch
import torch.nn as nn

from fairseq_megatron.errors import UsageError
from fairseq_megatron.modules.forward_wrappers import record_wrapper


def runs_compiled(module: nn.Module, incremental_state) -> bool:
    """Whether a forward of ``module`` should take its compiled code: a
    training pass with autograd on and no key/value cache."""
    return module.training and incremental_state is None and torch.is_grad_enabled()


def compile_for_training(module: nn.Module, backend: str = "inductor") -> nn.Module:
    """``torch.compile`` ``module.forward`` (a decoder layer's) for training
    steps only; state-dict keys do not change. ``backend``: ``torch.compile``'s.
    Apply before activation checkpointing, so recomputation replays the
    compiled forward.

    At model-parallel size > 1, dropout on sharded activations (attention,
    ``--activation-dropout``) swaps in the RNG tracker's stream, and dynamo
    does not trace ``get_rng_state``/``set_rng_state``: each such dropout
    splits the layer into more graphs (counted on CPU: 4 with attention
    dropout, 6 with activation dropout as well). Without those dropouts the
    layer stays one graph.
    """
    eager = module.forward
    compiled = torch.compile(eager, backend=backend)

    def forward(x, encoder_out=None, encoder_padding_mask=None, incremental_state=None, **kwargs):
        run = compiled if runs_compiled(module, incremental_state) else eager
        return run(x, encoder_out, encoder_padding_mask, incremental_state, **kwargs)

    module.forward = forward
    record_wrapper(module, "forward", compile_for_training, backend=backend)
    return module


def compile_layer_stack(decoder: nn.Module, backend: str = "inductor", cuda_graphs: bool = False) -> nn.Module:
    """Make training passes run the decoder's ``run_layer_stack`` through
    ``torch.compile`` as one region (``cuda_graphs``: in ``reduce-overhead``
    mode, inductor only). The region returns the last layer's output alone
    (``inner_states`` is then ``[x]``): were every layer's output an output
    of the compiled region, autograd would hand its backward a gradient for
    each of them, which AOT autograd fills with zeros for those the loss does
    not use, and CUDA graphs copy into their static inputs: L - 1
    activation-sized zero fills and copies per step for nothing."""
    eager = decoder.run_layer_stack

    def last_output(x, self_attn_mask, self_attn_padding_mask, sequence_parallel, layers):
        return eager(x, self_attn_mask, self_attn_padding_mask, None, sequence_parallel, layers)[0]

    if cuda_graphs and backend == "inductor":
        compiled = torch.compile(last_output, mode="reduce-overhead")
    else:
        compiled = torch.compile(last_output, backend=backend)

    def run_layer_stack(x, self_attn_mask, self_attn_padding_mask, incremental_state, sequence_parallel,
                        layers=None):
        if not runs_compiled(decoder, incremental_state):
            return eager(x, self_attn_mask, self_attn_padding_mask, incremental_state, sequence_parallel, layers)
        x = compiled(x, self_attn_mask, self_attn_padding_mask, sequence_parallel, layers)
        return x, [x]

    decoder.run_layer_stack = run_layer_stack
    decoder.compiled_layer_stack = compiled
    record_wrapper(decoder, "run_layer_stack", compile_layer_stack, backend=backend, cuda_graphs=cuda_graphs)
    return decoder


def apply_compile(decoder: nn.Module, checkpointing: bool, cuda_graphs: bool = False, backend: str = "inductor"):
    """``--compile-layers``: the whole layer stack where nothing in it breaks
    the graph (model-parallel size 1, no activation checkpointing), else each
    layer.

    Raises:
        UsageError: ``cuda_graphs`` where the stack is not compiled whole.
    """
    whole_stack = decoder.tensor_parallel.size == 1 and not checkpointing
    if cuda_graphs and not whole_stack:
        raise_cuda_graphs_need_the_stack()
    if whole_stack:
        compile_layer_stack(decoder, backend, cuda_graphs)
        return
    for layer in decoder.held_layers():
        compile_for_training(layer, backend)


def raise_cuda_graphs_need_the_stack():
    """Raises UsageError: ``--cuda-graphs`` replays the compiled layer stack."""
    raise UsageError("--cuda-graphs replays the compiled layer stack: it needs --compile-layers at "
                     "--model-parallel-size 1 without --checkpoint-activations or --offload-activations")
