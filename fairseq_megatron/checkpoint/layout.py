"""Which model tensors are split how across model parts, and how to split or join them.

In memory; :mod:`fairseq_megatron.checkpoint.resharding` streams files.

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

An optimizer state tensor shaped like its parameter (Adam's moments) is
split like the parameter (:func:`optimizer_state_per_parameter`).
"""

import re
from typing import Dict, List, Optional, Tuple

import torch

from fairseq_megatron.errors import UsageError


class CheckpointError(UsageError):
    """A checkpoint (or a set of part files) that cannot be read or resharded as asked."""


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


# ------------------------------------------------------------------ optimizer state

# Model state-dict entries that are buffers, not parameters: the decoder's
# format ``version`` and the sinusoidal positions' ``_float_tensor``.
BUFFER_NAMES = ("version", "_float_tensor")


def is_per_element(value) -> bool:
    """An optimizer state entry with one value per parameter element: a
    tensor of at least one dimension (not a number, not a 0-dim ``step``)."""
    return torch.is_tensor(value) and value.dim() > 0


def parameter_keys(keys: List[str], tied: Dict[str, str]) -> List[str]:
    """The model keys that are parameters, in the order fairseq's trainer
    hands them to the optimizer: ``model.parameters()`` is the state dict's
    order without buffers and without tied duplicates (``tied``, as
    :func:`tied_keys` returns it)."""
    return [k for k in keys if k not in tied and k.rsplit(".", 1)[-1] not in BUFFER_NAMES]


def optimizer_state_per_parameter(optimizer_state: dict, model: Dict[str, torch.Tensor],
                                  keys: List[str], where: str) -> Tuple[Dict[str, dict], bool]:
    """One model part's optimizer state (fairseq's ``last_optimizer_state``)
    as ``{parameter key: {name: value}}``, every tensor viewed with its
    parameter's shape, and whether the optimizer keeps one flat tensor.

    Two layouts occur. One state entry per parameter: fairseq's and torch's
    Adam on the parameters themselves (fp32, ``--bf16-autocast``, ``--amp``,
    ``--memory-efficient-fp16``). One entry for a flat fp32 copy of all
    parameters, concatenated in order: fairseq's ``FP16Optimizer``
    (``--fp16``, ``fairseq/optim/fp16_optimizer.py``). A tensor with the
    parameter's shape (Adam's ``exp_avg``, ``exp_avg_sq``) is split like the
    parameter; 0-dim tensors and numbers (``step``) are the same for every
    part.

    Raises:
        CheckpointError: the state's parameter count or sizes do not match
            ``keys``, or it holds tensors of other shapes (Adafactor's
            factored second moments, whose row statistics of a row-parallel
            weight are per-part means and cannot be joined).
    """
    state = optimizer_state.get("state", {})
    indices = [i for group in optimizer_state.get("param_groups", []) for i in group["params"]]
    if len(indices) == len(keys):
        per_key, flat = {k: dict(state.get(i, {})) for k, i in zip(keys, indices)}, False
    elif len(indices) == 1 and len(keys) > 1:
        entry, per_key, offset, flat = state.get(indices[0], {}), {k: {} for k in keys}, 0, True
        total = sum(model[k].numel() for k in keys)
        for name, value in entry.items():
            if is_per_element(value) and value.numel() != total:
                raise CheckpointError(f"{where}: flat optimizer state {name!r} has {value.numel()} elements, "
                                      f"the parameters {total}")
        for k in keys:
            n = model[k].numel()
            for name, value in entry.items():
                if is_per_element(value):
                    value = value.narrow(0, offset, n).view(model[k].shape)
                per_key[k][name] = value
            offset += n
    else:
        raise CheckpointError(f"{where}: the optimizer state is for {len(indices)} parameters, "
                              f"the model has {len(keys)}")
    for k, entries in per_key.items():
        for name, value in entries.items():
            if is_per_element(value) and value.shape != model[k].shape:
                raise CheckpointError(
                    f"{where}: optimizer state {name!r} of {k} has shape {tuple(value.shape)}, not the "
                    f"parameter's {tuple(model[k].shape)}; only states shaped like their parameters "
                    f"(Adam's moments) can be resharded"
                )
    return per_key, flat
