"""fairseq-generate and fairseq-interactive over model-parallel groups: how
they launch, which rank reads the prompts and which prints (step 6 of
:mod:`fairseq_megatron.fairseq_integration`; the gathering of several
groups' output is :mod:`fairseq_megatron.fairseq_integration.generate`).

6. :func:`model_parallel_generate` -- ``fairseq-generate`` never started
   torch.distributed, yet sharded its batches by the world size: one
   process generated 1 / world size of the subset (at fairseq's default
   world size, the number of visible GPUs), torchrun's processes each all of
   it. It now launches as fairseq-eval-lm does, at any model-parallel
   size; only model-parallel rank 0 prints, and the output of several
   data-parallel groups is printed once, in one process's order, as each
   round of batches completes, with one score line
   (:mod:`fairseq_megatron.fairseq_integration.generate`; before, the groups wrote over each
   other's ``--results-path`` file).
   fairseq-interactive under torchrun read standard input in every process,
   so the ranks split the lines between them and hung in their first
   collective; now rank 0 reads and sends each buffer of lines to all ranks,
   and only rank 0 prints. The processes that fairseq spawns itself read
   /dev/null as standard input and answered nothing; the launching process
   now passes its standard input on to rank 0 through a named pipe.
"""

import contextlib
import contextvars
import functools
import os
import sys
import threading


from fairseq_megatron.fairseq_integration.patching import StandIn, patch_cli_main, replace_in_cli_module


def _not_model_parallel_rank_0() -> bool:
    from fairseq_megatron.parallel import parallel_state

    return parallel_state.model_parallel_is_initialized() and parallel_state.get_tensor_model_parallel_rank() != 0


def model_parallel_generate() -> None:
    """fairseq-generate over all ranks of the world, and fairseq-interactive under torchrun.

    ``fairseq_cli/generate.py`` calls ``main(args)`` directly, never
    fairseq's distributed launcher, yet shards its batches by the world
    size: at a world size above 1 (fairseq's default is the number of
    visible GPUs) one process generated shard 0 alone, under torchrun every
    process generated everything, and with model parallelism no
    model-parallel group (and no ``-model_part-K`` checkpoint suffix) would
    exist. It now goes through ``distributed_utils.call_main`` first, as
    fairseq-eval-lm and fairseq-interactive do: one process per rank, the
    data sharded over the data-parallel groups. Every rank of a group
    computes the same hypotheses; model-parallel rank 0 prints them (or
    writes ``--results-path``), the others write to /dev/null. With two or
    more groups, :mod:`fairseq_megatron.fairseq_integration.generate` gathers their output
    round by round of batches, and rank 0 prints it once, as it comes, in
    the order of a run in one process, with one score line; a
    ``--results-path`` file is always written whole, under a temporary name
    first, and a ``--results-path`` with a file in its path is one error
    line before the model loads (it was a traceback after generating).
    fairseq-interactive already starts torch.distributed; it only gets the
    printing rule.
    """
    import contextlib

    import torch.distributed as dist
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.distributed import utils as dist_utils

    from fairseq_megatron.fairseq_integration import generate
    from fairseq_megatron.parallel import parallel_state
    from fairseq_megatron.errors import check_directory_can_be_made

    launching = contextvars.ContextVar("launching_fairseq_generate", default=False)

    def wrap_generate(original_main, module):
        def main(cfg):
            if not hasattr(cfg, "common_eval"):  # an argparse Namespace
                cfg = convert_namespace_to_omegaconf(cfg)
            if cfg.common_eval.results_path is not None:  # before the model is loaded, or processes spawned
                check_directory_can_be_made(cfg.common_eval.results_path,
                                            f"--results-path {cfg.common_eval.results_path}")
            if not dist.is_initialized() and not launching.get():
                # call_main runs module.main (this function) in each process it
                # starts, or here with the world size 1
                token = launching.set(True)
                try:
                    return dist_utils.call_main(cfg, module.main)
                finally:
                    launching.reset(token)
            if cfg.common_eval.results_path is not None or (
                    dist.is_initialized() and parallel_state.get_data_parallel_world_size() > 1):
                return generate.generate_over_data_parallel_groups(original_main, cfg)
            if _not_model_parallel_rank_0():
                with open(os.devnull, "w") as devnull:
                    return module._main(cfg, devnull)
            return original_main(cfg)

        return main

    def collected(_main):
        @functools.wraps(_main)
        def main(cfg, output_file):
            output = generate.collecting.get()
            return _main(cfg, output if output is not None else output_file)

        return main

    class ProgressBarCuttingBatches(StandIn):
        """``fairseq.logging.progress_bar`` in fairseq_cli.generate: while
        its output is collected, the batches pass through the collector."""

        def progress_bar(self, *args, **kwargs):
            bar = self.stands_for.progress_bar(*args, **kwargs)
            output = generate.collecting.get()
            return bar if output is None else generate.BatchCuttingProgressBar(bar, output)

    class ScoringOfShards(StandIn):
        """``fairseq.scoring`` in fairseq_cli.generate: while its output is
        collected, the scorer is a :class:`fairseq_megatron.fairseq_integration.generate.ShardScorer`."""

        def build_scorer(self, *args, **kwargs):
            scorer = self.stands_for.build_scorer(*args, **kwargs)
            return scorer if generate.collecting.get() is None else generate.ShardScorer(scorer)

    def wrap_interactive(original_main, module):
        def main(cfg, **kwargs):
            # Every rank reads the same input (see _read_on_rank_0), so every
            # model-parallel group computes the same hypotheses: rank 0 prints.
            if dist.is_initialized() and dist.get_rank() != 0:
                with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
                    return original_main(cfg, **kwargs)
            return original_main(cfg, **kwargs)

        return main

    patch_cli_main("fairseq_cli.generate", wrap_generate)
    replace_in_cli_module("fairseq_cli.generate", "_main", collected)
    replace_in_cli_module("fairseq_cli.generate", "progress_bar", ProgressBarCuttingBatches)
    replace_in_cli_module("fairseq_cli.generate", "StopwatchMeter", lambda _: generate.GenerationTimer)
    replace_in_cli_module("fairseq_cli.generate", "scoring", ScoringOfShards)
    patch_cli_main("fairseq_cli.interactive", wrap_interactive)
    replace_in_cli_module("fairseq_cli.interactive", "buffered_read", _read_on_rank_0)
    replace_in_cli_module("fairseq_cli.interactive", "distributed_utils", _InteractiveLaunch)


class _InteractiveLaunch(StandIn):
    """``fairseq.distributed.utils`` in fairseq_cli.interactive. When fairseq
    is about to spawn the processes itself (no torchrun: ``--distributed-world-size``
    above 1, by default the number of visible GPUs, or SLURM) and the prompts
    come from standard input, which multiprocessing replaces by /dev/null in
    the processes it starts (fairseq-interactive answered nothing and exited
    0), the launching process passes its standard input on to rank 0 through
    a named pipe given as ``--input``, line by line as it arrives."""

    def call_main(self, cfg, main, **kwargs):
        launch = cfg.distributed_training
        if launch.distributed_init_method is None:
            self.stands_for.infer_init_method(launch)  # call_main's first step; it skips it then
        spawning = launch.distributed_init_method is not None and not launch.distributed_no_spawn
        if not spawning or cfg.interactive.input != "-":
            return self.stands_for.call_main(cfg, main, **kwargs)
        with _standard_input_through_a_pipe() as pipe:
            cfg.interactive.input = pipe
            return self.stands_for.call_main(cfg, main, **kwargs)


@contextlib.contextmanager
def _standard_input_through_a_pipe():
    """The path of a named pipe that yields this process's standard input,
    copied line by line by a daemon thread; removed on exit. The thread
    blocks until a reader opens the pipe and ends with the input, or when
    the reader goes away."""
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(prefix="fairseq-interactive-")
    path = os.path.join(directory, "stdin")
    os.mkfifo(path)

    def copy():
        try:
            with open(path, "w", encoding="utf-8") as pipe:
                for line in sys.stdin:
                    pipe.write(line)
                    pipe.flush()
        except (BrokenPipeError, OSError):  # the reader exited first
            pass

    threading.Thread(target=copy, name="stdin-to-rank-0", daemon=True).start()
    try:
        yield path
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _read_on_rank_0(buffered_read):
    """Wrap fairseq-interactive's ``buffered_read(input, buffer_size)`` (a
    generator of lists of lines) so that under torch.distributed only global
    rank 0 reads ``input`` (a file, standard input, or the pipe of
    :func:`_standard_input_through_a_pipe`) and broadcasts each
    list; the others receive the same lists, then ``None`` at the end. The
    broadcasts go over a gloo group of their own with a week's timeout: rank
    0 may wait for a person to type, and the default group would time out.

    Only the ranks of data-parallel group 0 (rank 0's model-parallel group)
    are given the lines to answer: only rank 0 prints, and every other group
    computed the same answers for nothing (fairseq-interactive on 8 GPUs at
    model-parallel size 4 makes two groups). The others keep taking the
    broadcasts, and end with rank 0."""
    import datetime

    import torch.distributed as dist

    from fairseq_megatron.parallel import parallel_state

    @functools.wraps(buffered_read)
    def read(input, buffer_size):
        if not dist.is_initialized() or dist.get_world_size() == 1:
            yield from buffered_read(input, buffer_size)
            return
        answering = not parallel_state.model_parallel_is_initialized() or \
            parallel_state.get_data_parallel_rank() == 0
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=7))
        lines = buffered_read(input, buffer_size) if dist.get_rank() == 0 else None
        while True:
            box = [next(lines, None) if lines is not None else None]
            dist.broadcast_object_list(box, src=0, group=group)
            if box[0] is None:
                return
            if answering:
                yield box[0]

    return read
