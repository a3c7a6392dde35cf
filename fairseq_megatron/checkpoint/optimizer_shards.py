"""Optimizer state saved in shards, one file per data-parallel rank.

Under sharded data parallelism (``--ddp-backend fully_sharded``) each of the
``D`` data-parallel ranks of a model part holds ``1 / D`` of every
parameter's optimizer state (Adam's moments): the rows ``torch.chunk`` gives
it along dimension 0, as FSDP2 shards the parameter. Each rank saves its
share beside the part file, ``NAME-model_part-K[-stage-S]-optimizer-R.pt``
(:func:`shard_path`; ``NAME-optimizer-R.pt`` at one part), keyed by the
parameter's state-dict key; the part file holds the model, gathered, and the
number of shards (``optimizer_shards``) in place of ``last_optimizer_state``.
The save is one commit of the part files and the shards
(:mod:`fairseq_megatron.checkpoint.commit`: the manifest lists both, every
file carries the save's token). Nothing is ever gathered whole on one rank.

A run resumes from these files at any data-parallel size and under any
backend (:func:`optimizer_state_for`): each parameter's state is joined from
the shards (:func:`join_one`, one parameter at a time, the shards read as
memory maps) and cut the way the running rank holds the parameter
(:func:`place_one`: a ``DTensor`` shard, or all of it); :func:`by_key` and
:func:`as_optimizer_state` convert between torch's optimizer state (entries
numbered in the optimizer's parameter order) and entries keyed by parameter
name, so that a ``pytorch_ddp`` checkpoint's ``last_optimizer_state``
resumes sharded and back. Megatron-Core's distributed optimizer saves its
state by parameter the same way (``megatron/core/optimizer/distrib_optimizer.py``).
"""

import os
import re
import zipfile
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from fairseq_megatron.checkpoint import safe_loading
from fairseq_megatron.checkpoint.integrity import check_integrity
from fairseq_megatron.checkpoint.layout import CheckpointError
from fairseq_megatron.checkpoint.names import staged_name

SHARD_SUFFIX = "-optimizer-{}"
SHARD_FILE_NAME = re.compile(r"(.*)" + re.escape(SHARD_SUFFIX.format("")) + r"(\d+)\.pt")

PerKey = Dict[str, dict]
"""``{parameter key: {state name: value}}`` (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``)."""


def shard_path(part: str, rank: int) -> str:
    """Where data-parallel rank ``rank`` saves its optimizer shard of part file ``part``."""
    return part[: -len(".pt")] + SHARD_SUFFIX.format(rank) + ".pt"


def part_of_shard(path: str) -> Optional[str]:
    """The part file whose optimizer shard ``path`` is, or None for another name."""
    m = SHARD_FILE_NAME.fullmatch(path)
    return m.group(1) + ".pt" if m else None


def shard_paths(parts: Iterable[str], shards: int) -> List[str]:
    """The optimizer shards of ``parts``, ``shards`` each, part by part."""
    return [shard_path(part, rank) for part in parts for rank in range(shards)]


def by_key(optimizer_state: dict, keys: List[str]) -> Tuple[PerKey, dict]:
    """torch's optimizer ``state_dict()`` (one param group or several, entries
    numbered in parameter order) as ``(entries by parameter key, the rest)``:
    ``keys`` are the parameters' state-dict keys in the optimizer's order;
    the rest is everything but the entries (``param_groups``, fairseq's
    ``loss_scale``).

    Raises:
        ValueError: the state numbers other parameters than ``keys``.
    """
    indices = [i for group in optimizer_state.get("param_groups", []) for i in group["params"]]
    if len(indices) != len(keys):
        raise ValueError(f"the optimizer state is for {len(indices)} parameters, the model has {len(keys)}")
    state = optimizer_state.get("state", {})
    rest = {k: v for k, v in optimizer_state.items() if k != "state"}
    return {key: dict(state.get(index, {})) for key, index in zip(keys, indices)}, rest


def as_optimizer_state(entries: PerKey, keys: List[str], rest: dict) -> dict:
    """The inverse of :func:`by_key`: torch's optimizer state, entries
    numbered as ``rest["param_groups"]`` numbers the parameters ``keys``."""
    indices = [i for group in rest.get("param_groups", []) for i in group["params"]]
    state = {index: entries[key] for key, index in zip(keys, indices) if entries.get(key)}
    return {"state": state, **rest}


def local_share(entries: PerKey) -> Tuple[PerKey, Dict[str, tuple]]:
    """This rank's share of ``entries`` (a ``DTensor``'s local shard, any
    other value as it is), on the CPU, and the whole shape of each sharded
    value (``"key.name"``), for saving."""
    local, shapes = {}, {}
    for key, values in entries.items():
        local[key] = {}
        for name, value in values.items():
            if hasattr(value, "to_local"):
                shapes[f"{key}.{name}"] = tuple(value.shape)
                value = value.to_local()
            local[key][name] = value.detach().cpu() if torch.is_tensor(value) else value
    return local, shapes


def shard_state(optimizer_state: dict, keys: List[str], token: Optional[str], rank: int, shards: int) -> dict:
    """What data-parallel rank ``rank`` of ``shards`` saves in its shard file:
    its share of ``optimizer_state`` (torch's, of the parameters ``keys``)
    by key, the whole shapes, the rest of the state, and the save's
    ``token``."""
    entries, rest = by_key(optimizer_state, keys)
    local, shapes = local_share(entries)
    return {"entries": local, "shapes": shapes, "rest": rest, "keys": list(keys), "token": token, "rank": rank,
            "shards": shards}


def join_one(shards: List[dict], key: str) -> dict:
    """The whole state of parameter ``key`` from ``shards`` (the
    :func:`shard_state` of every rank, in rank order): each sharded value's
    pieces concatenated along dimension 0, the rest taken from rank 0.

    Raises:
        ValueError: a joined value does not have its recorded shape.
    """
    first, whole = shards[0], {}
    for name, value in first["entries"].get(key, {}).items():
        shape = first["shapes"].get(f"{key}.{name}")
        if shape is None:
            whole[name] = value
            continue
        joined = torch.cat([shard["entries"][key][name] for shard in shards], dim=0)
        if tuple(joined.shape) != tuple(shape):
            raise ValueError(f"the optimizer shards of {key} ({name}) join to {tuple(joined.shape)}, "
                             f"not its {tuple(shape)}")
        whole[name] = joined
    return whole


def place_one(values: dict, param: torch.Tensor) -> dict:
    """Whole ``values`` of one parameter's state placed as the running rank
    holds ``param``: a ``DTensor`` of this rank's piece for a sharded
    parameter (cut as the parameter is, without communication), the whole
    value otherwise. A piece is a copy: it holds its own rows only. Values
    not shaped like the parameter (``step``) stay as they are."""
    from fairseq_megatron.modules.sharding import local_piece

    placed = {}
    for name, value in values.items():
        if torch.is_tensor(value) and hasattr(param, "device_mesh") and tuple(value.shape) == tuple(param.shape):
            from torch.distributed.tensor import DTensor

            # a copy of the piece: a view would keep the whole value's storage on every rank
            piece = local_piece(param, value).to(param.device, copy=True)
            value = DTensor.from_local(piece, param.device_mesh,
                                       param.placements, shape=param.shape, stride=param.stride(), run_check=False)
        placed[name] = value
    return placed


def join(shards: List[dict]) -> PerKey:
    """Every parameter's whole state from ``shards`` (:func:`join_one` of each)."""
    return {key: join_one(shards, key) for key in shards[0]["entries"]}


def placed_like(entries: PerKey, parameters: Dict[str, torch.Tensor]) -> PerKey:
    """``entries`` (whole values) placed as the running rank holds each
    parameter of ``parameters`` (:func:`place_one` of each)."""
    return {key: place_one(values, parameters[key]) for key, values in entries.items()}


_ADVICE = "restore it, or resume with --reset-optimizer to start the optimizer afresh"


def read_shards(part: str, shards: int, token: Optional[str]) -> List[dict]:
    """The ``shards`` optimizer shard files of part file ``part`` (its final
    name) of the save ``token``, as memory maps: each under its staged name
    where a kill left it so (:mod:`fairseq_megatron.checkpoint.commit`),
    else under its final name; each file's CRC-32s checked first
    (:func:`~fairseq_megatron.checkpoint.integrity.check_integrity`).

    Raises:
        CheckpointError: a shard missing, cut short, corrupted, unreadable,
            or of another save.
    """
    found = []
    for rank in range(shards):
        path = shard_path(part, rank)
        names = ([staged_name(path, token)] if token else []) + [path]
        name = next((n for n in names if os.path.exists(n)), None)
        if name is None:
            raise CheckpointError(f"optimizer shard {path} of {part} is missing (the part was saved with {shards}): "
                                  f"{_ADVICE}")
        if not zipfile.is_zipfile(name):  # empty, cut short, or not a file torch saved
            raise CheckpointError(f"optimizer shard {name} is cut short or not a checkpoint "
                                  f"({os.path.getsize(name)} bytes): {_ADVICE}")
        try:
            check_integrity(name)
        except CheckpointError as e:
            raise CheckpointError(f"optimizer shard {e}: {_ADVICE}") from None
        try:
            state = safe_loading.load(name, name, mmap=True)  # as part files: a refused global named, never run
        except CheckpointError:
            raise
        except Exception as e:  # a zip archive that does not hold a torch save
            raise CheckpointError(f"cannot read optimizer shard {name}: {str(e).splitlines()[0]}") from None
        if not isinstance(state, dict) or state.get("token") != token or state.get("rank") != rank \
                or state.get("shards") != shards:
            raise CheckpointError(f"optimizer shard {name} is not rank {rank} of the {shards} shards of the save of "
                                  f"{part}: a file of another save; {_ADVICE}")
        found.append(state)
    return found


def optimizer_state_for(saved: dict, part: str, token: Optional[str], parameters: Dict[str, torch.Tensor]) -> \
        Optional[dict]:
    """torch's optimizer state for the running rank, whose trainable
    parameters are ``parameters`` (state-dict key -> parameter, in the
    optimizer's order), from checkpoint state ``saved`` of part file
    ``part`` (final name) of save ``token``: its optimizer shards
    (``saved["optimizer_shards"]``), or its whole ``last_optimizer_state``;
    each value placed as the rank holds its parameter. None where the
    checkpoint has no optimizer state.

    Raises:
        CheckpointError: a shard missing or of another save; optimizer
            state of other parameters than ``parameters`` (another model,
            or fairseq's ``--fp16`` optimizer, whose state is of one flat
            vector).
    """
    keys = list(parameters)
    try:
        if saved.get("optimizer_shards"):
            shards = read_shards(part, int(saved["optimizer_shards"]), token)
            if shards[0]["keys"] != keys:
                raise ValueError(f"the optimizer shards are of the parameters {_names(shards[0]['keys'])}, "
                                 f"this model has {_names(keys)}")
            entries = {key: place_one(join_one(shards, key), parameters[key]) for key in keys}
            return as_optimizer_state(entries, keys, shards[0]["rest"])
        whole = saved.get("last_optimizer_state")
        if not isinstance(whole, dict):
            return None
        entries, rest = by_key(whole, keys)
        return as_optimizer_state(placed_like(entries, parameters), keys, rest)
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"cannot resume the optimizer state of {part}: {e}; resume with --reset-optimizer "
                              f"to start it afresh") from None


def joined_optimizer_state(saved: dict, part: str, token: Optional[str]) -> Tuple[dict, List[str]]:
    """The whole optimizer state of part file ``part`` (final name) of save
    ``token``, joined from its ``saved["optimizer_shards"]`` shards, in
    torch's form (:func:`as_optimizer_state`), and the parameter keys it
    numbers, in order: what the resharding tool splits for another size
    (``--keep-optimizer``). Holds that part's whole state in memory.

    Raises:
        CheckpointError: a shard missing, cut short or of another save.
    """
    shards = read_shards(part, int(saved["optimizer_shards"]), token)
    try:
        entries = join(shards)
    except ValueError as e:
        raise CheckpointError(f"cannot join the optimizer shards of {part}: {e}") from None
    keys = list(shards[0]["keys"])
    return as_optimizer_state(entries, keys, shards[0]["rest"]), keys


def _names(keys: List[str]) -> str:
    return f"{keys[0]} ... ({len(keys)})" if keys else "(none)"
