"""What the unit and distributed tests of evaluation batches and context windows share."""

import torch

from tests.helpers import make_dictionary

CONTEXT = 7  # longer than a block, so a context spans several earlier blocks


def batches(dataset, batch_size):
    return [list(range(i, min(i + batch_size, len(dataset)))) for i in range(0, len(dataset), batch_size)]


def fake_hypos(dictionary, bpe_ids, gen):
    """One batch of scorer output: 3 hypotheses of random tokens (some of
    them BPE continuations) with random log-probabilities."""
    hypos = []
    for _ in range(3):
        n = int(torch.randint(2, 9, (1,), generator=gen))
        tokens = torch.randint(4, len(dictionary), (n,), generator=gen)
        tokens[torch.rand(n, generator=gen) < 0.3] = bpe_ids[0]
        scores = -5 * torch.rand(n, generator=gen)
        hypos.append([{"tokens": tokens, "positional_scores": scores}])
    return hypos


def fake_samples(seed: int, remove_bos_token: bool = False):
    """A dictionary with two BPE continuation symbols, and 4 batches of
    :func:`fake_hypos`, each carried by its sample for a stubbed scorer.
    With ``remove_bos_token`` each hypothesis starts with BOS (fairseq
    asserts it)."""
    dictionary = make_dictionary()
    bpe_ids = [dictionary.add_symbol("ab@@"), dictionary.add_symbol("cd@@")]
    gen = torch.Generator().manual_seed(seed)
    batches = [fake_hypos(dictionary, bpe_ids, gen) for _ in range(4)]
    if remove_bos_token:
        for h in batches:
            for hypo in h:
                hypo[0]["tokens"][0] = dictionary.bos()
    samples = [{"net_input": {}, "ntokens": 1, "id": torch.arange(3 * b, 3 * b + 3), "hypos": h}
               for b, h in enumerate(batches)]
    return dictionary, samples
