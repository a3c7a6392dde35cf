"""A single-file checkpoint for fairseq's own, non-parallel ``transformer_lm``
(``fairseq-megatron-reshard --to-fairseq``)."""

import copy
import logging
import dataclasses
import os
import re
from argparse import Namespace
from typing import Optional

from fairseq_megatron.checkpoint.hf_export import refuse_masked_rows, source_rows_beyond
from fairseq_megatron.checkpoint.layout import CheckpointError
from fairseq_megatron.checkpoint.resharding import (
    EMBED_KEYS,
    PartFiles,
    model_config,
    model_part,
    prepare_outputs,
    save_verified,
)

logger = logging.getLogger(__name__)


def _plain(value):
    """Config values as plain Python (no Namespace / omegaconf objects)."""
    if isinstance(value, Namespace):
        value = vars(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def _config_of_args(args) -> dict:
    """The config fairseq's loader makes of a checkpoint that holds argparse
    ``args`` only (fairseq before 0.10, as the published Megatron-11b):
    ``convert_namespace_to_omegaconf``, as plain Python values. Without it
    the export had no task config, and stock fairseq's hub could not load it."""
    if args is None:
        return {}
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    return OmegaConf.to_container(convert_namespace_to_omegaconf(copy.deepcopy(args)), resolve=True)


def fairseq_transformer_lm_config(config, cfg: Optional[dict] = None) -> dict:
    """Our model config translated to fairseq's ``transformer_lm`` dataclass config.

    Keeps the fields ``TransformerLanguageModelConfig`` knows; fields that
    fairseq fills by interpolation (``${task.tokens_per_sample}``,
    ``${common.tpu}``) are resolved from the checkpoint's ``cfg`` (or the
    field's type default), because the exported config stands alone.
    """
    from fairseq.models.transformer_lm import TransformerLanguageModelConfig

    source = _plain(config)
    cfg = cfg or {}
    out = {}
    for field in dataclasses.fields(TransformerLanguageModelConfig):
        if field.name in source:
            value = source[field.name]
            if isinstance(value, bool) and field.type in (int, float, Optional[int], Optional[float]):
                value = int(value)  # base_lm_architecture sets some int fields to False
            out[field.name] = value
            continue
        default = field.default
        m = re.fullmatch(r"\$\{(\w+)\.(\w+)\}", default) if isinstance(default, str) else None
        if m:
            out[field.name] = (cfg.get(m.group(1)) or {}).get(m.group(2), False if field.type is bool else None)
    out["_name"] = "transformer_lm"
    out["decoder_normalize_before"] = True  # every Megatron arch is pre-norm
    return out


def export_to_fairseq(input_path: str, output_path: str, vocab_size: Optional[int] = None,
                      verify: bool = True, parts: Optional[PartFiles] = None) -> str:
    """Write one checkpoint for fairseq's non-parallel ``transformer_lm``.

    The result holds only tensors and plain Python values, so stock fairseq
    loads it without ``--user-dir`` (and even with ``weights_only=True``).
    ``vocab_size`` keeps only the first rows of the (padded) vocabulary: stock
    fairseq builds its embedding with ``len(dictionary)`` rows, the size of
    the data's dict.txt plus 4 special symbols. Rows beyond it belong to
    ``madeupword`` padding symbols, which never occur in data; dropping them
    removes their (small, after training) share of the softmax. ``parts``:
    the input's :class:`PartFiles`, if already opened.

    Raises:
        CheckpointError: as :func:`reshard`, or ``vocab_size`` larger than the
            checkpoint's vocabulary.
        UsageError: masked vocabulary rows among those exported (an
            import's, :func:`~.hf_export.refuse_masked_rows`).
    """
    parts = prepare_outputs(input_path, output_path, [output_path], parts=parts)
    rows = parts.padded_vocab_size
    config = model_config(parts.metadata)
    refuse_masked_rows(config, vocab_size or rows, "--to-fairseq", "fairseq's transformer_lm")
    kept = source_rows_beyond(config, vocab_size or rows, rows)
    if kept > (vocab_size or rows):
        logger.warning(f"--to-fairseq: rows {vocab_size} to {kept - 1} of {input_path}, its source's own beyond its "
                       f"tokenizer (an import's), are left out: fairseq's transformer_lm has a row per symbol of "
                       f"dict.txt; the probabilities change by the share those rows took (--to-hf keeps them)")
    model = model_part(parts, 0, 1, check_replicas=True, progress=None)
    if vocab_size is not None:
        if vocab_size > rows:
            raise CheckpointError(f"vocab size {vocab_size} is larger than the checkpoint's {rows} rows")
        cut = {}  # a tied projection is the embedding's tensor, and stays it; an untied one is cut on its own
        for key in EMBED_KEYS:
            if key in model:
                model[key] = cut.setdefault(id(model[key]), model[key][:vocab_size].clone())
    cfg = _plain(parts.metadata.get("cfg") or _config_of_args(parts.metadata.get("args")))
    cfg["model"] = fairseq_transformer_lm_config(model_config(parts.metadata), cfg)
    cfg.setdefault("common", {})["model_parallel_size"] = 1
    cfg["criterion"] = {"_name": "cross_entropy", "sentence_avg": False}
    history = _plain(parts.metadata.get("optimizer_history") or []) or [{"lr_scheduler_state": {}, "num_updates": 0}]
    for entry in history:  # fairseq reads the last entry when it loads
        entry["criterion_name"] = "CrossEntropyCriterion"
    state = {"args": None, "cfg": cfg, "model": model, "optimizer_history": history, "extra_state": {}}
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    save_verified(state, output_path, verify)
    return output_path

