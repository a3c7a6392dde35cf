"""fairseq-generate at model-parallel size 2 and over data-parallel groups."""

import os
import re

from fairseq.data import data_utils

from fairseq_megatron import USER_DIR
from fairseq_megatron.checkpoint.resharding import reshard
from tests.e2e.common import hypotheses
from tests.helpers import fairseq


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
