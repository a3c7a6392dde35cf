"""Pipeline parallelism's pieces in one process: the rank grid, what a stage
holds, the micro-batches of an update, the stage files of a checkpoint and
their resharding, and the options refused before any work."""

import os
from argparse import Namespace

import pytest
import torch

from fairseq_megatron.checkpoint.layout import CheckpointError
from fairseq_megatron.checkpoint.part_files import (
    checkpoint_of_part,
    find_part_files,
    output_paths,
    stage_files,
    stage_path,
)
from fairseq_megatron.checkpoint.resharding import PartFiles, reshard, split_stages
from fairseq_megatron.errors import UsageError
from fairseq_megatron.training.options import check_pipeline_options
from fairseq_megatron.training.data_parallel import check_pipeline_data_parallel_backend
from fairseq_megatron.models.pipeline_stage import LOOP, V_SHAPE, PipelineStageLayout
from fairseq_megatron.parallel.parallel_state import ParallelLayout
from fairseq_megatron.training.pipeline_schedule import stack_micro_batches
from fairseq_megatron.training.pipeline_schedules import SCHEDULES, idle_share_bound, schedule_of, stage_layout
from tests.support.checkpoint_resharding import save_checkpoint
from tests.support.pipeline import PAD, sample

# ---------------------------------------------------------------- the grid


def test_layout_orders_tensor_then_data_then_pipeline():
    """Megatron-Core's order (tensor fastest, pipeline slowest), for T 2 x D 2 x P 2."""
    layout = ParallelLayout(8, tensor=2, pipeline=2)
    assert layout.data == 2
    assert layout.tensor_parallel_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.data_parallel_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.pipeline_parallel_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.model_parallel_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.embedding_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # (tensor, context, data, pipeline)
    assert [tuple(layout.coordinates(r)) for r in (0, 3, 6)] == [(0, 0, 0, 0), (1, 0, 1, 0), (0, 0, 1, 1)]
    assert all(layout.rank(**layout.coordinates(r)._asdict()) == r for r in range(8))


def test_layout_puts_context_between_tensor_and_data():
    """Megatron-Core's "tp-cp-dp-pp": T 2 x C 2 x D 2, context-parallel
    groups stride over the tensor ranks, data-parallel ones over both."""
    layout = ParallelLayout(8, tensor=2, context=2)
    assert layout.data == 2 and layout.mesh_shape == (1, 2, 2, 2)
    assert layout.tensor_parallel_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.context_parallel_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.data_parallel_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.model_parallel_groups() == layout.tensor_parallel_groups()
    assert tuple(layout.coordinates(7)) == (1, 1, 1, 0)


def test_layout_without_pipeline_is_the_tensor_parallel_one():
    """At P = 1 the groups are those fairseq's model parallelism always had."""
    layout = ParallelLayout(4, tensor=2)
    assert layout.tensor_parallel_groups() == [[0, 1], [2, 3]]
    assert layout.data_parallel_groups() == [[0, 2], [1, 3]]
    assert layout.model_parallel_groups() == layout.tensor_parallel_groups()
    assert layout.embedding_groups() == [[0], [1], [2], [3]]


def test_layout_refuses_a_world_size_tensor_times_pipeline_does_not_divide():
    with pytest.raises(UsageError, match=r"world size 6 is not divisible by --model-parallel-size 2 x "
                                         r"--pipeline-model-parallel-size 2 = 4"):
        ParallelLayout(6, tensor=2, pipeline=2)
    with pytest.raises(UsageError, match="at least 1"):
        ParallelLayout(2, tensor=1, pipeline=0)


# ---------------------------------------------------------------- a stage


def test_stage_holds_its_layers_and_its_end_of_the_model():
    first, middle, last = (PipelineStageLayout(s, 3, 6, tied_embeddings=True) for s in range(3))
    assert [s.held_layers for s in (first, middle, last)] == [[0, 1], [2, 3], [4, 5]]
    keys = ["decoder.embed_tokens.weight", "decoder.embed_positions._float_tensor", "decoder.layers.3.fc1.weight",
            "decoder.layer_norm.weight", "decoder.output_projection.weight", "decoder.version"]
    assert [k for k in keys if first.holds(k)] == [keys[0], keys[1], keys[5]]
    assert [k for k in keys if middle.holds(k)] == [keys[2], keys[5]]
    assert [k for k in keys if last.holds(k)] == [keys[0], keys[3], keys[4], keys[5]]
    assert last.holds_embedding_copy and not first.holds_embedding_copy
    untied_last = PipelineStageLayout(2, 3, 6, tied_embeddings=False)
    assert not untied_last.holds("decoder.embed_tokens.weight") and not untied_last.holds_embedding_copy


def test_schedules_place_their_chunks():
    """Loop placement (1F1B, the interleaved ones): stage s holds chunks s,
    s + P; V placement (zbv, dualpipev): s and 2P - 1 - s, stage 0 both
    ends, so the tied embedding has one copy and the loss is on stage 0."""
    def layout(schedule, stage, virtual=None):
        args = Namespace(pipeline_model_parallel_size=2, decoder_layers=8, share_decoder_input_output_embed=True,
                         pipeline_schedule=schedule, virtual_pipeline_model_parallel_size=virtual)
        return stage_layout(args, stage)

    assert [layout("1f1b", s).held_layers for s in (0, 1)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [layout("interleaved-zb", s, 2).held_layers for s in (0, 1)] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout("interleaved-zb", 0).virtual == 1  # ZB-1P
    for name in ("zbv", "dualpipev"):
        first, second = layout(name, 0), layout(name, 1)
        assert [c.index for c in first.chunks] == [0, 3] and [c.index for c in second.chunks] == [1, 2]
        assert first.held_layers == [0, 1, 6, 7] and second.held_layers == [2, 3, 4, 5]
        assert first.is_first and first.is_last and not second.is_first and not second.is_last
        assert first.holds_embedding and not second.holds_embedding
        assert not first.tied_copies and not first.holds_embedding_copy
        assert first.holds("decoder.output_projection.weight") and not second.holds("decoder.layer_norm.weight")
    assert layout("1f1b", 1).tied_copies and layout("1f1b", 1).holds_embedding_copy
    # the default: interleaved 1F1B with chunks, 1F1B without
    assert schedule_of(Namespace(virtual_pipeline_model_parallel_size=2)).name == "interleaved-1f1b"
    assert schedule_of(Namespace()).name == "1f1b"


def test_idle_share_bounds_of_the_schedules():
    """At F = B = W, P 2, m 8: 1F1B (P - 1) / (m + P - 1) and interleaved
    (P - 1) / (V m + P - 1) (Narayanan et al. 2021), ZB-1P a third of 1F1B's
    bubble (Qi et al. 2024: (P - 1) / (3 m + P - 1)), ZB-V none, DualPipeV
    (P - 1) F over chunks of half a stage; measured times change them."""
    bound = lambda name, v=1, **times: idle_share_bound(SCHEDULES[name], 2, v, 8, **times)  # noqa: E731
    assert bound("1f1b") == pytest.approx(1 / 9) and bound("interleaved-1f1b", 2) == pytest.approx(1 / 17)
    assert bound("interleaved-zb") == pytest.approx(1 / 25) and bound("interleaved-zb", 2) == pytest.approx(0.5 / 24.5)
    assert bound("zbv", 2) == 0.0 and bound("dualpipev", 2) == pytest.approx(1 / 25)
    assert bound("zbv", 2, backward_weight=0.5) == pytest.approx(0.5 / (8 * 2.5 + 0.5))  # W short: ZB-V idles
    assert idle_share_bound(SCHEDULES["1f1b"], 1, 1, 8) == 0.0


def test_the_embedding_and_the_loss_counted_as_layers():
    """Megatron-Core's account_for_embedding/loss_in_pipeline_split: the
    ``L + e + l`` counted layers split evenly, the first / last chunk one
    decoder layer short (with chunks: the first and last virtual stage)."""
    def held(stages, layers, virtual=1, placement=LOOP, embedding=False, loss=False):
        return [PipelineStageLayout(s, stages, layers, True, virtual, placement, embedding, loss).held_layers
                for s in range(stages)]

    assert held(2, 7, loss=True) == [[0, 1, 2, 3], [4, 5, 6]]
    assert held(2, 7, embedding=True) == [[0, 1, 2], [3, 4, 5, 6]]
    assert held(3, 7, embedding=True, loss=True) == [[0, 1], [2, 3, 4], [5, 6]]
    assert held(2, 7, 2, loss=True) == [[0, 1, 4, 5], [2, 3, 6]]  # chunks 0 and 2, 1 and 3
    assert held(2, 6, 2, V_SHAPE, True, True) == [[0, 5], [1, 2, 3, 4]]  # chunks 0 and 3, 1 and 2
    assert held(1, 5, loss=True) == [[0, 1, 2, 3, 4]]
    with pytest.raises(UsageError, match=r"^--decoder-layers 8 \+ 1 \(the loss, counted as a layer\) is not "
                                         r"divisible by --pipeline-model-parallel-size 2"):
        PipelineStageLayout(0, 2, 8, True, account_for_loss=True)
    with pytest.raises(UsageError, match=r"^--decoder-layers 2 \+ 2 \(the embedding and the loss, each counted as a "
                                         r"layer\) over 2 x 2 model chunks leaves the first or last chunk without"):
        PipelineStageLayout(0, 2, 2, True, 2, account_for_embedding=True, account_for_loss=True)


def test_stage_refuses_stages_that_do_not_divide_the_layers():
    with pytest.raises(UsageError, match="--decoder-layers 5 is not divisible by --pipeline-model-parallel-size 2"):
        PipelineStageLayout(0, 2, 5, tied_embeddings=True)


# ---------------------------------------------------------------- micro-batches


def test_micro_batches_pad_a_short_batch_a_short_block_and_a_short_group():
    full, short = sample(1), sample(2, rows=2, short_tail=5)
    stacked = stack_micro_batches([full, short], micro_batches=3, rows=4, length=16, pad=PAD)
    tokens, target = stacked["net_input"]["src_tokens"], stacked["target"]
    assert tokens.shape == target.shape == (12, 16)
    assert torch.equal(tokens[:4], full["net_input"]["src_tokens"])
    assert torch.equal(target[4:6], short["target"])
    assert target[6:].eq(PAD).all() and tokens[6:].eq(PAD).all()  # 2 padded rows, then an empty micro-batch
    assert stacked["ntokens"] == full["ntokens"] + short["ntokens"] == 4 * 16 + 2 * 16 - 5
    assert stacked["nsentences"] == 6
    assert torch.equal(stacked["id"], torch.cat([full["id"], short["id"]]))


def test_micro_batches_of_no_data_score_nothing():
    stacked = stack_micro_batches([{}, None], micro_batches=2, rows=4, length=16, pad=PAD)
    assert stacked["ntokens"] == stacked["nsentences"] == 0 and stacked["target"].eq(PAD).all()


def test_micro_batches_refuse_a_batch_larger_than_the_micro_batch():
    with pytest.raises(UsageError, match="does not fit the pipeline's micro-batch of 2 x 16"):
        stack_micro_batches([sample(1)], micro_batches=2, rows=2, length=16, pad=PAD)
    with pytest.raises(UsageError, match="3 samples for an update of 2 micro-batches"):
        stack_micro_batches([sample(1)] * 3, micro_batches=2, rows=4, length=16, pad=PAD)


# ---------------------------------------------------------------- options


def _args(**overrides):
    args = Namespace(pipeline_model_parallel_size=2, decoder_layers=4, update_freq=[2], sample_break_mode="none",
                     criterion="vocab_parallel_cross_entropy")
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


@pytest.mark.parametrize("overrides, message", [
    (dict(decoder_layers=3), "--decoder-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    (dict(update_freq=[1]), "--update-freq 1 is below --pipeline-model-parallel-size 2"),
    (dict(sample_break_mode="eos"), "--sample-break-mode eos with --pipeline-model-parallel-size 2"),
    (dict(criterion="cross_entropy"), "--criterion cross_entropy with --pipeline-model-parallel-size 2"),
    (dict(amp=True), "--amp: not supported with --pipeline-model-parallel-size 2"),
    (dict(pipeline_model_parallel_size=0), "--pipeline-model-parallel-size 0: the number of pipeline stages"),
    (dict(pipeline_schedule="gpipe"), "--pipeline-schedule gpipe: no such schedule"),
    (dict(pipeline_schedule="zbv", virtual_pipeline_model_parallel_size=3),
     "--virtual-pipeline-model-parallel-size 3 with --pipeline-schedule zbv: that schedule gives each stage 2"),
    (dict(pipeline_schedule="zbv", decoder_layers=6),
     r"--decoder-layers 6 is not divisible by --pipeline-model-parallel-size 2 x 2 model chunks per stage"),
    (dict(pipeline_schedule="interleaved-zb", virtual_pipeline_model_parallel_size=2, decoder_layers=6),
     "--decoder-layers 6 is not divisible by --pipeline-model-parallel-size 2 x --virtual-pipeline-model-parallel"),
    (dict(pipeline_schedule="dualpipev", update_freq=[3]),
     r"--update-freq 3 is below 4 \(2 x --pipeline-model-parallel-size 2\): the dualpipev schedule"),
    (dict(pipeline_schedule="interleaved-zb", virtual_pipeline_model_parallel_size=2, update_freq=[3]),
     "--update-freq 3 is not divisible by --pipeline-model-parallel-size 2"),
    (dict(pipeline_schedule="zbv", compile_layers=True), "--compile-layers with --pipeline-schedule zbv"),
    (dict(pipeline_model_parallel_size=1, pipeline_schedule="zb"), "--pipeline-schedule zb: no such schedule"),
    (dict(account_for_loss_in_pipeline_split=True),
     r"--decoder-layers 4 \+ 1 \(the loss, counted as a layer\) is not divisible by --pipeline-model-parallel-size 2"),
])
def test_pipeline_options_refused(overrides, message):
    with pytest.raises(UsageError, match=message):
        check_pipeline_options(_args(**overrides))


def test_pipeline_options_accepted():
    check_pipeline_options(_args())
    check_pipeline_options(_args(pipeline_model_parallel_size=1, decoder_layers=3, update_freq=[1]))
    # a checkpoint's config loaded for evaluation: no training options
    check_pipeline_options(Namespace(pipeline_model_parallel_size=2, decoder_layers=4))
    for name in SCHEDULES:  # each at P 2, m 4, V 2 where it takes chunks (V 1 given is V 2's default under zbv)
        check_pipeline_options(_args(pipeline_schedule=name, update_freq=[4],
                                     virtual_pipeline_model_parallel_size=1 if name in ("1f1b", "zbv") else 2))
    # a schedule at one stage runs as one stage: a zbv checkpoint's config loaded at P = 1
    check_pipeline_options(_args(pipeline_model_parallel_size=1, pipeline_schedule="zbv", update_freq=[1]))
    # the embedding and the loss count as layers in a pipeline's split only
    check_pipeline_options(_args(decoder_layers=5, account_for_loss_in_pipeline_split=True))
    check_pipeline_options(_args(pipeline_model_parallel_size=1, account_for_loss_in_pipeline_split=True,
                                 account_for_embedding_in_pipeline_split=True, update_freq=[1]))


def test_fully_sharded_with_the_schedules_that_split_the_backward():
    """The split backward needs each forward's gathered weights kept until
    its weight pass: resharding after the forward left the weight gradients
    of 14 of 24 input passes uncomputed (seen at P 2 x D 2 under
    interleaved-zb: torch's stage_backward_input found FSDP2's shards among
    the chunk's parameters, and no weight the forward used), and the losses
    1.3% off one model copy's; with ``--no-reshard-after-forward`` it
    trains as one copy (tests/distributed/test_fully_sharded.py). The V
    schedules with tied embeddings put the embedding in both of stage 0's
    chunks, each a root of FSDP2 (seen: torch refuses to shard the tensor a
    second time); untied they ran as one copy when tried."""
    from types import SimpleNamespace

    from fairseq_megatron.training.fully_sharded import check_fully_sharded

    common, ema = SimpleNamespace(amp=False), SimpleNamespace(store_ema=False)
    for keep in (False, True):
        distributed = SimpleNamespace(ddp_backend="fully_sharded", cpu_offload=False, use_sharded_state=False,
                                      zero_sharding="none", no_reshard_after_forward=keep)
        for name in SCHEDULES:
            for tied in (False, True):
                model = Namespace(pipeline_model_parallel_size=2, pipeline_schedule=name,
                                  share_decoder_input_output_embed=tied)
                if SCHEDULES[name].splits_backward and tied and SCHEDULES[name].placement == V_SHAPE:
                    with pytest.raises(UsageError, match=f"--pipeline-schedule {name} with tied embeddings does "
                                                         f"not work with --ddp-backend fully_sharded: its V"):
                        check_fully_sharded(distributed, common, ema, model)
                elif SCHEDULES[name].splits_backward and not keep:
                    with pytest.raises(UsageError, match=f"--pipeline-schedule {name} with --ddp-backend "
                                                         f"fully_sharded needs --no-reshard-after-forward"):
                        check_fully_sharded(distributed, common, ema, model)
                else:
                    check_fully_sharded(distributed, common, ema, model)
        check_fully_sharded(distributed, common, ema, Namespace(pipeline_model_parallel_size=1, pipeline_schedule="zbv"))


def test_data_parallel_backend_of_a_pipeline():
    check_pipeline_data_parallel_backend("pytorch_ddp", stages=2, data_parallel_size=1)
    check_pipeline_data_parallel_backend("legacy_ddp", stages=2, data_parallel_size=2)
    with pytest.raises(UsageError, match="use --ddp-backend legacy_ddp"):
        check_pipeline_data_parallel_backend("pytorch_ddp", stages=2, data_parallel_size=2)


# ---------------------------------------------------------------- stage files


def test_stage_file_names():
    assert stage_path("run/ckpt.pt", 1, 0) == "run/ckpt-model_part-1-stage-0.pt"
    assert checkpoint_of_part("run/ckpt-model_part-1-stage-3.pt") == "run/ckpt.pt"
    assert output_paths("m.pt", 2, 2) == ["m-model_part-0-stage-0.pt", "m-model_part-0-stage-1.pt",
                                          "m-model_part-1-stage-0.pt", "m-model_part-1-stage-1.pt"]
    assert output_paths("m.pt", 1, 2) == ["m-model_part-0-stage-0.pt", "m-model_part-0-stage-1.pt"]


def _models(files):
    return [torch.load(f, weights_only=False)["model"] for f in files]


def test_reshard_to_stages_and_back_is_bitwise(tmp_path):
    """(T 2, P 1) -> (T 1, P 2) -> (T 2, P 2) -> (T 2, P 1): the weights
    come back bitwise; each stage file holds its stage's keys only; the
    loader finds every stage of every part."""
    original = str(tmp_path / "orig.pt")
    save_checkpoint(original, 2)
    stages = str(tmp_path / "stages" / "m.pt")
    written = reshard(original, stages, 1, new_stages=2)
    assert written == output_paths(stages, 1, 2) == [stage_path(stages, 0, 0), stage_path(stages, 0, 1)]
    first, last = _models(written)
    assert {k.split(".")[2] for k in first if ".layers." in k} == {"0"}
    assert {k.split(".")[2] for k in last if ".layers." in k} == {"1"}
    assert "decoder.layer_norm.weight" in last and "decoder.layer_norm.weight" not in first
    assert torch.equal(first["decoder.embed_tokens.weight"], last["decoder.embed_tokens.weight"])  # tied copy
    config = torch.load(written[0], weights_only=False)["cfg"]["model"]
    assert config.pipeline_model_parallel_size == 2

    both = str(tmp_path / "both" / "m.pt")
    reshard(stages, both, 2, new_stages=2)
    assert find_part_files(both) == [stage_path(both, 0, 0), stage_path(both, 1, 0)]
    assert stage_files(stage_path(both, 1, 0)) == [stage_path(both, 1, 0), stage_path(both, 1, 1)]
    back = str(tmp_path / "back" / "m.pt")
    reshard(both, back, 2)
    for a, b in zip(_models(find_part_files(original)), _models(find_part_files(back))):
        assert sorted(a) == sorted(b)
        for k in a:
            if k != "decoder.embed_positions._float_tensor":  # fairseq's uninitialised buffer, not a weight
                assert torch.equal(a[k], b[k]), k


def test_a_missing_stage_is_one_line(tmp_path):
    original, stages = str(tmp_path / "orig.pt"), str(tmp_path / "m.pt")
    save_checkpoint(original, 1)
    reshard(original, stages, 2, new_stages=2)
    os.remove(stage_path(stages, 1, 1))
    with pytest.raises(CheckpointError, match=r"pipeline stage file .*m-model_part-1-stage-1.pt is missing"):
        find_part_files(stages)
    os.remove(stage_path(stages, 1, 0))  # part 1 gone whole: the config's size tells
    with pytest.raises(CheckpointError, match=r"m-model_part-1.pt is missing: .* saved at model-parallel size 2"):
        PartFiles(stages)


def test_split_stages_refuses_layers_it_cannot_split(tmp_path):
    path = str(tmp_path / "orig.pt")
    save_checkpoint(path, 1)
    state = torch.load(path, weights_only=False)
    with pytest.raises(UsageError, match="not divisible by --pipeline-model-parallel-size 3"):
        split_stages(state, 3)


def test_split_stages_follows_the_counted_layers_of_the_config(tmp_path):
    """The resharding tool cuts stages as fairseq-train builds them: 3
    layers with the loss counted, at 2 stages, 2 and 1 (evenly: refused)."""
    path = str(tmp_path / "orig.pt")
    save_checkpoint(path, 1, decoder_layers=3)
    state = torch.load(path, weights_only=False)
    state["cfg"]["model"].account_for_loss_in_pipeline_split = True
    first, last = split_stages(state, 2)
    assert [sorted({k.split(".")[2] for k in s["model"] if k.startswith("decoder.layers.")}) for s in (first, last)] \
        == [["0", "1"], ["2"]]
    assert "decoder.layer_norm.weight" in last["model"] and "decoder.layer_norm.weight" not in first["model"]
