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

import glob
import os
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


def merge_model_parts(parts: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Concatenate the state dicts of model parts ``0..N-1`` into the size-1 state dict.

    Raises:
        CheckpointError: the parts have different keys, or a replicated tensor
            differs between parts (parts of different checkpoints).
    """
    keys = list(parts[0].keys())
    for i, part in enumerate(parts[1:], start=1):
        if set(part.keys()) != set(keys):
            raise CheckpointError(f"model part {i} has different tensors than part 0")
    merged = {}
    for key in keys:
        dim = partition_dim(key)
        tensors = [p[key] for p in parts]
        if dim is None:
            for i, t in enumerate(tensors[1:], start=1):
                if t.shape != tensors[0].shape or not torch.equal(t, tensors[0]):
                    raise CheckpointError(
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


# ------------------------------------------------------------------ files

PART_SUFFIX = "-model_part-{}"


def part_path(path: str, rank: int) -> str:
    """fairseq's name for model part ``rank`` of ``path``: ``model.pt`` -> ``model-model_part-{rank}.pt``."""
    if not path.endswith(".pt"):
        raise ValueError(f"checkpoint path must end in .pt: {path}")
    return path[: -len(".pt")] + PART_SUFFIX.format(rank) + ".pt"


def find_part_files(path: str) -> List[str]:
    """The part files of checkpoint ``path`` (the ``--path`` given to fairseq), in rank order.

    A checkpoint saved at model-parallel size 1 is the file itself.

    Raises:
        FileNotFoundError: neither ``path`` nor any ``<path>-model_part-K.pt``
            exists, or the part numbers have a gap.
    """
    if os.path.exists(path) and not os.path.exists(part_path(path, 0)):
        return [path]
    prefix = part_path(path, 0)[: -len("0.pt")]
    ranks = sorted(
        int(tail)
        for tail in (p[len(prefix): -len(".pt")] for p in glob.glob(glob.escape(prefix) + "*.pt"))
        if tail.isdigit()
    )
    if not ranks:
        raise FileNotFoundError(f"no checkpoint {path} and no model part files {part_path(path, 0)}, ...")
    missing = sorted(set(range(ranks[-1] + 1)) - set(ranks))
    if missing:
        raise FileNotFoundError(f"model part file {part_path(path, missing[0])} is missing")
    return [part_path(path, r) for r in ranks]


def model_config(state: dict):
    """The model's Namespace/dict config of a checkpoint: old ``args`` or newer ``cfg.model``."""
    if state.get("cfg") is not None and state["cfg"].get("model") is not None:
        return state["cfg"]["model"]
    return state["args"]


def config_value(config, name: str, default=None):
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


def set_model_parallel_size(state: dict, size: int, padded_vocab_size: int) -> None:
    """Record a new model-parallel size (and the vocabulary size it must keep) everywhere
    fairseq reads it: ``args``, ``cfg.common`` and ``cfg.model``."""
    configs = [state.get("args")]
    cfg = state.get("cfg")
    if cfg is not None:
        if cfg.get("common") is not None:
            cfg["common"]["model_parallel_size"] = size
        configs.append(cfg.get("model"))
    for config in configs:
        if config is None:
            continue
        if isinstance(config, dict):
            config["model_parallel_size"] = size
            config["padded_vocab_size"] = padded_vocab_size
        else:
            config.model_parallel_size = size
            config.padded_vocab_size = padded_vocab_size


def load_parts(path: str) -> List[dict]:
    """Load every model part of checkpoint ``path`` (trusted files only: full unpickling).

    Raises:
        FileNotFoundError: see :func:`find_part_files`.
        CheckpointError: a file is truncated or not a fairseq checkpoint, or
            the number of parts differs from the model-parallel size they record.
    """
    files = find_part_files(path)
    parts = []
    for f in files:
        try:
            state = torch.load(f, map_location="cpu", weights_only=False, mmap=True)
        except Exception as e:  # truncated zip, not a torch file, ...
            raise CheckpointError(f"cannot read {f}: {type(e).__name__}: {e}") from None
        if not isinstance(state, dict) or "model" not in state:
            raise CheckpointError(f"{f} is not a fairseq checkpoint (no 'model' entry)")
        parts.append(state)
    recorded = int(config_value(model_config(parts[0]), "model_parallel_size", 1) or 1)
    if recorded != len(parts):
        raise CheckpointError(
            f"{path}: the checkpoint was saved at model-parallel size {recorded} but "
            f"{len(parts)} part file(s) exist"
        )
    return parts


def check_divisible(config, padded_vocab_size: int, size: int) -> None:
    """Raise CheckpointError unless ``size`` divides heads, FFN size and the padded vocabulary."""
    for what, n in (
        ("attention heads", config_value(config, "decoder_attention_heads")),
        ("FFN size", config_value(config, "decoder_ffn_embed_dim")),
        ("padded vocabulary", padded_vocab_size),
    ):
        if n is not None and int(n) % size != 0:
            raise CheckpointError(f"model-parallel size {size} does not divide the {what} ({n})")


def reshard(input_path: str, output_path: str, new_size: int) -> List[str]:
    """Rewrite checkpoint ``input_path`` (any model-parallel size) for size ``new_size``.

    Model weights only: optimizer state and the per-rank RNG tracker states
    are dropped (resume from the output with ``--reset-optimizer``). Output
    files are written under temporary names and renamed; inputs are never
    overwritten. Returns the written paths.

    Raises:
        CheckpointError / FileNotFoundError: bad input (see :func:`load_parts`),
            a size that does not divide the model, or outputs that would
            overwrite inputs.
    """
    parts = load_parts(input_path)
    merged = merge_model_parts([p["model"] for p in parts])
    padded_vocab_size = merged["decoder.embed_tokens.weight"].size(0)
    check_divisible(model_config(parts[0]), padded_vocab_size, new_size)

    outputs = [output_path] if new_size == 1 else [part_path(output_path, r) for r in range(new_size)]
    inputs = {os.path.realpath(f) for f in find_part_files(input_path)}
    clash = [o for o in outputs if os.path.realpath(o) in inputs]
    if clash:
        raise CheckpointError(f"refusing to overwrite the input {clash[0]}")

    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    for out, model_state in zip(outputs, split_model_state(merged, new_size)):
        state = {k: v for k, v in parts[0].items() if k not in ("model", "last_optimizer_state")}
        state["model"] = model_state
        state["extra_state"] = {
            k: v for k, v in (state.get("extra_state") or {}).items() if k != "rng_tracker_states"
        }
        set_model_parallel_size(state, new_size, padded_vocab_size)
        tmp = out + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, out)
    return outputs
