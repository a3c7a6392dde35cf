"""Sharded data parallelism (``--ddp-backend fully_sharded``) on torch's FSDP2.

``fully_shard`` (``torch.distributed.fsdp``) over the data-parallel
dimension of the layout's ``DeviceMesh``: each decoder layer is one unit and
the rest of the model (embeddings, final layer norm, output projection) the
root unit, as torchtitan's ``apply_fsdp`` does. Each data-parallel rank then
holds ``1 / D`` of every parameter (dimension 0, padded), and of its
gradient and optimizer state; a unit's parameters are all-gathered before
its forward and backward, and its gradients reduce-scattered after its
backward (Rajbhandari et al. 2020, ZeRO stage 3). Tensor parallelism is
the layers' own: FSDP2 shards each rank's tensor-parallel part further, over
the ranks that hold the same part (the ``dp`` dimension), so it composes with
tensor parallelism and pipeline stages.

- ``reshard_after_forward`` (fairseq's default; ``--no-reshard-after-forward``
  turns it off): parameters are freed after each unit's forward and
  gathered again for its backward (ZeRO-3: two all-gathers of the model per
  micro-batch); off, they stay gathered between forward and backward
  (ZeRO-2: one all-gather, the memory of the whole gathered model meanwhile).
- Precision (:func:`mixed_precision_policy`): fp32 sharded parameters
  always; ``--fp16`` and ``--memory-efficient-fp16`` compute in fp16 through
  FSDP2's ``MixedPrecisionPolicy`` (fairseq's loss scaler still scales the
  loss), gradients reduced in fp16, or in fp32 with ``--fp32-reduce-scatter``;
  ``--bf16-autocast`` keeps fp32 parameters and runs the forward under
  autocast, as without sharding.
- FSDP2 replaces every parameter by a ``DTensor`` and drops its Python
  attributes; :func:`apply_fully_sharded` tags the replacements again
  (:mod:`fairseq_megatron.modules.parameter_attributes`).
- Checkpoints: the model is gathered one tensor at a time
  (:func:`gathered_state_dict`) into this package's part files, and the
  optimizer state saved in shards, one file per data-parallel rank
  (:mod:`fairseq_megatron.checkpoint.optimizer_shards`).
"""

from typing import Iterable, List

import torch
import torch.nn as nn
from fairseq.utils import safe_getattr

from fairseq_megatron.errors import UsageError
from fairseq_megatron.models.pipeline_stage import V_SHAPE, pipeline_stages
from fairseq_megatron.modules.parameter_attributes import KeepsParameterAttributes
from fairseq_megatron.training.pipeline_schedules import schedule_of


def mixed_precision_policy(fp16: bool, fp32_reduce_scatter: bool):
    """FSDP2's ``MixedPrecisionPolicy`` for fairseq's precision flags: fp16
    compute (``fp16``) with gradients reduced in fp32 where
    ``fp32_reduce_scatter``; None (fp32 throughout) otherwise."""
    if not fp16:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.float16,
                                reduce_dtype=torch.float32 if fp32_reduce_scatter else torch.float16)


def apply_fully_sharded(root: nn.Module, units: Iterable[nn.Module], mesh, reshard_after_forward: bool = True,
                        mp_policy=None, deferred=None) -> nn.Module:
    """``fully_shard`` each module of ``units`` (the decoder layers), then
    ``root`` (what holds the rest: the model, or a pipeline stage's module),
    over the 1-D data-parallel ``mesh``. Returns ``root``, now an
    ``FSDPModule``. ``deferred``: the model's
    :class:`~fairseq_megatron.modules.sharding.DeferredInitialisation`, told
    which parameter replaced which, so that its draws fill the shards.

    Apply after compilation and activation checkpointing (FSDP2's hooks run
    around each unit's call: a compiled layer stays one region), and then
    :func:`retag_parameters` of the model."""
    from torch.distributed.fsdp import fully_shard

    options = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    before = [(module, name, param) for module in root.modules() for name, param in module._parameters.items()
              if param is not None]
    for unit in units:
        fully_shard(unit, **options)
    fully_shard(root, **options)
    if deferred is not None:
        for module, name, param in before:
            deferred.replaced(param, module._parameters[name])
    return root


def retag_parameters(module: nn.Module) -> None:
    """Give the parameters that replaced others (FSDP2's DTensors) the
    attributes the modules recorded for them."""
    for child in module.modules():
        if isinstance(child, KeepsParameterAttributes):
            child.tag_parameters()


def shard_model(model: nn.Module, roots: List[nn.Module], mesh, cfg) -> None:
    """Apply :func:`apply_fully_sharded` for fairseq-train's configuration
    ``cfg`` over the 1-D ``mesh`` of the ranks that average gradients (the
    layout's ``dp``, or ``dp`` and ``cp`` flattened with context
    parallelism: Megatron's data-and-context group), each decoder layer of
    ``model`` one unit, each of ``roots`` (``[model]``, or the modules of a
    pipeline stage's model chunks, each holding its layers) the rest;
    ``--no-reshard-after-forward``, ``--fp16`` and ``--fp32-reduce-scatter``
    as the module docstring says."""
    distributed = cfg.distributed_training
    layers = set(model.decoder.held_layers())
    for root in roots:
        apply_fully_sharded(root, [m for m in root.modules() if m in layers], mesh,
                            reshard_after_forward=not distributed.no_reshard_after_forward,
                            mp_policy=mixed_precision_policy(cfg.common.fp16, distributed.fp32_reduce_scatter),
                            deferred=model.deferred_initialisation)
    retag_parameters(model)


def gathered_state_dict(state: dict, keep: bool) -> dict:
    """The model ``state`` (``model.state_dict()`` of a sharded model, its
    values ``DTensor`` shards) gathered whole, one tensor at a time: each
    sharded value all-gathered over its mesh (``full_tensor``, a collective
    every rank of the mesh calls, in the state's key order) and, where
    ``keep``, moved to the CPU; elsewhere dropped at once, so that no rank
    holds more than its share plus one gathered tensor on the device.
    Returns the whole state where ``keep``, else an empty dict."""
    gathered = {}
    for key, value in state.items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        if keep:
            gathered[key] = value.detach().cpu() if torch.is_tensor(value) else value
    return gathered


def check_fully_sharded(distributed, common, ema, model, checkpoint=None) -> None:
    """Refuse what ``--ddp-backend fully_sharded`` (torch's FSDP2,
    :mod:`fairseq_megatron.training.fully_sharded`) does not do for our
    models (:class:`~fairseq_megatron.training.data_parallel.FullyShardedDataParallel`
    checks it at fairseq-train's start). ``distributed``, ``common``,
    ``ema``, ``checkpoint``: fairseq's ``cfg.distributed_training``,
    ``cfg.common``, ``cfg.ema``, ``cfg.checkpoint``; ``model``: the model
    config.

    Each refusal says why: fairscale's options have no FSDP2 counterpart
    (``--cpu-offload``, ``--use-sharded-state``: the checkpoints are always
    this package's part files plus one optimizer shard per data-parallel
    rank); ``--zero-sharding os`` would shard the optimizer state a second
    time; ``--cuda-graphs`` would replay addresses of parameters FSDP2
    gathers anew each step; fairseq's EMA keeps a whole model copy and its
    ``--amp`` optimizer does not use FSDP2's mixed-precision policy; the
    pipeline schedules that split the backward need the gathered weights
    kept from each forward to its weight pass (``--no-reshard-after-forward``),
    and those that place the chunks in a V cannot shard the tied embedding
    both of a rank's chunks hold; a save,
    which every rank takes part in (each writes its optimizer shard, one
    commit of all), is written synchronously to a local directory.

    Raises:
        UsageError: the first of these.
    """
    saving = checkpoint is not None and not checkpoint.no_save
    refused = [
        ("--cpu-offload", getattr(distributed, "cpu_offload", False),
         "fairscale's FSDP option; torch's FSDP2 here keeps the parameter shards on the device"),
        ("--use-sharded-state", getattr(distributed, "use_sharded_state", False),
         "fairscale's FSDP option; checkpoints are always part files plus one optimizer shard per data-parallel "
         "rank"),
        (f"--zero-sharding {distributed.zero_sharding}", distributed.zero_sharding != "none",
         "the optimizer state is sharded already, with the parameters"),
        ("--cuda-graphs", safe_getattr(model, "cuda_graphs", False),
         "FSDP2 gathers each layer's parameters into new memory every step, which a replayed CUDA graph "
         "cannot follow"),
        ("--store-ema", ema.store_ema, "fairseq's EMA keeps a whole copy of the model on every rank"),
        ("--amp", common.amp, "fairseq's AMP optimizer is not wired to FSDP2's mixed-precision policy; use --fp16 "
                              "or --bf16-autocast, which are"),
        ("--write-checkpoints-asynchronously", saving and checkpoint.write_checkpoints_asynchronously,
         "every rank takes part in a save (each writes its optimizer shard, one commit of all)"),
        (f"--save-dir {checkpoint.save_dir if checkpoint is not None else ''} (a remote file system)",
         saving and "://" in (checkpoint.save_dir or ""),
         "the save's commit renames every rank's files in a local directory"),
    ]
    for flag, given, reason in refused:
        if given:
            raise UsageError(f"{flag} does not work with --ddp-backend fully_sharded ({reason}); drop it, or use "
                             f"--ddp-backend pytorch_ddp")
    _check_pipeline_schedule(distributed, model)


def _check_pipeline_schedule(distributed, model) -> None:
    """Refuse the pipeline schedules FSDP2 does not train right under
    :func:`check_fully_sharded`'s options (see there)."""
    schedule = schedule_of(model)
    if pipeline_stages(model) > 1 and schedule.splits_backward:
        if schedule.placement == V_SHAPE and safe_getattr(model, "share_decoder_input_output_embed", False):
            raise UsageError(f"--pipeline-schedule {schedule.name} with tied embeddings does not work with "
                             f"--ddp-backend fully_sharded: its V places the first and the last model chunk on one "
                             f"rank, both holding the tied embedding, and FSDP2 shards each chunk as its own root, "
                             f"which cannot share a tensor; use --pipeline-schedule interleaved-zb (with "
                             f"--no-reshard-after-forward), or --ddp-backend legacy_ddp")
        if not getattr(distributed, "no_reshard_after_forward", False):
            raise UsageError(f"--pipeline-schedule {schedule.name} with --ddp-backend fully_sharded needs "
                             f"--no-reshard-after-forward: torch's split backward finds a chunk's weights among the "
                             f"parameters its module holds when the input pass runs (stage_backward_input), and after "
                             f"a resharding forward those are FSDP2's shards, not the gathered weights the forward "
                             f"used, so that micro-batch's weight gradients would never be computed")
