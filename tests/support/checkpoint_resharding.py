"""What the tests of resharding and export share: a small model, and its
checkpoint written as fairseq-train writes it at any number of model parts."""

import copy
from argparse import Namespace

import torch

from fairseq_megatron.checkpoint.layout import split_model_state
from tests.support.partition import expected_partition_dims
from fairseq_megatron.checkpoint.part_files import output_paths
from fairseq_megatron.models.model_parallel_transformer_lm import ModelParallelTransformerLanguageModel
from tests.helpers import LMTask, make_dictionary, model_args

TOL = dict(rtol=1e-5, atol=1e-5)
# 4 specials + 50 words = 54 symbols: padded to 56 at size 1, to 64 at size 2.
WORDS = 50


def build_at_size(size, args=None, seed=0):
    torch.manual_seed(seed)
    args = args or model_args(size)
    model = ModelParallelTransformerLanguageModel.build_model(args, LMTask(make_dictionary(WORDS)))
    return model, args


def optimizer_states(names, moments, num_parts, layout):
    """``last_optimizer_state`` of each of ``num_parts`` model parts for Adam
    with the given full-size moments ``{parameter name: (exp_avg,
    exp_avg_sq)}``, as fairseq saves it: ``"per-parameter"`` (torch's
    optimizer state dict, one entry per parameter in ``model.parameters()``
    order) or ``"flat"`` (fairseq's FP16Optimizer: one fp32 tensor of all
    parameters, and the loss scale)."""
    dims = expected_partition_dims(names)
    split = [split_model_state({n: moments[n][which] for n in names}, num_parts, dims) for which in (0, 1)]
    states = []
    for rank in range(num_parts):
        avg, avg_sq = split[0][rank], split[1][rank]
        if layout == "per-parameter":
            state = {i: {"step": torch.tensor(5.0), "exp_avg": avg[n], "exp_avg_sq": avg_sq[n]}
                     for i, n in enumerate(names)}
            groups = [{"lr": 1e-3, "betas": (0.9, 0.98), "params": list(range(len(names)))}]
            states.append({"state": state, "param_groups": groups})
        else:
            flat = {"step": 5, "exp_avg": torch.cat([avg[n].reshape(-1) for n in names]),
                    "exp_avg_sq": torch.cat([avg_sq[n].reshape(-1) for n in names])}
            groups = [{"lr": 1e-3, "betas": (0.9, 0.98), "params": [0]}]
            states.append({"state": {0: flat}, "param_groups": groups, "loss_scale": 64.0})
    return states


def save_checkpoint(path, num_parts, style="cfg", seed=0, legacy_format=False, optimizer="placeholder", ema=False,
                    **overrides):
    """A checkpoint as fairseq-train writes it at ``num_parts`` model parts.

    The weights come from a model built at size 2 in this process (so the
    vocabulary is padded to 64 = a multiple of 16), split into parts.
    ``legacy_format``: saved as PyTorch < 1.6 did (not a zip archive).
    ``optimizer``: ``"per-parameter"`` or ``"flat"`` writes Adam moments
    (see :func:`optimizer_states`) and returns them with the weights,
    ``None`` no optimizer state; the default a placeholder. ``ema``: also
    the EMA state dicts of fairseq-train ``--store-ema --ema-fp32`` (an EMA
    model with other weights, tied like the model's), returned as
    ``(weights, EMA weights)``. ``overrides``: model options
    (``share_decoder_input_output_embed=False``).
    """
    import fairseq_megatron.parallel.parallel_state as ps

    assert ps.get_tensor_model_parallel_world_size() == 1
    # build "as if" at size 2: pad the vocabulary the way size 2 would
    args = model_args(1, padded_vocab_size=64, **overrides)
    model, args = build_at_size(1, args, seed)
    with torch.no_grad():  # move layer norms away from their init, as training would
        for n, p in model.named_parameters():
            if "layer_norm" in n or n.endswith("out_proj.bias") or n.endswith("fc2.bias"):
                p.add_(torch.randn_like(p) * 0.1)
    args.model_parallel_size = num_parts
    full = model.state_dict()
    if ema:
        ema_model = copy.deepcopy(model)
        with torch.no_grad():
            for p in ema_model.parameters():
                p.mul_(0.5).add_(0.25)
        ema_full = ema_model.state_dict()
        ema_parts = split_model_state(ema_full, num_parts, expected_partition_dims(ema_full))
    names = [n for n, _ in model.named_parameters()]  # the order fairseq's trainer gives the optimizer
    generator = torch.Generator().manual_seed(seed + 100)
    moments = {n: (torch.randn(p.shape, generator=generator), torch.rand(p.shape, generator=generator))
               for n, p in model.named_parameters()}
    if optimizer in ("per-parameter", "flat"):
        optimizer_state = optimizer_states(names, moments, num_parts, optimizer)
    else:
        optimizer_state = [{"state": {0: torch.zeros(3)}} if optimizer else None] * num_parts
    parts = split_model_state(full, num_parts, expected_partition_dims(full))
    for rank, (out, part) in enumerate(zip(output_paths(path, num_parts), parts)):
        state = {
            "model": part,
            "optimizer_history": [{"num_updates": 5}],
            "extra_state": {"rng_tracker_states": {"model-parallel-rng": {"seed": rank}}, "epoch": 1},
        }
        if optimizer_state[rank] is not None:
            state["last_optimizer_state"] = optimizer_state[rank]
        if ema:
            state["extra_state"]["ema"] = ema_parts[rank]
            state["extra_state"]["ema_fp32_params"] = {k: v.clone() for k, v in ema_parts[rank].items()}
        if style == "cfg":
            state["cfg"] = {"common": {"model_parallel_size": num_parts}, "model": Namespace(**vars(args))}
        else:
            state["args"] = Namespace(**vars(args))
        torch.save(state, out, _use_new_zipfile_serialization=not legacy_format)
    if optimizer in ("per-parameter", "flat"):
        return full, names, moments
    return (full, ema_full) if ema else full
