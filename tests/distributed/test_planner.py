"""The parallelism planner against published parameter counts and measured memory."""

import pytest
import torch

from fairseq_megatron.planner import ModelShape, adafactor_state_elements, plan
from tests.helpers import DIMS, build_model, init_model_parallel, run_distributed


def _adam_state_bytes_under_zero_sharding(rank, world_size):
    """One fp32 Adam step through fairscale's OSS (what ``--zero-sharding
    os`` builds) over the data-parallel world; this rank's moment bytes."""
    from fairscale.optim import OSS

    init_model_parallel(1)
    model, dictionary = build_model(1)
    opt = OSS(model.parameters(), torch.optim.Adam)
    model(torch.randint(4, len(dictionary), (2, 16)))[0].sum().backward()
    opt.step()
    held = sum(t.numel() * t.element_size() for state in opt.optim.state.values()
               for k, t in state.items() if k != "step")
    return held, max(p.numel() for p in model.parameters())


def _adafactor_state_bytes(rank, world_size):
    """One step of fairseq's Adafactor (``--optimizer adafactor``'s defaults:
    no first moment) on our model at model-parallel size ``world_size``:
    the bytes of this rank's state tensors (the 0-dim ``RMS`` per parameter
    left out) and of its parameters."""
    from fairseq.optim.adafactor import Adafactor

    if world_size > 1:
        init_model_parallel(world_size)
    model, dictionary = build_model(world_size)
    opt = Adafactor(model.parameters(), lr=1e-3, relative_step=False, scale_parameter=False)
    model(torch.randint(4, len(dictionary), (2, 16)))[0].float().sum().backward()
    opt.step()
    held = sum(t.numel() * t.element_size() for state in opt.state.values()
               for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
    return held, sum(p.numel() for p in model.parameters())


def test_zero_sharding_splits_adams_moments_over_data_parallel_ranks(tmp_path):
    """``--zero-sharding os`` at data-parallel size 2 (two gloo processes):
    the ranks hold fp32 Adam's 8 bytes per parameter between them, each at
    most one parameter's moments above half (OSS deals whole parameters,
    each to the rank with the fewest elements so far); the planner's 8 / 2
    bytes per parameter lies within that bound on both ranks."""
    (held0, largest), (held1, _) = run_distributed(_adam_state_bytes_under_zero_sharding, 2, tmp_path)
    model, dictionary = build_model(1)
    params = sum(p.numel() for p in model.parameters())
    assert held0 + held1 == 8 * params and min(held0, held1) > 0
    shape = ModelShape(DIMS["decoder_layers"], DIMS["decoder_embed_dim"], DIMS["decoder_attention_heads"],
                       DIMS["decoder_ffn_embed_dim"], len(dictionary), 16)
    (layout,) = [l for l in plan(shape, 2, 2, 80, 2, 4, precision="fp32", zero_sharding=True) if l.tp == l.pp == 1]
    (unsharded,) = [l for l in plan(shape, 2, 2, 80, 2, 4, precision="fp32") if l.tp == l.pp == 1]
    assert layout.dp == 2 and layout.optimizer_gb * 1e9 == pytest.approx(8 * params / 2, rel=1e-9)
    assert unsharded.optimizer_gb * 1e9 == pytest.approx(8 * params, rel=1e-9)
    for held in (held0, held1):
        assert abs(held - layout.optimizer_gb * 1e9) <= 8 * largest, (held0, held1, largest)


@pytest.mark.slow  # several seconds: left out of make test-fast
def test_adafactor_state_matches_measured_bytes(tmp_path):
    """Adafactor's factored statistics, counted by the planner from the
    layer shapes, against the bytes fairseq's Adafactor holds after one step
    on a built model: at model-parallel size 1 in this process, and on each
    rank of size 2 (column- and row-parallel shards, replicated layer norms
    and row-parallel biases). Exact: the same shapes, fp32 statistics. The
    planner's optimizer memory is then those bytes (fp32 training: no
    master copy), far below Adam's 8 per parameter."""
    shape = ModelShape(DIMS["decoder_layers"], DIMS["decoder_embed_dim"], DIMS["decoder_attention_heads"],
                       DIMS["decoder_ffn_embed_dim"], 64, 16)
    held, params = _adafactor_state_bytes(0, 1)
    assert params == shape.parameters()
    assert held == 4 * adafactor_state_elements(shape, 1, shape.layers, embedding=True, final_norm=True)
    (layout,) = [l for l in plan(shape, 1, 1, 80, 2, 2, precision="fp32", optimizer="adafactor")]
    assert layout.optimizer_gb * 1e9 == pytest.approx(held, rel=1e-12) and held < 8 * params / 4
    for rank_held, _ in run_distributed(_adafactor_state_bytes, 2, tmp_path):
        assert rank_held == 4 * adafactor_state_elements(shape, 2, shape.layers, embedding=True, final_norm=True)
