"""The files of a checkpoint in model parts, by fairseq's naming.

fairseq names rank K's part of ``NAME.pt`` ``NAME-model_part-K.pt``
(``checkpoint_utils``: ``filename.replace(".pt", suffix + ".pt")``); size 1
is ``NAME.pt`` itself. With pipeline stages each tensor part is one file per
stage, ``NAME-model_part-K-stage-S.pt`` (at every tensor-parallel size, 1
included); the stage-0 file then stands for part K in the lists below, and
:func:`stage_files` gives all of its stages. This module finds the parts of
a checkpoint saved at any size, checks that none is missing or cut short,
and names the outputs of a resharding. A checkpoint with a manifest
(:mod:`.commit`) has the files its manifest lists, each under its final or
its staged name; :mod:`.reading` opens them as one save.
"""

import errno
import glob
import logging
import os
import shutil
import zipfile
from typing import List, Optional

from fairseq_megatron.checkpoint.commit import check_tokens, manifest_path, read_manifest, saved_token
from fairseq_megatron.checkpoint.layout import CheckpointError
from fairseq_megatron.checkpoint.names import (  # noqa: F401  (the names' rules, used with the files')
    PART_FILE_NAME,
    PART_SUFFIX,
    STAGE_SUFFIX,
    checkpoint_of_part,
    is_first_file,
    output_paths,
    part_path,
    stage_path,
    stage_suffix,
    staged_name,
)
from fairseq_megatron.errors import check_directory_can_be_made

logger = logging.getLogger(__name__)
_READ = object()  # a manifest argument not given: read it from disk


def _stages_on_disk(path: str) -> dict:
    """``{K: [S, ...]}`` for every ``<path>-model_part-K-stage-S.pt`` on disk (stages ascending)."""
    if not path.endswith(".pt"):
        return {}
    found = {}
    prefix = path[: -len(".pt")] + PART_SUFFIX.format("")
    for p in glob.glob(glob.escape(prefix) + "*" + STAGE_SUFFIX.format("*") + ".pt"):
        m = PART_FILE_NAME.fullmatch(p)
        if m and m.group(1) + ".pt" == path and m.group(3) is not None:
            found.setdefault(int(m.group(2)), []).append(int(m.group(3)))
    return {k: sorted(v) for k, v in found.items()}


def _manifest_of(checkpoint: Optional[str], manifest) -> Optional[dict]:
    """``manifest`` where given (None: known to have none), else checkpoint ``checkpoint``'s, read."""
    if manifest is not _READ:
        return manifest
    return read_manifest(checkpoint) if checkpoint else None


def stage_files(part: str, manifest=_READ) -> List[str]:
    """The files of the tensor part that ``part`` (from :func:`find_part_files`,
    which checked that no stage is missing) names, stage by stage: ``[part]``
    for a part without stages, all stages of a stage-0 file (those the
    checkpoint's ``manifest`` lists, where it has one: read unless given)."""
    m = PART_FILE_NAME.fullmatch(part)
    if not m or m.group(3) is None:
        return [part]
    checkpoint, rank = m.group(1) + ".pt", int(m.group(2))
    manifest = _manifest_of(checkpoint, manifest)
    if manifest is not None:
        directory = os.path.dirname(checkpoint)
        listed = [os.path.join(directory, name) for name in manifest["parts"]]
        return [f for f in listed if int(PART_FILE_NAME.fullmatch(f).group(2)) == rank]
    return [stage_path(checkpoint, rank, s) for s in _stages_on_disk(checkpoint).get(rank, [])]


def all_files(files: List[str], manifest=_READ) -> List[str]:
    """Every file of the parts ``files`` (:func:`find_part_files`), each part's stages in turn."""
    if files and manifest is _READ:
        manifest = _manifest_of(checkpoint_of_part(files[0]), manifest)
    return [f for part in files for f in stage_files(part, manifest)]


def pipeline_stages_of(files: List[str], manifest=_READ) -> int:
    """The number of pipeline stages of the parts ``files`` (1 without stages)."""
    return len(stage_files(files[0], manifest)) if files else 1


def _part_ranks(path: str) -> List[int]:
    """The K of every ``<path>-model_part-K.pt`` on disk, ascending; none for
    a name not ending in ``.pt`` (fairseq's part names replace the ``.pt``)."""
    if not path.endswith(".pt"):
        return []
    prefix = part_path(path, 0)[: -len("0.pt")]
    tails = (p[len(prefix): -len(".pt")] for p in glob.glob(glob.escape(prefix) + "*.pt"))
    return sorted(int(tail) for tail in tails if tail.isdigit())


def find_part_files(path: str, manifest=_READ) -> List[str]:
    """The part files of checkpoint ``path`` (the ``--path`` given to fairseq), in rank order.

    A checkpoint saved at model-parallel size 1 is the file itself (the only
    kind a name not ending in ``.pt`` can name: fairseq's part names replace
    the ``.pt``). A checkpoint with a manifest (``manifest``: read unless
    given; None for none) has the files it lists, each of them on disk under
    its final name or, where a kill interrupted the save's renames, its
    staged name (which the readers of :mod:`.reading` read). Reads the
    directory and the manifest only; writes nothing.

    Raises:
        FileNotFoundError: neither ``path`` nor any ``<path>-model_part-K.pt`` exists.
        CheckpointError: ``path`` is a directory, the part numbers have a
            gap, a file the manifest lists is missing, or ``path`` and part
            files both exist (checkpoints of two sizes under one name: which
            one was meant cannot be told).
    """
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a directory, not a checkpoint: name a checkpoint in it, such as "
                              f"{os.path.join(path, 'checkpoint_best.pt')}")
    ranks = _part_ranks(path)
    staged = _stages_on_disk(path)
    manifest = _manifest_of(path if path.endswith(".pt") else None, manifest)
    if manifest is not None:
        return _files_of_manifest(path, manifest, ranks, staged)
    if staged:
        if ranks or os.path.exists(path):
            other = part_path(path, ranks[0]) if ranks else path
            raise CheckpointError(f"{other} and pipeline stage file(s) {stage_path(path, min(staged), 0)} ... both "
                                  f"exist: checkpoints of two layouts under one name; move away the one not meant")
        return _stage_zero_files(path, staged)
    if os.path.exists(path):
        if ranks:
            raise CheckpointError(
                f"{path} and model part file(s) {part_path(path, ranks[0])} ... {part_path(path, ranks[-1])} "
                f"both exist: checkpoints of two model-parallel sizes under one name; move away the one not meant"
            )
        return [path]
    if not ranks:
        parts = f" and no model part files {part_path(path, 0)}, ..." if path.endswith(".pt") else ""
        raise FileNotFoundError(f"no checkpoint {path}{parts}")
    missing = sorted(set(range(ranks[-1] + 1)) - set(ranks))
    if missing:
        raise CheckpointError(f"model part file {part_path(path, missing[0])} is missing")
    return [part_path(path, r) for r in ranks]


def _files_of_manifest(path: str, manifest: dict, ranks: List[int], staged: dict) -> List[str]:
    """:func:`find_part_files` of a checkpoint whose ``manifest`` lists its
    files (``ranks``, ``staged``: the part and stage files on disk under
    their final names). The manifest must list the files of one layout, as
    :func:`output_paths` names them, and every one must be on disk (final or
    staged); files under the name that it does not list are of another save
    or layout."""
    directory = os.path.dirname(path)
    listed = [os.path.join(directory, name) for name in manifest["parts"]]
    if listed == [path]:  # a model in one part, saved with optimizer shards
        parts = 1
    else:
        parts = len({PART_FILE_NAME.fullmatch(f).group(2) for f in listed})  # read_manifest checked the names
    stages = len(listed) // parts
    if listed != output_paths(path, parts, stages):
        raise CheckpointError(f"{manifest_path(path)} is not a checkpoint manifest: its files "
                              f"{', '.join(manifest['parts'])} are not the parts of one layout")
    for f in listed:
        if not os.path.exists(f) and not os.path.exists(staged_name(f, manifest["token"])):
            raise CheckpointError(f"model part file {f} is missing: {manifest_path(path)} lists it, and neither it "
                                  f"nor {os.path.basename(staged_name(f, manifest['token']))} exists")
    on_disk = ([path] if os.path.exists(path) else []) + [part_path(path, r) for r in ranks] + [
        stage_path(path, r, s) for r, stages_of_r in staged.items() for s in stages_of_r]
    if listed == [path]:
        on_disk = on_disk[1:] if on_disk[:1] == [path] else on_disk
    others = [f for f in on_disk if f not in listed]
    if others:
        raise CheckpointError(f"{others[0]} exists beside the save that {manifest_path(path)} records, which does not "
                              f"list it: a file of another save or layout under the name; move it away")
    return listed[::stages]


def _stage_zero_files(path: str, staged: dict) -> List[str]:
    """The stage-0 file of each tensor part of the pipelined checkpoint
    ``path`` (``staged``: :func:`_stages_on_disk`), after checking that no
    part or stage is missing."""
    ranks = sorted(staged)
    missing = sorted(set(range(ranks[-1] + 1)) - set(ranks))
    if missing:
        raise CheckpointError(f"model part {missing[0]} of {path} is missing: no {stage_path(path, missing[0], 0)}")
    stages = max(max(v) for v in staged.values()) + 1
    for rank in ranks:
        gone = sorted(set(range(stages)) - set(staged[rank]))
        if gone:
            raise CheckpointError(f"pipeline stage file {stage_path(path, rank, gone[0])} is missing")
    return [stage_path(path, r, 0) for r in ranks]


def check_output_name(output_path: str, outputs: List[str]) -> None:
    """Raise CheckpointError where ``output_path`` or one of ``outputs`` is
    a directory (checked before any work, not found at the final rename), or
    where checkpoint files other than ``outputs`` (the files of one size)
    exist under the name ``output_path``: writing would leave two sizes under
    one name, which :func:`find_part_files` refuses to choose between; a
    UsageError where a file stands in the output's directory path (see
    :func:`check_directory_can_be_made`)."""
    check_directory_can_be_made(os.path.dirname(os.path.abspath(output_path)), f"cannot write the output {output_path}")
    for o in [output_path, *outputs]:
        if os.path.isdir(o):
            such_as = f": name a file in it, such as {os.path.join(o, 'model.pt')}" if o == output_path else ""
            raise CheckpointError(f"the output {o} is a directory{such_as}")
    existing = ([output_path] if os.path.exists(output_path) else []) + [
        part_path(output_path, r) for r in _part_ranks(output_path)]  # an export may be named freely
    stale = [f for f in existing if f not in outputs]
    if stale:
        raise CheckpointError(f"{stale[0]} exists under the output name {output_path} and is not one of the "
                              f"files to write: the name would hold two model-parallel sizes; choose another "
                              f"output or remove it")



def can_be_memory_mapped(path: str) -> bool:
    """False for files that ``torch.save`` wrote before PyTorch 1.6 (the
    legacy format, not a zip archive): ``torch.load(mmap=True)`` refuses them."""
    return zipfile.is_zipfile(path)


def update_count(state: dict) -> Optional[int]:
    """The number of updates fairseq-train had made when it saved checkpoint
    ``state`` (``optimizer_history[-1]["num_updates"]``, as
    ``fairseq/checkpoint_utils.py`` writes it); None where not recorded."""
    history = state.get("optimizer_history") if isinstance(state, dict) else None
    if not history or not isinstance(history[-1], dict):
        return None
    return history[-1].get("num_updates")


def _saved_state(path: str) -> Optional[dict]:
    """Checkpoint file ``path`` read through a memory map, its tensors left on
    disk; None for a file in the legacy format or one torch cannot read (the
    load that follows reports it)."""
    from fairseq_megatron.checkpoint import safe_loading

    if not can_be_memory_mapped(path):
        return None
    try:
        return safe_loading.load(path, mmap=True)
    except CheckpointError:
        raise  # a refused object, or a pickle that fails its CRC-32
    except Exception:
        return None


def check_one_save(files: List[str], states: Optional[List[dict]] = None, manifest=_READ) -> None:
    """Raise CheckpointError where the files ``files`` of one checkpoint
    (every part and stage) are not of the save their ``manifest`` records
    (:mod:`fairseq_megatron.checkpoint.commit`; read unless given, None for
    none), or, without a manifest, were saved at different updates or by
    different saves (the token each part of a save in parts records): a
    save interrupted between its parts, or parts of two runs put together.
    Each rank loads only its own part, so nothing else would notice at the
    size they were saved at (the evaluation is silently of a mix; a resumed
    run waits forever on a rank that reached --max-update). ``states``: the
    files already loaded (without their tensors); otherwise each is read
    through a memory map, without its tensors (files in torch's legacy
    format cannot be, and are not compared)."""
    checkpoint = checkpoint_of_part(files[0]) if files else None
    if len(files) == 1 and checkpoint is None and files[0].endswith(".pt"):
        checkpoint = files[0]  # a model in one part: its manifest, where saved with optimizer shards
    manifest = _manifest_of(checkpoint, manifest)
    if len(files) < 2 and manifest is None:
        return
    states = states if states is not None else [_saved_state(f) for f in files]
    if manifest is not None:
        check_tokens(checkpoint, manifest, files, [saved_token(state) if state else None for state in states])
        return
    updates = [update_count(state) if state else None for state in states]
    tokens = [saved_token(state) if state else None for state in states]
    name = checkpoint or files[0]
    if len({u for u in updates if u is not None}) > 1:
        saved = ", ".join(f"{os.path.basename(f)} at update {u}" for f, u in zip(files, updates) if u is not None)
        raise CheckpointError(f"the model parts of {name} are not one save: "
                              f"{saved} (a save interrupted between its parts, or parts of two runs)")
    if len({t for t in tokens if t is not None}) > 1:
        saved = ", ".join(f"{os.path.basename(f)} of save {t[:8]}" for f, t in zip(files, tokens) if t is not None)
        raise CheckpointError(f"the model parts of {name} are not one save: {saved}, at the same update (parts of "
                              f"two runs put together)")


def check_whole(path: str, name: Optional[str] = None) -> None:
    """Raise CheckpointError for checkpoint file ``path`` (named ``name``)
    cut short (a copy or save that stopped early): a zip archive, torch's
    format since 1.6, whose directory, written last, is missing; or an
    empty file. Reads only its start and end."""
    name = name or path
    with open(path, "rb") as f:
        head = f.read(4)
    if not head:
        raise CheckpointError(f"{name} is empty")
    if head == b"PK\x03\x04" and not zipfile.is_zipfile(path):
        raise CheckpointError(f"{name} is truncated: the zip archive's directory, which torch writes last, "
                              f"is missing (was the file still being saved or copied?)")


def check_complete(files: List[str]) -> None:
    """Raise CheckpointError for a file of the parts ``files`` cut short
    (:func:`check_whole`), and for parts that are not one save
    (:func:`check_one_save`), reading the files under their final names
    (:func:`fairseq_megatron.checkpoint.reading.open_save` opens a save's
    files once and reads them as opened, for the tools)."""
    files = all_files(files)
    for path in files:
        check_whole(path)
    check_one_save(files)


def is_write_failure(error: BaseException) -> bool:
    """Whether ``error``, raised while a checkpoint was written, is the file
    system's: an OSError, torch's zip writer reporting a short write (a full
    disk reaches it as "unexpected pos ..." or "file write failed"), or
    safetensors' writer reporting an I/O error (``SafetensorError: Error
    while serializing: I/O error: No space left on device (os error 28)``;
    ``IoError(...)`` in older releases)."""
    said = str(error)
    return isinstance(error, OSError) or (isinstance(error, RuntimeError) and any(
        s in said for s in ("unexpected pos", "file write failed", "PytorchStreamWriter failed"))) or (
        type(error).__name__ == "SafetensorError" and any(s in said for s in ("I/O error", "IoError")))


def write_error(path: str, error: BaseException, needed: Optional[int] = None) -> CheckpointError:
    """One line for a failed write to ``path`` (``needed``: the bytes it
    had to hold, where known), for the caller to raise once the partial file
    is removed: a full disk is named as such, with the bytes free there, and
    so is the process's file-size limit (``ulimit -f``) where that stopped
    the write (torch's zip writer reports it as "unexpected pos ...")."""
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    amounts = f"{_amount(needed)} to write, " if needed is not None else ""
    limit = _file_size_limit()
    too_large = (isinstance(error, OSError) and error.errno == errno.EFBIG) or (
        limit is not None and (needed is None or needed > limit) and not isinstance(error, OSError))
    if too_large and limit is not None:
        return CheckpointError(f"cannot write {path}: the file-size limit of this process (ulimit -f: "
                               f"{_amount(limit)}) is below the file's size ({amounts}{_amount(free)} free there); "
                               f"raise the limit; nothing was written")
    full = (isinstance(error, OSError) and error.errno == errno.ENOSPC) or (needed is not None and free < needed) or (
        not isinstance(error, OSError) and os.strerror(errno.ENOSPC) in str(error))  # safetensors' IoError
    reason = os.strerror(errno.ENOSPC) if full else f"{type(error).__name__}: {error}"
    return CheckpointError(f"cannot write {path}: {reason} ({amounts}{_amount(free)} free there); "
                           f"nothing was written")


def _file_size_limit() -> Optional[int]:
    """The process's limit on the size of a file it writes, in bytes (``ulimit -f``), or None."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def _amount(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"
