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
  fairseq-train (:mod:`fairseq_megatron.fairseq_integration.one_line_errors`), instead of Hydra's
  report with a traceback; bad model options end it before fairseq
  creates ``checkpoint.save_dir``, and so does a model-parallel size
  without the processes for it (:mod:`fairseq_megatron.fairseq_integration.train`).
"""

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


def hydra_main(cfg: DictConfig) -> float:
    """fairseq's ``hydra_main`` (``fairseq_cli/hydra_train.py``) with our run
    settings and model checks after fairseq's defaults, and our bad-input
    errors as one line (Hydra would report them with a traceback)."""
    from fairseq.dataclass.initialize import add_defaults
    from fairseq_cli import hydra_train

    from fairseq_megatron.fairseq_integration.one_line_errors import printed_as_one_line

    try:
        add_defaults(cfg)
        with_run_settings(cfg)
        check_model_options(cfg)
        return hydra_train._hydra_main(cfg)
    except Exception as error:
        if printed_as_one_line(error):
            sys.exit(1)
        raise


def main() -> None:
    """fairseq's ``cli_main`` of ``fairseq_cli/hydra_train.py``, running :func:`hydra_main`."""
    import hydra

    import fairseq_megatron  # noqa: F401  (installs the plugin before fairseq reads the config)
    from fairseq.dataclass.initialize import hydra_init

    try:
        from hydra._internal.utils import get_args

        config_name = get_args().config_name or "config"
    except Exception:  # as fairseq's: Hydra's argument parser is internal
        config_name = "config"
    hydra_init(config_name)
    hydra.main(config_path="pkg://fairseq.config", config_name="config")(hydra_main)()


if __name__ == "__main__":
    main()
