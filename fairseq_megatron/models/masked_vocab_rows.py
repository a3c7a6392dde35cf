"""Vocabulary rows the output softmax never predicts (``--masked-vocab-rows``).

A model imported from transformers (:mod:`fairseq_megatron.checkpoint.hf_import`)
has rows the source model lacks: fairseq's special symbols where the source
has none (GPT-2 has no ``<s>``, ``<pad>`` or ``<unk>``), a second row for a
token that also stands as fairseq's ``</s>``, and the padding of the
vocabulary to a multiple of the model-parallel size. Left as rows of zeros,
each would get logit 0, and real models' logits sit far below 0: those
rows would take most of the probability. Their logits are therefore set to
minus infinity in the decoder's output layer (every pass that scores or
predicts: fairseq-eval-lm, the training loss and validation, generation),
so that the softmax is over exactly the source model's rows.

The rows are recorded in the model config as text, ranges of row numbers
(``"0-1,3,50260-50303"``), so that the checkpoint carries them to every
tool and every model-parallel size.
"""

from typing import Iterable, List, Optional

import torch

from fairseq_megatron.errors import UsageError


def parse_rows(text: Optional[str], rows: Optional[int] = None) -> List[range]:
    """The row ranges of ``--masked-vocab-rows text`` (``"A-B,C"``: rows A to
    B inclusive, and C), sorted; ``[]`` for None or an empty text.
    ``rows``: the vocabulary's rows, which every range must lie within.

    Raises:
        UsageError: a part that is not a row number or ``A-B`` with A <= B, or
            a row outside ``[0, rows)``.
    """
    if not text:
        return []
    ranges = []
    for piece in str(text).split(","):
        first, _, last = piece.strip().partition("-")
        try:
            start, end = int(first), int(last or first)
        except ValueError:
            raise UsageError(f"--masked-vocab-rows {text}: {piece!r} is not a row number or a range A-B") from None
        if not 0 <= start <= end:
            raise UsageError(f"--masked-vocab-rows {text}: {piece!r} is not a range of rows A-B with 0 <= A <= B")
        if rows is not None and end >= rows:
            raise UsageError(f"--masked-vocab-rows {text}: row {end} is beyond the vocabulary's {rows} rows")
        ranges.append(range(start, end + 1))
    return sorted(ranges, key=lambda r: r.start)


def format_rows(rows: Iterable[int]) -> str:
    """``rows`` (row numbers, any order) as the text :func:`parse_rows` reads,
    runs of consecutive rows as ranges: ``[0, 1, 3, 7, 8, 9]`` -> ``"0-1,3,7-9"``."""
    out, run = [], None
    for row in sorted(set(rows)):
        if run is not None and row == run[1] + 1:
            run[1] = row
            continue
        if run is not None:
            out.append(run)
        run = [row, row]
    if run is not None:
        out.append(run)
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def local_mask(text: Optional[str], start: int, end: int) -> Optional[torch.Tensor]:
    """The masked rows among this rank's vocabulary shard ``[start, end)``, as
    a bool tensor ``(end - start,)`` (True = masked), or None where none is.

    Raises:
        UsageError: as :func:`parse_rows`.
    """
    mask = None
    for r in parse_rows(text):
        lo, hi = max(r.start, start), min(r.stop, end)
        if lo < hi:
            if mask is None:
                mask = torch.zeros(end - start, dtype=torch.bool)
            mask[lo - start: hi - start] = True
    return mask


def local_mask_of(args, vocab_size: int, tensor_parallel) -> Optional[torch.Tensor]:
    """:func:`local_mask` of ``args.masked_vocab_rows`` for the vocabulary
    shard that rank ``tensor_parallel.rank`` of ``tensor_parallel.size``
    holds of ``vocab_size`` padded rows (contiguous blocks,
    :func:`~fairseq_megatron.modules.vocab_parallel_embedding.vocab_range`)."""
    from fairseq.utils import safe_getattr

    from fairseq_megatron.modules.vocab_parallel_embedding import vocab_range

    start, end = vocab_range(vocab_size, tensor_parallel.rank, tensor_parallel.size)
    return local_mask(safe_getattr(args, "masked_vocab_rows", None), start, end)


def mask_logits_(logits: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Set the logits of masked rows to minus infinity, in place: ``logits``
    ``(..., V_local)`` (this rank's vocabulary shard), ``mask`` ``(V_local,)``
    bool from :func:`local_mask` (None: nothing to do). Returns ``logits``.
    The softmax then gives those rows probability 0 and their gradient is 0."""
    if mask is None:
        return logits
    if mask.device != logits.device:
        mask = mask.to(logits.device)
    return logits.masked_fill_(mask, float("-inf"))
