"""``fairseq-train`` (``fairseq_cli/train.py``) for our models.

- ``Trainer`` and ``MegatronTrainer``, the two classes it builds, are both
  :func:`~fairseq_megatron.fairseq_integration.trainer.build_trainer`, which
  picks our :class:`~fairseq_megatron.fairseq_integration.trainer.MegatronTrainer`
  for our models at every model-parallel size and fairseq's classes otherwise.
- ``main`` checks the training options and the launch before it writes
  anything (the parallel sizes were checked before it, where the layout is
  built; the model's options while fairseq parsed them): fairseq's
  ``main`` creates ``--save-dir`` (and writes a probe file into it) first,
  and ``--ddp-backend fully_sharded`` with fairscale-only options failed
  after building the model (:meth:`~fairseq_megatron.training.data_parallel.DataParallel.check`);
  ``--bf16`` without torch_xla and ``--fp16`` on CPU failed with
  tracebacks after building it; a ``--save-dir`` with a file in its path
  was "Not a directory: '<save-dir>/dummy'", and a read-only one a logged
  warning and a traceback; ``--fp8`` without torchao or a float8 GPU is
  refused here too. It then holds the save dir's lock for
  the run (:mod:`.save_dir`): a second run with the same ``--save-dir`` is
  one line. The refusals that need the task or a checkpoint (a dict.txt
  other than the checkpoint's, training samples all longer than the model's
  positions) come after ``main`` made the directory; a run that fails
  removes the directories it made if they are still empty.
- ``train`` (one epoch) returns at once when the checkpoint it resumed from
  has reached ``--max-update``: fairseq trained one more update before
  testing the limit and saved it over ``checkpoint_last`` (and an interval
  checkpoint), so each rerun of a finished command (a requeued job) moved
  the finished model on by one update.

Each applies to our architectures only.
"""

import argparse
import contextvars
import logging
import os

from fairseq import distributed_utils

from fairseq_megatron.fairseq_integration.patching import original, replace_in_cli_module
from fairseq_megatron.fairseq_integration.trainer import build_trainer, is_our_model

logger = logging.getLogger(__name__)

_MODULE = "fairseq_cli.train"


def _cli():
    import fairseq_cli.train

    return fairseq_cli.train


def main(cfg, **kwargs):
    """fairseq-train's ``main``, after the checks above for our architectures."""
    from fairseq_megatron.errors import check_directory_can_be_made
    from fairseq_megatron.models.model_parallel_transformer_lm import (
        is_model_parallel_arch,
        leave_initial_weights_to_the_trainer,
    )
    from fairseq_megatron.training.data_parallel import data_parallel_class
    from fairseq_megatron.training.float8 import check_fp8_environment
    from fairseq_megatron.training.options import check_training_options, check_training_precision
    from fairseq_megatron.fairseq_integration.save_dir import check_writable, one_run_at_a_time
    from fairseq_megatron.parallel import parallel_state

    run = original(_cli(), "main")
    if isinstance(cfg, argparse.Namespace):
        from fairseq.dataclass.utils import convert_namespace_to_omegaconf

        cfg = convert_namespace_to_omegaconf(cfg)
    # "arch" in the parsed namespace, "_name" in a Hydra config
    arch = getattr(cfg.model, "_name", None) or getattr(cfg.model, "arch", None)
    if not is_model_parallel_arch(arch):
        return run(cfg, **kwargs)
    check_directory_can_be_made(cfg.checkpoint.save_dir, f"--save-dir {cfg.checkpoint.save_dir}")
    take_the_architecture_of_the_checkpoint(cfg, arch)
    layout = parallel_state.get_parallel_layout()  # built from cfg at launch, its sizes checked there
    check_training_options(cfg.model)  # fairseq-train's options, all in the model's config for our archs
    data_parallel = data_parallel_class(cfg.distributed_training)
    data_parallel.check(cfg, layout.pipeline, layout.data, layout.context)
    check_training_precision(cfg.common, fp32_parameters=data_parallel.keeps_fp32_parameters)
    check_fp8_environment(cfg.model, cfg.common.cpu)
    # fairseq builds the model before it looks for a checkpoint: MegatronTrainer draws the weights after
    # parallelizing it, where no checkpoint fills them
    leave_initial_weights_to_the_trainer(cfg.model)
    if cfg.checkpoint.no_save:  # reads --save-dir (to resume) and writes nothing: no lock, no probe, no directory
        token = _WRITES_NOTHING.set(True)
        try:
            return run(cfg, **kwargs)
        finally:
            _WRITES_NOTHING.reset(token)
    check_writable(cfg.checkpoint.save_dir)
    # fairseq's main makes --save-dir on the master rank only
    master = distributed_utils.is_master(cfg.distributed_training)
    made = directories_missing(cfg.checkpoint.save_dir) if master else []
    try:
        with one_run_at_a_time(cfg.checkpoint.save_dir, master, made):
            return run(cfg, **kwargs)
    except BaseException:
        remove_while_empty(made)
        raise


# Set while fairseq's main runs one of our models under --no-save (:func:`main`).
_WRITES_NOTHING = contextvars.ContextVar("writes_nothing", default=False)


def verify_checkpoint_directory(save_dir: str) -> None:
    """fairseq-train's probe of ``--save-dir`` (``fairseq/checkpoint_utils.py``:
    it makes the directory and writes and removes a file ``dummy`` in it),
    skipped for a run of our models under ``--no-save``: fairseq probed it
    then too, so a read-only ``--save-dir`` refused a run that writes nothing."""
    if not _WRITES_NOTHING.get():
        from fairseq import checkpoint_utils

        checkpoint_utils.verify_checkpoint_directory(save_dir)


def take_the_architecture_of_the_checkpoint(cfg, arch: str) -> None:
    """The model options of the checkpoint the run starts from (an imported
    model's, say), where the command line leaves them at ``arch``'s
    defaults (:func:`~fairseq_megatron.models.arguments.architecture_from_checkpoint`):
    fairseq builds the model from the command line alone, before it loads
    the checkpoint, and failed on any difference ("Cannot load model
    parameters ... ensure that the architectures match").

    Raises:
        UsageError: an option given that differs from the checkpoint's.
    """
    from fairseq_megatron.checkpoint.loading import recorded_model_config
    from fairseq_megatron.fairseq_integration.checkpoint_utils import starting_checkpoint
    from fairseq_megatron.models.arguments import architecture_from_checkpoint

    path = starting_checkpoint(cfg.checkpoint)
    recorded = recorded_model_config(path) if path is not None else None
    if recorded is None:
        return
    taken = architecture_from_checkpoint(cfg.model, recorded, arch, path)
    if taken:
        logger.info(f"the model's options from {path}: {' '.join(taken)}")


def train(cfg, trainer, task, epoch_itr):
    """fairseq_cli.train's ``train`` (one epoch), which tests ``--max-update``
    only after each update; every rank has loaded the same update count, so
    all of them stop here alike."""
    max_update = cfg.optimization.max_update
    if is_our_model(trainer.get_model()) and max_update and trainer.get_num_updates() >= max_update:
        logger.info(f"nothing to train: the checkpoint is at update {trainer.get_num_updates()}, "
                    f"--max-update is {max_update}; no checkpoint saved")
        return [None], True  # (validation losses, stop), as after an update that reached the limit
    return original(_cli(), "train")(cfg, trainer, task, epoch_itr)


def directories_missing(path: str) -> list:
    """``path`` and those of its ancestors that do not exist, deepest first
    (the walk ends at the file system's root at the latest, which exists)."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def remove_while_empty(directories: list) -> None:
    """``os.rmdir`` each of ``directories`` (deepest first) until one is
    missing or not empty: never removes a file, nor a directory a file is in."""
    for directory in directories:
        try:
            os.rmdir(directory)
        except OSError:
            return


def fsdp_wrap(module, *args, **kwargs):
    """fairseq-train's ``fsdp_wrap`` (``fairseq/distributed/fully_sharded_data_parallel.py``)
    of the model it builds under ``--ddp-backend fully_sharded``: our models
    come back as they are, and ``MegatronTrainer`` shards them with torch's
    FSDP2 (:mod:`fairseq_megatron.training.fully_sharded`); fairseq wrapped
    them in fairscale's FSDP, which needs CUDA, flattens the parameters and
    cannot hold tensor-parallel parts. Other models get fairseq's."""
    if is_our_model(module):
        return module
    return original(_cli(), "fsdp_wrap")(module, *args, **kwargs)


def install() -> None:
    why = "our models get MegatronTrainer at every model-parallel size, other models fairseq's classes"
    replace_in_cli_module(_MODULE, "Trainer", build_trainer, why)
    replace_in_cli_module(_MODULE, "MegatronTrainer", build_trainer, why)
    replace_in_cli_module(_MODULE, "main", main, "our launch checked before --save-dir is written")
    replace_in_cli_module(_MODULE, "train", train, "a finished run of ours trains and saves nothing")
    from fairseq import checkpoint_utils

    from fairseq_megatron.fairseq_integration.patching import ModuleWith

    replace_in_cli_module(_MODULE, "checkpoint_utils",
                          ModuleWith(checkpoint_utils, verify_checkpoint_directory=verify_checkpoint_directory),
                          "a run of ours under --no-save writes nothing into --save-dir, fairseq's probe included")
    replace_in_cli_module(_MODULE, "fsdp_wrap", fsdp_wrap,
                          "our models are sharded by torch's FSDP2 (MegatronTrainer), not fairscale's FSDP")
