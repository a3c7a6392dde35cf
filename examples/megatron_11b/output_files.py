"""Output files of the recipe's text steps (detok.py, bpe_encode.py): checked
before the work, written whole or not at all."""

import argparse
import os


def check_output(parser: argparse.ArgumentParser, option: str, path: str) -> None:
    """Stop with a usage error (exit status 2) unless ``path`` can be written
    as a file: its directory exists, and it is not a directory itself.
    Checked before the work, so that a bad name costs nothing."""
    if os.path.isdir(path):
        parser.error(f"{option} {path} is a directory: name a file in it")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        parser.error(f"{option} {path}: no such directory")


def write_whole(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through ``path.tmp``, renamed when
    complete: a failure (a full disk, say) leaves no half-written file, and
    an earlier ``path`` as it was.

    Raises:
        OSError: the write or the rename failed (the temporary file is removed).
    """
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
