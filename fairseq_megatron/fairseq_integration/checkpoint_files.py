"""Checkpoint files as fairseq reads, sends, names and writes them: trusted
loading, a loaded checkpoint sent within a data-parallel group, the epoch's
position at another data-parallel size, the best-N part files, copies
written whole, part names under directories whose name holds ".pt", models
built for a checkpoint's weights, or for fairseq-train before it knows
(steps 4, 16, 20 to 23, 26 and 27 of
:mod:`fairseq_megatron.fairseq_integration`).

4. :func:`trusted_checkpoint_loading` -- torch >= 2.6 loads with
   ``weights_only=True``; fairseq checkpoints hold argparse/omegaconf objects.
   fairseq's checkpoint loader again loads full pickles, and so does its
   ``broadcast_object``, which sends a loaded checkpoint to the other ranks
   of a data-parallel group (it failed for any training resumed with two or
   more groups). **Only load checkpoints you trust** (your own, or the
   published Megatron-11b files): unpickling can run code. A file that is
   not a checkpoint fails with one error line naming it (fairseq: torch's
   unpickling traceback).

16. :func:`broadcast_from_a_rank_of_the_group` -- with several data-parallel
   groups the trainer reads a checkpoint on each group's first rank and
   sends it to the others with fairseq's ``broadcast_object(state,
   src_rank=0, group)``, which handed torch the rank within the group where
   torch takes a global rank: "Global rank 0 is not part of group" on every
   model-parallel rank but 0, so no run with model and data parallelism
   could resume or fine-tune. (The receiving ranks' unpickling is step 4's.)

20. :func:`resuming_at_another_data_parallel_size` -- a checkpoint records
   how far its epoch got as the number of batches each data-parallel group
   had taken. Resumed with another number of groups (more GPUs, or a
   checkpoint resharded to another model-parallel size on the same GPUs),
   fairseq read that count per group of the new run: with fewer groups it
   trained batches again, with more it skipped batches of the epoch. The
   count is now converted through the batches taken in all.

21. :func:`keep_best_checkpoints_of_model_parts` -- ``fairseq-train
   --keep-best-checkpoints N`` at model-parallel size > 1 stopped at its
   second validation with "ValueError: could not convert string to float:
   'part-0.pt'": fairseq reads the score of the worst kept checkpoint back
   from its file name by splitting at the last "_", and the part suffix
   ``-model_part-K`` has one. For such suffixes the best-N files are now
   kept here, named, chosen and removed as fairseq does.

22. :func:`checkpoint_copies_written_whole` -- fairseq-train writes a
   save's first file under a temporary name and renames it, but makes the
   others (``checkpoint_last`` after an epoch or ``--save-interval-updates``
   checkpoint, ``checkpoint_best``) with ``PathManager.copy``, in place: a run
   killed during that copy left a truncated ``checkpoint_last`` to resume
   from. Local copies now go to a temporary name in the same directory and
   are renamed over the old file.

23. :func:`part_names_under_directories_with_pt` -- fairseq names a rank's
   part of ``--restore-file``/``--finetune-from-model`` (and of ``--path``)
   with ``name.replace(".pt", suffix + ".pt")``, which also rewrites a ".pt"
   inside a directory name: ``runs/wiki.ptb/model.pt`` became
   ``runs/wiki-model_part-0.ptb/model-model_part-0.pt``. fairseq-train then
   logged "No existing checkpoint found" and trained from scratch;
   fairseq-eval-lm stopped with "Model file not found". Only the file name's
   ".pt" ending takes the suffix now.

26. :func:`models_for_a_checkpoint_skip_initialisation` -- fairseq's
   ``load_model_ensemble_and_task`` (fairseq-eval-lm, -generate,
   -interactive, -validate, the hub interface) builds the model, which draws
   random initial weights, then loads every parameter from the checkpoint
   with ``strict=True``. Drawing them is nearly all of the build: about
   2 minutes on 2 CPU threads, on every rank, for Megatron-11b (every rank draws each
   layer's full master tensor, :mod:`fairseq_megatron.modules.sharding`).
   The model-parallel layers are now left NaN under a strict load (a
   parameter the checkpoint did not fill would show, not pass for trained)
   and the tied output projection's own weight is not drawn, so the load
   takes nothing from the default generator; a non-strict load
   (``--checkpoint-shard-count`` > 1) initialises as before. On 8
   Megatron-11b layers ``load_model_ensemble_and_task`` took 22.0 s, now
   6.1 s (2 CPU threads, ``scripts/benchmark_model_loading.py``).

27. :func:`training_draws_initial_weights_only_without_a_checkpoint` --
   fairseq-train builds the model, drawing its initial weights, before it
   looks for a checkpoint to resume or fine-tune from, whose weights then
   replace them all (a strict load): the same minutes as in step 26 on every
   restart of a Megatron-11b run. fairseq-train now builds our models with
   the draws deferred (:func:`fairseq_megatron.modules.sharding.initialisation_deferred`);
   a checkpoint's strict load drops them, and without a checkpoint they run
   when the trainer has looked for one, from the generator state the build
   began with: a new run starts from bitwise the weights it started from
   before. If anything else in the build drew from the generator (fairseq's
   ``--decoder-learned-pos`` embedding), or ``--store-ema`` copies the model
   in the trainer's constructor, the model is built as before.
"""

import contextlib
import functools
import logging
import os
import re
from typing import Optional

import numpy as np
import torch

from fairseq_megatron.fairseq_integration.patching import TorchStandIn, patch_cli_main

logger = logging.getLogger(__name__)


class TorchWithTrustedLoad(TorchStandIn):
    """``torch`` inside ``fairseq.checkpoint_utils`` and
    ``fairseq.distributed.utils`` (which unpickles a checkpoint state sent
    from another rank): ``torch.load`` defaults to ``weights_only=False``
    there. A file that cannot be read (not a torch file, cut short in the
    legacy format) raises CheckpointError naming it, which fairseq's tools
    print as one line; fairseq let torch's unpickling error through, a
    traceback that did not name the file."""

    @staticmethod
    def load(f, *args, **kwargs):
        from fairseq_megatron.checkpoint.layout import CheckpointError

        kwargs.setdefault("weights_only", False)
        name = getattr(f, "name", f if isinstance(f, (str, os.PathLike)) else None)
        try:
            return torch.load(f, *args, **kwargs)
        except MemoryError:
            raise
        except Exception as e:
            if name is None:  # a buffer sent by another rank: not the user's file
                raise
            raise CheckpointError(f"cannot read {name}: {type(e).__name__}: {e}") from e


def trusted_checkpoint_loading() -> None:
    from fairseq import checkpoint_utils
    from fairseq.distributed import utils as distributed_utils

    for module in (checkpoint_utils, distributed_utils):
        if not isinstance(module.torch, TorchWithTrustedLoad):
            module.torch = TorchWithTrustedLoad()


def broadcast_from_a_rank_of_the_group() -> None:
    import torch.distributed as dist
    from fairseq.distributed import utils as distributed_utils

    original = distributed_utils.broadcast

    @functools.wraps(original)
    def broadcast(tensor, src, group):
        """fairseq's ``broadcast_object`` and ``broadcast_tensors`` name the
        source by its rank within ``group`` (they compare it with
        ``get_rank(group)``); torch's ``broadcast`` takes a global rank."""
        if group is not None and not distributed_utils.use_xla():
            src = dist.get_global_rank(group, src)
        return original(tensor, src, group)

    distributed_utils.broadcast = broadcast


def resuming_at_another_data_parallel_size() -> None:
    from fairseq.trainer import Trainer

    original_save = Trainer.save_checkpoint

    @functools.wraps(original_save)
    def save_checkpoint(self, filename, extra_state):
        extra_state["data_parallel_world_size"] = self.data_parallel_world_size
        return original_save(self, filename, extra_state)

    original_load = Trainer.load_checkpoint

    @functools.wraps(original_load)
    def load_checkpoint(self, *args, **kwargs):
        extra_state = original_load(self, *args, **kwargs)
        _continue_the_epoch(extra_state, self.data_parallel_world_size)
        return extra_state

    Trainer.save_checkpoint = save_checkpoint
    Trainer.load_checkpoint = load_checkpoint


def _continue_the_epoch(extra_state: Optional[dict], groups: int) -> None:
    """Convert a checkpoint's position in its epoch to ``groups`` data-parallel groups, in place.

    fairseq's ``EpochBatchIterator`` deals the epoch's batches (one order for
    any number of groups: shuffled by seed and epoch) round-robin to the D
    groups, so after ``iterations_in_epoch`` = k batches each, batches 0 ..
    kD - 1 have been trained (``fairseq/data/iterators.py``:
    ``ShardedIterator``). With G groups, each skips kD / G of its own; when
    G does not divide kD, the last kD mod G batches are trained once more
    (fewer than G). Checkpoints saved without the plugin's
    ``data_parallel_world_size`` (by stock fairseq) are left as they are.
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


def keep_best_checkpoints_of_model_parts() -> None:
    from fairseq import checkpoint_utils

    original_save = checkpoint_utils.save_checkpoint

    @functools.wraps(original_save)
    def save_checkpoint(cfg, trainer, epoch_itr, val_loss):
        keep = cfg.keep_best_checkpoints
        suffix = trainer.checkpoint_suffix
        if keep <= 0 or "_" not in suffix:
            return original_save(cfg, trainer, epoch_itr, val_loss)
        cfg.keep_best_checkpoints = 0  # fairseq's own keeping is what fails on the suffix
        try:
            saved = original_save(cfg, trainer, epoch_itr, val_loss)
        finally:
            cfg.keep_best_checkpoints = keep
        if val_loss is not None and not cfg.no_save and trainer.should_save_checkpoint_on_current_rank:
            _keep_best_checkpoint(cfg, trainer, epoch_itr, val_loss, saved)
        return saved

    checkpoint_utils.save_checkpoint = save_checkpoint


def _keep_best_checkpoint(cfg, trainer, epoch_itr, val_loss: float, saved: Optional[str]) -> None:
    """fairseq's ``--keep-best-checkpoints`` for part files
    (``fairseq/checkpoint_utils.py:save_checkpoint``): this rank's part is
    saved as ``checkpoint.best_{metric}_{score:.3f}{digit}{suffix}.pt`` (the
    digit, drawn from epoch, update and score, breaks ties) when the score
    beats the worst of those kept, or, with none kept yet, is the best so
    far; then all but the best ``cfg.keep_best_checkpoints`` are removed.
    The scores are read with the file-name pattern's group, not by splitting
    the name. ``saved``: the file this save wrote, copied (None when this
    save wrote none; then the checkpoint is written here)."""
    from fairseq import checkpoint_utils
    from fairseq.data import data_utils
    from fairseq.file_io import PathManager

    epoch, updates, suffix = epoch_itr.epoch, trainer.get_num_updates(), trainer.checkpoint_suffix
    metric = cfg.best_checkpoint_metric
    pattern = rf"checkpoint\.best_{metric}_(\d+\.?\d*){re.escape(suffix)}\.pt"
    kept = checkpoint_utils.checkpoint_paths(cfg.save_dir, pattern=pattern, keep_match=True)  # by score, descending
    best = getattr(checkpoint_utils.save_checkpoint, "best", None)
    if kept:
        best = kept[-1][1] if cfg.maximize_best_checkpoint_metric else kept[0][1]  # the worst kept
    better = best is None or (val_loss >= best if cfg.maximize_best_checkpoint_metric else val_loss <= best)
    if better:
        with data_utils.numpy_seed(epoch, updates, val_loss):
            digit = np.random.randint(0, cfg.keep_best_checkpoints)
        path = os.path.join(cfg.save_dir, f"checkpoint.best_{metric}_{val_loss:.3f}{digit}{suffix}.pt")
        if saved is not None:
            assert PathManager.copy(saved, path, overwrite=True), f"Failed to copy {saved} to {path}"
        else:
            trainer.save_checkpoint(path, _extra_state(trainer, epoch_itr, val_loss))
    ranked = checkpoint_utils.checkpoint_paths(cfg.save_dir, pattern=pattern)  # by score, descending
    if not cfg.maximize_best_checkpoint_metric:
        ranked = ranked[::-1]
    for worse in ranked[cfg.keep_best_checkpoints:]:
        os.remove(worse)


def _extra_state(trainer, epoch_itr, val_loss) -> dict:
    """The ``extra_state`` fairseq's ``save_checkpoint`` gives a checkpoint."""
    from fairseq import checkpoint_utils

    state = {"train_iterator": epoch_itr.state_dict(), "val_loss": val_loss}
    if hasattr(trainer.task, "get_checkpoint_dict"):
        state.update(trainer.task.get_checkpoint_dict())
    if hasattr(checkpoint_utils.save_checkpoint, "best"):
        state["best"] = checkpoint_utils.save_checkpoint.best
    return state


def checkpoint_copies_written_whole() -> None:
    from fairseq.file_io import PathManager

    original_copy = PathManager.copy

    @functools.wraps(original_copy)
    def copy(src_path: str, dst_path: str, overwrite: bool = False):
        if not overwrite or "://" in dst_path:  # no file to protect, or not a local path
            return original_copy(src_path, dst_path, overwrite=overwrite)
        partial = f"{dst_path}.tmp-{os.getpid()}"
        try:
            copied = original_copy(src_path, partial, overwrite=True)
            os.replace(partial, dst_path)
        finally:
            if os.path.lexists(partial):
                os.remove(partial)
        return dst_path if isinstance(copied, str) else copied  # shutil.copyfile's value, or iopath's

    PathManager.copy = staticmethod(copy)


def part_name(named_by_fairseq: str, suffix: str) -> str:
    """The part file fairseq meant by ``named_by_fairseq``, which it made with
    ``name.replace(".pt", suffix + ".pt")``: every ".pt" in ``name`` took the
    suffix, directories included. Names without that damage come back as
    they are."""
    name = named_by_fairseq.replace(suffix + ".pt", ".pt") if suffix else named_by_fairseq
    return name[: -len(".pt")] + suffix + ".pt" if suffix and name.endswith(".pt") else named_by_fairseq


def part_names_under_directories_with_pt() -> None:
    from fairseq import checkpoint_utils
    from fairseq.trainer import Trainer

    original_name = checkpoint_utils.get_maybe_sharded_checkpoint_filename

    @functools.wraps(original_name)
    def get_maybe_sharded_checkpoint_filename(filename, suffix, shard_idx, num_shards):
        chosen = original_name(filename, suffix, shard_idx, num_shards)
        return part_name(chosen, suffix) if chosen == filename.replace(".pt", suffix + ".pt") else chosen

    checkpoint_utils.get_maybe_sharded_checkpoint_filename = get_maybe_sharded_checkpoint_filename

    original_load = Trainer.load_checkpoint

    @functools.wraps(original_load)
    def load_checkpoint(self, filename, *args, **kwargs):
        return original_load(self, part_name(filename, self.checkpoint_suffix), *args, **kwargs)

    Trainer.load_checkpoint = load_checkpoint


def models_for_a_checkpoint_skip_initialisation() -> None:
    from fairseq import checkpoint_utils

    from fairseq_megatron.modules.sharding import initialisation_skipped

    original = checkpoint_utils.load_model_ensemble_and_task

    @functools.wraps(original)
    def load_model_ensemble_and_task(filenames, arg_overrides=None, task=None, strict=True, suffix="",
                                     num_shards=1, state=None):
        skipped = initialisation_skipped() if strict else contextlib.nullcontext()
        with skipped:  # strict: every parameter is loaded right after the build, or the load raises
            return original(filenames, arg_overrides, task, strict, suffix, num_shards, state)

    checkpoint_utils.load_model_ensemble_and_task = load_model_ensemble_and_task


# Whether fairseq-train's main is running in this process (step 27).
_in_fairseq_train = False


def training_draws_initial_weights_only_without_a_checkpoint() -> None:
    from fairseq import models
    from fairseq.trainer import Trainer

    from fairseq_megatron.models.model_parallel_transformer_lm import is_model_parallel_arch
    from fairseq_megatron.modules.sharding import initialisation_deferred

    def wrap_train(original_main, module):
        def main(cfg, **kwargs):
            global _in_fairseq_train
            # fairseq's EMA deep-copies the model in the trainer's constructor, before any load
            _in_fairseq_train = not cfg.ema.store_ema
            try:
                return original_main(cfg, **kwargs)
            finally:
                _in_fairseq_train = False

        return main

    patch_cli_main("fairseq_cli.train", wrap_train)

    original_build = models.build_model

    @functools.wraps(original_build)
    def build_model(cfg, task, *args, **kwargs):
        arch = getattr(cfg, "_name", None) or getattr(cfg, "arch", None)
        if not (_in_fairseq_train and is_model_parallel_arch(arch)):
            return original_build(cfg, task, *args, **kwargs)
        with initialisation_deferred() as deferred:
            model = original_build(cfg, task, *args, **kwargs)
        if deferred.generator_moved():  # another module drew: deferred draws would come out of order
            torch.set_rng_state(deferred.generator_state)
            del model, deferred  # and the queue's references to its parameters, before the second build
            return original_build(cfg, task, *args, **kwargs)
        model.deferred_initialisation = deferred
        return model

    models.build_model = build_model

    original_load = Trainer.load_checkpoint

    @functools.wraps(original_load)
    def load_checkpoint(self, *args, **kwargs):
        model = self.get_model()
        deferred = getattr(model, "deferred_initialisation", None)
        extra_state = original_load(self, *args, **kwargs)
        if deferred is not None:
            if model.run_deferred_initialisation():
                logger.info("no checkpoint to load: drew the initial weights (deferred from the build)")
            else:
                logger.info("the checkpoint filled every parameter: the initial weights were not drawn")
        return extra_state

    Trainer.load_checkpoint = load_checkpoint
