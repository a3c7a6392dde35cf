"""Bad input and bad launches reported as one ``error: ...`` line in
fairseq's tools.

Our errors for bad input or a bad launch
(:class:`fairseq_megatron.errors.UsageError`) reached the user as a
traceback through fairseq, with the message on its last line; they are now
printed as one ``error: ...`` line (exit status 1). In a tool run with
``--user-dir`` of this package, so are missing files and directories,
whoever finds them (fairseq's "Dataset not found", a data directory without
dict.txt, a ``--path`` that names nothing). A Python program that imports
the package keeps its tracebacks; ``FAIRSEQ_MEGATRON_TRACEBACK=1`` shows them
in the tools too. The hook is ``sys.excepthook`` (Python's, not fairseq's).
"""

import os
import sys

import torch

from fairseq_megatron.fairseq_integration.patching import fairseq_tool, plugin_on_command_line


def printed_as_one_line(error: BaseException) -> bool:
    """Print ``error: <message>`` for ``error`` if it is one of ours to
    shorten (see the module docstring), unless ``FAIRSEQ_MEGATRON_TRACEBACK``
    is set. Returns whether it printed."""
    from fairseq_megatron.errors import UsageError

    if os.environ.get("FAIRSEQ_MEGATRON_TRACEBACK") or fairseq_tool() is None:
        return False
    missing = (FileNotFoundError, IsADirectoryError, NotADirectoryError, torch.multiprocessing.ProcessExitedException)
    if not (isinstance(error, UsageError) or (isinstance(error, missing) and plugin_on_command_line())):
        return False
    print(f"error: {error}", file=sys.stderr, flush=True)
    return True


def install() -> None:
    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        if not printed_as_one_line(value):
            previous(kind, value, traceback)

    sys.excepthook = excepthook
