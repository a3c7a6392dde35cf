"""What each rank loads of a checkpoint saved at any layout: its own part
file, or its part built in memory from the parts that exist.

Every rank opens the files of one save, the same on all, and checks that
none is cut short before any rank loads a part (:func:`open_on_every_rank`;
nothing is written: :mod:`.reading`). Then:

- for evaluation (fairseq-eval-lm, -validate, -generate, -interactive, the
  hub): :func:`part_for_evaluation`, this rank's part of the model, read or
  resharded in memory (:func:`resharded_state`: the 8 published
  Megatron-11b parts on one GPU, say);
- for training (``MegatronTrainer.load_checkpoint``): :func:`part_for_training`,
  the same at this run's layout, refusing another layout unless the
  optimizer starts afresh, and checking the vocabulary the model was built
  with; it returns a
  :class:`~fairseq_megatron.checkpoint.reading.PreparedCheckpoint` for
  fairseq's loader.

``fairseq_integration/checkpoint_utils.py`` adapts these to fairseq's
functions.
"""

import logging
import os
import time
from typing import Callable, List, Optional

import torch.distributed as dist
from fairseq import checkpoint_utils

from fairseq_megatron.checkpoint.layout import CheckpointError
from fairseq_megatron.checkpoint.integrity import check_integrity
from fairseq_megatron.checkpoint.part_files import all_files, can_be_memory_mapped, find_part_files
from fairseq_megatron.checkpoint.names import checkpoint_of_part
from fairseq_megatron.checkpoint.reading import OpenedSave, PreparedCheckpoint, open_save
from fairseq_megatron.errors import UsageError
from fairseq_megatron.parallel import parallel_state

logger = logging.getLogger(__name__)


def on_every_rank(step: Callable[[], object], raised_elsewhere: Callable[[int, str], Exception], group=None) -> None:
    """Run ``step()`` on each rank of ``group`` (default: the model-parallel
    group, every tensor part of every pipeline stage of one model copy) and
    exchange the outcomes, so that no rank goes on, or waits in a
    collective, when another failed: a rank whose step failed raises its own
    error, the others ``raised_elsewhere(rank, message)`` of the first rank
    that failed. In a group of one, ``step()`` alone."""
    error = None
    try:
        step()
    except Exception as e:
        error = e
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_model_parallel_group()
    size = parallel_state.world_size(group)
    found = [None] * size
    if size > 1:
        dist.all_gather_object(found, None if error is None else str(error), group=group)
    if error is not None:
        raise error
    failed = [(rank, said) for rank, said in enumerate(found) if said is not None]
    if failed:
        raise raised_elsewhere(*failed[0])


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


def existing_part_files(path: str) -> list:
    """The files of checkpoint ``path``, or none where no checkpoint has that name."""
    try:
        return find_part_files(path)
    except FileNotFoundError:
        return []


def recorded_model_config(path: str):
    """The model config checkpoint ``path`` records (of its first file, read
    through a memory map without its tensors), as a new Namespace, with the
    padded vocabulary counted from the embedding's rows where the config
    does not record it (the published Megatron-11b's); None where no
    checkpoint has that name or it is not one of our models'.

    Raises:
        CheckpointError: the file cannot be read.
    """
    from fairseq_megatron.checkpoint.layout import arguments_of
    from fairseq_megatron.checkpoint.resharding import EMBED_KEYS, model_config, read_checkpoint

    try:
        opened = open_save(path)
    except FileNotFoundError:
        return None
    try:
        state = read_checkpoint(opened.read_through(opened.every_file[0]))
    finally:
        opened.close()
    if not is_model_parallel_lm(state):
        return None
    config = arguments_of(model_config(state))
    embedding = state["model"].get(EMBED_KEYS[0])
    if getattr(config, "padded_vocab_size", None) is None and embedding is not None:
        config.padded_vocab_size = embedding.size(0) * len(opened.files)
    return config


def is_model_parallel_lm(state: dict) -> bool:
    """Whether checkpoint ``state`` holds one of our architectures."""
    from fairseq_megatron.checkpoint.resharding import config_value, model_config
    from fairseq_megatron.models.model_parallel_transformer_lm import is_model_parallel_arch

    config = model_config(state)
    return is_model_parallel_arch(config_value(config, "_name") or config_value(config, "arch"))


def refuse_one_part_as(flag: str, path: str) -> None:
    """``--path ckpt/model-model_part-0.pt`` names one part, not the
    checkpoint (a common slip with the published Megatron-11b); loading it
    failed with errors about model-parallel sizes that did not say so, and
    ``--finetune-from-model`` loaded that one part on every rank.

    Raises:
        UsageError: ``path`` names one part file (or one pipeline stage's
            file) of a checkpoint in several files.
    """
    checkpoint = checkpoint_of_part(path)
    num_files = len(all_files(existing_part_files(checkpoint))) if checkpoint else 0
    if num_files > 1:
        raise UsageError(f"{flag} {path} is one of {num_files} model part files: pass the checkpoint's name, "
                         f"{flag} {checkpoint} (fairseq adds -model_part-K for each rank)")


def refuse_an_ensemble_as_one_path(path: str) -> None:
    """fairseq-generate and -interactive split ``--path a.pt:b.pt`` into an
    ensemble; fairseq-eval-lm and -validate load ``--path`` whole, and said
    "no checkpoint a.pt:b.pt" (with a part name made from the joined
    string) although both checkpoints exist.

    Raises:
        UsageError: ``path`` names no checkpoint, but each of its
            ``os.pathsep``-separated pieces does.
    """
    pieces = path.split(os.pathsep)
    if len(pieces) > 1 and not existing_part_files(path) and all(map(existing_part_files, pieces)):
        raise UsageError(f"--path {path} names {len(pieces)} checkpoints: this tool scores one model "
                         f"(fairseq-generate and fairseq-interactive take an ensemble as --path a.pt{os.pathsep}b.pt)")


def check_integrity_on_every_rank(path: str, name: Optional[str] = None) -> None:
    """:func:`~fairseq_megatron.checkpoint.integrity.check_integrity` of
    ``path`` (named ``name``), this rank's part: each rank of a
    model-parallel group reads only its own, and a corrupted part must stop
    every rank of the group (the others would wait for it in their first
    collective), so the ranks exchange what they found.

    Raises:
        CheckpointError: a part of the group failed its check, on every rank
            of the group (the message of that part).
    """
    on_every_rank(lambda: check_integrity(path, name), lambda rank, said: CheckpointError(said))


def resharded_state(path: str, opened: OpenedSave, arg_overrides=None, with_ema: bool = False,
                    layout=None) -> Optional[dict]:
    """This rank's part of checkpoint ``path`` (saved at another
    model-parallel size, or in pipeline stages; ``opened``: its files,
    :func:`open_on_every_rank`), built in memory (with pipeline stages in
    this run, this rank's stage of it: ``layout``, a
    :class:`~fairseq_megatron.models.pipeline_stage.PipelineStageLayout`,
    by default one model chunk per stage), in the
    form fairseq's ``load_checkpoint_to_cpu(files[0], arg_overrides)``
    returns (overrides applied, old formats upgraded; the config records
    this size); None for a checkpoint of another architecture. The optimizer
    state, another size's, is dropped, and so are part 0's EMA weights
    (``with_ema``: this rank's part of them is built too, for fairseq-train
    ``--store-ema``) and RNG tracker states."""
    from fairseq_megatron.checkpoint.resharding import (
        resharded_model,
        set_model_parallel_size,
        split_stages,
        stage_part,
        without_part_specific_state,
    )

    state = checkpoint_utils.load_checkpoint_to_cpu(opened.read_through(opened.every_file[0]), arg_overrides)
    if not is_model_parallel_lm(state):
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
    return split_stages(state, stages)[stage] if layout is None else stage_part(state, layout)


def part_for_evaluation(path: str, arg_overrides=None):
    """This rank's part of our checkpoint ``path`` for an evaluation tool at
    this run's model-parallel size (and, where the run has pipeline stages,
    this rank's stage of it): ``(opened, state)``, the files of the save
    (the first of them is the name fairseq checks), and the part's state as
    fairseq's ``load_checkpoint_to_cpu`` returns it, read or resharded in
    memory.

    Raises:
        UsageError / CheckpointError: a part or stage cut short or missing
            (also the last ones, which leave what looks like a checkpoint of
            a smaller size); parts of two saves; a file that fails its
            CRC-32 check; another size of a checkpoint not of our models.
    """
    from fairseq_megatron.checkpoint.resharding import check_part_count, read_checkpoint

    size = parallel_state.get_tensor_model_parallel_world_size()
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    opened = open_on_every_rank(path)  # one save, none cut short, before any rank loads a part
    files, first = opened.files, opened.every_file[0]
    if files[0] != path and len(files) == size and (size == 1 or can_be_memory_mapped(opened.source(first))):
        # the last parts or stages lost look like a checkpoint of this size
        check_part_count(path, files, read_checkpoint(opened.read_through(first)), opened.stages)
    if stages > 1 and (len(files), opened.stages) == (size, stages):  # this rank's stage file, as it was saved
        mine = opened.stage_files(files[parallel_state.get_tensor_model_parallel_rank()])[
            parallel_state.get_pipeline_model_parallel_rank()]
        check_integrity_on_every_rank(opened.source(mine), mine)
        return opened, checkpoint_utils.load_checkpoint_to_cpu(opened.read_through(mine), arg_overrides)
    if len(files) != size or opened.stages > 1 or stages > 1:
        state = resharded_state(path, opened, arg_overrides)  # checks every part
        if state is None and len(files) != size:
            raise UsageError(f"{path} does not hold a model-parallel transformer LM of fairseq_megatron: it "
                             f"loads only at the model-parallel size it was saved at, {len(files)}")
        if state is not None:
            return opened, state
    mine = files[parallel_state.get_tensor_model_parallel_rank() if len(files) > 1 else 0]
    check_integrity_on_every_rank(opened.source(mine), mine)
    return opened, checkpoint_utils.load_checkpoint_to_cpu(opened.read_through(mine), arg_overrides)


def check_vocabulary(dictionary, dictionary_size: int, built_rows: int, saved: Optional[int],
                     symbols: Optional[int], path: str, checksum: Optional[str] = None,
                     accept_other: bool = False) -> None:
    """fairseq-train builds the model before it loads a checkpoint, padding
    its ``dictionary`` (of ``dictionary_size`` symbols) for this run's size
    to ``built_rows`` vocabulary rows; a checkpoint from another size keeps
    the vocabulary it was trained with (``saved`` rows in all parts, None
    when unknown), and fairseq then failed with "Cannot load model parameters
    ... ensure that the architectures match". With ``--padded-vocab-size``
    the rows agree for any dictionary up to that size, so the dictionary's own
    size is checked against the one the checkpoint records (``symbols``, None
    when unknown), and its symbols against the checkpoint's ``checksum``
    (:func:`~fairseq_megatron.models.options.check_dictionary_size`; not with
    ``accept_other``).

    Raises:
        UsageError: the rows differ (the message gives the flag to add), or
            the dictionaries do.
    """
    from fairseq_megatron.models.options import check_dictionary_size

    check_dictionary_size(dictionary.symbols, dictionary_size, symbols, path, checksum, accept_other)
    if saved is not None and saved != built_rows:
        raise UsageError(
            f"{path} has a vocabulary of {saved} rows (the dictionary padded for the model-parallel "
            f"size it was first trained at), this model {built_rows}: add --padded-vocab-size {saved}"
        )


def ema_from_the_weights(state: dict, path: str) -> dict:
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


def part_for_training(filename: str, suffix: str, cfg, dictionary, reset_optimizer: bool, layout=None,
                      trainable: Optional[List[str]] = None):
    """What this rank of fairseq-train loads for the checkpoint fairseq named
    ``filename`` (this rank's part name: the checkpoint's name with
    ``suffix``, ``-model_part-K[-stage-S]``): its part file as opened (under
    the name it has on disk: its staged name where a kill left it so), or a
    part built in memory from the parts of another layout, with the EMA
    weights fairseq-train ``--store-ema`` needs; a
    :class:`~fairseq_megatron.checkpoint.reading.PreparedCheckpoint`, or
    None where no checkpoint has that name (fairseq starts from scratch).
    ``cfg``: fairseq-train's configuration; ``dictionary``: the task's (its
    size is checked against the checkpoint's); ``layout``: this rank's
    pipeline stage (a :class:`~fairseq_megatron.models.pipeline_stage.PipelineStageLayout`;
    None at one stage); ``trainable``: the keys of the parameters its
    optimizer holds, in order.

    A checkpoint of the same model-parallel size in other pipeline stages
    (any ``P``, chunks ``V`` and placement of the chunks, that is any
    ``--pipeline-schedule``) resumes with its optimizer state: the weights
    and each parameter's optimizer state are cut for this stage
    (:func:`~fairseq_megatron.checkpoint.resharding.restaged_optimizer_state`).

    Raises:
        UsageError: another model-parallel size without ``reset_optimizer``
            (the message gives the commands that work); another layout whose
            files this run would save over, or beside, in the save dir it
            saves into; vocabularies that differ; a checkpoint that is not of
            our models; a part missing or cut short.
        CheckpointError: optimizer state that cannot follow another pipeline
            layout (saved in shards; several parameter groups).
    """
    from fairseq_megatron.checkpoint.resharding import saved_vocabulary

    path = filename[: -len(suffix + ".pt")] + ".pt"
    size = parallel_state.get_tensor_model_parallel_world_size()
    try:
        opened = open_on_every_rank(path)  # one save, none cut short, before any rank loads a part
    except FileNotFoundError:
        return None
    store_ema, stages = cfg.ema.store_ema, parallel_state.get_pipeline_model_parallel_world_size()
    accept_other = bool(getattr(cfg.model, "accept_other_dictionary", False))
    vocabulary = lambda rows, symbols, checksum: check_vocabulary(  # noqa: E731
        dictionary, cfg.model.dictionary_size, cfg.model.padded_vocab_size, rows, symbols, path, checksum, accept_other)
    same_names = len(opened.files) == size and opened.stages == stages and filename in opened.every_file
    if same_names and _holds_this_stage(opened.read_through(filename), layout):
        mine = opened.read_through(filename)
        check_integrity_on_every_rank(mine.source, filename)
        rows, symbols, checksum = saved_vocabulary(mine)
        vocabulary(rows and rows * size, symbols, checksum)
        if not store_ema:
            return PreparedCheckpoint(mine.name, file=mine)
        return PreparedCheckpoint(mine.name, state=ema_from_the_weights(
            checkpoint_utils.load_checkpoint_to_cpu(mine), filename))
    return _part_of_another_layout(path, opened, cfg, vocabulary, reset_optimizer, same_names, layout, trainable)


def _part_of_another_layout(path: str, opened: OpenedSave, cfg, vocabulary, reset_optimizer: bool, same_names: bool,
                            layout, trainable: Optional[List[str]]) -> PreparedCheckpoint:
    """:func:`part_for_training` of a checkpoint of another layout
    (``vocabulary``: checks the saved vocabulary): this rank's part built in
    memory, at the same model-parallel size with its optimizer state
    unless ``reset_optimizer``.

    Raises:
        UsageError / CheckpointError: see :func:`part_for_training`.
    """
    from fairseq_megatron.checkpoint.resharding import (
        config_value,
        model_config,
        read_checkpoint,
        restaged_optimizer_state,
        saved_vocabulary,
    )

    size = parallel_state.get_tensor_model_parallel_world_size()
    saved_optimizer = bool(read_checkpoint(opened.read_through(opened.every_file[0])).get("last_optimizer_state"))
    restaged = not reset_optimizer and len(opened.files) == size and saved_optimizer  # it follows the weights
    _refuse_another_layout(path, opened, cfg, reset_optimizer or restaged, same_names)
    first = opened.read_through(opened.every_file[0])
    rows, symbols, checksum = saved_vocabulary(first)
    vocabulary(rows and rows * len(opened.files), symbols, checksum)
    state = resharded_state(path, opened, with_ema=cfg.ema.store_ema, layout=layout)
    if state is None:
        raise UsageError(f"{path} does not hold a model-parallel transformer LM of fairseq_megatron: "
                         f"it cannot be split into model parts")
    if restaged:
        part = opened.files[parallel_state.get_tensor_model_parallel_rank()]
        state["last_optimizer_state"] = restaged_optimizer_state(opened, part, trainable)
    # rows unknown above for files saved by PyTorch < 1.6 (not memory-mapped); a middle stage has no embedding
    embedding = state["model"].get("decoder.embed_tokens.weight")
    if embedding is not None:
        config = model_config(state)
        vocabulary(embedding.size(0) * size, config_value(config, "dictionary_size"),
                   config_value(config, "dictionary_checksum"))
    return PreparedCheckpoint(first.name, state=ema_from_the_weights(state, path) if cfg.ema.store_ema else state)


def _holds_this_stage(mine, layout) -> bool:
    """Whether part file ``mine`` (opened) holds the layers pipeline stage
    ``layout`` holds (None: one stage): saved at the same stages, chunks and
    placement of the chunks, by its config."""
    if layout is None:
        return True
    from fairseq_megatron.checkpoint.layout import arguments_of
    from fairseq_megatron.checkpoint.resharding import model_config, read_checkpoint
    from fairseq_megatron.training.pipeline_schedules import stage_layout

    saved = stage_layout(arguments_of(model_config(read_checkpoint(mine))), layout.stage)
    return saved.chunks == layout.chunks


def _saved_pipeline_options(saved: dict) -> str:
    """fairseq-train's options for the pipeline layout the stage checkpoint ``saved`` was saved at."""
    from fairseq_megatron.checkpoint.layout import arguments_of
    from fairseq_megatron.checkpoint.resharding import model_config
    from fairseq_megatron.training.pipeline_schedules import schedule_of, stage_layout

    args = arguments_of(model_config(saved))
    layout = stage_layout(args, 0)
    counted = "".join(f" --account-for-{what}-in-pipeline-split" for what, flag in (
        ("embedding", layout.account_for_embedding), ("loss", layout.account_for_loss)) if flag)
    return (f"--pipeline-model-parallel-size {layout.stages} --virtual-pipeline-model-parallel-size "
            f"{layout.virtual} --pipeline-schedule {schedule_of(args).name}{counted}")


def _refuse_another_layout(path: str, opened: OpenedSave, cfg, reset_optimizer: bool, same_names: bool) -> None:
    """A checkpoint of another layout resumes only with its optimizer state
    afresh (``--reset-optimizer``, as ``--finetune-from-model``), or cut for
    this run's pipeline stages (``reset_optimizer`` true too: the caller
    does it), and not into the save dir it came from where the run would
    save files of other names beside it (``same_names``: the run's files
    replace the checkpoint's, stage for stage).

    Raises:
        UsageError: either, giving the commands that work; parts or stages
            lost (which are no layout).
    """
    from fairseq_megatron.checkpoint.resharding import check_part_count, read_checkpoint

    files, saved_stages = opened.files, opened.stages
    size, stages = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size()
    first = opened.read_through(opened.every_file[0])
    saved = read_checkpoint(first)
    check_part_count(path, files, saved, saved_stages)  # parts or stages lost are not a layout
    save_dir = cfg.checkpoint.save_dir
    in_save_dir = (not cfg.checkpoint.no_save and os.path.basename(path).startswith("checkpoint")
                   and os.path.realpath(os.path.dirname(path)) == os.path.realpath(save_dir))
    # with --reset-optimizer the run starts from the weights; in the save dir it would save over them
    from_weights = (f"start a new run from its weights with --save-dir NEW_DIR --restore-file {path} "
                    f"--reset-optimizer" if in_save_dir else "start from its weights with --reset-optimizer "
                    "(as --finetune-from-model)")
    if not reset_optimizer and len(files) == size:  # another pipeline layout, without optimizer state to cut
        sharded = bool(saved.get("optimizer_shards"))
        raise UsageError(
            f"{path} was saved in {saved_stages} pipeline stage(s) with its optimizer state in shards "
            f"(--ddp-backend fully_sharded), which resume only at the layout they were saved at: resume with "
            f"{_saved_pipeline_options(saved)}, or join them into one stage's (fairseq-megatron-reshard --input "
            f"{path} --output NEW_DIR/checkpoint_last.pt --model-parallel-size {size} --keep-optimizer) and train "
            f"with --save-dir NEW_DIR, or {from_weights}, which splits them in memory" if sharded else
            f"{path} holds no optimizer state to resume from: resume from a checkpoint that holds it, or "
            f"{from_weights}, which splits them in memory")
    if not reset_optimizer and (saved_stages > 1 or stages > 1):
        raise UsageError(
            f"{path} was saved at model-parallel size {len(files)} with {saved_stages} pipeline stage(s), this run "
            f"has size {size} with {stages}: resume with --model-parallel-size {len(files)} (at any pipeline "
            f"stages and schedule), or {from_weights}, which splits them in memory"
        )
    if not reset_optimizer:
        raise UsageError(
            f"{path} was saved at model-parallel size {len(files)}, this run has size {size}: resume with "
            f"--model-parallel-size {len(files)}, or reshard it with its optimizer state "
            f"(fairseq-megatron-reshard --input {path} --output NEW_DIR/checkpoint_last.pt --model-parallel-size "
            f"{size} --keep-optimizer) and train with --save-dir NEW_DIR, or {from_weights}, which reshards the "
            f"weights alone in memory"
        )
    if in_save_dir and not same_names:
        staged = f" in {stages} pipeline stage(s), not its {saved_stages}," if stages != saved_stages else ""
        raise UsageError(f"{path} is in --save-dir {save_dir}, where this run would save checkpoints of "
                         f"model-parallel size {size}{staged} under the same names: pass another --save-dir (with "
                         f"--restore-file {path})")
