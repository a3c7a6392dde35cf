"""Every parameter says how it is split (Megatron-Core's attribute names),
held against fairseq's model-parallel layout by name
(``tests/support/partition.py``), and the attributes survive every copy the
code makes: ``copy.deepcopy`` (fairseq's ``--store-ema``), ``meta`` ->
``to_empty`` and the deferred build's own materialization,
``load_state_dict(assign=True)``. A layer built as rank ``k`` of ``T``
without any process group holds that rank's shard, on the meta device."""

import copy

import torch

from fairseq_megatron.checkpoint.layout import partition_dims, partition_dims_of_model
from fairseq_megatron.models.model_parallel_transformer_lm import ModelParallelTransformerLanguageModel
from fairseq_megatron.models.pipeline_stage import PipelineStageLayout
from fairseq_megatron.modules import sharding
from fairseq_megatron.parallel.parallel_state import RankGroup
from fairseq_megatron.training.pipeline_split import split_for_stage
from tests.helpers import DIMS, LMTask, build_model, make_dictionary, model_args
from tests.support.partition import expected_partition_dim

ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


def tags(model) -> dict:
    """``{name: (tensor_model_parallel, partition_dim, partition_stride)}`` of every parameter."""
    return {name: tuple(getattr(p, a, None) for a in ATTRIBUTES) for name, p in model.named_parameters()}


def expected_tags(model) -> dict:
    out = {}
    for name, _ in model.named_parameters():
        dim = expected_partition_dim(name)
        out[name] = (dim is not None, -1 if dim is None else dim, 1)
    return out


def test_every_parameter_of_a_model_built_through_fairseq_says_how_it_is_split():
    from fairseq import models

    args = model_args(1, share_decoder_input_output_embed=False, decoder_learned_pos=True)
    args.arch = "transformer_lm_megatron_11b"
    model = models.build_model(args, LMTask(make_dictionary()))
    # 16 per layer; the embedding, learned positions, the final norm's weight and bias, the output projection
    assert len(tags(model)) == 2 * 16 + 5
    assert tags(model) == expected_tags(model)
    assert not any(getattr(p, "shared_embedding", False) for p in model.parameters())  # untied


def test_the_tied_embedding_is_marked_and_the_last_stage_copy_is_counted_elsewhere():
    tied, _ = build_model(1)
    assert tied.decoder.embed_tokens.weight is tied.decoder.output_projection.weight
    assert tied.decoder.embed_tokens.weight.shared_embedding
    assert not getattr(tied.decoder.embed_tokens.weight, "shared", False)  # one stage: counted here
    layers = DIMS["decoder_layers"]
    first, last = (build_model(1)[0] for _ in range(2))
    split_for_stage(first, PipelineStageLayout(0, 2, layers, tied_embeddings=True))
    split_for_stage(last, PipelineStageLayout(1, 2, layers, tied_embeddings=True))
    assert not getattr(first.decoder.embed_tokens.weight, "shared", False)
    assert last.decoder.embed_tokens.weight.shared and last.decoder.embed_tokens.weight.shared_embedding
    assert list(last.decoder.layers.keys()) == ["1"]  # the global layer number stays in the keys
    assert tags(last) == expected_tags(last)


def test_tags_survive_deepcopy_to_empty_assign_and_materialization():
    model, _ = build_model(1)
    expected = expected_tags(model)
    assert tags(copy.deepcopy(model)) == expected

    on_meta = ModelParallelTransformerLanguageModel.build_model(model_args(1, initial_weights_after_build=True),
                                                                LMTask(make_dictionary()))
    deferred = on_meta.deferred_initialisation
    assert on_meta.decoder.layers[0].fc1.weight.is_meta
    empty = copy.deepcopy(on_meta).to_empty(device="cpu")
    assert tags(empty) == expected
    deferred.materialize(on_meta)
    assert tags(on_meta) == expected and not any(p.is_meta for p in on_meta.parameters())
    assert on_meta.decoder.output_projection.weight is on_meta.decoder.embed_tokens.weight  # still tied

    assigned, _ = build_model(1, seed=3)
    torch.nn.Module.load_state_dict(assigned, model.state_dict(), assign=True)  # torch's (fairseq's takes no assign)
    assert tags(assigned) == expected
    assert assigned.decoder.output_projection.weight is assigned.decoder.embed_tokens.weight  # tied again
    assert torch.equal(assigned.decoder.layers[1].fc2.weight, model.decoder.layers[1].fc2.weight)


def test_rank_k_of_t_builds_its_shard_on_meta_without_process_groups():
    """Rank 2 of 4, in this single process (no torch.distributed): the
    shapes of that rank's part and the vocabulary rows it owns."""
    args = model_args(4, initial_weights_after_build=True)
    with torch.device("meta"):
        part = ModelParallelTransformerLanguageModel.build_model(args, LMTask(make_dictionary()),
                                                                 tensor_parallel=RankGroup(4, 2))
    layer = part.decoder.layers[0]
    embed_dim, ffn = DIMS["decoder_embed_dim"], DIMS["decoder_ffn_embed_dim"]
    assert layer.fc1.weight.shape == (ffn // 4, embed_dim) and layer.fc2.weight.shape == (embed_dim, ffn // 4)
    assert layer.self_attn.num_heads_partition == DIMS["decoder_attention_heads"] // 4
    assert (part.decoder.embed_tokens.vocab_start_index, part.decoder.embed_tokens.vocab_end_index) == (32, 48)
    assert all(p.is_meta for p in part.parameters())
    assert tags(part) == expected_tags(part)


def test_a_checkpoint_config_gives_the_split_of_every_key():
    """What the checkpoint tools read for files on disk: the model the config
    describes, built on the meta device, says how each tensor is split."""
    model, _ = build_model(1)
    dims = partition_dims(model_args(1), padded_vocab_size=64)
    assert dims == partition_dims_of_model(model)
    assert dims == {key: expected_partition_dim(key) for key in model.state_dict()}
