"""A checkpoint save as a commit: all model parts of one save, or none.

Each rank writes its own part file, and renaming several files is not
atomic: a save killed between two ranks' renames left part 0 of the new
save beside part 1 of the previous one. A save of a checkpoint ``NAME.pt`` in N > 1
parts therefore goes:

1. Every rank writes its part under a staged name,
   ``NAME-model_part-K.pt.staged-TOKEN`` (:func:`staged_name`), TOKEN drawn
   once per save and agreed by the ranks; the part records it
   (``extra_state["save"]``, with the update count).
2. Once every rank has written its part, model-parallel rank 0 writes the
   manifest ``NAME.pt.manifest.json`` (:func:`write_manifest`: a temporary
   name, then a rename). Its rename is the commit point.
3. Every rank renames its staged part to ``NAME-model_part-K.pt``.

A reader that finds a manifest (:func:`finish_commit`) first does step 3
for any staged part still there, then requires every part to carry the
manifest's token. A kill before the commit point leaves the previous save
under ``NAME`` (the staged files of the killed save are removed by the next
save of ``NAME``, :func:`remove_stale`); a kill after it leaves the new
save, completed by the next reader. Megatron-LM's
``latest_checkpointed_iteration.txt`` plays the manifest's part there.

Checkpoints without a manifest (one part, older runs, the published
Megatron-11b) are read as before; their parts are compared by update count
(:func:`fairseq_megatron.checkpoint.part_files.check_one_save`).
"""

import glob
import json
import os
import uuid
from typing import List, Optional

from fairseq_megatron.checkpoint.layout import CheckpointError

MANIFEST_SUFFIX = ".manifest.json"


def new_token() -> str:
    """An identity for one save, drawn by model-parallel rank 0 and sent to the others."""
    return uuid.uuid4().hex


def staged_name(part: str, token: str) -> str:
    """Where part file ``part`` of the save ``token`` is written before the commit."""
    return f"{part}.staged-{token}"


def manifest_path(checkpoint: str) -> str:
    """The manifest of checkpoint ``checkpoint`` (``NAME.pt``, without a part suffix)."""
    return checkpoint + MANIFEST_SUFFIX


def write_manifest(checkpoint: str, token: str, updates: int, parts: List[str]) -> None:
    """Commit the save ``token`` of ``checkpoint``: its manifest, listing
    ``parts`` (their final names), written under a temporary name and
    renamed (the rename is the commit point).

    Raises:
        OSError: the write failed (the temporary file is removed).
    """
    path = manifest_path(checkpoint)
    partial = f"{path}.tmp-{os.getpid()}"
    record = {"token": token, "updates": updates, "parts": [os.path.basename(p) for p in parts]}
    try:
        with open(partial, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def read_manifest(checkpoint: str) -> Optional[dict]:
    """The manifest of ``checkpoint``, or None where it has none.

    Raises:
        CheckpointError: the manifest cannot be read.
    """
    path = manifest_path(checkpoint)
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(record, dict) or not isinstance(record.get("parts"), list) or "token" not in record:
        raise CheckpointError(f"{path} is not a checkpoint manifest")
    return record


def saved_token(state: dict) -> Optional[str]:
    """The save token checkpoint ``state`` records (None for a part written without one)."""
    extra_state = state.get("extra_state") if isinstance(state, dict) else None
    save = (extra_state or {}).get("save")
    return save.get("token") if isinstance(save, dict) else None


def finish_commit(checkpoint: str) -> Optional[dict]:
    """Complete the renames of a committed save of ``checkpoint`` that a kill
    interrupted (step 3 of the module docstring), and return its manifest;
    None where ``checkpoint`` has no manifest. Several processes may run
    this at once: a part another process renamed first is left as it is."""
    manifest = read_manifest(checkpoint)
    if manifest is None:
        return None
    directory = os.path.dirname(checkpoint)
    for name in manifest["parts"]:
        part = os.path.join(directory, name)
        try:
            os.replace(staged_name(part, manifest["token"]), part)
        except FileNotFoundError:
            pass  # renamed already
    return manifest


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
    """Remove the staged files of part file ``part`` left by saves other than ``token`` (killed ones)."""
    for path in glob.glob(glob.escape(part) + ".staged-*"):
        if not path.endswith(token):
            os.remove(path)
