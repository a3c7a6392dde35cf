"""Clear errors for impossible configurations and bad checkpoints."""

from fairseq_megatron.errors import UsageError
from fairseq_megatron.parallel import parallel_state
from tests.helpers import build_model, init_model_parallel, run_distributed


def _bad_dims_worker(rank, world_size):
    init_model_parallel(2)
    errors = {}
    for name, overrides in {
        "heads": dict(decoder_attention_heads=3, decoder_embed_dim=24),
        "ffn": dict(decoder_ffn_embed_dim=129),
    }.items():
        try:
            build_model(2, **overrides)
            errors[name] = None
        except UsageError as e:
            errors[name] = str(e)
    try:
        build_model(1)  # claims size 1 inside a group of 2
        errors["size"] = None
    except UsageError as e:
        errors["size"] = str(e)
    return {"tp": parallel_state.get_tensor_model_parallel_world_size(), "errors": errors}


def _world_not_divisible_worker(rank, world_size):
    try:
        parallel_state.initialize_model_parallel(2)
    except UsageError as e:
        return str(e)
    return None


def test_heads_and_ffn_must_divide_by_model_parallel_size(tmp_path):
    results = run_distributed(_bad_dims_worker, 2, tmp_path)
    for r in results:
        assert r["tp"] == 2
        assert r["errors"]["heads"] == "--decoder-attention-heads 3 is not divisible by --model-parallel-size 2"
        assert r["errors"]["ffn"] == "--decoder-ffn-embed-dim 129 is not divisible by --model-parallel-size 2"
        assert "configured for model-parallel size 1" in r["errors"]["size"]


def test_world_size_must_divide(tmp_path):
    results = run_distributed(_world_not_divisible_worker, 3, tmp_path)
    assert results == ["world size 3 is not divisible by --model-parallel-size 2"] * 3
