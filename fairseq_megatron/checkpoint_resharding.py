"""Which model tensors are split how across model parts, and how to merge or split them.

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


def merge_model_parts(parts: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Concatenate the state dicts of model parts ``0..N-1`` into the size-1 state dict.

    Raises:
        ValueError: the parts have different keys, or a replicated tensor
            differs between parts (parts of different checkpoints).
    """
    keys = list(parts[0].keys())
    for i, part in enumerate(parts[1:], start=1):
        if set(part.keys()) != set(keys):
            raise ValueError(f"model part {i} has different tensors than part 0")
    merged = {}
    for key in keys:
        dim = partition_dim(key)
        tensors = [p[key] for p in parts]
        if dim is None:
            for i, t in enumerate(tensors[1:], start=1):
                if t.shape != tensors[0].shape or not torch.equal(t, tensors[0]):
                    raise ValueError(
                        f"replicated tensor {key} differs between model part 0 and part {i}: "
                        f"the parts come from different checkpoints"
                    )
            merged[key] = tensors[0]
        else:
            merged[key] = torch.cat(tensors, dim=dim)
    return merged


def split_model_state(state: Dict[str, torch.Tensor], num_parts: int) -> List[Dict[str, torch.Tensor]]:
    """Split a size-1 state dict into ``num_parts`` model parts (inverse of :func:`merge_model_parts`).

    Raises:
        ValueError: a partitioned dimension is not divisible by ``num_parts``.
    """
    parts = [dict() for _ in range(num_parts)]
    for key, tensor in state.items():
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
    return parts
