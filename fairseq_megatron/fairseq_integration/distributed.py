"""``fairseq.distributed.utils`` for model parallelism on machines with or
without GPUs: the ``mpu`` module fairseq imports, how its tools start their
processes, and gathering on CPU.

- :func:`provide_mpu`: fairseq imports ``fairseq.model_parallel.megatron.mpu``
  when ``--model-parallel-size`` > 1, from a git submodule that no pip
  release ships; :mod:`fairseq_megatron.fairseq_integration.mpu` is registered under
  that name.
- :func:`call_main` (every fairseq tool starts through it):

  * On a machine without GPUs, torchrun, SLURM and fairseq's own spawn start
    CPU processes with the gloo backend. fairseq divided by
    ``torch.cuda.device_count()`` under torchrun (ZeroDivisionError), ignored
    torchrun's ``WORLD_SIZE`` unless ``--distributed-world-size`` repeated
    it, defaulted to NCCL, asserted a GPU per process without a launcher
    ("world size is 2 but have 0 available devices"), failed in
    ``torch.cuda.set_device`` under SLURM with one task per process, and
    with one task per node spawned no process and exited 0 with nothing
    trained. Without GPUs every process gets device id 0.
  * The processes fairseq spawns itself (``--distributed-world-size N`` on
    one machine, or one SLURM task per node) import this package before
    fairseq's ``distributed_init``: they imported fairseq afresh and the
    user dir only once ``main`` ran, after ``distributed_init`` had looked
    for the mpu module ("Please install the megatron submodule" at any
    model-parallel size above 1).
  * fairseq-interactive spawned that way read /dev/null as standard input
    and answered nothing; the launching process now passes its standard
    input on to rank 0 through a named pipe given as ``--input``.
  * With ``--user-dir`` of this package, every process builds its parallel
    layout once, from the configuration, before the tool's ``main``
    (:func:`main_in_its_layout`): a size below 1 is one error line (fairseq
    ran a model-parallel size of 0 as size 1), and so is a world size the
    sizes do not divide, and a value of fairseq's own numeric options that no
    run can use (:mod:`.option_values`: ``--update-freq 0``, ``--beam 0``,
    ...); each rank that torchrun or fairseq's own spawn started ends when
    its launcher dies (:func:`_exit_with_the_launcher`): the ranks of a
    torchrun killed with SIGKILL trained on and wrote checkpoints.

  These are the launch fixes that stock fairseq needs too on a machine
  without GPUs (see ``docs/fairseq-changes.md``).
- :func:`all_gather_list`: without GPUs, torch's ``all_gather_object``
  (fairseq stages the data through a CUDA buffer, so fairseq-validate failed
  with two or more data-parallel groups on CPU).
"""

import atexit
import contextlib
import functools
import os
import socket
import sys
import threading
import types

import torch
import torch.distributed as dist
from fairseq.distributed import utils as distributed_utils
from fairseq.utils import safe_getattr

from fairseq_megatron.errors import UsageError
from fairseq_megatron.fairseq_integration.patching import fairseq_tool, original, plugin_on_command_line, replace
from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.parallel.layout import SIZES, check_size
from fairseq_megatron.training.data_parallel import data_parallel_class

_TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


def provide_mpu() -> None:
    """Register :mod:`fairseq_megatron.fairseq_integration.mpu` as
    ``fairseq.model_parallel.megatron.mpu`` (the package attribute included)."""
    import fairseq.model_parallel

    from fairseq_megatron.fairseq_integration import mpu

    package = types.ModuleType("fairseq.model_parallel.megatron")
    package.__path__ = []  # a namespace with one submodule, mpu
    package.mpu = mpu
    sys.modules["fairseq.model_parallel.megatron"] = package
    sys.modules["fairseq.model_parallel.megatron.mpu"] = mpu
    replace(fairseq.model_parallel, "megatron", package,
            "the megatron submodule's mpu, which no pip release of fairseq ships")


def _infer_launch_without_gpus(launch) -> None:
    """Fill in ``launch`` (fairseq's ``cfg.distributed_training``) as fairseq's
    ``infer_init_method`` would, for CPU processes: under torchrun, SLURM, or
    spawned on this machine. ``launch.distributed_num_procs`` is the number of
    processes to spawn here (fairseq counted GPUs)."""
    if all(k in os.environ for k in _TORCHRUN_VARS):
        launch.distributed_init_method = "env://"
        launch.distributed_world_size = int(os.environ["WORLD_SIZE"])
        launch.distributed_rank = int(os.environ["RANK"])
        launch.device_id = 0  # fairseq calls cuda.set_device(id) for id > 0
        launch.distributed_no_spawn = True
        return
    if launch.distributed_world_size <= 1:
        return
    world_size = launch.distributed_world_size
    if distributed_utils._infer_slurm_init(launch, None):  # fairseq's SLURM branch; then the GPU counts fixed
        launch.device_id = 0
        if not launch.distributed_no_spawn:  # one task per node: it counted the node's GPUs
            nodes = int(os.environ["SLURM_NNODES"])
            if world_size % nodes:
                raise UsageError(f"--distributed-world-size {world_size} is not divisible by the {nodes} SLURM "
                                 f"nodes (one task per node spawns the same number on each)")
            launch.distributed_num_procs = world_size // nodes
            launch.distributed_world_size = world_size
            launch.distributed_rank = int(os.environ["SLURM_NODEID"]) * launch.distributed_num_procs
        return
    if launch.distributed_port <= 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            launch.distributed_port = s.getsockname()[1]
    launch.distributed_init_method = f"tcp://localhost:{launch.distributed_port}"
    launch.distributed_num_procs = world_size


def _exit_with_the_launcher() -> None:
    """Have Linux kill this process (SIGKILL) when the process that started
    it dies (``prctl(PR_SET_PDEATHSIG)``), for a rank started by torchrun
    or by fairseq's spawn: nothing else ends a rank whose launcher was
    killed, and such ranks went on training and writing checkpoints. Not on
    other systems; a launcher already gone ends this process now."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    launcher = os.getppid()
    pr_set_pdeathsig = 1  # <linux/prctl.h>
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL) == 0 and os.getppid() != launcher:
        os._exit(1)  # it died before the signal was asked for


def launch_sizes(cfg):
    """``(tensor, pipeline, context)`` parallel sizes of fairseq config
    ``cfg``: ``--model-parallel-size`` and, where the model has them (our
    architectures in fairseq-train), ``--pipeline-model-parallel-size`` and
    ``--context-parallel-size``."""
    model = getattr(cfg, "model", None)
    return (cfg.common.model_parallel_size, int(safe_getattr(model, "pipeline_model_parallel_size", 1) or 1),
            int(safe_getattr(model, "context_parallel_size", 1) or 1))


def runs_our_models(cfg) -> bool:
    """Whether this run is ours: a fairseq tool given ``--user-dir`` of this
    package, or a config whose model is one of our architectures
    (fairseq-megatron-hydra-train, which needs no user dir)."""
    from fairseq_megatron.models.model_parallel_transformer_lm import is_model_parallel_arch

    model = getattr(cfg, "model", None)
    return plugin_on_command_line() or is_model_parallel_arch(
        safe_getattr(model, "_name", None) or safe_getattr(model, "arch", None))


def main_in_its_layout(main, sizes, cfg, **kwargs):
    """``main(cfg, **kwargs)`` once this rank's groups are built for the
    parallel ``sizes`` of ``cfg`` (:func:`launch_sizes`, read once per
    process; :func:`~fairseq_megatron.parallel.parallel_state.ensure_model_parallel`:
    fairseq's ``distributed_init`` built them already at model-parallel size
    > 1; a single process gets the single-process layout). Sharded data
    parallelism (``--ddp-backend fully_sharded``) in one process without a
    launcher gets a world of its own one rank: FSDP2 shards over a process
    group, even of one."""
    if data_parallel_class(getattr(cfg, "distributed_training", None)).needs_a_process_group \
            and not dist.is_initialized():
        parallel_state.start_single_rank_world()
    parallel_state.ensure_model_parallel(*sizes)
    _forget_fairseqs_global_group_at_exit()
    return main(cfg, **kwargs)


@functools.lru_cache(maxsize=None)  # registered once per process
def _forget_fairseqs_global_group_at_exit() -> None:
    """fairseq keeps a group of the whole world on a function attribute
    (``distributed.utils.get_global_group._global_group``) to the end; at a
    normal exit it goes before the process's other groups are released
    (:func:`~fairseq_megatron.parallel.parallel_state.release_process_groups`,
    registered earlier, so it runs after this). Harmless after an error:
    nothing is destroyed then, and torch's registry keeps the group."""
    atexit.register(vars(distributed_utils.get_global_group).pop, "_global_group", None)


def _distributed_main_with_the_plugin(index: int, main, cfg, kwargs, sizes=None) -> None:
    """What each process that fairseq's launch spawns runs: fairseq's
    ``distributed_main``, after this module's import (the process unpickles
    this function by its module path), which installs the plugin. Our
    bad-input errors end as one line here too (torch's spawn catches them
    before the excepthook would); the parent then reports the exit status.
    ``sizes``: in a run of our models, the parallel sizes :func:`call_main`
    read; the process then ends with its launcher
    (:func:`_exit_with_the_launcher`) and takes them for its layout
    (:func:`~fairseq_megatron.parallel.parallel_state.launch_layout`)."""
    from fairseq_megatron.fairseq_integration.one_line_errors import printed_as_one_line

    try:
        if sizes is not None:
            _exit_with_the_launcher()
            parallel_state.launch_layout(*sizes)
        distributed_utils.distributed_main(index, main, cfg, kwargs)
    except Exception as e:
        if printed_as_one_line(e):
            sys.exit(1)
        raise


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


def call_main(cfg, main, **kwargs):
    """fairseq's ``call_main`` (``fairseq/distributed/utils.py``): the launch
    inferred (without GPUs, by :func:`_infer_launch_without_gpus`), then the
    processes spawned with the plugin loaded, or ``main`` run here.

    In a run of our models (:func:`runs_our_models`), the parallel sizes
    are read from ``cfg`` here, once, and checked; every process then takes
    them for its layout (:func:`~fairseq_megatron.parallel.parallel_state.launch_layout`)
    and has its groups built before ``main`` runs (:func:`main_in_its_layout`).

    Raises:
        UsageError: in a run of our models, a parallel size below 1, or an
            impossible value of fairseq's numeric options
            (:func:`.option_values.check_option_values`); SLURM nodes that do
            not divide the world size.
    """
    ours = runs_our_models(cfg)
    sizes = launch_sizes(cfg) if ours else None
    if ours:
        from fairseq_megatron.fairseq_integration.option_values import check_option_values

        for name, size in zip(SIZES, sizes):  # each at least 1, before anything starts; the rest in each process
            check_size(name, size)
        check_option_values(cfg)  # fairseq's own numbers, beside our sizes
        main = functools.partial(main_in_its_layout, main, sizes)
    if ours and os.environ.get("TORCHELASTIC_RUN_ID"):  # a rank that torchrun started
        _exit_with_the_launcher()
    launch = cfg.distributed_training
    if torch.cuda.device_count() == 0 and not cfg.common.tpu:
        if launch.distributed_backend == "nccl":
            launch.distributed_backend = "gloo"  # NCCL needs GPUs
        if launch.distributed_init_method is None:
            _infer_launch_without_gpus(launch)
        elif not launch.distributed_no_spawn:
            launch.distributed_num_procs = launch.distributed_world_size  # fairseq: one per GPU, none
    elif launch.distributed_init_method is None:
        distributed_utils.infer_init_method(launch)  # what fairseq's call_main does first
    if launch.distributed_init_method is None or launch.distributed_no_spawn or cfg.common.tpu:
        if ours:
            parallel_state.launch_layout(*sizes)
        return original(distributed_utils, "call_main")(cfg, main, **kwargs)
    # fairseq's spawn, of processes that load this plugin first
    nprocs = launch.distributed_num_procs if torch.cuda.device_count() == 0 else \
        min(torch.cuda.device_count(), launch.distributed_world_size)
    kwargs["start_rank"] = launch.distributed_rank
    launch.distributed_rank = None  # assigned in each process
    interactive = getattr(cfg, "interactive", None)
    with contextlib.ExitStack() as stack:
        if interactive is not None and interactive.input == "-" and fairseq_tool() == "interactive":
            interactive.input = stack.enter_context(_standard_input_through_a_pipe())
        torch.multiprocessing.spawn(fn=_distributed_main_with_the_plugin, args=(main, cfg, kwargs, sizes),
                                    nprocs=nprocs, join=True)


def all_gather_list(data, group=None, max_size=16384):
    """fairseq's gather of any picklable ``data`` from every rank of
    ``group`` (a list in rank order); without GPUs, torch's
    ``all_gather_object`` (fairseq stages it through a CUDA buffer)."""
    if torch.cuda.is_available() or distributed_utils.use_xla():
        return original(distributed_utils, "all_gather_list")(data, group=group, max_size=max_size)
    if group is None:
        group = distributed_utils.get_global_group()
    gathered = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(gathered, data, group=group)
    return gathered


def install() -> None:
    provide_mpu()
    replace(distributed_utils, "call_main", call_main,
            "CPU processes under torchrun, SLURM or spawn; spawned processes load the plugin")
    replace(distributed_utils, "all_gather_list", all_gather_list, "gathers without a CUDA buffer on CPU")
