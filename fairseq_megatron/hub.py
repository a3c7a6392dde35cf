"""Python API: load a model-parallel checkpoint and generate, like fairseq's hub interface.

    # run with: torchrun --nproc_per_node 8 my_script.py   (one process per model part)
    from fairseq_megatron.hub import from_pretrained
    lm = from_pretrained("megatron_11b/model.pt", data="megatron_11b", model_parallel_size=8)
    print(lm.sample("The meaning of life is", beam=1, sampling=True, sampling_topk=10))

Every rank of a model-parallel group must make the same calls with the same
arguments; all of them return the same text (logits are gathered before the
search, and sampling draws from the default generator, seeded identically on
all ranks). Mirrors ``fairseq.hub_utils.from_pretrained``.
"""

import os
from typing import Optional

import torch
import torch.distributed as dist
from fairseq import checkpoint_utils
from fairseq.hub_utils import GeneratorHubInterface

from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.checkpoint.part_files import find_part_files
from fairseq_megatron.parallel.rng_tracker import model_parallel_manual_seed


def init_distributed_from_env() -> None:
    """Initialise torch.distributed from torchrun's environment, if it is set and not done yet.

    The process groups are destroyed at a normal exit, before Python shuts
    down (see :func:`~fairseq_megatron.parallel.parallel_state.release_process_groups`).
    """
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    dist.init_process_group(backend=backend, init_method="env://")
    parallel_state.release_at_exit()


def from_pretrained(
    path: str,
    data: Optional[str] = None,
    model_parallel_size: Optional[int] = None,
    seed: int = 1,
    cpu: bool = False,
    fp16: bool = False,
    **overrides,
) -> GeneratorHubInterface:
    """Load checkpoint ``path`` (as fairseq's ``--path``: parts are ``-model_part-K``) on this rank.

    Args:
        path: checkpoint file name, e.g. ``megatron_11b/model.pt``.
        data: directory with ``dict.txt`` (default: the checkpoint's directory).
        model_parallel_size: default: the torch.distributed world size (1 without it).
        seed: seeds the default generator (sampling) identically on every rank,
            and the model-parallel stream.
        cpu / fp16: device and precision; GPU is used when available unless ``cpu``.
        overrides: further model args overrides, as fairseq's ``arg_overrides``.

    Returns:
        fairseq's ``GeneratorHubInterface`` (``sample``, ``generate``, ``score``, ...).

    Raises:
        UsageError (a ValueError): the world size is not divisible by
            ``model_parallel_size``, or a size above 1 in one process.
        FileNotFoundError: no checkpoint ``path``, whole or in parts.
        CheckpointError: parts missing or from different checkpoints, or a
            size that does not divide the model (a checkpoint saved at another
            size is resharded in memory as it loads; see
            :func:`fairseq_megatron.checkpoint.resharding.resharded_model`).
    """
    init_distributed_from_env()
    size = model_parallel_size or (dist.get_world_size() if dist.is_initialized() else 1)
    parallel_state.ensure_model_parallel(size)  # the layout, made once (size 1: each rank a whole model)
    if size > 1:
        model_parallel_manual_seed(seed)
    suffix = f"-model_part-{parallel_state.get_tensor_model_parallel_rank()}" if size > 1 else ""
    find_part_files(path)  # some checkpoint of that name exists, at whatever size

    arg_overrides = {"data": data or os.path.dirname(os.path.abspath(path)), **overrides}
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [path], arg_overrides=arg_overrides, suffix=suffix
    )
    use_cuda = torch.cuda.is_available() and not cpu
    for model in models:
        if fp16:
            model.half()
        if use_cuda:
            model.cuda()
    torch.manual_seed(seed)  # sampling starts from the same state on every rank and at every size
    return GeneratorHubInterface(cfg, task, models)
