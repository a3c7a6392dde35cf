"""Everything the plugin changes in an installed fairseq 0.12, in one place.

Called once by ``import fairseq_megatron`` (which ``--user-dir`` triggers in
every process, before fairseq initialises torch.distributed). Each step fixes
one fact listed in the project's FAIRSEQ_FACTS.md:

1. :func:`_provide_mpu` -- registers :mod:`fairseq_megatron.mpu` as
   ``fairseq.model_parallel.megatron.mpu``, the module fairseq imports when
   ``--model-parallel-size > 1`` (no pip release ships the git submodule).
2. :func:`_enable_megatron_trainer` -- ``fairseq_cli/train.py`` imported
   ``MegatronTrainer`` before any user dir, so its "submodule present" flag is
   already False; set it and bind the names it failed to import. Its
   ``clip_grad_norm`` counted the parameters every rank holds in full (layer
   norms, row-parallel biases) once per rank, so ``gnorm`` and clipping
   depended on the model-parallel size; now each counts once
   (:mod:`fairseq_megatron.grad_norm`). The ``crash.pt`` that fairseq's
   trainer writes on a FloatingPointError had no part suffix, so every rank
   of a group wrote (and renamed) the same file: one rank's part survived
   under a whole checkpoint's name, and the other rank could fail with
   FileNotFoundError instead of the real error. Each rank now writes its
   own ``crash-model_part-K.pt``.
3. :func:`_launch_on_cpu` -- torchrun on a CPU-only machine: fairseq divides
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
4. :func:`_trusted_checkpoint_loading` -- torch >= 2.6 loads with
   ``weights_only=True``; fairseq checkpoints hold argparse/omegaconf objects.
   fairseq's checkpoint loader again loads full pickles, and so does its
   ``broadcast_object``, which sends a loaded checkpoint to the other ranks
   of a data-parallel group (it failed for any training resumed with two or
   more groups). **Only load checkpoints you trust** (your own, or the
   published Megatron-11b files): unpickling can run code. A file that is
   not a checkpoint fails with one error line naming it (fairseq: torch's
   unpickling traceback).
5. :func:`_shard_by_data_parallel_rank` -- ``fairseq-eval-lm`` and
   ``fairseq-generate`` shard the data by global rank, so the ranks of one
   model-parallel group would see different batches. With model parallelism
   the shards follow the data-parallel rank instead: every token is scored
   once, by a whole group. fairseq-eval-lm's ``--context-window`` dataset
   crashed on uneven shards and gave wrong contexts once batches were split
   over shards or workers, and each group printed its own shard's
   perplexity (and words, with ``--output-word-probs`` or
   ``--output-word-stats``); :mod:`fairseq_megatron.eval_lm` fixes the three, and
   refuses settings that leave no token to score (fairseq printed
   perplexity 1.00, or failed with ZeroDivisionError).
6. :func:`_model_parallel_generate` -- ``fairseq-generate`` never started
   torch.distributed, yet sharded its batches by the world size: one
   process generated 1 / world size of the subset (at fairseq's default
   world size, the number of visible GPUs), torchrun's processes each all of
   it. It now launches as fairseq-eval-lm does, at any model-parallel
   size; only model-parallel rank 0 prints, and the output of several
   data-parallel groups is printed once, in one process's order, as each
   round of batches completes, with one score line
   (:mod:`fairseq_megatron.generate`; before, the groups wrote over each
   other's ``--results-path`` file).
   fairseq-interactive under torchrun read standard input in every process,
   so the ranks split the lines between them and hung in their first
   collective; now rank 0 reads and sends each buffer of lines to all ranks,
   and only rank 0 prints. The processes that fairseq spawns itself read
   /dev/null as standard input and answered nothing; the launching process
   now passes its standard input on to rank 0 through a named pipe.
7. :func:`_data_parallel_only` -- with ``--model-parallel-size 1`` (the
   default) under a distributed launch, fairseq creates no model-parallel
   groups, so building our model failed ("model parallel group is not
   initialized") and pure data-parallel training, evaluation or generation
   of a ``transformer_lm_megatron*`` model was impossible. Now every rank is
   its own model-parallel group of one, and all ranks form the data-parallel
   group; checkpoint names and RNG seeding stay fairseq's size-1 ones.
8. :func:`_fused_adam_without_apex` -- ``--optimizer adam`` uses a fused
   kernel (torch's fused AdamW) when apex is absent, and that kernel also
   applies fairseq's gradient multiply and clipping; see
   :mod:`fairseq_megatron.fused_adam`.
9. :func:`_step_log_without_device_wait` -- after every optimizer step the
   trainer's ``_reduce_and_log_stats`` waited for the GPU twice: it tested
   the gradient norm for finiteness (train_step had tested it before the
   step) and rounded the step's loss into a dictionary that
   ``fairseq-train`` only compares with None. The host then sat idle until
   the optimizer's kernels finished, and the GPU sat idle while the host
   prepared the next batch. The same meters are logged; the dictionary is
   rounded when first read.
10. :func:`_quiet_prefetch_threads_at_exit` -- fairseq's ``BufferedIterator``
   prefetches batches in a daemon thread that is still collating (torch
   code) when a run stops before the end of its epoch; the process then
   sometimes aborted at exit ("terminate called without an active
   exception", exit code -6) after a successful run. Those threads are now
   stopped and joined before the interpreter shuts down.
11. :func:`_padding_known_on_the_host` -- our decoder asks whether a batch
   holds padding (to build an attention mask only then), and on the GPU that
   question waited for the previous step's optimizer to finish. The trainer
   now answers it while the batch is still on the CPU and marks the GPU copy
   (:mod:`fairseq_megatron.padding`).
12. :func:`_nonfinite_gradients_skipped_on_the_device` -- before every
   update the trainer tested the gradient norm on the host
   (``torch.isfinite(grad_norm)``, to raise FloatingPointError before the
   weights change), which waited for the whole backward pass. With our fused
   AdamW (``--bf16-autocast`` or fp32 training with ``--optimizer adam``)
   the kernel now skips such an update on the device, and the error is
   raised at the next update (or when a checkpoint would be saved) with the
   number of the update skipped. ``--fp16`` and ``--amp`` keep fairseq's
   test: their loss scaler reads the norm anyway; with several data-parallel
   groups, fairseq's check that they all got the same norm still reads it.
13. :func:`_checkpoints_at_another_model_parallel_size` -- fairseq loads
   only the file of its own model-parallel size (``model.pt`` at size 1,
   ``model-model_part-K.pt`` above), so a checkpoint saved at another size
   was "Model file not found". fairseq-eval-lm, fairseq-generate,
   fairseq-interactive and the hub interface now build each rank's part in
   memory from the parts that exist (the 8 published Megatron-11b parts on
   one GPU, say; :func:`fairseq_megatron.checkpoint_resharding.resharded_model`).
   Every rank checks that no part file is cut short before any rank loads
   one: a truncated part made its rank fail inside torch.load while the
   others reported a lost connection.
14. :func:`_one_line_errors` -- our errors for bad input or a bad launch
   (:class:`fairseq_megatron.errors.UsageError`) reached the user as a
   traceback through fairseq, with the message on its last line; they are
   now printed as one ``error: ...`` line (exit status 1). So are missing
   files and directories, whoever finds them (fairseq's "Dataset not found",
   a data directory without dict.txt, a ``--path`` that names nothing: it was
   fairseq's traceback, naming one rank's part). Only in those tools: a
   Python program that imports the package keeps its tracebacks.
   ``FAIRSEQ_MEGATRON_TRACEBACK=1`` shows the traceback.
15. :func:`_training_from_checkpoints_at_another_size` -- fairseq-train
   resuming in a save dir whose checkpoint has another size silently started
   from scratch; it now stops and says how to reshard (with the optimizer
   state: ``fairseq-megatron-reshard --keep-optimizer``). With
   ``--reset-optimizer`` the weights are resharded in memory instead, unless
   the run would save its checkpoints beside them in the same save dir (one
   name would then hold two sizes). ``--finetune-from-model CKPT.pt`` looked for the file CKPT.pt alone, so a
   checkpoint in parts "does not exist", one file went whole into every
   rank, and a part's name (``CKPT-model_part-0.pt``) trained every rank on
   part 0's weights without a word; it now loads each rank's part, or builds
   it in memory, from a checkpoint saved at any size, and refuses a part's
   name. A checkpoint whose vocabulary rows differ from those fairseq-train
   built (saved at a size that padded the dictionary differently) stops with
   the ``--padded-vocab-size`` to pass; fairseq said "Cannot load model
   parameters". Every rank checks the part files for truncation first.
   A ``--restore-file`` (or, on a first launch, ``--continue-once``) that
   names no checkpoint, or a ``--finetune-from-model`` directory, made
   fairseq train from scratch and save over the save dir's
   ``checkpoint_last``; it now stops the run. With ``--store-ema`` the EMA
   weights of a checkpoint of another size are resharded in memory with the
   weights (every rank got part 0's: a size mismatch), and a checkpoint
   without EMA weights starts the EMA from its weights (fairseq meant to,
   but read them after deleting them: ``KeyError: 'model'``).
16. :func:`_broadcast_from_a_rank_of_the_group` -- with several data-parallel
   groups the trainer reads a checkpoint on each group's first rank and
   sends it to the others with fairseq's ``broadcast_object(state,
   src_rank=0, group)``, which handed torch the rank within the group where
   torch takes a global rank: "Global rank 0 is not part of group" on every
   model-parallel rank but 0, so no run with model and data parallelism
   could resume or fine-tune. (The receiving ranks' unpickling is step 4's.)
17. :func:`_spawned_processes_install_the_plugin` -- without torchrun
   (``fairseq-train --distributed-world-size 8`` on one machine, or one task
   per node under SLURM) fairseq starts one process per GPU with
   ``torch.multiprocessing.spawn``. Those import fairseq afresh, and the
   user dir only once ``main`` runs, after ``distributed_init`` has looked
   for the mpu module of step 1: "Please install the megatron submodule" at
   any model-parallel size above 1. They now import this package first. On
   a machine without GPUs fairseq spawned no process at all (one per GPU);
   there it spawns the world size.
18. :func:`_fairseq_validate_across_ranks` -- ``fairseq-validate`` under a
   distributed launch printed its configuration and result once per rank
   (it resets the logging that ``distributed_init`` had quieted on every
   rank but 0); now rank 0 prints. With two or more data-parallel groups on
   a machine without GPUs it failed gathering their results: fairseq's
   ``all_gather_list`` allocates a CUDA buffer. There it now gathers with
   torch's ``all_gather_object``. With a number of batches that the groups
   do not divide it failed on any machine (``KeyError: 'net_input'``): the
   empty batch that fairseq pads a short shard with now scores nothing.
19. :func:`_evaluation_scores_every_sample` -- fairseq's ``batch_by_size``
   drops the last batch when its size is not a multiple of
   ``--required-batch-size-multiple`` (8 by default; facebookresearch/fairseq
   issue 5036), so fairseq-validate, fairseq-train's validation and
   fairseq-generate silently skipped up to 7 samples of every subset (with
   ``--batch-size 4``, 4 of the test model's 44 validation blocks; with
   ``--batch-size 6``, 2). There it is now kept. Training batches are left
   as fairseq makes them (fixed shapes for compiled steps). Samples longer
   than the model's positions are refused by evaluations without
   ``--skip-invalid-size-inputs-valid-test`` in one line (fairseq: a bare
   Exception's traceback), fairseq-eval-lm included, which skipped them
   whatever the flag said and printed the loss of the others. Where the
   samples are skipped (training, or with that flag) and none is left, the
   run stops with one line: fairseq failed with an IndexError in
   ``batch_by_size``.
20. :func:`_resuming_at_another_data_parallel_size` -- a checkpoint records
   how far its epoch got as the number of batches each data-parallel group
   had taken. Resumed with another number of groups (more GPUs, or a
   checkpoint resharded to another model-parallel size on the same GPUs),
   fairseq read that count per group of the new run: with fewer groups it
   trained batches again, with more it skipped batches of the epoch. The
   count is now converted through the batches taken in all.
21. :func:`_keep_best_checkpoints_of_model_parts` -- ``fairseq-train
   --keep-best-checkpoints N`` at model-parallel size > 1 stopped at its
   second validation with "ValueError: could not convert string to float:
   'part-0.pt'": fairseq reads the score of the worst kept checkpoint back
   from its file name by splitting at the last "_", and the part suffix
   ``-model_part-K`` has one. For such suffixes the best-N files are now
   kept here, named, chosen and removed as fairseq does.
22. :func:`_checkpoint_copies_written_whole` -- fairseq-train writes a
   save's first file under a temporary name and renames it, but makes the
   others (``checkpoint_last`` after an epoch or ``--save-interval-updates``
   checkpoint, ``checkpoint_best``) with ``PathManager.copy``, in place: a run
   killed during that copy left a truncated ``checkpoint_last`` to resume
   from. Local copies now go to a temporary name in the same directory and
   are renamed over the old file.
23. :func:`_part_names_under_directories_with_pt` -- fairseq names a rank's
   part of ``--restore-file``/``--finetune-from-model`` (and of ``--path``)
   with ``name.replace(".pt", suffix + ".pt")``, which also rewrites a ".pt"
   inside a directory name: ``runs/wiki.ptb/model.pt`` became
   ``runs/wiki-model_part-0.ptb/model-model_part-0.pt``. fairseq-train then
   logged "No existing checkpoint found" and trained from scratch;
   fairseq-eval-lm stopped with "Model file not found". Only the file name's
   ".pt" ending takes the suffix now.
24. :func:`_launch_checked_before_fairseq_train_writes` -- fairseq-train's
   ``main`` creates ``--save-dir`` (and writes a probe file into it) first,
   and only building the model refused ``--model-parallel-size`` > 1 in one
   process without a launcher and ``--ddp-backend fully_sharded``, so both
   left an empty save dir behind. ``main`` now checks them first, for our
   architectures (the model's option checks already run while fairseq
   parses the command line). The refusals that need the task or a
   checkpoint (a dict.txt other than the checkpoint's, training samples
   all longer than the model's positions) come after ``main`` made
   the directory; a run that fails removes the directories it made if they
   are still empty.
25. :func:`_finished_training_left_as_it_is` -- fairseq-train resumed from a
   checkpoint that has reached ``--max-update`` (the same command run again,
   a requeued job) trained one more update before testing the limit, and
   saved it over ``checkpoint_last`` (and an interval checkpoint): each
   rerun moved the finished model on by one update. It now logs that there
   is nothing to train and stops without saving.
"""

import atexit
import collections.abc
import contextlib
import contextvars
import copy
import functools
import logging
import os
import re
import sys
import threading
import time
import types
import weakref
from typing import Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)

_INSTALLED = False
_TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
# Processes that fairseq's spawn starts on a machine without GPUs under SLURM
# with one task per node (step 3); None: all of the world size (step 17).
_cpu_processes_per_node: Optional[int] = None


def install() -> None:
    """Apply all integration steps (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _provide_mpu()
    _enable_megatron_trainer()
    _launch_on_cpu()
    _trusted_checkpoint_loading()
    _shard_by_data_parallel_rank()
    _model_parallel_generate()
    _data_parallel_only()
    _fused_adam_without_apex()
    _step_log_without_device_wait()
    _quiet_prefetch_threads_at_exit()
    _padding_known_on_the_host()
    _nonfinite_gradients_skipped_on_the_device()
    _checkpoints_at_another_model_parallel_size()
    _one_line_errors()
    _training_from_checkpoints_at_another_size()
    _broadcast_from_a_rank_of_the_group()
    _spawned_processes_install_the_plugin()
    _fairseq_validate_across_ranks()
    _evaluation_scores_every_sample()
    _resuming_at_another_data_parallel_size()
    _keep_best_checkpoints_of_model_parts()
    _checkpoint_copies_written_whole()
    _part_names_under_directories_with_pt()
    _launch_checked_before_fairseq_train_writes()
    _finished_training_left_as_it_is()
    _INSTALLED = True


def _provide_mpu() -> None:
    import fairseq.model_parallel

    from fairseq_megatron import mpu

    package = types.ModuleType("fairseq.model_parallel.megatron")
    package.__path__ = []  # a namespace with one submodule, mpu
    package.mpu = mpu
    sys.modules["fairseq.model_parallel.megatron"] = package
    sys.modules["fairseq.model_parallel.megatron.mpu"] = mpu
    fairseq.model_parallel.megatron = package


def _enable_megatron_trainer() -> None:
    from fairseq.model_parallel import megatron_trainer

    from fairseq_megatron import mpu, parallel_state
    from fairseq_megatron.grad_norm import model_parallel_norm_aggregator

    for name in (
        "get_data_parallel_group",
        "get_data_parallel_rank",
        "get_data_parallel_world_size",
        "get_model_parallel_group",
        "get_model_parallel_src_rank",
        "get_cuda_rng_tracker",
    ):
        setattr(megatron_trainer, name, getattr(mpu, name))
    megatron_trainer.has_megatron_submodule = True

    def clip_grad_norm(self, clip_norm):
        """Clip by the norm of the whole model, replicated parameters counted
        once (fairseq's counts them once per model-parallel rank)."""
        aggregate = model_parallel_norm_aggregator(self.model, parallel_state.get_tensor_model_parallel_group())
        return self.optimizer.clip_grad_norm(clip_norm, aggregate_norm_fn=aggregate)

    megatron_trainer.MegatronTrainer.clip_grad_norm = clip_grad_norm

    original_save = megatron_trainer.MegatronTrainer.save_checkpoint

    @functools.wraps(original_save)
    def save_checkpoint(self, filename, extra_state):
        suffix = self.checkpoint_suffix  # "-model_part-K" (fairseq's distributed_init sets it)
        if suffix and filename.endswith(".pt") and not filename.endswith(suffix + ".pt"):
            filename = filename[: -len(".pt")] + suffix + ".pt"  # crash.pt; the others have it
        return original_save(self, filename, extra_state)

    megatron_trainer.MegatronTrainer.save_checkpoint = save_checkpoint


def _launch_on_cpu() -> None:
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


class _StandIn(types.ModuleType):
    """Stands in for module ``stands_for`` as a global of one fairseq module:
    that module's names (looked up on each use), except those a subclass
    defines."""

    def __init__(self, stands_for: types.ModuleType):
        super().__init__(stands_for.__name__)
        self.stands_for = stands_for

    def __getattr__(self, name):
        return getattr(self.stands_for, name)


class _TorchStandIn(_StandIn):
    """Stands in for ``torch`` as the global ``torch`` of one fairseq module."""

    def __init__(self):
        super().__init__(torch)


class _TorchWithTrustedLoad(_TorchStandIn):
    """``torch`` inside ``fairseq.checkpoint_utils`` and
    ``fairseq.distributed.utils`` (which unpickles a checkpoint state sent
    from another rank): ``torch.load`` defaults to ``weights_only=False``
    there. A file that cannot be read (not a torch file, cut short in the
    legacy format) raises CheckpointError naming it, which fairseq's tools
    print as one line; fairseq let torch's unpickling error through, a
    traceback that did not name the file."""

    @staticmethod
    def load(f, *args, **kwargs):
        from fairseq_megatron.checkpoint_layout import CheckpointError

        kwargs.setdefault("weights_only", False)
        name = getattr(f, "name", f if isinstance(f, (str, os.PathLike)) else None)
        try:
            return torch.load(f, *args, **kwargs)
        except MemoryError:
            raise
        except Exception as e:
            if name is None:  # a buffer sent by another rank: not the user's file
                raise
            raise CheckpointError(f"cannot read {name}: {type(e).__name__}: {e}") from e


def _trusted_checkpoint_loading() -> None:
    from fairseq import checkpoint_utils
    from fairseq.distributed import utils as distributed_utils

    for module in (checkpoint_utils, distributed_utils):
        if not isinstance(module.torch, _TorchWithTrustedLoad):
            module.torch = _TorchWithTrustedLoad()


def _data_parallel_shard(num_shards: int, shard_id: int):
    """Map fairseq's global-rank sharding onto data-parallel ranks under model parallelism.

    fairseq-eval-lm and fairseq-generate pass ``num_shards=world size,
    shard_id=global rank``; the trainer already passes data-parallel values
    (which differ from those whenever model parallelism is on), so only the
    global ones are rewritten.
    """
    import torch.distributed as dist

    from fairseq_megatron import parallel_state

    if (
        parallel_state.model_parallel_is_initialized()
        and parallel_state.get_tensor_model_parallel_world_size() > 1
        and num_shards == dist.get_world_size()
        and shard_id == dist.get_rank()
    ):
        return parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    return num_shards, shard_id


def _shard_by_data_parallel_rank() -> None:
    from fairseq.tasks.fairseq_task import FairseqTask
    from fairseq.tasks.language_modeling import LanguageModelingTask

    from fairseq_megatron import eval_lm

    LanguageModelingTask.eval_lm_dataloader = eval_lm.eval_lm_dataloader
    _replace_in_cli_module("fairseq_cli.eval_lm", "SequenceScorer", lambda _: eval_lm.TallyingSequenceScorer)
    _replace_in_cli_module("fairseq_cli.eval_lm", "eval_lm", eval_lm.eval_lm_over_data_parallel_groups)
    _patch_cli_main("fairseq_cli.eval_lm", eval_lm.with_settings_checked)

    def wrap(cls, name):
        original = getattr(cls, name)

        @functools.wraps(original)
        def method(self, *args, num_shards=1, shard_id=0, **kwargs):
            num_shards, shard_id = _data_parallel_shard(num_shards, shard_id)
            return original(self, *args, num_shards=num_shards, shard_id=shard_id, **kwargs)

        setattr(cls, name, method)

    wrap(LanguageModelingTask, "eval_lm_dataloader")  # fairseq-eval-lm
    wrap(FairseqTask, "get_batch_iterator")  # fairseq-generate


def _cli_modules(module_name: str) -> list:
    """The module objects of a fairseq_cli module: the imported one and, when
    it runs as ``python -m fairseq_cli.X``, ``__main__`` (a second module
    object executing the same file, with its own globals)."""
    import importlib

    modules = [importlib.import_module(module_name)]
    main_module = sys.modules.get("__main__")
    spec = getattr(main_module, "__spec__", None)
    if spec is not None and spec.name == module_name and hasattr(main_module, "main"):
        modules.append(main_module)
    return modules


def _replace_in_cli_module(module_name: str, name: str, replace) -> None:
    """Set global ``name`` of fairseq_cli module ``module_name`` to
    ``replace(current value)`` wherever that module's code looks it up: in
    each module object of :func:`_cli_modules` and in the globals its
    ``main`` runs with. Those differ in a process that multiprocessing
    spawned from ``python -m fairseq_cli.X`` (fairseq's own launcher): it
    re-runs the main module with runpy and copies the result into
    ``__mp_main__``, so the functions keep runpy's dictionary."""
    import inspect

    namespaces = []
    for module in _cli_modules(module_name):
        for namespace in (vars(module), inspect.unwrap(module.main).__globals__):
            if not any(namespace is seen for seen in namespaces):
                namespaces.append(namespace)
    for namespace in namespaces:
        namespace[name] = replace(namespace[name])


def _patch_cli_main(module_name: str, wrap) -> None:
    """Replace ``main`` of a fairseq_cli module by ``wrap(original_main, module)``."""
    for module in _cli_modules(module_name):
        module.main = functools.wraps(module.main)(wrap(module.main, module))


def _not_model_parallel_rank_0() -> bool:
    from fairseq_megatron import parallel_state

    return parallel_state.model_parallel_is_initialized() and parallel_state.get_tensor_model_parallel_rank() != 0


def _model_parallel_generate() -> None:
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
    more groups, :mod:`fairseq_megatron.generate` gathers their output
    round by round of batches, and rank 0 prints it once, as it comes, in
    the order of a run in one process, with one score line; a
    ``--results-path`` file is always written whole, under a temporary name
    first. fairseq-interactive already starts torch.distributed; it
    only gets the printing rule.
    """
    import contextlib

    import torch.distributed as dist
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.distributed import utils as dist_utils

    from fairseq_megatron import generate, parallel_state

    launching = contextvars.ContextVar("launching_fairseq_generate", default=False)

    def wrap_generate(original_main, module):
        def main(cfg):
            if not hasattr(cfg, "common_eval"):  # an argparse Namespace
                cfg = convert_namespace_to_omegaconf(cfg)
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

    class ProgressBarCuttingBatches(_StandIn):
        """``fairseq.logging.progress_bar`` in fairseq_cli.generate: while
        its output is collected, the batches pass through the collector."""

        def progress_bar(self, *args, **kwargs):
            bar = self.stands_for.progress_bar(*args, **kwargs)
            output = generate.collecting.get()
            return bar if output is None else generate.BatchCuttingProgressBar(bar, output)

    class ScoringOfShards(_StandIn):
        """``fairseq.scoring`` in fairseq_cli.generate: while its output is
        collected, the scorer is a :class:`fairseq_megatron.generate.ShardScorer`."""

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

    _patch_cli_main("fairseq_cli.generate", wrap_generate)
    _replace_in_cli_module("fairseq_cli.generate", "_main", collected)
    _replace_in_cli_module("fairseq_cli.generate", "progress_bar", ProgressBarCuttingBatches)
    _replace_in_cli_module("fairseq_cli.generate", "StopwatchMeter", lambda _: generate.GenerationTimer)
    _replace_in_cli_module("fairseq_cli.generate", "scoring", ScoringOfShards)
    _patch_cli_main("fairseq_cli.interactive", wrap_interactive)
    _replace_in_cli_module("fairseq_cli.interactive", "buffered_read", _read_on_rank_0)
    _replace_in_cli_module("fairseq_cli.interactive", "distributed_utils", _InteractiveLaunch)


class _InteractiveLaunch(_StandIn):
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

    from fairseq_megatron import parallel_state

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


def _data_parallel_only() -> None:
    import torch.distributed as dist
    from fairseq.distributed import utils as dist_utils

    from fairseq_megatron import parallel_state

    original = dist_utils.distributed_init

    @functools.wraps(original)
    def distributed_init(cfg):
        rank = original(cfg)  # creates the groups itself when --model-parallel-size > 1
        if dist.is_initialized() and not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1)
        return rank

    dist_utils.distributed_init = distributed_init


def _fused_adam_without_apex() -> None:
    import fairseq.optim.adam

    from fairseq_megatron.fused_adam import fused_adam_class, route_to_fused

    fairseq.optim.adam.get_fused_adam_class = fused_adam_class(fairseq.optim.adam.get_fused_adam_class)
    route_to_fused(fairseq.optim.adam.FairseqAdam)


class _SmoothedValuesOnRead(collections.abc.Mapping):
    """The dictionary ``Trainer._reduce_and_log_stats`` returns (one step's
    smoothed meter values and ``sample_size``, without ppl, wps, wpb and bsz),
    computed when first read instead of right away: rounding reads the loss
    from the GPU. The step's meters receive nothing after it returns."""

    def __init__(self, aggregator, sample_size):
        self._aggregator, self._sample_size, self._values = aggregator, sample_size, None

    def _computed(self) -> dict:
        if self._values is None:
            values = self._aggregator.get_smoothed_values()
            values["sample_size"] = self._sample_size
            for key in ("ppl", "wps", "wpb", "bsz"):
                values.pop(key, None)
            self._values, self._aggregator = values, None
        return self._values

    def __getitem__(self, key):
        return self._computed()[key]

    def __iter__(self):
        return iter(self._computed())

    def __len__(self):
        return len(self._computed())


def _step_log_without_device_wait() -> None:
    from fairseq.logging import metrics
    from fairseq.trainer import Trainer

    original = Trainer._reduce_and_log_stats

    @functools.wraps(original)
    def reduce_and_log_stats(self, logging_outputs, sample_size, grad_norm=None):
        if self.tpu or not torch.is_tensor(grad_norm):  # validation passes no norm
            return original(self, logging_outputs, sample_size, grad_norm)
        # fairseq's body without its two waits. train_step calls this with a
        # norm it found finite (after an fp16 overflow it does not call it).
        metrics.log_speed("ups", 1.0, priority=100, round=2)
        metrics.log_scalar("gnorm", grad_norm, priority=400, round=3)
        clip_norm = self.cfg.optimization.clip_norm
        if clip_norm > 0:
            # fairseq builds 100 and 0 with new_tensor: host-to-device copies,
            # each a wait on the GPU
            clipped = (grad_norm > clip_norm).to(grad_norm.dtype) * 100
            metrics.log_scalar("clip", clipped, priority=500, round=1)
        with metrics.aggregate() as aggregator:
            if logging_outputs is not None:
                self.task.reduce_metrics(logging_outputs, self.get_criterion())
            if "loss" not in aggregator:
                if "loss" not in self._warn_once:
                    self._warn_once.add("loss")
                    logger.warning("Criterion.reduce_metrics did not log a 'loss' value, "
                                   "which may break some functionality")
                metrics.log_scalar("loss", -1)
        return _SmoothedValuesOnRead(aggregator, sample_size)

    Trainer._reduce_and_log_stats = reduce_and_log_stats


_prefetch_threads = weakref.WeakSet()
_stop_prefetching = threading.Event()


def _until_stopped(items):
    for item in items:
        if _stop_prefetching.is_set():
            return
        yield item


def _stop_prefetch_threads(timeout: float = 10.0) -> None:
    """Make every live ``BackgroundConsumer`` finish: it produces no new
    item once the stop is set, and its queue is emptied so that a pending
    ``put`` returns. Waits at most ``timeout`` seconds in all."""
    import queue

    _stop_prefetching.set()
    deadline = time.monotonic() + timeout
    for thread in list(_prefetch_threads):
        while thread.is_alive() and time.monotonic() < deadline:
            try:
                while True:
                    thread._queue.get_nowait()
            except queue.Empty:
                pass
            thread.join(timeout=0.05)


def _quiet_prefetch_threads_at_exit() -> None:
    from fairseq.data import iterators

    original_init = iterators.BackgroundConsumer.__init__

    @functools.wraps(original_init)
    def __init__(self, queue, source, max_len, cuda_device):
        original_init(self, queue, _until_stopped(source), max_len, cuda_device)
        _prefetch_threads.add(self)

    iterators.BackgroundConsumer.__init__ = __init__
    atexit.register(_stop_prefetch_threads)


def _source_tokens(sample):
    """``sample["net_input"]["src_tokens"]``, or None for any other shape of batch."""
    if isinstance(sample, dict) and isinstance(sample.get("net_input"), dict):
        tokens = sample["net_input"].get("src_tokens")
        if torch.is_tensor(tokens):
            return tokens
    return None


def _padding_known_on_the_host() -> None:
    from fairseq.trainer import Trainer

    from fairseq_megatron.padding import mark_padding

    original = Trainer._prepare_sample

    @functools.wraps(original)
    def prepare_sample(self, sample, is_dummy=False):
        tokens = _source_tokens(sample)
        dictionary = getattr(self.task, "source_dictionary", None)
        if tokens is None or tokens.device.type != "cpu" or dictionary is None:
            return original(self, sample, is_dummy)
        pad = dictionary.pad()
        holds_padding = bool(tokens.eq(pad).any())  # on the CPU: no wait
        sample, is_dummy = original(self, sample, is_dummy)
        moved = _source_tokens(sample)
        if moved is not None:
            mark_padding(moved, pad, holds_padding)
        return sample, is_dummy

    Trainer._prepare_sample = prepare_sample


_CHECKED_ON_THE_DEVICE = "_fairseq_megatron_finite_checked_on_the_device"


class _CheckedOnTheDevice:
    """``torch.isfinite(grad_norm)`` for a norm that step 12 marked: fairseq
    asks ``.all()`` of it and gets True without any tensor being read (the
    optimizer skips a non-finite update by itself)."""

    @staticmethod
    def all() -> bool:
        return True


class _TorchWithNormsCheckedOnTheDevice(_TorchStandIn):
    """``torch`` inside ``fairseq.trainer``: ``isfinite`` of a gradient norm
    marked by step 12 answers without reading it; any other tensor gets
    torch's answer."""

    @staticmethod
    def isfinite(tensor):
        if torch.is_tensor(tensor) and getattr(tensor, _CHECKED_ON_THE_DEVICE, None) == tensor._version:
            return _CheckedOnTheDevice()
        return torch.isfinite(tensor)


def _nonfinite_gradients_skipped_on_the_device() -> None:
    from fairseq import trainer as trainer_module
    from fairseq.model_parallel.megatron_trainer import MegatronTrainer
    from fairseq.optim.adam import FairseqAdam

    from fairseq_megatron.fused_adam import FusedAdamW

    def checked_on_the_device(clip_grad_norm):
        @functools.wraps(clip_grad_norm)
        def method(self, clip_norm):
            optimizer = self.optimizer  # FP16Optimizer, AMPOptimizer: not a FairseqAdam, unchanged
            fused = optimizer._optimizer if isinstance(optimizer, FairseqAdam) else None
            if not isinstance(fused, FusedAdamW):
                return clip_grad_norm(self, clip_norm)
            if fused.last_step_skipped():
                raise FloatingPointError(f"gradients are Nan/Inf in update {self.get_num_updates()} (skipped: "
                                         "weights and Adam moments unchanged)")
            grad_norm = clip_grad_norm(self, clip_norm)
            fused.skip_step_if_nonfinite(grad_norm)
            setattr(grad_norm, _CHECKED_ON_THE_DEVICE, grad_norm._version)
            return grad_norm

        return method

    for cls in (trainer_module.Trainer, MegatronTrainer):
        cls.clip_grad_norm = checked_on_the_device(cls.__dict__["clip_grad_norm"])
    trainer_module.torch = _TorchWithNormsCheckedOnTheDevice()


def _is_model_parallel_lm(state: dict) -> bool:
    """Whether checkpoint ``state`` holds one of our architectures."""
    from fairseq_megatron.checkpoint_resharding import config_value, model_config
    from fairseq_megatron.models.model_parallel_transformer_lm import is_model_parallel_arch

    config = model_config(state)
    return is_model_parallel_arch(config_value(config, "_name") or config_value(config, "arch"))


def _existing_part_files(path: str) -> list:
    """The files of checkpoint ``path`` (see
    :func:`fairseq_megatron.checkpoint_resharding.find_part_files`), or none
    where no checkpoint has that name."""
    from fairseq_megatron.checkpoint_resharding import find_part_files

    try:
        return find_part_files(path)
    except FileNotFoundError:
        return []


def _refuse_one_part_as(flag: str, path: str) -> None:
    """``--path ckpt/model-model_part-0.pt`` names one part, not the
    checkpoint (a common slip with the published Megatron-11b); loading it
    failed with errors about model-parallel sizes that did not say so, and
    ``--finetune-from-model`` loaded that one part on every rank.

    Raises:
        UsageError: ``path`` names one part file of a checkpoint in parts.
    """
    from fairseq_megatron.checkpoint_resharding import checkpoint_of_part
    from fairseq_megatron.errors import UsageError

    checkpoint = checkpoint_of_part(path)
    num_parts = len(_existing_part_files(checkpoint)) if checkpoint else 0
    if num_parts > 1:
        raise UsageError(f"{flag} {path} is one of {num_parts} model part files: pass the checkpoint's name, "
                         f"{flag} {checkpoint} (fairseq adds -model_part-K for each rank)")


def _resharded_state(path: str, files: list, arg_overrides=None, with_ema: bool = False):
    """This rank's part of checkpoint ``path`` (saved at another
    model-parallel size in ``files``), built in memory, in the form fairseq's
    ``load_checkpoint_to_cpu(files[0], arg_overrides)`` returns (overrides
    applied, old formats upgraded; the config records this size); None for a
    checkpoint of another architecture. The optimizer state, another size's,
    is dropped, and so are part 0's EMA weights (``with_ema``: this rank's
    part of them is built too, for fairseq-train ``--store-ema``) and RNG
    tracker states."""
    from fairseq import checkpoint_utils

    from fairseq_megatron import parallel_state
    from fairseq_megatron.checkpoint_resharding import (
        resharded_model,
        set_model_parallel_size,
        without_part_specific_state,
    )

    state = checkpoint_utils.load_checkpoint_to_cpu(files[0], arg_overrides)
    if not _is_model_parallel_lm(state):
        return None
    rank, size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    logger.info(f"{path}: {len(files)} model part(s), loaded at model-parallel size {size}: "
                f"part {rank} resharded in memory")
    state["model"] = None  # free part 0 before building this rank's part
    state["model"], padded_vocab_size = resharded_model(path, rank, size)
    set_model_parallel_size(state, size, padded_vocab_size)
    state.pop("last_optimizer_state", None)
    had_ema = (state.get("extra_state") or {}).get("ema") is not None
    state["extra_state"] = without_part_specific_state(state.get("extra_state"))
    if with_ema and had_ema:
        state["extra_state"]["ema"], _ = resharded_model(path, rank, size, entry="ema")
    return state


def _ema_from_the_weights(state: dict, path: str) -> dict:
    """fairseq-train ``--store-ema`` on from a checkpoint without EMA weights
    means to start the EMA from the weights it loads ("EMA is re-initialized
    from checkpoint"), but reads them after deleting them: ``KeyError:
    'model'`` (``fairseq/trainer.py``, ``load_checkpoint``). It now gets the
    weights as the EMA weights. Changes and returns ``state``."""
    extra_state = state.get("extra_state")
    if extra_state is not None and extra_state.get("ema") is None:
        logger.info(f"{path} holds no EMA weights: the EMA (--store-ema) starts from its weights")
        extra_state["ema"] = state["model"]
    return state


def _checkpoints_at_another_model_parallel_size() -> None:
    from fairseq import checkpoint_utils
    from fairseq.file_io import PathManager

    from fairseq_megatron import parallel_state
    from fairseq_megatron.checkpoint_resharding import check_complete, find_part_files

    original_load = checkpoint_utils.load_model_ensemble_and_task

    def needs_resharding(path: str, files: list) -> bool:
        """Whether ``files`` hold checkpoint ``path`` at another size than
        this run's (fairseq then found no file, or the wrong one)."""
        size = parallel_state.get_tensor_model_parallel_world_size()
        return bool(files) and len(files) != size and not (size == 1 and PathManager.exists(path))

    @functools.wraps(original_load)
    def load_model_ensemble_and_task(filenames, arg_overrides=None, task=None, strict=True, suffix="",
                                     num_shards=1, state=None):
        if state is not None or num_shards != 1:
            return original_load(filenames, arg_overrides, task, strict, suffix, num_shards, state)
        ensemble, cfg = [], None
        for filename in filenames:
            _refuse_one_part_as("--path", filename)
            try:
                files = find_part_files(filename)
            except FileNotFoundError:
                if PathManager.exists(_part_name(filename.replace(".pt", suffix + ".pt"), suffix)):
                    files = []  # a file that only fairseq's PathManager reaches (a remote URI)
                else:
                    raise  # naming the part files looked for too; fairseq named one rank's part
            check_complete(files)  # on every rank, before any rank loads a part
            part_state = _resharded_state(filename, files, arg_overrides) if needs_resharding(filename, files) else None
            if part_state is None:
                models, cfg, task = original_load([filename], arg_overrides, task, strict, suffix, num_shards)
            else:
                # fairseq checks that a file of the given name exists, then uses the state given.
                models, cfg, task = original_load([files[0]], arg_overrides, task, strict, "", 1, part_state)
            ensemble.extend(models)
        return ensemble, cfg, task

    checkpoint_utils.load_model_ensemble_and_task = load_model_ensemble_and_task


@contextlib.contextmanager
def _checkpoint_read_as(filename: str, build_state):
    """Within this context fairseq's ``load_checkpoint_to_cpu(filename)``
    returns ``build_state()`` instead of reading the file: only on the ranks
    where fairseq reads (the trainer reads on data-parallel rank 0 and
    broadcasts to the others), and once."""
    from fairseq import checkpoint_utils

    original = checkpoint_utils.load_checkpoint_to_cpu

    @functools.wraps(original)
    def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
        if path != filename:
            return original(path, arg_overrides, load_on_all_ranks)
        checkpoint_utils.load_checkpoint_to_cpu = original  # build_state reads through it
        return build_state()

    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu
    try:
        yield
    finally:
        checkpoint_utils.load_checkpoint_to_cpu = original


def _training_from_checkpoints_at_another_size() -> None:
    from fairseq import checkpoint_utils
    from fairseq.file_io import PathManager
    from fairseq.trainer import Trainer

    from fairseq_megatron import parallel_state
    from fairseq_megatron.checkpoint_resharding import (
        check_complete,
        check_part_count,
        config_value,
        find_part_files,
        model_config,
        saved_vocabulary,
    )
    from fairseq_megatron.errors import UsageError
    from fairseq_megatron.models.model_parallel_transformer_lm import (
        ModelParallelTransformerLanguageModel,
        check_dictionary_size,
    )

    def check_vocabulary(trainer, saved: Optional[int], symbols: Optional[int], path: str, size: int) -> None:
        """fairseq-train builds the model before it loads a checkpoint, padding
        the dictionary for this run's size; a checkpoint from another size
        keeps the vocabulary it was trained with (``saved`` rows in all
        parts, None when unknown), and fairseq then failed with "Cannot load
        model parameters ... ensure that the architectures match". With
        ``--padded-vocab-size`` the rows agree for any dictionary up to that
        size, so the dictionary's own size is checked against the one the
        checkpoint records (``symbols``, None when unknown).

        Raises:
            UsageError: the rows differ (the message gives the flag to add),
                or the dictionaries do.
        """
        check_dictionary_size(trainer.task.source_dictionary.symbols, trainer.cfg.model.dictionary_size,
                              symbols, path)
        built = trainer.get_model().decoder.embed_tokens.weight.size(0) * size
        if saved is not None and saved != built:
            raise UsageError(
                f"{path} has a vocabulary of {saved} rows (the dictionary padded for the model-parallel "
                f"size it was first trained at), this model {built}: add --padded-vocab-size {saved}"
            )

    original_resume = Trainer.load_checkpoint

    @functools.wraps(original_resume)
    def load_checkpoint(self, filename, reset_optimizer=False, *args, **kwargs):
        def load(name):
            return original_resume(self, name, reset_optimizer, *args, **kwargs)

        model, suffix = self.get_model(), self.checkpoint_suffix + ".pt"
        if not (isinstance(model, ModelParallelTransformerLanguageModel) and filename.endswith(suffix)):
            return load(filename)
        path = filename[: -len(suffix)] + ".pt"
        size = parallel_state.get_tensor_model_parallel_world_size()
        try:
            files = find_part_files(path)
        except FileNotFoundError:
            return load(filename)  # no checkpoint at all: fairseq starts from scratch
        check_complete(files)  # each rank checks every part before any rank loads one
        store_ema = self.cfg.ema.store_ema
        if len(files) == size and PathManager.isfile(filename):
            rows, symbols = saved_vocabulary(filename)
            check_vocabulary(self, rows and rows * size, symbols, path, size)
            if not store_ema:
                return load(filename)
            with _checkpoint_read_as(filename, lambda: _ema_from_the_weights(
                    checkpoint_utils.load_checkpoint_to_cpu(filename), filename)):
                return load(filename)
        check_part_count(path, files)  # parts lost are not another size
        if not reset_optimizer:
            raise UsageError(
                f"{path} was saved at model-parallel size {len(files)}, this run has size {size}: resume with "
                f"--model-parallel-size {len(files)}, or reshard it with its optimizer state "
                f"(fairseq-megatron-reshard --input {path} --output NEW.pt --model-parallel-size {size} "
                f"--keep-optimizer) and train with --restore-file NEW.pt; with --reset-optimizer (as "
                f"--finetune-from-model) the weights alone are resharded in memory"
            )
        save_dir = self.cfg.checkpoint.save_dir
        if (not self.cfg.checkpoint.no_save and os.path.basename(path).startswith("checkpoint")
                and os.path.realpath(os.path.dirname(path)) == os.path.realpath(save_dir)):
            raise UsageError(f"{path} is in --save-dir {save_dir}, where this run would save checkpoints of "
                             f"model-parallel size {size} under the same names: pass another --save-dir")
        rows, symbols = saved_vocabulary(files[0])
        check_vocabulary(self, rows and rows * len(files), symbols, path, size)

        def this_ranks_part():
            state = _resharded_state(path, files, with_ema=store_ema)
            if state is None:
                raise UsageError(f"{path} does not hold a model-parallel transformer LM of fairseq_megatron: "
                                 f"it cannot be split into model parts")
            # rows unknown above for files saved by PyTorch < 1.6 (not memory-mapped)
            check_vocabulary(self, state["model"]["decoder.embed_tokens.weight"].size(0) * size,
                             config_value(model_config(state), "dictionary_size"), path, size)
            return _ema_from_the_weights(state, path) if store_ema else state

        with _checkpoint_read_as(files[0], this_ranks_part):  # fairseq logs the name files[0]
            return load(files[0])

    Trainer.load_checkpoint = load_checkpoint

    original_start = checkpoint_utils.load_checkpoint

    @functools.wraps(original_start)
    def load_checkpoint_or_pretrained_model(cfg, trainer, **passthrough_args):
        """fairseq's ``--finetune-from-model PATH`` on a first launch loads
        the file PATH itself into every rank: a checkpoint in parts was
        "does not exist", and one file went whole into each part. It is
        fairseq's ``--restore-file PATH`` with every ``--reset-*`` flag, and
        that loads each rank's part, or builds it in memory (above).

        The checkpoint that fairseq would load, named by ``--restore-file``
        or, on a first launch, by ``--continue-once`` or
        ``--finetune-from-model``, must exist, whole or in parts: fairseq
        started from scratch without it (and saved over the checkpoints of
        ``--save-dir``), except for a missing ``--finetune-from-model``
        file, which was a traceback."""
        ours = isinstance(trainer.get_model(), ModelParallelTransformerLanguageModel)
        last = os.path.join(cfg.save_dir, f"checkpoint_last{trainer.checkpoint_suffix}.pt")
        if cfg.restore_file != "checkpoint_last.pt":
            flag, named = "--restore-file", cfg.restore_file
        elif PathManager.exists(last):
            flag, named = None, None  # fairseq resumes from it
        elif getattr(cfg, "continue_once", None) is not None:
            flag, named = "--continue-once", cfg.continue_once
        else:
            flag, named = "--finetune-from-model", cfg.finetune_from_model
        if ours and named is not None and not (_existing_part_files(named) or PathManager.exists(named)):
            raise UsageError(f"{flag} {named}: no such checkpoint, whole or in model parts (leave out {flag} "
                             f"to start from scratch)")
        path = cfg.finetune_from_model
        if (
            path is None
            or not ours
            or cfg.restore_file != "checkpoint_last.pt"  # fairseq refuses both
            or any((cfg.reset_optimizer, cfg.reset_lr_scheduler, cfg.reset_meters, cfg.reset_dataloader))
            or getattr(cfg, "continue_once", None) is not None
            or PathManager.exists(last)
        ):
            return original_start(cfg, trainer, **passthrough_args)
        size = parallel_state.get_tensor_model_parallel_world_size()
        if not path.endswith(".pt"):
            if size == 1:
                return original_start(cfg, trainer, **passthrough_args)
            raise UsageError(f"--finetune-from-model {path}: at model-parallel size {size} the name must end "
                             f"in .pt (fairseq names each rank's part by replacing it)")
        _refuse_one_part_as("--finetune-from-model", path)
        logger.info(f"fine-tuning from {path}: optimizer, lr scheduler, meters and data loader start afresh")
        cfg = copy.deepcopy(cfg)
        cfg.finetune_from_model, cfg.restore_file = None, path
        cfg.reset_optimizer = cfg.reset_lr_scheduler = cfg.reset_meters = cfg.reset_dataloader = True
        return original_start(cfg, trainer, **passthrough_args)

    checkpoint_utils.load_checkpoint = load_checkpoint_or_pretrained_model


def _fairseq_tool() -> Optional[str]:
    """The fairseq command-line tool this process runs, by its module name
    (``eval_lm`` for ``python -m fairseq_cli.eval_lm`` or the
    ``fairseq-eval-lm`` script); None in a Python program that imported the
    package. ``fairseq-megatron-hydra-train`` (or ``python -m
    fairseq_megatron.cli.hydra_train``) counts as fairseq's hydra_train."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name.startswith("fairseq_cli."):
        return spec.name[len("fairseq_cli."):]
    if spec is not None and spec.name == "fairseq_megatron.cli.hydra_train":
        return "hydra_train"
    script = os.path.basename(sys.argv[0] if sys.argv else "")
    if script == "fairseq-megatron-hydra-train":
        return "hydra_train"
    return script[len("fairseq-"):].replace("-", "_") if script.startswith("fairseq-") else None


def _printed_as_one_line(error: BaseException) -> bool:
    """Print ``error: <message>`` for ``error`` if it is one of ours to
    shorten: a UsageError (or a spawned process's exit after printing one,
    see :func:`_run_spawned`) in one of fairseq's tools, unless
    ``FAIRSEQ_MEGATRON_TRACEBACK`` is set. Returns whether it printed."""
    from fairseq_megatron.errors import UsageError

    ours = isinstance(error, (UsageError, FileNotFoundError, IsADirectoryError, NotADirectoryError,
                              torch.multiprocessing.ProcessExitedException))
    if not ours or os.environ.get("FAIRSEQ_MEGATRON_TRACEBACK") or _fairseq_tool() is None:
        return False
    print(f"error: {error}", file=sys.stderr, flush=True)
    return True


def _one_line_errors() -> None:
    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        if not _printed_as_one_line(value):
            previous(kind, value, traceback)

    sys.excepthook = excepthook


def _broadcast_from_a_rank_of_the_group() -> None:
    import torch.distributed as dist
    from fairseq.distributed import utils as distributed_utils

    original = distributed_utils.broadcast

    @functools.wraps(original)
    def broadcast(tensor, src, group):
        """fairseq's ``broadcast_object`` and ``broadcast_tensors`` name the
        source by its rank within ``group`` (they compare it with
        ``get_rank(group)``); torch's ``broadcast`` takes a global rank."""
        if group is not None and not distributed_utils.use_xla():
            src = dist.get_global_rank(group, src)
        return original(tensor, src, group)

    distributed_utils.broadcast = broadcast


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
        if _printed_as_one_line(e):
            sys.exit(1)
        raise


class _SpawnWithThePlugin(_StandIn):
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


class _TorchInDistributedUtils(_TorchWithTrustedLoad):
    """``torch`` inside ``fairseq.distributed.utils``: trusted loads (step 4)
    and a ``multiprocessing.spawn`` whose processes install the plugin."""

    multiprocessing = _SpawnWithThePlugin()


def _spawned_processes_install_the_plugin() -> None:
    from fairseq.distributed import utils as distributed_utils

    if not isinstance(distributed_utils.torch, _TorchInDistributedUtils):
        distributed_utils.torch = _TorchInDistributedUtils()


def _scoring_empty_batches_as_nothing(task):
    """``task``, whose ``valid_step`` scores an empty batch (``{}``, which
    fairseq's iterator pads a short data shard with) as nothing; it looked up
    ``sample["net_input"]``. Only the short shard's ranks see one; every rank
    of a model-parallel group reads the same shard, so all of them skip it
    and no collective is left waiting."""
    valid_step = task.valid_step

    @functools.wraps(valid_step)
    def valid_step_or_nothing(sample, model, criterion):
        if not sample:
            return 0, 0, {}  # (loss, sample size, logging output)
        return valid_step(sample, model, criterion)

    task.valid_step = valid_step_or_nothing
    return task


class _CheckpointUtilsInValidate(_StandIn):
    """``fairseq.checkpoint_utils`` as ``fairseq_cli/validate.py`` sees it:
    the task it loads with the model scores empty batches as nothing."""

    def __init__(self):
        from fairseq import checkpoint_utils

        super().__init__(checkpoint_utils)

    def load_model_ensemble_and_task(self, *args, **kwargs):
        models, cfg, task = self.stands_for.load_model_ensemble_and_task(*args, **kwargs)
        return models, cfg, _scoring_empty_batches_as_nothing(task)


def _fairseq_validate_across_ranks() -> None:
    import torch.distributed as dist
    from fairseq.distributed import utils as distributed_utils

    def quiet_on_other_ranks(reset_logging):
        @functools.wraps(reset_logging)
        def reset_logging_on_rank_0():
            """fairseq's reset, then ``distributed_init``'s rule: INFO on rank 0 only."""
            reset_logging()
            if dist.is_initialized() and dist.get_rank() != 0:
                logging.getLogger().setLevel(logging.WARNING)

        return reset_logging_on_rank_0

    _replace_in_cli_module("fairseq_cli.validate", "reset_logging", quiet_on_other_ranks)
    _replace_in_cli_module("fairseq_cli.validate", "checkpoint_utils", lambda _: _CheckpointUtilsInValidate())

    original = distributed_utils.all_gather_list

    @functools.wraps(original)
    def all_gather_list(data, group=None, max_size=16384):
        """fairseq's gather of any picklable ``data`` from every rank of
        ``group`` (a list in rank order); without GPUs, torch's
        ``all_gather_object`` (fairseq's stages it through a CUDA buffer)."""
        if torch.cuda.is_available() or distributed_utils.use_xla():
            return original(data, group=group, max_size=max_size)
        if group is None:
            group = distributed_utils.get_global_group()
        gathered = [None] * dist.get_world_size(group=group)
        dist.all_gather_object(gathered, data, group=group)
        return gathered

    distributed_utils.all_gather_list = all_gather_list


# Whether fairseq's batch_by_size keeps a last batch of any size (step 19):
# set while an evaluation builds its batches.
_keep_the_last_batch = contextvars.ContextVar("keep_the_last_batch", default=False)


def _evaluating(function):
    """``function``, building its batches with the last one kept."""

    @functools.wraps(function)
    def evaluating(*args, **kwargs):
        token = _keep_the_last_batch.set(True)
        try:
            return function(*args, **kwargs)
        finally:
            _keep_the_last_batch.reset(token)

    return evaluating


def _evaluation_scores_every_sample() -> None:
    from fairseq import trainer
    from fairseq.data import data_utils
    from fairseq.tasks.fairseq_task import FairseqTask

    from fairseq_megatron.errors import UsageError

    original = data_utils.batch_by_size

    @functools.wraps(original)
    def batch_by_size(indices, num_tokens_fn, num_tokens_vec=None, max_tokens=None, max_sentences=None,
                      required_batch_size_multiple=1, fixed_shapes=None):
        """fairseq's batches; while evaluating, with the last batch that it
        drops for not being a multiple of ``required_batch_size_multiple``.
        fairseq fills the batches in the order of ``indices`` (unless given
        fixed shapes, left as they are), so the dropped batch is the indices
        after the others."""
        args = (num_tokens_fn, num_tokens_vec, max_tokens, max_sentences, required_batch_size_multiple,
                fixed_shapes)
        if not _keep_the_last_batch.get() or fixed_shapes is not None or required_batch_size_multiple <= 1:
            return original(indices, *args)
        indices = np.fromiter(indices, dtype=np.int64, count=-1)  # fairseq's conversion, kept for the tail
        batches = original(indices, *args)
        batched = sum(len(batch) for batch in batches)
        if batched < len(indices):
            batches = list(batches) + [indices[batched:]]
        return batches

    data_utils.batch_by_size = batch_by_size
    trainer.Trainer.get_valid_iterator = _evaluating(trainer.Trainer.get_valid_iterator)

    def filter_indices_by_size(self, indices, dataset, max_positions=None, ignore_invalid_inputs=False):
        """fairseq's ``FairseqTask.filter_indices_by_size``, whose refusal of
        samples longer than the model's positions (evaluations without
        ``--skip-invalid-size-inputs-valid-test``) is one line: fairseq
        raised a bare Exception, a traceback in every tool. In
        fairseq-interactive the sample is a prompt, and the line says so
        (fairseq's advice there was to skip the "example").

        Raises:
            UsageError: a sample is too long and ``ignore_invalid_inputs`` is
                false, or every sample is too long (except in
                fairseq-interactive, where a skipped prompt is one of many).
        """
        if ignore_invalid_inputs:
            kept = original_filter(self, indices, dataset, max_positions, ignore_invalid_inputs)
            if len(kept) == 0 and len(indices) > 0 and _fairseq_tool() != "interactive":
                raise UsageError(f"all {len(indices):,} samples are longer than the model's positions "
                                 f"(max_positions={max_positions}): lower --tokens-per-sample")
            return kept
        kept, too_long = dataset.filter_indices_by_size(indices, max_positions)
        if len(too_long) == 0:
            return kept
        if _fairseq_tool() == "interactive":  # the user's own lines
            raise UsageError(
                f"a prompt of {dataset.size(too_long[0])} tokens is longer than the model's positions "
                f"(max_positions={max_positions}): shorten it, or skip such prompts with "
                f"--skip-invalid-size-inputs-valid-test"
            )
        raise UsageError(
            f"{len(too_long):,} samples are longer than the model's positions (sample #{too_long[0]}: "
            f"{dataset.size(too_long[0])}, max_positions={max_positions}): lower --tokens-per-sample, "
            f"or skip them with --skip-invalid-size-inputs-valid-test"
        )

    original_filter = FairseqTask.filter_indices_by_size
    FairseqTask.filter_indices_by_size = functools.wraps(original_filter)(filter_indices_by_size)
    for name in ("fairseq_cli.validate", "fairseq_cli.generate"):
        _patch_cli_main(name, lambda main, module: _evaluating(main))


def _resuming_at_another_data_parallel_size() -> None:
    from fairseq.trainer import Trainer

    original_save = Trainer.save_checkpoint

    @functools.wraps(original_save)
    def save_checkpoint(self, filename, extra_state):
        extra_state["data_parallel_world_size"] = self.data_parallel_world_size
        return original_save(self, filename, extra_state)

    original_load = Trainer.load_checkpoint

    @functools.wraps(original_load)
    def load_checkpoint(self, *args, **kwargs):
        extra_state = original_load(self, *args, **kwargs)
        _continue_the_epoch(extra_state, self.data_parallel_world_size)
        return extra_state

    Trainer.save_checkpoint = save_checkpoint
    Trainer.load_checkpoint = load_checkpoint


def _continue_the_epoch(extra_state: Optional[dict], groups: int) -> None:
    """Convert a checkpoint's position in its epoch to ``groups`` data-parallel groups, in place.

    fairseq's ``EpochBatchIterator`` deals the epoch's batches (one order for
    any number of groups: shuffled by seed and epoch) round-robin to the D
    groups, so after ``iterations_in_epoch`` = k batches each, batches 0 ..
    kD - 1 have been trained (``fairseq/data/iterators.py``:
    ``ShardedIterator``). With G groups, each skips kD / G of its own; when
    G does not divide kD, the last kD mod G batches are trained once more
    (fewer than G). Checkpoints saved without the plugin's
    ``data_parallel_world_size`` (by stock fairseq) are left as they are.
    """
    if not extra_state or "train_iterator" not in extra_state:
        return
    saved = extra_state.get("data_parallel_world_size")
    position = extra_state["train_iterator"]
    taken = position.get("iterations_in_epoch", 0) * (saved or 0)
    if saved is None or saved == groups or taken == 0:
        return
    position["iterations_in_epoch"] = taken // groups
    again = taken % groups
    logger.info(
        "resuming at %d data-parallel groups (saved at %d): epoch %d goes on after its first %d batches%s",
        groups, saved, position["epoch"], taken,
        f" ({again} of them trained once more: {taken} is not divisible by {groups})" if again else "")


def _keep_best_checkpoints_of_model_parts() -> None:
    from fairseq import checkpoint_utils

    original_save = checkpoint_utils.save_checkpoint

    @functools.wraps(original_save)
    def save_checkpoint(cfg, trainer, epoch_itr, val_loss):
        keep = cfg.keep_best_checkpoints
        suffix = trainer.checkpoint_suffix
        if keep <= 0 or "_" not in suffix:
            return original_save(cfg, trainer, epoch_itr, val_loss)
        cfg.keep_best_checkpoints = 0  # fairseq's own keeping is what fails on the suffix
        try:
            saved = original_save(cfg, trainer, epoch_itr, val_loss)
        finally:
            cfg.keep_best_checkpoints = keep
        if val_loss is not None and not cfg.no_save and trainer.should_save_checkpoint_on_current_rank:
            _keep_best_checkpoint(cfg, trainer, epoch_itr, val_loss, saved)
        return saved

    checkpoint_utils.save_checkpoint = save_checkpoint


def _keep_best_checkpoint(cfg, trainer, epoch_itr, val_loss: float, saved: Optional[str]) -> None:
    """fairseq's ``--keep-best-checkpoints`` for part files
    (``fairseq/checkpoint_utils.py:save_checkpoint``): this rank's part is
    saved as ``checkpoint.best_{metric}_{score:.3f}{digit}{suffix}.pt`` (the
    digit, drawn from epoch, update and score, breaks ties) when the score
    beats the worst of those kept, or, with none kept yet, is the best so
    far; then all but the best ``cfg.keep_best_checkpoints`` are removed.
    The scores are read with the file-name pattern's group, not by splitting
    the name. ``saved``: the file this save wrote, copied (None when this
    save wrote none; then the checkpoint is written here)."""
    from fairseq import checkpoint_utils
    from fairseq.data import data_utils
    from fairseq.file_io import PathManager

    epoch, updates, suffix = epoch_itr.epoch, trainer.get_num_updates(), trainer.checkpoint_suffix
    metric = cfg.best_checkpoint_metric
    pattern = rf"checkpoint\.best_{metric}_(\d+\.?\d*){re.escape(suffix)}\.pt"
    kept = checkpoint_utils.checkpoint_paths(cfg.save_dir, pattern=pattern, keep_match=True)  # by score, descending
    best = getattr(checkpoint_utils.save_checkpoint, "best", None)
    if kept:
        best = kept[-1][1] if cfg.maximize_best_checkpoint_metric else kept[0][1]  # the worst kept
    better = best is None or (val_loss >= best if cfg.maximize_best_checkpoint_metric else val_loss <= best)
    if better:
        with data_utils.numpy_seed(epoch, updates, val_loss):
            digit = np.random.randint(0, cfg.keep_best_checkpoints)
        path = os.path.join(cfg.save_dir, f"checkpoint.best_{metric}_{val_loss:.3f}{digit}{suffix}.pt")
        if saved is not None:
            assert PathManager.copy(saved, path, overwrite=True), f"Failed to copy {saved} to {path}"
        else:
            trainer.save_checkpoint(path, _extra_state(trainer, epoch_itr, val_loss))
    ranked = checkpoint_utils.checkpoint_paths(cfg.save_dir, pattern=pattern)  # by score, descending
    if not cfg.maximize_best_checkpoint_metric:
        ranked = ranked[::-1]
    for worse in ranked[cfg.keep_best_checkpoints:]:
        os.remove(worse)


def _extra_state(trainer, epoch_itr, val_loss) -> dict:
    """The ``extra_state`` fairseq's ``save_checkpoint`` gives a checkpoint."""
    from fairseq import checkpoint_utils

    state = {"train_iterator": epoch_itr.state_dict(), "val_loss": val_loss}
    if hasattr(trainer.task, "get_checkpoint_dict"):
        state.update(trainer.task.get_checkpoint_dict())
    if hasattr(checkpoint_utils.save_checkpoint, "best"):
        state["best"] = checkpoint_utils.save_checkpoint.best
    return state


def _checkpoint_copies_written_whole() -> None:
    from fairseq.file_io import PathManager

    original_copy = PathManager.copy

    @functools.wraps(original_copy)
    def copy(src_path: str, dst_path: str, overwrite: bool = False):
        if not overwrite or "://" in dst_path:  # no file to protect, or not a local path
            return original_copy(src_path, dst_path, overwrite=overwrite)
        partial = f"{dst_path}.tmp-{os.getpid()}"
        try:
            copied = original_copy(src_path, partial, overwrite=True)
            os.replace(partial, dst_path)
        finally:
            if os.path.lexists(partial):
                os.remove(partial)
        return dst_path if isinstance(copied, str) else copied  # shutil.copyfile's value, or iopath's

    PathManager.copy = staticmethod(copy)


def _part_name(named_by_fairseq: str, suffix: str) -> str:
    """The part file fairseq meant by ``named_by_fairseq``, which it made with
    ``name.replace(".pt", suffix + ".pt")``: every ".pt" in ``name`` took the
    suffix, directories included. Names without that damage come back as
    they are."""
    name = named_by_fairseq.replace(suffix + ".pt", ".pt") if suffix else named_by_fairseq
    return name[: -len(".pt")] + suffix + ".pt" if suffix and name.endswith(".pt") else named_by_fairseq


def _part_names_under_directories_with_pt() -> None:
    from fairseq import checkpoint_utils
    from fairseq.trainer import Trainer

    original_name = checkpoint_utils.get_maybe_sharded_checkpoint_filename

    @functools.wraps(original_name)
    def get_maybe_sharded_checkpoint_filename(filename, suffix, shard_idx, num_shards):
        chosen = original_name(filename, suffix, shard_idx, num_shards)
        return _part_name(chosen, suffix) if chosen == filename.replace(".pt", suffix + ".pt") else chosen

    checkpoint_utils.get_maybe_sharded_checkpoint_filename = get_maybe_sharded_checkpoint_filename

    original_load = Trainer.load_checkpoint

    @functools.wraps(original_load)
    def load_checkpoint(self, filename, *args, **kwargs):
        return original_load(self, _part_name(filename, self.checkpoint_suffix), *args, **kwargs)

    Trainer.load_checkpoint = load_checkpoint


def _launch_checked_before_fairseq_train_writes() -> None:
    from fairseq import distributed_utils

    from fairseq_megatron import parallel_state
    from fairseq_megatron.models.model_parallel_transformer_lm import (
        check_data_parallel_backend,
        check_processes,
        is_model_parallel_arch,
    )

    def wrap_train(original_main, module):
        def main(cfg, **kwargs):
            # fairseq_cli.train: "arch" in the parsed namespace, "_name" in a Hydra config
            arch = getattr(cfg.model, "_name", None) or getattr(cfg.model, "arch", None)
            if is_model_parallel_arch(arch):
                size = cfg.common.model_parallel_size
                check_processes(size, parallel_state.world_size(None))
                check_data_parallel_backend(cfg.distributed_training.ddp_backend, size, cfg.common.cpu)
            # fairseq's main makes --save-dir on the master rank only
            made = _directories_missing(cfg.checkpoint.save_dir) if distributed_utils.is_master(
                cfg.distributed_training) else []
            try:
                return original_main(cfg, **kwargs)
            except BaseException:
                _remove_while_empty(made)
                raise

        return main

    _patch_cli_main("fairseq_cli.train", wrap_train)


def _directories_missing(path: str) -> list:
    """``path`` and those of its ancestors that do not exist, deepest first
    (the walk ends at the file system's root at the latest, which exists)."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _remove_while_empty(directories: list) -> None:
    """``os.rmdir`` each of ``directories`` (deepest first) until one is
    missing or not empty: never removes a file, nor a directory a file is in."""
    for directory in directories:
        try:
            os.rmdir(directory)
        except OSError:
            return


def _finished_training_left_as_it_is() -> None:
    def wrap(train):
        @functools.wraps(train)
        def train_unless_finished(cfg, trainer, task, epoch_itr):
            """fairseq_cli.train's ``train`` (one epoch), which tests
            ``--max-update`` only after each update; every rank has loaded the
            same update count, so all of them stop here alike."""
            max_update = cfg.optimization.max_update
            if max_update and trainer.get_num_updates() >= max_update:
                logger.info(f"nothing to train: the checkpoint is at update {trainer.get_num_updates()}, "
                            f"--max-update is {max_update}; no checkpoint saved")
                return [None], True  # (validation losses, stop), as after an update that reached the limit
            return train(cfg, trainer, task, epoch_itr)

        return train_unless_finished

    _replace_in_cli_module("fairseq_cli.train", "train", wrap)
