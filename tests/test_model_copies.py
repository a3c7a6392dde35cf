"""``copy.deepcopy`` of the model: what fairseq-train ``--store-ema`` does.

fairseq's EMA (``fairseq/models/ema/ema.py``) deep-copies the whole model.
Our modules keep their process group, which cannot be pickled, so the copy
failed at model-parallel size > 1. A copy must share the group, own new
parameters, and run its own weights also where ``--compile-layers`` or
``--checkpoint-activations`` replaced a layer's forward (functions that
deepcopy does not copy). Numbers are compared bitwise: copy and original
run the same operations in the same order on equal weights.
"""

import copy
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.training.activation_checkpointing import checkpoint_wrapper, compile_for_training
from tests.helpers import build_model, init_model_parallel, make_batch, run_distributed


def _training_logits(model, dictionary):
    """Logits of one training-mode forward (dropout is off in these models),
    and the loss's backward."""
    model.train()
    tokens, target = make_batch(dictionary, seed=2)
    logits, _ = model(tokens)
    F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1), ignore_index=dictionary.pad()).backward()
    return logits.detach()


def _check_copy(model, dictionary):
    """Copy ``model``; check the copy shares no parameter, computes what the
    original does, and then computes with its own weights once those change."""
    before = _training_logits(model, dictionary)
    copied = copy.deepcopy(model)
    ours = {p.data_ptr() for p in model.parameters()}
    assert not any(p.data_ptr() in ours for p in copied.parameters()), "the copy shares parameter storage"
    for p in copied.parameters():
        p.grad = None
    assert torch.equal(_training_logits(copied, dictionary), before)

    with torch.no_grad():
        for layer in copied.decoder.layers:
            layer.fc2.weight.mul_(2.0)
    for p in model.parameters():
        p.grad = None
    changed = _training_logits(copied, dictionary)
    assert not torch.equal(changed, before), "the copy's forward ran the original's weights"
    assert all(p.grad is None for p in model.parameters()), "the copy's backward reached the original"
    assert torch.equal(_training_logits(model, dictionary), before), "changing the copy changed the original"
    return copied


def _copy_at_size(rank, world_size, wrapped):
    init_model_parallel(world_size)
    model, dictionary = build_model(world_size, seed=0)
    aot_eager = functools.partial(compile_for_training, backend="aot_eager")
    for layer in model.decoder.layers:
        for wrap in wrapped:
            {"compile": aot_eager, "checkpoint": checkpoint_wrapper}[wrap](layer)
    copied = _check_copy(model, dictionary)
    group = copied.decoder.layers[0].fc1.group
    assert group is model.decoder.layers[0].fc1.group, "the copy has another group"
    assert isinstance(group, dist.ProcessGroup) and dist.get_world_size(group) == world_size
    return parallel_state.get_tensor_model_parallel_world_size()


def test_copy_at_model_parallel_size_2(tmp_path):
    assert run_distributed(_copy_at_size, 2, tmp_path, ()) == [2, 2]


def test_copy_of_compiled_and_checkpointed_layers_at_size_2(tmp_path):
    assert run_distributed(_copy_at_size, 2, tmp_path, ("compile", "checkpoint")) == [2, 2]


def test_copy_of_the_compiled_layer_stack():
    """Size 1, one process: ``--compile-layers`` compiles the whole stack."""
    model, dictionary = build_model(1, seed=0)
    model.decoder.compile_run_layers(backend="aot_eager")
    copied = _check_copy(model, dictionary)
    assert copied.decoder._compiled_layer_stack is not model.decoder._compiled_layer_stack
