"""fairseq-megatron-hydra-train: fairseq's Hydra front end for our models.

Stock ``fairseq-hydra-train`` imports ``common.user_dir`` only after it has
set up torch.distributed, so at model-parallel size > 1 it cannot build the
model-parallel groups. Our entry point installs the plugin first; here it
trains the model of a YAML config at model-parallel size 2 (torchrun, 2 CPU
processes) and must produce the weights fairseq-train produces from the
same settings."""

import os
import re

import pytest
import torch

from fairseq_megatron import USER_DIR
from tests.e2e.common import binarized_corpus, eval_loss, evaluated_tokens
from tests.helpers import fairseq

# One model and run, written once for each front end. Dropout stays on: both
# runs draw the same masks from the same seeds.
SETTINGS = dict(layers=2, embed=64, ffn=256, heads=4, tokens=32, batch=4, lr=0.001, updates=3, seed=5)
CONFIG = """\
common:
  cpu: true
  seed: {seed}
  model_parallel_size: {size}
  log_format: simple
  log_interval: 1
distributed_training:
  distributed_world_size: {size}
checkpoint:
  save_dir: {save_dir}
  no_epoch_checkpoints: true
task:
  _name: language_modeling
  data: {data}
  tokens_per_sample: {tokens}
  sample_break_mode: none
dataset:
  batch_size: {batch}
  disable_validation: true
criterion:
  _name: vocab_parallel_cross_entropy
model:
  _name: transformer_lm_megatron_11b
  decoder_layers: {layers}
  decoder_embed_dim: {embed}
  decoder_ffn_embed_dim: {ffn}
  decoder_attention_heads: {heads}
  share_decoder_input_output_embed: true
optimizer:
  _name: adam
lr_scheduler:
  _name: fixed
optimization:
  lr: [{lr}]
  max_update: {updates}
"""


def fairseq_train_args(data, save_dir, size):
    s = SETTINGS
    return [data, "--user-dir", USER_DIR, "--cpu", "--seed", str(s["seed"]), "--model-parallel-size", str(size),
            "--log-format", "simple", "--log-interval", "1", "--save-dir", save_dir, "--no-epoch-checkpoints",
            "--task", "language_modeling", "--tokens-per-sample", str(s["tokens"]), "--sample-break-mode", "none",
            "--batch-size", str(s["batch"]), "--disable-validation",
            "--criterion", "vocab_parallel_cross_entropy", "--arch", "transformer_lm_megatron_11b",
            "--decoder-layers", str(s["layers"]), "--decoder-embed-dim", str(s["embed"]),
            "--decoder-ffn-embed-dim", str(s["ffn"]), "--decoder-attention-heads", str(s["heads"]),
            "--share-decoder-input-output-embed", "--optimizer", "adam", "--lr-scheduler", "fixed",
            "--lr", str(s["lr"]), "--max-update", str(s["updates"])]


def hydra_train(config_dir, overrides=(), nproc=None, check=True):
    """``python -m fairseq_megatron.cli.hydra_train`` (what the console
    script ``fairseq-megatron-hydra-train`` runs) on ``config_dir/run.yaml``,
    in that directory: (rc, output)."""
    args = ["--config-dir", str(config_dir), "--config-name", "run", *overrides]
    return fairseq("fairseq_megatron.cli.hydra_train", args, nproc=nproc, check=check, cwd=config_dir)


def write_config(directory, data, save_dir, size):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "run.yaml"), "w") as f:
        f.write(CONFIG.format(data=data, save_dir=save_dir, size=size, **SETTINGS))
    return directory


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return binarized_corpus(tmp_path_factory.mktemp("hydra"), max_bytes=100_000)


@pytest.fixture(scope="module")
def hydra_and_flags(data, tmp_path_factory):
    """The same run from a YAML config and from fairseq-train's flags, both at
    model-parallel size 2 in 2 processes."""
    root = tmp_path_factory.mktemp("hydra_runs")
    hydra_dir, flags_dir = str(root / "hydra_ckpt"), str(root / "flags_ckpt")
    _, hydra_log = hydra_train(write_config(root / "config", data, hydra_dir, 2), nproc=2)
    _, flags_log = fairseq("train", fairseq_train_args(data, flags_dir, 2), nproc=2)
    return {"data": data, "root": root, "hydra": hydra_dir, "flags": flags_dir,
            "hydra_log": hydra_log, "flags_log": flags_log}


def test_hydra_train_at_size_2_equals_fairseq_train(hydra_and_flags):
    # Both ran at world size 2 and took the same number of updates.
    for log in (hydra_and_flags["hydra_log"], hydra_and_flags["flags_log"]):
        assert "training on 2 devices" in log, log[-3000:]
        assert re.search(rf"num_updates[ =]{SETTINGS['updates']}\b", log), log[-3000:]
    for part in (0, 1):
        name = f"checkpoint_last-model_part-{part}.pt"
        ours = torch.load(os.path.join(hydra_and_flags["hydra"], name), weights_only=False)
        theirs = torch.load(os.path.join(hydra_and_flags["flags"], name), weights_only=False)
        assert sorted(ours["model"]) == sorted(theirs["model"])
        # Same program, seeds and batches; only the config was built another
        # way: the weights must be equal bit for bit.
        different = [k for k in theirs["model"] if not torch.equal(ours["model"][k], theirs["model"][k])]
        assert not different, different
        assert ours["optimizer_history"][-1]["num_updates"] == SETTINGS["updates"]
        # The model config records the run's settings, as fairseq-train's does.
        model = ours["cfg"]["model"]
        assert (model["model_parallel_size"], model["cpu"], model["tokens_per_sample"]) == (2, True, SETTINGS["tokens"])
        assert model["padded_vocab_size"] == theirs["cfg"]["model"].padded_vocab_size


def test_hydra_checkpoint_evaluates_at_its_size_and_at_size_1(hydra_and_flags):
    """fairseq-eval-lm reads the recorded size: at size 2 it loads the two
    parts, at size 1 it builds the whole model from them in memory."""
    path = os.path.join(hydra_and_flags["hydra"], "checkpoint_last.pt")
    args = [hydra_and_flags["data"], "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling", "--path", path,
            "--gen-subset", "valid", "--tokens-per-sample", str(SETTINGS["tokens"]), "--batch-size", "8"]
    _, at_2 = fairseq("eval_lm", args + ["--model-parallel-size", "2"], nproc=2)
    _, at_1 = fairseq("eval_lm", args + ["--model-parallel-size", "1"])
    assert "2 model part(s), loaded at model-parallel size 1" in at_1, at_1[-3000:]
    assert evaluated_tokens(at_2) == evaluated_tokens(at_1) > 0
    # eval-lm prints 4 decimals; fp32 sums over 2 shards vs 1 differ by ~1e-6.
    assert abs(eval_loss(at_2) - eval_loss(at_1)) <= 2e-4, (eval_loss(at_2), eval_loss(at_1))


def test_bad_config_ends_as_one_error_line(data, tmp_path):
    config = write_config(tmp_path / "config", data, str(tmp_path / "ckpt"), 1)
    rc, out = hydra_train(config, ["model.decoder_attention_heads=3"], check=False)
    assert rc == 1, out[-3000:]
    assert "error: --decoder-embed-dim 64 is not divisible by --decoder-attention-heads 3" in out, out[-3000:]
    assert "Traceback" not in out and "Error executing job" not in out, out[-3000:]
    assert not os.path.exists(tmp_path / "ckpt")  # refused before fairseq-train creates its save_dir
    # a model-parallel size without a launcher, found once the run's processes are known
    config = write_config(tmp_path / "config2", data, str(tmp_path / "ckpt"), 2)
    rc, out = hydra_train(config, ["distributed_training.distributed_world_size=1"], check=False)
    assert rc == 1, out[-3000:]
    assert out.rstrip().splitlines()[-1].startswith(
        "error: --model-parallel-size 2 needs 2 processes, one per model part, and this run is one process"), out[-3000:]
    assert not os.path.exists(tmp_path / "ckpt")
