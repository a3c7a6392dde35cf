"""fairseq's own numeric options, checked once at launch in runs of this
package's models.

fairseq 0.12 takes most numbers as they come: ``--update-freq 0`` trained
no batch and divided by zero, ``--tokens-per-sample 0`` ended in a
traceback inside the block dataset, ``--dropout 1.5`` in one from
``torch.nn.functional.dropout`` at the first forward, ``--beam 0`` and
``--temperature -1`` in assertions of the sequence generator,
``--batch-size -1`` ran on with batches of one sample. In a fairseq tool
given ``--user-dir`` of this package,
:func:`~fairseq_megatron.fairseq_integration.distributed.call_main` checks
them with our own sizes (``--model-parallel-size``) before any process
starts: one line naming the flag, the value and what it must be.
"""

from typing import Callable, Iterable

from fairseq_megatron.errors import UsageError


def _at_least(low) -> Callable:
    return lambda v: v >= low


def _probability(v) -> bool:
    return 0 <= v <= 1


# (config group, field, flag, test of one value, what a value must be)
BOUNDS = [
    ("optimization", "update_freq", "--update-freq", _at_least(1), "at least 1 (batches accumulated per update)"),
    ("optimization", "lr", "--lr", _at_least(0), "at least 0"),
    ("optimization", "clip_norm", "--clip-norm", _at_least(0), "at least 0 (0: no clipping)"),
    ("optimization", "max_update", "--max-update", _at_least(0), "at least 0 (0: no limit)"),
    ("optimization", "max_epoch", "--max-epoch", _at_least(0), "at least 0 (0: no limit)"),
    ("task", "tokens_per_sample", "--tokens-per-sample", _at_least(1), "at least 1 (tokens per block)"),
    ("dataset", "batch_size", "--batch-size", _at_least(1), "at least 1 (sentences per batch)"),
    ("dataset", "batch_size_valid", "--batch-size-valid", _at_least(1), "at least 1 (sentences per batch)"),
    ("dataset", "max_tokens", "--max-tokens", _at_least(1), "at least 1 (tokens per batch)"),
    ("dataset", "max_tokens_valid", "--max-tokens-valid", _at_least(1), "at least 1 (tokens per batch)"),
    ("dataset", "required_batch_size_multiple", "--required-batch-size-multiple", _at_least(1), "at least 1"),
    ("dataset", "num_workers", "--num-workers", _at_least(0), "at least 0 (0: load in the main process)"),
    ("model", "dropout", "--dropout", _probability, "a probability, from 0 to 1"),
    ("model", "attention_dropout", "--attention-dropout", _probability, "a probability, from 0 to 1"),
    ("model", "activation_dropout", "--activation-dropout", _probability, "a probability, from 0 to 1"),
    ("generation", "beam", "--beam", _at_least(1), "at least 1 (hypotheses kept per step)"),
    ("generation", "nbest", "--nbest", _at_least(1), "at least 1 (hypotheses printed per sentence)"),
    ("generation", "temperature", "--temperature", lambda v: v > 0, "above 0"),
    ("generation", "sampling_topk", "--sampling-topk", lambda v: v == -1 or v >= 1, "-1 (off) or at least 1"),
    ("generation", "sampling_topp", "--sampling-topp", lambda v: v == -1 or 0 < v <= 1,
     "-1 (off) or above 0 and at most 1"),
    ("generation", "max_len_a", "--max-len-a", _at_least(0), "at least 0"),
    ("generation", "max_len_b", "--max-len-b", _at_least(0), "at least 0"),
    ("generation", "min_len", "--min-len", _at_least(1), "at least 1"),
    ("eval_lm", "context_window", "--context-window", _at_least(0), "at least 0 (0: no context)"),
    ("common", "log_interval", "--log-interval", _at_least(1), "at least 1 (updates between log lines)"),
]


def _values(value) -> Iterable:
    return value if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig" else [value]


def check_option_values(cfg) -> None:
    """Refuse a value of fairseq's numeric options (:data:`BOUNDS`) that no
    run can use, and ``--nbest`` above ``--beam`` (fairseq's assertion).
    Options the tool does not have, or not given a value, pass.

    Raises:
        UsageError: "<flag> <value>: <what it must be>", for the first.
    """
    for group, field, flag, allowed, needs in BOUNDS:
        section = getattr(cfg, group, None)
        value = getattr(section, field, None) if section is not None else None
        if value is None or isinstance(value, str):
            continue
        if not all(allowed(v) for v in _values(value)):
            shown = ",".join(str(v) for v in _values(value))
            raise UsageError(f"{flag} {shown}: {needs}")
    generation = getattr(cfg, "generation", None)
    beam, nbest = getattr(generation, "beam", None), getattr(generation, "nbest", None)
    if beam is not None and nbest is not None and nbest > beam:
        raise UsageError(f"--nbest {nbest} is above --beam {beam}: a search keeps at most --beam hypotheses")
