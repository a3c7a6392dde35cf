"""Where this package meets fairseq 0.12, one module per fairseq object it extends.

Through fairseq's own extension points:

- :mod:`.trainer`: ``MegatronTrainer``, a subclass of fairseq's ``Trainer``
  (fairseq's pattern for model parallelism), for our models at every
  model-parallel size;
- :mod:`.task`: a subclass of fairseq's ``language_modeling`` task,
  registered under its name, that changes nothing until it has built one of
  our models;
- the model, its architectures and the criterion, registered under
  fairseq's model-parallel names (:mod:`fairseq_megatron.models.registry`).

Where no extension point reaches, :func:`install` replaces a fairseq
attribute once, with a function that calls fairseq's own for anything that
is not ours (:mod:`.patching` records each, with its reason;
``docs/fairseq-changes.md`` lists them):

- :mod:`.distributed`: the ``mpu`` module fairseq imports, its launch
  (``call_main``) on machines without GPUs and for processes it spawns, and
  gathering on CPU (``all_gather_list``);
- :mod:`.checkpoint_utils`: loading that runs no code, checkpoints at another
  model-parallel size, fine-tuning from part files, saving part files;
- one module per fairseq tool: :mod:`.train`, :mod:`.eval_lm`,
  :mod:`.generate`, :mod:`.interactive`; what they check at launch:
  :mod:`.save_dir` (one fairseq-train per ``--save-dir``, which must be
  writable) and :mod:`.option_values` (fairseq's own numeric options);
- :mod:`.one_line_errors`: our bad-input errors as one line
  (``sys.excepthook``).

Two of the replacements change fairseq for every model, because without them
stock fairseq does not run here at all: checkpoint loading under
torch >= 2.6, and the launch of CPU processes (torchrun, SLURM, spawn).
Everything else applies to our models, or to runs given ``--user-dir`` of
this package.
"""

from fairseq_megatron.errors import UsageError

SUPPORTED_FAIRSEQ = ("0.12.2", "0.12.3", "0.12.3.1")
"""The fairseq releases this integration was written for: 0.12.2 and
fairseq-fixed 0.12.3.1, the same code with Python 3.11 fixes (which reports
itself as 0.12.3 or 0.12.3.1). The replaced functions' signatures are pinned
by ``tests/unit/test_fairseq_integration.py``."""

_INSTALLED = False  # install() runs once per interpreter


class UnsupportedFairseqError(UsageError):
    """fairseq is not a release this package was written for."""


def check_fairseq_version(version: str) -> None:
    """Raises UnsupportedFairseqError unless ``version`` is in :data:`SUPPORTED_FAIRSEQ`."""
    if version not in SUPPORTED_FAIRSEQ:
        raise UnsupportedFairseqError(
            f"fairseq {version} is installed; fairseq_megatron supports fairseq {', '.join(SUPPORTED_FAIRSEQ)} "
            f"(pip install 'fairseq-fixed==0.12.3.1' on Python >= 3.11, 'fairseq==0.12.2' before)")


def install() -> None:
    """Check fairseq's version, register the task, and make the replacements
    listed above (once per interpreter).

    Raises:
        UnsupportedFairseqError: another fairseq release.
    """
    global _INSTALLED
    if _INSTALLED:
        return
    import fairseq

    check_fairseq_version(fairseq.__version__)
    from fairseq_megatron.fairseq_integration import (
        checkpoint_utils,
        distributed,
        eval_lm,
        generate,
        interactive,
        one_line_errors,
        task,  # noqa: F401  (registers the language_modeling task)
        train,
    )

    distributed.install()
    checkpoint_utils.install()
    train.install()
    eval_lm.install()
    generate.install()
    interactive.install()
    one_line_errors.install()
    _INSTALLED = True
