"""Checkpoints opened without running code.

A checkpoint file is a pickle, and unpickling calls whatever functions the
file names (an object's ``__reduce__``): a file made by someone else could
run their code the moment a tool opens it, before any check. Every
checkpoint is therefore read with torch's ``weights_only`` unpickler
(``torch.load(weights_only=True)``), which rebuilds tensors, containers and
plain values and refuses any other global before calling it, with an
allowlist (:data:`ALLOWED_GLOBALS`) of exactly the classes that the
checkpoints of fairseq 0.12, of this package and of fairseq's 2020 code (the
published Megatron-11b) hold beyond those. They were found by listing the
``GLOBAL`` opcodes of files that fairseq-train (our models at one and two
parts, pipeline stages, ``--store-ema``, validation and best-N files;
fairseq's ``transformer_lm``), the resharding tool and fairseq's own tests
write, and the published layout (``tests/e2e/test_published_layout.py``):

- ``argparse.Namespace``: fairseq's training ``args`` (checkpoints of 2020,
  such as the published Megatron-11b) and the ``cfg.model`` of an
  architecture registered the argparse way (ours).

Anything else is refused with one line naming it (:class:`UnsafeCheckpoint`).
A checkpoint you trust that holds other objects (a task of your own that
saves them) loads with ``FAIRSEQ_MEGATRON_TRUST_CHECKPOINTS=1``, which
unpickles every file in full and says so in a warning.

A zip checkpoint (torch's format since 1.6) stores a CRC-32 of its pickle;
it is checked before the pickle is read (:func:`check_pickle_crc`), so a
corrupted pickle is refused, not unpickled.
"""

import argparse
import contextlib
import functools
import logging
import os
import pickle
import re
import warnings
import zipfile
from typing import Optional

import torch

from fairseq_megatron.checkpoint.layout import CheckpointError

TRUST_CHECKPOINTS = "FAIRSEQ_MEGATRON_TRUST_CHECKPOINTS"
# torch's own switch, which forces full unpickling where a caller (fairseq) does not pass weights_only
_TORCH_FORCE_NO_WEIGHTS_ONLY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
ALLOWED_GLOBALS = [argparse.Namespace]
_REFUSED_GLOBAL = re.compile(r"GLOBAL (\S+) was not an allowed global")
_BLOCKED_MODULE = re.compile(r"Trying to load unsupported GLOBAL (\S+) whose module \S+ is blocked")

logger = logging.getLogger(__name__)


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file that holds an object the weights-only unpickler refuses."""


def trusted() -> bool:
    """Whether ``FAIRSEQ_MEGATRON_TRUST_CHECKPOINTS=1`` asks for full unpickling."""
    return os.environ.get(TRUST_CHECKPOINTS) == "1"


@functools.lru_cache(maxsize=None)
def _warn_once() -> None:
    logger.warning(f"{TRUST_CHECKPOINTS}=1: checkpoint files are unpickled in full, which runs any code a file "
                   f"names; use it only for files you trust")


def check_pickle_crc(path: str, name: Optional[str] = None) -> None:
    """Read the pickle records of zip checkpoint ``path`` (``data.pkl``, and
    the small records beside it; not the tensors' ``data/N`` records),
    which checks each against the CRC-32 ``torch.save`` stored. A file in
    the legacy format has none, and passes. ``name``: the file's name in
    messages (``path`` may be an open file's ``/proc/self/fd/N``).

    Raises:
        CheckpointError: a pickle record does not match its CRC-32.
    """
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError):
        return  # the legacy format, or cut short: the load reports it
    with archive:
        for record in archive.infolist():
            if "/data/" in record.filename or record.CRC == 0:
                continue
            try:
                archive.read(record)
            except zipfile.BadZipFile:
                raise CheckpointError(f"{name or path} is corrupted: its record {record.filename} does not match "
                                      f"the CRC-32 stored when it was saved (the file changed since)") from None


def refusal(error: BaseException, name: str) -> Optional[CheckpointError]:
    """The one-line error for ``error``, raised by the weights-only
    unpickler while it read ``name``: an :class:`UnsafeCheckpoint` naming
    the global it refused, or for a file it cannot read at all (not a
    pickle torch wrote) "cannot read ..." with the unpickler's reason; None
    for errors of other kinds."""
    said = str(error)
    if not isinstance(error, pickle.UnpicklingError) or "Weights only load failed" not in said:
        return None
    found = _REFUSED_GLOBAL.search(said) or _BLOCKED_MODULE.search(said)
    if found:
        return UnsafeCheckpoint(
            f"{name} holds {found.group(1)}, which no checkpoint of fairseq or fairseq_megatron holds: refused "
            f"without unpickling it, as unpickling would call it (set {TRUST_CHECKPOINTS}=1 to unpickle files you "
            f"trust in full)")
    reason = said.split("WeightsUnpickler error:")[-1].split("Check the documentation of torch.load")[0]
    return CheckpointError(f"cannot read {name}: UnpicklingError: {' '.join(reason.split())}")


@contextlib.contextmanager
def loading():
    """``torch.load`` calls that do not pass ``weights_only`` (fairseq's
    ``load_checkpoint_to_cpu``) load with the weights-only unpickler and
    :data:`ALLOWED_GLOBALS` while this runs, whatever
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` says; with
    ``FAIRSEQ_MEGATRON_TRUST_CHECKPOINTS=1`` they unpickle in full (a
    warning, once per process)."""
    previous = os.environ.pop(_TORCH_FORCE_NO_WEIGHTS_ONLY, None)
    if trusted():
        _warn_once()
        os.environ[_TORCH_FORCE_NO_WEIGHTS_ONLY] = "1"
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(ALLOWED_GLOBALS):
            warnings.filterwarnings("ignore", message="Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
            yield
    finally:
        os.environ.pop(_TORCH_FORCE_NO_WEIGHTS_ONLY, None)
        if previous is not None:
            os.environ[_TORCH_FORCE_NO_WEIGHTS_ONLY] = previous


def load(path: str, name: Optional[str] = None, mmap: bool = False):
    """``torch.load`` of checkpoint file ``path`` to CPU, without running
    code (full unpickling with ``FAIRSEQ_MEGATRON_TRUST_CHECKPOINTS=1``),
    its pickle's CRC-32 checked first; ``mmap`` maps the tensors instead of
    reading them (zip files only). ``name``: the file's name in messages.

    Raises:
        UnsafeCheckpoint: the file holds a global outside the allowlist.
        CheckpointError: the pickle fails its CRC-32, or is not one torch
            wrote (the weights-only unpickler's reason).
        Exception: what torch raises for a file it cannot read otherwise.
    """
    name = name or path
    check_pickle_crc(path, name)
    weights_only = not trusted()
    if not weights_only:
        _warn_once()
    try:
        with torch.serialization.safe_globals(ALLOWED_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap)
    except Exception as e:
        refused = refusal(e, name)
        if refused is not None:
            raise refused from None
        raise
