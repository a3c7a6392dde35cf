"""Parallel layers and the vocab-parallel cross entropy against dense references.

Each worker builds the dense reference itself (same seed on every rank), runs
the parallel layer on its group, and compares; the parent checks that every
rank ran at the claimed world size and model-parallel size.

Tolerance: rtol=atol=1e-5 in fp32. The parallel result sums partial
products of N shards (row-parallel, all-reduce) where the reference runs one
GEMM; reassociating fp32 sums moves results by a few ULP (~1e-7 relative at
these sizes), and 1e-5 leaves room for BLAS blocking differences while still
failing on any wrong shard, missing reduction or wrong scaling (errors ~1e-1)."""

import pytest
import torch
import torch.nn.functional as F

from fairseq_megatron.modules import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from fairseq_megatron.modules.sharding import shard_of
from fairseq_megatron.parallel import parallel_state
from tests.helpers import init_model_parallel, run_distributed

TOL = dict(rtol=1e-5, atol=1e-5)


def _dense_weight(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def _layers_worker(rank, world_size, model_parallel_size):
    init_model_parallel(model_parallel_size)
    group = parallel_state.get_tensor_model_parallel_group()
    tp, tp_rank = parallel_state.world_size(group), parallel_state.rank(group)
    dp_rank = parallel_state.get_data_parallel_rank()
    checked = []

    # Different data per model-parallel group: a collective that talked to the
    # whole world instead of the group would mix the groups' results.
    x = _dense_weight((5, 3, 16), seed=100 + dp_rank).requires_grad_()
    w = _dense_weight((24, 16), seed=1)
    b = _dense_weight((24,), seed=2)

    # Column parallel: Y = X W^T + b, W split along output rows.
    col = ColumnParallelLinear(16, 24, gather_output=False, group=group)
    with torch.no_grad():
        col.weight.copy_(shard_of(w, 0, tp_rank, tp))
        col.bias.copy_(shard_of(b, 0, tp_rank, tp))
    y = col(x)
    torch.testing.assert_close(y, F.linear(x, w, b).chunk(tp, -1)[tp_rank], **TOL)
    col.gather_output = True
    x_ref = x.detach().clone().requires_grad_()
    y_full = col(x)
    y_ref = F.linear(x_ref, w, b)
    torch.testing.assert_close(y_full, y_ref, **TOL)
    y_full.pow(2).sum().backward()
    y_ref.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)  # backward all-reduce of the input grad
    checked.append("column")

    # Row parallel, both input modes.
    w2 = _dense_weight((12, 24), seed=3)
    b2 = _dense_weight((12,), seed=4)
    h = _dense_weight((5, 3, 24), seed=200 + dp_rank)
    for input_is_parallel in (True, False):
        row = RowParallelLinear(24, 12, input_is_parallel=input_is_parallel, group=group)
        with torch.no_grad():
            row.weight.copy_(shard_of(w2, 1, tp_rank, tp))
            row.bias.copy_(b2)
        inp = h.chunk(tp, -1)[tp_rank] if input_is_parallel else h
        torch.testing.assert_close(row(inp), F.linear(h, w2, b2), **TOL)
    checked.append("row")

    # Vocab-parallel embedding, padding row included.
    table = _dense_weight((32, 8), seed=5)
    emb = VocabParallelEmbedding(32, 8, padding_idx=1, group=group)
    with torch.no_grad():
        emb.weight.copy_(shard_of(table, 0, tp_rank, tp))
    tokens = torch.randint(0, 32, (4, 7), generator=torch.Generator().manual_seed(6 + dp_rank))
    tokens[0, 0] = 1
    torch.testing.assert_close(emb(tokens), F.embedding(tokens, table), **TOL)
    checked.append("embedding")

    # Vocab-parallel cross entropy: values and logit gradients, padding ignored.
    logits = _dense_weight((6, 5, 32), seed=7 + dp_rank) * 3
    target = torch.randint(0, 32, (6, 5), generator=torch.Generator().manual_seed(8 + dp_rank))
    target[0, :2] = 1  # padding
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.view(-1, 32), target.view(-1), ignore_index=1, reduction="none").view(6, 5)
    shard = logits.chunk(tp, -1)[tp_rank].clone().requires_grad_()
    shard_before = shard.detach().clone()
    loss = vocab_parallel_cross_entropy(shard, target, ignore_index=1, group=group)
    torch.testing.assert_close(loss, ref, **TOL)
    assert torch.equal(shard.detach(), shard_before), "the caller's logits were modified"
    g_out = _dense_weight((6, 5), seed=9)
    (loss * g_out).sum().backward()
    (ref * g_out).sum().backward()
    torch.testing.assert_close(shard.grad, full.grad.chunk(tp, -1)[tp_rank], **TOL)
    assert shard.grad[0, :2].abs().sum() == 0
    checked.append("cross_entropy")

    return {"tp": tp, "tp_rank": tp_rank, "dp_rank": dp_rank, "checked": checked}


@pytest.mark.parametrize(
    "world_size,model_parallel_size",
    [(2, 2), (4, 4), (4, 2)],
    ids=["world2-mp2", "world4-mp4", "world4-two-groups-of-2"],
)
def test_parallel_layers_match_dense(tmp_path, world_size, model_parallel_size):
    results = run_distributed(_layers_worker, world_size, tmp_path, model_parallel_size)
    assert [r["tp"] for r in results] == [model_parallel_size] * world_size
    assert [r["tp_rank"] for r in results] == [i % model_parallel_size for i in range(world_size)]
    assert [r["dp_rank"] for r in results] == [i // model_parallel_size for i in range(world_size)]
    for r in results:
        assert r["checked"] == ["column", "row", "embedding", "cross_entropy"]
