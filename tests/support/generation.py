"""What the unit and distributed tests of incremental decoding share."""

import torch

TOL = dict(rtol=1e-5, atol=1e-5)
MAX_NEW = 10


def incremental_logits(model, tokens):
    state = {}
    steps = [model(tokens[:, : t + 1], incremental_state=state)[0][:, -1] for t in range(tokens.size(1))]
    return torch.stack(steps, dim=1)
