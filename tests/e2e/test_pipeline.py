"""fairseq-train with --pipeline-model-parallel-size 2 as a user runs it
(2 processes under torchrun), against the same command at one stage: the
same losses, gradient norms and validation losses per update, also after
resuming (the one-stage run goes through without stopping), stage files
under the commit rule, and fairseq-eval-lm loading the stages at one stage.

Tolerances: fairseq-train prints losses and norms to 3 decimals and the two
runs differ only in the order of fp32 sums (about 1e-6), so the printed
values may differ by one unit of the last digit: 1e-3. fairseq-eval-lm
prints 4 decimals; the checkpoint loaded as stages and as one merged file
hold bitwise the same weights, so their lines are identical, and the
one-stage run's checkpoint differs by the training runs' fp32 reordering
carried through 6 Adam updates: 1e-3 relative (about 0.008 for a loss near
8, far above that reordering and still far below what a wrong stage split
would change).
"""

import os
import re

import pytest
import torch

from fairseq_megatron.checkpoint.resharding import reshard
from fairseq_megatron import USER_DIR
from tests.e2e.common import MODEL, assert_close_per_update, eval_args, eval_loss, train_and_valid_losses, \
    train_and_validate
from tests.helpers import fairseq

pytestmark = pytest.mark.slow


def _train(data, save_dir, stages, max_update, *extra):
    return train_and_validate(data, save_dir, max_update, stages, "--update-freq", "2", "--decoder-layers", "4",
                              "--pipeline-model-parallel-size", str(stages), *extra)


@pytest.fixture(scope="module")
def runs(trained, tmp_path_factory):
    """Two stages for 4 updates, then resumed to 6 with two model chunks per
    stage (the interleaved schedule: each stage's layers and their optimizer
    state cut anew); one stage for 6 updates."""
    root = tmp_path_factory.mktemp("pipeline")
    logs = {2: [_train(trained["data"], root / "pp2", 2, 4),
                _train(trained["data"], root / "pp2", 2, 6, "--virtual-pipeline-model-parallel-size", "2")],
            1: _train(trained["data"], root / "pp1", 1, 6)}
    return root, logs


def _updates(curve, first, last):
    return {u: v for u, v in curve.items() if first <= u <= last}


def test_two_stages_train_as_one(runs):
    root, logs = runs
    train1, valid1 = train_and_valid_losses(logs[1])
    assert sorted(train1) == [1, 2, 3, 4, 5, 6] and sorted(valid1) == [2, 4, 6]
    for log, (first, last) in zip(logs[2], ((1, 4), (5, 6))):  # the first run, then the resumed one
        train2, valid2 = train_and_valid_losses(log)
        assert sorted(train2) == list(range(first, last + 1))
        assert_close_per_update(train2, _updates(train1, first, last))
        assert_close_per_update(valid2, _updates(valid1, first, last))


def test_stage_files_hold_their_stages_and_commit(runs):
    root, _ = runs
    names = sorted(os.listdir(root / "pp2"))
    assert names == ["checkpoint_best-model_part-0-stage-0.pt", "checkpoint_best-model_part-0-stage-1.pt",
                     "checkpoint_best.pt.manifest.json", "checkpoint_last-model_part-0-stage-0.pt",
                     "checkpoint_last-model_part-0-stage-1.pt", "checkpoint_last.pt.manifest.json"]
    first, last = (torch.load(root / "pp2" / f"checkpoint_last-model_part-0-stage-{s}.pt", weights_only=False)
                   for s in (0, 1))
    assert {k.split(".")[2] for k in first["model"] if ".layers." in k} == {"0", "2"}  # saved at 2 chunks per stage
    assert {k.split(".")[2] for k in last["model"] if ".layers." in k} == {"1", "3"}
    assert torch.equal(first["model"]["decoder.embed_tokens.weight"], last["model"]["decoder.embed_tokens.weight"])
    assert first["extra_state"]["save"] == last["extra_state"]["save"]  # one save, one token


def test_eval_lm_loads_the_stages_at_one_stage(runs, trained):
    root, _ = runs
    path = str(root / "pp2" / "checkpoint_last.pt")
    _, from_stages = fairseq("eval_lm", eval_args(trained["data"], path, 1))
    assert "1 model part(s) x 2 pipeline stages, loaded at model-parallel size 1" in from_stages
    assert len(re.findall(r"Loss \(base 2\)", from_stages)) == 1
    merged = str(root / "merged" / "model.pt")
    assert reshard(path, merged, 1) == [merged]
    _, from_one_file = fairseq("eval_lm", eval_args(trained["data"], merged, 1))
    assert eval_loss(from_stages) == eval_loss(from_one_file)
    _, one_stage_run = fairseq("eval_lm", eval_args(trained["data"], str(root / "pp1" / "checkpoint_last.pt"), 1))
    assert abs(eval_loss(from_stages) - eval_loss(one_stage_run)) <= 1e-3 * eval_loss(one_stage_run)
    stage_file = str(root / "pp2" / "checkpoint_last-model_part-0-stage-1.pt")
    rc, one_file = fairseq("eval_lm", eval_args(trained["data"], stage_file, 1), check=False)
    assert rc == 1 and f"error: --path {stage_file} is one of 2 model part files: pass the checkpoint's name, " \
                       f"--path {path}" in one_file, one_file[-2000:]


def test_fine_tuning_splits_a_one_stage_checkpoint_into_stages(runs, trained, tmp_path):
    """--finetune-from-model of the one-stage run's checkpoint at 2 stages:
    each rank builds its stage in memory and training starts from those
    weights: its first loss is below the first loss of the runs that started
    from the initial weights."""
    root, logs = runs
    log = _train(trained["data"], tmp_path / "tuned", 2, 1, "--finetune-from-model",
                 str(root / "pp1" / "checkpoint_last.pt"))
    assert "1 model part(s), loaded at model-parallel size 1 x 2 pipeline stages: part 0 of stage 0 resharded " \
           "in memory" in log, log[-3000:]
    assert train_and_valid_losses(log)[0][1][0] < train_and_valid_losses(logs[1])[0][1][0] - 0.5
    assert sorted(os.listdir(tmp_path / "tuned"))[:2] == ["checkpoint_best-model_part-0-stage-0.pt",
                                                         "checkpoint_best-model_part-0-stage-1.pt"]


def test_fine_tuning_a_checkpoint_of_two_chunks_per_stage_under_zbv(runs, trained, tmp_path):
    """--finetune-from-model of the P 2 x V 2 checkpoint under
    --pipeline-schedule zbv (stage 0 holding layers 0 and 3, stage 1 layers
    1 and 2): training starts from those weights, its first loss below the
    first loss of the runs that started from the initial weights, and saves
    the V placement's stages."""
    root, logs = runs
    log = _train(trained["data"], tmp_path / "zbv", 2, 1, "--pipeline-schedule", "zbv", "--update-freq", "4",
                 "--finetune-from-model", str(root / "pp2" / "checkpoint_last.pt"))
    assert "1 model part(s) x 2 pipeline stages, loaded at model-parallel size 1 x 2 pipeline stages" in log, \
        log[-3000:]
    assert train_and_valid_losses(log)[0][1][0] < train_and_valid_losses(logs[1])[0][1][0] - 0.5
    first = torch.load(tmp_path / "zbv" / "checkpoint_last-model_part-0-stage-0.pt", weights_only=False)
    assert {k.split(".")[2] for k in first["model"] if ".layers." in k} == {"0", "3"}
    assert "decoder.layer_norm.weight" in first["model"]
    _, evaluated = fairseq("eval_lm", eval_args(trained["data"], str(tmp_path / "zbv" / "checkpoint_last.pt"), 1))
    assert "1 model part(s) x 2 pipeline stages, loaded at model-parallel size 1" in evaluated
    assert 0 < eval_loss(evaluated) < 20, evaluated[-3000:]  # every key loaded (fairseq loads strictly)


def test_resuming_with_a_stage_file_gone_is_one_line_on_every_rank(runs, trained, tmp_path):
    """The stage-1 file of checkpoint_last removed: the rank of stage 1 said
    so in one line, and stage 0's rank died in a collective with gloo's
    "Connection closed by peer" traceback; now every rank says it."""
    import shutil

    root, _ = runs
    broken = tmp_path / "broken"
    shutil.copytree(root / "pp2", broken)
    os.remove(broken / "checkpoint_last-model_part-0-stage-1.pt")
    args = [trained["data"], "--user-dir", USER_DIR, "--cpu", *MODEL, "--criterion", "vocab_parallel_cross_entropy",
            "--batch-size", "4", "--optimizer", "adam", "--lr", "0.001", "--max-update", "8", "--save-dir",
            str(broken), "--update-freq", "2", "--pipeline-model-parallel-size", "2"]
    rc, out = fairseq("train", args, nproc=2, check=False)
    errors = [line for line in out.splitlines() if "error: " in line]  # each rank's, "[rankN]: error: ..."
    assert rc != 0 and len(errors) == 2 and all("checkpoint_last-model_part-0-stage-1.pt is missing" in e
                                                for e in errors), out[-3000:]
    assert "Traceback" not in out and "Connection closed" not in out, out[-3000:]


def test_resharding_keeps_the_optimizer_state_of_the_stages(runs, tmp_path):
    """``--keep-optimizer`` on the two-stage checkpoint (two chunks per
    stage) writes the optimizer state of one stage: the parameters in a
    one-stage model's order, Adam's moments of every parameter those of the
    one-stage run at the same update. Tolerance: the
    two runs differ by the order of fp32 sums carried through 6 updates
    (the module docstring), far below what a moment of another parameter,
    or of the tied embedding's unsynchronized copy, would differ by."""
    root, _ = runs
    out = str(tmp_path / "one" / "checkpoint_last.pt")
    written = reshard(str(root / "pp2" / "checkpoint_last.pt"), out, 1, with_optimizer=True)
    assert written == [out]  # one part, one stage: one file

    # the parameters in the order of a one-stage model, which fairseq's optimizer numbers its state by (the
    # stages list layers 0 and 2, then 1 and 3)
    order = [list(torch.load(path, weights_only=False, map_location="cpu")["model"])
             for path in (written[0], str(root / "pp1" / "checkpoint_last.pt"))]
    assert order[0] == order[1]
    joined, one_stage = _moments(written[0]), _moments(str(root / "pp1" / "checkpoint_last.pt"))
    assert sorted(joined) == sorted(one_stage) and len(joined) > 20
    for key, theirs in one_stage.items():
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(joined[key][name], theirs[name], rtol=1e-3, atol=1e-6, msg=f"{key} {name}")


def test_resharding_joins_the_optimizer_shards_of_sharded_stages(runs, trained, tmp_path):
    """The same model under ``--ddp-backend fully_sharded`` (one data-parallel
    rank: each stage's optimizer state saved as one shard beside it), two
    stages of two chunks under ``interleaved-zb``: it trains as one stage,
    and ``--keep-optimizer`` joins each stage's shards into one stage's
    state, in a one-stage model's order, Adam's moments those of the
    one-stage run (the tolerances of the test above)."""
    root, logs = runs
    log = _train(trained["data"], tmp_path / "zb", 2, 6, "--virtual-pipeline-model-parallel-size", "2",
                 "--pipeline-schedule", "interleaved-zb", "--ddp-backend", "fully_sharded",
                 "--no-reshard-after-forward")
    for mine, theirs in zip(train_and_valid_losses(log), train_and_valid_losses(logs[1])):
        assert_close_per_update(mine, theirs)
    assert any(name.endswith("-optimizer-0.pt") for name in os.listdir(tmp_path / "zb"))  # saved in shards
    out = str(tmp_path / "one" / "checkpoint_last.pt")
    written = reshard(str(tmp_path / "zb" / "checkpoint_last.pt"), out, 1, with_optimizer=True)
    joined, one_stage = _moments(written[0]), _moments(str(root / "pp1" / "checkpoint_last.pt"))
    assert list(joined) == list(one_stage) and len(joined) > 20
    for key, theirs in one_stage.items():
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(joined[key][name], theirs[name], rtol=1e-3, atol=1e-6, msg=f"{key} {name}")


def _moments(path):
    """Adam's state per parameter key of checkpoint ``path``, in the order its optimizer numbers them."""
    from fairseq_megatron.checkpoint.layout import optimizer_state_per_parameter, parameter_keys
    from fairseq_megatron.checkpoint.resharding import aliases_of

    state = torch.load(path, weights_only=False, map_location="cpu")
    keys = parameter_keys(list(state["model"]), aliases_of(state))
    return optimizer_state_per_parameter(state["last_optimizer_state"], state["model"], keys, path)[0]
