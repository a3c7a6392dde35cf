"""Workers for the context-parallel tests: the epoch they train on, a
control run with the mask a plain causal attention call would use, and the
activation memory of one training pass.

The trainer workers are the pipeline tests' (:func:`tests.support.pipeline.train`)
given a context-parallel size; every rank reports its context-parallel rank
and size and the length of its first layer's input.
"""

import torch

from fairseq_megatron.parallel import parallel_state
from tests.support.pipeline import LENGTH, sample, train

SHORT_BLOCK = LENGTH - 3  # 13: not a multiple of 2C = 4, padded to 16 under context parallelism


def epoch(updates: int, micro_batches: int, data_parallel_rank: int = 0) -> list:
    """``updates`` updates of ``micro_batches`` samples of ``--tokens-per-sample``
    blocks for one data-parallel rank; the last update ends the epoch with a
    batch of the last, shorter block: 2 rows of :data:`SHORT_BLOCK` tokens,
    the second 4 tokens shorter still (right-padded). The ``C`` ranks of a
    sequence get the same batches."""
    out = []
    for u in range(updates):
        seeds = [1000 * data_parallel_rank + micro_batches * u + i for i in range(micro_batches)]
        samples = [sample(s) for s in seeds]
        if u == updates - 1:
            samples[-1] = sample(seeds[-1], rows=2, length=SHORT_BLOCK, short_tail=4)
        out.append(samples)
    return out


def train_with_top_left_mask(rank, world_size, *args):
    """:func:`tests.support.pipeline.train` with the mask of SDPA's
    ``is_causal`` for a ``(T / C) x T`` problem, aligned top-left (query row
    ``i`` sees keys ``0..i`` of the gathered order, whatever its position in
    the sequence): the bug a mask by global position avoids."""
    from fairseq_megatron.parallel.context_parallel import ContextSplit

    def top_left(self, local_length, device=None):
        return torch.ones(local_length, local_length * self.size, dtype=torch.bool, device=device).triu(1)

    ContextSplit.causal_mask = top_left  # this forked rank only
    return train(rank, world_size, *args)


def activation_memory(rank, world_size, context: int, length: int, dims: dict):
    """One training pass (forward, loss, backward) of a model of ``dims`` on
    2 sequences of ``length`` tokens, at context-parallel size ``context``
    (this world): the most bytes of activations autograd kept at once
    (:class:`~fairseq_megatron.training.memory.SavedActivations`), the loss
    summed over the group, this rank's context rank and size, and the length
    of the first layer's input."""
    import torch.distributed as dist

    from fairseq_megatron.modules import vocab_parallel_cross_entropy
    from fairseq_megatron.training.memory import SavedActivations
    from tests.helpers import build_model, make_batch

    torch.set_num_threads(1)  # the two ranks share the machine's cores
    parallel_state.initialize_model_parallel(1, 1, context)
    model, dictionary = build_model(1, tokens_per_sample=length, max_target_positions=length, **dims)
    tokens, target = make_batch(dictionary, batch=2, seq_len=length, pad_tail=0)
    layer_input = []
    model.decoder.layers[0].register_forward_pre_hook(lambda _, args: layer_input.append(args[0].size(0)))
    with SavedActivations(model) as saved:
        logits, _ = model(tokens, gather_logits=False)
        loss = vocab_parallel_cross_entropy(logits, model.get_targets({"target": target}, None),
                                            ignore_index=dictionary.pad(), group=None).sum()
    loss.backward()
    total = loss.detach().clone()
    if context > 1:
        dist.all_reduce(total, group=parallel_state.get_context_parallel_group())
    return {"peak": saved.peak, "after_backward": saved.current, "loss": float(total),
            "context": (parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_world_size()),
            "first_layer_input_length": layer_input[-1]}
