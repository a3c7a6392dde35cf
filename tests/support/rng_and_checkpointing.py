"""What the unit and distributed tests of the model-parallel RNG and activation checkpointing share."""

import torch.nn.functional as F

from tests.helpers import make_batch


def training_pass(model, dictionary):
    """One forward/backward in training mode on a fixed batch: (loss, {name: grad})."""
    model.train()
    tokens, target = make_batch(dictionary, seed=2)
    logits, _ = model(tokens)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1), ignore_index=dictionary.pad())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
