"""The one error class users of fairseq's command-line tools see as a single line.

:class:`UsageError` marks bad input or a bad launch that the user fixes: a
model-parallel size that does not divide the world size or the model, a
checkpoint part that is missing, truncated or of another size, conflicting
flags. Raised inside ``fairseq-train``, ``fairseq-eval-lm``,
``fairseq-generate`` or ``fairseq-interactive`` with ``--user-dir``, it
reaches the user as one ``error: <message>`` line on standard error (one
per process under torchrun) and exit status 1, instead of a traceback
through fairseq (``fairseq_integration`` step 14); a Python program that
imports the package sees the exception as usual. A path that names nothing
(``FileNotFoundError``, or a directory where a file was meant, or the
reverse) is treated the same, whoever raised it. Set
``FAIRSEQ_MEGATRON_TRACEBACK=1`` to see the traceback. Other exceptions are
bugs, or fairseq's, and keep Python's traceback.
"""


class UsageError(ValueError):
    """Bad input or a bad launch, with a message that says what to change.

    A ValueError, so callers that caught ValueError still do."""
