"""``fairseq.checkpoint_utils`` for checkpoints in model parts.

Four functions of fairseq's module are replaced (:func:`install`); each
calls fairseq's own for anything that is not a checkpoint of our models:

- ``load_checkpoint_to_cpu``: loading that runs no code. torch >= 2.6
  loads with ``weights_only=True``, and fairseq's checkpoints hold
  ``argparse.Namespace`` objects: every fairseq tool failed on every
  checkpoint with an UnpicklingError. fairseq's function now loads with the
  weights-only unpickler and the allowlist of
  :mod:`fairseq_megatron.checkpoint.safe_loading` (exactly the classes
  fairseq's checkpoints and ours hold), stock fairseq's checkpoints
  included, whatever ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` says: any other
  object is one line naming its type, before it runs; a pickle that fails
  its CRC-32 is not unpickled; ``FAIRSEQ_MEGATRON_TRUST_CHECKPOINTS=1``
  unpickles in full (with a warning). In a fairseq tool run with this
  plugin, a file that is not a checkpoint is one error line naming it
  (fairseq: torch's unpickling traceback). It also gives what a
  :class:`~fairseq_megatron.checkpoint.reading.PreparedCheckpoint` prepared
  for the name (a state built in memory, or the file as it was opened).
- ``load_model_ensemble_and_task`` (fairseq-eval-lm, -generate,
  -interactive, -validate, the hub): fairseq loads only the file of its own
  model-parallel size, so a checkpoint saved at another size was "Model file
  not found"; each rank's part is now built in memory from the parts that
  exist (the 8 published Megatron-11b parts on one GPU, say;
  :func:`fairseq_megatron.checkpoint.resharding.resharded_model`), after
  every rank has opened the files of one save, the same on every rank, and
  checked that no part is cut short (a truncated part made its rank fail
  inside torch.load while the others reported a lost connection); nothing
  is written (:mod:`fairseq_megatron.checkpoint.reading`).
  A part's name given as the checkpoint, and two checkpoints joined as
  ``a.pt:b.pt`` in a tool that scores one model, are one error line each.
- ``load_checkpoint`` (fairseq-train's start): ``--finetune-from-model
  CKPT.pt`` looked for the file CKPT.pt alone, so a checkpoint in parts "does
  not exist", one file went whole into every rank, and a part's name trained
  every rank on part 0's weights without a word; it now loads each rank's
  part, or builds it in memory, from a checkpoint saved at any size, and
  refuses a part's name. A ``--restore-file`` (or, on a first launch,
  ``--continue-once`` or ``--finetune-from-model``) that names no checkpoint
  made fairseq train from scratch and save over ``checkpoint_last``; it
  now stops the run.
- ``save_checkpoint``: fairseq's naming and keeping rules for part files
  (:func:`fairseq_megatron.checkpoint.saving.save_checkpoint_of_model_parts`),
  whose ``-model_part-K`` suffix broke ``--keep-best-checkpoints`` ("could
  not convert string to float: 'part-0.pt'"), and whose copies
  (``checkpoint_last``, ``checkpoint_best``) fairseq made in place, so that
  a run killed during a copy left a truncated checkpoint to resume from.

These are adapters: what each rank loads and how a save is written are
:mod:`fairseq_megatron.checkpoint.loading` and :mod:`fairseq_megatron.checkpoint.saving`.
"""


import copy
import logging
import os
import traceback
from typing import Optional

from fairseq import checkpoint_utils
from fairseq.file_io import PathManager

from fairseq_megatron.checkpoint import safe_loading
from fairseq_megatron.checkpoint.layout import CheckpointError
from fairseq_megatron.checkpoint.loading import (
    existing_part_files,
    part_for_evaluation,
    refuse_an_ensemble_as_one_path,
    refuse_one_part_as,
)
from fairseq_megatron.checkpoint.names import part_name
from fairseq_megatron.checkpoint.part_files import find_part_files
from fairseq_megatron.checkpoint.reading import name_of, prepared_under, source_of
from fairseq_megatron.checkpoint.saving import save_checkpoint_of_model_parts
from fairseq_megatron.errors import UsageError
from fairseq_megatron.fairseq_integration.patching import original, plugin_on_command_line, replace
from fairseq_megatron.models.model_parallel_transformer_lm import is_our_model
from fairseq_megatron.parallel import parallel_state

logger = logging.getLogger(__name__)


def _raised_by_torch_load(error: BaseException) -> bool:
    return any(frame.f_code.co_filename.endswith(os.path.join("torch", "serialization.py"))
               for frame, _ in traceback.walk_tb(error.__traceback__))


def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
    """fairseq's, without running code: the weights-only unpickler with the
    allowlist of :mod:`fairseq_megatron.checkpoint.safe_loading` (full
    pickles with ``FAIRSEQ_MEGATRON_TRUST_CHECKPOINTS=1``), the pickle's
    CRC-32 checked first. ``path``: a file name (one a
    :class:`~fairseq_megatron.checkpoint.reading.PreparedCheckpoint` may
    stand for: its state, or its file as opened), or a
    :class:`~fairseq_megatron.checkpoint.reading.FileAsOpened`.

    Raises:
        UnsafeCheckpoint: the file holds an object outside the allowlist
            (one line naming its type; nothing of it was run).
        CheckpointError: the pickle fails its CRC-32; in a fairseq tool run
            with this plugin, the file cannot be read (not a torch file, cut
            short in the legacy format).
    """
    prepared = prepared_under(path)
    if prepared is not None and prepared.state is not None:
        return prepared.state
    if prepared is not None and prepared.file is not None:
        path = prepared.file
    name, source = name_of(path), source_of(path)
    try:
        if os.path.isfile(source):
            safe_loading.check_pickle_crc(source, name)
        with safe_loading.loading():
            return original(checkpoint_utils, "load_checkpoint_to_cpu")(source, arg_overrides, load_on_all_ranks)
    except MemoryError:
        raise
    except CheckpointError:
        raise
    except Exception as e:
        refused = safe_loading.refusal(e, name)
        if refused is not None:
            raise refused from None
        if not (plugin_on_command_line() and _raised_by_torch_load(e)):
            raise
        raise CheckpointError(f"cannot read {name}: {type(e).__name__}: {e}") from e


def load_model_ensemble_and_task(filenames, arg_overrides=None, task=None, strict=True, suffix="", num_shards=1,
                                 state=None):
    """fairseq's, for our checkpoints at any model-parallel size: each
    rank's part is read, or built in memory when the checkpoint was saved at
    another size (:func:`~fairseq_megatron.checkpoint.loading.part_for_evaluation`).
    Other checkpoints load as fairseq loads them.

    Raises:
        UsageError: a part's name given for the checkpoint; an ensemble in a
            tool that scores one model; what ``part_for_evaluation`` raises.
        FileNotFoundError: no checkpoint of that name, whole or in parts
            (an OSError, as fairseq's "Model file not found"); the message
            names the files looked for.
    """
    load = original(checkpoint_utils, "load_model_ensemble_and_task")
    if state is not None or num_shards != 1:
        return load(filenames, arg_overrides, task, strict, suffix, num_shards, state)
    ensemble, cfg = [], None
    for filename in filenames:
        refuse_one_part_as("--path", filename)
        refuse_an_ensemble_as_one_path(filename)
        try:
            files = find_part_files(filename)
        except FileNotFoundError:
            if not PathManager.exists(part_name(filename.replace(".pt", suffix + ".pt"), suffix)):
                raise  # naming the part files looked for; fairseq named one rank's part
            files = []  # a path only fairseq's PathManager reaches (a remote URI)
        named_file = len(files) == 1 and os.path.abspath(files[0]) == os.path.abspath(filename)
        if not (len(files) > 1 or (files and (plugin_on_command_line() or not named_file))):
            # one file of fairseq's own (the file named), or remote
            models, cfg, task = load([part_name(filename.replace(".pt", suffix + ".pt"), suffix)
                                      if suffix and files else filename], arg_overrides, task, strict,
                                     "" if suffix and files else suffix, num_shards)
        else:
            opened, part_state = part_for_evaluation(filename, arg_overrides)
            # fairseq checks that a file of the given name exists, then uses the state given
            models, cfg, task = load([opened.source(opened.every_file[0])], arg_overrides, task, strict, "", 1,
                                     part_state)
        ensemble.extend(models)
    return ensemble, cfg, task


def _named_checkpoint(cfg, last: str):
    """``(flag, name)``: the checkpoint fairseq-train's options ask to start
    from, and the flag that named it; ``(None, None)`` where fairseq resumes
    from ``last`` or starts from scratch."""
    if cfg.restore_file != "checkpoint_last.pt":
        return "--restore-file", cfg.restore_file
    if PathManager.exists(last):
        return None, None  # fairseq resumes from it
    if getattr(cfg, "continue_once", None) is not None:
        return "--continue-once", cfg.continue_once
    return "--finetune-from-model", cfg.finetune_from_model


def starting_checkpoint(cfg) -> Optional[str]:
    """The checkpoint fairseq-train's ``cfg.checkpoint`` makes it start from
    (``fairseq/checkpoint_utils.py``, ``load_checkpoint``): the save dir's
    ``checkpoint_last.pt`` where it exists (in parts or whole), else the one
    ``--restore-file``, ``--continue-once`` or ``--finetune-from-model``
    names; None where the run starts from scratch."""
    last = os.path.join(cfg.save_dir, "checkpoint_last.pt")
    if cfg.restore_file == "checkpoint_last.pt" and (existing_part_files(last) or PathManager.exists(last)):
        return last
    _, named = _named_checkpoint(cfg, last)
    return named if named is not None and existing_part_files(named) else None


def load_checkpoint(cfg, trainer, **passthrough_args):
    """fairseq's ``load_checkpoint`` (the start of fairseq-train), which for
    our models also loads ``--finetune-from-model`` at any model-parallel
    size (as ``--restore-file`` with every ``--reset-*`` flag, which loads
    each rank's part or builds it in memory), resumes every rank from a save
    whose renames a kill interrupted (the part of a rank only under its
    staged name: fairseq would start that rank alone from scratch), and
    stops when the checkpoint it is told to load does not exist (fairseq
    started from scratch, and saved over the save dir's ``checkpoint_last``).

    Raises:
        UsageError: ``--restore-file``, ``--continue-once`` (first launch)
            or ``--finetune-from-model`` (first launch) names no checkpoint;
            ``--finetune-from-model`` names a part, or lacks ``.pt`` at
            model-parallel size > 1.
    """
    load = original(checkpoint_utils, "load_checkpoint")
    if not is_our_model(trainer.get_model()):
        return load(cfg, trainer, **passthrough_args)
    last = os.path.join(cfg.save_dir, f"checkpoint_last{trainer.checkpoint_suffix}.pt")
    interrupted = os.path.join(cfg.save_dir, "checkpoint_last.pt")
    # on every rank alike (a part the manifest lists but that is gone is each rank's error, not only its owner's,
    # who would leave the others waiting for it in the next collective)
    saved = existing_part_files(interrupted) if cfg.restore_file == "checkpoint_last.pt" else []
    if cfg.restore_file == "checkpoint_last.pt" and not PathManager.exists(last) and saved:
        cfg = copy.deepcopy(cfg)
        cfg.restore_file, cfg.finetune_from_model = interrupted, None
        if getattr(cfg, "continue_once", None) is not None:
            cfg.continue_once = None
        return load(cfg, trainer, **passthrough_args)
    flag, named = _named_checkpoint(cfg, last)
    if named is not None and not (existing_part_files(named) or PathManager.exists(named)):
        raise UsageError(f"{flag} {named}: no such checkpoint, whole or in model parts (leave out {flag} "
                         f"to start from scratch)")
    path = cfg.finetune_from_model
    if path is None or flag != "--finetune-from-model" or any(
            (cfg.reset_optimizer, cfg.reset_lr_scheduler, cfg.reset_meters, cfg.reset_dataloader)):
        return load(cfg, trainer, **passthrough_args)  # fairseq refuses --finetune-from-model with the others
    size = parallel_state.get_tensor_model_parallel_world_size()
    if not path.endswith(".pt"):
        if size == 1:
            return load(cfg, trainer, **passthrough_args)
        raise UsageError(f"--finetune-from-model {path}: at model-parallel size {size} the name must end "
                         f"in .pt (fairseq names each rank's part by replacing it)")
    refuse_one_part_as("--finetune-from-model", path)
    logger.info(f"fine-tuning from {path}: optimizer, lr scheduler, meters and data loader start afresh")
    cfg = copy.deepcopy(cfg)
    cfg.finetune_from_model, cfg.restore_file = None, path
    cfg.reset_optimizer = cfg.reset_lr_scheduler = cfg.reset_meters = cfg.reset_dataloader = True
    return load(cfg, trainer, **passthrough_args)


def save_checkpoint(cfg, trainer, epoch_itr, val_loss):
    """fairseq's, or :func:`~fairseq_megatron.checkpoint.saving.save_checkpoint_of_model_parts` for our models."""
    if is_our_model(trainer.get_model()):
        return save_checkpoint_of_model_parts(cfg, trainer, epoch_itr, val_loss, checkpoint_utils.save_checkpoint)
    return original(checkpoint_utils, "save_checkpoint")(cfg, trainer, epoch_itr, val_loss)


def install() -> None:
    replace(checkpoint_utils, "load_checkpoint_to_cpu", load_checkpoint_to_cpu,
            "loads fairseq's checkpoints with torch's weights-only unpickler and their classes allowed (torch >= 2.6 "
            "refused them); anything else, and an unreadable file, one line")
    replace(checkpoint_utils, "load_model_ensemble_and_task", load_model_ensemble_and_task,
            "our checkpoints load at any model-parallel size; parts checked before any is read")
    replace(checkpoint_utils, "load_checkpoint", load_checkpoint,
            "fine-tuning from a checkpoint in parts; a checkpoint named but missing stops the run")
    replace(checkpoint_utils, "save_checkpoint", save_checkpoint,
            "part files keep the best N and are copied whole")
