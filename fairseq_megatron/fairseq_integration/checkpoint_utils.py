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
  (fairseq: torch's unpickling traceback). It also returns the state a
  :class:`~fairseq_megatron.fairseq_integration.trainer.CheckpointInMemory`
  name carries, and reads a
  :class:`~fairseq_megatron.checkpoint.reading.ReadThrough` name's file as
  it was opened.
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
  (:func:`save_checkpoint_of_model_parts`), whose ``-model_part-K`` suffix
  broke ``--keep-best-checkpoints`` ("could not convert string to float:
  'part-0.pt'"), and whose copies (``checkpoint_last``, ``checkpoint_best``)
  fairseq made in place, so that a run killed during a copy left a truncated
  checkpoint to resume from.

fairseq names a rank's part ``name.replace(".pt", suffix + ".pt")``, which
also rewrote a ".pt" inside a directory name (``runs/wiki.ptb/model.pt``
became ``runs/wiki-model_part-0.ptb/model-model_part-0.pt``): fairseq-train
then started from scratch and fairseq-eval-lm found no file.
:func:`part_name` undoes that for our checkpoints.
"""

import collections
import copy
import logging
import os
import re
import time
import traceback
from typing import Optional

import numpy as np
import torch.distributed as dist
from fairseq import checkpoint_utils
from fairseq.file_io import PathManager

from fairseq_megatron.checkpoint import commit, safe_loading
from fairseq_megatron.checkpoint.commit import manifest_path, remove_stale, staged_name, write_manifest
from fairseq_megatron.checkpoint.layout import CheckpointError
from fairseq_megatron.checkpoint.part_files import (
    all_files,
    can_be_memory_mapped,
    check_integrity,
    checkpoint_of_part,
    find_part_files,
    is_first_file,
    output_paths,
    write_error,
)
from fairseq_megatron.checkpoint.reading import OpenedSave, open_save, source_of
from fairseq_megatron.files import written_whole
from fairseq_megatron.errors import UsageError
from fairseq_megatron.fairseq_integration.patching import original, plugin_on_command_line, replace
from fairseq_megatron.fairseq_integration.trainer import CheckpointInMemory, is_our_model
from fairseq_megatron.parallel import parallel_state

logger = logging.getLogger(__name__)


def part_name(named_by_fairseq: str, suffix: str) -> str:
    """The part file fairseq meant by ``named_by_fairseq``, which it made with
    ``name.replace(".pt", suffix + ".pt")``: every ".pt" in ``name`` took the
    suffix, directories included. Names without that damage come back as
    they are."""
    if isinstance(named_by_fairseq, CheckpointInMemory):
        return named_by_fairseq
    name = named_by_fairseq.replace(suffix + ".pt", ".pt") if suffix else named_by_fairseq
    return name[: -len(".pt")] + suffix + ".pt" if suffix and name.endswith(".pt") else named_by_fairseq


# ------------------------------------------------------------------ reading


def _raised_by_torch_load(error: BaseException) -> bool:
    return any(frame.f_code.co_filename.endswith(os.path.join("torch", "serialization.py"))
               for frame, _ in traceback.walk_tb(error.__traceback__))


def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
    """fairseq's, without running code: the weights-only unpickler with the
    allowlist of :mod:`fairseq_megatron.checkpoint.safe_loading` (full
    pickles with ``FAIRSEQ_MEGATRON_TRUST_CHECKPOINTS=1``), the pickle's
    CRC-32 checked first; a ``CheckpointInMemory``'s state; a
    :class:`~fairseq_megatron.checkpoint.reading.ReadThrough`'s file as it
    was opened.

    Raises:
        UnsafeCheckpoint: the file holds an object outside the allowlist
            (one line naming its type; nothing of it was run).
        CheckpointError: the pickle fails its CRC-32; in a fairseq tool run
            with this plugin, the file cannot be read (not a torch file, cut
            short in the legacy format).
    """
    if isinstance(path, CheckpointInMemory):
        return path.state
    name, source = str(path), source_of(path)
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


def open_on_every_rank(path: str) -> OpenedSave:
    """:func:`~fairseq_megatron.checkpoint.reading.open_save` of checkpoint
    ``path`` on every rank of the run, the same save on all: each rank opens
    the files itself, and a training that saves the checkpoint meanwhile can
    give two ranks two saves (each rank would load its part of another), so
    the ranks compare what they opened and open again until they agree.

    Raises:
        FileNotFoundError / CheckpointError: as ``open_save``, on every rank
            (the message of the first rank that failed).
        ChangedWhileRead: the ranks opened different saves every time.
    """
    from fairseq_megatron.checkpoint.reading import ATTEMPTS, ChangedWhileRead

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    for attempt in range(ATTEMPTS):
        opened, error = None, None
        try:
            opened = open_save(path)
        except Exception as e:
            error = e
        if world == 1:
            if error is not None:
                raise error
            return opened
        found = [None] * world
        dist.all_gather_object(found, (None if opened is None else opened.identity(),
                                       None if error is None else str(error)))
        if error is not None:
            raise error
        failed = [said for _, said in found if said is not None]
        if failed:
            raise CheckpointError(failed[0])
        if len({identity for identity, _ in found}) == 1:
            return opened
        opened.close()
        time.sleep(0.01 * (attempt + 1))
    raise ChangedWhileRead(f"{path} was saved again each of the {ATTEMPTS} times the ranks opened it, each rank "
                           f"finding another save (a training saves it faster than it can be read): read it "
                           f"again, or read a copy")


def _existing_part_files(path: str) -> list:
    """The files of checkpoint ``path``, or none where no checkpoint has that name."""
    try:
        return find_part_files(path)
    except FileNotFoundError:
        return []


def _is_model_parallel_lm(state: dict) -> bool:
    """Whether checkpoint ``state`` holds one of our architectures."""
    from fairseq_megatron.checkpoint.resharding import config_value, model_config
    from fairseq_megatron.models.model_parallel_transformer_lm import is_model_parallel_arch

    config = model_config(state)
    return is_model_parallel_arch(config_value(config, "_name") or config_value(config, "arch"))


def _refuse_one_part_as(flag: str, path: str) -> None:
    """``--path ckpt/model-model_part-0.pt`` names one part, not the
    checkpoint (a common slip with the published Megatron-11b); loading it
    failed with errors about model-parallel sizes that did not say so, and
    ``--finetune-from-model`` loaded that one part on every rank.

    Raises:
        UsageError: ``path`` names one part file (or one pipeline stage's
            file) of a checkpoint in several files.
    """
    checkpoint = checkpoint_of_part(path)
    num_files = len(all_files(_existing_part_files(checkpoint))) if checkpoint else 0
    if num_files > 1:
        raise UsageError(f"{flag} {path} is one of {num_files} model part files: pass the checkpoint's name, "
                         f"{flag} {checkpoint} (fairseq adds -model_part-K for each rank)")


def _refuse_an_ensemble_as_one_path(path: str) -> None:
    """fairseq-generate and -interactive split ``--path a.pt:b.pt`` into an
    ensemble; fairseq-eval-lm and -validate load ``--path`` whole, and said
    "no checkpoint a.pt:b.pt" (with a part name made from the joined
    string) although both checkpoints exist.

    Raises:
        UsageError: ``path`` names no checkpoint, but each of its
            ``os.pathsep``-separated pieces does.
    """
    pieces = path.split(os.pathsep)
    if len(pieces) > 1 and not _existing_part_files(path) and all(map(_existing_part_files, pieces)):
        raise UsageError(f"--path {path} names {len(pieces)} checkpoints: this tool scores one model "
                         f"(fairseq-generate and fairseq-interactive take an ensemble as --path a.pt{os.pathsep}b.pt)")


def resharded_state(path: str, opened: OpenedSave, arg_overrides=None, with_ema: bool = False,
                    virtual: int = 1):
    """This rank's part of checkpoint ``path`` (saved at another
    model-parallel size, or in pipeline stages; ``opened``: its files,
    :func:`open_on_every_rank`), built in memory (with pipeline stages in
    this run, this rank's stage of it), in the form fairseq's
    ``load_checkpoint_to_cpu(files[0], arg_overrides)`` returns (overrides
    applied, old formats upgraded; the config records this size); None for a
    checkpoint of another architecture. The optimizer state, another size's,
    is dropped, and so are part 0's EMA weights (``with_ema``: this rank's
    part of them is built too, for fairseq-train ``--store-ema``) and RNG
    tracker states."""
    from fairseq_megatron.checkpoint.resharding import (
        resharded_model,
        set_model_parallel_size,
        split_stages,
        without_part_specific_state,
    )

    state = checkpoint_utils.load_checkpoint_to_cpu(opened.read_through(opened.every_file[0]), arg_overrides)
    if not _is_model_parallel_lm(state):
        return None
    rank, size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    stages, stage = (parallel_state.get_pipeline_model_parallel_world_size(),
                     parallel_state.get_pipeline_model_parallel_rank())
    files, saved_stages = opened.files, opened.stages
    saved = f"{len(files)} model part(s)" + (f" x {saved_stages} pipeline stages" if saved_stages > 1 else "")
    here = f"model-parallel size {size}" + (f" x {stages} pipeline stages" if stages > 1 else "")
    built = f"part {rank}" + (f" of stage {stage}" if stages > 1 else "")
    logger.info(f"{path}: {saved}, loaded at {here}: {built} resharded in memory")
    state["model"] = None  # free part 0 before building this rank's part
    state["model"], padded_vocab_size = resharded_model(path, rank, size, opened=opened)
    set_model_parallel_size(state, size, padded_vocab_size)
    state.pop("last_optimizer_state", None)
    had_ema = (state.get("extra_state") or {}).get("ema") is not None
    state["extra_state"] = without_part_specific_state(state.get("extra_state"))
    if with_ema and had_ema:
        state["extra_state"]["ema"], _ = resharded_model(path, rank, size, entry="ema", opened=opened)
    return split_stages(state, stages, virtual)[stage]


def _on_every_rank(step, raised_elsewhere) -> None:
    """Run ``step()`` on each rank of the model-parallel group (every tensor
    part of every pipeline stage of one model copy) and exchange
    the outcomes, so that no rank goes on, or waits in a collective, when
    another failed: a rank whose step failed raises its own error, the
    others ``raised_elsewhere(rank, message)`` of the first rank that
    failed. Without model parallelism, ``step()`` alone."""
    error = None
    try:
        step()
    except Exception as e:
        error = e
    group = parallel_state.get_model_parallel_group() if parallel_state.model_parallel_is_initialized() else None
    size = parallel_state.world_size(group) if group is not None else 1
    found = [None] * size
    if size > 1:
        dist.all_gather_object(found, None if error is None else str(error), group=group)
    if error is not None:
        raise error
    failed = [(rank, said) for rank, said in enumerate(found) if said is not None]
    if failed:
        raise raised_elsewhere(*failed[0])


def check_integrity_on_every_rank(path: str, name: Optional[str] = None) -> None:
    """:func:`check_integrity` of ``path`` (named ``name``), this rank's
    part: each rank of a model-parallel group reads only its own, and a
    corrupted part must stop every rank of the group (the others would wait
    for it in their first collective), so the ranks exchange what they found.

    Raises:
        CheckpointError: a part of the group failed its check, on every rank
            of the group (the message of that part).
    """
    _on_every_rank(lambda: check_integrity(path, name), lambda rank, said: CheckpointError(said))


def load_model_ensemble_and_task(filenames, arg_overrides=None, task=None, strict=True, suffix="", num_shards=1,
                                 state=None):
    """fairseq's, for our checkpoints at any model-parallel size: each
    rank's part is read, or built in memory when the checkpoint was saved at
    another size. Other checkpoints load as fairseq loads them.

    Raises:
        UsageError: a part's name given for the checkpoint; an ensemble in a
            tool that scores one model; a part cut short or missing (also the
            last parts, which leave what looks like a checkpoint of a smaller
            size); parts of two saves; a file read that fails its CRC-32
            check (see :func:`check_integrity`).
        FileNotFoundError: no checkpoint of that name, whole or in parts
            (an OSError, as fairseq's "Model file not found"); the message
            names the files looked for.
    """
    load = original(checkpoint_utils, "load_model_ensemble_and_task")
    if state is not None or num_shards != 1:
        return load(filenames, arg_overrides, task, strict, suffix, num_shards, state)
    size = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() \
        else 1
    ensemble, cfg = [], None
    for filename in filenames:
        _refuse_one_part_as("--path", filename)
        _refuse_an_ensemble_as_one_path(filename)
        try:
            files = find_part_files(filename)
        except FileNotFoundError:
            if not PathManager.exists(part_name(filename.replace(".pt", suffix + ".pt"), suffix)):
                raise  # naming the part files looked for; fairseq named one rank's part
            files = []  # a path only fairseq's PathManager reaches (a remote URI)
        if not (len(files) > 1 or (files and plugin_on_command_line())):  # one file of fairseq's own, or remote
            models, cfg, task = load([part_name(filename.replace(".pt", suffix + ".pt"), suffix)
                                      if suffix and files else filename], arg_overrides, task, strict,
                                     "" if suffix and files else suffix, num_shards)
            ensemble.extend(models)
            continue
        opened = open_on_every_rank(filename)  # one save, none cut short, before any rank loads a part
        files, first = opened.files, opened.every_file[0]
        if files[0] != filename and len(files) == size and (size == 1 or can_be_memory_mapped(opened.source(first))):
            from fairseq_megatron.checkpoint.resharding import check_part_count, read_checkpoint

            # the last parts or stages lost look like a checkpoint of this size
            check_part_count(filename, files, read_checkpoint(opened.read_through(first)), opened.stages)
        if len(files) != size or opened.stages > 1:
            part_state = resharded_state(filename, opened, arg_overrides)  # checks every part
        else:
            mine = files[parallel_state.get_tensor_model_parallel_rank() if len(files) > 1 else 0]
            check_integrity_on_every_rank(opened.source(mine), mine)
            part_state = None
        if part_state is None and len(files) != size:
            raise UsageError(f"{filename} does not hold a model-parallel transformer LM of fairseq_megatron: it "
                             f"loads only at the model-parallel size it was saved at, {len(files)}")
        if part_state is None:  # this size's own part
            mine = files[parallel_state.get_tensor_model_parallel_rank() if len(files) > 1 else 0]
            part_state = checkpoint_utils.load_checkpoint_to_cpu(opened.read_through(mine), arg_overrides)
        # fairseq checks that a file of the given name exists, then uses the state given
        models, cfg, task = load([opened.source(first)], arg_overrides, task, strict, "", 1, part_state)
        ensemble.extend(models)
    return ensemble, cfg, task


# ------------------------------------------------------------------ training


def _check_vocabulary(trainer, saved: Optional[int], symbols: Optional[int], path: str, size: int) -> None:
    """fairseq-train builds the model before it loads a checkpoint, padding
    the dictionary for this run's size; a checkpoint from another size keeps
    the vocabulary it was trained with (``saved`` rows in all parts, None
    when unknown), and fairseq then failed with "Cannot load model parameters
    ... ensure that the architectures match". With ``--padded-vocab-size``
    the rows agree for any dictionary up to that size, so the dictionary's own
    size is checked against the one the checkpoint records (``symbols``, None
    when unknown).

    Raises:
        UsageError: the rows differ (the message gives the flag to add), or
            the dictionaries do.
    """
    from fairseq_megatron.models.options import check_dictionary_size

    check_dictionary_size(trainer.task.source_dictionary.symbols, trainer.cfg.model.dictionary_size, symbols, path)
    built = trainer.get_model().decoder.embed_tokens.weight.size(0) * size
    if saved is not None and saved != built:
        raise UsageError(
            f"{path} has a vocabulary of {saved} rows (the dictionary padded for the model-parallel "
            f"size it was first trained at), this model {built}: add --padded-vocab-size {saved}"
        )


def _ema_from_the_weights(state: dict, path: str) -> dict:
    """fairseq-train ``--store-ema`` on from a checkpoint without EMA weights
    means to start the EMA from the weights it loads ("EMA is re-initialized
    from checkpoint"), but reads them after deleting them: ``KeyError:
    'model'`` (``fairseq/trainer.py``, ``load_checkpoint``). It now gets the
    weights as the EMA weights. Changes and returns ``state``."""
    extra_state = state.get("extra_state")
    if extra_state is not None and extra_state.get("ema") is None:
        logger.info(f"{path} holds no EMA weights: the EMA (--store-ema) starts from its weights")
        extra_state["ema"] = state["model"]
    return state


def checkpoint_for_rank(trainer, filename: str, reset_optimizer: bool) -> str:
    """What :meth:`MegatronTrainer.load_checkpoint` hands fairseq's: this
    rank's part file of the checkpoint fairseq named ``filename``, as a
    :class:`~fairseq_megatron.checkpoint.reading.ReadThrough` (the file as
    opened, under the name it has on disk: its staged name where a kill
    left it so), or a :class:`CheckpointInMemory` for it (a part built from
    the parts of another model-parallel size; EMA weights added for
    ``--store-ema``). Every rank opens the files of one save, the same on
    all, and checks that no part is cut short before any rank loads one;
    nothing is written.

    Raises:
        UsageError: another size without ``reset_optimizer`` (the message
            gives the resharding command); another size in the save dir this
            run saves into; vocabularies that differ; a checkpoint that is not
            of our models; a part missing or cut short.
    """
    from fairseq_megatron.checkpoint.resharding import (
        check_part_count,
        config_value,
        model_config,
        read_checkpoint,
        saved_vocabulary,
    )

    suffix = trainer.checkpoint_suffix + ".pt"
    if not filename.endswith(suffix):
        return filename
    path = filename[: -len(suffix)] + ".pt"
    size = parallel_state.get_tensor_model_parallel_world_size()
    try:
        opened = open_on_every_rank(path)  # one save, none cut short, before any rank loads a part
    except FileNotFoundError:
        return filename  # no checkpoint at all: fairseq starts from scratch
    files, saved_stages = opened.files, opened.stages
    store_ema = trainer.cfg.ema.store_ema
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    if len(files) == size and saved_stages == stages and filename in opened.every_file:
        mine = opened.read_through(filename)  # the name on disk: staged where a kill left it so
        check_integrity_on_every_rank(mine.source, filename)
        rows, symbols = saved_vocabulary(mine)
        _check_vocabulary(trainer, rows and rows * size, symbols, path, size)
        if not store_ema:
            return mine
        return CheckpointInMemory(mine, _ema_from_the_weights(checkpoint_utils.load_checkpoint_to_cpu(mine),
                                                              filename))
    first = opened.read_through(opened.every_file[0])
    check_part_count(path, files, read_checkpoint(first), saved_stages)  # parts or stages lost are not a layout
    save_dir = trainer.cfg.checkpoint.save_dir
    in_save_dir = (not trainer.cfg.checkpoint.no_save and os.path.basename(path).startswith("checkpoint")
                   and os.path.realpath(os.path.dirname(path)) == os.path.realpath(save_dir))
    # with --reset-optimizer the run starts from the weights; in the save dir it would save over them
    from_weights = (f"start a new run from its weights with --save-dir NEW_DIR --restore-file {path} "
                    f"--reset-optimizer" if in_save_dir else "start from its weights with --reset-optimizer "
                    "(as --finetune-from-model)")
    if not reset_optimizer and (saved_stages > 1 or stages > 1):
        raise UsageError(
            f"{path} was saved at model-parallel size {len(files)} with {saved_stages} pipeline stage(s), this run "
            f"has size {size} with {stages}: resume with --model-parallel-size {len(files)} "
            f"--pipeline-model-parallel-size {saved_stages}, or {from_weights}, which splits them in memory"
        )
    if not reset_optimizer:
        raise UsageError(
            f"{path} was saved at model-parallel size {len(files)}, this run has size {size}: resume with "
            f"--model-parallel-size {len(files)}, or reshard it with its optimizer state "
            f"(fairseq-megatron-reshard --input {path} --output NEW_DIR/checkpoint_last.pt --model-parallel-size "
            f"{size} --keep-optimizer) and train with --save-dir NEW_DIR, or {from_weights}, which reshards the "
            f"weights alone in memory"
        )
    if in_save_dir:
        raise UsageError(f"{path} is in --save-dir {save_dir}, where this run would save checkpoints of "
                         f"model-parallel size {size} under the same names: pass another --save-dir (with "
                         f"--restore-file {path})")
    rows, symbols = saved_vocabulary(first)
    _check_vocabulary(trainer, rows and rows * len(files), symbols, path, size)
    state = resharded_state(path, opened, with_ema=store_ema,
                            virtual=int(getattr(trainer.cfg.model, "virtual_pipeline_model_parallel_size", 1) or 1))
    if state is None:
        raise UsageError(f"{path} does not hold a model-parallel transformer LM of fairseq_megatron: "
                         f"it cannot be split into model parts")
    # rows unknown above for files saved by PyTorch < 1.6 (not memory-mapped); a middle stage has no embedding
    embedding = state["model"].get("decoder.embed_tokens.weight")
    if embedding is not None:
        _check_vocabulary(trainer, embedding.size(0) * size, config_value(model_config(state), "dictionary_size"),
                          path, size)
    return CheckpointInMemory(first, _ema_from_the_weights(state, path) if store_ema else state)


def load_checkpoint(cfg, trainer, **passthrough_args):
    """fairseq's ``load_checkpoint`` (the start of fairseq-train), which for
    our models also loads ``--finetune-from-model`` at any model-parallel
    size (as ``--restore-file`` with every ``--reset-*`` flag, which loads
    each rank's part or builds it in memory), and stops when the checkpoint
    it is told to load does not exist (fairseq started from scratch, and
    saved over the save dir's ``checkpoint_last``).

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
    if cfg.restore_file == "checkpoint_last.pt" and not PathManager.exists(last) and _existing_part_files(
            os.path.join(cfg.save_dir, "checkpoint_last.pt")):
        # this rank's part only under its staged name (a kill interrupted the save's renames): fairseq would
        # take this for a first launch on this rank alone; every rank resumes from the save the manifest records
        cfg = copy.deepcopy(cfg)
        cfg.restore_file = os.path.join(cfg.save_dir, "checkpoint_last.pt")
        cfg.finetune_from_model = None
        if getattr(cfg, "continue_once", None) is not None:
            cfg.continue_once = None
        return load(cfg, trainer, **passthrough_args)
    if cfg.restore_file != "checkpoint_last.pt":
        flag, named = "--restore-file", cfg.restore_file
    elif PathManager.exists(last):
        flag, named = None, None  # fairseq resumes from it
    elif getattr(cfg, "continue_once", None) is not None:
        flag, named = "--continue-once", cfg.continue_once
    else:
        flag, named = "--finetune-from-model", cfg.finetune_from_model
    if named is not None and not (_existing_part_files(named) or PathManager.exists(named)):
        raise UsageError(f"{flag} {named}: no such checkpoint, whole or in model parts (leave out {flag} "
                         f"to start from scratch)")
    path = cfg.finetune_from_model
    if (
        path is None
        or cfg.restore_file != "checkpoint_last.pt"  # fairseq refuses both
        or any((cfg.reset_optimizer, cfg.reset_lr_scheduler, cfg.reset_meters, cfg.reset_dataloader))
        or getattr(cfg, "continue_once", None) is not None
        or PathManager.exists(last)
    ):
        return load(cfg, trainer, **passthrough_args)
    size = parallel_state.get_tensor_model_parallel_world_size()
    if not path.endswith(".pt"):
        if size == 1:
            return load(cfg, trainer, **passthrough_args)
        raise UsageError(f"--finetune-from-model {path}: at model-parallel size {size} the name must end "
                         f"in .pt (fairseq names each rank's part by replacing it)")
    _refuse_one_part_as("--finetune-from-model", path)
    logger.info(f"fine-tuning from {path}: optimizer, lr scheduler, meters and data loader start afresh")
    cfg = copy.deepcopy(cfg)
    cfg.finetune_from_model, cfg.restore_file = None, path
    cfg.reset_optimizer = cfg.reset_lr_scheduler = cfg.reset_meters = cfg.reset_dataloader = True
    return load(cfg, trainer, **passthrough_args)


# ------------------------------------------------------------------ saving


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


def _remove(paths) -> None:
    """Remove this rank's part files ``paths`` (old checkpoints fairseq's
    --keep-* options drop), and with part 0 its checkpoint's manifest."""
    for path in paths:
        if os.path.lexists(path):
            os.remove(path)
        elif PathManager.exists(path):
            PathManager.rm(path)
        checkpoint = checkpoint_of_part(path)
        if checkpoint is not None and is_first_file(path) and os.path.lexists(manifest_path(checkpoint)):
            os.remove(manifest_path(checkpoint))


def _failed_on_a_rank(what: str):
    """What :func:`_on_every_rank` raises where another rank failed at ``what``."""
    return lambda rank, said: CheckpointError(f"{what} failed on model-parallel rank {rank}: {said}")


def _save_committed(write, part: str, token: str, updates: int) -> None:
    """Write this rank's part file ``part`` of a save of model parts as a
    commit (:mod:`fairseq_megatron.checkpoint.commit`): ``write(path)``
    writes it under its staged name on every rank; model-parallel rank 0
    then writes the manifest; then each rank renames its part. A failure
    on any rank before the commit point stops every rank, the staged files
    removed and the previous save left under the name."""
    staged = staged_name(part, token)
    checkpoint = checkpoint_of_part(part)
    layout = parallel_state.get_parallel_layout()
    first = parallel_state.rank(parallel_state.get_model_parallel_group()) == 0
    try:
        _on_every_rank(lambda: write(staged), _failed_on_a_rank(f"saving {checkpoint}"))
        _on_every_rank(lambda: write_manifest(checkpoint, token, updates,
                                              output_paths(checkpoint, layout.tensor, layout.pipeline))
                       if first else None,
                       _failed_on_a_rank(f"committing the save of {checkpoint}"))
    except BaseException:
        if os.path.lexists(staged):
            os.remove(staged)
        raise
    os.replace(staged, part)
    remove_stale(part, token)


def save_checkpoint_of_model_parts(cfg, trainer, epoch_itr, val_loss, best_holder) -> Optional[str]:
    """fairseq's ``checkpoint_utils.save_checkpoint`` for our models: the
    same files under the same conditions (the epoch and interval
    checkpoints, ``checkpoint_best``, the best-N files of
    ``--keep-best-checkpoints``, ``checkpoint_last``) and the same removals,
    for this rank's part (``-model_part-K`` files). Where it differs: the
    score of a kept best-N file is read with the file-name pattern's group
    (fairseq split the name at its last "_", which the part suffix holds), and
    the copies of the file written first are written whole (a temporary name
    in the same directory, then a rename; fairseq copied in place), and at
    model-parallel size > 1 every file is a commit of all its parts
    (:func:`_save_committed`).
    ``best_holder``: the function object fairseq keeps the best score on
    (``save_checkpoint.best``, read by fairseq-train and ``load_checkpoint``)."""
    from fairseq import meters
    from fairseq.data import data_utils

    if trainer.data_parallel_rank == 0:
        os.makedirs(cfg.save_dir, exist_ok=True)
    prev_best = getattr(best_holder, "best", val_loss)
    if val_loss is not None:
        best_holder.best = (max if cfg.maximize_best_checkpoint_metric else min)(val_loss, prev_best)
    if cfg.no_save:
        return None
    trainer.consolidate_optimizer()
    if not trainer.should_save_checkpoint_on_current_rank:
        if trainer.always_call_state_dict_during_save_checkpoint:
            trainer.state_dict()
        return None

    write_timer = meters.StopwatchMeter()
    write_timer.start()
    epoch, end_of_epoch, updates = epoch_itr.epoch, epoch_itr.end_of_epoch(), trainer.get_num_updates()
    logger.info(f"Preparing to save checkpoint for epoch {epoch} @ {updates} updates")

    def is_better(a, b):
        return a >= b if cfg.maximize_best_checkpoint_metric else a <= b

    suffix = trainer.checkpoint_suffix
    metric = cfg.best_checkpoint_metric
    best_pattern = rf"checkpoint\.best_{metric}_(\d+\.?\d*){re.escape(suffix)}\.pt"
    conds = collections.OrderedDict()
    conds[f"checkpoint{epoch}{suffix}.pt"] = (end_of_epoch and not cfg.no_epoch_checkpoints
                                              and epoch % cfg.save_interval == 0)
    conds[f"checkpoint_{epoch}_{updates}{suffix}.pt"] = (not end_of_epoch and cfg.save_interval_updates > 0
                                                        and updates % cfg.save_interval_updates == 0)
    conds[f"checkpoint_best{suffix}.pt"] = val_loss is not None and (
        not hasattr(best_holder, "best") or is_better(val_loss, best_holder.best))
    if val_loss is not None and cfg.keep_best_checkpoints > 0:
        worst_best = getattr(best_holder, "best", None)
        kept = checkpoint_utils.checkpoint_paths(cfg.save_dir, pattern=best_pattern, keep_match=True)
        if kept:  # by score, descending
            worst_best = kept[-1][1] if cfg.maximize_best_checkpoint_metric else kept[0][1]
        with data_utils.numpy_seed(epoch, updates, val_loss):
            digit = np.random.randint(0, cfg.keep_best_checkpoints)  # breaks ties, as fairseq
        conds[f"checkpoint.best_{metric}_{val_loss:.3f}{digit}{suffix}.pt"] = (
            worst_best is None or is_better(val_loss, worst_best))
    conds[f"checkpoint_last{suffix}.pt"] = not cfg.no_last_checkpoints

    extra_state = {"train_iterator": epoch_itr.state_dict(), "val_loss": val_loss}
    if hasattr(trainer.task, "get_checkpoint_dict"):
        extra_state.update(trainer.task.get_checkpoint_dict())
    if hasattr(best_holder, "best"):
        extra_state["best"] = best_holder.best

    checkpoints = [os.path.join(cfg.save_dir, name) for name, cond in conds.items() if cond]
    saved = None
    layout = parallel_state.get_parallel_layout()
    committed = layout.tensor * layout.pipeline > 1 and "://" not in cfg.save_dir and not cfg.write_checkpoints_asynchronously
    if checkpoints and committed:  # every file a commit of all parts (see _save_committed)
        token = [commit.new_token()]  # model-parallel rank 0's, sent to the others
        group = parallel_state.get_model_parallel_group()
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
        extra_state["save"] = {"token": token[0], "updates": updates}
        _save_committed(lambda staged: trainer.save_checkpoint(staged, extra_state), checkpoints[0], token[0],
                        updates)
        for other in checkpoints[1:]:
            _save_committed(lambda staged: copy_whole(checkpoints[0], staged), other, token[0], updates)
    elif checkpoints:
        saved = trainer.save_checkpoint(checkpoints[0], extra_state)
        for other in checkpoints[1:]:
            if cfg.write_checkpoints_asynchronously:
                logger.warning(f"not copying {checkpoints[0]} to {other}: checkpoints are written asynchronously")
            elif "://" in other:  # not a local path: fairseq's PathManager
                assert PathManager.copy(checkpoints[0], other, overwrite=True), f"Failed to copy to {other}"
            else:
                copy_whole(checkpoints[0], other)
    if checkpoints:
        write_timer.stop()
        logger.info(f"Saved checkpoint {checkpoints[0]} (epoch {epoch} @ {updates} updates, score {val_loss}) "
                    f"(writing took {write_timer.sum} seconds)")

    if not end_of_epoch and cfg.keep_interval_updates > 0:
        interval = rf"checkpoint_\d+_(\d+){re.escape(suffix)}\.pt"
        if cfg.keep_interval_updates_pattern == -1:
            old = checkpoint_utils.checkpoint_paths(cfg.save_dir, pattern=interval)
        else:
            old = [path for path, n in checkpoint_utils.checkpoint_paths(cfg.save_dir, pattern=interval,
                                                                         keep_match=True)
                   if n % cfg.keep_interval_updates_pattern != 0]
        _remove(old[cfg.keep_interval_updates:])
    if cfg.keep_last_epochs > 0:
        old = checkpoint_utils.checkpoint_paths(cfg.save_dir, pattern=rf"checkpoint(\d+){re.escape(suffix)}\.pt")
        _remove(old[cfg.keep_last_epochs:])
    if cfg.keep_best_checkpoints > 0:
        ranked = checkpoint_utils.checkpoint_paths(cfg.save_dir, pattern=best_pattern)  # by score, descending
        if not cfg.maximize_best_checkpoint_metric:
            ranked = ranked[::-1]
        _remove(ranked[cfg.keep_best_checkpoints:])
    return saved


def save_checkpoint(cfg, trainer, epoch_itr, val_loss):
    """fairseq's, or :func:`save_checkpoint_of_model_parts` for our models."""
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
