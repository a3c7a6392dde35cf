"""fairseq-eval-lm on the shared checkpoint: sizes, other-size checkpoints, every token scored, and the one-line errors of bad checkpoints."""

import os
import re
import shutil

import torch
from fairseq.data import Dictionary

from fairseq_megatron import USER_DIR
from fairseq_megatron.checkpoint.resharding import reshard
from tests.e2e.common import eval_args, eval_loss, evaluated_tokens, listing, train_args, train_without_dropout
from tests.helpers import fairseq


def word_output(log):
    """fairseq-eval-lm's ``--output-word-probs`` lines as ``[(sample id, [(word, log-prob)])]``
    and its ``--output-word-stats`` lines as ``[(word, count, log-prob sum, fields 3-5)]``."""
    probs, stats = [], []
    for message in re.findall(r"fairseq_cli\.eval_lm(?: \| |:)(.*)", log):  # fairseq's format, or Python's
        fields = message.split("\t")
        if re.fullmatch(r"\d+ .*", message):
            first_id, first_word = fields[0].split(" ", 1)
            words = [re.fullmatch(r"(.*) \[(\S+)\]", f).groups() for f in [first_word] + fields[1:]]
            probs.append((int(first_id), [(w, float(p)) for w, p in words]))
        elif len(fields) == 6 and fields[1].isdigit():
            stats.append((fields[0], int(fields[1]), float(fields[2]), fields[3], float(fields[4]), int(fields[5])))
    return probs, stats


def test_eval_lm_size_2_equals_size_1_on_same_weights(trained):
    path = os.path.join(trained["ckpt"], "checkpoint_last.pt")
    _, out2 = fairseq("eval_lm", eval_args(trained["data"], path, 2), nproc=2)

    merged = str(trained["root"] / "merged" / "model.pt")
    assert reshard(path, merged, 1) == [merged]
    _, out1 = fairseq("eval_lm", eval_args(trained["data"], merged, 1))

    # Every test token is scored once by the model-parallel group (fairseq
    # alone would give each rank half of the batches).
    assert evaluated_tokens(out2) == evaluated_tokens(out1)
    # eval-lm prints 4 decimals; fp32 reordering across shards is ~1e-6.
    assert abs(eval_loss(out2) - eval_loss(out1)) <= 2e-4, (eval_loss(out2), eval_loss(out1))


def test_eval_lm_loads_a_checkpoint_saved_at_another_size(trained, tmp_path):
    """fairseq-eval-lm at model-parallel size 1 on the 2 part files (also
    written as an old checkpoint), and at size 2 on one merged file: each
    rank's part is built in memory (fairseq alone: "Model file not found"),
    nothing is written, and the loss is the loss at the size the files were
    saved at."""
    path = os.path.join(trained["ckpt"], "checkpoint_last.pt")
    _, saved_size = fairseq("eval_lm", eval_args(trained["data"], path, 2), nproc=2)
    before = listing(trained["ckpt"])
    _, from_parts = fairseq("eval_lm", eval_args(trained["data"], path, 1))
    assert listing(trained["ckpt"]) == before
    assert "2 model part(s), loaded at model-parallel size 1: part 0 resharded in memory" in from_parts

    merged = str(tmp_path / "model.pt")
    reshard(path, merged, 1)
    _, from_one_file = fairseq("eval_lm", eval_args(trained["data"], merged, 2), nproc=2)
    assert os.listdir(tmp_path) == ["model.pt"]
    assert "1 model part(s), loaded at model-parallel size 2: part 0 resharded in memory" in from_one_file

    # The same parts as a 2020 checkpoint such as the published Megatron-11b:
    # argparse ``args`` instead of ``cfg``, torch's pre-1.6 file format, and
    # in each part its own value of the buffer fairseq creates uninitialised
    # (NaN in one part), which joining the parts must not take for a weight.
    from fairseq import options

    args = options.parse_args_and_arch(options.get_training_parser(),
                                       train_args(trained["data"], trained["ckpt"], max_update=4))
    old = tmp_path / "old"
    old.mkdir()
    for rank in range(2):
        state = torch.load(os.path.join(trained["ckpt"], f"checkpoint_last-model_part-{rank}.pt"), weights_only=False)
        state["args"], state["cfg"] = args, None
        state["model"]["decoder.embed_positions._float_tensor"] = torch.tensor([(0.0, float("nan"))[rank]])
        torch.save(state, old / f"model-model_part-{rank}.pt", _use_new_zipfile_serialization=False)
    _, from_old_parts = fairseq("eval_lm", eval_args(trained["data"], str(old / "model.pt"), 1))
    assert "2 model part(s), loaded at model-parallel size 1" in from_old_parts

    for out in (from_parts, from_one_file, from_old_parts):
        assert evaluated_tokens(out) == evaluated_tokens(saved_size)
        # eval-lm prints 4 decimals; fp32 reordering across shards is ~1e-6.
        assert abs(eval_loss(out) - eval_loss(saved_size)) <= 2e-4, (eval_loss(out), eval_loss(saved_size))


def test_missing_part_file_is_reported(trained):
    broken = trained["root"] / "broken"
    broken.mkdir()
    shutil.copy(os.path.join(trained["ckpt"], "checkpoint_last-model_part-0.pt"), broken)
    rc, out = fairseq("eval_lm", eval_args(trained["data"], str(broken / "checkpoint_last.pt"), 2),
                      nproc=2, check=False)
    assert rc != 0
    assert "checkpoint_last-model_part-1.pt" in out
    line = (f"error: model part file {broken / 'checkpoint_last-model_part-1.pt'} is missing: "
            f"{broken / 'checkpoint_last.pt'} was saved at model-parallel size 2")
    # at size 1, where the one part left looked like a whole checkpoint: fairseq's traceback
    # "Model file not found: .../checkpoint_last.pt", which named no part
    rc, out = fairseq("eval_lm", eval_args(trained["data"], str(broken / "checkpoint_last.pt"), 1), check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == line and "Traceback" not in out, out[-3000:]
    # fairseq-train resuming there: rank 0 loaded its part, rank 1 was told
    # the checkpoint had another size; now both name the missing part
    rc, out = fairseq("train", train_args(trained["data"], str(broken), max_update=9), nproc=2, check=False)
    assert rc != 0 and f"[rank0]: {line}" in out and f"[rank1]: {line}" in out, out[-3000:]


def test_a_dictionary_other_than_the_trained_one_is_one_error_line(trained, tmp_path):
    """The data's dict.txt cut by 10 lines (502 symbols for a model trained
    with 512): at size 2 it pads to the same 512 rows, so fairseq-eval-lm
    evaluated and fine-tuning trained on without a word, every token looked
    up in another symbol's row (stock fairseq's model fails to load:
    "size mismatch"). Both now stop with one line on every rank."""
    data = tmp_path / "bin"
    shutil.copytree(trained["data"], data)
    lines = (data / "dict.txt").read_text().splitlines(keepends=True)
    (data / "dict.txt").write_text("".join(lines[:-10]))
    assert len(Dictionary.load(str(data / "dict.txt"))) == 502
    path = os.path.join(trained["ckpt"], "checkpoint_last.pt")
    rc, out = fairseq("eval_lm", eval_args(str(data), path, 2), nproc=2, check=False)
    line = "error: the dictionary has 502 symbols but the checkpoint's model was trained with 512: " \
           "wrong dict.txt for this checkpoint"
    assert rc != 0 and f"[rank0]: {line}" in out and f"[rank1]: {line}" in out, out[-3000:]
    assert "Loss (base 2)" not in out

    rc, out = fairseq("train", train_args(str(data), str(tmp_path / "finetune"), max_update=2)
                      + ["--finetune-from-model", path], nproc=2, check=False)
    line = f"error: the dictionary has 502 symbols but {path} was trained with 512: wrong dict.txt for this checkpoint"
    assert rc != 0 and f"[rank0]: {line}" in out and f"[rank1]: {line}" in out, out[-3000:]
    assert "num_updates" not in out
    assert not (tmp_path / "finetune").exists()  # made by fairseq-train's main, removed when it failed


def test_a_truncated_part_file_is_one_error_line_on_every_rank(trained, tmp_path):
    """Part 1 cut short (a copy that stopped): before, the rank loading it
    failed inside torch.load and the other reported a lost connection, each
    with a traceback. Now every rank checks every part first and prints the
    same single line, in fairseq-eval-lm (size 2 under torchrun, and size 1
    in one process, where that line is all that follows fairseq's log) and
    in fairseq-train resuming at the saved size."""
    for name in ("checkpoint_last-model_part-0.pt", "checkpoint_last-model_part-1.pt"):
        shutil.copy(os.path.join(trained["ckpt"], name), tmp_path)
    part = tmp_path / "checkpoint_last-model_part-1.pt"
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])
    line = (f"error: {part} is truncated: the zip archive's directory, which torch writes last, is missing "
            f"(was the file still being saved or copied?)")
    path = str(tmp_path / "checkpoint_last.pt")

    rc, out = fairseq("eval_lm", eval_args(trained["data"], path, 2), nproc=2, check=False)
    assert rc != 0
    assert f"[rank0]: {line}" in out and f"[rank1]: {line}" in out, out[-3000:]
    assert "PytorchStreamReader" not in out and "Connection closed" not in out, out[-3000:]

    rc, out = fairseq("eval_lm", eval_args(trained["data"], path, 1), check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == line and "Traceback" not in out, out[-3000:]

    rc, out = fairseq("train", train_args(trained["data"], str(tmp_path), max_update=9), nproc=2, check=False)
    assert rc != 0
    assert f"[rank0]: {line}" in out and f"[rank1]: {line}" in out, out[-3000:]
    assert "num_updates" not in out and part.stat().st_size == len(data) // 2


def test_parts_of_two_saves_are_one_error_line_on_every_rank(trained, tmp_path):
    """Part 1 from a later save than part 0 (a save killed between its
    parts leaves that; here its recorded update count is changed). At the
    size they were saved at each rank loads only its own part: fairseq-eval-lm
    scored the mix with exit 0, and fairseq-train resuming waited forever on
    the rank that reached --max-update first. Now every tool refuses the set
    on every rank before loading, in one line naming each part's update:
    eval-lm and fairseq-generate at size 2, eval-lm at size 1 (the parts
    joined in memory) and fairseq-train resuming at size 2."""
    for name in ("checkpoint_last-model_part-0.pt", "checkpoint_last-model_part-1.pt"):
        shutil.copy(os.path.join(trained["ckpt"], name), tmp_path)
    part = tmp_path / "checkpoint_last-model_part-1.pt"
    state = torch.load(part, weights_only=False)
    state["optimizer_history"][-1]["num_updates"] = 9
    torch.save(state, part)
    path = str(tmp_path / "checkpoint_last.pt")
    line = (f"error: the model parts of {path} are not one save: checkpoint_last-model_part-0.pt at update 4, "
            f"checkpoint_last-model_part-1.pt at update 9 (a save interrupted between its parts, or parts of two "
            f"runs)")

    rc, out = fairseq("eval_lm", eval_args(trained["data"], path, 2), nproc=2, check=False)
    assert rc != 0 and f"[rank0]: {line}" in out and f"[rank1]: {line}" in out, out[-3000:]
    assert "Loss (base 2)" not in out

    generate = [trained["data"], "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling", "--path", path,
                "--gen-subset", "test", "--sample-break-mode", "none", "--tokens-per-sample", "32",
                "--prefix-size", "2", "--max-len-b", "4", "--batch-size", "8", "--beam", "1",
                "--model-parallel-size", "2"]
    rc, out = fairseq("generate", generate, nproc=2, check=False)
    assert rc != 0 and f"[rank0]: {line}" in out and f"[rank1]: {line}" in out, out[-3000:]

    rc, out = fairseq("eval_lm", eval_args(trained["data"], path, 1), check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == line and "Traceback" not in out, out[-3000:]

    before = listing(tmp_path)
    rc, out = fairseq("train", train_args(trained["data"], str(tmp_path), max_update=9), nproc=2, check=False,
                      timeout=120)
    assert rc != 0 and f"[rank0]: {line}" in out and f"[rank1]: {line}" in out, out[-3000:]
    assert "num_updates" not in out and listing(tmp_path) == before


def test_a_corrupted_part_is_one_error_line_on_every_rank(trained, tmp_path):
    """One byte of a weight in part 1 flipped after the save: fairseq-eval-lm
    printed another perplexity with exit 0. Each rank checks the CRC-32s of
    the part it reads, and the ranks of a model-parallel group share what
    they found: at size 2 both print the line of part 1 (rank 0's part is
    whole), as does fairseq-train resuming; at size 1, which reads every
    part, eval-lm prints it."""
    for name in ("checkpoint_last-model_part-0.pt", "checkpoint_last-model_part-1.pt"):
        shutil.copy(os.path.join(trained["ckpt"], name), tmp_path)
    part = tmp_path / "checkpoint_last-model_part-1.pt"
    weight = torch.load(part, weights_only=False)["model"]["decoder.layers.1.fc2.weight"]
    data = bytearray(part.read_bytes())
    at = data.find(weight.numpy().tobytes())
    assert at > 0
    data[at + 101] ^= 0x01
    part.write_bytes(bytes(data))
    path = str(tmp_path / "checkpoint_last.pt")
    line = re.compile(r"error: " + re.escape(f"{part} is corrupted: its record ")
                      + r"\S+/data/\d+ does not match the CRC-32 stored when it was saved \(the file changed since\)")

    def said_by(out):
        return sorted(m.group(1) for m in re.finditer(r"^(\[rank\d\]: )?" + line.pattern + "$", out, re.M))

    rc, out = fairseq("eval_lm", eval_args(trained["data"], path, 2), nproc=2, check=False, timeout=120)
    assert rc != 0 and said_by(out) == ["[rank0]: ", "[rank1]: "], out[-3000:]
    assert "Loss (base 2)" not in out

    rc, out = fairseq("eval_lm", eval_args(trained["data"], path, 1), check=False)
    assert rc == 1 and line.fullmatch(out.rstrip().splitlines()[-1]) and "Traceback" not in out, out[-3000:]

    rc, out = fairseq("train", train_args(trained["data"], str(tmp_path), max_update=9), nproc=2, check=False,
                      timeout=120)
    assert rc != 0 and said_by(out) == ["[rank0]: ", "[rank1]: "], out[-3000:]
    assert "num_updates" not in out


def test_a_file_that_is_not_a_checkpoint_is_one_error_line(trained, tmp_path):
    """A checkpoint name holding something else (here a text file) in
    fairseq-eval-lm and in fairseq-train resuming, both at size 1 in one
    process: fairseq let torch's unpickling error through as a traceback
    that did not name the file; now one line names it, and the file is
    left as it was."""
    junk = tmp_path / "checkpoint_last.pt"
    junk.write_text("not a checkpoint\n")
    rc, out = fairseq("eval_lm", eval_args(trained["data"], str(junk), 1), check=False)
    last = out.rstrip().splitlines()[-1]
    assert rc == 1 and last.startswith(f"error: cannot read {junk}: UnpicklingError: ") \
        and "Traceback" not in out, out[-3000:]
    rc, out = train_without_dropout(trained["data"], tmp_path, 2, 1, check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1].startswith(f"error: cannot read {junk}: ") \
        and "Traceback" not in out and "num_updates" not in out, out[-3000:]
    assert junk.read_text() == "not a checkpoint\n"


def test_a_path_that_names_nothing_is_one_error_line(trained, tmp_path):
    """Paths that name no file: fairseq answered with a traceback whose last
    line named one rank's part ("Model file not found: ...-model_part-1.pt"),
    an IsADirectoryError for a directory, and a FileNotFoundError for a data
    directory without dict.txt. Each is now one line (on every rank under
    torchrun) naming what was looked for."""
    missing = tmp_path / "missing.pt"
    rc, out = fairseq("eval_lm", eval_args(trained["data"], str(missing), 2), nproc=2, check=False)
    line = (f"error: no checkpoint {missing} and no model part files "
            f"{tmp_path / 'missing-model_part-0.pt'}, ...")
    assert rc != 0 and f"[rank0]: {line}" in out and f"[rank1]: {line}" in out \
        and "]: Traceback" not in out, out[-3000:]  # torchrun's own follows, its summary of the exits
    rc, out = fairseq("eval_lm", eval_args(trained["data"], trained["ckpt"], 1), check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == (
        f"error: {trained['ckpt']} is a directory, not a checkpoint: name a checkpoint in it, such as "
        f"{os.path.join(trained['ckpt'], 'checkpoint_best.pt')}") and "Traceback" not in out, out[-3000:]
    path = os.path.join(trained["ckpt"], "checkpoint_last.pt")
    rc, out = fairseq("eval_lm", eval_args(str(tmp_path), path, 1), check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == (
        f"error: [Errno 2] No such file or directory: '{tmp_path / 'dict.txt'}'") \
        and "Traceback" not in out, out[-3000:]


def test_eval_lm_scores_every_token_or_stops_with_one_line(trained):
    """Blocks longer than the model's 32 positions: fairseq-eval-lm skipped
    such samples with a warning whatever --skip-invalid-size-inputs-valid-test
    said, and printed the loss of the others ("Loss (base 2): 0.0000,
    Perplexity: 1.00" with all of them skipped). A context window as long as
    the blocks left no token to score: ZeroDivisionError in fairseq's block
    dataset. Each now stops with one line on every rank: too-long samples
    unless the flag asks to skip them, and a run in which nothing was scored."""
    path = os.path.join(trained["ckpt"], "checkpoint_last.pt")

    def run(tokens_per_sample, context_window, *extra):
        args = eval_args(trained["data"], path, 2) + list(extra)
        args[args.index("--tokens-per-sample") + 1] = str(tokens_per_sample)
        args[args.index("--context-window") + 1] = str(context_window)
        rc, out = fairseq("eval_lm", args, nproc=2, check=False)
        assert rc != 0 and "Loss (base 2)" not in out and "ZeroDivisionError" not in out, out[-3000:]
        lines = {rank: re.findall(rf"^\[rank{rank}\]: (error: .*)$", out, re.M) for rank in (0, 1)}
        assert len(lines[0]) == 1 and lines[0] == lines[1], out[-3000:]
        return lines[0][0]

    assert re.fullmatch(r"error: [0-9,]+ samples are longer than the model's positions \(sample #\d+: \d+, "
                        r"max_positions=32\): lower --tokens-per-sample, or skip them with "
                        r"--skip-invalid-size-inputs-valid-test", run(64, 0))
    assert re.fullmatch(r"error: all [0-9,]+ samples are longer than the model's positions \(max_positions=32\): "
                        r"lower --tokens-per-sample", run(64, 0, "--skip-invalid-size-inputs-valid-test"))
    assert run(32, 32) == (
        "error: --context-window 32 leaves no token to score in blocks of --tokens-per-sample 32: each "
        "block scores tokens-per-sample minus context-window tokens")


def test_one_part_file_as_path_is_refused(trained):
    """--path naming a part file instead of the checkpoint (the slip users
    make with the published model) is refused with the name to pass."""
    part = os.path.join(trained["ckpt"], "checkpoint_last-model_part-0.pt")
    rc, out = fairseq("eval_lm", eval_args(trained["data"], part, 1), check=False)
    assert rc != 0
    assert (f"--path {part} is one of 2 model part files: pass the checkpoint's name, "
            f"--path {os.path.join(trained['ckpt'], 'checkpoint_last.pt')}") in out, out[-3000:]


def test_eval_lm_over_two_data_parallel_groups(trained, tmp_path):
    """World size 4 at model-parallel size 2 (two data-parallel groups, each
    DataLoader with 2 workers, an odd number of batches) prints the loss of
    the whole test set, equal to one process's. Upstream this crashed
    (KeyError 'net_input' on the empty batch that pads the short shard), took
    each block's context from whichever batch its worker collated before,
    and printed rank 0's shard only; so did ``--output-word-probs`` and
    ``--output-word-stats``, whose lines now give every sample and word of
    the test set in one process's order. Tolerance as in the size-2 test
    above; for a word's log-probability 1e-4, per occurrence in the
    statistics' sums (fp32 rounding: on the demo checkpoint, size 1 against
    world size 4 at size 2, at most 4e-6 in the 6 printed decimals)."""
    path = os.path.join(trained["ckpt"], "checkpoint_last.pt")
    merged = str(tmp_path / "model.pt")
    reshard(path, merged, 1)
    words = ["--output-word-probs", "--output-word-stats"]
    _, one = fairseq("eval_lm", eval_args(trained["data"], merged, 1) + words)
    blocks = -(-evaluated_tokens(one) // 16)  # eval_args: 32 tokens per sample, 16 of them context
    batch_size = next(b for b in range(3, 20) if -(-blocks // b) % 2 == 1)
    args = eval_args(trained["data"], path, 2) + ["--num-workers", "2"] + words
    args[args.index("--batch-size") + 1] = str(batch_size)
    _, four = fairseq("eval_lm", args, nproc=4)
    assert "2 data-parallel groups scored" in four, four[-3000:]
    assert evaluated_tokens(four) < evaluated_tokens(one)  # this rank's shard only: the data was split
    assert abs(eval_loss(four) - eval_loss(one)) <= 2e-4, (eval_loss(four), eval_loss(one))

    (probs_one, stats_one), (probs_four, stats_four) = word_output(one), word_output(four)
    assert len(probs_one) == blocks and sum(s[1] for s in stats_one) == evaluated_tokens(one), one[-3000:]
    assert [(i, [w for w, _ in ws]) for i, ws in probs_four] == [(i, [w for w, _ in ws]) for i, ws in probs_one]
    assert all(abs(p4 - p1) <= 1e-4 for (_, ws4), (_, ws1) in zip(probs_four, probs_one)
               for (_, p4), (_, p1) in zip(ws4, ws1))
    assert [(s[0], s[1], s[3], s[5]) for s in stats_four] == [(s[0], s[1], s[3], s[5]) for s in stats_one]
    assert all(abs(s4[i] - s1[i]) <= 1e-4 * s1[1] for s4, s1 in zip(stats_four, stats_one) for i in (2, 4))
