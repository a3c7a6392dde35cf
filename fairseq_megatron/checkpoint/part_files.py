"""The files of a checkpoint in model parts, by fairseq's naming.

fairseq names rank K's part of ``NAME.pt`` ``NAME-model_part-K.pt``
(``checkpoint_utils``: ``filename.replace(".pt", suffix + ".pt")``); size 1
is ``NAME.pt`` itself. This module finds the parts of a checkpoint saved at
any size, checks that none is missing or cut short, and names the outputs
of a resharding.
"""

import glob
import os
import re
import zipfile
from typing import Iterable, List, Optional

from fairseq_megatron.checkpoint.layout import CheckpointError
from fairseq_megatron.errors import check_directory_can_be_made

PART_SUFFIX = "-model_part-{}"


def part_path(path: str, rank: int) -> str:
    """fairseq's name for model part ``rank`` of ``path``: ``model.pt`` -> ``model-model_part-{rank}.pt``."""
    if not path.endswith(".pt"):
        raise CheckpointError(f"checkpoint path must end in .pt: {path}")
    return path[: -len(".pt")] + PART_SUFFIX.format(rank) + ".pt"


def checkpoint_of_part(path: str) -> Optional[str]:
    """The checkpoint name that part file ``path`` belongs to
    (``model-model_part-3.pt`` -> ``model.pt``), or None for a name without
    the part suffix."""
    m = re.fullmatch(r"(.*)" + re.escape(PART_SUFFIX.format("")) + r"\d+\.pt", path)
    return m.group(1) + ".pt" if m else None


def output_paths(path: str, num_parts: int) -> List[str]:
    """Where a checkpoint of ``num_parts`` parts named ``path`` lives (``path`` itself for 1)."""
    return [path] if num_parts == 1 else [part_path(path, r) for r in range(num_parts)]


def _part_ranks(path: str) -> List[int]:
    """The K of every ``<path>-model_part-K.pt`` on disk, ascending; none for
    a name not ending in ``.pt`` (fairseq's part names replace the ``.pt``)."""
    if not path.endswith(".pt"):
        return []
    prefix = part_path(path, 0)[: -len("0.pt")]
    tails = (p[len(prefix): -len(".pt")] for p in glob.glob(glob.escape(prefix) + "*.pt"))
    return sorted(int(tail) for tail in tails if tail.isdigit())


def find_part_files(path: str) -> List[str]:
    """The part files of checkpoint ``path`` (the ``--path`` given to fairseq), in rank order.

    A checkpoint saved at model-parallel size 1 is the file itself (the only
    kind a name not ending in ``.pt`` can name: fairseq's part names replace
    the ``.pt``).

    Raises:
        FileNotFoundError: neither ``path`` nor any ``<path>-model_part-K.pt`` exists.
        CheckpointError: ``path`` is a directory, the part numbers have a
            gap, or ``path`` and part files both exist (checkpoints of two
            sizes under one name: which one was meant cannot be told).
    """
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a directory, not a checkpoint: name a checkpoint in it, such as "
                              f"{os.path.join(path, 'checkpoint_best.pt')}")
    ranks = _part_ranks(path)
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


def check_complete(files: Iterable[str]) -> None:
    """Raise CheckpointError for a checkpoint file cut short (a copy or save
    that stopped early): a zip archive, torch's format since 1.6, whose
    directory, written last, is missing; or an empty file. Reads only the
    start and end of each file, so every rank can check every part before
    any of them loads one."""
    for path in files:
        with open(path, "rb") as f:
            head = f.read(4)
        if not head:
            raise CheckpointError(f"{path} is empty")
        if head == b"PK\x03\x04" and not zipfile.is_zipfile(path):
            raise CheckpointError(f"{path} is truncated: the zip archive's directory, which torch writes last, "
                                  f"is missing (was the file still being saved or copied?)")

