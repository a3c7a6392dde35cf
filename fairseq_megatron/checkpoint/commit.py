"""A checkpoint save as a commit: all model parts of one save, or none.

Each rank writes its own part file, and renaming several files is not
atomic: a save killed between two ranks' renames left part 0 of the new
save beside part 1 of the previous one. A save of a checkpoint ``NAME.pt`` in N > 1
parts therefore goes:

1. Every rank writes its part under a staged name,
   ``NAME-model_part-K.pt.staged-TOKEN`` (:func:`~fairseq_megatron.checkpoint.names.staged_name`), TOKEN drawn
   once per save and agreed by the ranks; the part records it
   (``extra_state["save"]``, with the update count).
2. Once every rank has written its part, model-parallel rank 0 writes the
   manifest ``NAME.pt.manifest.json`` (:func:`write_manifest`: a temporary
   name, then a rename). Its rename is the commit point.
3. Every rank renames its staged part to ``NAME-model_part-K.pt``.

Readers never write (a checkpoint may be on read-only storage, or being
saved by a training as it is read): a reader that finds a manifest reads
each part it lists under the staged name where that file is still there
and under the final name otherwise, and requires every part to carry the
manifest's token (:mod:`fairseq_megatron.checkpoint.reading`). A kill
before the commit point leaves the previous save under ``NAME``; a kill
after it leaves the new save, readable through the names its manifest
records. The writer, the next save of ``NAME``, discards what a killed save
left (:func:`remove_stale`) and replaces the unfinished one. Megatron-LM's
``latest_checkpointed_iteration.txt`` plays the manifest's part there.

Under sharded data parallelism every rank also saves an optimizer shard
(:mod:`fairseq_megatron.checkpoint.optimizer_shards`): the commit then spans
every rank, the manifest lists the shards too (``optimizer_shards``), and a
model in one part has a manifest listing ``NAME.pt`` itself.

Checkpoints without a manifest (one part, older runs, the published
Megatron-11b) are read as before; their parts are compared by update count
and save token (:func:`fairseq_megatron.checkpoint.part_files.check_one_save`).
"""

import glob
import json
import os
import re
import uuid
from typing import List, Optional, Sequence

from fairseq_megatron.checkpoint.layout import CheckpointError
from fairseq_megatron.checkpoint.names import checkpoint_of_part
from fairseq_megatron.checkpoint.optimizer_shards import part_of_shard

MANIFEST_SUFFIX = ".manifest.json"
_TOKEN = re.compile(r"[0-9a-f]{32}")  # new_token's: a uuid4 in hex


def new_token() -> str:
    """An identity for one save, drawn by model-parallel rank 0 and sent to the others."""
    return uuid.uuid4().hex


def manifest_path(checkpoint: str) -> str:
    """The manifest of checkpoint ``checkpoint`` (``NAME.pt``, without a part suffix)."""
    return checkpoint + MANIFEST_SUFFIX


def write_manifest(checkpoint: str, token: str, updates: int, parts: List[str],
                   optimizer_shards: Sequence[str] = ()) -> None:
    """Commit the save ``token`` of ``checkpoint``: its manifest, listing
    ``parts`` (their final names; ``checkpoint`` itself for a model in one
    part) and the ``optimizer_shards`` saved beside them
    (:mod:`fairseq_megatron.checkpoint.optimizer_shards`), written under a
    temporary name of its own and renamed (the rename is the commit point).

    Raises:
        OSError: the write failed (the temporary file is removed).
    """
    from fairseq_megatron.files import written_whole

    record = {"token": token, "updates": updates, "parts": [os.path.basename(p) for p in parts]}
    if optimizer_shards:
        record["optimizer_shards"] = [os.path.basename(p) for p in optimizer_shards]
    with written_whole(manifest_path(checkpoint)) as partial:
        with open(partial, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())


def read_manifest(checkpoint: str) -> Optional[dict]:
    """The manifest of ``checkpoint``, or None where it has none. Its token
    must be one :func:`new_token` draws, and each name it lists a plain file
    name (``os.path.basename``'s, no directory in it) of a part of
    ``checkpoint``: the parts are read in ``checkpoint``'s own directory,
    under those names and their staged names, and nowhere else.

    Raises:
        CheckpointError: the manifest cannot be read, or is not one that
            :func:`write_manifest` writes for ``checkpoint``.
    """
    path = manifest_path(checkpoint)
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(record, dict) or not isinstance(record.get("parts"), list) or not record["parts"]:
        raise CheckpointError(f"{path} is not a checkpoint manifest")
    token = record.get("token")
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise CheckpointError(f"{path} is not a checkpoint manifest: its token {token!r} is not a save's")
    directory = os.path.dirname(checkpoint)
    one_part = record["parts"] == [os.path.basename(checkpoint)]
    for name in record["parts"]:
        if one_part:
            break
        if not _plain(name) or checkpoint_of_part(os.path.join(directory, name)) != checkpoint:
            raise CheckpointError(f"{path} is not a checkpoint manifest: it lists {name!r}, which is not the name of "
                                  f"a part file of {checkpoint} in its directory")
    parts = {os.path.join(directory, name) for name in record["parts"]}
    shards = record.get("optimizer_shards", [])
    for name in shards if isinstance(shards, list) else [shards]:
        if not _plain(name) or part_of_shard(os.path.join(directory, name)) not in parts:
            raise CheckpointError(f"{path} is not a checkpoint manifest: it lists {name!r}, which is not the name of "
                                  f"an optimizer shard of a part of {checkpoint} in its directory")
    return record


def _plain(name) -> bool:
    """Whether ``name`` is a plain file name (``os.path.basename``'s, no directory in it)."""
    return isinstance(name, str) and name == os.path.basename(name) and name not in ("", ".", "..") and \
        "\0" not in name and not (os.altsep and os.altsep in name)


def saved_token(state: dict) -> Optional[str]:
    """The save token checkpoint ``state`` records (None for a part written without one)."""
    extra_state = state.get("extra_state") if isinstance(state, dict) else None
    save = (extra_state or {}).get("save")
    return save.get("token") if isinstance(save, dict) else None


def check_tokens(checkpoint: str, manifest: dict, files: List[str], tokens: List[Optional[str]]) -> None:
    """Raise CheckpointError unless ``files`` are the parts ``manifest``
    lists, each carrying its token (``tokens``, read from the files)."""
    names = [os.path.basename(f) for f in files]
    if names != manifest["parts"]:
        raise CheckpointError(f"{manifest_path(checkpoint)} lists the parts {', '.join(manifest['parts'])}, "
                              f"but {', '.join(names)} exist")
    others = [name for name, token in zip(names, tokens) if token != manifest["token"]]
    if others:
        raise CheckpointError(f"the model parts of {checkpoint} are not one save: {', '.join(others)} not of the "
                              f"save its manifest records (update {manifest.get('updates')})")


def remove_stale(part: str, token: str) -> None:
    """Remove the staged files of part file ``part`` left by saves other
    than ``token`` (killed ones, or one whose renames a kill interrupted):
    the writer's job, at its next save of the name."""
    for path in glob.glob(glob.escape(part) + ".staged-*"):
        other = path[len(part) + len(".staged-"):]
        if other != token and _TOKEN.fullmatch(other):
            os.remove(path)
