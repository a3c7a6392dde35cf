"""fairseq-train of our models on CPU processes: part files, resuming, the options it refuses before it writes, the checkpoint it starts from."""

import json
import os
import re
import shutil
import sys

import pytest
import torch
from fairseq.data import Dictionary, data_utils

from fairseq_megatron.checkpoint.resharding import reshard
from fairseq_megatron.cli import reshard_checkpoint
from tests.e2e.common import eval_args, eval_loss, listing, per_update, train_args, train_without_dropout, valid_losses
from tests.helpers import fairseq


def test_train_writes_one_part_per_rank(trained):
    """Each rank writes its part; the save is committed by a manifest that
    lists the parts and the token each of them carries (one save)."""
    files = sorted(os.listdir(trained["ckpt"]))
    assert files == ["checkpoint_last-model_part-0.pt", "checkpoint_last-model_part-1.pt",
                     "checkpoint_last.pt.manifest.json"], files
    parts = files[:2]
    states = [torch.load(os.path.join(trained["ckpt"], p), weights_only=False) for p in parts]
    manifest = json.loads((trained["root"] / "ckpt" / "checkpoint_last.pt.manifest.json").read_text())
    assert manifest["parts"] == parts and manifest["updates"] == 4
    assert [state["extra_state"]["save"] for state in states] == [{"token": manifest["token"], "updates": 4}] * 2
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


def test_the_log_gives_throughput_per_gpu(trained):
    """Each update the size-2 run (2 processes on a CPU) logged gives tokens/s
    per process, ``wps / 2``, and model TFLOP/s per process, ``tps x (6 N +
    12 L h s) / 1e12``, with ``N`` the benchmark's count from the shape
    (tied embedding, the 512 padded rows the part files hold) and ``L h s =
    2 x 64 x 32``: the figure scripts/benchmark.py reports for such a run;
    and its peak memory; no MFU on a CPU."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "scripts"))
    import benchmark

    params = benchmark.count_params(dict(layers=2, hidden=64, ffn=256, heads=4, seq_len=32), 512)
    flops_per_token = 6 * params + 12 * 2 * 64 * 32
    updates = re.findall(r"\| epoch \d+: +\d+ / \d+ (.*)", trained["first_log"])
    assert len(updates) == 4, trained["first_log"][-3000:]
    for update in updates:
        logged = dict(re.findall(r"(\w+)=([^,\s]+)", update))
        wps, tps, tflops = (float(logged[key]) for key in ("wps", "tps", "tflops"))
        # fairseq rounds wps to 0.1 tokens/s and reads the clock for it apart from ours: microseconds later, of an
        # interval of tens of milliseconds here (one update)
        assert tps == pytest.approx(wps / 2, rel=1e-2), update
        # one reading of the clock for both; each printed to 6 significant digits ("{:g}")
        assert tflops == pytest.approx(tps * flops_per_token / 1e12, rel=1e-5), update
        assert float(logged["gb_peak"]) > 0 and "mfu" not in logged, update


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
        return per_update(logs[-1], "loss")

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


def test_resuming_at_another_size_stops_instead_of_starting_over(trained, tmp_path, capsys):
    """fairseq-train at size 1 in a save dir holding a size-2 checkpoint_last:
    fairseq would not find checkpoint_last.pt and train from scratch; the run
    stops before training, says how to reshard, and leaves the files alone.
    Each way on the message gives, followed as written, trains: the
    resharding command with the optimizer state and a run in its directory
    (from the saved update), and a new run from the weights."""
    for name in ("checkpoint_last-model_part-0.pt", "checkpoint_last-model_part-1.pt"):
        shutil.copy(os.path.join(trained["ckpt"], name), tmp_path)
    before = listing(tmp_path)
    args = train_args(trained["data"], str(tmp_path), max_update=9)
    args[args.index("--model-parallel-size") + 1] = "1"
    args[args.index("--criterion") + 1] = "cross_entropy"
    rc, out = fairseq("train", args, check=False)
    assert rc != 0
    assert ("checkpoint_last.pt was saved at model-parallel size 2, this run has size 1: resume with "
            "--model-parallel-size 2, or reshard it with its optimizer state") in out, out[-3000:]
    assert "num_updates" not in out  # no update ran
    assert listing(tmp_path) == before
    # with --reset-optimizer the weights would load, but the run would save a
    # size-1 checkpoint_last.pt beside the size-2 parts
    rc, out = fairseq("train", args + ["--reset-optimizer"], check=False)
    assert rc != 0 and "num_updates" not in out, out[-3000:]
    assert out.rstrip().splitlines()[-1] == (
        f"error: {tmp_path / 'checkpoint_last.pt'} is in --save-dir {tmp_path}, where this run would save "
        f"checkpoints of model-parallel size 1 under the same names: pass another --save-dir (with --restore-file "
        f"{tmp_path / 'checkpoint_last.pt'})"), out[-3000:]
    assert listing(tmp_path) == before

    _, advice = fairseq("train", args, check=False)
    command = re.search(r"\((fairseq-megatron-reshard [^)]*)\) and train with --save-dir NEW_DIR", advice).group(1)
    resharded = tmp_path / "resharded"
    assert reshard_checkpoint.main(command.replace("NEW_DIR", str(resharded)).split()[1:]) == 0
    capsys.readouterr()
    resume = _with(_with(args, "--save-dir", str(resharded)), "--criterion", "vocab_parallel_cross_entropy")  # as saved
    _, log = fairseq("train", resume)
    assert "(epoch 1 @ 4 updates)" in log and "num_updates=5," in log, log[-3000:]
    flags = re.search(r"start a new run from its weights with (--save-dir NEW_DIR --restore-file \S+ "
                      r"--reset-optimizer)", advice).group(1).replace("NEW_DIR", str(tmp_path / "fresh")).split()
    _, log = fairseq("train", _with(args, *flags[:2]) + flags[2:])
    assert "2 model part(s), loaded at model-parallel size 1" in log and "num_updates=1," in log, log[-3000:]


def _with(args, flag, value):
    """``args`` with ``flag``'s value set to ``value``."""
    args = list(args)
    args[args.index(flag) + 1] = value
    return args


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
    expected = per_update(reference, "loss")
    assert len(expected) == 3, reference[-3000:]
    for what, log in runs.items():
        assert "(epoch 1 @ 0 updates)" in log, (what, log[-3000:])
        losses = per_update(log, "loss")
        assert len(losses) == 3 and all(abs(a - b) <= 1.1e-3 for a, b in zip(losses, expected)), \
            (what, losses, expected)
    fresh = per_update(train("fresh", 2), "loss")
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


def test_a_checkpoint_to_start_from_that_does_not_exist_stops_the_run(trained, tmp_path):
    """fairseq-train --restore-file naming no checkpoint (a typo, a wrong
    directory) trained from scratch after one "No existing checkpoint found"
    log line, and saved the new model over the save dir's checkpoint_last;
    so did --continue-once on a first launch, and --finetune-from-model
    naming a directory. Each now stops on every rank before training, with
    the files of the save dir as they were."""
    for name in ("checkpoint_last-model_part-0.pt", "checkpoint_last-model_part-1.pt"):
        shutil.copy(os.path.join(trained["ckpt"], name), tmp_path)
    before = listing(tmp_path)
    missing = str(tmp_path / "checkpoint_9_99.pt")
    rc, out = fairseq("train", train_args(trained["data"], str(tmp_path), max_update=9)
                      + ["--restore-file", missing], nproc=2, check=False)
    line = (f"error: --restore-file {missing}: no such checkpoint, whole or in model parts "
            f"(leave out --restore-file to start from scratch)")
    assert rc != 0 and f"[rank0]: {line}" in out and f"[rank1]: {line}" in out \
        and "num_updates" not in out, out[-3000:]
    assert listing(tmp_path) == before
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


def test_fairscale_options_with_fully_sharded_refused_before_fairseq_train_writes(trained, tmp_path):
    """``--ddp-backend fully_sharded`` is torch's FSDP2 here; fairscale's
    ``--cpu-offload`` has no counterpart: one error line and no save dir
    (fairseq would have created --save-dir before building the model)."""
    save_dir = tmp_path / "never"
    args = train_args(trained["data"], str(save_dir), max_update=1)
    args[args.index("--model-parallel-size") + 1] = "1"
    rc, out = fairseq("train", args + ["--ddp-backend", "fully_sharded", "--cpu-offload"], check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == (
        "error: --cpu-offload does not work with --ddp-backend fully_sharded (fairscale's FSDP option; torch's "
        "FSDP2 here keeps the parameter shards on the device); drop it, or use --ddp-backend pytorch_ddp"
    ), out[-3000:]
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
    for size in (0, -1):  # in one process
        rc, out = fairseq("eval_lm", eval_args(trained["data"], path, size), check=False)
        assert rc == 1 and out.rstrip().splitlines()[-1] == (
            f"error: --model-parallel-size {size}: the number of model parts is at least 1"), out[-3000:]


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
        expected = per_update(trained["first_log"], key)
        assert len(expected) == 4 and per_update(log, key) == expected, (key, per_update(log, key), expected)
    logs = {}
    for flags in ((), ("--offload-activations",)):
        args = train_args(trained["data"], str(tmp_path / "dp2"), max_update=3)
        args[args.index("--model-parallel-size") + 1] = "1"
        _, logs[flags] = fairseq("train", args + ["--no-save", *flags], nproc=2)
        assert "training on 2 devices" in logs[flags], logs[flags][-2000:]
    for key in ("loss", "gnorm"):
        plain, offloaded = (per_update(logs[flags], key) for flags in logs)
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
        at_1, at_2 = per_update(logs[1], key), per_update(logs[2], key)
        assert len(at_1) == len(at_2) == 3, (key, at_1, at_2)
        for a, b in zip(at_1, at_2):
            assert abs(a - b) <= 1.1e-3, (key, at_1, at_2)
    assert min(per_update(logs[1], "gnorm")) > 0.5, "the updates were not clipped"


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
    losses = valid_losses(log)
    assert len(losses) == 4, log[-3000:]
    files = sorted(os.listdir(save_dir))
    best = [f for f in files if f.startswith("checkpoint.best_")]
    for part in (0, 1):
        scores = sorted(float(m.group(1)[:-1]) for f in best
                        if (m := re.fullmatch(rf"checkpoint\.best_loss_(\d+\.\d+)-model_part-{part}\.pt", f)))
        assert scores == sorted(losses)[:2], (scores, losses, files)
    parts = [f for f in files if f.endswith(".pt")]
    assert sorted(set(parts) - set(best)) == [f"checkpoint{kind}-model_part-{part}.pt"
                                               for kind in ("_1_4", "_best", "_last") for part in (0, 1)], files
    # one manifest per checkpoint kept (those of the removed ones removed with them)
    assert sorted(set(files) - set(parts)) == sorted(f"{f.replace('-model_part-0.pt', '.pt')}.manifest.json"
                                                     for f in parts if "-model_part-0." in f), files


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
