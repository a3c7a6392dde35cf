"""``copy.deepcopy`` of the model at model-parallel size 2, as fairseq-train
``--store-ema`` makes it (``fairseq/models/ema/ema.py``): our modules keep
their process group, which cannot be pickled, so fairseq's copy failed at
sizes > 1. Also with compiled and checkpointed layers, whose replaced forward
functions deepcopy does not copy."""

import functools

import pytest
import torch.distributed as dist

from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.training.activation_checkpointing import checkpoint_wrapper
from fairseq_megatron.training.compile import compile_for_training
from tests.helpers import build_model, init_model_parallel, run_distributed
from tests.support.model_copies import check_copy


def _copy_at_size(rank, world_size, wrapped):
    init_model_parallel(world_size)
    model, dictionary = build_model(world_size, seed=0)
    aot_eager = functools.partial(compile_for_training, backend="aot_eager")
    for layer in model.decoder.layers:
        for wrap in wrapped:
            {"compile": aot_eager, "checkpoint": checkpoint_wrapper}[wrap](layer)
    copied = check_copy(model, dictionary)
    group = copied.decoder.layers[0].fc1.tensor_parallel.group
    assert group is model.decoder.layers[0].fc1.tensor_parallel.group, "the copy has another group"
    assert isinstance(group, dist.ProcessGroup) and dist.get_world_size(group) == world_size
    return parallel_state.get_tensor_model_parallel_world_size()


def test_copy_at_model_parallel_size_2(tmp_path):
    assert run_distributed(_copy_at_size, 2, tmp_path, ()) == [2, 2]


@pytest.mark.slow  # several seconds: left out of make test-fast
def test_copy_of_compiled_and_checkpointed_layers_at_size_2(tmp_path):
    assert run_distributed(_copy_at_size, 2, tmp_path, ("compile", "checkpoint")) == [2, 2]
