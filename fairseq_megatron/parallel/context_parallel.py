"""Context parallelism: ``C`` ranks split each sequence along time.

Causal load balancing (Megatron-Core's ``get_batch_on_this_cp_rank``;
Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.2): a sequence
of ``T`` positions (a multiple of ``2C``) is cut into ``2C`` equal chunks
and rank ``i`` of the context-parallel group holds chunks ``i`` and
``2C - 1 - i``. Under the causal mask a late chunk has more keys to attend to
than an early one; paired this way every rank has the same number of
(query, key) pairs to compute.

Attention stays exact (Llama 3's all-gather variant): each rank computes
the queries of its ``T / C`` positions against the keys and values of all
``T``, gathered within the context-parallel group
(:func:`gather_keys_and_values`); the backward reduce-scatters their
gradients, so each rank receives the sum over every rank's queries of the
gradient of its own keys and values. The gathered keys come in rank order
(:meth:`ContextSplit.gathered_positions`), and the mask is built from global
positions (:meth:`ContextSplit.causal_mask`): SDPA's ``is_causal`` aligns a
``(T / C) x T`` problem top-left, which is wrong for every rank.

Everything here is a pure function of the sizes, except the one collective
pair of :func:`gather_keys_and_values`.
"""

import math
from dataclasses import dataclass

import torch

from fairseq_megatron.parallel.mappings import _gather_first_dim, _reduce_scatter_first_dim
from fairseq_megatron.parallel.parallel_state import ProcessGroup, RankGroup


@dataclass(frozen=True)
class ContextSplit:
    """How this rank's context-parallel ``group`` (``C`` ranks) splits a
    sequence; lengths are padded to a multiple of ``multiple`` (``2C``, or a
    multiple of it) first.

    Shapes: a sequence of ``T`` positions (``T`` a multiple of ``2C``);
    each rank holds ``T / C`` of them.
    """

    group: RankGroup
    multiple: int

    def __post_init__(self):
        if self.multiple % (2 * self.group.size):
            raise ValueError(f"lengths padded to a multiple of {self.multiple} cannot be cut into "
                             f"2 x {self.group.size} chunks")

    def __deepcopy__(self, memo):
        return self  # immutable, and its group is a handle to the same ranks (a copy of the model shares it)

    @property
    def size(self) -> int:
        """``C``."""
        return self.group.size

    @staticmethod
    def multiple_for(context: int, tensor: int = 1, sequence_parallel: bool = False) -> int:
        """The multiple a length is padded to: ``2C``, and with sequence
        parallelism also ``C x T`` (each rank's ``T / C`` positions are then
        split over ``T`` tensor-parallel ranks)."""
        multiple = 2 * context
        if sequence_parallel and tensor > 1:
            multiple = multiple * context * tensor // math.gcd(multiple, context * tensor)
        return multiple

    def padded_length(self, length: int) -> int:
        """``length`` rounded up to :attr:`multiple`."""
        return -(-length // self.multiple) * self.multiple

    def pad(self, tokens: torch.Tensor, pad: int) -> torch.Tensor:
        """``(B, T)`` -> ``(B, T')``, right-padded with ``pad`` to
        :meth:`padded_length` (``tokens`` itself when no padding is needed)."""
        missing = self.padded_length(tokens.size(1)) - tokens.size(1)
        if missing == 0:
            return tokens
        return torch.nn.functional.pad(tokens, (0, missing), value=pad)

    def positions(self, length: int, device=None, rank: int = None) -> torch.Tensor:
        """The global positions that ``rank`` (default: this rank) holds of
        a sequence of ``length``: chunk ``rank``, then chunk ``2C - 1 - rank``,
        ``(length / C,)`` int64.

        Raises:
            ValueError: ``length`` is not a multiple of ``2C``.
        """
        chunks = 2 * self.size
        if length % chunks:
            raise ValueError(f"a sequence of {length} positions cannot be cut into {chunks} equal chunks")
        rank = self.group.rank if rank is None else rank
        chunk = length // chunks
        first, second = rank * chunk, (chunks - 1 - rank) * chunk
        return torch.cat([torch.arange(first, first + chunk, device=device),
                          torch.arange(second, second + chunk, device=device)])

    def gathered_positions(self, length: int, device=None) -> torch.Tensor:
        """The global position of each key after :func:`gather_keys_and_values`:
        every rank's :meth:`positions`, in rank order, ``(length,)``."""
        return torch.cat([self.positions(length, device, rank) for rank in range(self.size)])

    def keep(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's positions of ``x`` along ``dim`` (of padded length
        ``T``): ``T`` -> ``T / C`` there, chunk ``i`` then chunk ``2C - 1 - i``.
        Its backward puts the gradient back at those positions (zeros
        elsewhere)."""
        return x.index_select(dim, self.positions(x.size(dim), x.device))

    def in_key_order(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """``x`` indexed by global position along ``dim`` (``T``), reordered
        as the gathered keys are (:meth:`gathered_positions`): a key padding
        mask ``(B, T)`` for the gathered keys."""
        return x.index_select(dim, self.gathered_positions(x.size(dim), x.device))

    def causal_mask(self, local_length: int, device=None) -> torch.Tensor:
        """The attention mask of this rank's ``local_length`` = ``T / C``
        queries over the ``T`` gathered keys, ``(T / C, T)`` bool: True
        (blocked) where key ``j`` comes after query ``i`` in the sequence (the
        queries' own positions, not their row numbers)."""
        length = local_length * self.size
        queries = self.positions(length, device)
        keys = self.gathered_positions(length, device)
        return keys[None, :] > queries[:, None]


class _GatherKeysAndValues(torch.autograd.Function):
    """Keys and values ``(T / C, B, H)`` of every rank -> ``(T, B, H)`` each, in
    rank order; one all-gather forward, one reduce-scatter backward."""

    @staticmethod
    def forward(ctx, k, v, group):
        ctx.group = group
        width = k.size(-1)
        gathered = _gather_first_dim(torch.cat([k, v], dim=-1), group)  # (T, B, 2H)
        return gathered[..., :width], gathered[..., width:]

    @staticmethod
    def backward(ctx, grad_k, grad_v):
        width = grad_k.size(-1)
        grad = _reduce_scatter_first_dim(torch.cat([grad_k, grad_v], dim=-1), ctx.group)  # (T / C, B, 2H)
        return grad[..., :width], grad[..., width:], None


def gather_keys_and_values(k: torch.Tensor, v: torch.Tensor, group: ProcessGroup):
    """All-gather keys and values within the context-parallel ``group``:
    ``(T / C, B, H)`` each -> ``(T, B, H)`` each, the ranks' positions in rank
    order (:meth:`ContextSplit.gathered_positions`). The backward sums the
    gradient of each rank's keys and values over the group and returns it to
    that rank (a reduce-scatter). ``H``: this rank's heads x head size. The
    identity for a group of one."""
    if group is None or torch.distributed.get_world_size(group=group) == 1:
        return k, v
    return _GatherKeysAndValues.apply(k, v, group)
