"""Optimizer state saved in shards, one file per data-parallel rank.

Under sharded data parallelism (``--ddp-backend fully_sharded``) each of the
``D`` data-parallel ranks of a model part holds ``1 / D`` of every
parameter's optimizer state (Adam's moments): the rows ``torch.chunk`` gives
it along dimension 0, as FSDP2 shards the parameter. Each rank saves its
share beside the part file, ``NAME-model_part-K[-stage-S]-optimizer-D.pt``
(:func:`shard_path`; ``NAME-optimizer-D.pt`` at one part), keyed by the
parameter's state-dict key; the part file itself holds the model, gathered.
Nothing is ever gathered whole on one rank.

A run resumes from these files at any data-parallel size and under any
backend: :func:`join` puts the shards of each parameter back together (one
parameter at a time), :func:`placed_like` cuts the whole state the way the
running rank holds its parameters (a ``DTensor`` shard, or all of it), and
:func:`by_key` / :func:`as_optimizer_state` convert between torch's
optimizer state (entries numbered in the optimizer's parameter order) and
entries keyed by parameter name, so that a ``pytorch_ddp`` checkpoint's
``last_optimizer_state`` resumes sharded and back.
"""

from typing import Dict, List, Tuple

import torch

SHARD_SUFFIX = "-optimizer-{}"

PerKey = Dict[str, dict]
"""``{parameter key: {state name: value}}`` (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``)."""


def shard_path(part: str, rank: int) -> str:
    """Where data-parallel rank ``rank`` saves its optimizer shard of part file ``part``."""
    return part[: -len(".pt")] + SHARD_SUFFIX.format(rank) + ".pt"


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
    other value as it is) and the whole shape of each sharded value, for
    saving."""
    local, shapes = {}, {}
    for key, values in entries.items():
        local[key] = {}
        for name, value in values.items():
            if hasattr(value, "to_local"):
                shapes[f"{key}.{name}"] = tuple(value.shape)
                value = value.to_local()
            local[key][name] = value.detach().cpu() if torch.is_tensor(value) else value
    return local, shapes


def join(shards: List[PerKey], shapes: Dict[str, tuple]) -> PerKey:
    """The whole state of every parameter from the ``shards`` of all
    data-parallel ranks, in rank order (:func:`local_share` of each), and
    ``shapes``, the whole shapes of the sharded values: each sharded value's
    pieces concatenated along dimension 0, the rest taken from rank 0.

    Raises:
        ValueError: a joined value does not have its recorded shape (shards
            of different saves, or missing).
    """
    whole = {}
    for key, values in shards[0].items():
        whole[key] = {}
        for name, value in values.items():
            shape = shapes.get(f"{key}.{name}")
            if shape is None:
                whole[key][name] = value
                continue
            joined = torch.cat([shard[key][name] for shard in shards], dim=0)
            if tuple(joined.shape) != tuple(shape):
                raise ValueError(f"the optimizer shards of {key} ({name}) join to {tuple(joined.shape)}, "
                                 f"not its {tuple(shape)}")
            whole[key][name] = joined
    return whole


def placed_like(entries: PerKey, parameters: Dict[str, torch.Tensor]) -> PerKey:
    """``entries`` (whole values) placed as the running rank holds each
    parameter of ``parameters`` (by key): a ``DTensor`` value of this
    rank's piece (cut as the parameter is, without communication: every
    rank holds the whole value) for a sharded parameter, the whole value
    otherwise. Values not shaped like their parameter (``step``) stay as
    they are."""
    from fairseq_megatron.modules.sharding import local_piece

    placed = {}
    for key, values in entries.items():
        param = parameters[key]
        placed[key] = {}
        for name, value in values.items():
            if torch.is_tensor(value) and hasattr(param, "device_mesh") and tuple(value.shape) == tuple(param.shape):
                from torch.distributed.tensor import DTensor

                value = DTensor.from_local(local_piece(param, value).to(param.device), param.device_mesh,
                                           param.placements, shape=param.shape, stride=param.stride(),
                                           run_check=False)
            placed[key][name] = value
    return placed
