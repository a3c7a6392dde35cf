"""Reshard checkpoint files from model-parallel size N to M, streaming tensor by tensor.

The published Megatron-11b is 8 part files for 8 GPUs; nothing in fairseq can
change that (fairseq issues 2351, 3398). :func:`reshard` reads the parts of a
checkpoint saved at any size and writes the parts for any size M that divides
the attention heads, the FFN size and the padded vocabulary; M = 1 gives one
file (:mod:`fairseq_megatron.checkpoint.export` writes one for fairseq's own,
non-parallel ``transformer_lm``; :mod:`fairseq_megatron.checkpoint.part_files`
finds and names the part files).

Memory: inputs are memory-mapped (``torch.load(mmap=True)``) and reopened for
every layer, so only the layer being copied is resident (a layer's mappings
close when its last tensor is dropped: the loaded dicts hold no reference
cycles); the output parts are
built and written one at a time. Peak RSS is about one output part plus one
layer of the input (see ``scripts/benchmark_reshard.py``). Files in torch's
legacy format (before PyTorch 1.6) cannot be mapped and are read whole.

Safety: inputs are never overwritten, nor written: they are opened once
(:func:`~fairseq_megatron.checkpoint.reading.open_save`) and read through
those descriptors, as they were when opened, also while a training saves the
checkpoint again. Every output is written to a temporary file of its own
(:func:`~fairseq_megatron.files.new_temporary`), verified by re-reading it
and comparing a checksum per tensor (``verify=True``), then renamed, the
parts of one output once all of them are written: a failure (a full disk is
one line with the bytes to write and the bytes free) leaves no output and no
temporary file.

How each tensor is split is read from the parameters of the model the
checkpoint's config describes, built on the ``meta`` device
(:func:`fairseq_megatron.checkpoint.layout.partition_dims`).
"""

import copy
import hashlib
import os
import re
from collections import OrderedDict
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from fairseq_megatron.checkpoint.layout import (
    BUFFER_NAMES,
    CheckpointError,
    is_per_element,
    key_partition_dim,
    optimizer_state_per_parameter,
    parameter_keys,
    partition_dims,
    slice_for_part,
    tied_keys,
)
from fairseq_megatron.checkpoint import safe_loading
from fairseq_megatron.checkpoint.commit import saved_token
from fairseq_megatron.checkpoint.integrity import check_integrity
from fairseq_megatron.checkpoint.optimizer_shards import joined_optimizer_state
from fairseq_megatron.checkpoint.part_files import (
    can_be_memory_mapped,
    check_one_save,
    check_output_name,
    is_write_failure,
    output_paths,
    part_path,
    stage_path,
    write_error,
)
from fairseq_megatron.checkpoint.reading import OpenedSave, name_of, open_save, source_of
from fairseq_megatron.files import new_temporary

EMBED_KEYS = ("decoder.embed_tokens.weight", "decoder.output_projection.weight")
# The entries of ``extra_state`` that fairseq-train ``--store-ema`` writes
# (``fairseq/trainer.py``): the EMA model's state dict and, with
# ``--ema-fp32``, fp32 copies of it; both keyed like the model's state dict,
# so they are split and joined by the same rules.
EMA_STATE_DICTS = ("ema", "ema_fp32_params")


# ------------------------------------------------------------------ configs


def model_config(state: dict):
    """The model's config in a checkpoint: newer ``cfg.model`` or old ``args`` (Namespace or dict)."""
    if state.get("cfg") is not None and state["cfg"].get("model") is not None:
        return state["cfg"]["model"]
    return state.get("args")


def config_value(config, name: str, default=None):
    """``config[name]`` or ``config.name`` (a checkpoint holds dicts, DictConfigs or Namespaces);
    ``default`` where the config or the name is missing."""
    if config is None:
        return default
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


def _set(config, name, value):
    if isinstance(config, dict):
        config[name] = value
    else:
        setattr(config, name, value)


def set_model_parallel_size(state: dict, size: int, padded_vocab_size: int, stages: int = 1) -> None:
    """Record a new model-parallel size (and number of pipeline stages), and
    the vocabulary size the model must keep, everywhere fairseq reads them:
    ``args``, ``cfg.common``, ``cfg.model``."""
    cfg = state.get("cfg")
    if cfg is not None and cfg.get("common") is not None:
        cfg["common"]["model_parallel_size"] = size
    for config in (state.get("args"), cfg.get("model") if cfg is not None else None):
        if config is not None:
            _set(config, "model_parallel_size", size)
            _set(config, "padded_vocab_size", padded_vocab_size)
            if stages > 1 or config_value(config, "pipeline_model_parallel_size") is not None:
                _set_stages(config, stages, 1)


def stage_layouts(config, stages: int, virtual: int = 1) -> list:
    """The :class:`~fairseq_megatron.models.pipeline_stage.PipelineStageLayout`
    of each of ``stages`` stages (of ``virtual`` model chunks each) of the
    model ``config`` describes.

    Raises:
        UsageError: ``stages x virtual`` does not divide the decoder layers.
    """
    from fairseq_megatron.models.pipeline_stage import LOOP, PipelineStageLayout

    layers = int(config_value(config, "decoder_layers"))
    tied = bool(config_value(config, "share_decoder_input_output_embed", False))
    counted = [stages > 1 and bool(config_value(config, f"account_for_{what}_in_pipeline_split", False))
               for what in ("embedding", "loss")]
    return [PipelineStageLayout(stage, stages, layers, tied, virtual, LOOP, *counted) for stage in range(stages)]


def _set_stages(config, stages: int, virtual: int) -> None:
    _set(config, "pipeline_model_parallel_size", stages)
    if virtual > 1 or config_value(config, "virtual_pipeline_model_parallel_size") is not None:
        _set(config, "virtual_pipeline_model_parallel_size", virtual)


def split_stages(state: dict, stages: int, virtual: int = 1) -> List[dict]:
    """One tensor part's checkpoint ``state`` (all layers) as the
    checkpoints of its ``stages`` pipeline stages (of ``virtual`` model chunks,
    in the loop placement: :func:`stage_part`), each recording ``stages`` in
    its config. ``[state]`` for one stage.

    Raises:
        UsageError: ``stages`` does not divide the decoder layers.
    """
    if stages == 1:
        return [state]
    return [stage_part(state, layout) for layout in stage_layouts(model_config(state), stages, virtual)]


def stage_part(state: dict, layout) -> dict:
    """One tensor part's checkpoint ``state`` (all layers) cut to what the
    pipeline stage ``layout`` (a :class:`~fairseq_megatron.models.pipeline_stage.PipelineStageLayout`,
    any placement of its chunks) holds
    (:meth:`~fairseq_megatron.models.pipeline_stage.PipelineStageLayout.holds`),
    its config recording the stages and chunks; the EMA weights are cut the
    same way."""
    part = {k: v for k, v in state.items() if k not in ("model", "args", "cfg")}
    part.update({k: copy.deepcopy(state[k]) for k in ("args", "cfg") if k in state})
    part["extra_state"] = dict(state.get("extra_state") or {})
    part["model"] = OrderedDict((k, v) for k, v in state["model"].items() if layout.holds(k))
    for entry in EMA_STATE_DICTS:
        weights = (part.get("extra_state") or {}).get(entry)
        if weights is not None:
            part["extra_state"][entry] = OrderedDict((k, v) for k, v in weights.items() if layout.holds(k))
    for c in (part.get("args"), (part.get("cfg") or {}).get("model")):
        if c is not None:
            _set_stages(c, layout.stages, layout.virtual)
    return part


def _joined_shards(state: dict, part: str) -> dict:
    """The whole optimizer state of ``state``, part file ``part`` saved under
    ``--ddp-backend fully_sharded``, joined from its optimizer shards
    (:func:`~fairseq_megatron.checkpoint.optimizer_shards.joined_optimizer_state`).

    Raises:
        CheckpointError: the shards' (missing, cut short, of another save),
            or shards of other parameters than the part's model.
    """
    joined, order = joined_optimizer_state(state, part, saved_token(state))
    if order != parameter_keys(list(state["model"]), aliases_of(state)):
        raise CheckpointError(f"the optimizer shards of {part} are of other parameters than its model's")
    return joined


def restaged_optimizer_state(opened: OpenedSave, part: str, keys: List[str]) -> dict:
    """The optimizer state (fairseq's ``last_optimizer_state``) of tensor part
    ``part`` of the checkpoint ``opened`` (in pipeline stages of any
    placement, or in one) for a pipeline stage of another layout whose
    optimizer holds the parameters ``keys`` (state-dict keys, in its order):
    each saved stage's state by parameter
    (:func:`~fairseq_megatron.checkpoint.layout.optimizer_state_per_parameter`),
    the stages' joined (the tied embedding's two copies, whose updates are
    the same, taken from the first stage), then numbered in the order of
    ``keys``; the optimizer's options (``param_groups``) and fairseq's loss
    scale are stage 0's. A flat state (fairseq's ``FP16Optimizer``) is
    rebuilt flat over ``keys``. A stage saved under ``--ddp-backend
    fully_sharded`` has its optimizer shards joined first
    (:func:`~fairseq_megatron.checkpoint.optimizer_shards.joined_optimizer_state`).
    Memory: the stages' files memory-mapped, one stage's joined shards and
    this stage's state.

    Raises:
        CheckpointError: a stage without optimizer state; a stage's
            optimizer shards missing, cut short or of other parameters;
            optimizer state of other parameters than the stage's model,
            more than one parameter group, a key of ``keys`` that no stage
            holds.
    """
    per_key, rest, flat = {}, None, False
    for f in opened.stage_files(part):
        state = _load(opened.source(f), name=f)
        saved = state.get("last_optimizer_state")
        if not saved and state.get("optimizer_shards"):  # saved under --ddp-backend fully_sharded
            saved = _joined_shards(state, f)
        if not saved or "param_groups" not in saved:
            raise CheckpointError(f"{f} holds no optimizer state: resume at the layout it was saved at, or with "
                                  f"--reset-optimizer")
        if len(saved["param_groups"]) != 1:
            raise CheckpointError(f"{f}: optimizer state of {len(saved['param_groups'])} parameter groups, which "
                                  f"are not split over other pipeline stages: resume with --reset-optimizer")
        found, flat = optimizer_state_per_parameter(
            saved, state["model"], parameter_keys(list(state["model"]), aliases_of(state)), f)
        for key, values in found.items():
            per_key.setdefault(key, values)
        rest = rest if rest is not None else {k: copy.deepcopy(v) for k, v in saved.items() if k != "state"}
    missing = [k for k in keys if k not in per_key]
    if missing:
        raise CheckpointError(f"{opened.path}: no pipeline stage holds the optimizer state of {missing[0]}")
    group = rest["param_groups"][0]
    if flat:
        entry = {name: (torch.cat([per_key[k][name].reshape(-1) for k in keys]) if is_per_element(value) else value)
                 for name, value in per_key[keys[0]].items()}
        rest["param_groups"] = [dict(group, params=[0])]
        return {"state": {0: entry} if entry else {}, **rest}
    rest["param_groups"] = [dict(group, params=list(range(len(keys))))]
    return {"state": {i: per_key[k] for i, k in enumerate(keys) if per_key[k]}, **rest}


def check_divisible(config, padded_vocab_size: int, size: int) -> None:
    """Raise CheckpointError unless ``size`` divides heads, FFN size and the
    padded vocabulary (:func:`fairseq_megatron.models.options.split_dimensions`)."""
    from fairseq_megatron.models.options import undivided_dimension

    undivided = undivided_dimension(size, config_value(config, "decoder_attention_heads"),
                                    config_value(config, "decoder_ffn_embed_dim"), padded_vocab_size)
    if undivided is not None:
        what, _, n = undivided
        raise CheckpointError(f"model-parallel size {size} does not divide the {what} ({n})")


# ------------------------------------------------------------------ reading


def _load(path: str, mmap: bool = True, name: Optional[str] = None) -> dict:
    """Checkpoint file ``path`` (named ``name`` in messages), read without
    running code (:func:`~fairseq_megatron.checkpoint.safe_loading.load`).

    Raises:
        CheckpointError: unreadable (truncated, not a torch file), an
            object the loader refuses, or not a fairseq checkpoint.
    """
    name = name or path
    try:
        state = safe_loading.load(path, name, mmap=mmap)
    except CheckpointError:
        raise
    except Exception as e:  # truncated zip, not a torch file, ...
        raise CheckpointError(f"cannot read {name}: {type(e).__name__}: {e}") from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise CheckpointError(f"{name} is not a fairseq checkpoint (no 'model' entry)")
    return state


_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.")


def _in_layer_order(state: dict) -> dict:
    """``state`` with its decoder layers' keys in layer order (each layer's
    own keys in their order), where the stages listed them chunk by chunk
    (layers 0 and 2, then 1 and 3, at two stages of two chunks); the other
    keys before the first layer's stay before the layers, the rest after:
    the order of a one-stage model's ``state_dict``, which is the order
    fairseq's optimizer numbers its parameters in, and so the order the
    optimizer state written beside it must follow."""
    keys = list(state)
    first = next((i for i, k in enumerate(keys) if _LAYER_KEY.match(k)), len(keys))
    layers = sorted((k for k in keys if _LAYER_KEY.match(k)), key=lambda k: int(_LAYER_KEY.match(k).group(1)))
    head = [k for k in keys[:first] if not _LAYER_KEY.match(k)]
    tail = [k for k in keys[first:] if not _LAYER_KEY.match(k)]
    return {k: state[k] for k in head + layers + tail}


def merge_stages(states: List[dict], files: List[str]) -> dict:
    """One tensor part's checkpoint from its pipeline stages' (``states``,
    read from ``files``, stage order): the model's state dict and the EMA
    weights (where every stage holds them) are the union of the stages',
    their layers in layer order (:func:`_in_layer_order`); everything else
    is stage 0's, its config recording one stage. Keys held by two stages (the tied embedding's copy on the last,
    ``decoder.version``) are checked to be equal, and a key that is the
    same tensor as another on its stage (the last stage's output projection
    tied to its copy of the embedding) is the same tensor in the merged
    dict: the checkpoint of one stage it makes is tied as a one-stage
    training saves it. A single state is returned as it is.

    Raises:
        CheckpointError: the stages disagree on a key both hold.
    """
    if len(states) == 1:
        return states[0]
    merged = dict(states[0])

    def union(dicts):
        out = {}
        for f, d in zip(files, dicts):
            for k, v in d.items():
                if k in out and not _is_buffer(k) and not _same_values(out[k], v):
                    raise CheckpointError(f"{f} holds {k} with other values than {files[0]}'s stage")
                out.setdefault(k, v)
        for d in dicts:
            for key, target in tied_keys(d).items():
                out[key] = out[target]
        return out

    merged["model"] = _in_layer_order(union([s["model"] for s in states]))
    extras = [s.get("extra_state") or {} for s in states]
    if all(e.get("ema") is not None for e in extras):
        merged["extra_state"] = dict(extras[0], ema=_in_layer_order(union([e["ema"] for e in extras])))
    merged.pop("last_optimizer_state", None)
    _set_stages(model_config(merged), 1, 1)
    return merged


def saved_vocabulary(path) -> Tuple[Optional[int], Optional[int], Optional[str]]:
    """``(rows, dictionary_size, dictionary_checksum)`` of checkpoint file
    ``path`` (a name, or a
    :class:`~fairseq_megatron.checkpoint.reading.FileAsOpened`): the rows of
    its token embedding (one model part: the padded vocabulary divided by
    the size it was saved at), and the dictionary's size and checksum its
    config records, read through a memory map without loading the tensors.
    Each is None when unknown: a file in the legacy format, without that
    tensor, or saved before the record."""
    if not can_be_memory_mapped(source_of(path)):
        return None, None, None
    state = _load(source_of(path), name=name_of(path))
    embedding = state["model"].get(EMBED_KEYS[0])
    config = model_config(state)
    return (None if embedding is None else embedding.size(0), config_value(config, "dictionary_size"),
            config_value(config, "dictionary_checksum"))


def read_checkpoint(path) -> dict:
    """``torch.load`` of one checkpoint file to CPU (a name, or a
    :class:`~fairseq_megatron.checkpoint.reading.FileAsOpened`),
    memory-mapped unless it is in the legacy format.

    Raises:
        CheckpointError: unreadable (truncated, not a torch file) or not a
            fairseq checkpoint.
    """
    return _load(source_of(path), mmap=can_be_memory_mapped(source_of(path)), name=name_of(path))


def check_part_count(path: str, files: List[str], first: Optional[dict] = None, stages: int = 1) -> None:
    """Raise CheckpointError where ``files`` (from :func:`find_part_files`)
    are not as many as the model-parallel size checkpoint ``path`` records
    (read from ``files[0]``, or ``first``, its loaded state, its stages not
    merged), or their ``stages`` (the pipeline stages found) not as many as
    it records: its last parts, or the last stage of every part, were lost,
    which the file numbers alone cannot show."""
    if first is None:
        first = read_checkpoint(files[0])
    recorded_stages = int(config_value(model_config(first), "pipeline_model_parallel_size", 1) or 1)
    if recorded_stages > stages:
        raise CheckpointError(f"pipeline stage file {stage_path(path, 0, stages)} is missing: {path} was saved in "
                              f"{recorded_stages} pipeline stages")
    recorded = int(config_value(model_config(first), "model_parallel_size", 1) or 1)
    if files[0] != path and recorded > len(files):
        raise CheckpointError(
            f"model part file {part_path(path, len(files))} is missing: {path} was saved at "
            f"model-parallel size {recorded}"
        )
    if recorded != len(files):
        raise CheckpointError(
            f"{path}: the checkpoint was saved at model-parallel size {recorded} but "
            f"{len(files)} part file(s) exist"
        )


class PartFiles:
    """The part files of one checkpoint, memory-mapped on demand.

    :meth:`models` maps every part and returns their model state dicts; the
    caller drops them when done, which unmaps the files, so pages read for
    one layer do not stay resident.

    Files in torch's legacy format (saved before PyTorch 1.6, as checkpoints
    of 2019-2020 may be) cannot be mapped: they are read once, whole, and
    kept (their model state dicts, and with ``with_optimizer`` their whole
    checkpoints), so memory then holds the input.

    The files are opened once (:func:`~fairseq_megatron.checkpoint.reading.open_save`,
    or ``opened``, already opened) and every read goes through those
    descriptors: a training that saves the checkpoint again meanwhile
    changes nothing that is read.

    Raises (on construction):
        FileNotFoundError / CheckpointError: missing, truncated, corrupted
            (:func:`check_integrity`) or foreign files; parts of different
            saves or with different tensors; a part or stage count that
            differs from the one the checkpoint records.
    """

    def __init__(self, path: str, with_optimizer: bool = False, opened: Optional[OpenedSave] = None):
        self.path = path
        self.opened = opened or open_save(path)
        self.files, self.stages = self.opened.files, self.opened.stages
        every_file = self.opened.every_file
        for f in every_file:
            check_integrity(self.opened.source(f), f)
        self.mmap = all(can_be_memory_mapped(self.opened.source(f)) for f in every_file)
        loaded_files = [_load(self.opened.source(f), self.mmap, f) for f in every_file]
        check_one_save(every_file, loaded_files, self.opened.manifest)
        check_part_count(path, self.files, loaded_files[0], self.stages)  # before merging: the stages recorded
        loaded = [merge_stages(loaded_files[i: i + self.stages], every_file[i: i + self.stages])
                  for i in range(0, len(every_file), self.stages)]
        first = loaded[0]
        self.keys = list(first["model"].keys())
        for f, state in zip(self.files[1:], loaded[1:]):
            if list(state["model"].keys()) != self.keys:
                raise CheckpointError(f"{f} holds different tensors than {self.files[0]}")
        joined = False
        if with_optimizer:
            for f, state in zip(self.files, loaded):
                if self.stages > 1:  # the stages' optimizer states, joined as one stage's optimizer holds them
                    state["last_optimizer_state"] = restaged_optimizer_state(
                        self.opened, f, parameter_keys(list(state["model"]), aliases_of(state)))
                    joined = True  # kept in memory
                if state.get("optimizer_shards") and not state.get("last_optimizer_state"):
                    joined = True  # saved under --ddp-backend fully_sharded: the shards joined, kept in memory
                    state["last_optimizer_state"] = _joined_shards(state, f)
                if not state.get("last_optimizer_state"):
                    raise CheckpointError(f"{f} holds no optimizer state")
        if self.mmap and not joined:
            self._kept = None
        else:
            self._kept = loaded if with_optimizer else [
                {"model": state["model"], "extra_state": state.get("extra_state")} for state in loaded]
        del loaded, loaded_files
        self.metadata = {k: v for k, v in first.items() if k != "model"}
        self.aliases = aliases_of(first)
        self.padded_vocab_size = first["model"]["decoder.embed_tokens.weight"].size(0) * len(self.files)
        # how each tensor is split: what the parameters of the model the config describes say
        self.dims = partition_dims(model_config(first), self.padded_vocab_size)

    def __len__(self):
        return len(self.files)

    @property
    def ema_entries(self) -> List[str]:
        """The :data:`EMA_STATE_DICTS` that part 0 holds (fairseq-train ``--store-ema``)."""
        extra_state = self.metadata.get("extra_state") or {}
        return [entry for entry in EMA_STATE_DICTS if extra_state.get(entry) is not None]

    def checkpoints(self) -> List[dict]:
        """Every part's checkpoint dict (its stages merged), tensors memory-mapped."""
        if self._kept is not None:
            return list(self._kept)
        return [merge_stages([_load(self.opened.source(f), name=f) for f in files], files)
                for files in map(self.opened.stage_files, self.files)]

    def models(self) -> List[Dict[str, torch.Tensor]]:
        return [state["model"] for state in self.checkpoints()]

    def state_dicts(self, entry: Optional[str] = None) -> List[Dict[str, torch.Tensor]]:
        """Every part's model state dict, or with ``entry`` (one of
        :data:`EMA_STATE_DICTS`) that state dict of its ``extra_state``.

        Raises:
            CheckpointError: a part lacks ``entry``.
        """
        if entry is None:
            return self.models()
        found = []
        for f, state in zip(self.files, self.checkpoints()):
            value = (state.get("extra_state") or {}).get(entry)
            if value is None:
                raise CheckpointError(f"{f} holds no {entry!r} state dict, but {self.files[0]} does")
            found.append(value)
        return found


def aliases_of(state: dict) -> Dict[str, str]:
    """``{key: the key it is tied to}`` of checkpoint ``state``'s model: the
    tensors saved once for two keys (:func:`~.layout.tied_keys`), and the
    output projection of a model trained tied whose save holds it apart, a
    copy of the embedding (a ``fully_sharded`` save gathers each tensor on
    its own)."""
    aliases = tied_keys(state["model"])
    projection, embedding = EMBED_KEYS[1], EMBED_KEYS[0]
    if projection in state["model"] and projection not in aliases and config_value(
            model_config(state), "share_decoder_input_output_embed", False):
        aliases[projection] = embedding
    return aliases


def layer_groups(keys: Iterable[str]) -> List[List[str]]:
    """Keys grouped by transformer layer (``decoder.layers.N.``), other keys in one group, order kept."""
    groups: "OrderedDict[str, List[str]]" = OrderedDict()
    for key in keys:
        m = re.match(r"(.*\.layers\.\d+)\.", key)
        groups.setdefault(m.group(1) if m else "", []).append(key)
    return list(groups.values())


# ------------------------------------------------------------------ writing


def tensor_checksum(t: torch.Tensor) -> str:
    """blake2b of the tensor's bytes, with its dtype and shape."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(memoryview(data))
    return h.hexdigest()


VERIFY_CHUNK_BYTES = 64 * 2**20


def _checked_tensors(state: dict) -> Dict[str, torch.Tensor]:
    """The tensors of a checkpoint that verification compares: the model's,
    and the optimizer state's (named ``optimizer.<index>.<name>``)."""
    tensors = {f"model.{k}": v for k, v in state["model"].items()}
    for index, entries in (state.get("last_optimizer_state") or {}).get("state", {}).items():
        for name, value in entries.items():
            if torch.is_tensor(value):
                tensors[f"optimizer.{index}.{name}"] = value
    return tensors


def _verify(path: str, expected: Dict[str, str]) -> None:
    """Re-read ``path`` and compare per-tensor checksums, mapping at most
    about VERIFY_CHUNK_BYTES of it at a time."""
    keys, i = list(expected), 0
    while i < len(keys):
        tensors, budget = _checked_tensors(_load(path)), 0
        while i < len(keys) and budget < VERIFY_CHUNK_BYTES:
            key = keys[i]
            if key not in tensors or tensor_checksum(tensors[key]) != expected[key]:
                raise CheckpointError(f"verification of {path} failed at tensor {key}")
            budget += tensors[key].nbytes
            i += 1
        del tensors  # unmaps this chunk


def save_verified(state: dict, path: str, verify: bool, rename: bool = True) -> str:
    """Write ``state`` to a temporary file of its own beside ``path``
    (:func:`~fairseq_megatron.files.new_temporary`), optionally verify it,
    rename it to ``path`` (with ``rename``; else the caller renames it).
    Returns the path written. Nothing is left under either name when it
    fails, and no other file is touched.

    Consumes ``state``: it is emptied after writing, so the tensors are freed
    before the file is re-read.

    Raises:
        CheckpointError: the write failed (a full disk: see
            :func:`~fairseq_megatron.checkpoint.part_files.write_error`), or
            the verification did.
    """
    tensors = _checked_tensors(state)
    expected = {k: tensor_checksum(v) for k, v in tensors.items()} if verify else None
    needed = sum(t.nbytes for t in tensors.values())
    del tensors
    try:
        tmp = new_temporary(path)
    except OSError as e:
        raise write_error(path, e, needed) from None
    try:
        try:
            torch.save(state, tmp)
        except (OSError, RuntimeError) as e:
            if not is_write_failure(e):
                raise
            if os.path.exists(tmp):
                os.remove(tmp)  # first: the space it took is free again
            raise write_error(path, e, needed) from None
        state.clear()
        if verify:
            _verify(tmp, expected)
        if rename:
            os.replace(tmp, path)
            return path
        return tmp
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and elements, NaN equal to NaN (a replicated weight
    that went NaN in training is NaN in every part)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
    return torch.equal(a, b)


def _check_replicas(what: str, tensors: List[torch.Tensor]) -> None:
    for i, t in enumerate(tensors[1:], start=1):
        if not _same_values(t, tensors[0]):
            raise CheckpointError(
                f"{what} differs between model part 0 and part {i}: the parts come from different checkpoints"
            )


def _is_buffer(key: str) -> bool:
    """A state-dict entry that is not a weight (:data:`BUFFER_NAMES`), whose
    value fairseq's loader does not use: it drops the sinusoidal positions'
    ``_float_tensor`` (``fairseq/modules/sinusoidal_positional_embedding.py``),
    a 1-element tensor created uninitialised, so each part of a checkpoint
    saved by several processes holds its own value (the published
    Megatron-11b's parts do), and it resets the decoder's ``version``
    (``TransformerDecoderBase.upgrade_state_dict_named``). Taken from part 0,
    not compared."""
    return key.rsplit(".", 1)[-1] in BUFFER_NAMES


def model_part_groups(parts: PartFiles, rank: int, num_parts: int, check_replicas: bool,
                      entry: Optional[str] = None) -> Iterator[Dict[str, torch.Tensor]]:
    """The model state dict of part ``rank`` of ``num_parts``, one layer group
    (:func:`layer_groups`) at a time, in the checkpoint's key order; tied
    keys (``aliases``) are left out. Each group's input mappings are closed
    before it is yielded, so a consumer that writes and drops each group
    holds about one layer. With ``entry``, that state dict of ``extra_state``
    instead (see :meth:`PartFiles.state_dicts`).

    Raises:
        CheckpointError: a replicated weight differs between parts (checked
            with ``check_replicas``; buffers are not, see :func:`_is_buffer`);
            parts hold different ``entry`` keys.
    """
    keys, aliases = _keys_and_aliases(parts, entry)
    what = "replicated tensor" if entry is None else f"replicated {entry!r} tensor"
    for group in layer_groups(keys):
        state_dicts, tensors, out = parts.state_dicts(entry), [], OrderedDict()
        for key in group:
            if key in aliases:
                continue
            tensors = [m[key] for m in state_dicts]
            dim = key_partition_dim(parts.dims, key)
            if dim is None:
                if check_replicas and not _is_buffer(key):
                    _check_replicas(f"{what} {key}", tensors)
                out[key] = tensors[0].clone()
            else:
                out[key] = slice_for_part(tensors, dim, rank, num_parts)
        del state_dicts, tensors  # the layer's mappings close here
        yield out


def _keys_and_aliases(parts: PartFiles, entry: Optional[str]) -> Tuple[List[str], Dict[str, str]]:
    if entry is None:
        return parts.keys, parts.aliases
    first = parts.state_dicts(entry)
    keys = list(first[0].keys())
    for f, state_dict in zip(parts.files, first):
        if list(state_dict.keys()) != keys:
            raise CheckpointError(f"{f} holds different {entry!r} tensors than {parts.files[0]}")
    return keys, tied_keys(first[0])


def model_part(parts: PartFiles, rank: int, num_parts: int, check_replicas: bool,
               progress: Optional[Callable[[str], None]], entry: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """The whole model state dict of part ``rank`` of ``num_parts``, tied
    keys included (:func:`model_part_groups`, gathered); ``progress`` is
    called with each group's first key.

    Raises:
        CheckpointError: as :func:`model_part_groups`.
    """
    keys, aliases = _keys_and_aliases(parts, entry)
    out: Dict[str, torch.Tensor] = {}
    for group in model_part_groups(parts, rank, num_parts, check_replicas, entry):
        out.update(group)
        if progress:
            progress(next(iter(group), None))
    for key, target in aliases.items():
        out[key] = out[target]
    return OrderedDict((k, out[k]) for k in keys)


def _optimizer_part(parts: PartFiles, rank: int, num_parts: int, check_replicas: bool,
                    progress: Optional[Callable[[str], None]]) -> dict:
    """The ``last_optimizer_state`` of model part ``rank`` of ``num_parts``,
    built layer by layer like the weights: each state tensor shaped like its
    parameter is split or joined as the parameter is; numbers and 0-dim
    tensors (``step``), ``param_groups`` and the loss scale come from part 0.
    A flat state (fairseq's ``FP16Optimizer``) stays flat, filled in place.

    Raises:
        CheckpointError: see :func:`optimizer_state_per_parameter`; a
            replicated parameter's state differs between parts.
    """
    keys = parameter_keys(parts.keys, parts.aliases)
    first = parts.checkpoints()[0]
    _, flat = optimizer_state_per_parameter(first["last_optimizer_state"], first["model"], keys, parts.files[0])
    offsets, total = {}, 0  # flat layout: where each parameter starts in the output part
    for key in keys:
        offsets[key] = total
        total += _part_numel(first["model"][key], key_partition_dim(parts.dims, key), len(parts), num_parts)
    del first
    per_key: Dict[str, dict] = {}  # per parameter: its state (flat layout: the numbers only)
    flat_out: Dict[str, torch.Tensor] = {}  # flat layout: one tensor per name, allocated at first use
    for group in layer_groups(keys):  # the keys after the last layer join the group before it
        checkpoints = parts.checkpoints()
        views = [optimizer_state_per_parameter(state["last_optimizer_state"], state["model"], keys, f)[0]
                 for f, state in zip(parts.files, checkpoints)]
        for key in group:
            dim = key_partition_dim(parts.dims, key)
            entries = {}
            for name, value in views[0][key].items():
                if not is_per_element(value):
                    entries[name] = value.clone() if torch.is_tensor(value) else value
                    continue
                tensors = [view[key][name] for view in views]
                if dim is None:
                    if check_replicas:
                        _check_replicas(f"optimizer state {name!r} of {key}", tensors)
                    t = tensors[0].clone()
                else:
                    t = slice_for_part(tensors, dim, rank, num_parts)
                if flat:
                    if name not in flat_out:
                        flat_out[name] = torch.empty(total, dtype=t.dtype)
                    flat_out[name].narrow(0, offsets[key], t.numel()).copy_(t.reshape(-1))
                else:
                    entries[name] = t
            per_key[key] = entries
        del checkpoints, views
        if progress:
            progress(group[0])
    source = parts.metadata["last_optimizer_state"]
    out = {k: copy.deepcopy(v) for k, v in source.items() if k != "state"}
    indices = [i for group in source["param_groups"] for i in group["params"]]
    if flat:
        entry = {**per_key[keys[0]], **flat_out}
        out["state"] = {indices[0]: entry} if entry else {}
    else:
        out["state"] = {i: per_key[k] for i, k in zip(indices, keys) if per_key[k]}
    return out


def _part_numel(tensor: torch.Tensor, dim: Optional[int], num_inputs: int, num_outputs: int) -> int:
    """Elements in one of ``num_outputs`` parts of a tensor split along
    ``dim`` (None: replicated), given its ``tensor`` in one of ``num_inputs``."""
    return tensor.numel() if dim is None else tensor.numel() * num_inputs // num_outputs


def _metadata_for_size(metadata: dict) -> dict:
    """Part 0's entries besides the model, for a checkpoint of another size:
    without the optimizer state (:func:`_optimizer_part` builds each part's,
    whole: the count of optimizer shards a ``fully_sharded`` save recorded
    is dropped too), without the EMA state dicts (:func:`_model_part`
    builds each part's) and without the per-rank RNG tracker states (a rank
    of the new size has no counterpart; it is seeded afresh)."""
    state = {k: v for k, v in metadata.items() if k not in ("last_optimizer_state", "optimizer_shards")}
    state["extra_state"] = without_part_specific_state(state.get("extra_state"))
    return state


def without_part_specific_state(extra_state: Optional[dict]) -> dict:
    """``extra_state`` of one part without what only that part's model can
    use: the EMA state dicts (:data:`EMA_STATE_DICTS`) and the per-rank RNG
    tracker states."""
    dropped = ("rng_tracker_states", *EMA_STATE_DICTS)
    return {k: v for k, v in (extra_state or {}).items() if k not in dropped}


def prepare_outputs(input_path: str, output_path: str, outputs: List[str], with_optimizer: bool = False,
             parts: Optional[PartFiles] = None) -> PartFiles:
    check_output_name(output_path, outputs)
    parts = parts or PartFiles(input_path, with_optimizer)
    inputs = {os.path.realpath(f) for f in parts.opened.every_file}
    for o in outputs:
        if os.path.realpath(o) in inputs:
            raise CheckpointError(f"refusing to overwrite the input {o}")
    return parts


def _part_state(parts: PartFiles, rank: int, size: int, check_replicas: bool, with_optimizer: bool = False,
                progress: Optional[Callable[[str], None]] = None) -> dict:
    """Checkpoint dict of model part ``rank`` of ``size``: weights (and the
    EMA weights of ``--store-ema``), config recording the new size and padded
    vocabulary, and the optimizer state if ``with_optimizer``."""
    state = _metadata_for_size(parts.metadata)
    state["model"] = model_part(parts, rank, size, check_replicas, progress)
    for entry in parts.ema_entries:
        state["extra_state"][entry] = model_part(parts, rank, size, check_replicas, progress, entry)
    if with_optimizer:
        state["last_optimizer_state"] = _optimizer_part(parts, rank, size, check_replicas, progress)
    set_model_parallel_size(state, size, parts.padded_vocab_size)
    return state


def resharded_model(input_path: str, rank: int, size: int, entry: Optional[str] = None,
                    opened: Optional[OpenedSave] = None) -> Tuple[Dict[str, torch.Tensor], int]:
    """The model state dict of part ``rank`` of ``size``, built in memory from
    checkpoint ``input_path`` saved at any model-parallel size, and the padded
    vocabulary size a model must be built with to take it (record it with
    :func:`set_model_parallel_size`). The same tensors :func:`reshard` would
    write; nothing is written to disk. Memory: this part's tensors plus one
    memory-mapped layer of the input. ``entry``: one of
    :data:`EMA_STATE_DICTS` instead of the model's state dict. ``opened``:
    the checkpoint's files, already opened.

    Raises:
        FileNotFoundError / CheckpointError: as :func:`reshard`, or a
            ``rank`` outside ``[0, size)``.
    """
    parts = PartFiles(input_path, opened=opened)
    check_divisible(model_config(parts.metadata), parts.padded_vocab_size, size)
    if not 0 <= rank < size:
        raise CheckpointError(f"model part {rank} does not exist at model-parallel size {size}")
    model = model_part(parts, rank, size, check_replicas=True, progress=None, entry=entry)
    return model, parts.padded_vocab_size


def reshard(input_path: str, output_path: str, new_size: int, verify: bool = True,
            progress: Optional[Callable[[str], None]] = None, with_optimizer: bool = False,
            parts: Optional[PartFiles] = None, new_stages: int = 1) -> List[str]:
    """Rewrite checkpoint ``input_path`` (any model-parallel size) for size ``new_size``.

    The model weights (and the EMA weights of fairseq-train ``--store-ema``,
    split the same way), and with ``with_optimizer`` the optimizer state
    (Adam's moments split like their parameters, see :func:`_optimizer_part`),
    so that ``fairseq-train --restore-file`` resumes from the output at the
    new size as if it had not stopped; without it, resume with
    ``--reset-optimizer``. The per-rank RNG tracker states are dropped. The
    padded vocabulary size is recorded in the config, so the model built at
    the new size has exactly the same vocabulary rows. Returns the paths
    written: ``output_path`` for size 1, else its ``-model_part-K`` names;
    with ``new_stages`` > 1 pipeline stages, ``-model_part-K-stage-S``
    (:func:`split_stages`; the input may have any number of stages, which
    are merged first: :func:`merge_stages`). Memory: one output part (with the optimizer: its weights and moments)
    plus one memory-mapped layer of the input. ``parts``: the input already
    opened, as ``PartFiles(input_path, with_optimizer)`` (not read again).

    Raises:
        FileNotFoundError / CheckpointError: bad input (see :class:`PartFiles`),
            a size that does not divide the model, outputs that would
            overwrite inputs or sit beside another size's files under the
            same name, a failed verification, or with
            ``with_optimizer`` a part without optimizer state or a state
            that cannot be split (see :func:`optimizer_state_per_parameter`).
    """
    outputs = output_paths(output_path, new_size, new_stages)
    if with_optimizer and new_stages > 1:
        raise CheckpointError(f"--keep-optimizer with {new_stages} pipeline stages: this tool writes the optimizer "
                              f"state of one stage; drop --pipeline-model-parallel-size, and fairseq-train "
                              f"--pipeline-model-parallel-size {new_stages} cuts it for its stages as it resumes")
    parts = prepare_outputs(input_path, output_path, outputs, with_optimizer, parts)
    check_divisible(model_config(parts.metadata), parts.padded_vocab_size, new_size)
    stage_layouts(model_config(parts.metadata), new_stages)  # refuses stages that do not divide the layers
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    written = []  # every part under its temporary name, renamed once all are written: all parts or none
    try:
        for rank in range(new_size):
            state = _part_state(parts, rank, new_size, check_replicas=(rank == 0), with_optimizer=with_optimizer,
                                progress=progress)
            for stage_state in split_stages(state, new_stages):
                written.append(save_verified(stage_state, outputs[len(written)], verify, rename=False))
            del state
    except BaseException:
        for tmp in written:
            os.remove(tmp)
        raise
    for tmp, out in zip(written, outputs):
        os.replace(tmp, out)
    return outputs
