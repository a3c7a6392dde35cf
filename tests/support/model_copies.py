"""What a copy of the model must be, for the tests of ``copy.deepcopy``
(fairseq's EMA): it shares the process group, owns new parameters, and runs
its own weights. Numbers are compared bitwise: copy and original run the
same operations in the same order on equal weights."""

import copy

import torch
import torch.nn.functional as F

from tests.helpers import make_batch


def _training_logits(model, dictionary):
    """Logits of one training-mode forward (dropout is off in these models),
    and the loss's backward."""
    model.train()
    tokens, target = make_batch(dictionary, seed=2)
    logits, _ = model(tokens)
    F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1), ignore_index=dictionary.pad()).backward()
    return logits.detach()


def check_copy(model, dictionary):
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
