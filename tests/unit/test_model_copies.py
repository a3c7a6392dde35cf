"""``copy.deepcopy`` of the model, as fairseq-train ``--store-ema`` makes it
(``fairseq/models/ema/ema.py``), in one process: the copy of a compiled layer
stack runs its own weights. What a copy must be: ``support/model_copies.py``."""

from fairseq_megatron.training.compile import compile_layer_stack
from tests.helpers import build_model
from tests.support.model_copies import check_copy


def test_copy_of_the_compiled_layer_stack():
    """Size 1, one process: ``--compile-layers`` compiles the whole stack."""
    model, dictionary = build_model(1, seed=0)
    compile_layer_stack(model.decoder, backend="aot_eager")
    copied = check_copy(model, dictionary)
    assert copied.decoder.compiled_layer_stack is not model.decoder.compiled_layer_stack
