"""How the plugin reaches fairseq: what ``import fairseq_megatron`` changes in
fairseq (counted from outside, in a fresh interpreter), that no fairseq
attribute is replaced twice, the signatures of everything it replaces or
overrides (so that a fairseq upgrade that changes one fails here, not at a
user's), the version guard, and fairseq's own tests with the plugin loaded."""

import inspect

import pytest

import fairseq_megatron  # noqa: F401  (installs the integration)
from fairseq_megatron.fairseq_integration import patching

# The signature of every fairseq function this package replaces or whose
# method it overrides, as fairseq 0.12.2 / fairseq-fixed 0.12.3.1 define
# them. A change fails here: each replacement calls the original with these
# arguments, and each override is called by fairseq with them.
PINNED = {
    "fairseq.distributed.utils.call_main": "(cfg: fairseq.dataclass.configs.FairseqConfig, main, **kwargs)",
    "fairseq.distributed.utils.all_gather_list": "(data, group=None, max_size=16384)",
    "fairseq.distributed.utils.distributed_main": "(i, main, cfg: fairseq.dataclass.configs.FairseqConfig, kwargs)",
    "fairseq.distributed.utils.infer_init_method": "(cfg: fairseq.dataclass.configs.DistributedTrainingConfig, "
                                                   "force_distributed=False)",
    "fairseq.distributed.utils._infer_slurm_init": "(cfg: fairseq.dataclass.configs.DistributedTrainingConfig, "
                                                   "num_pipelines_per_node)",
    "fairseq.checkpoint_utils.load_checkpoint_to_cpu": "(path, arg_overrides=None, load_on_all_ranks=False)",
    "fairseq.checkpoint_utils.load_model_ensemble_and_task": "(filenames, arg_overrides: Optional[Dict[str, Any]] = "
                                                             "None, task=None, strict=True, suffix='', num_shards=1, "
                                                             "state=None)",
    "fairseq.checkpoint_utils.load_checkpoint": "(cfg: fairseq.dataclass.configs.CheckpointConfig, trainer, "
                                                "**passthrough_args)",
    "fairseq.checkpoint_utils.save_checkpoint": "(cfg: fairseq.dataclass.configs.CheckpointConfig, trainer, "
                                                "epoch_itr, val_loss)",
    "fairseq_cli.train.main": "(cfg: fairseq.dataclass.configs.FairseqConfig) -> None",
    "fairseq_cli.train.train": "(cfg: omegaconf.dictconfig.DictConfig, trainer: fairseq.trainer.Trainer, "
                               "task: fairseq.tasks.fairseq_task.FairseqTask, "
                               "epoch_itr) -> Tuple[List[Optional[float]], bool]",
    "fairseq_cli.train.fsdp_wrap": "(module, min_num_params: Optional[int] = None, **kwargs)",
    "fairseq_cli.eval_lm.main": "(cfg: omegaconf.dictconfig.DictConfig, **unused_kwargs)",
    "fairseq_cli.eval_lm.eval_lm": "(models: List[fairseq.models.fairseq_model.FairseqModel], "
                                   "source_dictionary: fairseq.data.dictionary.Dictionary, batch_iterator: Iterable, "
                                   "post_process: Optional[str] = None, output_word_probs: bool = False, "
                                   "output_word_stats: bool = False, target_dictionary: "
                                   "Optional[fairseq.data.dictionary.Dictionary] = None, softmax_batch: int = 0, "
                                   "remove_bos_token: bool = False, device: Optional[torch.device] = None)",
    "fairseq_cli.generate.main": "(cfg: omegaconf.dictconfig.DictConfig)",
    "fairseq_cli.generate._main": "(cfg: omegaconf.dictconfig.DictConfig, output_file)",
    "fairseq_cli.interactive.main": "(cfg: fairseq.dataclass.configs.FairseqConfig)",
    "fairseq_cli.interactive.buffered_read": "(input, buffer_size)",
    "fairseq_cli.hydra_train._hydra_main": "(cfg: fairseq.dataclass.configs.FairseqConfig, **kwargs) -> float",
    "fairseq.trainer.Trainer.__init__": "(self, cfg: fairseq.dataclass.configs.FairseqConfig, task, model, "
                                        "criterion, quantizer=None)",
    "fairseq.trainer.Trainer.load_checkpoint": "(self, filename, reset_optimizer=False, reset_lr_scheduler=False, "
                                               "optimizer_overrides=None, reset_meters=False)",
    "fairseq.trainer.Trainer.save_checkpoint": "(self, filename, extra_state)",
    "fairseq.trainer.Trainer._build_optimizer": "(self)",
    "fairseq.trainer.Trainer.clip_grad_norm": "(self, clip_norm)",
    "fairseq.trainer.Trainer._prepare_sample": "(self, sample, is_dummy=False)",
    "fairseq.trainer.Trainer._reduce_and_log_stats": "(self, logging_outputs, sample_size, grad_norm=None)",
    "fairseq.trainer.Trainer.get_train_iterator": "(self, epoch, combine=True, load_dataset=True, "
                                                  "data_selector=None, shard_batch_itr=True, "
                                                  "disable_iterator_cache=False)",
    "fairseq.tasks.language_modeling.LanguageModelingTask.build_model": "(self, args, from_checkpoint=False)",
    "fairseq.tasks.language_modeling.LanguageModelingTask.eval_lm_dataloader": (
        "(self, dataset, max_tokens: Optional[int] = 36000, batch_size: Optional[int] = None, "
        "max_positions: Optional[int] = None, num_shards: int = 1, shard_id: int = 0, num_workers: int = 1, "
        "data_buffer_size: int = 10, context_window: int = 0)"),
    "fairseq.tasks.fairseq_task.FairseqTask.get_batch_iterator": (
        "(self, dataset, max_tokens=None, max_sentences=None, max_positions=None, ignore_invalid_inputs=False, "
        "required_batch_size_multiple=1, seed=1, num_shards=1, shard_id=0, num_workers=0, epoch=1, "
        "data_buffer_size=0, disable_iterator_cache=False, skip_remainder_batch=False, grouped_shuffling=False, "
        "update_epoch_batch_itr=False)"),
    "fairseq.tasks.fairseq_task.FairseqTask.filter_indices_by_size": (
        "(self, indices, dataset, max_positions=None, ignore_invalid_inputs=False)"),
    "fairseq.tasks.fairseq_task.FairseqTask.valid_step": "(self, sample, model, criterion)",
    "fairseq.data.fairseq_dataset.FairseqDataset.batch_by_size": (
        "(self, indices, max_tokens=None, max_sentences=None, required_batch_size_multiple=1)"),
}


def _fairseq_object(dotted: str):
    """The object at ``dotted`` as fairseq defines it (the original where this
    package replaced it)."""
    import importlib

    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        rest = parts[split:]
        if len(rest) == 1:
            try:
                return patching.original(owner, rest[0])
            except KeyError:
                return getattr(owner, rest[0])
        value = getattr(owner, rest[0])
        for name in rest[1:]:
            value = vars(value)[name]
        return value
    raise ImportError(dotted)


def test_no_fairseq_attribute_is_replaced_twice():
    keys = [(r.owner, r.name) for r in patching.REPLACEMENTS]
    assert len(keys) == len(set(keys))
    import fairseq.checkpoint_utils

    with pytest.raises(RuntimeError, match="fairseq.checkpoint_utils.save_checkpoint is replaced already"):
        patching.replace(fairseq.checkpoint_utils, "save_checkpoint", lambda *a: None, "again")
    assert len(patching.REPLACEMENTS) == len(keys)


@pytest.mark.parametrize("dotted", sorted(PINNED))
def test_the_fairseq_signatures_we_rely_on(dotted):
    assert str(inspect.signature(_fairseq_object(dotted))) == PINNED[dotted]


def test_every_replacement_is_pinned():
    """A replacement added without pinning the signature it depends on fails
    here (the classes and modules that stand in for fairseq's are checked by
    the tests of their tools)."""
    for r in patching.REPLACEMENTS:
        if inspect.isroutine(r.original):
            assert f"{r.owner}.{r.name}" in PINNED, f"{r.owner}.{r.name} replaced without a pinned signature"
