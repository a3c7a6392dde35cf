#!/usr/bin/env python
"""fairseq-hydra-train for model-parallel language models.

    fairseq-megatron-hydra-train --config-dir configs --config-name megatron_11b \\
        task.data=data-bin common.model_parallel_size=8

Takes exactly the arguments of fairseq's ``fairseq-hydra-train``
(``fairseq_cli/hydra_train.py``: a YAML config plus ``key=value`` overrides)
and runs it with the plugin installed first. The stock tool cannot train
these models: it imports ``common.user_dir`` only inside fairseq-train's
``main``, after torch.distributed and the model-parallel groups are set up,
so at ``common.model_parallel_size`` > 1 it stops with fairseq's "Please
install the megatron submodule" (and on a CPU-only machine under torchrun
with a ZeroDivisionError first). ``common.user_dir`` is not needed here.

Two more differences from the stock tool, both for our architectures only:

- The model config gets the run's settings that fairseq-train's flat
  namespace gives every model and that the model reads (the model-parallel
  size, ``cpu``, the precision flags, ``update_freq``, the task's sequence
  length; see :data:`RUN_SETTINGS`), as interpolations of the config's own
  values; a key the model config sets itself is kept. The checkpoints then
  record them as fairseq-train's do, so ``fairseq-eval-lm`` and the other
  tools load them at any model-parallel size.
- Bad input (:class:`~fairseq_megatron.errors.UsageError`, a missing
  file) ends as one ``error: ...`` line and exit status 1, as in
  fairseq-train (``fairseq_integration`` step 14), instead of Hydra's
  report with a traceback; bad model options end it before fairseq
  creates ``checkpoint.save_dir``, and so does a model-parallel size
  without the processes for it (``fairseq_integration`` step 24).
"""

import functools
import sys

from omegaconf import DictConfig, OmegaConf, open_dict

# Model-config key -> where fairseq's FairseqConfig keeps that setting. The
# first seven are read by ModelParallelTransformerLanguageModel.build_model;
# the last three are those fairseq's own TransformerLanguageModelConfig
# interpolates the same way.
RUN_SETTINGS = {
    "model_parallel_size": "common.model_parallel_size",
    "cpu": "common.cpu",
    "fp16": "common.fp16",
    "memory_efficient_fp16": "common.memory_efficient_fp16",
    "amp": "common.amp",
    "update_freq": "optimization.update_freq",
    "tokens_per_sample": "task.tokens_per_sample",
    "max_target_positions": "task.max_target_positions",
    "add_bos_token": "task.add_bos_token",
    "tpu": "common.tpu",
}


def with_run_settings(cfg: DictConfig) -> None:
    """Give ``cfg.model`` the :data:`RUN_SETTINGS` it lacks, as interpolations
    (``${common.model_parallel_size}``, ...) that fairseq's ``_hydra_main``
    resolves; only for this package's architectures, and only keys that
    ``cfg`` has. Changes ``cfg`` in place."""
    from fairseq_megatron.models.model_parallel_transformer_lm import is_model_parallel_arch

    model = cfg.get("model")
    if not isinstance(model, DictConfig) or not is_model_parallel_arch(model.get("_name")):
        return
    with open_dict(model):
        for key, source in RUN_SETTINGS.items():
            if key not in model and OmegaConf.select(cfg, source, default=None) is not None:
                model[key] = "${" + source + "}"


def check_model_options(cfg: DictConfig) -> None:
    """Run our architecture's function, and with it
    :func:`~fairseq_megatron.models.model_parallel_transformer_lm.check_options`,
    on a resolved copy of ``cfg.model``: bad model options stop the run
    before fairseq-train creates ``checkpoint.save_dir``, as they do in
    fairseq-train's parser. Other models' configs are left alone.

    Raises:
        UsageError: what :func:`check_options` refuses.
    """
    from argparse import Namespace

    from fairseq.models import ARCH_CONFIG_REGISTRY

    from fairseq_megatron.models.model_parallel_transformer_lm import is_model_parallel_arch

    model = cfg.get("model")
    if not isinstance(model, DictConfig) or not is_model_parallel_arch(model.get("_name")):
        return
    ARCH_CONFIG_REGISTRY[model._name](Namespace(**OmegaConf.to_container(model, resolve=True)))


def _install_into(hydra_train) -> None:
    """Wrap the two functions of module ``fairseq_cli.hydra_train`` that
    its ``hydra_main`` looks up at call time."""
    original_add_defaults = hydra_train.add_defaults

    @functools.wraps(original_add_defaults)
    def add_defaults(cfg):
        original_add_defaults(cfg)
        with_run_settings(cfg)
        check_model_options(cfg)

    original_hydra_main = hydra_train._hydra_main

    @functools.wraps(original_hydra_main)
    def _hydra_main(cfg, **kwargs):
        from fairseq_megatron.fairseq_integration.one_line_errors import printed_as_one_line

        try:
            return original_hydra_main(cfg, **kwargs)
        except Exception as error:  # Hydra would report it with a traceback
            if printed_as_one_line(error):
                sys.exit(1)
            raise

    hydra_train.add_defaults = add_defaults
    hydra_train._hydra_main = _hydra_main


def main() -> None:
    import fairseq_megatron  # noqa: F401  (installs the plugin before fairseq reads the config)
    from fairseq_cli import hydra_train

    _install_into(hydra_train)
    hydra_train.cli_main()


if __name__ == "__main__":
    main()
