"""Resharding checkpoint files between model-parallel sizes, and export to stock fairseq.

Logit tolerance (fp32): rtol=atol=1e-5, as in test_model_parity.py: the
weights are bitwise the same at every size; only the order of the fp32 sums
in row-parallel layers and the gathered vocabulary changes (~1e-6)."""

import os

import pytest
import torch

from fairseq_megatron.checkpoint.part_files import part_path
from fairseq_megatron.checkpoint.resharding import reshard
from fairseq_megatron.parallel import parallel_state
from tests.helpers import make_batch, make_dictionary, run_distributed
from tests.support.checkpoint_resharding import TOL, WORDS, build_at_size, save_checkpoint


def _logits_worker(rank, world_size, path, tokens):
    from tests.helpers import init_model_parallel

    init_model_parallel(world_size)
    state = torch.load(part_path(path, rank) if world_size > 1 else path, weights_only=False)
    model, _ = build_at_size(world_size, state["cfg"]["model"])
    model.load_state_dict(state["model"], strict=True)
    model.eval()
    with torch.no_grad():
        return {"tp": parallel_state.get_tensor_model_parallel_world_size(), "logits": model(tokens)[0]}


@pytest.mark.slow  # several seconds: left out of make test-fast
def test_resharded_parts_give_the_same_logits_at_sizes_1_2_4(tmp_path):
    src = str(tmp_path / "src" / "model.pt")
    os.makedirs(os.path.dirname(src))
    save_checkpoint(src, 2)
    paths = {n: str(tmp_path / f"mp{n}" / "model.pt") for n in (1, 2, 4)}
    for n, p in paths.items():
        reshard(src, p, n)
    tokens, _ = make_batch(make_dictionary(WORDS), seed=4)

    # size 1 in this process: the model pads 54 symbols to the recorded 64
    state = torch.load(paths[1], weights_only=False)
    model, args = build_at_size(1, state["cfg"]["model"])
    assert args.padded_vocab_size == 64
    model.load_state_dict(state["model"], strict=True)
    model.eval()
    with torch.no_grad():
        reference = model(tokens)[0]
    for n in (2, 4):
        for r in run_distributed(_logits_worker, n, tmp_path / f"run{n}", paths[n], tokens):
            assert r["tp"] == n
            torch.testing.assert_close(r["logits"], reference, **TOL)
