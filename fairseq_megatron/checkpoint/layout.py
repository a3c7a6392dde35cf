"""Which model tensors are split how across model parts, and how to split or join them.

In memory; :mod:`fairseq_megatron.checkpoint.resharding` streams files.

How a tensor is split is what its parameter says of itself
(:mod:`fairseq_megatron.modules.parameter_attributes`: ``tensor_model_parallel``
and ``partition_dim``, set by the layer that creates it). For a model in
memory :func:`partition_dims_of_model` reads the attributes; for files on
disk, :func:`partition_dims` builds the model their config describes on the
``meta`` device (no weights drawn or allocated) and reads them there. For
the model-parallel transformer LM this gives the layout of fairseq's
ModelParallelTransformerDecoder:

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

import argparse
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from fairseq_megatron.errors import UsageError
from fairseq_megatron.modules.parameter_attributes import partition_dim


class CheckpointError(UsageError):
    """A checkpoint (or a set of part files) that cannot be read or resharded as asked."""


# Model state-dict entries that are buffers, not parameters: the decoder's
# format ``version`` and the sinusoidal positions' ``_float_tensor``.
BUFFER_NAMES = ("version", "_float_tensor")

PartitionDims = Dict[str, Optional[int]]
"""``{state-dict key: the dimension model parts split it along, or None (replicated)}``."""


def partition_dims_of_model(model: nn.Module) -> PartitionDims:
    """The split of every entry of ``model.state_dict()``, read from its
    parameters' attributes (buffers are replicated).

    Raises:
        ValueError: a parameter that does not say how it is split.
    """
    return {key: partition_dim(value) if isinstance(value, nn.Parameter) else None
            for key, value in model.state_dict(keep_vars=True).items()}


def arguments_of(config) -> argparse.Namespace:
    """A checkpoint's model config (argparse Namespace, dict or omegaconf) as a new Namespace."""
    if isinstance(config, argparse.Namespace):
        return argparse.Namespace(**vars(config))
    if not isinstance(config, dict):
        from omegaconf import OmegaConf

        config = OmegaConf.to_container(config, resolve=True)
    return argparse.Namespace(**config)


def model_on_meta(config, padded_vocab_size: int) -> nn.Module:
    """The model that checkpoint config ``config`` describes (a
    ``model_parallel_transformer_lm`` with ``padded_vocab_size`` vocabulary
    rows), built whole as one part with its sharded weights on the ``meta``
    device: neither drawn nor allocated. Its ``state_dict()`` gives every
    key, each whole tensor's shape and, through the parameters' attributes,
    how model parts split it (:func:`partition_dims`).

    Raises:
        UsageError: the config describes a model this package cannot build.
    """
    from fairseq.data import Dictionary

    from fairseq_megatron.models.model_parallel_transformer_lm import ModelParallelTransformerLanguageModel
    from fairseq_megatron.modules import sharding
    from fairseq_megatron.parallel.parallel_state import RankGroup

    args = arguments_of(config)
    args.model_parallel_size, args.pipeline_model_parallel_size = 1, 1
    args.padded_vocab_size, args.dictionary_size, args.dictionary_checksum = padded_vocab_size, None, None

    class _Task:  # what build_model reads of a task
        source_dictionary = target_dictionary = Dictionary()

    while len(_Task.source_dictionary) < padded_vocab_size:
        _Task.source_dictionary.add_symbol(f"madeupword{len(_Task.source_dictionary):06d}")
    generator = torch.get_rng_state()  # fairseq's learned positions draw at construction
    try:
        # the draws queued and never run: the weights stay on the meta device
        return ModelParallelTransformerLanguageModel._build(args, _Task(), RankGroup(),
                                                            sharding.DeferredInitialisation())
    finally:
        torch.set_rng_state(generator)


def partition_dims(config, padded_vocab_size: int) -> PartitionDims:
    """The split of every state-dict key of the model that checkpoint config
    ``config`` describes (a ``model_parallel_transformer_lm`` with
    ``padded_vocab_size`` vocabulary rows), read from the attributes of that
    model built on the ``meta`` device (:func:`model_on_meta`).

    Raises:
        UsageError: the config describes a model this package cannot build.
    """
    return partition_dims_of_model(model_on_meta(config, padded_vocab_size))


def key_partition_dim(dims: PartitionDims, key: str) -> Optional[int]:
    """``dims[key]``; None (replicated) for the buffers of :data:`BUFFER_NAMES`
    that older checkpoints hold and the model no longer keeps in its state
    dict (the sinusoidal positions' ``_float_tensor``).

    Raises:
        CheckpointError: ``key`` is not a tensor of the model (a checkpoint
            of another model, or a key this package does not know).
    """
    if key in dims:
        return dims[key]
    if key.rsplit(".", 1)[-1] in BUFFER_NAMES:
        return None
    raise CheckpointError(f"the checkpoint holds {key}, which the model its config describes has not: "
                          f"not a checkpoint of this model")


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


def split_model_state(state: Dict[str, torch.Tensor], num_parts: int,
                      dims: PartitionDims) -> List[Dict[str, torch.Tensor]]:
    """Split a size-1 state dict into ``num_parts`` model parts, each key
    along ``dims[key]`` (:func:`partition_dims`).

    Raises:
        ValueError: a partitioned dimension is not divisible by ``num_parts``.
        CheckpointError: a key ``dims`` does not know.
    """
    parts = [dict() for _ in range(num_parts)]
    tied = tied_keys(state)
    for key, tensor in state.items():
        if key in tied:
            continue
        dim = key_partition_dim(dims, key)
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
