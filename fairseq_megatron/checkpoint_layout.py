"""Which model tensors are split how across model parts, and how to split or join them.

In memory; :mod:`fairseq_megatron.checkpoint_resharding` streams files.

The layout is that of fairseq's ModelParallelTransformerDecoder (and of
this package's modules):

======================================  ==================  =====================
key (under ``decoder.``)                kind                split along
======================================  ==================  =====================
embed_tokens.weight                     vocab parallel      dim 0 (vocabulary)
output_projection.weight                vocab parallel      dim 0 (vocabulary)
layers.N.self_attn.{q,k,v}_proj.*       column parallel     dim 0 (output)
layers.N.fc1.*                          column parallel     dim 0 (output)
layers.N.self_attn.out_proj.weight      row parallel        dim 1 (input)
layers.N.fc2.weight                     row parallel        dim 1 (input)
everything else (layer norms, row-     replicated          -- (equal in all parts)
parallel biases, positions, version)
======================================  ==================  =====================
"""

import re
from typing import Dict, List, Optional

import torch


class CheckpointError(ValueError):
    """A checkpoint (or a set of part files) that cannot be resharded as asked."""


_VOCAB = re.compile(r"(^|\.)(embed_tokens|output_projection)\.weight$")
_COLUMN = re.compile(r"(^|\.)(self_attn\.[qkv]_proj|fc1)\.(weight|bias)$")
_ROW = re.compile(r"(^|\.)(self_attn\.out_proj|fc2)\.weight$")


def partition_dim(key: str) -> Optional[int]:
    """The dimension along which model parts split tensor ``key``; None if replicated."""
    if _VOCAB.search(key) or _COLUMN.search(key):
        return 0
    if _ROW.search(key):
        return 1
    return None


def tied_keys(state: Dict[str, torch.Tensor]) -> Dict[str, str]:
    """``{key: earlier key}`` for tensors that are the same memory, such as the
    output projection tied to the token embedding (saved once by torch.save)."""
    seen, tied = {}, {}
    for key, t in state.items():
        if t.numel() == 0:
            continue
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if ident in seen:
            tied[key] = seen[ident]
        else:
            seen[ident] = key
    return tied


def _retie(parts: List[Dict[str, torch.Tensor]], tied: Dict[str, str]) -> None:
    for part in parts:
        for key, target in tied.items():
            part[key] = part[target]


def split_model_state(state: Dict[str, torch.Tensor], num_parts: int) -> List[Dict[str, torch.Tensor]]:
    """Split a size-1 state dict into ``num_parts`` model parts .

    Raises:
        ValueError: a partitioned dimension is not divisible by ``num_parts``.
    """
    parts = [dict() for _ in range(num_parts)]
    tied = tied_keys(state)
    for key, tensor in state.items():
        if key in tied:
            continue
        dim = partition_dim(key)
        if dim is None:
            for part in parts:
                part[key] = tensor
            continue
        if tensor.size(dim) % num_parts != 0:
            raise ValueError(
                f"{key}: dimension {dim} of size {tensor.size(dim)} is not divisible by {num_parts} parts"
            )
        for part, chunk in zip(parts, tensor.chunk(num_parts, dim=dim)):
            part[key] = chunk.clone()
    _retie(parts, tied)
    return [{k: p[k] for k in state} for p in parts]


def slice_for_part(tensors: List[torch.Tensor], dim: int, part: int, num_parts: int) -> torch.Tensor:
    """Part ``part`` of ``num_parts`` of the tensor whose input shards are ``tensors``
    (concatenated along ``dim``), touching only the input shards that overlap it.

    Works for any pair of sizes: 8 -> 1 concatenates all eight, 1 -> 8 slices
    one, 4 -> 2 concatenates two neighbours. Returns a new contiguous tensor.

    Raises:
        CheckpointError: the full size along ``dim`` is not divisible by ``num_parts``.
    """
    in_size = tensors[0].size(dim)
    full = in_size * len(tensors)
    if full % num_parts != 0:
        raise CheckpointError(f"dimension {dim} of size {full} is not divisible by {num_parts} parts")
    out_size = full // num_parts
    start, end = part * out_size, (part + 1) * out_size
    pieces = []
    for i, t in enumerate(tensors):
        lo, hi = max(start, i * in_size), min(end, (i + 1) * in_size)
        if lo < hi:
            pieces.append(t.narrow(dim, lo - i * in_size, hi - lo))
    return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0].clone(memory_format=torch.contiguous_format)
