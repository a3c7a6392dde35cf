"""What the unit and distributed tests of deferred initial weights share."""

import torch

import fairseq_megatron  # noqa: F401  (installs the integration steps)
from fairseq_megatron.models.model_parallel_transformer_lm import ModelParallelTransformerLanguageModel
from tests.helpers import LMTask, build_model, make_dictionary, model_args

# The weights the model-parallel layers draw through sharding.init_shard_:
# q/k/v/out projections, fc1/fc2 and the vocab-parallel embedding (tied to
# the output projection). Biases start at zero and layer norms at one.
DRAWN = ("_proj.weight", "fc1.weight", "fc2.weight", "embed_tokens.weight")


def built_both_ways(model_parallel_size: int, seed: int = 7, **overrides) -> dict:
    """Our model built from ``seed`` as before, and again with its draws
    deferred, materialized (NaN), cast to fp16 (as fairseq's trainer does
    before it looks for a checkpoint), then drawn: what each way gives and
    leaves behind."""
    drawn, _ = build_model(model_parallel_size, seed=seed, **overrides)
    generator_after_the_build = torch.get_rng_state()

    torch.manual_seed(seed)
    args = model_args(model_parallel_size, **overrides)
    args.initial_weights_after_build = True  # as fairseq-train builds it: the trainer draws the weights
    lazy = ModelParallelTransformerLanguageModel.build_model(args, LMTask(make_dictionary()))
    deferred = lazy.deferred_initialisation
    moved = deferred.generator_moved()
    deferred.materialize(lazy)
    nan_before = sorted(n for n, p in lazy.named_parameters() if torch.isnan(p).all())
    queued = len(deferred)
    lazy.half()
    torch.rand(5)  # a draw between the build and the run, which starts from the build's state regardless
    deferred.run()
    return {
        "moved": moved, "queued": queued, "nan_before": nan_before,
        "drawn_names": sorted(n for n, _ in drawn.named_parameters() if n.endswith(DRAWN)),
        "same_generator": torch.equal(torch.get_rng_state(), generator_after_the_build),
        "different": [k for k, v in drawn.state_dict().items() if not torch.equal(lazy.state_dict()[k], v.half())],
        "finite": all(torch.isfinite(p).all() for p in lazy.parameters()),
    }
