"""Checkpoints saved at another model-parallel size than the run's: fairseq's
tools and fairseq-train build each rank's part in memory from the part
files that exist, after checking them for truncation (steps 13 and 15 of
:mod:`fairseq_megatron.fairseq_integration`; the resharding itself is
:mod:`fairseq_megatron.checkpoint.resharding`).

13. :func:`checkpoints_at_another_model_parallel_size` -- fairseq loads
   only the file of its own model-parallel size (``model.pt`` at size 1,
   ``model-model_part-K.pt`` above), so a checkpoint saved at another size
   was "Model file not found". fairseq-eval-lm, fairseq-generate,
   fairseq-interactive and the hub interface now build each rank's part in
   memory from the parts that exist (the 8 published Megatron-11b parts on
   one GPU, say; :func:`fairseq_megatron.checkpoint.resharding.resharded_model`).
   Every rank checks that no part file is cut short before any rank loads
   one: a truncated part made its rank fail inside torch.load while the
   others reported a lost connection. fairseq-eval-lm and -validate load
   ``--path`` whole: two checkpoints joined as ``a.pt:b.pt`` (an ensemble,
   for fairseq-generate) were "no checkpoint a.pt:b.pt"; that is now one
   line saying these tools score one model.

15. :func:`training_from_checkpoints_at_another_size` -- fairseq-train
   resuming in a save dir whose checkpoint has another size silently started
   from scratch; it now stops and says how to reshard (with the optimizer
   state: ``fairseq-megatron-reshard --keep-optimizer``). With
   ``--reset-optimizer`` the weights are resharded in memory instead, unless
   the run would save its checkpoints beside them in the same save dir (one
   name would then hold two sizes). ``--finetune-from-model CKPT.pt`` looked for the file CKPT.pt alone, so a
   checkpoint in parts "does not exist", one file went whole into every
   rank, and a part's name (``CKPT-model_part-0.pt``) trained every rank on
   part 0's weights without a word; it now loads each rank's part, or builds
   it in memory, from a checkpoint saved at any size, and refuses a part's
   name. A checkpoint whose vocabulary rows differ from those fairseq-train
   built (saved at a size that padded the dictionary differently) stops with
   the ``--padded-vocab-size`` to pass; fairseq said "Cannot load model
   parameters". Every rank checks the part files for truncation first.
   A ``--restore-file`` (or, on a first launch, ``--continue-once``) that
   names no checkpoint, or a ``--finetune-from-model`` directory, made
   fairseq train from scratch and save over the save dir's
   ``checkpoint_last``; it now stops the run. With ``--store-ema`` the EMA
   weights of a checkpoint of another size are resharded in memory with the
   weights (every rank got part 0's: a size mismatch), and a checkpoint
   without EMA weights starts the EMA from its weights (fairseq meant to,
   but read them after deleting them: ``KeyError: 'model'``).
"""

import contextlib
import copy
import functools
import logging
import os
from typing import Optional


from fairseq_megatron.fairseq_integration.checkpoint_files import part_name

logger = logging.getLogger(__name__)


def _is_model_parallel_lm(state: dict) -> bool:
    """Whether checkpoint ``state`` holds one of our architectures."""
    from fairseq_megatron.checkpoint.resharding import config_value, model_config
    from fairseq_megatron.models.model_parallel_transformer_lm import is_model_parallel_arch

    config = model_config(state)
    return is_model_parallel_arch(config_value(config, "_name") or config_value(config, "arch"))


def _existing_part_files(path: str) -> list:
    """The files of checkpoint ``path`` (see
    :func:`fairseq_megatron.checkpoint.part_files.find_part_files`), or none
    where no checkpoint has that name."""
    from fairseq_megatron.checkpoint.part_files import find_part_files

    try:
        return find_part_files(path)
    except FileNotFoundError:
        return []


def _refuse_one_part_as(flag: str, path: str) -> None:
    """``--path ckpt/model-model_part-0.pt`` names one part, not the
    checkpoint (a common slip with the published Megatron-11b); loading it
    failed with errors about model-parallel sizes that did not say so, and
    ``--finetune-from-model`` loaded that one part on every rank.

    Raises:
        UsageError: ``path`` names one part file of a checkpoint in parts.
    """
    from fairseq_megatron.checkpoint.part_files import checkpoint_of_part
    from fairseq_megatron.errors import UsageError

    checkpoint = checkpoint_of_part(path)
    num_parts = len(_existing_part_files(checkpoint)) if checkpoint else 0
    if num_parts > 1:
        raise UsageError(f"{flag} {path} is one of {num_parts} model part files: pass the checkpoint's name, "
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
    from fairseq_megatron.errors import UsageError

    pieces = path.split(os.pathsep)
    if len(pieces) > 1 and not _existing_part_files(path) and all(map(_existing_part_files, pieces)):
        raise UsageError(f"--path {path} names {len(pieces)} checkpoints: this tool scores one model "
                         f"(fairseq-generate and fairseq-interactive take an ensemble as --path a.pt{os.pathsep}b.pt)")


def _resharded_state(path: str, files: list, arg_overrides=None, with_ema: bool = False):
    """This rank's part of checkpoint ``path`` (saved at another
    model-parallel size in ``files``), built in memory, in the form fairseq's
    ``load_checkpoint_to_cpu(files[0], arg_overrides)`` returns (overrides
    applied, old formats upgraded; the config records this size); None for a
    checkpoint of another architecture. The optimizer state, another size's,
    is dropped, and so are part 0's EMA weights (``with_ema``: this rank's
    part of them is built too, for fairseq-train ``--store-ema``) and RNG
    tracker states."""
    from fairseq import checkpoint_utils

    from fairseq_megatron.parallel import parallel_state
    from fairseq_megatron.checkpoint.resharding import (
        resharded_model,
        set_model_parallel_size,
        without_part_specific_state,
    )

    state = checkpoint_utils.load_checkpoint_to_cpu(files[0], arg_overrides)
    if not _is_model_parallel_lm(state):
        return None
    rank, size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    logger.info(f"{path}: {len(files)} model part(s), loaded at model-parallel size {size}: "
                f"part {rank} resharded in memory")
    state["model"] = None  # free part 0 before building this rank's part
    state["model"], padded_vocab_size = resharded_model(path, rank, size)
    set_model_parallel_size(state, size, padded_vocab_size)
    state.pop("last_optimizer_state", None)
    had_ema = (state.get("extra_state") or {}).get("ema") is not None
    state["extra_state"] = without_part_specific_state(state.get("extra_state"))
    if with_ema and had_ema:
        state["extra_state"]["ema"], _ = resharded_model(path, rank, size, entry="ema")
    return state


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


def checkpoints_at_another_model_parallel_size() -> None:
    from fairseq import checkpoint_utils
    from fairseq.file_io import PathManager

    from fairseq_megatron.parallel import parallel_state
    from fairseq_megatron.checkpoint.part_files import check_complete, find_part_files

    original_load = checkpoint_utils.load_model_ensemble_and_task

    def needs_resharding(path: str, files: list) -> bool:
        """Whether ``files`` hold checkpoint ``path`` at another size than
        this run's (fairseq then found no file, or the wrong one)."""
        size = parallel_state.get_tensor_model_parallel_world_size()
        return bool(files) and len(files) != size and not (size == 1 and PathManager.exists(path))

    @functools.wraps(original_load)
    def load_model_ensemble_and_task(filenames, arg_overrides=None, task=None, strict=True, suffix="",
                                     num_shards=1, state=None):
        if state is not None or num_shards != 1:
            return original_load(filenames, arg_overrides, task, strict, suffix, num_shards, state)
        ensemble, cfg = [], None
        for filename in filenames:
            _refuse_one_part_as("--path", filename)
            _refuse_an_ensemble_as_one_path(filename)
            try:
                files = find_part_files(filename)
            except FileNotFoundError:
                if PathManager.exists(part_name(filename.replace(".pt", suffix + ".pt"), suffix)):
                    files = []  # a file that only fairseq's PathManager reaches (a remote URI)
                else:
                    raise  # naming the part files looked for too; fairseq named one rank's part
            check_complete(files)  # on every rank, before any rank loads a part
            part_state = _resharded_state(filename, files, arg_overrides) if needs_resharding(filename, files) else None
            if part_state is None:
                models, cfg, task = original_load([filename], arg_overrides, task, strict, suffix, num_shards)
            else:
                # fairseq checks that a file of the given name exists, then uses the state given.
                models, cfg, task = original_load([files[0]], arg_overrides, task, strict, "", 1, part_state)
            ensemble.extend(models)
        return ensemble, cfg, task

    checkpoint_utils.load_model_ensemble_and_task = load_model_ensemble_and_task


@contextlib.contextmanager
def _checkpoint_read_as(filename: str, build_state):
    """Within this context fairseq's ``load_checkpoint_to_cpu(filename)``
    returns ``build_state()`` instead of reading the file: only on the ranks
    where fairseq reads (the trainer reads on data-parallel rank 0 and
    broadcasts to the others), and once."""
    from fairseq import checkpoint_utils

    original = checkpoint_utils.load_checkpoint_to_cpu

    @functools.wraps(original)
    def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
        if path != filename:
            return original(path, arg_overrides, load_on_all_ranks)
        checkpoint_utils.load_checkpoint_to_cpu = original  # build_state reads through it
        return build_state()

    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu
    try:
        yield
    finally:
        checkpoint_utils.load_checkpoint_to_cpu = original


def training_from_checkpoints_at_another_size() -> None:
    from fairseq import checkpoint_utils
    from fairseq.file_io import PathManager
    from fairseq.trainer import Trainer

    from fairseq_megatron.parallel import parallel_state
    from fairseq_megatron.checkpoint.part_files import check_complete, find_part_files
    from fairseq_megatron.checkpoint.resharding import (
        check_part_count,
        config_value,
        model_config,
        saved_vocabulary,
    )
    from fairseq_megatron.errors import UsageError
    from fairseq_megatron.models.model_parallel_transformer_lm import (
        ModelParallelTransformerLanguageModel,
        check_dictionary_size,
    )

    def check_vocabulary(trainer, saved: Optional[int], symbols: Optional[int], path: str, size: int) -> None:
        """fairseq-train builds the model before it loads a checkpoint, padding
        the dictionary for this run's size; a checkpoint from another size
        keeps the vocabulary it was trained with (``saved`` rows in all
        parts, None when unknown), and fairseq then failed with "Cannot load
        model parameters ... ensure that the architectures match". With
        ``--padded-vocab-size`` the rows agree for any dictionary up to that
        size, so the dictionary's own size is checked against the one the
        checkpoint records (``symbols``, None when unknown).

        Raises:
            UsageError: the rows differ (the message gives the flag to add),
                or the dictionaries do.
        """
        check_dictionary_size(trainer.task.source_dictionary.symbols, trainer.cfg.model.dictionary_size,
                              symbols, path)
        built = trainer.get_model().decoder.embed_tokens.weight.size(0) * size
        if saved is not None and saved != built:
            raise UsageError(
                f"{path} has a vocabulary of {saved} rows (the dictionary padded for the model-parallel "
                f"size it was first trained at), this model {built}: add --padded-vocab-size {saved}"
            )

    original_resume = Trainer.load_checkpoint

    @functools.wraps(original_resume)
    def load_checkpoint(self, filename, reset_optimizer=False, *args, **kwargs):
        def load(name):
            return original_resume(self, name, reset_optimizer, *args, **kwargs)

        model, suffix = self.get_model(), self.checkpoint_suffix + ".pt"
        if not (isinstance(model, ModelParallelTransformerLanguageModel) and filename.endswith(suffix)):
            return load(filename)
        path = filename[: -len(suffix)] + ".pt"
        size = parallel_state.get_tensor_model_parallel_world_size()
        try:
            files = find_part_files(path)
        except FileNotFoundError:
            return load(filename)  # no checkpoint at all: fairseq starts from scratch
        check_complete(files)  # each rank checks every part before any rank loads one
        store_ema = self.cfg.ema.store_ema
        if len(files) == size and PathManager.isfile(filename):
            rows, symbols = saved_vocabulary(filename)
            check_vocabulary(self, rows and rows * size, symbols, path, size)
            if not store_ema:
                return load(filename)
            with _checkpoint_read_as(filename, lambda: _ema_from_the_weights(
                    checkpoint_utils.load_checkpoint_to_cpu(filename), filename)):
                return load(filename)
        check_part_count(path, files)  # parts lost are not another size
        if not reset_optimizer:
            raise UsageError(
                f"{path} was saved at model-parallel size {len(files)}, this run has size {size}: resume with "
                f"--model-parallel-size {len(files)}, or reshard it with its optimizer state "
                f"(fairseq-megatron-reshard --input {path} --output NEW.pt --model-parallel-size {size} "
                f"--keep-optimizer) and train with --restore-file NEW.pt; with --reset-optimizer (as "
                f"--finetune-from-model) the weights alone are resharded in memory"
            )
        save_dir = self.cfg.checkpoint.save_dir
        if (not self.cfg.checkpoint.no_save and os.path.basename(path).startswith("checkpoint")
                and os.path.realpath(os.path.dirname(path)) == os.path.realpath(save_dir)):
            raise UsageError(f"{path} is in --save-dir {save_dir}, where this run would save checkpoints of "
                             f"model-parallel size {size} under the same names: pass another --save-dir")
        rows, symbols = saved_vocabulary(files[0])
        check_vocabulary(self, rows and rows * len(files), symbols, path, size)

        def this_ranks_part():
            state = _resharded_state(path, files, with_ema=store_ema)
            if state is None:
                raise UsageError(f"{path} does not hold a model-parallel transformer LM of fairseq_megatron: "
                                 f"it cannot be split into model parts")
            # rows unknown above for files saved by PyTorch < 1.6 (not memory-mapped)
            check_vocabulary(self, state["model"]["decoder.embed_tokens.weight"].size(0) * size,
                             config_value(model_config(state), "dictionary_size"), path, size)
            return _ema_from_the_weights(state, path) if store_ema else state

        with _checkpoint_read_as(files[0], this_ranks_part):  # fairseq logs the name files[0]
            return load(files[0])

    Trainer.load_checkpoint = load_checkpoint

    original_start = checkpoint_utils.load_checkpoint

    @functools.wraps(original_start)
    def load_checkpoint_or_pretrained_model(cfg, trainer, **passthrough_args):
        """fairseq's ``--finetune-from-model PATH`` on a first launch loads
        the file PATH itself into every rank: a checkpoint in parts was
        "does not exist", and one file went whole into each part. It is
        fairseq's ``--restore-file PATH`` with every ``--reset-*`` flag, and
        that loads each rank's part, or builds it in memory (above).

        The checkpoint that fairseq would load, named by ``--restore-file``
        or, on a first launch, by ``--continue-once`` or
        ``--finetune-from-model``, must exist, whole or in parts: fairseq
        started from scratch without it (and saved over the checkpoints of
        ``--save-dir``), except for a missing ``--finetune-from-model``
        file, which was a traceback."""
        ours = isinstance(trainer.get_model(), ModelParallelTransformerLanguageModel)
        last = os.path.join(cfg.save_dir, f"checkpoint_last{trainer.checkpoint_suffix}.pt")
        if cfg.restore_file != "checkpoint_last.pt":
            flag, named = "--restore-file", cfg.restore_file
        elif PathManager.exists(last):
            flag, named = None, None  # fairseq resumes from it
        elif getattr(cfg, "continue_once", None) is not None:
            flag, named = "--continue-once", cfg.continue_once
        else:
            flag, named = "--finetune-from-model", cfg.finetune_from_model
        if ours and named is not None and not (_existing_part_files(named) or PathManager.exists(named)):
            raise UsageError(f"{flag} {named}: no such checkpoint, whole or in model parts (leave out {flag} "
                             f"to start from scratch)")
        path = cfg.finetune_from_model
        if (
            path is None
            or not ours
            or cfg.restore_file != "checkpoint_last.pt"  # fairseq refuses both
            or any((cfg.reset_optimizer, cfg.reset_lr_scheduler, cfg.reset_meters, cfg.reset_dataloader))
            or getattr(cfg, "continue_once", None) is not None
            or PathManager.exists(last)
        ):
            return original_start(cfg, trainer, **passthrough_args)
        size = parallel_state.get_tensor_model_parallel_world_size()
        if not path.endswith(".pt"):
            if size == 1:
                return original_start(cfg, trainer, **passthrough_args)
            raise UsageError(f"--finetune-from-model {path}: at model-parallel size {size} the name must end "
                             f"in .pt (fairseq names each rank's part by replacing it)")
        _refuse_one_part_as("--finetune-from-model", path)
        logger.info(f"fine-tuning from {path}: optimizer, lr scheduler, meters and data loader start afresh")
        cfg = copy.deepcopy(cfg)
        cfg.finetune_from_model, cfg.restore_file = None, path
        cfg.reset_optimizer = cfg.reset_lr_scheduler = cfg.reset_meters = cfg.reset_dataloader = True
        return original_start(cfg, trainer, **passthrough_args)

    checkpoint_utils.load_checkpoint = load_checkpoint_or_pretrained_model
