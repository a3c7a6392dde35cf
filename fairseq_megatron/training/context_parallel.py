"""Context parallelism (``--context-parallel-size C``) applied to a built
model, and the sample sizes each of its ranks counts.

The model itself splits the sequence
(:class:`~fairseq_megatron.models.model_parallel_transformer_decoder.ModelParallelTransformerDecoder`,
:class:`~fairseq_megatron.modules.ModelParallelMultiheadAttention`, the
split itself in :mod:`fairseq_megatron.parallel.context_parallel`);
:func:`apply_context_parallel` tells it the group. The ``C`` ranks read
the same batches and each computes the loss of its own positions, so
fairseq's sums over the ranks that average gradients (the ``D x C`` ranks,
:class:`~fairseq_megatron.fairseq_integration.trainer.MegatronTrainer`)
must count each token and each sequence once: :func:`count_own_share`.
Parameters are not split by ``C``: every context-parallel rank holds the
whole part of its tensor-parallel rank, and checkpoints do not depend on ``C``.
"""

import logging

import torch.nn as nn

from fairseq_megatron.modules import ModelParallelMultiheadAttention
from fairseq_megatron.parallel.context_parallel import ContextSplit
from fairseq_megatron.parallel.parallel_state import RankGroup

logger = logging.getLogger(__name__)


def apply_context_parallel(model: nn.Module, group: RankGroup) -> ContextSplit:
    """Make ``model`` (a ``model_parallel_transformer_lm``, any pipeline
    stage of it) split its training and validation passes over the
    context-parallel ``group`` of ``C`` ranks: the decoder keeps this rank's
    positions, padded to a multiple of ``2C`` (and of ``C x T`` with
    ``--sequence-parallel``), and each attention gathers the keys and values
    of all of them. Returns the split, which the trainer counts each
    sample's share by (:func:`count_own_share`)."""
    decoder = model.decoder
    split = ContextSplit(group, ContextSplit.multiple_for(group.size, decoder.tensor_parallel.size,
                                                          decoder.sequence_parallel))
    decoder.context_split = split
    for module in decoder.modules():
        if isinstance(module, ModelParallelMultiheadAttention):
            module.context_parallel = group
    chunks = 2 * group.size
    logger.info(f"context parallelism: each sequence split over {group.size} ranks, this one holding chunks "
                f"{group.rank} and {chunks - 1 - group.rank} of {chunks}")
    return split


def count_own_share(sample: dict, split: ContextSplit, pad: int) -> dict:
    """fairseq language-modeling ``sample`` with its sizes as this rank counts
    them: ``ntokens``, the targets at this rank's positions that are not
    ``pad``; ``nsentences``, the batch's rows on context-parallel rank 0 and
    none on the others (each sequence once over the group). A new dict;
    the tensors are shared. Computed from the whole target, so counting a
    sample again gives the same."""
    target = sample["target"]
    own = split.keep(split.pad(target, pad), 1)
    return dict(sample, ntokens=int(own.ne(pad).sum()),
                nsentences=target.size(0) if split.group.rank == 0 else 0)
