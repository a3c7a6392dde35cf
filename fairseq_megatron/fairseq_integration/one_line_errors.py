"""Bad input and bad launches reported as one ``error: ...`` line in
fairseq's tools (step 14 of :mod:`fairseq_megatron.fairseq_integration`).

14. :func:`one_line_errors` -- our errors for bad input or a bad launch
   (:class:`fairseq_megatron.errors.UsageError`) reached the user as a
   traceback through fairseq, with the message on its last line; they are
   now printed as one ``error: ...`` line (exit status 1). So are missing
   files and directories, whoever finds them (fairseq's "Dataset not found",
   a data directory without dict.txt, a ``--path`` that names nothing: it was
   fairseq's traceback, naming one rank's part). Only in those tools: a
   Python program that imports the package keeps its tracebacks.
   ``FAIRSEQ_MEGATRON_TRACEBACK=1`` shows the traceback.
"""

import os
import sys

import torch

from fairseq_megatron.fairseq_integration.patching import fairseq_tool


def printed_as_one_line(error: BaseException) -> bool:
    """Print ``error: <message>`` for ``error`` if it is one of ours to
    shorten: a UsageError (or a spawned process's exit after printing one,
    see :func:`.launch._run_spawned`) in one of fairseq's tools, unless
    ``FAIRSEQ_MEGATRON_TRACEBACK`` is set. Returns whether it printed."""
    from fairseq_megatron.errors import UsageError

    ours = isinstance(error, (UsageError, FileNotFoundError, IsADirectoryError, NotADirectoryError,
                              torch.multiprocessing.ProcessExitedException))
    if not ours or os.environ.get("FAIRSEQ_MEGATRON_TRACEBACK") or fairseq_tool() is None:
        return False
    print(f"error: {error}", file=sys.stderr, flush=True)
    return True


def one_line_errors() -> None:
    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        if not printed_as_one_line(value):
            previous(kind, value, traceback)

    sys.excepthook = excepthook
