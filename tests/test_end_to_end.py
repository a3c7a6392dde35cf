"""Unmodified fairseq-train / fairseq-eval-lm at model-parallel size 2 (torchrun, 2 CPU processes).

One small training run is shared by the tests of this module: train, resume,
evaluate at size 2, reshard to size 1 and evaluate again, and the errors a
user meets with bad launches or incomplete checkpoints.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from fairseq.data import Dictionary, data_utils

from fairseq_megatron import USER_DIR
from fairseq_megatron.checkpoint.export import export_to_fairseq
from fairseq_megatron.checkpoint.resharding import reshard
from fairseq_megatron.cli import reshard_checkpoint
from tests.helpers import ENV, fairseq, free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import make_corpus  # noqa: E402

MODEL = [
    "--task", "language_modeling", "--arch", "transformer_lm_megatron_11b",
    "--decoder-layers", "2", "--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "256",
    "--decoder-attention-heads", "4", "--share-decoder-input-output-embed",
    "--sample-break-mode", "none", "--tokens-per-sample", "32",
]


def train_args(data, save_dir, max_update):
    return [data, "--user-dir", USER_DIR, "--cpu", *MODEL,
            "--criterion", "vocab_parallel_cross_entropy", "--model-parallel-size", "2",
            "--batch-size", "4", "--optimizer", "adam", "--lr", "0.001",
            "--max-update", str(max_update), "--save-dir", save_dir, "--no-epoch-checkpoints",
            "--disable-validation", "--log-format", "simple", "--log-interval", "1", "--seed", "3"]


def train_without_dropout(data, save_dir, max_update, model_parallel_size, *extra, groups=1, check=True):
    """fairseq-train at ``model_parallel_size`` on ``groups`` data-parallel
    groups with dropout off (every size then computes the same function):
    (rc, log). A run that succeeded must say it ran at that world size."""
    args = train_args(data, str(save_dir), max_update)
    args[args.index("--model-parallel-size") + 1] = str(model_parallel_size)
    args += ["--dropout", "0", "--attention-dropout", "0", *extra]
    nproc = groups * model_parallel_size
    rc, log = fairseq("train", args, nproc=nproc if nproc > 1 else None, check=check)
    assert rc or f"training on {nproc} devices" in log, log[-3000:]
    return rc, log


def eval_args(data, path, model_parallel_size):
    return [data, "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling", "--path", path,
            "--gen-subset", "test", "--sample-break-mode", "none", "--tokens-per-sample", "32",
            "--context-window", "16", "--batch-size", "4", "--model-parallel-size", str(model_parallel_size)]


def eval_loss(output):
    found = re.findall(r"Loss \(base 2\): ([0-9.]+)", output)
    assert found, output[-3000:]
    return float(found[-1])


def evaluated_tokens(output):
    return int(re.findall(r"Evaluated ([0-9,]+) tokens", output)[-1].replace(",", ""))


def binarized_corpus(root, max_bytes: int) -> str:
    """English text from the standard library's docstrings (``max_bytes``),
    split into ``root/text/{train,valid,test}.txt`` and binarized by
    fairseq-preprocess into ``root/bin``, which is returned. 512 symbols: a
    multiple of 16, so the model at size 2 adds no padding rows and stock
    fairseq (which never pads) builds the same vocabulary."""
    text, data = str(root / "text"), str(root / "bin")
    stdlib = make_corpus.sysconfig.get_paths()["stdlib"]
    corpus = make_corpus.build_corpus(make_corpus.stdlib_files(stdlib), stdlib, max_bytes=max_bytes)
    make_corpus.write_splits(corpus, text)
    fairseq("preprocess", ["--only-source", "--trainpref", f"{text}/train.txt", "--validpref",
                           f"{text}/valid.txt", "--testpref", f"{text}/test.txt", "--destdir", data,
                           "--nwordssrc", "512"])
    return data


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    data, ckpt = binarized_corpus(root, max_bytes=300_000), str(root / "ckpt")
    _, log = fairseq("train", train_args(data, ckpt, max_update=4), nproc=2)
    return {"root": root, "data": data, "ckpt": ckpt, "first_log": log}


def test_train_writes_one_part_per_rank(trained):
    parts = sorted(f for f in os.listdir(trained["ckpt"]) if f.startswith("checkpoint_last"))
    assert parts == ["checkpoint_last-model_part-0.pt", "checkpoint_last-model_part-1.pt"]
    states = [torch.load(os.path.join(trained["ckpt"], p), weights_only=False) for p in parts]
    for rank, state in enumerate(states):
        emb = state["model"]["decoder.embed_tokens.weight"]
        assert tuple(emb.shape) == (512 // 2, 64), "embedding is not vocab-sharded"
        assert tuple(state["model"]["decoder.layers.0.fc1.weight"].shape) == (256 // 2, 64)
        assert tuple(state["model"]["decoder.layers.0.fc2.weight"].shape) == (64, 256 // 2)
        assert state["optimizer_history"][-1]["num_updates"] == 4
        assert state["cfg"]["model"].padded_vocab_size == 512
        assert state["cfg"]["model"].dictionary_size == len(Dictionary.load(os.path.join(trained["data"], "dict.txt")))
        # one model-parallel RNG stream per rank: seed + 2718 + rank
        assert state["extra_state"]["rng_tracker_states"]["model-parallel-rng"]["seed"] == 3 + 2718 + rank
    # the two parts hold different halves of the vocabulary
    assert not torch.equal(states[0]["model"]["decoder.embed_tokens.weight"],
                           states[1]["model"]["decoder.embed_tokens.weight"])
    assert "training on 2 devices" in trained["first_log"]


def test_resume_from_part_files(trained, tmp_path):
    """In a copy of the fixture's save dir: the other tests of this module
    expect its checkpoint at update 4, whichever runs first."""
    save_dir = str(tmp_path / "ckpt")
    shutil.copytree(trained["ckpt"], save_dir)
    _, log = fairseq("train", train_args(trained["data"], save_dir, max_update=7), nproc=2)
    assert re.search(r"Loaded checkpoint .*checkpoint_last-model_part-0\.pt \(epoch 1 @ 4 updates\)", log), log[-3000:]
    assert "num_updates 7" in log or "num_updates=7" in log
    state = torch.load(os.path.join(save_dir, "checkpoint_last-model_part-1.pt"), weights_only=False)
    assert state["optimizer_history"][-1]["num_updates"] == 7


def test_eval_lm_size_2_equals_size_1_on_same_weights(trained):
    path = os.path.join(trained["ckpt"], "checkpoint_last.pt")
    _, out2 = fairseq("eval_lm", eval_args(trained["data"], path, 2), nproc=2)

    merged = str(trained["root"] / "merged" / "model.pt")
    assert reshard(path, merged, 1) == [merged]
    _, out1 = fairseq("eval_lm", eval_args(trained["data"], merged, 1))

    # Every test token is scored once by the model-parallel group (fairseq
    # alone would give each rank half of the batches).
    assert evaluated_tokens(out2) == evaluated_tokens(out1)
    # eval-lm prints 4 decimals; fp32 reordering across shards is ~1e-6.
    assert abs(eval_loss(out2) - eval_loss(out1)) <= 2e-4, (eval_loss(out2), eval_loss(out1))


def _listing(directory):
    """``{name: (size, mtime_ns)}`` of the files in ``directory``."""
    return {e.name: (e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(directory)}


def test_eval_lm_loads_a_checkpoint_saved_at_another_size(trained, tmp_path):
    """fairseq-eval-lm at model-parallel size 1 on the 2 part files (also
    written as an old checkpoint), and at size 2 on one merged file: each
    rank's part is built in memory (fairseq alone: "Model file not found"),
    nothing is written, and the loss is the loss at the size the files were
    saved at."""
    path = os.path.join(trained["ckpt"], "checkpoint_last.pt")
    _, saved_size = fairseq("eval_lm", eval_args(trained["data"], path, 2), nproc=2)
    before = _listing(trained["ckpt"])
    _, from_parts = fairseq("eval_lm", eval_args(trained["data"], path, 1))
    assert _listing(trained["ckpt"]) == before
    assert "2 model part(s), loaded at model-parallel size 1: part 0 resharded in memory" in from_parts

    merged = str(tmp_path / "model.pt")
    reshard(path, merged, 1)
    _, from_one_file = fairseq("eval_lm", eval_args(trained["data"], merged, 2), nproc=2)
    assert os.listdir(tmp_path) == ["model.pt"]
    assert "1 model part(s), loaded at model-parallel size 2: part 0 resharded in memory" in from_one_file

    # The same parts as a 2020 checkpoint such as the published Megatron-11b:
    # argparse ``args`` instead of ``cfg``, torch's pre-1.6 file format.
    from fairseq import options

    args = options.parse_args_and_arch(options.get_training_parser(),
                                       train_args(trained["data"], trained["ckpt"], max_update=4))
    old = tmp_path / "old"
    old.mkdir()
    for rank in range(2):
        state = torch.load(os.path.join(trained["ckpt"], f"checkpoint_last-model_part-{rank}.pt"), weights_only=False)
        state["args"], state["cfg"] = args, None
        torch.save(state, old / f"model-model_part-{rank}.pt", _use_new_zipfile_serialization=False)
    _, from_old_parts = fairseq("eval_lm", eval_args(trained["data"], str(old / "model.pt"), 1))
    assert "2 model part(s), loaded at model-parallel size 1" in from_old_parts

    for out in (from_parts, from_one_file, from_old_parts):
        assert evaluated_tokens(out) == evaluated_tokens(saved_size)
        # eval-lm prints 4 decimals; fp32 reordering across shards is ~1e-6.
        assert abs(eval_loss(out) - eval_loss(saved_size)) <= 2e-4, (eval_loss(out), eval_loss(saved_size))


def test_a_resumed_run_repeats_the_uninterrupted_one_with_dropout(trained, tmp_path):
    """At size 2 with dropout on (0.1, the arch's default), 3 updates, a stop
    and 3 more log the same loss per update as 6 updates in one go: the
    checkpoint carries each rank's model-parallel RNG stream (dropout inside
    the tensor-parallel region) and fairseq reseeds the others per update.
    fairseq issue 2681 reports resumed model-parallel runs that drift.
    The resumed run never drew the initial weights it would have thrown away
    (the model's deferred initialisation). Tolerance: none beyond the 3 printed
    decimals (same code, same order)."""
    logs = []

    def run(save_dir, max_update):
        args = train_args(trained["data"], str(save_dir), max_update)
        logs.append(fairseq("train", args, nproc=2)[1])
        return _per_update(logs[-1], "loss")

    whole = run(tmp_path / "whole", 6)
    first, second = run(tmp_path / "stopped", 3), run(tmp_path / "stopped", 6)
    assert len(whole) == 6 and len(first) == len(second) == 3, (whole, first, second)
    assert first + second == whole, (whole, first, second)
    drew, filled = "drew the initial weights (deferred from the build)", "the initial weights were not drawn"
    assert [(drew in log, filled in log) for log in logs] == [(True, False), (True, False), (False, True)]


def test_a_new_run_starts_from_the_weights_a_build_from_its_seed_draws(trained, tmp_path):
    """fairseq-train defers the initial draws until it has found no
    checkpoint (deferred initialisation); they must still give the
    weights that building the model right after fairseq seeds the generator
    with ``--seed`` gives. With ``--lr 0`` the update moves no weight
    (Adam's step and weight decay are multiples of the learning rate), so
    the saved weights are the initial ones. Size 1, one process.
    Tolerance: none (the same draws in the same order, fp32 throughout)."""
    from fairseq import checkpoint_utils, tasks

    save_dir = tmp_path / "ckpt"
    args = train_args(trained["data"], str(save_dir), 1)
    args[args.index("--model-parallel-size") + 1] = "1"
    args[args.index("--lr") + 1] = "0"
    _, log = fairseq("train", args)
    assert "no checkpoint to load: drew the initial weights" in log, log[-3000:]
    state = checkpoint_utils.load_checkpoint_to_cpu(str(save_dir / "checkpoint_last.pt"))
    assert state["optimizer_history"][-1]["num_updates"] == 1

    torch.manual_seed(3)  # what fairseq-train's main does first, with --seed 3
    task = tasks.setup_task(state["cfg"]["task"])
    built = task.build_model(state["cfg"]["model"]).state_dict()
    assert built.keys() == state["model"].keys()
    different = [k for k, v in built.items() if not torch.equal(state["model"][k], v)]
    assert different == [], different


def test_resuming_at_another_size_stops_instead_of_starting_over(trained, tmp_path):
    """fairseq-train at size 1 in a save dir holding a size-2 checkpoint_last:
    fairseq would not find checkpoint_last.pt and train from scratch; the run
    stops before training, says how to reshard, and leaves the files alone."""
    for name in ("checkpoint_last-model_part-0.pt", "checkpoint_last-model_part-1.pt"):
        shutil.copy(os.path.join(trained["ckpt"], name), tmp_path)
    before = _listing(tmp_path)
    args = train_args(trained["data"], str(tmp_path), max_update=9)
    args[args.index("--model-parallel-size") + 1] = "1"
    args[args.index("--criterion") + 1] = "cross_entropy"
    rc, out = fairseq("train", args, check=False)
    assert rc != 0
    assert ("checkpoint_last.pt was saved at model-parallel size 2, this run has size 1: resume with "
            "--model-parallel-size 2, or reshard it with its optimizer state") in out, out[-3000:]
    assert "num_updates" not in out  # no update ran
    assert _listing(tmp_path) == before
    # with --reset-optimizer the weights would load, but the run would save a
    # size-1 checkpoint_last.pt beside the size-2 parts
    rc, out = fairseq("train", args + ["--reset-optimizer"], check=False)
    assert rc != 0 and "num_updates" not in out, out[-3000:]
    assert out.rstrip().splitlines()[-1] == (
        f"error: {tmp_path / 'checkpoint_last.pt'} is in --save-dir {tmp_path}, where this run would save "
        f"checkpoints of model-parallel size 1 under the same names: pass another --save-dir"), out[-3000:]
    assert _listing(tmp_path) == before


def test_resharded_optimizer_state_resumes_training_at_another_size(trained, tmp_path, capsys):
    """A size-2 checkpoint resharded to size 1 with --keep-optimizer trains on
    at size 1 with the same loss and ``gnorm`` per update as the original
    parts trained on at size 2; with --reset-optimizer (all there was before)
    the losses part after the first update, so the comparison can fail.

    The dictionary has 500 symbols: size 2 pads it to 512 rows, a fresh
    model at size 1 to 504. fairseq-train builds its model before loading,
    so at size 1 it first stops and names --padded-vocab-size 512 (fairseq
    said "Cannot load model parameters"). Dropout is off, so both sizes
    compute the same function; tolerance: one unit of the 3 printed
    decimals (fp32 summation order)."""
    data, size2, size1 = (tmp_path / d for d in ("bin500", "size2", "size1"))
    text = trained["root"] / "text"
    fairseq("preprocess", ["--only-source", "--trainpref", f"{text}/train.txt", "--destdir", str(data),
                           "--nwordssrc", "500"])
    fairseq("train", train_args(str(data), str(size2), max_update=4), nproc=2)
    assert reshard_checkpoint.main(["--input", str(size2 / "checkpoint_last.pt"), "--output",
                                    str(size1 / "checkpoint_last.pt"), "--model-parallel-size", "1",
                                    "--keep-optimizer"]) == 0
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"train on with: fairseq-train ... --model-parallel-size 1 --restore-file {size1 / 'checkpoint_last.pt'} "
        f"--padded-vocab-size 512")

    def train_on(save_dir, size, *extra, reset_optimizer=False):
        start = 0 if reset_optimizer else 4  # fairseq's --reset-optimizer resets the update count too
        rc, log = train_without_dropout(str(data), save_dir, start + 3, size, "--no-save", *extra,
                                        *(["--reset-optimizer"] if reset_optimizer else []), check=False)
        if rc:
            return log
        assert f"(epoch 1 @ {start} updates)" in log, log[-3000:]
        return {key: _per_update(log, key) for key in ("loss", "gnorm")}

    refused = train_on(size1, 1)
    assert refused.rstrip().splitlines()[-1] == (
        f"error: {size1 / 'checkpoint_last.pt'} has a vocabulary of 512 rows (the dictionary padded for the "
        f"model-parallel size it was first trained at), this model 504: add --padded-vocab-size 512"), refused[-3000:]
    # fine-tuning at size 1 from the size-2 parts (joined in memory) meets the same rows, also from
    # parts saved by PyTorch < 1.6 (read whole: their rows are known only once the part is built)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for name in ("checkpoint_last-model_part-0.pt", "checkpoint_last-model_part-1.pt"):
        torch.save(torch.load(size2 / name, weights_only=False), legacy / name, _use_new_zipfile_serialization=False)
    for source in (size2, legacy):
        refused = train_on(tmp_path / "finetune", 1, "--finetune-from-model", str(source / "checkpoint_last.pt"))
        assert refused.rstrip().splitlines()[-1] == (
            f"error: {source / 'checkpoint_last.pt'} has a vocabulary of 512 rows (the dictionary padded for the "
            f"model-parallel size it was first trained at), this model 504: add --padded-vocab-size 512"), \
            refused[-3000:]
    at_2 = train_on(size2, 2)
    at_1 = train_on(size1, 1, "--padded-vocab-size", "512")
    reset = train_on(size1, 1, "--padded-vocab-size", "512", reset_optimizer=True)
    for key in ("loss", "gnorm"):
        assert len(at_2[key]) == len(at_1[key]) == 3, (key, at_2, at_1)
        for a, b in zip(at_2[key], at_1[key]):
            assert abs(a - b) <= 1.1e-3, (key, at_2, at_1)
    assert reset["loss"][0] == at_1["loss"][0]  # the same weights and batch before the first update
    # then Adam's moments start from zero: the losses part by far more than the tolerance
    assert max(abs(a - b) for a, b in zip(reset["loss"][1:], at_1["loss"][1:])) > 10 * 1.1e-3, (reset, at_1)


def test_store_ema_at_size_2_and_on_at_size_1(trained, tmp_path, capsys):
    """fairseq-train ``--store-ema`` deep-copies the model for its EMA, which
    failed at model-parallel size 2 ("cannot pickle 'ProcessGroup' object");
    and fairseq's EMA step dropped the final layer norm from the copy. With
    ``--ema-decay 0`` the EMA is the weights after every update, so each
    part's EMA must equal that part's weights, bitwise, key for key. At size
    1 training goes on from the parts resharded by fairseq-megatron-reshard
    and from the parts themselves, joined in memory (the EMA weights too;
    before, every rank got part 0's: a size mismatch). A checkpoint without
    EMA weights starts the EMA from its weights (fairseq: ``KeyError:
    'model'``)."""
    size2, size1, joined = (tmp_path / d for d in ("size2", "size1", "joined"))
    train_without_dropout(trained["data"], size2, 3, 2, "--store-ema", "--ema-decay", "0")
    for part in (0, 1):
        state = torch.load(size2 / f"checkpoint_last-model_part-{part}.pt", weights_only=False)
        ema, model = state["extra_state"]["ema"], state["model"]
        assert list(ema) == list(model) and ema["decoder.embed_tokens.weight"].shape == (512 // 2, 64)
        different = [key for key in model if not torch.equal(ema[key], model[key])]
        assert not different, different

    assert reshard_checkpoint.main(["--input", str(size2 / "checkpoint_last.pt"), "--output",
                                    str(size1 / "checkpoint_last.pt"), "--model-parallel-size", "1",
                                    "--keep-optimizer"]) == 0
    capsys.readouterr()
    _, log = train_without_dropout(trained["data"], size1, 5, 1, "--store-ema", "--ema-decay", "0", "--no-save")
    assert "(epoch 1 @ 3 updates)" in log and "Loading EMA from checkpoint" in log, log[-3000:]
    assert re.search(r"num_updates[ =]5\b", log), log[-3000:]

    _, log = train_without_dropout(trained["data"], joined, 2, 1, "--store-ema", "--reset-optimizer", "--no-save",
                                   "--restore-file", str(size2 / "checkpoint_last.pt"))
    assert "2 model part(s), loaded at model-parallel size 1" in log, log[-3000:]
    assert "Loading EMA from checkpoint" in log and "holds no EMA weights" not in log, log[-3000:]
    assert re.search(r"num_updates[ =]2\b", log), log[-3000:]

    without_ema = os.path.join(trained["ckpt"], "checkpoint_last.pt")
    _, log = train_without_dropout(trained["data"], tmp_path / "started", 1, 2, "--store-ema", "--reset-optimizer",
                                   "--no-save", "--restore-file", without_ema)
    assert f"{trained['ckpt']}/checkpoint_last-model_part-0.pt holds no EMA weights" in log, log[-3000:]
    assert re.search(r"num_updates[ =]1\b", log), log[-3000:]


def test_fine_tuning_from_a_checkpoint_saved_at_any_size(trained, tmp_path):
    """``--finetune-from-model CKPT.pt`` with CKPT saved in 2 parts, at size
    2 (each rank its own part) and at size 1 (the parts joined in memory),
    and with CKPT one file at size 2 (split in memory), trains on with the
    same loss per update as the documented equivalent at the saved layout:
    ``--restore-file`` with every ``--reset-*`` flag, at size 1 from one
    file. fairseq looked only for the file CKPT.pt itself, so the parts were
    "does not exist" at every size, and at size 2 one file was loaded whole
    into each rank. A part file's name is refused with the name to pass:
    every rank loaded that same part. Dropout is off, so every size computes
    the same function; tolerance: one unit of the 3 printed decimals (fp32
    summation order). A run from fresh weights is the control: its first
    loss is far from the fine-tuned ones."""
    parts, one = tmp_path / "parts", tmp_path / "one"
    parts.mkdir()
    for name in ("checkpoint_last-model_part-0.pt", "checkpoint_last-model_part-1.pt"):
        shutil.copy(os.path.join(trained["ckpt"], name), parts)
    reshard(str(parts / "checkpoint_last.pt"), str(one / "model.pt"), 1)

    def train(name, size, *extra, check=True):
        rc, log = train_without_dropout(trained["data"], tmp_path / name, 3, size, "--no-save", *extra, check=check)
        return log if check else (rc, log)

    resets = ["--reset-optimizer", "--reset-lr-scheduler", "--reset-meters", "--reset-dataloader"]
    reference = train("reference", 1, "--restore-file", str(one / "model.pt"), *resets)
    assert "(epoch 1 @ 0 updates)" in reference, reference[-3000:]
    runs = {
        "parts at size 2": train("a", 2, "--finetune-from-model", str(parts / "checkpoint_last.pt")),
        "parts at size 1": train("b", 1, "--finetune-from-model", str(parts / "checkpoint_last.pt")),
        "one file at size 2": train("c", 2, "--finetune-from-model", str(one / "model.pt")),
        "one file at size 1": train("d", 1, "--finetune-from-model", str(one / "model.pt")),
    }
    expected = _per_update(reference, "loss")
    assert len(expected) == 3, reference[-3000:]
    for what, log in runs.items():
        assert "(epoch 1 @ 0 updates)" in log, (what, log[-3000:])
        losses = _per_update(log, "loss")
        assert len(losses) == 3 and all(abs(a - b) <= 1.1e-3 for a, b in zip(losses, expected)), \
            (what, losses, expected)
    fresh = _per_update(train("fresh", 2), "loss")
    assert abs(fresh[0] - expected[0]) > 10 * 1.1e-3, (fresh, expected)

    part = str(parts / "checkpoint_last-model_part-0.pt")
    rc, log = train("e", 2, "--finetune-from-model", part, check=False)
    assert rc != 0 and "num_updates" not in log, log[-3000:]
    assert (f"error: --finetune-from-model {part} is one of 2 model part files: pass the checkpoint's name, "
            f"--finetune-from-model {parts / 'checkpoint_last.pt'}") in log, log[-3000:]


def test_weights_joined_in_memory_leave_each_rank_its_own_dropout_stream(trained, tmp_path):
    """fairseq-train at size 4 from the fixture's 2 parts (``--reset-optimizer``:
    each rank's part built in memory). The checkpoint fairseq reads is part
    0's, with part 0's model-parallel RNG stream, which MegatronTrainer
    restored into every rank: all four ranks then dropped the same units of
    their shards (saved seeds 3 + 2718 + 0 on every part). Each rank keeps
    the stream seeded for it (seed + 2718 + rank), as at a fresh start."""
    train_without_dropout(trained["data"], tmp_path / "size4", 1, 4, "--reset-optimizer",
                          "--restore-file", os.path.join(trained["ckpt"], "checkpoint_last.pt"))
    seeds = [torch.load(tmp_path / "size4" / f"checkpoint_last-model_part-{rank}.pt", weights_only=False)
             ["extra_state"]["rng_tracker_states"]["model-parallel-rng"]["seed"] for rank in range(4)]
    assert seeds == [3 + 2718 + rank for rank in range(4)], seeds


def test_export_evaluates_in_stock_fairseq_without_user_dir(trained):
    path = os.path.join(trained["ckpt"], "checkpoint_last.pt")
    _, ours = fairseq("eval_lm", eval_args(trained["data"], path, 2), nproc=2)
    plain = str(trained["root"] / "plain" / "model.pt")
    export_to_fairseq(path, plain)
    stock_args = [a for a in eval_args(trained["data"], plain, 1) if a != USER_DIR and a != "--user-dir"]
    assert "--user-dir" not in stock_args
    _, stock = fairseq("eval_lm", stock_args)
    assert "fairseq_megatron" not in stock
    assert evaluated_tokens(stock) == evaluated_tokens(ours)
    assert abs(eval_loss(stock) - eval_loss(ours)) <= 2e-4, (eval_loss(stock), eval_loss(ours))


def hypotheses(output):
    """``{sample id: hypothesis}`` from fairseq-generate's ``H-<id>`` lines."""
    hyps = {}
    for line in output.splitlines():
        if line.startswith("H-"):
            sample_id, _score, text = line.split("\t")
            assert sample_id not in hyps, f"{sample_id} printed twice"
            hyps[sample_id] = text
    return hyps


# Token-for-token equality of size 2 and size 1 is tested in test_generation.py
# on a model whose next-token choices are not near-ties. The 7-update model
# here predicts almost flat distributions, where fp32 rounding alone (a
# different batch size, even at size 1) changes greedy choices, so these tests
# check what must hold regardless: the runs work at size 2, every sample is
# generated once, and all ranks of a group produce the same text.


def test_fairseq_generate_at_size_2(trained):
    path = os.path.join(trained["ckpt"], "checkpoint_last.pt")
    merged = str(trained["root"] / "generate_mp1" / "model.pt")
    reshard(path, merged, 1)

    def generate(p, size, search, nproc=None):
        args = [trained["data"], "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling", "--path", p,
                "--gen-subset", "test", "--sample-break-mode", "none", "--tokens-per-sample", "32",
                "--prefix-size", "2", "--max-len-b", "12", "--batch-size", "8", "--seed", "3",
                "--model-parallel-size", str(size), *search]
        return hypotheses(fairseq("generate", args, nproc=nproc)[1])

    # (fairseq-generate itself fails with --beam > 1 and --prefix-size on
    # language_modeling: "AssertionError: 12 < 12"; beam search is tested in-process.)
    for search in (["--beam", "1"], ["--beam", "1", "--sampling", "--sampling-topk", "10"]):
        mp2, mp1 = generate(path, 2, search, nproc=2), generate(merged, 1, search)
        assert len(mp1) >= 10
        assert set(mp2) == set(mp1)  # every sample once, printed by model-parallel rank 0 only


def test_fairseq_generate_over_data_parallel_groups(trained, tmp_path):
    """fairseq-generate sharded its batches by the world size and printed
    per shard: one process at --distributed-world-size 2 generated half of
    the subset; under torchrun at size 1 each process generated all of it;
    at size 2 in a world of 4 both groups wrote the same --results-path file
    at once and each printed its own shard's BLEU. Now every launch prints
    the text of one process at the same model-parallel size, byte for byte
    (the same batches through the same model, one thread each: the same
    floats), including one BLEU line over the whole subset."""
    path = os.path.join(trained["ckpt"], "checkpoint_last.pt")
    test = data_utils.load_indexed_dataset(os.path.join(trained["data"], "test"), None)
    blocks = -(-int(test.sizes.sum()) // 32)  # --tokens-per-sample 32
    args = [trained["data"], "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling", "--path", path,
            "--gen-subset", "test", "--sample-break-mode", "none", "--tokens-per-sample", "32",
            "--prefix-size", "2", "--max-len-b", "6", "--batch-size", "4", "--beam", "1"]

    def generated(text):
        lines = [line for line in text.splitlines(keepends=True) if re.match(r"[STHDP]-\d+\t|Generate test ", line)]
        assert len(hypotheses(text)) == blocks and sum(line.startswith("Generate") for line in lines) == 1, text[-3000:]
        return "".join(lines)

    def results(args, nproc):
        out = tmp_path / f"results-{len(os.listdir(tmp_path))}"
        out.mkdir()
        (out / "generate-test.txt").write_text("an earlier run's output\n")
        _, log = fairseq("generate", args + ["--results-path", str(out)], nproc=nproc)
        assert os.listdir(out) == ["generate-test.txt"], os.listdir(out)  # replaced whole, no temporary left
        return log, (out / "generate-test.txt").read_text()

    # model-parallel size 2: one group (world 2) against two (world 4)
    _, one_group = results(args + ["--model-parallel-size", "2"], nproc=2)
    log, two_groups = results(args + ["--model-parallel-size", "2"], nproc=4)
    assert f"2 data-parallel groups translated {blocks} sentences together" in log, log[-3000:]
    assert generated(two_groups) == generated(one_group)
    # a run that fails (here: no such checkpoint) leaves the last run's file as it was;
    # fairseq opened it for writing first, and left it empty
    failed = tmp_path / "results-failed"
    failed.mkdir()
    (failed / "generate-test.txt").write_text(one_group)
    bad = args + ["--results-path", str(failed)]
    bad[bad.index("--path") + 1] = str(tmp_path / "no_such" / "model.pt")
    rc, log = fairseq("generate", bad, check=False)
    assert rc == 1 and "no_such" in log.splitlines()[-1], log[-3000:]
    assert os.listdir(failed) == ["generate-test.txt"] and (failed / "generate-test.txt").read_text() == one_group
    # a file where the results directory should be: one line before the model loads (it was
    # "[Errno 20] Not a directory" once everything had been generated; with the file itself as
    # --results-path, os.makedirs' traceback, "File exists")
    rc, log = fairseq("generate", args + ["--results-path", str(failed / "generate-test.txt" / "sub")], check=False)
    assert rc == 1 and log.rstrip().splitlines()[-1] == (
        f"error: --results-path {failed / 'generate-test.txt' / 'sub'}: {failed / 'generate-test.txt'} is a file, "
        "not a directory"), log[-3000:]
    assert "loading model" not in log and (failed / "generate-test.txt").read_text() == one_group

    # size 1: one process, torchrun with 2, fairseq's own spawn of 2 (no init method given)
    _, single = fairseq("generate", args)
    _, torchrun = fairseq("generate", args, nproc=2)
    _, spawned = fairseq("generate", args + ["--distributed-world-size", "2"])
    assert "2 data-parallel groups translated" in torchrun and "2 data-parallel groups translated" in spawned
    assert generated(torchrun) == generated(single) and generated(spawned) == generated(single)

    # 3 processes, 2 batches (32 blocks, then the 18 left): a group without a batch
    # failed with ZeroDivisionError (fairseq's sentences per second, its BLEU of nothing)
    assert 32 < blocks <= 64, blocks
    args[args.index("--batch-size") + 1] = "32"
    _, single = fairseq("generate", args)
    _, three = fairseq("generate", args, nproc=3)
    assert "3 data-parallel groups translated" in three and generated(three) == generated(single)


def test_fairseq_interactive_reads_standard_input_at_world_size_4(trained):
    """Prompts piped into torchrun at model-parallel size 2 in a world of 4:
    each prompt answered and printed once. Upstream every rank read standard
    input, the ranks split the lines and the run hung in a collective."""
    args = [trained["data"], "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling",
            "--path", os.path.join(trained["ckpt"], "checkpoint_last.pt"), "--model-parallel-size", "2",
            "--beam", "1", "--max-len-b", "8"]
    _, out = fairseq("interactive", args, nproc=4, stdin="the function\nreturn a\nis the\n", timeout=180)
    assert all(f"as rank {r}" in out for r in range(4)) and "as rank 4" not in out  # fairseq's per-rank line
    hyps = hypotheses(out)
    assert sorted(hyps) == ["H-0", "H-1", "H-2"]  # once per prompt, not once per rank or group
    assert [hyps[f"H-{i}"].split()[:2] for i in range(3)] == [["the", "function"], ["return", "a"], ["is", "the"]]



def test_a_prompt_longer_than_the_model_is_one_error_line(trained):
    """fairseq-interactive given a prompt of 40 words for a model of 32
    positions: fairseq raised a bare Exception (a traceback) telling the
    user to skip the "example"; it is now one line that says it is the
    prompt, and how long (the session stops there, as fairseq's did)."""
    args = [trained["data"], "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling",
            "--path", os.path.join(trained["ckpt"], "checkpoint_last.pt"), "--beam", "1", "--max-len-b", "4"]
    rc, out = fairseq("interactive", args, stdin=" ".join(["the"] * 40) + "\n", check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == (
        "error: a prompt of 41 tokens is longer than the model's positions (max_positions=32): shorten it, "
        "or skip such prompts with --skip-invalid-size-inputs-valid-test"), out[-3000:]

HUB_SCRIPT = """
import sys, torch
from fairseq_megatron.hub import from_pretrained
lm = from_pretrained(sys.argv[1], data=sys.argv[2], cpu=True, model_parallel_size=int(sys.argv[4]))
rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
prompt = "return the"
with open(f"{sys.argv[3]}/rank{rank}.txt", "w") as f:  # one file per rank: stdout lines would interleave
    print(f"size={size} greedy: " + lm.sample(prompt, beam=1, max_len_b=8), file=f)
    print(f"size={size} beam: " + lm.sample(prompt, beam=3, max_len_b=8), file=f)
    print(f"size={size} sampled: " + lm.sample(prompt, beam=1, sampling=True, sampling_topk=20, max_len_b=8), file=f)
"""


@pytest.mark.parametrize("model_parallel_size", [2, 1])
def test_hub_interface_in_a_world_of_2(trained, tmp_path, model_parallel_size):
    """Two processes under torchrun: one model in two parts, or (size 1) a
    whole model on each rank, which failed to build before the plugin gave
    each rank a model-parallel group of one; at size 1 each rank merges the
    two part files in memory."""
    path = os.path.join(trained["ckpt"], "checkpoint_last.pt")
    script = str(tmp_path / "hub_script.py")
    out_dir = tmp_path / "hub_out"
    out_dir.mkdir()
    with open(script, "w") as f:
        f.write(HUB_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           script, path, trained["data"], str(out_dir), str(model_parallel_size)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    rank0 = (out_dir / "rank0.txt").read_text().splitlines()
    rank1 = (out_dir / "rank1.txt").read_text().splitlines()
    assert len(rank0) == 3 and rank0 == rank1  # greedy, beam and sampled text identical on both ranks
    assert all(l.startswith("size=2 ") and l.split(": ", 1)[1].startswith("return the") for l in rank0)


def test_fairseq_spawning_its_processes(trained, tmp_path):
    """Without torchrun fairseq starts the processes itself
    (``torch.multiprocessing.spawn``), as ``fairseq-train
    --distributed-world-size 8`` does on a GPU machine, and under SLURM. Those
    processes imported fairseq afresh and looked for the mpu module before
    fairseq imported the user dir: "Please install the megatron submodule"
    (and on CPU fairseq spawned no process: one per GPU). Spawned at world
    size 2, the run logs the same losses as the fixture's torchrun run (same
    seed, data and per-rank dropout streams: the same computation, so the
    same printed values); fairseq-eval-lm (with two data-parallel groups)
    prints the loss, and fairseq-generate the hypotheses, that torchrun's
    processes print;
    fairseq-interactive answers prompts from ``--input``, and from standard
    input, which the launching process passes on to rank 0. A bad
    input in the spawned processes is one line each, and the launching
    process reports their exit."""
    def launch(world_size=2):
        return ["--distributed-world-size", str(world_size), "--distributed-init-method",
                f"tcp://127.0.0.1:{free_port()}", "--distributed-backend", "gloo"]

    _, log = fairseq("train", train_args(trained["data"], str(tmp_path / "spawned"), max_update=4) + launch())
    assert "training on 2 devices" in log and "torch.distributed.run" not in log, log[-3000:]
    expected = _per_update(trained["first_log"], "loss")
    assert len(expected) == 4 and _per_update(log, "loss") == expected, (_per_update(log, "loss"), expected)
    assert sorted(os.listdir(tmp_path / "spawned")) == ["checkpoint_last-model_part-0.pt",
                                                        "checkpoint_last-model_part-1.pt"]
    # fairseq-eval-lm (the README's command for the published model spawns 8), here with two
    # data-parallel groups: the plugin's tally over the groups must reach the spawned processes too
    path = str(tmp_path / "spawned" / "checkpoint_last.pt")
    _, spawned = fairseq("eval_lm", eval_args(trained["data"], path, 2) + launch(world_size=4))
    _, torchrun = fairseq("eval_lm", eval_args(trained["data"], path, 2), nproc=2)
    assert spawned.count("Loss (base 2)") == 1, spawned[-3000:]
    assert f"2 data-parallel groups scored {evaluated_tokens(torchrun):,} tokens together" in spawned, spawned[-3000:]
    # 4 printed decimals; fp32 sums in another order across the groups
    assert abs(eval_loss(spawned) - eval_loss(torchrun)) <= 2e-4, (eval_loss(spawned), eval_loss(torchrun))
    # fairseq-generate: greedy, the same hypotheses as under torchrun, each printed once
    generate = [trained["data"], "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling", "--path", path,
                "--gen-subset", "test", "--sample-break-mode", "none", "--tokens-per-sample", "32",
                "--prefix-size", "2", "--max-len-b", "12", "--batch-size", "8", "--beam", "1",
                "--model-parallel-size", "2"]
    spawned = hypotheses(fairseq("generate", generate + launch())[1])
    assert len(spawned) >= 10 and spawned == hypotheses(fairseq("generate", generate, nproc=2)[1])
    # fairseq-interactive: spawned processes get /dev/null as standard input (upstream it answered
    # nothing, exit 0); the launching process passes its standard input on to rank 0
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("return the value\n")
    interactive = [trained["data"], "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling", "--path", path,
                   "--tokens-per-sample", "32", "--max-len-b", "8", "--beam", "1", "--model-parallel-size", "2"]
    _, piped = fairseq("interactive", interactive + launch(), stdin="return the\nis the\n")
    _, torchrun = fairseq("interactive", interactive, nproc=2, stdin="return the\nis the\n")
    assert "as rank 1" in piped and sorted(hypotheses(piped)) == ["H-0", "H-1"], piped[-3000:]
    assert hypotheses(piped) == hypotheses(torchrun)
    _, log = fairseq("interactive", interactive + launch() + ["--input", str(prompts)])
    assert [line.split("\t")[0] for line in log.splitlines() if line.startswith("H-")] == ["H-0"], log[-3000:]

    part = os.path.join(trained["ckpt"], "checkpoint_last-model_part-0.pt")
    args = train_args(trained["data"], str(tmp_path / "refused"), max_update=4) + launch()
    rc, log = fairseq("train", args + ["--finetune-from-model", part], check=False)
    line = (f"error: --finetune-from-model {part} is one of 2 model part files: pass the checkpoint's name, "
            f"--finetune-from-model {os.path.join(trained['ckpt'], 'checkpoint_last.pt')}")
    assert rc == 1 and line in log and "Traceback" not in log, log[-3000:]
    assert log.rstrip().splitlines()[-1].startswith("error: process "), log[-3000:]


def _under_slurm(tmp_path, args, nodes, tasks_per_node):
    """Run ``fairseq-train args`` as SLURM would start it on ``nodes`` x
    ``tasks_per_node`` tasks, all on this machine: SLURM's variables per
    task, and an ``scontrol`` that names this machine as the first node.
    Returns each task's (rc, output), in SLURM_PROCID order."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")  # fairseq runs: scontrol show hostnames
    (bin_dir / "scontrol").chmod(0o755)
    port = free_port()
    tasks, logs = [], []
    for node in range(nodes):
        for local in range(tasks_per_node):
            env = dict(ENV, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_NODELIST=f"node[1-{nodes}]",
                       SLURM_NNODES=str(nodes), SLURM_NTASKS_PER_NODE=str(tasks_per_node), SLURM_NODEID=str(node),
                       SLURM_PROCID=str(node * tasks_per_node + local), SLURM_LOCALID=str(local))
            logs.append(tmp_path / f"slurm-task-{len(logs)}.log")
            with open(logs[-1], "w") as log:
                tasks.append(subprocess.Popen([sys.executable, "-m", "fairseq_cli.train", *args, "--distributed-port",
                                               str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
    deadline = time.monotonic() + 300
    while None in (codes := [task.poll() for task in tasks]):
        if time.monotonic() > deadline or any(codes):
            for task in tasks:  # as srun does: one task failed, the others would wait for it
                if task.poll() is None:
                    os.killpg(task.pid, signal.SIGKILL)  # with the processes it spawned
        time.sleep(0.1)
    return [(task.returncode, log.read_text()) for task, log in zip(tasks, logs)]


def test_fairseq_train_under_slurm(trained, tmp_path):
    """fairseq reads SLURM's variables itself (``srun fairseq-train ...
    --distributed-port P``, no torchrun). One task per process, 2 on one
    node: the same losses as the fixture's torchrun run (the same
    computation); on a machine without GPUs fairseq set the task's device
    to SLURM_LOCALID and task 1 failed in ``torch.cuda.set_device``. One task
    per node, as the README's recipe runs: 2 nodes spawning 2 processes each
    (world size 4, two data-parallel groups at model-parallel size 2), the
    same losses as torchrun with 4 processes; on CPU fairseq counted each
    node's GPUs, none, so it spawned nothing and exited 0 with nothing
    trained. A world size that the nodes do not divide is one error line."""
    args = train_args(trained["data"], str(tmp_path / "per-process"), max_update=4) + ["--distributed-world-size", "2"]
    (rc0, log), (rc1, other) = _under_slurm(tmp_path, args, nodes=1, tasks_per_node=2)
    assert rc0 == rc1 == 0 and "training on 2 devices" in log, (log + other)[-3000:]
    expected = _per_update(trained["first_log"], "loss")
    assert len(expected) == 4 and _per_update(log, "loss") == expected, (_per_update(log, "loss"), expected)

    args = train_args(trained["data"], str(tmp_path / "per-node"), max_update=4)
    [(rc0, log), (rc1, other)] = _under_slurm(tmp_path, args + ["--distributed-world-size", "4"], 2, 1)
    assert rc0 == rc1 == 0 and "training on 4 devices" in log, (log + other)[-3000:]
    _, torchrun = fairseq("train", train_args(trained["data"], str(tmp_path / "torchrun"), max_update=4), nproc=4)
    expected = _per_update(torchrun, "loss")
    assert len(expected) == 4 and _per_update(log, "loss") == expected, (_per_update(log, "loss"), expected)
    assert sorted(os.listdir(tmp_path / "per-node")) == ["checkpoint_last-model_part-0.pt",
                                                         "checkpoint_last-model_part-1.pt"]

    line = ("error: --distributed-world-size 3 is not divisible by the 2 SLURM nodes (one task per node spawns "
            "the same number on each)")
    ended = _under_slurm(tmp_path, args + ["--distributed-world-size", "3"], 2, 1)  # the first to fail stops both
    assert all(rc for rc, _ in ended) and any(rc == 1 and log.rstrip().splitlines()[-1] == line
                                              for rc, log in ended), ended


def test_missing_part_file_is_reported(trained):
    broken = trained["root"] / "broken"
    broken.mkdir()
    shutil.copy(os.path.join(trained["ckpt"], "checkpoint_last-model_part-0.pt"), broken)
    rc, out = fairseq("eval_lm", eval_args(trained["data"], str(broken / "checkpoint_last.pt"), 2),
                      nproc=2, check=False)
    assert rc != 0
    assert "checkpoint_last-model_part-1.pt" in out
    # fairseq-train resuming there: rank 0 loaded its part, rank 1 was told
    # the checkpoint had another size; now both name the missing part
    rc, out = fairseq("train", train_args(trained["data"], str(broken), max_update=9), nproc=2, check=False)
    line = (f"error: model part file {broken / 'checkpoint_last-model_part-1.pt'} is missing: "
            f"{broken / 'checkpoint_last.pt'} was saved at model-parallel size 2")
    assert rc != 0 and f"[rank0]: {line}" in out and f"[rank1]: {line}" in out, out[-3000:]


def test_a_dictionary_other_than_the_trained_one_is_one_error_line(trained, tmp_path):
    """The data's dict.txt cut by 10 lines (502 symbols for a model trained
    with 512): at size 2 it pads to the same 512 rows, so fairseq-eval-lm
    evaluated and fine-tuning trained on without a word, every token looked
    up in another symbol's row (stock fairseq's model fails to load:
    "size mismatch"). Both now stop with one line on every rank."""
    data = tmp_path / "bin"
    shutil.copytree(trained["data"], data)
    lines = (data / "dict.txt").read_text().splitlines(keepends=True)
    (data / "dict.txt").write_text("".join(lines[:-10]))
    assert len(Dictionary.load(str(data / "dict.txt"))) == 502
    path = os.path.join(trained["ckpt"], "checkpoint_last.pt")
    rc, out = fairseq("eval_lm", eval_args(str(data), path, 2), nproc=2, check=False)
    line = "error: the dictionary has 502 symbols but the checkpoint's model was trained with 512: " \
           "wrong dict.txt for this checkpoint"
    assert rc != 0 and f"[rank0]: {line}" in out and f"[rank1]: {line}" in out, out[-3000:]
    assert "Loss (base 2)" not in out

    rc, out = fairseq("train", train_args(str(data), str(tmp_path / "finetune"), max_update=2)
                      + ["--finetune-from-model", path], nproc=2, check=False)
    line = f"error: the dictionary has 502 symbols but {path} was trained with 512: wrong dict.txt for this checkpoint"
    assert rc != 0 and f"[rank0]: {line}" in out and f"[rank1]: {line}" in out, out[-3000:]
    assert "num_updates" not in out
    assert not (tmp_path / "finetune").exists()  # made by fairseq-train's main, removed when it failed


def test_a_truncated_part_file_is_one_error_line_on_every_rank(trained, tmp_path):
    """Part 1 cut short (a copy that stopped): before, the rank loading it
    failed inside torch.load and the other reported a lost connection, each
    with a traceback. Now every rank checks every part first and prints the
    same single line, in fairseq-eval-lm (size 2 under torchrun, and size 1
    in one process, where that line is all that follows fairseq's log) and
    in fairseq-train resuming at the saved size."""
    for name in ("checkpoint_last-model_part-0.pt", "checkpoint_last-model_part-1.pt"):
        shutil.copy(os.path.join(trained["ckpt"], name), tmp_path)
    part = tmp_path / "checkpoint_last-model_part-1.pt"
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])
    line = (f"error: {part} is truncated: the zip archive's directory, which torch writes last, is missing "
            f"(was the file still being saved or copied?)")
    path = str(tmp_path / "checkpoint_last.pt")

    rc, out = fairseq("eval_lm", eval_args(trained["data"], path, 2), nproc=2, check=False)
    assert rc != 0
    assert f"[rank0]: {line}" in out and f"[rank1]: {line}" in out, out[-3000:]
    assert "PytorchStreamReader" not in out and "Connection closed" not in out, out[-3000:]

    rc, out = fairseq("eval_lm", eval_args(trained["data"], path, 1), check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == line and "Traceback" not in out, out[-3000:]

    rc, out = fairseq("train", train_args(trained["data"], str(tmp_path), max_update=9), nproc=2, check=False)
    assert rc != 0
    assert f"[rank0]: {line}" in out and f"[rank1]: {line}" in out, out[-3000:]
    assert "num_updates" not in out and part.stat().st_size == len(data) // 2


def test_a_file_that_is_not_a_checkpoint_is_one_error_line(trained, tmp_path):
    """A checkpoint name holding something else (here a text file) in
    fairseq-eval-lm and in fairseq-train resuming, both at size 1 in one
    process: fairseq let torch's unpickling error through as a traceback
    that did not name the file; now one line names it, and the file is
    left as it was."""
    junk = tmp_path / "checkpoint_last.pt"
    junk.write_text("not a checkpoint\n")
    rc, out = fairseq("eval_lm", eval_args(trained["data"], str(junk), 1), check=False)
    last = out.rstrip().splitlines()[-1]
    assert rc == 1 and last.startswith(f"error: cannot read {junk}: UnpicklingError: ") \
        and "Traceback" not in out, out[-3000:]
    rc, out = train_without_dropout(trained["data"], tmp_path, 2, 1, check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1].startswith(f"error: cannot read {junk}: ") \
        and "Traceback" not in out and "num_updates" not in out, out[-3000:]
    assert junk.read_text() == "not a checkpoint\n"


def test_a_path_that_names_nothing_is_one_error_line(trained, tmp_path):
    """Paths that name no file: fairseq answered with a traceback whose last
    line named one rank's part ("Model file not found: ...-model_part-1.pt"),
    an IsADirectoryError for a directory, and a FileNotFoundError for a data
    directory without dict.txt. Each is now one line (on every rank under
    torchrun) naming what was looked for."""
    missing = tmp_path / "missing.pt"
    rc, out = fairseq("eval_lm", eval_args(trained["data"], str(missing), 2), nproc=2, check=False)
    line = (f"error: no checkpoint {missing} and no model part files "
            f"{tmp_path / 'missing-model_part-0.pt'}, ...")
    assert rc != 0 and f"[rank0]: {line}" in out and f"[rank1]: {line}" in out \
        and "]: Traceback" not in out, out[-3000:]  # torchrun's own follows, its summary of the exits
    rc, out = fairseq("eval_lm", eval_args(trained["data"], trained["ckpt"], 1), check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == (
        f"error: {trained['ckpt']} is a directory, not a checkpoint: name a checkpoint in it, such as "
        f"{os.path.join(trained['ckpt'], 'checkpoint_best.pt')}") and "Traceback" not in out, out[-3000:]
    path = os.path.join(trained["ckpt"], "checkpoint_last.pt")
    rc, out = fairseq("eval_lm", eval_args(str(tmp_path), path, 1), check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == (
        f"error: [Errno 2] No such file or directory: '{tmp_path / 'dict.txt'}'") \
        and "Traceback" not in out, out[-3000:]


def test_a_checkpoint_to_start_from_that_does_not_exist_stops_the_run(trained, tmp_path):
    """fairseq-train --restore-file naming no checkpoint (a typo, a wrong
    directory) trained from scratch after one "No existing checkpoint found"
    log line, and saved the new model over the save dir's checkpoint_last;
    so did --continue-once on a first launch, and --finetune-from-model
    naming a directory. Each now stops on every rank before training, with
    the files of the save dir as they were."""
    for name in ("checkpoint_last-model_part-0.pt", "checkpoint_last-model_part-1.pt"):
        shutil.copy(os.path.join(trained["ckpt"], name), tmp_path)
    before = _listing(tmp_path)
    missing = str(tmp_path / "checkpoint_9_99.pt")
    rc, out = fairseq("train", train_args(trained["data"], str(tmp_path), max_update=9)
                      + ["--restore-file", missing], nproc=2, check=False)
    line = (f"error: --restore-file {missing}: no such checkpoint, whole or in model parts "
            f"(leave out --restore-file to start from scratch)")
    assert rc != 0 and f"[rank0]: {line}" in out and f"[rank1]: {line}" in out \
        and "num_updates" not in out, out[-3000:]
    assert _listing(tmp_path) == before
    fresh = tmp_path / "fresh"
    rc, out = train_without_dropout(trained["data"], fresh, 1, 1, "--continue-once", missing, check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == (
        f"error: --continue-once {missing}: no such checkpoint, whole or in model parts "
        f"(leave out --continue-once to start from scratch)") and "num_updates" not in out, out[-3000:]
    rc, out = train_without_dropout(trained["data"], fresh, 1, 1, "--finetune-from-model", trained["ckpt"],
                                    check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == (
        f"error: {trained['ckpt']} is a directory, not a checkpoint: name a checkpoint in it, such as "
        f"{os.path.join(trained['ckpt'], 'checkpoint_best.pt')}") and "num_updates" not in out, out[-3000:]
    assert not fresh.exists() or not os.listdir(fresh)


def test_eval_lm_scores_every_token_or_stops_with_one_line(trained):
    """Blocks longer than the model's 32 positions: fairseq-eval-lm skipped
    such samples with a warning whatever --skip-invalid-size-inputs-valid-test
    said, and printed the loss of the others ("Loss (base 2): 0.0000,
    Perplexity: 1.00" with all of them skipped). A context window as long as
    the blocks left no token to score: ZeroDivisionError in fairseq's block
    dataset. Each now stops with one line on every rank: too-long samples
    unless the flag asks to skip them, and a run in which nothing was scored."""
    path = os.path.join(trained["ckpt"], "checkpoint_last.pt")

    def run(tokens_per_sample, context_window, *extra):
        args = eval_args(trained["data"], path, 2) + list(extra)
        args[args.index("--tokens-per-sample") + 1] = str(tokens_per_sample)
        args[args.index("--context-window") + 1] = str(context_window)
        rc, out = fairseq("eval_lm", args, nproc=2, check=False)
        assert rc != 0 and "Loss (base 2)" not in out and "ZeroDivisionError" not in out, out[-3000:]
        lines = {rank: re.findall(rf"^\[rank{rank}\]: (error: .*)$", out, re.M) for rank in (0, 1)}
        assert len(lines[0]) == 1 and lines[0] == lines[1], out[-3000:]
        return lines[0][0]

    assert re.fullmatch(r"error: [0-9,]+ samples are longer than the model's positions \(sample #\d+: \d+, "
                        r"max_positions=32\): lower --tokens-per-sample, or skip them with "
                        r"--skip-invalid-size-inputs-valid-test", run(64, 0))
    assert re.fullmatch(r"error: all [0-9,]+ samples are longer than the model's positions \(max_positions=32\): "
                        r"lower --tokens-per-sample", run(64, 0, "--skip-invalid-size-inputs-valid-test"))
    assert run(32, 32) == (
        "error: --context-window 32 leaves no token to score in blocks of --tokens-per-sample 32: each "
        "block scores tokens-per-sample minus context-window tokens")


def test_training_on_samples_all_longer_than_the_model_is_one_error_line(trained, tmp_path):
    """fairseq-train skips training samples longer than the model's
    positions, with a warning; where that is all of them (blocks of about 32
    tokens, the last one included, for a model of 16 positions) it failed
    with an IndexError in its batching. Now one line, before any update, and
    the save dir fairseq-train's main made (with its parent) is gone again."""
    train = data_utils.load_indexed_dataset(os.path.join(trained["data"], "train"), None)  # sizes: its memory map
    tokens = int(train.sizes.sum())
    block = next(b for b in range(32, 64) if tokens % b == 0 or tokens % b > 16)  # no last block of <= 16
    save_dir = tmp_path / "runs" / "never"
    rc, out = train_without_dropout(trained["data"], save_dir, 2, 1, "--max-target-positions", "16",
                                    "--tokens-per-sample", str(block), check=False)
    assert rc == 1 and re.fullmatch(
        r"error: all [0-9,]+ samples are longer than the model's positions \(max_positions=16\): "
        r"lower --tokens-per-sample", out.rstrip().splitlines()[-1]) and "num_updates" not in out, out[-3000:]
    assert os.listdir(tmp_path) == []


def test_one_part_file_as_path_is_refused(trained):
    """--path naming a part file instead of the checkpoint (the slip users
    make with the published model) is refused with the name to pass."""
    part = os.path.join(trained["ckpt"], "checkpoint_last-model_part-0.pt")
    rc, out = fairseq("eval_lm", eval_args(trained["data"], part, 1), check=False)
    assert rc != 0
    assert (f"--path {part} is one of 2 model part files: pass the checkpoint's name, "
            f"--path {os.path.join(trained['ckpt'], 'checkpoint_last.pt')}") in out, out[-3000:]


def test_world_size_not_divisible_by_model_parallel_size(trained, tmp_path):
    """Refused before fairseq-train writes anything: the save dir is not
    created (the one-process case created it, empty, before fairseq-train's main checked the launch)."""
    save_dir = tmp_path / "never"
    args = train_args(trained["data"], str(save_dir), max_update=1)
    rc, out = fairseq("train", args, nproc=3, check=False)
    assert rc != 0
    assert "[rank0]: error: world size 3 is not divisible by --model-parallel-size 2" in out, out[-3000:]
    assert not save_dir.exists()
    # one process, no launcher (the commonest slip): it said the model's size differed from the group's
    rc, out = fairseq("train", args, check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == (
        "error: --model-parallel-size 2 needs 2 processes, one per model part, and this run is one process: "
        "launch it with torchrun --nproc_per_node 2 (or give fairseq --distributed-world-size 2 on a machine "
        "with 2 GPUs)"), out[-3000:]
    assert not save_dir.exists()


def test_finished_training_run_again_trains_nothing(trained, tmp_path):
    """The fixture's command run again on its finished checkpoint (4 updates,
    --max-update 4), as a requeued job would: fairseq trained a 5th update
    and saved it over checkpoint_last. Now nothing is trained and the part
    files stay byte for byte as they were."""
    save_dir = tmp_path / "ckpt"
    shutil.copytree(trained["ckpt"], save_dir)
    before = {name: (save_dir / name).read_bytes() for name in os.listdir(save_dir)}
    _, log = fairseq("train", train_args(trained["data"], str(save_dir), max_update=4), nproc=2)
    assert "nothing to train: the checkpoint is at update 4, --max-update is 4; no checkpoint saved" in log, log[-3000:]
    assert "num_updates=5" not in log and "training on 2 devices" in log, log[-3000:]
    assert {name: (save_dir / name).read_bytes() for name in os.listdir(save_dir)} == before


def test_fully_sharded_data_parallel_refused_before_fairseq_train_writes(trained, tmp_path):
    """``--ddp-backend fully_sharded`` at model-parallel size 1 on CPU: one
    error line and no save dir (it was refused while fairseq built the model
    inside FSDP's wrap, after creating --save-dir)."""
    save_dir = tmp_path / "never"
    args = train_args(trained["data"], str(save_dir), max_update=1)
    args[args.index("--model-parallel-size") + 1] = "1"
    rc, out = fairseq("train", args + ["--ddp-backend", "fully_sharded"], check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == (
        "error: --ddp-backend fully_sharded needs CUDA GPUs (fairscale's FSDP); on CPU use --ddp-backend "
        "pytorch_ddp (the default), no_c10d or legacy_ddp"), out[-3000:]
    assert not save_dir.exists()


def test_refused_options_stop_fairseq_train_before_it_writes(trained, tmp_path):
    """Options the model cannot take stop fairseq-train while it parses its
    command line (the architecture function checks them), so nothing is
    written: before, fairseq created --save-dir and only building the model
    refused them. So is --fp16 on CPU, at the start of fairseq-train's main
    (it failed in fairseq's FP16 optimizer), a --save-dir that is a file,
    and --model-parallel-size 0 (in any tool). One process, and two under
    torchrun, each rank saying it."""
    save_dir = tmp_path / "never"
    args = train_args(trained["data"], str(save_dir), max_update=1)
    args[args.index("--model-parallel-size") + 1] = "1"
    rc, out = fairseq("train", args + ["--scale-attn"], check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == (
        "error: --scale-attn: not implemented by the model-parallel decoder; drop it (fairseq's own "
        "transformer_lm has it, without model parallelism)"), out[-3000:]
    assert not save_dir.exists()
    rc, out = fairseq("train", args + ["--fp16"], check=False)  # checked before main writes
    assert rc == 1 and out.rstrip().splitlines()[-1].startswith("error: --fp16 needs a CUDA GPU"), out[-3000:]
    assert not save_dir.exists()
    # a file where --save-dir should be (fairseq's probe said "Not a directory: '<save-dir>/dummy'")
    save_file = tmp_path / "a_file"
    save_file.write_text("keep me\n")
    save_at = args.index("--save-dir") + 1
    rc, out = fairseq("train", args[:save_at] + [str(save_file)] + args[save_at + 1:], check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == (
        f"error: --save-dir {save_file}: {save_file} is a file, not a directory"), out[-3000:]
    assert save_file.read_text() == "keep me\n"
    args[args.index("--model-parallel-size") + 1] = "0"  # it trained as size 1
    rc, out = fairseq("train", args, check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == (
        "error: --model-parallel-size 0: the number of model parts is at least 1"), out[-3000:]
    assert not save_dir.exists()
    args = train_args(trained["data"], str(save_dir), max_update=1) + ["--decoder-attention-heads", "3",
                                                                        "--decoder-embed-dim", "48"]
    rc, out = fairseq("train", args, nproc=2, check=False)
    assert rc != 0
    said = "error: --decoder-attention-heads 3 is not divisible by --model-parallel-size 2"
    assert out.splitlines().count(said) == 2, out[-3000:]  # one line per process
    assert not save_dir.exists()
    # any tool's distributed start refuses a size below 1 (fairseq-eval-lm scored as size 1)
    path = os.path.join(trained["ckpt"], "checkpoint_last.pt")
    rc, out = fairseq("eval_lm", eval_args(trained["data"], path, 0), nproc=2, check=False)
    said = "error: --model-parallel-size 0: the number of model parts is at least 1"
    assert rc == 1 and out.splitlines().count(said) == 2, out[-3000:]


def _per_update(log, key):
    """``key=value`` of each logged update (``--log-format simple``, ``--log-interval 1``)."""
    return [float(v) for v in re.findall(rf"\| epoch \d+: +\d+ / \d+ .*?\b{key}=([0-9.]+)", log)]


def test_offload_activations_trains_like_no_checkpointing(trained, tmp_path):
    """fairseq-train ``--offload-activations`` with dropout on (0.1): at
    model-parallel size 2 it logs the fixture's losses and ``gnorm`` (same
    seed and data, no checkpointing there), and at size 1 on two
    data-parallel groups (DDP's gradient hooks fire during the recompute)
    those of the same run without the flag. Tolerance: none beyond the 3
    printed decimals (the same arithmetic; the recompute replays the masks)."""
    _, log = fairseq("train", train_args(trained["data"], str(tmp_path / "mp2"), max_update=4)
                     + ["--offload-activations", "--no-save"], nproc=2)
    for key in ("loss", "gnorm"):
        expected = _per_update(trained["first_log"], key)
        assert len(expected) == 4 and _per_update(log, key) == expected, (key, _per_update(log, key), expected)
    logs = {}
    for flags in ((), ("--offload-activations",)):
        args = train_args(trained["data"], str(tmp_path / "dp2"), max_update=3)
        args[args.index("--model-parallel-size") + 1] = "1"
        _, logs[flags] = fairseq("train", args + ["--no-save", *flags], nproc=2)
        assert "training on 2 devices" in logs[flags], logs[flags][-2000:]
    for key in ("loss", "gnorm"):
        plain, offloaded = (_per_update(logs[flags], key) for flags in logs)
        assert len(plain) == 3 and offloaded == plain, (key, plain, offloaded)


def test_gradient_norm_and_clipping_match_size_1(trained):
    """``gnorm`` (which ``--clip-norm`` clips by) at model-parallel size 2
    equals the size-1 model's on the same data and initial weights: replicated
    parameters count once (fairseq's MegatronTrainer counts them per rank, 2%
    too high for this model). Dropout is off, so both sizes compute the same
    function. Tolerance: fairseq prints 3 decimals; fp32 differences between
    the sizes are ~1e-6, so values agree to one unit in the last place."""
    logs = {}
    for size in (1, 2):
        args = train_args(trained["data"], str(trained["root"] / f"clip-size{size}"), max_update=3)
        args[args.index("--model-parallel-size") + 1] = str(size)
        args += ["--dropout", "0", "--attention-dropout", "0", "--clip-norm", "0.5", "--no-save"]
        _, logs[size] = fairseq("train", args, nproc=2 if size == 2 else None)
        assert f"training on {size} devices" in logs[size], logs[size][-2000:]
    for key in ("loss", "gnorm"):
        at_1, at_2 = _per_update(logs[1], key), _per_update(logs[2], key)
        assert len(at_1) == len(at_2) == 3, (key, at_1, at_2)
        for a, b in zip(at_1, at_2):
            assert abs(a - b) <= 1.1e-3, (key, at_1, at_2)
    assert min(_per_update(logs[1], "gnorm")) > 0.5, "the updates were not clipped"


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
        one, two = _per_update(logs[1], key), _per_update(logs[2], key)
        assert len(one) == len(two) == 3, (key, one, two)
        for a, b in zip(one, two):
            assert abs(a - b) <= 1.1e-3, (key, one, two)
    assert _per_update(logs[2], "bsz") == [8.0] * 3  # 4 sequences in each of the 2 groups


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
        assert len(_per_update(plain, key)) == 4, plain[-3000:]
        assert _per_update(first, key) + _per_update(resumed, key) == _per_update(plain, key), key
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
    two, one = _per_update(first, "loss") + _per_update(resumed, "loss"), _per_update(whole, "loss")
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
        return log, _per_update(log, "loss")

    _, whole = train("whole", 4, 1, "--update-freq", "2", "--no-save")
    for name, first, then in (("two_then_one", (2,), (1, "--update-freq", "2")),
                              ("one_then_two", (1, "--update-freq", "2"), (2,))):
        _, before = train(name, 2, *first)
        log, after = train(name, 4, *then)  # resumes from checkpoint_last
        assert "epoch 1 goes on after its first 4 batches" in log, log[-3000:]
        assert len(whole) == 4 and len(before + after) == 4, (whole, before, after)
        assert all(abs(a - b) <= 1.1e-3 for a, b in zip(before + after, whole)), (name, before + after, whole)


def word_output(log):
    """fairseq-eval-lm's ``--output-word-probs`` lines as ``[(sample id, [(word, log-prob)])]``
    and its ``--output-word-stats`` lines as ``[(word, count, log-prob sum, fields 3-5)]``."""
    probs, stats = [], []
    for message in re.findall(r"fairseq_cli\.eval_lm(?: \| |:)(.*)", log):  # fairseq's format, or Python's
        fields = message.split("\t")
        if re.fullmatch(r"\d+ .*", message):
            first_id, first_word = fields[0].split(" ", 1)
            words = [re.fullmatch(r"(.*) \[(\S+)\]", f).groups() for f in [first_word] + fields[1:]]
            probs.append((int(first_id), [(w, float(p)) for w, p in words]))
        elif len(fields) == 6 and fields[1].isdigit():
            stats.append((fields[0], int(fields[1]), float(fields[2]), fields[3], float(fields[4]), int(fields[5])))
    return probs, stats


def test_eval_lm_over_two_data_parallel_groups(trained, tmp_path):
    """World size 4 at model-parallel size 2 (two data-parallel groups, each
    DataLoader with 2 workers, an odd number of batches) prints the loss of
    the whole test set, equal to one process's. Upstream this crashed
    (KeyError 'net_input' on the empty batch that pads the short shard), took
    each block's context from whichever batch its worker collated before,
    and printed rank 0's shard only; so did ``--output-word-probs`` and
    ``--output-word-stats``, whose lines now give every sample and word of
    the test set in one process's order. Tolerance as in the size-2 test
    above; for a word's log-probability 1e-4, per occurrence in the
    statistics' sums (fp32 rounding: on the demo checkpoint, size 1 against
    world size 4 at size 2, at most 4e-6 in the 6 printed decimals)."""
    path = os.path.join(trained["ckpt"], "checkpoint_last.pt")
    merged = str(tmp_path / "model.pt")
    reshard(path, merged, 1)
    words = ["--output-word-probs", "--output-word-stats"]
    _, one = fairseq("eval_lm", eval_args(trained["data"], merged, 1) + words)
    blocks = -(-evaluated_tokens(one) // 16)  # eval_args: 32 tokens per sample, 16 of them context
    batch_size = next(b for b in range(3, 20) if -(-blocks // b) % 2 == 1)
    args = eval_args(trained["data"], path, 2) + ["--num-workers", "2"] + words
    args[args.index("--batch-size") + 1] = str(batch_size)
    _, four = fairseq("eval_lm", args, nproc=4)
    assert "2 data-parallel groups scored" in four, four[-3000:]
    assert evaluated_tokens(four) < evaluated_tokens(one)  # this rank's shard only: the data was split
    assert abs(eval_loss(four) - eval_loss(one)) <= 2e-4, (eval_loss(four), eval_loss(one))

    (probs_one, stats_one), (probs_four, stats_four) = word_output(one), word_output(four)
    assert len(probs_one) == blocks and sum(s[1] for s in stats_one) == evaluated_tokens(one), one[-3000:]
    assert [(i, [w for w, _ in ws]) for i, ws in probs_four] == [(i, [w for w, _ in ws]) for i, ws in probs_one]
    assert all(abs(p4 - p1) <= 1e-4 for (_, ws4), (_, ws1) in zip(probs_four, probs_one)
               for (_, p4), (_, p1) in zip(ws4, ws1))
    assert [(s[0], s[1], s[3], s[5]) for s in stats_four] == [(s[0], s[1], s[3], s[5]) for s in stats_one]
    assert all(abs(s4[i] - s1[i]) <= 1e-4 * s1[1] for s4, s1 in zip(stats_four, stats_one) for i in (2, 4))


def _valid_losses(log):
    return [float(v) for v in re.findall(r"valid on 'valid' subset \| loss ([0-9.]+)", log)]


def test_fairseq_validate_over_two_data_parallel_groups(trained):
    """fairseq-validate at world size 4, model-parallel size 2 (two
    data-parallel groups, 7 batches: one group's shard ends with the empty
    batch fairseq pads it with) prints its configuration and result once,
    the loss of one process at size 1 on the same checkpoint (its parts
    joined in memory). Before: every rank printed both, the gather of the
    groups' results failed on CPU (fairseq allocates a CUDA buffer), and
    the padding batch failed on any machine (KeyError 'net_input').
    Tolerance: one unit of the 3 printed decimals (fp32 sums in another
    order)."""
    args = [trained["data"], "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling", "--path",
            os.path.join(trained["ckpt"], "checkpoint_last.pt"), "--sample-break-mode", "none",
            "--tokens-per-sample", "32", "--batch-size", "6", "--valid-subset", "valid"]
    _, one = fairseq("validate", args)
    _, four = fairseq("validate", args + ["--model-parallel-size", "2"], nproc=4)
    assert re.search(r"initialized host \S+ as rank 3\b", four), four[-3000:]  # ran at world size 4
    losses = {"one": _valid_losses(one), "four": _valid_losses(four)}
    assert len(losses["one"]) == len(losses["four"]) == 1, (losses, four[-3000:])
    assert abs(losses["one"][0] - losses["four"][0]) <= 1.1e-3, losses
    assert four.count("| INFO | fairseq_cli.validate | {'_name'") == 1, four[-3000:]


def test_evaluation_scores_every_sample(trained, tmp_path):
    """fairseq drops the last batch when its size is not a multiple of
    ``--required-batch-size-multiple`` (8 by default; fairseq issue 5036).
    With ``--batch-size 4`` the test model's 44 validation blocks made 10
    batches, 40 blocks: fairseq-validate printed 8.33 where fairseq-eval-lm,
    which scores every token, prints 8.3118; fairseq-train's validation
    missed the same blocks (8.912 against 8.8676), and fairseq-generate wrote
    40 hypotheses for 44 prompts. Now all three cover every block: the
    validation losses equal eval-lm's on the same weights. Tolerance: the two
    tools print 3 and 4 decimals (rounding, 5.5e-4) plus fp32 sums in
    another order."""
    data, ckpt = trained["data"], os.path.join(trained["ckpt"], "checkpoint_last.pt")
    valid = data_utils.load_indexed_dataset(os.path.join(data, "valid"), None)  # unmapped when collected
    tokens = int(valid.sizes.sum())
    blocks = -(-tokens // 32)  # --tokens-per-sample 32
    assert blocks % 8, blocks  # so that generate's --batch-size 8 also leaves a short last batch
    subset = ["--sample-break-mode", "none", "--tokens-per-sample", "32", "--batch-size", "4"]
    evaluate = [data, "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling", *subset]

    def eval_lm_loss(path):
        _, log = fairseq("eval_lm", evaluate + ["--path", path, "--gen-subset", "valid"])
        assert evaluated_tokens(log) == tokens, log[-3000:]
        return eval_loss(log)

    _, log = fairseq("validate", evaluate + ["--path", ckpt, "--valid-subset", "valid"])
    validated, scored = _valid_losses(log), eval_lm_loss(ckpt)
    assert len(validated) == 1 and abs(validated[0] - scored) <= 1e-3, (validated, scored)

    # fairseq-train at size 1 validating after update 2, then saving those weights
    save_dir = tmp_path / "train"
    args = train_args(data, str(save_dir), max_update=2)
    args.remove("--disable-validation")
    args[args.index("--model-parallel-size") + 1] = "1"
    _, log = fairseq("train", args + ["--validate-interval-updates", "2", "--save-interval-updates", "2"])
    validated, scored = _valid_losses(log), eval_lm_loss(str(save_dir / "checkpoint_last.pt"))
    assert len(validated) == 1 and abs(validated[0] - scored) <= 1e-3, (validated, scored)

    generate = evaluate + ["--path", ckpt, "--gen-subset", "valid", "--prefix-size", "2", "--max-len-b", "4",
                           "--beam", "1"]
    generate[generate.index("--batch-size") + 1] = "8"
    _, log = fairseq("generate", generate)
    assert sorted(int(line.split("\t")[0][2:]) for line in log.splitlines() if line.startswith("H-")) == list(
        range(blocks)), log[-3000:]



def test_keep_best_checkpoints_of_model_parts(trained, tmp_path):
    """``--keep-best-checkpoints 2`` at size 2, validating after every update:
    fairseq stopped at the second validation ("could not convert string to
    float: 'part-0.pt'": it read the score back from the file name by
    splitting at the last "_", and the part suffix has one). Now each part
    keeps the checkpoints of the two best validation losses, under fairseq's
    names (score with 3 decimals, a tie-breaking digit, the part suffix),
    and the other files are fairseq's usual ones."""
    save_dir = tmp_path / "ckpt"
    args = train_args(trained["data"], str(save_dir), max_update=4)
    args.remove("--disable-validation")
    args += ["--save-interval-updates", "1", "--keep-interval-updates", "1", "--keep-best-checkpoints", "2"]
    _, log = fairseq("train", args, nproc=2)
    losses = _valid_losses(log)
    assert len(losses) == 4, log[-3000:]
    files = sorted(os.listdir(save_dir))
    best = [f for f in files if f.startswith("checkpoint.best_")]
    for part in (0, 1):
        scores = sorted(float(m.group(1)[:-1]) for f in best
                        if (m := re.fullmatch(rf"checkpoint\.best_loss_(\d+\.\d+)-model_part-{part}\.pt", f)))
        assert scores == sorted(losses)[:2], (scores, losses, files)
    assert sorted(set(files) - set(best)) == [f"checkpoint{kind}-model_part-{part}.pt"
                                               for kind in ("_1_4", "_best", "_last") for part in (0, 1)], files


def test_an_interrupted_checkpoint_copy_leaves_the_old_file_whole(tmp_path, monkeypatch):
    """fairseq-train makes ``checkpoint_last`` (after an interval or epoch
    checkpoint) and ``checkpoint_best`` by copying the file it just saved,
    with ``PathManager.copy``; upstream that wrote the destination in place,
    so a copy cut short (the job killed, the disk full) left a truncated
    ``checkpoint_last``. Our models' saves copy with ``copy_whole``: here the
    copy stops half-way with an OSError, the old file is still whole and no
    temporary file is left; an uninterrupted copy replaces it."""
    from fairseq_megatron.fairseq_integration.checkpoint_utils import copy_whole

    src, dst = tmp_path / "checkpoint_1_4-model_part-0.pt", tmp_path / "checkpoint_last-model_part-0.pt"
    src.write_bytes(b"new" * 1000)
    dst.write_bytes(b"old" * 1000)

    def copy_half(source, destination, **_):
        data = open(source, "rb").read()
        with open(destination, "wb") as f:
            f.write(data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", copy_half)
    with pytest.raises(OSError, match="No space left on device"):
        copy_whole(str(src), str(dst))
    assert dst.read_bytes() == b"old" * 1000
    assert sorted(os.listdir(tmp_path)) == [src.name, dst.name]
    monkeypatch.undo()
    copy_whole(str(src), str(dst))
    assert dst.read_bytes() == b"new" * 1000 and sorted(os.listdir(tmp_path)) == [src.name, dst.name]


def test_checkpoints_under_a_directory_named_with_pt(trained, tmp_path):
    """fairseq names a rank's part with ``name.replace(".pt", suffix + ".pt")``,
    which also rewrote ".pt" inside a directory name: for ``wiki.ptb/
    checkpoint_last.pt`` rank 0 looked for ``wiki-model_part-0.ptb/
    checkpoint_last-model_part-0.pt``. fairseq-train ``--restore-file``
    logged "No existing checkpoint found" and trained from scratch, and
    fairseq-eval-lm stopped with "Model file not found". Now both load the
    parts."""
    directory = tmp_path / "wiki.ptb"
    directory.mkdir()
    for rank in (0, 1):
        shutil.copy(os.path.join(trained["ckpt"], f"checkpoint_last-model_part-{rank}.pt"), directory)
    path = str(directory / "checkpoint_last.pt")
    _, log = fairseq("train", train_args(trained["data"], str(tmp_path / "resumed"), max_update=9)
                     + ["--restore-file", path, "--no-save"], nproc=2)  # 9: above any other test's resume
    assert re.search(rf"Loaded checkpoint {re.escape(str(directory))}/checkpoint_last-model_part-0\.pt "
                     r"\(epoch \d+ @ \d+ updates\)", log), log[-3000:]
    assert "No existing checkpoint found" not in log
    _, out = fairseq("eval_lm", eval_args(trained["data"], path, 2), nproc=2)
    assert eval_loss(out) > 0
