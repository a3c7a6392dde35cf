"""Output files of the recipe's text steps (detok.py, bpe_encode.py): checked
before the work, written whole or not at all."""

import argparse
import os
import secrets
from typing import Sequence


def check_output(parser: argparse.ArgumentParser, option: str, path: str, inputs: Sequence[str] = ()) -> None:
    """Stop with a usage error (exit status 2) unless ``path`` can be written
    as a file: its directory exists, it is not a directory itself, and it is
    none of the ``inputs`` (the output would replace the text it was made
    from). Checked before the work, so that a bad name costs nothing."""
    for source in inputs:
        if source != "-" and os.path.exists(source) and os.path.exists(path) and os.path.samefile(source, path):
            parser.error(f"{option} {path} is the input {source}: writing it would replace the input; "
                         f"name another file")
    if os.path.isdir(path):
        parser.error(f"{option} {path} is a directory: name a file in it")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        parser.error(f"{option} {path}: no such directory")


def write_whole(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file of its own
    beside it (``<name>.tmp-<random hex>``, created exclusively: never a file
    that exists, such as an input named ``<name>.tmp``), renamed when
    complete: a failure (a full disk, say) leaves no half-written file, an
    earlier ``path`` as it was, and every other file untouched.

    Raises:
        OSError: the write or the rename failed (the temporary file is removed).
    """
    parent, name = os.path.split(os.path.abspath(path))
    while True:  # fairseq_megatron.files.new_temporary, without importing the package (and fairseq)
        tmp = os.path.join(parent, f"{name}.tmp-{secrets.token_hex(4)}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:
            continue
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def utf8_text(data: bytes, path: str) -> str:
    """``data``, the bytes of file ``path``, decoded as UTF-8.

    Raises:
        ValueError: not UTF-8; the message names the file, the line and the
            byte offset in the file.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}: line {line}, byte {e.start}: not UTF-8 ({e.reason}: "
                         f"{data[e.start:e.end]!r})") from None
