"""The one error class users of fairseq's command-line tools see as a single line.

:class:`UsageError` marks bad input or a bad launch that the user fixes: a
model-parallel size that does not divide the world size or the model, a
checkpoint part that is missing, truncated or of another size, conflicting
flags. Raised inside ``fairseq-train``, ``fairseq-eval-lm``,
``fairseq-generate`` or ``fairseq-interactive`` with ``--user-dir``, it
reaches the user as one ``error: <message>`` line on standard error (one
per process under torchrun) and exit status 1, instead of a traceback
through fairseq (:mod:`fairseq_megatron.fairseq_integration.one_line_errors`); a Python program that
imports the package sees the exception as usual. A path that names nothing
(``FileNotFoundError``, or a directory where a file was meant, or the
reverse) is treated the same, whoever raised it. Set
``FAIRSEQ_MEGATRON_TRACEBACK=1`` to see the traceback. Other exceptions are
bugs, or fairseq's, and keep Python's traceback.

:func:`check_directory_can_be_made` raises it for an output directory
(``--save-dir``, ``--results-path``, a resharding output's) that a file
stands in the way of.
"""

import os


class UsageError(ValueError):
    """Bad input or a bad launch, with a message that says what to change.

    A ValueError, so callers that caught ValueError still do."""


def check_directory_can_be_made(directory: str, what: str) -> None:
    """Raise UsageError where a file stands at ``directory`` or at one of its
    ancestors, so that it can be neither made nor written into: "``what``:
    ``<file>`` is a file, not a directory". ``os.makedirs`` would fail there
    with a bare "[Errno 17] File exists" (or fairseq's probe of its save dir
    with "Not a directory: '<dir>/dummy'"), naming neither the option nor the
    file in the way. A directory that is missing is fine: it is made later.
    ``what`` names the option or the output, e.g. ``"--save-dir ckpt"``.

    Raises:
        UsageError: as above.
    """
    existing = os.path.abspath(directory)
    while not os.path.exists(existing):  # ends at the file system's root at the latest
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError(f"{what}: {existing} is a file, not a directory")
