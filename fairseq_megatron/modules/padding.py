"""Whether a batch of tokens holds padding, known without waiting for the GPU.

The decoder builds a key-padding mask only for batches that hold padding
(fairseq's ``TransformerDecoder`` does the same): without one, attention takes
the flash kernel. Testing a GPU tensor (``tokens.eq(pad).any()``) makes the host
wait until the GPU has finished all queued work, the previous step's optimizer
included, and the GPU then idles while the host launches the next forward.
The batch was on the CPU a moment earlier, where the same test costs nothing:
our trainer (``MegatronTrainer._prepare_sample``) runs it there and marks the GPU copy with the
answer; :func:`has_padding` reads the mark and falls back to the GPU test for
tensors without one (evaluation, generation, any other caller).

A mark holds the padding index it was computed for and the tensor's version
counter, so a tensor changed in place after marking is tested again.
"""

import torch

_MARK = "_fairseq_megatron_padding"


def mark_padding(tokens: torch.Tensor, padding_idx: int, holds_padding: bool) -> None:
    """Record on ``tokens`` (any shape, integer ids) whether it holds ``padding_idx``."""
    setattr(tokens, _MARK, (padding_idx, tokens._version, bool(holds_padding)))


def has_padding(tokens: torch.Tensor, padding_idx: int) -> bool:
    """``bool(tokens.eq(padding_idx).any())``, from the mark :func:`mark_padding`
    left when it is still valid (same padding index, tensor unchanged since),
    else computed (a device-to-host read for a GPU tensor)."""
    mark = getattr(tokens, _MARK, None)
    if mark is not None and mark[0] == padding_idx and mark[1] == tokens._version:
        return mark[2]
    return bool(tokens.eq(padding_idx).any())
