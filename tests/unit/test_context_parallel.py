"""How context-parallel ranks split a sequence, and the options refused
before any work (the training runs are in tests/distributed/test_context_parallel.py)."""

import re
from argparse import Namespace

import pytest
import torch

from fairseq_megatron.errors import UsageError
from fairseq_megatron.models.options import check_context_parallel_options
from fairseq_megatron.training.data_parallel import check_pipeline_data_parallel_backend
from fairseq_megatron.parallel.context_parallel import ContextSplit
from fairseq_megatron.parallel.layout import ParallelLayout
from fairseq_megatron.parallel.parallel_state import RankGroup
from fairseq_megatron.training.context_parallel import count_own_share
from tests.support.pipeline import PAD, sample


def _split(rank, size=2, multiple=None):
    return ContextSplit(RankGroup(size, rank), multiple or 2 * size)


def test_rank_i_holds_chunks_i_and_2c_minus_1_minus_i():
    assert _split(0).positions(8).tolist() == [0, 1, 6, 7]
    assert _split(1).positions(8).tolist() == [2, 3, 4, 5]
    assert [_split(r, 4).positions(8).tolist() for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert _split(1).gathered_positions(8).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]  # rank order
    with pytest.raises(ValueError, match="a sequence of 10 positions cannot be cut into 4 equal chunks"):
        _split(0).positions(10)


def test_every_rank_computes_the_same_number_of_query_key_pairs():
    """The causal load balancing: with chunks i and 2C-1-i, each rank's
    queries see the same number of keys in all (a sequence of 16 at C = 4:
    136 pairs, 34 each), where cutting it into 4 consecutive blocks gives
    10, 26, 42 and 58."""
    length, size = 16, 4
    pairs = [int((~_split(r, size).causal_mask(length // size)).sum()) for r in range(size)]
    assert pairs == [34] * 4 and sum(pairs) == length * (length + 1) // 2


def test_mask_is_the_dense_causal_mask_at_global_positions():
    """Rows: this rank's queries; columns: the gathered keys. Against the
    dense future mask of the whole sequence (True = blocked), indexed by
    the positions written out here."""
    dense = torch.ones(8, 8, dtype=torch.bool).triu(1)
    gathered = [0, 1, 6, 7, 2, 3, 4, 5]
    for rank, queries in ((0, [0, 1, 6, 7]), (1, [2, 3, 4, 5])):
        assert torch.equal(_split(rank).causal_mask(4), dense[queries][:, gathered])
    # SDPA's is_causal on a (T / C) x T problem blocks by row number instead: wrong on every rank
    top_left = torch.ones(4, 8, dtype=torch.bool).triu(1)
    assert not torch.equal(_split(0).causal_mask(4), top_left)
    assert not torch.equal(_split(1).causal_mask(4), top_left)


def test_padding_and_keeping_positions():
    split = _split(1)
    tokens = torch.arange(1, 14).reshape(1, 13) + 10  # 13 tokens: padded to 16
    padded = split.pad(tokens, PAD)
    assert padded.tolist() == [list(range(11, 24)) + [PAD] * 3]
    assert split.pad(padded, PAD) is padded  # a multiple of 2C already: the same tensor
    assert split.keep(padded, 1).tolist() == [[15, 16, 17, 18, 19, 20, 21, 22]]  # positions 4..11
    assert split.in_key_order(padded, 1)[0, :4].tolist() == [11, 12, 13, 14]
    with pytest.raises(ValueError, match="cannot be cut into 2 x 2 chunks"):
        _split(0, multiple=6)


def test_lengths_are_padded_for_sequence_parallelism_too():
    assert ContextSplit.multiple_for(2) == 4
    assert ContextSplit.multiple_for(2, tensor=2) == 4  # without --sequence-parallel T does not matter
    assert ContextSplit.multiple_for(2, tensor=4, sequence_parallel=True) == 8  # T / C split over 4
    assert ContextSplit.multiple_for(4, tensor=2, sequence_parallel=True) == 8
    assert ContextSplit.multiple_for(3, tensor=4, sequence_parallel=True) == 12


def test_each_token_and_sequence_counted_once_over_the_ranks():
    """A batch of 2 rows of 13 tokens, the second ending in 4 padding tokens
    (22 real targets), split over 2 ranks after padding to 16."""
    batch = sample(7, rows=2, length=13, short_tail=4)
    assert batch["ntokens"] == 22
    shares = [count_own_share(batch, _split(r), PAD) for r in (0, 1)]
    # rank 0 holds positions 0-3 and 12-15: 4 + 1 real targets in row 0, 4 + 0 in row 1
    assert [s["ntokens"] for s in shares] == [9, 13]
    assert [s["nsentences"] for s in shares] == [2, 0]
    assert count_own_share(shares[1], _split(1), PAD)["ntokens"] == 13  # counting again changes nothing
    assert batch["ntokens"] == 22 and shares[0]["target"] is batch["target"]  # a new dict, the same tensors


def _options(**overrides):
    args = Namespace(context_parallel_size=2, tokens_per_sample=16, sample_break_mode="none",
                     criterion="vocab_parallel_cross_entropy")
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


@pytest.mark.parametrize("overrides, message", [
    (dict(tokens_per_sample=30), "--tokens-per-sample 30 is not divisible by 2 x --context-parallel-size 2 = 4: "
                                 "each of the 2 ranks holds 2 of 4 equal chunks of a sequence"),
    (dict(sample_break_mode="eos"), "--sample-break-mode eos with --context-parallel-size 2: the ranks split "
                                    "blocks of --tokens-per-sample tokens; use --sample-break-mode none"),
    (dict(criterion="cross_entropy"), "--criterion cross_entropy with --context-parallel-size 2: each rank "
                                      "computes the loss of its own positions; use --criterion "
                                      "vocab_parallel_cross_entropy"),
    (dict(context_parallel_size=0), "--context-parallel-size 0: the number of context-parallel ranks is at least 1"),
])
def test_context_parallel_options_refused(overrides, message):
    with pytest.raises(UsageError, match=f"^{re.escape(message)}$"):
        check_context_parallel_options(_options(**overrides))


def test_context_parallel_options_accepted():
    check_context_parallel_options(_options())
    check_context_parallel_options(_options(context_parallel_size=1, tokens_per_sample=30, sample_break_mode="eos"))
    check_context_parallel_options(Namespace(context_parallel_size=2))  # a config without the training options


def test_fairseq_train_refuses_while_parsing():
    """fairseq-train's parser runs the architecture function, which checks
    the options: the run stops before it has written anything."""
    from fairseq import options

    with pytest.raises(UsageError, match=re.escape("--tokens-per-sample 30 is not divisible by 2 x "
                                                   "--context-parallel-size 2 = 4")):
        options.parse_args_and_arch(options.get_training_parser(), input_args=[
            "data", "--task", "language_modeling", "--arch", "transformer_lm_megatron_11b",
            "--criterion", "vocab_parallel_cross_entropy", "--tokens-per-sample", "30",
            "--context-parallel-size", "2"])


def test_world_size_must_divide_by_tensor_context_and_pipeline():
    with pytest.raises(UsageError, match=re.escape(
            "world size 6 is not divisible by --model-parallel-size 1 x --context-parallel-size 2 x "
            "--pipeline-model-parallel-size 2 = 4")):
        ParallelLayout(6, tensor=1, pipeline=2, context=2)
    layout = ParallelLayout(8, tensor=2, context=2)
    assert layout.data == 2 and layout.context_parallel_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_pipeline_with_context_ranks_needs_legacy_ddp():
    """The context-parallel ranks average their gradients as model copies do:
    torch's DDP, which the pipeline schedule bypasses, would not."""
    with pytest.raises(UsageError, match=re.escape(
            "--ddp-backend pytorch_ddp with --pipeline-model-parallel-size 2 and 1 model copy x "
            "--context-parallel-size 2: the pipeline schedule runs each stage outside torch's DDP")):
        check_pipeline_data_parallel_backend("pytorch_ddp", 2, 1, 2)
    check_pipeline_data_parallel_backend("legacy_ddp", 2, 1, 2)
    check_pipeline_data_parallel_backend("pytorch_ddp", 1, 1, 2)


def _attention_and_grads(q, k, v, blocked, dropout_p, seed, grad_out, ours: bool):
    """Output and (q, k, v) gradients of attention drawn from ``seed``: ours
    (a group of one: the keys as given), or SDPA's own on the same inputs.
    The generator moves between forward and backward (``randn``)."""
    import torch.nn.functional as F

    from fairseq_megatron.modules.context_parallel_attention import attend_to_gathered_keys

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    torch.manual_seed(seed)
    if ours:
        out = attend_to_gathered_keys(q, k, v, blocked, None, None, heads=q.size(1), dropout_p=dropout_p)
    else:
        heads = [t.view(t.size(0), t.size(1), q.size(1), -1).permute(1, 2, 0, 3) for t in (k, v)]
        additive = torch.zeros(blocked.shape).masked_fill(blocked, float("-inf"))
        out = F.scaled_dot_product_attention(q, *heads, attn_mask=additive, dropout_p=dropout_p)
    torch.randn(100)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def test_attention_backward_recomputes_with_the_dropout_of_its_forward(monkeypatch):
    """The attention over gathered keys keeps no probabilities: its backward
    recomputes them, drawing the forward's dropout again. Against SDPA's own
    backward on the same inputs and draws: the same output and gradients
    (the same kernels on the same values: bitwise). Control: without
    restoring the generator the recompute draws other units, and the
    gradients differ."""
    from fairseq_megatron.modules import context_parallel_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 8, 4, generator=g)  # (B, h, T, d)
    k, v = torch.randn(8, 2, 12, generator=g), torch.randn(8, 2, 12, generator=g)  # (T, B, h x d)
    grad_out = torch.randn(2, 3, 8, 4, generator=g)
    blocked = torch.ones(8, 8, dtype=torch.bool).triu(1)
    ours = _attention_and_grads(q, k, v, blocked, 0.3, 5, grad_out, ours=True)
    reference = _attention_and_grads(q, k, v, blocked, 0.3, 5, grad_out, ours=False)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    monkeypatch.setattr(context_parallel_attention, "_set_generator_state", lambda device, state: None)
    unreplayed = _attention_and_grads(q, k, v, blocked, 0.3, 5, grad_out, ours=True)
    torch.testing.assert_close(unreplayed[0], reference[0], rtol=0, atol=0)  # the forward is the same
    assert not torch.allclose(unreplayed[1], reference[1], atol=1e-3)
