"""Whether a checkpoint file holds the bytes it was saved with.

``torch.save`` (since PyTorch 1.6) writes a zip archive whose every record
(the pickle, each tensor's storage) carries a CRC-32. :func:`check_integrity`
reads a file whole and checks each record against it, so that flipped bits
are refused in one line instead of loaded as weights or optimizer state.
Part files, stage files and optimizer shards are all checked this way where
they are read for training or evaluation (:mod:`.loading`, :mod:`.resharding`,
:mod:`.optimizer_shards`)."""

import functools
import logging
import os
import zipfile
from typing import Optional

from fairseq_megatron.checkpoint.layout import CheckpointError

# Set to 1 to skip the CRC-32 check of every checkpoint file read (its cost: docs/benchmarks.md).
SKIP_INTEGRITY_CHECK = "FAIRSEQ_MEGATRON_SKIP_INTEGRITY_CHECK"

logger = logging.getLogger(__name__)


def check_integrity(path: str, name: Optional[str] = None) -> bool:
    """Read checkpoint file ``path`` whole and check every record of its zip
    archive against the CRC-32 that ``torch.save`` stored: flipped bits are
    otherwise loaded as weights (the cost of that read:
    ``scripts/benchmark_integrity_check.py``).
    Returns whether it could be checked: not a file saved by PyTorch before
    1.6 (not a zip archive), nor one saved with its CRCs off
    (``torch.serialization.set_crc32_options(False)`` writes zeros); those
    are logged as unchecked. A file checked once is not read again while
    its size and modification time stay the same. Skipped, returning False,
    where the environment variable ``FAIRSEQ_MEGATRON_SKIP_INTEGRITY_CHECK``
    is 1. ``name``: the file's name in messages (``path`` may be an open
    file's ``/proc/self/fd/N``, :mod:`.reading`).

    Raises:
        CheckpointError: a record's bytes do not match its CRC-32.
    """
    if os.environ.get(SKIP_INTEGRITY_CHECK) == "1":
        _warn_skipped()
        return False
    stat = os.stat(path)
    key = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if key not in _CHECKED:
        _CHECKED[key] = _checked(path, name or path)
    return _CHECKED[key]


@functools.lru_cache(maxsize=None)
def _warn_skipped() -> None:
    """Once per process: the opt-out weakens every read."""
    logger.warning(f"{SKIP_INTEGRITY_CHECK}=1: checkpoint files are read without their CRC-32 check; flipped bits "
                   f"load as weights or optimizer state without a word")


# The outcome for each file checked in this process, by (device, inode, size, mtime).
_CHECKED: dict = {}


def _checked(path: str, name: str) -> bool:
    with open(path, "rb") as f:
        zip_archive = f.read(4) == b"PK\x03\x04"
    if not zip_archive:
        logger.warning(f"{name}: saved by PyTorch before 1.6, a format without checksums: its integrity "
                       f"cannot be checked")
        return False
    if not zipfile.is_zipfile(path):
        return False  # truncated: reported by the reader's checks (reading.open_save), or by the load
    unchecked = 0
    with zipfile.ZipFile(path) as archive:
        for record in archive.infolist():
            if record.CRC == 0 and record.file_size > 0:
                unchecked += 1  # written without a CRC
                continue
            try:
                with archive.open(record) as f:
                    while f.read(64 << 20):
                        pass
            except zipfile.BadZipFile:
                raise CheckpointError(f"{name} is corrupted: its record {record.filename} does not match the "
                                      f"CRC-32 stored when it was saved (the file changed since)") from None
    if unchecked:
        logger.warning(f"{name}: {unchecked} record(s) saved without a CRC-32: their integrity cannot be checked")
    return unchecked == 0
