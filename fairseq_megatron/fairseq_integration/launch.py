"""Launching fairseq's tools: torchrun, SLURM and fairseq's own spawn on
machines with or without GPUs, data parallelism at model-parallel size 1,
and the checks fairseq-train makes before it writes anything (steps 3, 7,
17 and 24 of :mod:`fairseq_megatron.fairseq_integration`).

3. :func:`launch_on_cpu` -- torchrun on a CPU-only machine: fairseq divides
   by ``torch.cuda.device_count()`` (ZeroDivisionError), ignores torchrun's
   WORLD_SIZE unless ``--distributed-world-size`` repeats it, defaults to
   the NCCL backend, and (data parallelism at model-parallel size 1) hands a
   GPU device id to torch's DistributedDataParallel. Without a launcher or
   an init method fairseq asserted a GPU per process ("world size is 2 but
   have 0 available devices"); there they are now CPU processes on a free
   port. Under SLURM without GPUs, one task per process failed in
   ``torch.cuda.set_device``, and one task per node spawned no process and
   exited 0 with nothing trained; each node now spawns its share of
   ``--distributed-world-size``.

7. :func:`data_parallel_only` -- with ``--model-parallel-size 1`` (the
   default) under a distributed launch, fairseq creates no model-parallel
   groups, so building our model failed ("model parallel group is not
   initialized") and pure data-parallel training, evaluation or generation
   of a ``transformer_lm_megatron*`` model was impossible. Now every rank is
   its own model-parallel group of one, and all ranks form the data-parallel
   group; checkpoint names and RNG seeding stay fairseq's size-1 ones.

17. :func:`spawned_processes_install_the_plugin` -- without torchrun
   (``fairseq-train --distributed-world-size 8`` on one machine, or one task
   per node under SLURM) fairseq starts one process per GPU with
   ``torch.multiprocessing.spawn``. Those import fairseq afresh, and the
   user dir only once ``main`` runs, after ``distributed_init`` has looked
   for the mpu module of step 1: "Please install the megatron submodule" at
   any model-parallel size above 1. They now import this package first. On
   a machine without GPUs fairseq spawned no process at all (one per GPU);
   there it spawns the world size.

24. :func:`launch_checked_before_fairseq_train_writes` -- fairseq-train's
   ``main`` creates ``--save-dir`` (and writes a probe file into it) first,
   and only building the model refused ``--model-parallel-size`` > 1 in one
   process without a launcher and ``--ddp-backend fully_sharded``, so both
   left an empty save dir behind; ``--bf16`` without torch_xla and
   ``--fp16`` on CPU failed with tracebacks after building it. ``main`` now
   checks them first, for our architectures (the model's option checks already run while fairseq
   parses the command line), and for any model a ``--save-dir`` with a
   file in its path (fairseq's probe said only "Not a directory:
   '<save-dir>/dummy'"). The refusals that need the task or a
   checkpoint (a dict.txt other than the checkpoint's, training samples
   all longer than the model's positions) come after ``main`` made
   the directory; a run that fails removes the directories it made if they
   are still empty.
"""

import functools
import os
import sys
from typing import Optional

import torch

from fairseq_megatron.fairseq_integration.checkpoint_files import TorchWithTrustedLoad
from fairseq_megatron.fairseq_integration.one_line_errors import printed_as_one_line
from fairseq_megatron.fairseq_integration.patching import StandIn, patch_cli_main


_TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


# Processes that fairseq's spawn starts on a machine without GPUs under SLURM
# with one task per node (step 3); None: all of the world size (step 17).
_cpu_processes_per_node: Optional[int] = None


def launch_on_cpu() -> None:
    from fairseq.distributed import utils as dist_utils

    def infer_torch_distributed_launch_init(cfg):
        """fairseq's torchrun branch, minus the division by the GPU count."""
        cfg.distributed_init_method = "env://"
        cfg.distributed_world_size = int(os.environ["WORLD_SIZE"])
        cfg.distributed_rank = int(os.environ["RANK"])
        n_gpus = torch.cuda.device_count()
        local_rank = int(os.environ.get("LOCAL_RANK", cfg.distributed_rank))
        # On CPU the device id must stay 0: fairseq calls cuda.set_device(id) if id > 0.
        cfg.device_id = local_rank % n_gpus if n_gpus > 0 else 0
        cfg.distributed_no_spawn = True

    original_infer_init_method = dist_utils.infer_init_method

    @functools.wraps(original_infer_init_method)
    def infer_init_method(cfg, force_distributed=False):
        launched_by_torchrun = all(k in os.environ for k in _TORCHRUN_VARS)
        if launched_by_torchrun and cfg.distributed_init_method is None:
            cfg.distributed_world_size = int(os.environ["WORLD_SIZE"])
        if not torch.cuda.is_available() and cfg.distributed_backend == "nccl":
            cfg.distributed_backend = "gloo"  # NCCL needs GPUs
        return original_infer_init_method(cfg, force_distributed)

    original_infer_slurm_init = dist_utils._infer_slurm_init

    @functools.wraps(original_infer_slurm_init)
    def infer_slurm_init(cfg, num_pipelines_per_node):
        """fairseq's SLURM branch, where a GPU count would come in. One
        task per process: the task's device id stays 0 (fairseq called
        ``cuda.set_device(SLURM_LOCALID)``). One task per node: each node
        spawns world size / nodes processes, ranks from node id x that
        (fairseq counted the node's GPUs, none: world size 0, nothing
        spawned, exit status 0 with nothing trained)."""
        global _cpu_processes_per_node
        if torch.cuda.device_count() > 0:
            return original_infer_slurm_init(cfg, num_pipelines_per_node)
        world_size = cfg.distributed_world_size
        if not original_infer_slurm_init(cfg, num_pipelines_per_node):
            return False
        cfg.device_id = 0
        if not cfg.distributed_no_spawn:  # fairseq's one-task-per-node branch
            nodes = int(os.environ["SLURM_NNODES"])
            if world_size % nodes:
                from fairseq_megatron.errors import UsageError

                raise UsageError(f"--distributed-world-size {world_size} is not divisible by the "
                                 f"{nodes} SLURM nodes (one task per node spawns the same number on each)")
            _cpu_processes_per_node = world_size // nodes
            cfg.distributed_world_size = world_size
            cfg.distributed_rank = int(os.environ["SLURM_NODEID"]) * _cpu_processes_per_node
        return True

    original_infer_single_node_init = dist_utils._infer_single_node_init

    @functools.wraps(original_infer_single_node_init)
    def infer_single_node_init(cfg):
        """fairseq's branch for one machine without a launcher, which
        asserts a GPU per process ("world size is 2 but have 0 available
        devices"); without GPUs the processes are CPU processes, spawned by
        step 17, on a free port unless ``--distributed-port`` names one."""
        if torch.cuda.device_count() > 0:
            return original_infer_single_node_init(cfg)
        if cfg.distributed_port <= 0:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                cfg.distributed_port = s.getsockname()[1]
        cfg.distributed_init_method = f"tcp://localhost:{cfg.distributed_port}"

    dist_utils._infer_single_node_init = infer_single_node_init
    dist_utils._infer_torch_distributed_launch_init = infer_torch_distributed_launch_init
    dist_utils._infer_slurm_init = infer_slurm_init
    dist_utils.infer_init_method = infer_init_method

    import fairseq.models
    from fairseq.distributed import ModuleProxyWrapper

    original_ddp = fairseq.models.DistributedFairseqModel

    @functools.wraps(original_ddp)
    def DistributedFairseqModel(args, model, process_group, device):
        """fairseq's pytorch_ddp backend passes ``device_ids=[device_id]``,
        which torch's DDP refuses for a CPU module; on CPU it gets none."""
        if torch.device(device).type != "cpu" or args.ddp_backend not in {"c10d", "pytorch_ddp"}:
            return original_ddp(args, model, process_group, device)
        wrapped = torch.nn.parallel.DistributedDataParallel(
            module=model.to(device),
            broadcast_buffers=args.broadcast_buffers,
            bucket_cap_mb=args.bucket_cap_mb,
            process_group=process_group,
            find_unused_parameters=args.find_unused_parameters,
            gradient_as_bucket_view=args.gradient_as_bucket_view,
        )
        return ModuleProxyWrapper(wrapped)

    fairseq.models.DistributedFairseqModel = DistributedFairseqModel


def data_parallel_only() -> None:
    import torch.distributed as dist
    from fairseq.distributed import utils as dist_utils

    from fairseq_megatron.parallel import parallel_state

    original = dist_utils.distributed_init

    @functools.wraps(original)
    def distributed_init(cfg):
        from fairseq_megatron.models.model_parallel_transformer_lm import check_processes

        # a FairseqConfig, or fairseq's flat Namespace; a size below 1 ran as size 1 in every tool
        common, launch = (cfg.common, cfg.distributed_training) if hasattr(cfg, "common") else (cfg, cfg)
        check_processes(common.model_parallel_size, launch.distributed_world_size)
        rank = original(cfg)  # creates the groups itself when --model-parallel-size > 1
        if dist.is_initialized() and not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1)
        return rank

    dist_utils.distributed_init = distributed_init


def _run_spawned(fn, index: int, *args) -> None:
    """What each process that fairseq spawns runs: ``fn(index, *args)``
    (fairseq's ``distributed_main``), after this module's import (the
    process unpickles this function by its module path), which installs the
    plugin. Our bad-input errors end as one line here too (torch's spawn
    catches them before the excepthook of step 14 would); the parent then
    reports the exit status."""
    try:
        fn(index, *args)
    except Exception as e:
        if printed_as_one_line(e):
            sys.exit(1)
        raise


class _SpawnWithThePlugin(StandIn):
    """``torch.multiprocessing`` as ``fairseq.distributed.utils`` sees it."""

    def __init__(self):
        super().__init__(torch.multiprocessing)

    @staticmethod
    def spawn(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
        if nprocs == 0 and not torch.cuda.is_available():
            # fairseq asks for min(GPU count, world size) processes; args = (main, cfg, kwargs)
            nprocs = _cpu_processes_per_node or args[1].distributed_training.distributed_world_size
        return torch.multiprocessing.spawn(functools.partial(_run_spawned, fn), args, nprocs, join, daemon,
                                           start_method)


class _TorchInDistributedUtils(TorchWithTrustedLoad):
    """``torch`` inside ``fairseq.distributed.utils``: trusted loads (step 4)
    and a ``multiprocessing.spawn`` whose processes install the plugin."""

    multiprocessing = _SpawnWithThePlugin()


def spawned_processes_install_the_plugin() -> None:
    from fairseq.distributed import utils as distributed_utils

    if not isinstance(distributed_utils.torch, _TorchInDistributedUtils):
        distributed_utils.torch = _TorchInDistributedUtils()


def launch_checked_before_fairseq_train_writes() -> None:
    from fairseq import distributed_utils

    from fairseq_megatron.parallel import parallel_state
    from fairseq_megatron.errors import check_directory_can_be_made
    from fairseq_megatron.models.model_parallel_transformer_lm import (
        check_data_parallel_backend,
        check_processes,
        check_training_precision,
        is_model_parallel_arch,
    )

    def wrap_train(original_main, module):
        def main(cfg, **kwargs):
            check_directory_can_be_made(cfg.checkpoint.save_dir, f"--save-dir {cfg.checkpoint.save_dir}")
            # fairseq_cli.train: "arch" in the parsed namespace, "_name" in a Hydra config
            arch = getattr(cfg.model, "_name", None) or getattr(cfg.model, "arch", None)
            if is_model_parallel_arch(arch):
                size = cfg.common.model_parallel_size
                check_processes(size, parallel_state.world_size(None))
                check_data_parallel_backend(cfg.distributed_training.ddp_backend, size, cfg.common.cpu)
                check_training_precision(cfg.common)
            # fairseq's main makes --save-dir on the master rank only
            made = directories_missing(cfg.checkpoint.save_dir) if distributed_utils.is_master(
                cfg.distributed_training) else []
            try:
                return original_main(cfg, **kwargs)
            except BaseException:
                remove_while_empty(made)
                raise

        return main

    patch_cli_main("fairseq_cli.train", wrap_train)


def directories_missing(path: str) -> list:
    """``path`` and those of its ancestors that do not exist, deepest first
    (the walk ends at the file system's root at the latest, which exists)."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def remove_while_empty(directories: list) -> None:
    """``os.rmdir`` each of ``directories`` (deepest first) until one is
    missing or not empty: never removes a file, nor a directory a file is in."""
    for directory in directories:
        try:
            os.rmdir(directory)
        except OSError:
            return
