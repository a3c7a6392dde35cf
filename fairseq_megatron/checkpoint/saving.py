"""fairseq-train's saves of a model in parts: which files, written how.

:func:`save_checkpoint_of_model_parts` is fairseq's ``checkpoint_utils.save_checkpoint``
for our models: the same files under the same conditions (the epoch and
interval checkpoints, ``checkpoint_best``, the best-N files of
``--keep-best-checkpoints``, ``checkpoint_last``) and the same removals, for
this rank's part (``-model_part-K`` files). Where it differs:

- the score of a kept best-N file is read with the file-name pattern's group
  (fairseq split the name at its last "_", which the part suffix holds);
- the copies of the file written first are written whole (a temporary name
  in the same directory, then a rename; fairseq copied in place, so that a
  run killed during a copy left a truncated checkpoint to resume from);
- at model-parallel size > 1 every file is a commit of all its parts
  (:func:`save_committed`, :mod:`.commit`), and under sharded data
  parallelism of all parts and optimizer shards (:mod:`.optimizer_shards`).
"""

import collections
import glob
import logging
import os
import re
from typing import Callable, Dict, List, Optional

import numpy as np
import torch.distributed as dist
from fairseq import checkpoint_utils
from fairseq.file_io import PathManager

from fairseq_megatron.checkpoint import commit
from fairseq_megatron.checkpoint.commit import manifest_path, remove_stale, write_manifest
from fairseq_megatron.checkpoint.layout import CheckpointError
from fairseq_megatron.checkpoint.loading import on_every_rank
from fairseq_megatron.checkpoint.names import checkpoint_of_part, is_first_file, output_paths, staged_name
from fairseq_megatron.checkpoint.optimizer_shards import SHARD_FILE_NAME, SHARD_SUFFIX, shard_path, shard_paths
from fairseq_megatron.checkpoint.part_files import write_error
from fairseq_megatron.files import written_whole
from fairseq_megatron.parallel import parallel_state

logger = logging.getLogger(__name__)


def copy_whole(src: str, dst: str) -> None:
    """``dst`` becomes a copy of ``src``: written under a temporary name of
    its own in ``dst``'s directory (:func:`~fairseq_megatron.files.written_whole`),
    then renamed over ``dst`` (a copy cut short never stands under ``dst``'s
    name).

    Raises:
        CheckpointError: the copy failed (a full disk: one line with the
            bytes to write and free); nothing is left under either name.
    """
    try:
        with written_whole(dst) as partial:
            assert PathManager.copy(src, partial, overwrite=True), f"Failed to copy {src} to {dst}"
    except OSError as e:
        raise write_error(dst, e, os.path.getsize(src)) from None


def remove_old(paths) -> None:
    """Remove the files of the old checkpoints fairseq's --keep-* options
    drop (``paths``: the files of this rank's part; called on the part's
    writer alone, so that no two ranks remove one file): each part file,
    its optimizer shards, and with part 0 (or a model's only part) its
    checkpoint's manifest."""
    for path in paths:
        if os.path.lexists(path):
            os.remove(path)
        elif PathManager.exists(path):
            PathManager.rm(path)
        remove_optimizer_shards(path)
        checkpoint = checkpoint_of_part(path)
        if checkpoint is None or is_first_file(path):
            remove_manifest(checkpoint or path)


def remove_manifest(checkpoint: str) -> None:
    """Remove ``checkpoint``'s manifest, where it has one (before a save that
    writes none: a model in one part without optimizer shards)."""
    if os.path.lexists(manifest_path(checkpoint)):
        os.remove(manifest_path(checkpoint))


def remove_optimizer_shards(part: str, beyond: int = 0) -> None:
    """Remove the optimizer shards of part file ``part`` (:mod:`.optimizer_shards`)
    of data-parallel ranks ``beyond`` and above, where an earlier save under
    sharded data parallelism left them (all of them by default; a save of
    ``D`` shards removes those an earlier save at a larger ``D`` left)."""
    for name in glob.glob(glob.escape(part[: -len(".pt")]) + SHARD_SUFFIX.format("*") + ".pt"):
        shard = SHARD_FILE_NAME.fullmatch(name)
        if shard and int(shard.group(2)) >= beyond:
            os.remove(name)


def _failed_on_a_rank(what: str):
    """What :func:`~fairseq_megatron.checkpoint.loading.on_every_rank` raises where another rank failed at ``what``."""
    return lambda rank, said: CheckpointError(f"{what} failed on model-parallel rank {rank}: {said}")


def save_committed(write: Callable[[Dict[str, str]], object], mine: List[str], checkpoint: str, token: str,
                   updates: int, shards: int = 0) -> None:
    """Write this rank's files ``mine`` (final names: its part file, its
    optimizer shard) of a save of ``checkpoint`` as a commit
    (:mod:`fairseq_megatron.checkpoint.commit`): ``write(staged)`` writes
    each under its staged name (``staged``: final name -> staged name) on
    every rank; the first rank then writes the manifest, listing the parts
    and their ``shards`` optimizer shards each; then each rank renames its
    files. The ranks of the commit are the model-parallel group, or every
    rank where each saves an optimizer shard. A failure on any rank before
    the commit point stops every rank, the staged files removed and the
    previous save left under the name. The writer of a part then removes
    the optimizer shards beyond ``shards`` that an earlier save left."""
    staged = {name: staged_name(name, token) for name in mine}
    layout = parallel_state.get_parallel_layout()
    group = dist.group.WORLD if shards else parallel_state.get_model_parallel_group()
    first = parallel_state.rank(group) == 0
    parts = output_paths(checkpoint, layout.tensor, layout.pipeline)
    try:
        on_every_rank(lambda: write(staged), _failed_on_a_rank(f"saving {checkpoint}"), group)
        on_every_rank(lambda: write_manifest(checkpoint, token, updates, parts, shard_paths(parts, shards))
                      if first else None,
                      _failed_on_a_rank(f"committing the save of {checkpoint}"), group)
    except BaseException:
        for name in staged.values():
            if os.path.lexists(name):
                os.remove(name)
        raise
    for name, written in staged.items():
        os.replace(written, name)
        remove_stale(name, token)
        if shards and name in parts:  # the part's writer: shards of an earlier save at a larger D go
            remove_optimizer_shards(name, beyond=shards)


def checkpoint_names(cfg, suffix: str, epoch: int, end_of_epoch: bool, updates: int, val_loss,
                     best_holder) -> List[str]:
    """The files fairseq-train saves now, first the one written (the others
    are its copies), as fairseq's ``save_checkpoint`` chooses them, named
    for this rank's part (``suffix``). ``best_holder``: see
    :func:`save_checkpoint_of_model_parts`."""
    from fairseq.data import data_utils

    def is_better(a, b):
        return a >= b if cfg.maximize_best_checkpoint_metric else a <= b

    conds = collections.OrderedDict()
    conds[f"checkpoint{epoch}{suffix}.pt"] = (end_of_epoch and not cfg.no_epoch_checkpoints
                                              and epoch % cfg.save_interval == 0)
    conds[f"checkpoint_{epoch}_{updates}{suffix}.pt"] = (not end_of_epoch and cfg.save_interval_updates > 0
                                                        and updates % cfg.save_interval_updates == 0)
    conds[f"checkpoint_best{suffix}.pt"] = val_loss is not None and (
        not hasattr(best_holder, "best") or is_better(val_loss, best_holder.best))
    if val_loss is not None and cfg.keep_best_checkpoints > 0:
        worst_best = getattr(best_holder, "best", None)
        kept = checkpoint_utils.checkpoint_paths(cfg.save_dir, pattern=_best_pattern(cfg, suffix), keep_match=True)
        if kept:  # by score, descending
            worst_best = kept[-1][1] if cfg.maximize_best_checkpoint_metric else kept[0][1]
        with data_utils.numpy_seed(epoch, updates, val_loss):
            digit = np.random.randint(0, cfg.keep_best_checkpoints)  # breaks ties, as fairseq
        conds[f"checkpoint.best_{cfg.best_checkpoint_metric}_{val_loss:.3f}{digit}{suffix}.pt"] = (
            worst_best is None or is_better(val_loss, worst_best))
    conds[f"checkpoint_last{suffix}.pt"] = not cfg.no_last_checkpoints
    return [os.path.join(cfg.save_dir, name) for name, cond in conds.items() if cond]


def _best_pattern(cfg, suffix: str) -> str:
    return rf"checkpoint\.best_{cfg.best_checkpoint_metric}_(\d+\.?\d*){re.escape(suffix)}\.pt"


def save_checkpoint_of_model_parts(cfg, trainer, epoch_itr, val_loss, best_holder) -> Optional[str]:
    """fairseq's ``checkpoint_utils.save_checkpoint`` for our models (see
    the module docstring): ``cfg`` is fairseq's ``cfg.checkpoint``,
    ``trainer`` the run's ``MegatronTrainer``; ``best_holder``: the function
    object fairseq keeps the best score on (``save_checkpoint.best``, read by
    fairseq-train and ``load_checkpoint``). Returns the file written, on the
    ranks that write."""
    from fairseq import meters

    prev_best = getattr(best_holder, "best", val_loss)
    if val_loss is not None:
        best_holder.best = (max if cfg.maximize_best_checkpoint_metric else min)(val_loss, prev_best)
    if cfg.no_save:
        return None
    if trainer.data_parallel_rank == 0:
        os.makedirs(cfg.save_dir, exist_ok=True)
    trainer.consolidate_optimizer()
    if not trainer.should_save_checkpoint_on_current_rank:
        if trainer.always_call_state_dict_during_save_checkpoint:
            trainer.state_dict()
        return None

    write_timer = meters.StopwatchMeter()
    write_timer.start()
    epoch, end_of_epoch, updates = epoch_itr.epoch, epoch_itr.end_of_epoch(), trainer.get_num_updates()
    logger.info(f"Preparing to save checkpoint for epoch {epoch} @ {updates} updates")
    suffix = trainer.checkpoint_suffix
    checkpoints = checkpoint_names(cfg, suffix, epoch, end_of_epoch, updates, val_loss, best_holder)
    extra_state = {"train_iterator": epoch_itr.state_dict(), "val_loss": val_loss}
    if hasattr(trainer.task, "get_checkpoint_dict"):
        extra_state.update(trainer.task.get_checkpoint_dict())
    if hasattr(best_holder, "best"):
        extra_state["best"] = best_holder.best
    saved = _write(cfg, trainer, checkpoints, extra_state, updates)
    if checkpoints:
        write_timer.stop()
        logger.info(f"Saved checkpoint {checkpoints[0]} (epoch {epoch} @ {updates} updates, score {val_loss}) "
                    f"(writing took {write_timer.sum} seconds)")
    if trainer.writes_the_part:  # one rank per part removes its old files (all data-parallel ranks save shards)
        _remove_beyond_what_is_kept(cfg, suffix, end_of_epoch)
    return saved


def _write(cfg, trainer, checkpoints: List[str], extra_state: dict, updates: int) -> Optional[str]:
    """Write ``checkpoints[0]`` and copy it to the others: each a commit of
    all parts (and optimizer shards) where the model is in parts or its
    optimizer state in shards (the save dir local and written
    synchronously: ``--ddp-backend fully_sharded`` refuses the others)."""
    if not checkpoints:
        return None
    layout = parallel_state.get_parallel_layout()
    shards = trainer.optimizer_shards
    if (layout.tensor * layout.pipeline > 1 or shards) and "://" not in cfg.save_dir \
            and not cfg.write_checkpoints_asynchronously:
        group = dist.group.WORLD if shards else parallel_state.get_model_parallel_group()
        token = [commit.new_token()]  # the first rank's, sent to the others
        if parallel_state.world_size(group) > 1:
            dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
        extra_state["save"] = {"token": token[0], "updates": updates}
        for i, part in enumerate(checkpoints):
            mine = ([part] if trainer.writes_the_part else []) + (
                [shard_path(part, trainer.optimizer_shard_rank)] if shards else [])
            if i == 0:
                write = lambda staged: trainer.save_checkpoint(  # noqa: E731
                    staged.get(part), extra_state, optimizer_shard=staged.get(mine[-1]) if shards else None)
            else:
                write = lambda staged: [copy_whole(first, staged[name])  # noqa: E731
                                        for first, name in zip(first_files, mine)]
            save_committed(write, mine, checkpoint_of_part(part) or part, token[0], updates, shards)
            first_files = mine
        return None
    local = "://" not in cfg.save_dir
    if local:
        remove_manifest(checkpoints[0])  # of an earlier save with optimizer shards: this one writes none
    saved = trainer.save_checkpoint(checkpoints[0], extra_state)
    if local and not cfg.write_checkpoints_asynchronously:
        remove_optimizer_shards(checkpoints[0])
    for other in checkpoints[1:]:
        if cfg.write_checkpoints_asynchronously:
            logger.warning(f"not copying {checkpoints[0]} to {other}: checkpoints are written asynchronously")
        elif not local:  # fairseq's PathManager
            assert PathManager.copy(checkpoints[0], other, overwrite=True), f"Failed to copy to {other}"
        else:
            remove_manifest(other)
            copy_whole(checkpoints[0], other)
            remove_optimizer_shards(other)
    return saved


def _remove_beyond_what_is_kept(cfg, suffix: str, end_of_epoch: bool) -> None:
    """fairseq's ``--keep-interval-updates``, ``--keep-last-epochs`` and
    ``--keep-best-checkpoints`` for this rank's part files."""
    if not end_of_epoch and cfg.keep_interval_updates > 0:
        interval = rf"checkpoint_\d+_(\d+){re.escape(suffix)}\.pt"
        if cfg.keep_interval_updates_pattern == -1:
            old = checkpoint_utils.checkpoint_paths(cfg.save_dir, pattern=interval)
        else:
            old = [path for path, n in checkpoint_utils.checkpoint_paths(cfg.save_dir, pattern=interval,
                                                                         keep_match=True)
                   if n % cfg.keep_interval_updates_pattern != 0]
        remove_old(old[cfg.keep_interval_updates:])
    if cfg.keep_last_epochs > 0:
        old = checkpoint_utils.checkpoint_paths(cfg.save_dir, pattern=rf"checkpoint(\d+){re.escape(suffix)}\.pt")
        remove_old(old[cfg.keep_last_epochs:])
    if cfg.keep_best_checkpoints > 0:
        ranked = checkpoint_utils.checkpoint_paths(cfg.save_dir, pattern=_best_pattern(cfg, suffix))
        if not cfg.maximize_best_checkpoint_metric:  # by score, descending
            ranked = ranked[::-1]
        remove_old(ranked[cfg.keep_best_checkpoints:])
