"""fairseq's ``load_model_ensemble_and_task`` on our checkpoints, in one
process at model-parallel size 1: the model it builds for a checkpoint's
weights draws no initial weights, and every parameter still comes from the
checkpoint. And fairseq-train's model, built before fairseq-train knows
whether a checkpoint will fill it: its draws are deferred, and when they run
they give bitwise the weights, and the generator state, of a build that drew
them. Other sizes: tests/distributed/ and the tools in tests/e2e/."""

import os
from argparse import Namespace

import pytest
import torch
from fairseq import checkpoint_utils

import fairseq_megatron  # noqa: F401  (installs the integration steps)
from fairseq_megatron.models.model_parallel_transformer_lm import ModelParallelTransformerLanguageModel
from tests.helpers import LMTask, build_model, make_dictionary, model_args
from tests.support.checkpoint_loading import DRAWN, built_both_ways


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
def unfilled_before_loading(monkeypatch):
    """The names of the parameters that hold no values yet (on the ``meta``
    device: neither drawn nor even allocated) when fairseq loads the
    checkpoint into the model it built, one list per load."""
    seen = []
    original = ModelParallelTransformerLanguageModel.load_state_dict

    def load_state_dict(self, *args, **kwargs):
        seen.append(sorted(n for n, p in self.named_parameters() if p.is_meta))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ModelParallelTransformerLanguageModel, "load_state_dict", load_state_dict)
    return seen


def test_a_model_built_for_a_checkpoint_draws_no_initial_weights(tmp_path, unfilled_before_loading):
    path, weights = save_fairseq_checkpoint(tmp_path)
    drawn = sorted(n for n in dict(build_model(1)[0].named_parameters()) if n.endswith(DRAWN))
    assert len(drawn) == 2 * 6 + 1  # 2 layers of 6 weight matrices, and the embedding

    generator = torch.get_rng_state()
    (model,), _, _ = checkpoint_utils.load_model_ensemble_and_task([path])
    assert unfilled_before_loading == [drawn]  # none drawn: no values until the checkpoint filled them
    assert torch.equal(torch.get_rng_state(), generator)  # nor the tied output projection's own weight
    loaded = model.state_dict()
    assert loaded.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor), name  # bitwise the checkpoint's, no NaN left

    # A load that may leave parameters unfilled (fairseq passes strict=False
    # for --checkpoint-shard-count > 1) draws them first (the model's
    # load_state_dict runs the deferred draws), as a build that drew them would.
    (model,), _, _ = checkpoint_utils.load_model_ensemble_and_task([path], strict=False)
    assert not torch.equal(torch.get_rng_state(), generator)
    assert all(torch.isfinite(p).all() for p in model.parameters())


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


@pytest.mark.parametrize("tied", [True, False])
def test_deferred_draws_give_the_weights_and_generator_state_of_the_build(tied):
    """Tied: the output projection's own nn.Linear weight, drawn and thrown
    away, keeps its place in the sequence; untied: it is a column-parallel
    layer of its own. Tolerance: none (the same draws, in the same order,
    cast to fp16 by the same rounding)."""
    both = built_both_ways(1, share_decoder_input_output_embed=tied)
    assert not both["moved"]  # nothing drew during the deferred build
    # 2 layers x 6 weight matrices, the embedding, and the output projection
    # (tied: the throwaway draw; untied: its own weight, NaN too)
    assert both["queued"] == 14
    untied = [] if tied else ["decoder.output_projection.weight"]
    assert both["nan_before"] == sorted(both["drawn_names"] + untied) and len(both["nan_before"]) == 13 + (not tied)
    assert both["different"] == [] and both["finite"] and both["same_generator"]


def test_fairseq_train_builds_deferred_whatever_draws_in_the_build():
    """The model's choice, through fairseq's ``models.build_model`` as
    fairseq-train calls it: deferred for our architectures when the task says
    a checkpoint may fill the weights (our task does in fairseq-train and for
    every load of a checkpoint), also where another module draws from the
    generator as it is built (``--decoder-learned-pos``: fairseq's learned
    positional embedding, whose draw is queued again in its place); drawn at
    once when no checkpoint may come."""
    from fairseq import models

    def build(seed, may_be_loaded=True, **overrides):
        torch.manual_seed(seed)
        args = model_args(1, **overrides)
        args.arch = "transformer_lm_megatron_11b"
        task = LMTask(make_dictionary())
        task.initial_weights_may_be_loaded = may_be_loaded
        return models.build_model(args, task)

    assert build(0, may_be_loaded=False).deferred_initialisation is None  # no checkpoint may come: drawn at once
    lazy = build(4)
    assert len(lazy.deferred_initialisation) == 14
    assert lazy.decoder.layers[0].fc1.weight.is_meta  # no memory until materialized
    lazy.materialize()
    assert torch.isnan(lazy.decoder.layers[0].fc1.weight).all()  # NaN until drawn or loaded
    lazy.run_deferred_initialisation()
    assert lazy.deferred_initialisation is None
    for name, tensor in build_model(1, seed=4)[0].state_dict().items():
        assert torch.equal(lazy.state_dict()[name], tensor), name

    learned = build(4, decoder_learned_pos=True)  # fairseq's positions drew as they were built: queued again
    assert len(learned.deferred_initialisation) == 15
    torch.rand(3)  # a draw between the build and the run, which starts from the build's state regardless
    learned.run_deferred_initialisation()
    expected_generator = torch.get_rng_state()
    reference, _ = build_model(1, seed=4, decoder_learned_pos=True)
    assert torch.equal(torch.get_rng_state(), expected_generator)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(learned.state_dict()[name], tensor), name


def test_a_strict_load_drops_the_deferred_draws_and_a_partial_load_runs_them_first():
    from fairseq import models

    trained, _ = build_model(1, seed=9)
    weights = trained.state_dict()

    def deferred_model():
        torch.manual_seed(4)
        args = model_args(1)
        args.arch = "transformer_lm_megatron_11b"
        task = LMTask(make_dictionary())
        task.initial_weights_may_be_loaded = True
        return models.build_model(args, task)

    model, before = deferred_model(), torch.get_rng_state()
    model.load_state_dict(weights)
    assert model.deferred_initialisation is None and torch.equal(torch.get_rng_state(), before)
    assert not model.run_deferred_initialisation()  # nothing left to draw over the loaded weights
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())

    partial = {k: v for k, v in weights.items() if k != "decoder.layers.1.fc1.weight"}
    model = deferred_model()
    model.load_state_dict(partial, strict=False)
    initial, _ = build_model(1, seed=4)
    assert torch.equal(model.decoder.layers[1].fc1.weight, initial.decoder.layers[1].fc1.weight)
    assert torch.equal(model.decoder.layers[0].fc1.weight, weights["decoder.layers.0.fc1.weight"])
