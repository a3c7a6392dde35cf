"""Saving and loading the trainer's checkpoint: this rank's part.

Mixed into :class:`~fairseq_megatron.fairseq_integration.trainer.MegatronTrainer`
(before fairseq's ``Trainer``, ``fairseq/trainer.py``, whose
``save_checkpoint`` and ``load_checkpoint`` these extend). What the part files
are and how a checkpoint of another layout is prepared for this one is
:mod:`fairseq_megatron.checkpoint`'s.
"""

import contextlib
import logging
import os
import re
from typing import Dict, Optional

import torch
import torch.distributed as dist

from fairseq_megatron.checkpoint.commit import saved_token
from fairseq_megatron.checkpoint.layout import CheckpointError
from fairseq_megatron.checkpoint.loading import on_every_rank, part_for_training
from fairseq_megatron.checkpoint.names import part_name
from fairseq_megatron.checkpoint.optimizer_shards import optimizer_state_for, shard_state
from fairseq_megatron.checkpoint.part_files import is_write_failure, stage_suffix, write_error
from fairseq_megatron.checkpoint.reading import ChangedWhileRead, PreparedCheckpoint, prepared_for_loading
from fairseq_megatron.files import written_whole
from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.parallel.rng_tracker import get_rng_tracker

logger = logging.getLogger(__name__)


class TrainerCheckpoints:
    """``-model_part-K[-stage-S]`` files, the RNG tracker's streams and the
    epoch's position across data-parallel sizes (the trainer's docstring says
    what differs from fairseq)."""

    @property
    def checkpoint_suffix(self) -> str:
        """fairseq's (``-model_part-K`` at model-parallel size > 1), and with
        pipeline stages ``-model_part-K-stage-S``."""
        if self.pipeline is None:
            return super().checkpoint_suffix
        base = re.sub(r"-model_part-\d+$", "", self.cfg.checkpoint.checkpoint_suffix or "")
        return base + stage_suffix(parallel_state.get_tensor_model_parallel_rank(), self.pipeline.stage.stage)

    # ------------------------------------------------------------ sharded optimizer state

    @property
    def optimizer_shards(self) -> int:
        """The files each part's optimizer state is saved in, one per rank
        whose parameters are sharded (:mod:`fairseq_megatron.checkpoint.optimizer_shards`);
        0: the part file holds it (the data parallelism says:
        :attr:`~fairseq_megatron.training.data_parallel.DataParallel.optimizer_shards`)."""
        return self.data_parallel.optimizer_shards

    @property
    def optimizer_shard_rank(self) -> int:
        """This rank's shard of its part's optimizer state."""
        return self.data_parallel.optimizer_shard_rank

    @property
    def writes_the_part(self) -> bool:
        """Whether this rank writes its part file: the first of the ranks that average gradients."""
        return self.data_parallel.gradients.rank == 0

    @property
    def should_save_checkpoint_on_current_rank(self) -> bool:
        """fairseq's; every rank where the optimizer state is saved in shards (each saves its own)."""
        return bool(self.optimizer_shards) or super().should_save_checkpoint_on_current_rank

    def _trainable_parameters(self) -> Dict[str, torch.Tensor]:
        """The parameters the optimizer updates, by state-dict key, in its order (fairseq's ``Trainer._build_optimizer``)."""
        return {name: p for name, p in self.get_model().named_parameters() if p.requires_grad}

    def state_dict(self):
        """fairseq's, as a part file holds it
        (:meth:`~fairseq_megatron.training.data_parallel.DataParallel.checkpoint_state`:
        under ``fully_sharded`` the model gathered whole, every rank taking
        part, and in place of the optimizer state the number of its shards,
        :meth:`optimizer_shard_state` being each rank's)."""
        return self.data_parallel.checkpoint_state(super().state_dict(), keep=self.writes_the_part)

    def optimizer_shard_state(self, token: Optional[str]) -> dict:
        """This rank's optimizer shard of the save ``token``, to write (:func:`~fairseq_megatron.checkpoint.optimizer_shards.shard_state`)."""
        return shard_state(self.optimizer.state_dict(), list(self._trainable_parameters()), token,
                           self.optimizer_shard_rank, self.optimizer_shards)

    # ------------------------------------------------------------ saving and loading

    def save_checkpoint(self, filename, extra_state, optimizer_shard: Optional[str] = None):
        """fairseq's, for this rank's part (``crash.pt`` too), recording the
        RNG tracker's streams and the number of data-parallel groups,
        written whole under a temporary name of its own
        (:func:`~fairseq_megatron.files.written_whole`; fairseq's
        ``torch_persistent_save`` writes ``<name>.tmp``, a name a file of the
        user's may have, and on a failed write retried twice, 2.5 s apart,
        and logged a traceback before the error went on). Remote paths and
        ``--write-checkpoints-asynchronously`` go through fairseq's.

        Where the optimizer state is saved in shards (``fully_sharded``)
        every rank calls it (the model is gathered over all): ``filename`` is
        None on the ranks that write no part file, and each rank writes its
        optimizer shard to ``optimizer_shard``. A rank's own ``crash.pt`` (a
        failed step) is not written there.

        Raises:
            CheckpointError: the file system refused the write (a full disk):
                one line with the bytes free; the temporary file is removed,
                and the file of the previous save stays whole.
        """
        if self.optimizer_shards and optimizer_shard is None:
            logger.warning(f"not saving {filename}: under --ddp-backend fully_sharded a save gathers the model "
                           f"over every rank")
            return None
        suffix = self.checkpoint_suffix  # "-model_part-K" (fairseq's distributed_init sets it)
        if suffix and filename and filename.endswith(".pt") and not filename.endswith(suffix + ".pt"):
            filename = filename[: -len(".pt")] + suffix + ".pt"
        extra_state["rng_tracker_states"] = get_rng_tracker().get_states()
        extra_state["data_parallel_world_size"] = self.data_shards
        if not self.optimizer_shards and (self.cfg.checkpoint.write_checkpoints_asynchronously or "://" in filename):
            return super().save_checkpoint(filename, extra_state)
        if not self.should_save_checkpoint_on_current_rank:
            return None
        from fairseq import utils

        state_dict = utils.move_to_cpu(self.state_dict())
        state_dict["extra_state"].update(extra_state)
        if optimizer_shard is not None:
            _write(optimizer_shard, self.optimizer_shard_state((extra_state.get("save") or {}).get("token")))
        if filename is None:
            return None
        _write(filename, state_dict, log=True)
        return os.path.abspath(filename)

    def load_checkpoint(self, filename, reset_optimizer=False, reset_lr_scheduler=False, optimizer_overrides=None,
                        reset_meters=False):
        """fairseq's, for this rank's part of a checkpoint saved at any size.

        Every data-parallel rank reads the file itself. Afterwards the RNG
        tracker's streams are restored, the epoch's position is converted to
        this run's number of data-parallel groups, and, if nothing was
        loaded, the deferred initial weights are drawn.
        """
        filename = part_name(filename, self.checkpoint_suffix)
        model = self.get_model()
        deferred = model.deferred_initialisation is not None
        checkpoint = self.cfg.checkpoint
        on_all_ranks = checkpoint.load_checkpoint_on_all_dp_ranks
        checkpoint.load_checkpoint_on_all_dp_ranks = True
        prepared = None
        if filename.endswith(self.checkpoint_suffix + ".pt"):
            prepared = part_for_training(filename, self.checkpoint_suffix, self.cfg, self.task.source_dictionary,
                                         reset_optimizer, self.pipeline.stage if self.pipeline is not None else None,
                                         list(self._trainable_parameters()))
        if prepared is not None and not reset_optimizer:
            prepared = self._optimizer_state_placed(prepared, filename)
        try:
            with prepared_for_loading(prepared) if prepared is not None else contextlib.nullcontext(filename) as name:
                extra_state = super().load_checkpoint(name, reset_optimizer, reset_lr_scheduler, optimizer_overrides,
                                                      reset_meters)
        finally:
            checkpoint.load_checkpoint_on_all_dp_ranks = on_all_ranks
        if extra_state is None and prepared is not None:
            # fairseq found no file under the name it was handed: another process renamed it since it was opened
            raise ChangedWhileRead(f"{prepared.name} was renamed or removed while it was loaded (a run is saving "
                                   f"this checkpoint?): start again, or load a copy")
        if extra_state is not None and "rng_tracker_states" in extra_state:
            get_rng_tracker().set_states(extra_state["rng_tracker_states"])
        _continue_the_epoch(extra_state, self.data_shards)
        if model.run_deferred_initialisation():
            logger.info("no checkpoint to load: drew the initial weights (deferred from the build)")
        elif deferred:
            logger.info("the checkpoint filled every parameter: the initial weights were not drawn")
        return extra_state

    def _optimizer_state_placed(self, prepared: PreparedCheckpoint, part: str) -> PreparedCheckpoint:
        """``prepared`` (this rank's part ``part`` of a checkpoint of this
        layout) with the optimizer state this rank resumes from, where it
        differs from the file's: joined from the checkpoint's optimizer
        shards, or (where this run saves it in shards) cut from its whole state, each
        value placed as this rank holds its parameter
        (:func:`~fairseq_megatron.checkpoint.optimizer_shards.optimizer_state_for`).

        Raises:
            CheckpointError: an optimizer shard missing or of another save,
                or optimizer state of other parameters.
        """
        manifest = prepared.file.opened.manifest if prepared.file is not None else None
        if not self.optimizer_shards and not (manifest or {}).get("optimizer_shards"):
            return prepared  # as fairseq loads it
        from fairseq import checkpoint_utils

        state = prepared.state if prepared.state is not None else checkpoint_utils.load_checkpoint_to_cpu(prepared.file)

        def place():
            placed = optimizer_state_for(state, part, saved_token(state), self._trainable_parameters())
            if placed is not None:
                state["last_optimizer_state"] = placed

        # every rank learns of a shard another rank misses, before any of them trains
        on_every_rank(place, lambda rank, said: CheckpointError(f"rank {rank}: {said}"), dist.group.WORLD)
        return PreparedCheckpoint(prepared.name, state=state)


def _write(filename: str, state: dict, log: bool = False) -> None:
    """``torch.save`` of ``state`` to ``filename``, whole or not at all, with fairseq's log lines where ``log``.

    Raises:
        CheckpointError: the file system refused the write.
    """
    from fairseq import trainer as fairseq_trainer

    if log:
        fairseq_trainer.logger.info(f"Saving checkpoint to {os.path.abspath(filename)}")
    try:
        with written_whole(filename) as partial:
            torch.save(state, partial)
    except (OSError, RuntimeError) as e:
        if not is_write_failure(e):
            raise
        raise write_error(filename, e) from None
    if log:
        fairseq_trainer.logger.info(f"Finished saving checkpoint to {os.path.abspath(filename)}")


def _continue_the_epoch(extra_state: Optional[dict], groups: int) -> None:
    """Convert a checkpoint's position in its epoch to ``groups`` data-parallel groups, in place.

    fairseq's ``EpochBatchIterator`` deals the epoch's batches (one order for
    any number of groups: shuffled by seed and epoch) round-robin to the D
    groups, so after ``iterations_in_epoch`` = k batches each, batches 0 ..
    kD - 1 have been trained (``fairseq/data/iterators.py``:
    ``ShardedIterator``). With G groups, each skips kD / G of its own; when
    G does not divide kD, the last kD mod G batches are trained once more
    (fewer than G). fairseq read the count as it was: with fewer groups it
    trained batches again, with more it skipped some. Checkpoints saved
    without ``data_parallel_world_size`` (by stock fairseq) are left as they are.
    """
    if not extra_state or "train_iterator" not in extra_state:
        return
    saved = extra_state.get("data_parallel_world_size")
    position = extra_state["train_iterator"]
    taken = position.get("iterations_in_epoch", 0) * (saved or 0)
    if saved is None or saved == groups or taken == 0:
        return
    position["iterations_in_epoch"] = taken // groups
    again = taken % groups
    logger.info(
        "resuming at %d data-parallel groups (saved at %d): epoch %d goes on after its first %d batches%s",
        groups, saved, position["epoch"], taken,
        f" ({again} of them trained once more: {taken} is not divisible by {groups})" if again else "")
