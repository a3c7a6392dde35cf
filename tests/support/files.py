"""What the tests of readers compare a directory by."""

import os
from typing import Dict


def file_contents(directory) -> Dict[str, bytes]:
    """Every file under ``directory`` (its path relative to it) with its bytes:
    what a reader must leave as it was."""
    found = {}
    for root, _, names in os.walk(directory):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                found[os.path.relpath(os.path.join(root, name), directory)] = f.read()
    return found
