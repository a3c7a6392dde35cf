"""scripts/parallelism_ablation.py's pure parts: the rows' batches and
flags, the launch checks that refuse a row, and its outputs (the script's
run is tests/e2e/test_parallelism_ablation.py)."""

import csv
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "scripts"))
import parallelism_ablation as ablation  # noqa: E402  isort:skip

QUICK = ablation.SHAPES["quick"]


def test_every_row_reads_the_same_global_batch():
    """Each model copy takes its micro-batches' rows of the iteration's
    batch: over the copies and micro-batches, every sequence once; the
    ranks of one copy (tensor, context, pipeline) read the same."""
    tokens = ablation.global_batch(0, QUICK, seed=1)
    assert tokens.shape == (QUICK.batch, QUICK.seq_len + 1)
    assert torch.equal(tokens, ablation.global_batch(0, QUICK, seed=1)) and \
        not torch.equal(tokens, ablation.global_batch(1, QUICK, seed=1))
    for name in ablation.LAYOUTS:
        row = ablation.layout(name)
        assert row.world_size == row.tensor * row.context * row.pipeline * row.data
        samples = [s for d in range(row.data) for s in ablation.rank_samples(tokens, row, QUICK, d)]
        assert len(samples) == row.data * row.micro_batches
        assert torch.equal(torch.cat([s["net_input"]["src_tokens"] for s in samples]), tokens[:, :-1]), name
        assert torch.equal(torch.cat([s["target"] for s in samples]), tokens[:, 1:]), name
        assert sum(s["ntokens"] for s in samples) == QUICK.batch * QUICK.seq_len


def test_rows_are_the_layouts_fairseq_train_runs():
    for name, (tensor, context, pipeline) in {"baseline": (1, 1, 1), "TP2": (2, 1, 1), "CP2": (1, 2, 1),
                                              "PP2": (1, 1, 2)}.items():
        cfg = ablation._parse(ablation.fairseq_flags(ablation.layout(name), QUICK, cpu=True, seed=1))
        assert (cfg.common.model_parallel_size, cfg.model.context_parallel_size,
                cfg.model.pipeline_model_parallel_size) == (tensor, context, pipeline)
        assert cfg.model.padded_vocab_size == QUICK.padded_vocab and cfg.common.seed == 1
    assert ablation._parse(ablation.fairseq_flags(ablation.layout("SP2"), QUICK, True, 1)).model.sequence_parallel
    cfg = ablation._parse(ablation.fairseq_flags(ablation.layout("FSDP2"), QUICK, True, 1))
    assert cfg.distributed_training.ddp_backend == "fully_sharded"


def test_every_row_passes_fairseq_trains_launch_checks_on_cpu():
    """FSDP2 too: torch's FSDP2 runs on CPU with gloo; and PP2 under each
    pipeline schedule, its chunks those the planner predicts it with."""
    for name in ablation.LAYOUTS:
        assert ablation.refusal(ablation.layout(name), QUICK, cpu=True, seed=1) is None, name
    from fairseq_megatron.training.pipeline_schedules import chunks_per_stage

    for name, (schedule, chunks) in ablation.SCHEDULE_ROWS.items():
        row = ablation.layout(name)
        cfg = ablation._parse(ablation.fairseq_flags(row, QUICK, cpu=True, seed=1))
        assert (cfg.model.pipeline_schedule, cfg.model.pipeline_model_parallel_size) == (schedule, 2), name
        assert chunks_per_stage(cfg.model) == row.chunks == chunks, name  # what the trainer runs, what is predicted
    cfg = ablation._parse(ablation.fairseq_flags(ablation.layout("FSDP2"), QUICK, cpu=True, seed=1))
    assert cfg.distributed_training.ddp_backend == "fully_sharded"


def test_a_row_that_did_not_run_is_reported_in_the_table_csv_and_png(tmp_path):
    ok = {"layout": "CP2", "world_size": 2, "device": "CPU", "status": "ok", "iteration_ms": 12.5,
          "peak_memory_mib": 3.0, "loss": 9.5}
    for r in range(2):
        ok.update({f"rank{r}_{part}_mib": 0.5 for part in ablation.PARTS}, **{f"rank{r}_peak_mib": 2.0})
    failed = {"layout": "FSDP2", "world_size": 2, "device": "CPU", "status": "refused: needs CUDA GPUs"}
    table = ablation.format_table([ok, failed])
    assert table.splitlines()[2] == "FSDP2         2   refused: needs CUDA GPUs"
    assert "0.5 / 0.5 / 0.5 / 0.5   0.5 / 0.5 / 0.5 / 0.5" in table.splitlines()[1]
    path = tmp_path / "rows.csv"
    ablation.write_csv(str(path), [ok, failed])
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [r["layout"] for r in rows] == ["CP2", "FSDP2"] and rows[1]["iteration_ms"] == ""
    assert rows[1]["status"] == "refused: needs CUDA GPUs" and os.listdir(tmp_path) == ["rows.csv"]
    ablation.draw_png(str(tmp_path / "rows.png"), [ok, failed])
    assert (tmp_path / "rows.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == ["rows.csv", "rows.png"]


def test_bad_arguments_are_one_line_before_any_row(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        ablation.main(["--cpu", "--quick", "--iterations", "2"])
    assert e.value.code == 2 and "error: --iterations 2: the first 2 are not timed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ablation.main(["--cpu", "--quick", "--csv", str(tmp_path / "missing" / "a.csv")])
    assert f"error: --csv {tmp_path / 'missing' / 'a.csv'}: no directory" in capsys.readouterr().err


def test_every_layout_says_what_it_splits_and_is_predicted():
    """The chart's labels cover every row, and the planner predicts each
    row's update on given rates: on a machine whose links are slow, the
    layouts that communicate every layer (TP2, SP2, CP2) are predicted
    slower than DP2, which reduces its gradients once."""
    from fairseq_megatron.planner import GPU

    assert set(ablation.SPLITS) == set(ablation.LAYOUTS)
    slow_links = GPU("test", 1e6, 1.0, 1.0, 10.0, 0.05, 0.05)
    predicted = {name: ablation.predicted_ms(ablation.layout(name), QUICK, slow_links, cpu=True)
                 for name in ablation.LAYOUTS}
    assert all(value > 0 for value in predicted.values())
    assert predicted["DP2"] < min(predicted["TP2"], predicted["SP2"], predicted["CP2"])
    assert predicted["DP2"] < predicted["baseline"]  # each of two copies computes half the batch


@pytest.mark.parametrize("flag", ["--csv", "--png"])
def test_an_output_that_is_a_directory_is_one_line_before_any_row(tmp_path, capsys, flag):
    """An existing directory given as the output file is refused at launch
    (before, --png met IsADirectoryError after every row had run)."""
    with pytest.raises(SystemExit) as exit_:
        ablation.main(["--cpu", "--quick", flag, str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"{flag} {tmp_path}: a directory; give a file name in it, e.g. "
                        f"{tmp_path / ('ablation.' + flag[2:])}"), err
    assert os.listdir(tmp_path) == []


def test_ordered_pairs_count_the_rows_predicted_apart_that_ran_in_that_order():
    """Pairs predicted at least 10% apart (ablation.APART) are compared;
    closer ones are not."""
    lines = [{"layout": "baseline", "predicted_ms": 200.0, "iteration_ms": 390.0},
             {"layout": "DP2", "predicted_ms": 100.0, "iteration_ms": 150.0},
             {"layout": "TP2", "predicted_ms": 105.0, "iteration_ms": 140.0},  # 5% from DP2: not compared
             {"layout": "PP2", "predicted_ms": 130.0, "iteration_ms": 120.0}]  # measured faster than both
    agree, pairs = ablation.ordered_pairs(lines)
    assert [(fast, slow) for fast, slow, *_ in pairs] == [("DP2", "baseline"), ("TP2", "baseline"),
                                                         ("PP2", "baseline"), ("DP2", "PP2"), ("TP2", "PP2")]
    assert agree == 3
    text = ablation.orderings([dict(line, status="ok") for line in lines])
    assert "pairs of rows predicted at least 10% apart: 3 of 5 measured in that order" in text
    assert "  DP2 < PP2 predicted (100 < 130 ms), measured 150 >= 120 ms" in text
