"""The copies fairseq-train makes of a part it just saved (``checkpoint_last``
after an interval checkpoint, ``checkpoint_best``): written whole or not at all."""

import os
import re
import shutil

import pytest

from fairseq_megatron.checkpoint.layout import CheckpointError


def test_an_interrupted_checkpoint_copy_leaves_the_old_file_whole(tmp_path, monkeypatch):
    """fairseq-train makes ``checkpoint_last`` (after an interval or epoch
    checkpoint) and ``checkpoint_best`` by copying the file it just saved,
    with ``PathManager.copy``; upstream that wrote the destination in place,
    so a copy cut short (the job killed, the disk full) left a truncated
    ``checkpoint_last``. Our models' saves copy with ``copy_whole``: here the
    copy stops half-way with an OSError (a full disk), which is one line, the
    old file is still whole and no temporary file is left; an uninterrupted
    copy replaces it."""
    from fairseq_megatron.checkpoint.saving import copy_whole

    src, dst = tmp_path / "checkpoint_1_4-model_part-0.pt", tmp_path / "checkpoint_last-model_part-0.pt"
    src.write_bytes(b"new" * 1000)
    dst.write_bytes(b"old" * 1000)

    def copy_half(source, destination, **_):
        data = open(source, "rb").read()
        with open(destination, "wb") as f:
            f.write(data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", copy_half)
    with pytest.raises(CheckpointError) as raised:  # one line: the file, the reason, the bytes
        copy_whole(str(src), str(dst))
    assert re.fullmatch(rf"cannot write {re.escape(str(dst))}: No space left on device \(0\.00 MB to write, "
                        r"[\d.]+ [MG]B free there\); nothing was written", str(raised.value)), str(raised.value)
    assert dst.read_bytes() == b"old" * 1000
    assert sorted(os.listdir(tmp_path)) == [src.name, dst.name]
    monkeypatch.undo()
    copy_whole(str(src), str(dst))
    assert dst.read_bytes() == b"new" * 1000 and sorted(os.listdir(tmp_path)) == [src.name, dst.name]
