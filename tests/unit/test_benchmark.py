"""scripts/benchmark.py without a training run: the parameter formula
against the GPU kit's minimal GPT, the GPU-busy summary of a profile, and
what the script refuses or keeps (arguments, CSV files, failed runs)."""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_parameter_formula_matches_the_anchor_model():
    """The FLOPs of the anchor row use this script's parameter formula with the
    anchor's vocabulary; the anchor's own count (parameters minus positions)
    must agree. Builds its model on CPU (no timing)."""
    path = os.path.join(REPO, "..", "shared", "gpu", "sdpa_gpt_anchor.py")
    if not os.path.exists(path):
        pytest.skip("../shared/gpu/sdpa_gpt_anchor.py is not beside this checkout")
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import benchmark

    source = open(path).read()
    namespace = {}
    exec(compile(source[:source.index(benchmark._ANCHOR_LOOP)], path, "exec"), namespace)
    shape = dict(benchmark.SHAPES["tiny"])
    model = namespace["GPT"](shape["layers"], shape["hidden"], shape["heads"], shape["ffn"], T=shape["seq_len"])
    anchor_count = sum(p.numel() for p in model.parameters()) - model.pos.numel()
    assert benchmark.count_params(shape, benchmark.ANCHOR_VOCAB) == anchor_count


def test_gpu_busy_summary_counts_overlapping_kernels_once():
    """Device intervals (0, 10), (5, 15), (20, 30) µs: busy 25 of a 30 µs
    span; a record_function span over the whole window is not a kernel."""
    import types

    import torch

    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import benchmark

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(start, end, device, name="kernel", annotation=False):
        return types.SimpleNamespace(time_range=types.SimpleNamespace(start=start, end=end), device_type=device,
                                     name=name, is_user_annotation=annotation)

    events = [event(0, 10, cuda), event(5, 15, cuda), event(20, 30, cuda), event(0, 30, cuda, "forward", True),
              event(12, 13, cpu, "cudaStreamSynchronize"), event(14, 15, cpu, "aten::add")]
    summary = benchmark.gpu_busy_summary(types.SimpleNamespace(events=lambda: events), steps=1)
    assert summary["busy_share"] == round(25 / 30, 3)
    assert summary["device_events_per_step"] == 3
    assert summary["host_waits_per_step"] == {"cudaStreamSynchronize": 1.0}


def test_bad_arguments_and_failed_runs_are_reported_in_one_line(capsys):
    """--updates 0 reached fairseq as --max-update 0, no limit: the
    benchmark trained until killed. --log-interval 0 was a ZeroDivisionError
    there, --batch-size 0 silently meant the shape's default. argparse now
    refuses them. A failed fairseq-train run is reported by its error lines,
    not by the last lines of torchrun's failure summary."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import benchmark

    for flag in ("--updates", "--log-interval", "--batch-size", "--model-parallel-size"):
        with pytest.raises(SystemExit) as exited:
            benchmark.main(["--shape", "tiny", flag, "0"])
        assert exited.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f": error: {flag} must be at least 1")
    line = "error: --decoder-attention-heads 4 is not divisible by --model-parallel-size 3"
    torchrun = "\n".join([f"[rank1]: {line}", f"[rank0]: {line}", "E1124 ... failed (exitcode: 1)",
                          "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:", "=" * 60])
    assert benchmark.why_it_failed(torchrun) == line
    traceback = "\n".join(["Traceback (most recent call last):"] + [f'  File "x.py", line {i}' for i in range(6)]
                          + ["ZeroDivisionError: integer modulo by zero"])
    assert benchmark.why_it_failed(traceback) == "\n".join(traceback.splitlines()[-5:])


def test_csv_keeps_earlier_rows_and_a_foreign_csv_is_refused_before_running(tmp_path, capsys):
    """The CSV is rewritten whole (temporary name, then rename) with the
    earlier rows first. A file with other columns, or one in a directory that
    does not exist, stopped the script only after the runs (appended rows
    under the wrong columns, or a traceback); now it is one argparse error
    line before anything runs, and the file is left as it was."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import benchmark

    path = str(tmp_path / "bench.csv")
    first = [dict.fromkeys(benchmark.CSV_FIELDS, "1"), dict.fromkeys(benchmark.CSV_FIELDS, "2")]
    benchmark.write_csv(path, first)
    later = [dict.fromkeys(benchmark.CSV_FIELDS, "3")]
    benchmark.write_csv(path, benchmark.read_csv_rows(path) + later)
    assert [row["label"] for row in benchmark.read_csv_rows(path)] == ["1", "2", "3"]
    assert sorted(os.listdir(tmp_path)) == ["bench.csv"]  # no temporary file left
    with pytest.raises(ValueError):  # a row with a column the file lacks fails halfway through the write
        benchmark.write_csv(path, benchmark.read_csv_rows(path) + [{"no such column": 1}])
    assert [row["label"] for row in benchmark.read_csv_rows(path)] == ["1", "2", "3"]
    assert sorted(os.listdir(tmp_path)) == ["bench.csv"]

    foreign = tmp_path / "other.csv"
    foreign.write_text("shape,tokens_per_s\ntiny,5\n")
    for csv_path, message in ((str(foreign), f"error: --csv {foreign} has other columns"),
                              (str(tmp_path / "missing" / "b.csv"), "no such directory")):
        with pytest.raises(SystemExit) as exited:
            benchmark.main(["--shape", "tiny", "--csv", csv_path, "--work-dir", str(tmp_path / "work")])
        assert exited.value.code == 2
        assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert foreign.read_text() == "shape,tokens_per_s\ntiny,5\n"
    assert not (tmp_path / "work").exists()  # refused before the runs


def test_settings_that_cannot_give_a_result_are_refused_before_running(tmp_path, capsys):
    """Each of these failed only after the training runs, which on a GPU
    take minutes: too few log intervals for the median of three, a context
    window that leaves fairseq-eval-lm no token to score, and a work
    directory that cannot be made (a traceback)."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import benchmark

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for argv, message in [
        (["--updates", "5", "--log-interval", "2"], "--updates 5 gives fewer than 3 intervals of --log-interval 2"),
        (["--eval-lm-tokens", "100", "--context-window", "64"],  # the tiny shape's 64 tokens per sample
         "--context-window 64 leaves no token to score in blocks of 64"),
        (["--eval-lm-tokens", "100", "--seq-len", "32", "--context-window", "40"],
         "--context-window 40 leaves no token to score in blocks of 32"),
        (["--work-dir", str(a_file / "work")], f"--work-dir {a_file / 'work'}: Not a directory"),
    ]:
        with pytest.raises(SystemExit) as exited:
            benchmark.main(["--shape", "tiny", *argv])
        assert exited.value.code == 2
        assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_failed_eval_lm_keeps_the_training_row_and_exits_1(tmp_path, capsys, monkeypatch):
    """fairseq-eval-lm runs after training; its failure used to print a line
    without the reason and exit 0, so a script driving the benchmark took
    the run for complete. The training row is still written (those figures
    are sound), fairseq's error line is shown, and the exit status is 1."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import benchmark

    # run_eval_lm's own subprocess, with a stand-in for fairseq-eval-lm that fails as it would
    failing = [sys.executable, "-c", "import sys; print('error: the eval-lm stand-in fails'); sys.exit(1)"]
    monkeypatch.setattr(benchmark, "_launcher", lambda nproc: failing)
    save_dir = tmp_path / "work" / "checkpoints"

    def run_one(args, impl, work_dir, use_cuda, device):
        save_dir.mkdir(parents=True)
        row = dict.fromkeys(benchmark.CSV_FIELDS, 1)
        row.update(label="trained", impl=impl)
        shape = benchmark.resolved_shape(args)
        row.update(benchmark.run_eval_lm(args, impl, shape, str(tmp_path), str(save_dir), use_cuda, 1))
        return row

    monkeypatch.setattr(benchmark, "run_one", run_one)
    out_csv = tmp_path / "bench.csv"
    rc = benchmark.main(["--shape", "tiny", "--eval-lm-tokens", "100", "--context-window", "8",
                         "--work-dir", str(tmp_path / "work"), "--csv", str(out_csv)])
    err = capsys.readouterr().err
    assert rc == 1
    log = tmp_path / "work" / "eval_lm-megatron-tiny.log"
    assert f"error: fairseq-eval-lm (megatron) failed, exit 1; log {log}:\nerror: the eval-lm stand-in fails" in err
    assert [row["label"] for row in benchmark.read_csv_rows(str(out_csv))] == ["trained"]
    assert not save_dir.exists()  # the checkpoint is removed whether or not eval-lm succeeded


def test_the_record_of_a_run_holds_its_timed_window_and_losses(tmp_path, monkeypatch):
    """``--record``: fairseq-train's output lines are stamped on the host
    clock as they arrive (a line printed 0.2 s after another arrives that
    much later), the timed window spans the last three log intervals (from
    the line before the first of them to the last), and the losses are the
    logged ones. The anchor's window ends at its result line and lasts its
    30 timed steps; ``ANCHOR_*`` knobs show in its label, precision and
    command."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import benchmark

    child = "import time; print('a', flush=True); time.sleep(0.2); print('b', flush=True)"
    rc, output, times = benchmark.run_with_line_times([sys.executable, "-c", child], dict(os.environ))
    assert (rc, output) == (0, "a\nb\n") and times[1] - times[0] >= 0.15

    def interval(update, loss, wps):
        return (f'2026-11-27 10:00:00 | INFO | train_inner | {{"epoch": 1, "update": 0.0, "loss": "{loss}", '
                f'"wps": "{wps}", "num_updates": "{update}"}}')

    output = "\n".join(["begin training", interval(7, 9.9, 10), "a warning", interval(14, 9.5, 20),
                        interval(21, 9.2, 30), interval(28, 9.0, 40)]) + "\n"
    times = [100.0, 101.0, 101.5, 102.0, 103.0, 104.0]
    assert benchmark.timed_window(output, times) == [101.5, 104.0]  # the warning before update 14's line
    assert benchmark.logged_losses(output) == [[7, 9.9], [14, 9.5], [21, 9.2], [28, 9.0]]
    assert benchmark.timed_window("\n".join(output.splitlines()[-3:]), times[-3:]) is None  # no line before

    anchor = tmp_path / "anchor.py"
    anchor.write_text("def bench(name, L, d, h, f, compile_=False, steps=7, B=8, T=1024):\n"
                      "    assert compile_ and steps == 30, (compile_, steps)\n"
                      "    print(f'{name} float8 rowwise compiled: 1M params, 2048.0 tokens/s, 0 TFLOP/s, "
                      "peak mem 1.0 GiB')\n"
                      "\nfor c in (False, True):\n    raise SystemExit('the loop over every shape ran')\n")
    monkeypatch.setenv("ANCHOR_FLOAT8", "rowwise")
    monkeypatch.setenv("ANCHOR_INIT", "torch")
    args = benchmark.build_parser().parse_args(["--shape", "tiny", "--with-anchor", str(anchor), "--label", "x"])
    row = benchmark.run_anchor(args, str(tmp_path), "CPU")
    record = benchmark.run_record(row)
    assert "_record" not in row and row["precision"] == record["precision"] == "fp8-rowwise"
    assert row["label"] == "compiled minimal GPT tiny ANCHOR_INIT=torch ANCHOR_FLOAT8=rowwise x"
    assert row["command"].startswith(f"ANCHOR_INIT=torch ANCHOR_FLOAT8=rowwise {anchor} ")
    start, end = record["window"]
    assert abs((end - start) - 30 * 4 * 64 / 2048.0) < 1e-9  # tiny: 4 x 64 tokens per step, at 2048 tokens/s


def test_fp8_and_gpt2_initialisation_flags(tmp_path, monkeypatch, capsys):
    """``--fp8 RECIPE`` reaches our fairseq-train command (not fairseq's
    transformer_lm's) and the row's precision says it; without a GPU or the
    test mode it is refused before anything runs. ``--init gpt2`` draws
    what the GPU kit's minimal GPT draws: matrices normal(0, 0.02), the
    residual projections 0.02 / sqrt(2 x 2 layers), biases zero, layer
    norms untouched (the std of n normal draws is off by about
    1 / sqrt(2n), 1% for these 4096 and more elements: 5% allows it)."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import benchmark
    import torch

    from tests.helpers import build_model

    monkeypatch.delenv("FAIRSEQ_MEGATRON_FP8_EMULATE", raising=False)
    with pytest.raises(SystemExit) as exited:
        benchmark.main(["--shape", "tiny", "--fp8", "rowwise", "--work-dir", str(tmp_path / "work")])
    assert exited.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: --fp8 needs a GPU with float8 matrix multiplies (or the test mode FAIRSEQ_MEGATRON_FP8_EMULATE=1)")
    assert not (tmp_path / "work").exists()
    args = benchmark.build_parser().parse_args(["--shape", "tiny", "--fp8", "rowwise", "--precision", "bf16-autocast"])
    shape = benchmark.resolved_shape(args)
    ours = benchmark.train_command(args, "megatron", shape, "data", "result", use_cuda=True)
    theirs = benchmark.train_command(args, "fairseq", shape, "data", "result", use_cuda=True)
    assert " --fp8 --fp8-recipe rowwise " in " ".join(ours) and "--fp8" not in theirs
    assert benchmark.precision_label(args, "megatron", True) == "fp8-rowwise"
    assert benchmark.precision_label(args, "fairseq", True) == "fp16"  # its fastest GPU recipe, no float8
    args.precision = "fp32"
    monkeypatch.setenv("FAIRSEQ_MEGATRON_FP8_EMULATE", "1")
    assert benchmark.precision_label(args, "megatron", False) == "fp8-rowwise/fp32-emulated"

    model, _ = build_model(1, decoder_layers=2, decoder_embed_dim=64, decoder_ffn_embed_dim=256)
    norms = {n: p.detach().clone() for n, p in model.named_parameters() if "layer_norm" in n}
    benchmark.gpt2_initialisation_(model)
    for name, p in model.named_parameters():
        if name in norms:
            assert torch.equal(p, norms[name]), name
        elif name.endswith("bias"):
            assert not p.any(), name
        else:
            expected = 0.02 / 2 if name.endswith(("out_proj.weight", "fc2.weight")) else 0.02
            assert abs(p.std().item() / expected - 1) < 0.05 and abs(p.mean().item()) < expected / 10, name
