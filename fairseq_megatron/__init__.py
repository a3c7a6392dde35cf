"""fairseq_megatron: Megatron-style tensor-model-parallel language models for fairseq.

Load with ``--user-dir $(python -m fairseq_megatron.user_dir)``. Importing the
package registers the ``model_parallel_transformer_lm`` model, the
``transformer_lm_megatron`` and ``transformer_lm_megatron_11b`` archs, the
``vocab_parallel_cross_entropy`` criterion and the ``language_modeling``
task for them, and makes fairseq's ``--model-parallel-size`` work
(:mod:`fairseq_megatron.fairseq_integration`).

The package, by what each part is about, each importing only those before
it: ``parallel/`` (the layout, process groups, communication, RNG streams,
gradient norm), ``modules/`` (the parallel layers and how their parameters
are split), ``models/`` (the model, its decoder, its options, the
registry), ``training/`` (what training applies to a built model, the
pipeline schedule, fused AdamW), ``criterions/``, ``checkpoint/`` (part
files, resharding, export), ``fairseq_integration/`` (where it meets
fairseq), ``cli/`` (its commands), ``hub.py`` (the Python API) and
``planner.py`` (cluster layouts); docs/architecture.md draws it.

State travels on objects (the trainer, the task, the model, the datasets).
The module-level state that changes at run time, each where nothing can
carry it instead:

- the process groups (:mod:`fairseq_megatron.parallel.parallel_state`:
  this process's groups, the layout its launch gave it until they are built,
  since fairseq's ``distributed_init`` asks for them by the tensor-parallel
  size alone, and the patient group of fairseq-interactive) and the RNG
  tracker (:mod:`fairseq_megatron.parallel.rng_tracker`): Megatron's
  process-wide API, which fairseq imports as ``mpu``;
- ``fairseq_integration.train._WRITES_NOTHING``: set while fairseq-train's
  ``main`` runs one of our models under ``--no-save``, for fairseq's probe
  of ``--save-dir``, which is handed the directory alone;
- ``checkpoint.reading._prepared``: the checkpoints prepared in memory
  (resharded, or read once) under the names fairseq's loaders are handed,
  which take a file name alone;
- caches: ``modules.vocab_parallel_cross_entropy._COMPILED`` (the compiled
  kernels, built once), ``checkpoint.integrity._CHECKED`` (each file's CRC
  check, once per process), and the ``functools.lru_cache`` of functions
  that register or warn once per process;
- ``fairseq_integration.patching.REPLACEMENTS`` and
  ``fairseq_integration._INSTALLED``: the replacements of fairseq functions,
  made once per interpreter;
- ``fairseq_integration.eval_lm._run`` and ``fairseq_integration.generate.collecting``:
  fairseq-eval-lm's and fairseq-generate's ``main`` build their task,
  progress bar and scorer themselves, with no argument through which the
  run's settings could reach them.
"""

import contextlib
import logging
import os
import sys
import warnings


@contextlib.contextmanager
def _fairseq_imported_quietly():
    """Hold off what importing fairseq 0.12 does to the whole process, when
    this package imports it first (our command-line tools, a Python program
    using the hub): ``fairseq/models/wav2vec/wav2vec2_classification.py``
    calls ``logging.basicConfig(level=DEBUG)``, after which every library's
    debug messages reach standard error (80 lines of matplotlib's font search
    for one ``fairseq-megatron-plan --png``); ``fairseq/tasks/text_to_speech.py``
    logs "Please install tensorboardX"; fairscale 0.4.13 warns twice at import
    that ``torch.cuda.amp.custom_fwd`` is deprecated. While the root logger
    holds a handler, ``basicConfig`` does nothing. fairseq's own tools
    configure logging and import fairseq before loading a user dir, so there
    this changes nothing."""
    root = logging.getLogger()
    if "fairseq" in sys.modules or root.handlers:
        yield
        return
    placeholder = logging.NullHandler()
    root.addHandler(placeholder)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"fairscale\.")
            yield
    finally:
        root.removeHandler(placeholder)


with _fairseq_imported_quietly():
    from fairseq_megatron import fairseq_integration

    fairseq_integration.install()

    from fairseq_megatron import criterions, models  # noqa: F401  (registers names)

USER_DIR = os.path.dirname(os.path.abspath(__file__))
"""The path to pass as fairseq's ``--user-dir``."""
