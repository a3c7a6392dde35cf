"""What the unit and distributed tests of refused settings share."""

from fairseq_megatron.errors import UsageError
from tests.helpers import build_model


def fully_sharded_build_error(model_parallel_size, **overrides):
    """The error of building the model as fairseq-train ``--ddp-backend
    fully_sharded`` does, inside fairscale's ``enable_wrap`` (None: built)."""
    from fairscale.nn import FullyShardedDataParallel, enable_wrap

    try:
        with enable_wrap(wrapper_cls=FullyShardedDataParallel):
            build_model(model_parallel_size, **overrides)
    except UsageError as e:
        return str(e)
    return None
