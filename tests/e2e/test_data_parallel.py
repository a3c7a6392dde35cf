"""Data parallelism with fairseq-train: groups against update-freq, ZeRO sharding, fine-tuning and resuming at another number of groups."""

import os

import pytest
import torch

from fairseq_megatron.checkpoint.resharding import reshard
from tests.e2e.common import per_update, train_args, train_without_dropout
from tests.helpers import fairseq


@pytest.mark.parametrize("model_parallel_size", [1, 2])
def test_two_data_parallel_groups_equal_one_with_update_freq_2(trained, model_parallel_size):
    """Two data-parallel groups (2 processes at model-parallel size 1, the
    default; 4 at size 2) log the same loss and ``gnorm`` per update as one
    group accumulating the same two batches (``--update-freq 2``): fairseq
    deals the shuffled batches round-robin to the data-parallel ranks, so
    group g of update k gets batch 2k + g. At size 1 building our model
    failed before the plugin gave every rank a model-parallel group of one
    ("model parallel group is not initialized"), and fairseq's DDP refused a
    CPU module. Dropout is off; tolerance: one unit of the 3 printed
    decimals (fp32 summation order)."""
    logs = {}
    for groups in (1, 2):
        nproc = groups * model_parallel_size
        args = train_args(trained["data"], str(trained["root"] / f"dp{groups}-mp{model_parallel_size}"), max_update=3)
        args[args.index("--model-parallel-size") + 1] = str(model_parallel_size)
        args += ["--dropout", "0", "--attention-dropout", "0", "--no-save"]
        if groups == 1:
            args += ["--update-freq", "2"]
        _, logs[groups] = fairseq("train", args, nproc=nproc if nproc > 1 else None)
        assert f"training on {nproc} devices" in logs[groups], logs[groups][-2000:]
    for key in ("loss", "gnorm", "bsz"):
        one, two = per_update(logs[1], key), per_update(logs[2], key)
        assert len(one) == len(two) == 3, (key, one, two)
        for a, b in zip(one, two):
            assert abs(a - b) <= 1.1e-3, (key, one, two)
    assert per_update(logs[2], "bsz") == [8.0] * 3  # 4 sequences in each of the 2 groups


def test_zero_sharding_over_data_parallel_groups_trains_and_resumes_like_adam(trained, tmp_path):
    """fairseq's ZeRO stage 1 (``--zero-sharding os``: fairscale's OSS splits
    Adam's moments over the data-parallel group) with model parallelism: 2
    groups at model-parallel size 2 (4 processes). Each model part's
    optimizer is sharded over its own data-parallel group, so 2 updates,
    saved and resumed for 2 more, log the losses and ``gnorm`` of plain Adam
    run 4 updates at once, and each part file holds the same Adam moments
    (fairseq gathers the shards into the group's first rank before it
    saves). Dropout is off; no tolerance: the same arithmetic per element,
    in the same order (compared at the 3 printed decimals, and the saved
    moments exactly)."""
    def train(save_dir, max_update, *extra):
        args = train_args(trained["data"], str(tmp_path / save_dir), max_update)
        _, log = fairseq("train", args + ["--dropout", "0", "--attention-dropout", "0", *extra], nproc=4)
        assert "training on 4 devices" in log, log[-3000:]
        return log

    plain = train("adam", 4)
    first = train("zero", 2, "--zero-sharding", "os")
    resumed = train("zero", 4, "--zero-sharding", "os")
    assert "'zero_sharding': 'os'" in first and "Loaded checkpoint" in resumed, resumed[-3000:]
    for key in ("loss", "gnorm"):
        assert len(per_update(plain, key)) == 4, plain[-3000:]
        assert per_update(first, key) + per_update(resumed, key) == per_update(plain, key), key
    for part in (0, 1):
        states = [torch.load(tmp_path / run / f"checkpoint_last-model_part-{part}.pt", weights_only=False)
                  ["last_optimizer_state"]["state"] for run in ("adam", "zero")]
        assert states[0].keys() == states[1].keys() and len(states[0]) > 0
        for index, moments in states[0].items():
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(moments[name], states[1][index][name]), (part, index, name)


@pytest.mark.parametrize("model_parallel_size", [1, 2])
def test_two_data_parallel_groups_fine_tune_and_resume(trained, tmp_path, model_parallel_size):
    """Two data-parallel groups (world size 2 at model-parallel size 1, 4 at
    size 2): 2 updates fine-tuned from a checkpoint, saved, then resumed for
    2 more, log the same loss per update as one group with ``--update-freq
    2`` (as in the test above) fine-tuned for 4. Each group's data-parallel
    rank 0 reads the checkpoint (at size 2 from one file, its part built in
    memory) and fairseq sends it to the other group. The reference reads the
    other layout: the size-2 parts. Loading any checkpoint with two groups
    failed in fairseq's broadcast: torch >= 2.6 unpickled the sent state
    with ``weights_only=True`` (refused on fairseq's config objects), and
    the source was given as a rank within the data-parallel group where
    torch takes a global one ("Global rank 0 is not part of group" on
    model-parallel rank 1's group). Dropout is off; tolerance: one unit of
    the 3 printed decimals (fp32 summation order)."""
    one = tmp_path / "one" / "model.pt"
    reshard(os.path.join(trained["ckpt"], "checkpoint_last.pt"), str(one), 1)

    def train(save_dir, max_update, groups, *extra):
        return train_without_dropout(trained["data"], tmp_path / save_dir, max_update, model_parallel_size, *extra,
                                     groups=groups)[1]

    first = train("two", 2, 2, "--finetune-from-model", str(one))
    assert "(epoch 1 @ 0 updates)" in first, first[-3000:]
    resumed = train("two", 4, 2, "--finetune-from-model", str(one))  # checkpoint_last now exists
    assert "(epoch 1 @ 2 updates)" in resumed, resumed[-3000:]
    whole = train("one", 4, 1, "--finetune-from-model", os.path.join(trained["ckpt"], "checkpoint_last.pt"),
                  "--update-freq", "2", "--no-save")
    two, one = per_update(first, "loss") + per_update(resumed, "loss"), per_update(whole, "loss")
    assert len(two) == len(one) == 4, (two, one)
    assert all(abs(a - b) <= 1.1e-3 for a, b in zip(two, one)), (two, one)


def test_resuming_at_another_data_parallel_size_goes_on_with_the_epoch(trained, tmp_path):
    """2 updates on two data-parallel groups, saved, then 2 on one group with
    ``--update-freq 2`` (the same 2 batches per update), and the other way
    round: both log the losses of one group with ``--update-freq 2`` for 4
    updates, batches 0-7 of the epoch in order. fairseq kept each group's own
    count of batches: one group trained batches 2-5 after 0-3 (2 per group
    taken as 2 in all), two groups skipped batches 4-7 (4 taken as 4 each).
    Dropout is off, model-parallel size 1; tolerance: one unit of the 3
    printed decimals (fp32 summation order)."""
    one = tmp_path / "one" / "model.pt"
    reshard(os.path.join(trained["ckpt"], "checkpoint_last.pt"), str(one), 1)

    def train(save_dir, max_update, groups, *extra):
        log = train_without_dropout(trained["data"], tmp_path / save_dir, max_update, 1, "--finetune-from-model",
                                    str(one), *extra, groups=groups)[1]
        return log, per_update(log, "loss")

    _, whole = train("whole", 4, 1, "--update-freq", "2", "--no-save")
    for name, first, then in (("two_then_one", (2,), (1, "--update-freq", "2")),
                              ("one_then_two", (1, "--update-freq", "2"), (2,))):
        _, before = train(name, 2, *first)
        log, after = train(name, 4, *then)  # resumes from checkpoint_last
        assert "epoch 1 goes on after its first 4 batches" in log, log[-3000:]
        assert len(whole) == 4 and len(before + after) == 4, (whole, before, after)
        assert all(abs(a - b) <= 1.1e-3 for a, b in zip(before + after, whole)), (name, before + after, whole)
