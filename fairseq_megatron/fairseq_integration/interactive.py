"""``fairseq-interactive`` (``fairseq_cli/interactive.py``) over model-parallel groups.

Under torchrun fairseq-interactive read standard input in every process, so
the ranks split the lines between them and hung in their first collective,
and every rank printed. Now rank 0 reads and sends each buffer of lines to
all ranks (:func:`buffered_read`), and only rank 0 prints (:func:`main`).
(When fairseq spawns the processes itself, the launching process passes its
standard input on to rank 0: :mod:`.distributed`.) Both apply to runs of our
models: given ``--user-dir`` of this package, or with its model-parallel
groups made.
"""

import contextlib
import os

import torch.distributed as dist

from fairseq_megatron.fairseq_integration.patching import original, plugin_on_command_line, replace_in_cli_module
from fairseq_megatron.parallel import parallel_state


def _ours() -> bool:
    return plugin_on_command_line() or parallel_state.model_parallel_is_initialized()


def _cli():
    import fairseq_cli.interactive

    return fairseq_cli.interactive


def main(cfg, **kwargs):
    """fairseq-interactive's ``main``; under torch.distributed only rank 0
    prints. Every rank reads the same input (:func:`buffered_read`), so every
    model-parallel group computes the same hypotheses."""
    run = original(_cli(), "main")
    if _ours() and dist.is_initialized() and dist.get_rank() != 0:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            return run(cfg, **kwargs)
    return run(cfg, **kwargs)


def buffered_read(input, buffer_size):
    """fairseq-interactive's ``buffered_read(input, buffer_size)`` (a
    generator of lists of lines); under torch.distributed only global rank 0
    reads ``input`` (a file, standard input, or the launcher's pipe) and
    broadcasts each list; the others receive the same lists, then ``None``
    at the end. The broadcasts go over the world's patient group (gloo, a
    week's timeout): rank 0 may wait for a person to type, and the default
    group would time out.

    Only the ranks of data-parallel group 0 (rank 0's model-parallel group)
    are given the lines to answer: only rank 0 prints, and every other group
    computed the same answers for nothing. The others keep taking the
    broadcasts, and end with rank 0."""
    read = original(_cli(), "buffered_read")
    if not _ours() or not dist.is_initialized() or dist.get_world_size() == 1:
        yield from read(input, buffer_size)
        return
    answering = not parallel_state.model_parallel_is_initialized() or parallel_state.get_data_parallel_rank() == 0
    group = parallel_state.get_patient_group()
    lines = read(input, buffer_size) if dist.get_rank() == 0 else None
    while True:
        box = [next(lines, None) if lines is not None else None]
        dist.broadcast_object_list(box, src=0, group=group)
        if box[0] is None:
            return
        if answering:
            yield box[0]


def install() -> None:
    module = "fairseq_cli.interactive"
    replace_in_cli_module(module, "main", main, "only rank 0 prints under torch.distributed")
    replace_in_cli_module(module, "buffered_read", buffered_read, "rank 0 reads the input and sends it to all")
