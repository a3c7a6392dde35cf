"""The ``fairseq.model_parallel.megatron.mpu`` API, provided without the submodule.

fairseq imports these names lazily at run time when ``--model-parallel-size > 1``
(``distributed/utils.py``, ``model_parallel/megatron_trainer.py``);
:func:`fairseq_megatron.fairseq_integration.install` registers this module
under that import path. Names follow Megatron-LM's ``mpu`` of 2020, which the
fairseq code was written against; group-less communication helpers use this
rank's tensor-model-parallel group.
"""

from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.modules import (  # noqa: F401  (re-exported for Megatron-style imports)
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)
from fairseq_megatron.parallel.parallel_state import (  # noqa: F401
    destroy_model_parallel,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from fairseq_megatron.parallel.rng_tracker import get_cuda_rng_tracker, model_parallel_cuda_manual_seed  # noqa: F401

get_model_parallel_group = parallel_state.get_tensor_model_parallel_group
get_model_parallel_rank = parallel_state.get_tensor_model_parallel_rank
get_model_parallel_world_size = parallel_state.get_tensor_model_parallel_world_size
get_model_parallel_src_rank = parallel_state.get_tensor_model_parallel_src_rank


def copy_to_model_parallel_region(x):
    """Identity forward, all-reduce of the gradient over this rank's tensor-model-parallel
    group (Megatron-LM ``mpu.copy_to_model_parallel_region``); any shape."""
    return copy_to_tensor_model_parallel_region(x, parallel_state.get_tensor_model_parallel_group())


def reduce_from_model_parallel_region(x):
    """All-reduce (sum) over this rank's tensor-model-parallel group, identity backward
    (Megatron-LM ``mpu.reduce_from_model_parallel_region``); any shape."""
    return reduce_from_tensor_model_parallel_region(x, parallel_state.get_tensor_model_parallel_group())


def scatter_to_model_parallel_region(x):
    """This rank's slice of the last dimension, ``(..., H)`` -> ``(..., H / N)``; the
    backward gathers (Megatron-LM ``mpu.scatter_to_model_parallel_region``).
    Raises ValueError when N does not divide H."""
    return scatter_to_tensor_model_parallel_region(x, parallel_state.get_tensor_model_parallel_group())


def gather_from_model_parallel_region(x):
    """All-gather along the last dimension, ``(..., H / N)`` -> ``(..., H)``, rank 0's
    slice first; the backward keeps this rank's slice
    (Megatron-LM ``mpu.gather_from_model_parallel_region``)."""
    return gather_from_tensor_model_parallel_region(x, parallel_state.get_tensor_model_parallel_group())
