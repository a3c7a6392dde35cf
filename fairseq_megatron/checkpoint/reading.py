"""A checkpoint read as one save, without writing anything.

Readers (fairseq-eval-lm, -validate, -generate, -interactive, the hub,
the resharding tool and both exports, ``--finetune-from-model``,
fairseq-train resuming before its first save) rename, create and remove
nothing: the checkpoint may be on read-only storage, and a training may be
saving it as it is read. :func:`open_save` finds the files of the save the
checkpoint's manifest records (:mod:`.commit`; the staged name of a part
whose rename a kill interrupted, the final name otherwise), opens every one
and checks that they are one save: each carries the manifest's token, or,
without a manifest, the same update count and save token
(:func:`~fairseq_megatron.checkpoint.part_files.check_one_save`).

A training that saves while a reader opens the files can replace a part
between two opens; the reader then sees parts of two saves, finds the
manifest changed, and opens the new save's files instead, up to
:data:`ATTEMPTS` times; after that it stops with one line saying the
checkpoint changed under it. Once open, the files are read through their
descriptors (``/proc/self/fd/N`` on Linux, :meth:`OpenedSave.source`):
the files as they were when opened, whatever a writer renames or removes
later, so a reader that reads a part layer by layer never reads layers of
two saves. Elsewhere the names are read again, and a change is found by
the consistency checks (a replicated weight that differs between parts).
"""

import contextlib
import os
import time
import weakref
import zipfile
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple, Union

from fairseq_megatron.checkpoint import safe_loading
from fairseq_megatron.checkpoint.commit import manifest_path, read_manifest
from fairseq_megatron.checkpoint.layout import CheckpointError
from fairseq_megatron.checkpoint.part_files import all_files, check_one_save, check_whole, find_part_files
from fairseq_megatron.checkpoint.names import staged_name

# Saves seen to change under the reader before it gives up.
ATTEMPTS = 10


class ChangedWhileRead(CheckpointError):
    """The checkpoint was saved again while its files were being opened."""


class _Changed(Exception):
    """One attempt saw the checkpoint change (internal)."""


@dataclass(frozen=True)
class FileAsOpened:
    """A checkpoint file as :func:`open_save` opened it: ``name``, the name
    it has on disk (for messages, and for fairseq's tests that it exists),
    and ``source``, the path that reads it as it was opened. Holds its
    :class:`OpenedSave` open while it lives."""

    name: str
    source: str
    opened: "OpenedSave" = field(repr=False, compare=False)


def source_of(file: Union[str, FileAsOpened]) -> str:
    """Where to read checkpoint file ``file``: a :class:`FileAsOpened`'s
    source, a name itself."""
    return file.source if isinstance(file, FileAsOpened) else file


def name_of(file: Union[str, FileAsOpened]) -> str:
    """How messages name checkpoint file ``file``."""
    return file.name if isinstance(file, FileAsOpened) else file


@dataclass
class PreparedCheckpoint:
    """A checkpoint file as a rank is to load it, for a loader that takes a
    file name (fairseq's ``Trainer.load_checkpoint``): ``name``, a file on
    disk, and what reading it gives while :func:`prepared_for_loading` is
    open: ``state``, built in memory (a part resharded from another size,
    EMA weights added), or else the file read as opened (``file``)."""

    name: str
    file: Optional[FileAsOpened] = None
    state: Optional[dict] = None


_prepared: Dict[str, PreparedCheckpoint] = {}


@contextlib.contextmanager
def prepared_for_loading(prepared: PreparedCheckpoint) -> Iterator[str]:
    """Within this context reading ``prepared.name``
    (:func:`prepared_under`, which fairseq's ``load_checkpoint_to_cpu`` asks)
    gives ``prepared``'s state or file; yields the name to hand the loader."""
    _prepared[prepared.name] = prepared
    try:
        yield prepared.name
    finally:
        _prepared.pop(prepared.name, None)


def prepared_under(name) -> Optional[PreparedCheckpoint]:
    """The :class:`PreparedCheckpoint` a :func:`prepared_for_loading` context
    holds for file ``name``, or None."""
    return _prepared.get(name) if isinstance(name, str) else None


class OpenedSave:
    """The files of one save of checkpoint ``path``, held open (see the
    module docstring); made by :func:`open_save`.

    ``files``: the file of each tensor part (of a pipelined checkpoint, its
    stage-0 file), as :func:`~fairseq_megatron.checkpoint.part_files.find_part_files`
    names them; ``every_file``: every file, each part's stages in turn;
    ``stages``: the pipeline stages; ``manifest``: the manifest read, or None.
    """

    def __init__(self, path: str, files: List[str], every_file: List[str], manifest: Optional[dict],
                 opened: Dict[str, Tuple[int, str]]):
        self.path, self.files, self.every_file, self.manifest = path, files, every_file, manifest
        self.stages = len(every_file) // len(files) if files else 1
        self._opened = opened  # final name -> (descriptor, the name it was opened under)
        self._close = weakref.finalize(self, _close_all, [fd for fd, _ in opened.values()])

    def source(self, name: str) -> str:
        """The path that reads file ``name`` (one of :attr:`every_file`) as it was opened."""
        fd, opened_as = self._opened[name]
        proc = f"/proc/self/fd/{fd}"
        return proc if os.path.exists(proc) else opened_as

    def read_through(self, name: str) -> FileAsOpened:
        """File ``name`` (one of :attr:`every_file`) as opened, named as it
        is on disk (its staged name while a kill left it so)."""
        return FileAsOpened(self._opened[name][1], self.source(name), self)

    def identity(self) -> tuple:
        """What tells this save from another: the manifest's token, or each
        file's size and modification time (compared between ranks that
        opened the checkpoint each for itself)."""
        if self.manifest is not None:
            return (self.manifest["token"],)
        return tuple((s.st_size, s.st_mtime_ns) for s in (os.fstat(fd) for fd, _ in self._opened.values()))

    def stage_files(self, part: str) -> List[str]:
        """The files of tensor part ``part`` (one of :attr:`files`), stage by stage."""
        i = self.files.index(part) * self.stages
        return self.every_file[i: i + self.stages]

    def close(self) -> None:
        self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _close_all(fds: List[int]) -> None:
    for fd in fds:
        os.close(fd)


def open_save(path: str, metadata: bool = True) -> OpenedSave:
    """Open every file of checkpoint ``path`` (the ``--path`` given to
    fairseq) and check that they are one save, whole: none is empty or cut
    short, and (``metadata``: each file's pickle read, not its tensors) all
    carry the manifest's token, or without a manifest the same update count
    and save token. Writes nothing.

    Raises:
        FileNotFoundError / CheckpointError: as
            :func:`~fairseq_megatron.checkpoint.part_files.find_part_files`;
            a file cut short or empty; parts of two saves; a manifest that
            is not one (:func:`~fairseq_megatron.checkpoint.commit.read_manifest`).
        ChangedWhileRead: a training saved the checkpoint again each of
            :data:`ATTEMPTS` times its files were opened.
    """
    for attempt in range(ATTEMPTS):
        try:
            return _open_once(path, metadata)
        except _Changed:
            time.sleep(0.01 * (attempt + 1))
    raise ChangedWhileRead(f"{path} was saved again each of the {ATTEMPTS} times its files were opened (a "
                           f"training saves it faster than it can be read): read it again, or read a copy")


def _open_once(path: str, metadata: bool) -> OpenedSave:
    manifest = read_manifest(path) if path.endswith(".pt") else None
    files = find_part_files(path, manifest)
    every_file = all_files(files, manifest)
    opened: Dict[str, Tuple[int, str]] = {}
    try:
        for name in every_file:
            opened[name] = _open(name, manifest, path)
        save = OpenedSave(path, files, every_file, manifest, opened)
    except BaseException:
        _close_all([fd for fd, _ in opened.values()])
        raise
    try:
        for name in every_file:
            check_whole(save.source(name), name)
        if metadata and (len(every_file) > 1 or manifest is not None):
            states = [_metadata(save.source(name), name) for name in every_file]
            try:
                check_one_save(every_file, states, manifest)
            except CheckpointError:
                if _changed(path, manifest, save):
                    raise _Changed() from None
                raise
    except BaseException:
        save.close()
        raise
    return save


def _open(name: str, manifest: Optional[dict], path: str) -> Tuple[int, str]:
    """A descriptor of file ``name`` of the save ``manifest`` records (its
    staged name first: the save's own file while it is there), and the name
    it was opened under."""
    candidates = [staged_name(name, manifest["token"]), name] if manifest else [name]
    for candidate in candidates:
        try:
            return os.open(candidate, os.O_RDONLY), candidate
        except FileNotFoundError:
            continue
    if manifest is not None and read_manifest(path) != manifest:
        raise _Changed()
    if manifest is not None:
        raise CheckpointError(f"model part file {name} is missing: {manifest_path(path)} lists it, and neither it "
                              f"nor {os.path.basename(staged_name(name, manifest['token']))} exists")
    raise FileNotFoundError(f"{name} disappeared while the checkpoint was read (was it removed?)")


def _changed(path: str, manifest: Optional[dict], save: OpenedSave) -> bool:
    """Whether checkpoint ``path`` is no longer the save ``save`` opened:
    another manifest, or (without one) another file under a name opened."""
    if manifest is not None:
        try:
            return read_manifest(path) != manifest
        except CheckpointError:
            return True
    for name in save.every_file:
        fd, opened_as = save._opened[name]
        try:
            now, then = os.stat(opened_as), os.fstat(fd)
        except FileNotFoundError:
            return True
        if (now.st_ino, now.st_dev) != (then.st_ino, then.st_dev):
            return True
    return False


def _metadata(source: str, name: str) -> Optional[dict]:
    """File ``name``'s checkpoint dict, its tensors left on disk (a memory
    map), read from ``source``; None for a file in torch's legacy format,
    which cannot be mapped (not compared)."""
    if not zipfile.is_zipfile(source):
        return None
    try:
        return safe_loading.load(source, name, mmap=True)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"cannot read {name}: {type(e).__name__}: {e}") from None
