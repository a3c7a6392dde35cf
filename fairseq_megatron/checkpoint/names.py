"""The names of a checkpoint's files, by fairseq's naming.

fairseq names rank K's part of ``NAME.pt`` ``NAME-model_part-K.pt``
(``checkpoint_utils``: ``filename.replace(".pt", suffix + ".pt")``); size 1
is ``NAME.pt`` itself. With pipeline stages each tensor part is one file per
stage, ``NAME-model_part-K-stage-S.pt`` (at every tensor-parallel size, 1
included). :mod:`.part_files` finds them on disk.
"""

import re
from typing import List, Optional

from fairseq_megatron.checkpoint.layout import CheckpointError

PART_SUFFIX = "-model_part-{}"
STAGE_SUFFIX = "-stage-{}"
def part_path(path: str, rank: int) -> str:
    """fairseq's name for model part ``rank`` of ``path``: ``model.pt`` -> ``model-model_part-{rank}.pt``."""
    if not path.endswith(".pt"):
        raise CheckpointError(f"checkpoint path must end in .pt: {path}")
    return path[: -len(".pt")] + PART_SUFFIX.format(rank) + ".pt"


def stage_suffix(rank: int, stage: int) -> str:
    """The suffix of tensor part ``rank`` of pipeline stage ``stage``: ``-model_part-{rank}-stage-{stage}``."""
    return PART_SUFFIX.format(rank) + STAGE_SUFFIX.format(stage)


def stage_path(path: str, rank: int, stage: int) -> str:
    """``model.pt`` -> ``model-model_part-{rank}-stage-{stage}.pt``."""
    if not path.endswith(".pt"):
        raise CheckpointError(f"checkpoint path must end in .pt: {path}")
    return path[: -len(".pt")] + stage_suffix(rank, stage) + ".pt"


# NAME-model_part-K.pt or NAME-model_part-K-stage-S.pt: groups NAME, K and S
PART_FILE_NAME = re.compile(r"(.*)" + re.escape(PART_SUFFIX.format("")) + r"(\d+)(?:" +
                        re.escape(STAGE_SUFFIX.format("")) + r"(\d+))?\.pt")


def checkpoint_of_part(path: str) -> Optional[str]:
    """The checkpoint name that part file ``path`` belongs to
    (``model-model_part-3.pt`` and ``model-model_part-3-stage-1.pt`` ->
    ``model.pt``), or None for a name without the part suffix."""
    m = PART_FILE_NAME.fullmatch(path)
    return m.group(1) + ".pt" if m else None


def is_first_file(path: str) -> bool:
    """Whether ``path`` is part 0 (of stage 0) of its checkpoint: the file
    whose removal takes the checkpoint's manifest with it."""
    m = PART_FILE_NAME.fullmatch(path)
    return bool(m) and int(m.group(2)) == 0 and int(m.group(3) or 0) == 0


def output_paths(path: str, num_parts: int, stages: int = 1) -> List[str]:
    """Where a checkpoint of ``num_parts`` tensor parts and ``stages``
    pipeline stages named ``path`` lives (``path`` itself for one of each),
    part by part, each part's stages in turn (the order of :func:`.part_files.all_files`)."""
    if stages > 1:
        return [stage_path(path, r, s) for r in range(num_parts) for s in range(stages)]
    return [path] if num_parts == 1 else [part_path(path, r) for r in range(num_parts)]


def part_name(named_by_fairseq: str, suffix: str) -> str:
    """The part file fairseq meant by ``named_by_fairseq``, which it made with
    ``name.replace(".pt", suffix + ".pt")``: every ".pt" in ``name`` took the
    suffix, directories included (``runs/wiki.ptb/model.pt`` became
    ``runs/wiki-model_part-0.ptb/model-model_part-0.pt``, and fairseq-train
    then started from scratch, fairseq-eval-lm found no file). Names without
    that damage come back as they are."""
    name = named_by_fairseq.replace(suffix + ".pt", ".pt") if suffix else named_by_fairseq
    return name[: -len(".pt")] + suffix + ".pt" if suffix and name.endswith(".pt") else named_by_fairseq


def staged_name(path: str, token: str) -> str:
    """Where file ``path`` (a part file, an optimizer shard) of the save
    ``token`` is written before the save's commit (:mod:`.commit`)."""
    return f"{path}.staged-{token}"
