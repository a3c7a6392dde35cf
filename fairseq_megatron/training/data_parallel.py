"""Data parallelism: one object per ``--ddp-backend``, which the trainer asks.

In a world of ``T x C x D x P`` ranks (:mod:`fairseq_megatron.parallel.layout`)
data parallelism uses two of this rank's groups, each named for its use (as
torchtitan's ``dp`` and ``dp_cp`` meshes are):

- :attr:`DataParallel.data`, the ``D`` model copies: the data loader shards
  the batches over them (the ``C`` context-parallel ranks of a copy read the
  same batches);
- :attr:`DataParallel.gradients`, the ``D x C`` ranks that average their
  gradients and sum their logging outputs (Megatron-Core's
  data-and-context-parallel group; ``data`` itself where ``C = 1``).

How the gradients are averaged is fairseq's ``--ddp-backend``, read by
:func:`data_parallel_class` alone; each backend is one class:

- ``pytorch_ddp``, ``c10d``: :class:`DistributedDataParallel`, torch's
  DDP (buckets all-reduced during the backward pass);
- ``legacy_ddp``, ``no_c10d``: :class:`LegacyDistributedDataParallel`,
  fairseq's (all-reduced after the backward pass, when the trainer asks);
- ``fully_sharded``: :class:`FullyShardedDataParallel`, torch's FSDP2
  (parameters, gradients and optimizer state sharded over the ranks);
- ``slowmo``: :class:`SlowMo`, fairseq's SlowMo wrapper.

Each class checks the launch options it cannot run with (:meth:`DataParallel.check`,
before any work), applies itself to the model (:meth:`DataParallel.apply`,
from :func:`~fairseq_megatron.training.parallelize.parallelize`), wraps it
for fairseq's trainer (:meth:`DataParallel.wrap`), and says how a
checkpoint holds the model and the optimizer state (:meth:`DataParallel.checkpoint_state`,
:attr:`DataParallel.optimizer_shards`).
"""

from typing import Dict, Optional, Type

import torch
import torch.nn as nn
from fairseq.utils import safe_getattr

from fairseq_megatron.errors import UsageError
from fairseq_megatron.parallel.parallel_state import ProcessGroups, RankGroup
from fairseq_megatron.training.fully_sharded import check_fully_sharded, gathered_state_dict, shard_model


class DataParallel:
    """Fairseq's own wrapper (``fairseq/models/distributed_fairseq_model.py``)
    averages the gradients over :attr:`gradients`; subclasses say what
    differs. ``groups``: this rank's groups
    (:func:`~fairseq_megatron.parallel.parallel_state.get_process_groups`)."""

    backends = ()
    """The ``--ddp-backend`` values that name this class."""

    averages_outside_the_forward = False
    """Whether the gradients are averaged after the backward pass, when the
    trainer asks, rather than by hooks of the wrapped module's forward: torch's
    pipeline schedule calls each stage's modules itself, not the wrapper."""

    needs_a_process_group = False
    """Whether it runs over a process group even at one rank (then a process
    without a launcher starts a world of its own one rank)."""

    keeps_fp32_parameters = False
    """Whether ``--fp16`` keeps the parameters in fp32 (computing in fp16 from
    them) and scales the loss without an fp32 copy of them: fairseq's
    trainer then casts nothing to half precision and builds its
    memory-efficient fp16 optimizer (fairseq's branches for fairscale's FSDP)."""

    def __init__(self, groups: ProcessGroups):
        self.data: RankGroup = groups.data
        self.gradients: RankGroup = groups.data_context
        self.groups = groups

    @classmethod
    def check(cls, cfg, stages: int, data_parallel_size: int, context_parallel_size: int = 1) -> None:
        """Refuse, before any work, what this backend cannot run in a layout of
        ``stages`` pipeline stages, ``data_parallel_size`` model copies and
        ``context_parallel_size`` context-parallel ranks with fairseq-train's
        configuration ``cfg`` (None: the layout alone).

        torch's pipeline schedule runs each stage outside the wrapper, so a
        backend whose hooks average in the wrapper's forward (torch's DDP)
        would never average a stage's gradients (see
        :attr:`averages_outside_the_forward`).

        Raises:
            UsageError: pipeline stages, more than one rank to average
                gradients over, and a backend that averages in the forward.
        """
        if stages > 1 and data_parallel_size * context_parallel_size > 1 and not cls.averages_outside_the_forward:
            ranks = f"{data_parallel_size} model cop{'y' if data_parallel_size == 1 else 'ies'}"
            if context_parallel_size > 1:
                ranks += f" x --context-parallel-size {context_parallel_size}"
            raise UsageError(f"--ddp-backend {cls.backends[0]} with --pipeline-model-parallel-size {stages} and "
                             f"{ranks}: the pipeline schedule runs each stage outside "
                             f"torch's DDP; use --ddp-backend legacy_ddp or fully_sharded")

    def apply(self, model: nn.Module, roots, cfg) -> None:
        """Apply this data parallelism to ``model`` in place, ``roots`` being
        the modules that hold the rest of it around its layers (``[model]``,
        or a pipeline stage's model chunks). Nothing here: the trainer wraps
        the model (:meth:`wrap`)."""

    def wrap(self, model: nn.Module, device: torch.device, distributed) -> Optional[nn.Module]:
        """The module fairseq's trainer runs in place of ``model`` when more
        than one rank averages gradients (``distributed``: fairseq's
        ``cfg.distributed_training``), or None for fairseq's own wrapper."""
        return None

    def checkpoint_state(self, state: dict, keep: bool) -> dict:
        """fairseq's trainer ``state`` as a part file holds it (``keep``: this
        rank writes the part file; every rank calls this). As it is here."""
        return state

    @property
    def optimizer_shards(self) -> int:
        """The files a part's optimizer state is saved in, one per rank of
        :attr:`gradients` (:mod:`fairseq_megatron.checkpoint.optimizer_shards`);
        0: the part file holds it whole."""
        return 0

    @property
    def optimizer_shard_rank(self) -> int:
        """This rank's optimizer shard (0 where :attr:`optimizer_shards` is 0)."""
        return 0


class DistributedDataParallel(DataParallel):
    """torch's ``DistributedDataParallel``: each rank holds the whole
    parameters, and the gradients are all-reduced in buckets during the
    backward pass (Li et al. 2020)."""

    backends = ("pytorch_ddp", "c10d")

    def wrap(self, model, device, distributed):
        """On a GPU fairseq's wrapper (torch's DDP with the device id); on the
        CPU torch's DDP without device ids, which fairseq passed (torch's DDP
        refuses them for a CPU module)."""
        if device.type != "cpu":
            return None
        from fairseq.distributed import ModuleProxyWrapper

        return ModuleProxyWrapper(nn.parallel.DistributedDataParallel(
            module=model.to(device),
            broadcast_buffers=distributed.broadcast_buffers,
            bucket_cap_mb=distributed.bucket_cap_mb,
            process_group=self.gradients.group,
            find_unused_parameters=distributed.find_unused_parameters,
            gradient_as_bucket_view=distributed.gradient_as_bucket_view,
        ))


class LegacyDistributedDataParallel(DataParallel):
    """fairseq's ``LegacyDistributedDataParallel``: the gradients are
    all-reduced in one flat buffer after the backward pass, when the trainer
    asks, so it averages a pipeline stage that torch's schedule runs."""

    backends = ("legacy_ddp", "no_c10d")
    averages_outside_the_forward = True


class SlowMo(DataParallel):
    """fairseq's SlowMo wrapper (Wang et al. 2020), as fairseq builds it."""

    backends = ("slowmo",)


# fairseq's optimizers whose update of a parameter reads more than each of its elements
# (factored or per-row statistics): their ``supports_flat_params`` is False.
NOT_POINTWISE = ("adafactor", "lamb", "adagrad")


class FullyShardedDataParallel(DataParallel):
    """torch's FSDP2 (:mod:`fairseq_megatron.training.fully_sharded`) over
    :attr:`gradients`: each rank holds ``1 / (D x C)`` of every parameter,
    of its gradient and of its optimizer state (Rajbhandari et al. 2020,
    ZeRO stage 3). A checkpoint gathers the model into the part files and
    keeps the optimizer state in one shard per rank."""

    backends = ("fully_sharded",)
    averages_outside_the_forward = True  # each model chunk is a root unit, which torch's schedule drives
    needs_a_process_group = True  # FSDP2 shards over a mesh, even of one rank
    keeps_fp32_parameters = True

    @classmethod
    def check(cls, cfg, stages, data_parallel_size, context_parallel_size=1):
        """As :meth:`DataParallel.check`, and what
        :func:`~fairseq_megatron.training.fully_sharded.check_fully_sharded` refuses."""
        super().check(cfg, stages, data_parallel_size, context_parallel_size)
        if cfg is not None:
            check_fully_sharded(cfg.distributed_training, cfg.common, cfg.ema, cfg.model, cfg.checkpoint)
            optimizer = getattr(cfg.get("optimizer") or {}, "_name", None)
            if optimizer in NOT_POINTWISE:  # fairseq's own rule for fully_sharded (fairseq/trainer.py)
                raise UsageError(f"--optimizer {optimizer} does not work with --ddp-backend fully_sharded: each rank "
                                 f"updates its shard of every parameter alone, which only pointwise optimizers "
                                 f"(Adam, AdamW, Adadelta, Adamax, SGD) do as on whole parameters; use one of them, "
                                 f"or --ddp-backend pytorch_ddp")

    def apply(self, model, roots, cfg):
        """``fully_shard`` each decoder layer and then each of ``roots``
        (:func:`~fairseq_megatron.training.fully_sharded.shard_model`) over
        the 1-D mesh of :attr:`gradients`."""
        mesh = self.groups.mesh
        mesh = mesh["dp_cp"] if self.groups.layout.context > 1 else mesh["dp"]
        shard_model(model, roots, mesh, cfg)

    def wrap(self, model, device, distributed):
        """The model itself: FSDP2 shards it in place."""
        return model

    def checkpoint_state(self, state, keep):
        """The model gathered whole one tensor at a time (kept where ``keep``;
        every rank takes part), and in place of the optimizer state the
        number of its shards (each rank saves its own)."""
        state["model"] = gathered_state_dict(state["model"], keep=keep)
        if state.pop("last_optimizer_state", None) is not None:
            state["optimizer_shards"] = self.optimizer_shards
        return state

    @property
    def optimizer_shards(self) -> int:
        return self.gradients.size

    @property
    def optimizer_shard_rank(self) -> int:
        return self.gradients.rank


_CLASSES: Dict[str, Type[DataParallel]] = {
    backend: cls for cls in (DistributedDataParallel, LegacyDistributedDataParallel, FullyShardedDataParallel, SlowMo)
    for backend in cls.backends}


def data_parallel_class(distributed) -> Type[DataParallel]:
    """The class of ``--ddp-backend`` (``distributed``: fairseq's
    ``cfg.distributed_training``, or the backend's name): the one place that
    reads the option."""
    name = distributed if isinstance(distributed, str) else safe_getattr(distributed, "ddp_backend", "pytorch_ddp")
    return _CLASSES[str(name)]


def check_pipeline_data_parallel_backend(ddp_backend: str, stages: int, data_parallel_size: int,
                                         context_parallel_size: int = 1) -> None:
    """:meth:`DataParallel.check` of ``--ddp-backend ddp_backend`` for the
    layout alone.

    Raises:
        UsageError: as :meth:`DataParallel.check`.
    """
    data_parallel_class(ddp_backend).check(None, stages, data_parallel_size, context_parallel_size)
