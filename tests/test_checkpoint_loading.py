"""fairseq's ``load_model_ensemble_and_task`` on our checkpoints
(``fairseq_integration`` step 26): the model it builds for a checkpoint's
weights draws no initial weights, and every parameter still comes from the
checkpoint. In one process at model-parallel size 1; the tools that use it
at other sizes are tested end to end in test_end_to_end.py and
test_eval_lm.py."""

import math
import os
from argparse import Namespace

import pytest
import torch
from fairseq import checkpoint_utils

import fairseq_megatron  # noqa: F401  (installs the integration steps)
from fairseq_megatron.models.model_parallel_transformer_lm import ModelParallelTransformerLanguageModel
from fairseq_megatron.modules import sharding
from tests.helpers import build_model, make_dictionary, model_args

# The weights the model-parallel layers draw through sharding.init_shard_:
# q/k/v/out projections, fc1/fc2 and the vocab-parallel embedding (tied to
# the output projection). Biases start at zero and layer norms at one.
DRAWN = ("_proj.weight", "fc1.weight", "fc2.weight", "embed_tokens.weight")


def save_fairseq_checkpoint(directory, seed=5, drop=None) -> tuple:
    """A checkpoint as fairseq-train saves it at size 1 (an argparse ``args``
    config, the task's data directory with its dict.txt): (path, weights)."""
    make_dictionary().save(os.path.join(directory, "dict.txt"))
    model, _ = build_model(1, seed=seed)
    args = model_args(1)
    args.task, args.data, args.arch, args.criterion = (
        "language_modeling", str(directory), "transformer_lm_megatron_11b", "cross_entropy")
    weights = model.state_dict()
    saved = {k: v for k, v in weights.items() if k != drop}
    history = [{"num_updates": 3, "best_loss": None, "criterion_name": "CrossEntropyCriterion",
                "optimizer_name": "Adam", "lr_scheduler_state": {}}]
    path = os.path.join(directory, "model.pt")
    torch.save({"args": Namespace(**vars(args)), "model": saved, "optimizer_history": history,
                "extra_state": {}, "last_optimizer_state": None}, path)
    return path, weights


@pytest.fixture
def nan_before_loading(monkeypatch):
    """The names of the parameters that are all NaN when fairseq loads the
    checkpoint into the model it built, one list per load."""
    seen = []
    original = ModelParallelTransformerLanguageModel.load_state_dict

    def load_state_dict(self, *args, **kwargs):
        seen.append(sorted(n for n, p in self.named_parameters() if torch.isnan(p).all()))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ModelParallelTransformerLanguageModel, "load_state_dict", load_state_dict)
    return seen


def test_a_model_built_for_a_checkpoint_draws_no_initial_weights(tmp_path, nan_before_loading):
    path, weights = save_fairseq_checkpoint(tmp_path)
    drawn = sorted(n for n in dict(build_model(1)[0].named_parameters()) if n.endswith(DRAWN))
    assert len(drawn) == 2 * 6 + 1  # 2 layers of 6 weight matrices, and the embedding

    generator = torch.get_rng_state()
    (model,), _, _ = checkpoint_utils.load_model_ensemble_and_task([path])
    assert nan_before_loading == [drawn]  # none drawn: NaN until the checkpoint filled them
    assert torch.equal(torch.get_rng_state(), generator)  # nor the tied output projection's own weight
    loaded = model.state_dict()
    assert loaded.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor), name  # bitwise the checkpoint's, no NaN left

    # A load that may leave parameters unfilled (fairseq passes strict=False
    # for --checkpoint-shard-count > 1) initialises them as before.
    checkpoint_utils.load_model_ensemble_and_task([path], strict=False)
    assert nan_before_loading[-1] == []
    assert not torch.equal(torch.get_rng_state(), generator)


def test_a_weight_the_checkpoint_lacks_stops_the_load(tmp_path):
    """NaN cannot reach a forward pass: strict loading raises for the missing key."""
    path, _ = save_fairseq_checkpoint(tmp_path, drop="decoder.layers.1.fc1.weight")
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*decoder\.layers\.1\.fc1\.weight"):
        checkpoint_utils.load_model_ensemble_and_task([path])


def test_two_checkpoints_in_one_path_are_an_ensemble_or_one_error_line(tmp_path):
    """fairseq-generate splits ``--path a.pt:b.pt`` before loading (an
    ensemble); fairseq-eval-lm and -validate pass it whole, which named no
    checkpoint ("no checkpoint a.pt:b.pt")."""
    from fairseq_megatron.errors import UsageError

    paths = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        paths.append(save_fairseq_checkpoint(tmp_path / name, seed=len(paths))[0])
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task(paths)  # split: an ensemble
    assert len(models) == 2
    joined = os.pathsep.join(paths)
    with pytest.raises(UsageError, match=f"^--path {joined} names 2 checkpoints: this tool scores one model "):
        checkpoint_utils.load_model_ensemble_and_task([joined])
    with pytest.raises(FileNotFoundError, match="no checkpoint"):  # one of them missing: say which name failed
        checkpoint_utils.load_model_ensemble_and_task([os.pathsep.join([paths[0], str(tmp_path / "c.pt")])])


def test_initialisation_skipped_leaves_nan_and_the_generator_alone():
    before = torch.get_rng_state()
    shard = torch.zeros(4, 3)
    with sharding.initialisation_skipped():
        with sharding.initialisation_skipped():  # nests: the outer context still skips
            pass
        sharding.init_shard_(shard, (8, 3), 0, 1, 2, torch.nn.init.xavier_normal_)
    assert torch.isnan(shard).all() and torch.equal(torch.get_rng_state(), before)
    sharding.init_shard_(shard, (8, 3), 0, 1, 2, torch.nn.init.xavier_normal_)  # outside: drawn again
    assert not torch.equal(torch.get_rng_state(), before)
    assert torch.isfinite(shard).all() and 0 < shard.std().item() < 2 * math.sqrt(2 / (8 + 3))


def test_loading_benchmark_runs_both_ways_on_a_tiny_shape(tmp_path):
    """scripts/benchmark_model_loading.py (its numbers are in the README)
    still runs: a tiny checkpoint, loaded once with the initial weights
    drawn and once skipped, each in its own process."""
    import re
    import subprocess
    import sys

    from tests.helpers import ENV

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                          "benchmark_model_loading.py")
    proc = subprocess.run([sys.executable, script, "--work-dir", str(tmp_path), "--layers", "1", "--hidden", "64",
                           "--heads", "4", "--ffn", "128", "--vocab", "64", "--repeats", "1"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert re.search(r"load 1, initial weights drawn: [0-9.]+ s\nload 1, initial weights skipped: [0-9.]+ s\n"
                     r"median: drawn [0-9.]+ s, skipped [0-9.]+ s", proc.stdout), proc.stdout
    assert sorted(os.listdir(tmp_path)) == ["dict.txt", "model.pt"]  # no temporary file left
