"""fairseq-validate and fairseq-train's validation: every sample scored, over data-parallel groups."""

import os
import re

from fairseq.data import data_utils

from fairseq_megatron import USER_DIR
from tests.e2e.common import eval_loss, evaluated_tokens, train_args, valid_losses
from tests.helpers import fairseq


def test_fairseq_validate_over_two_data_parallel_groups(trained):
    """fairseq-validate at world size 4, model-parallel size 2 (two
    data-parallel groups, 7 batches: one group's shard ends with the empty
    batch fairseq pads it with) prints its configuration and result once,
    the loss of one process at size 1 on the same checkpoint (its parts
    joined in memory). Before: every rank printed both, the gather of the
    groups' results failed on CPU (fairseq allocates a CUDA buffer), and
    the padding batch failed on any machine (KeyError 'net_input').
    Tolerance: one unit of the 3 printed decimals (fp32 sums in another
    order)."""
    args = [trained["data"], "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling", "--path",
            os.path.join(trained["ckpt"], "checkpoint_last.pt"), "--sample-break-mode", "none",
            "--tokens-per-sample", "32", "--batch-size", "6", "--valid-subset", "valid"]
    _, one = fairseq("validate", args)
    _, four = fairseq("validate", args + ["--model-parallel-size", "2"], nproc=4)
    assert re.search(r"initialized host \S+ as rank 3\b", four), four[-3000:]  # ran at world size 4
    losses = {"one": valid_losses(one), "four": valid_losses(four)}
    assert len(losses["one"]) == len(losses["four"]) == 1, (losses, four[-3000:])
    assert abs(losses["one"][0] - losses["four"][0]) <= 1.1e-3, losses
    assert four.count("| INFO | fairseq_cli.validate | {'_name'") == 1, four[-3000:]


def test_evaluation_scores_every_sample(trained, tmp_path):
    """fairseq drops the last batch when its size is not a multiple of
    ``--required-batch-size-multiple`` (8 by default; fairseq issue 5036).
    With ``--batch-size 4`` the test model's 44 validation blocks made 10
    batches, 40 blocks: fairseq-validate printed 8.33 where fairseq-eval-lm,
    which scores every token, prints 8.3118; fairseq-train's validation
    missed the same blocks (8.912 against 8.8676), and fairseq-generate wrote
    40 hypotheses for 44 prompts. Now all three cover every block: the
    validation losses equal eval-lm's on the same weights. Tolerance: the two
    tools print 3 and 4 decimals (rounding, 5.5e-4) plus fp32 sums in
    another order."""
    data, ckpt = trained["data"], os.path.join(trained["ckpt"], "checkpoint_last.pt")
    valid = data_utils.load_indexed_dataset(os.path.join(data, "valid"), None)  # unmapped when collected
    tokens = int(valid.sizes.sum())
    blocks = -(-tokens // 32)  # --tokens-per-sample 32
    assert blocks % 8, blocks  # so that generate's --batch-size 8 also leaves a short last batch
    subset = ["--sample-break-mode", "none", "--tokens-per-sample", "32", "--batch-size", "4"]
    evaluate = [data, "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling", *subset]

    def eval_lm_loss(path):
        _, log = fairseq("eval_lm", evaluate + ["--path", path, "--gen-subset", "valid"])
        assert evaluated_tokens(log) == tokens, log[-3000:]
        return eval_loss(log)

    _, log = fairseq("validate", evaluate + ["--path", ckpt, "--valid-subset", "valid"])
    validated, scored = valid_losses(log), eval_lm_loss(ckpt)
    assert len(validated) == 1 and abs(validated[0] - scored) <= 1e-3, (validated, scored)

    # fairseq-train at size 1 validating after update 2, then saving those weights
    save_dir = tmp_path / "train"
    args = train_args(data, str(save_dir), max_update=2)
    args.remove("--disable-validation")
    args[args.index("--model-parallel-size") + 1] = "1"
    _, log = fairseq("train", args + ["--validate-interval-updates", "2", "--save-interval-updates", "2"])
    validated, scored = valid_losses(log), eval_lm_loss(str(save_dir / "checkpoint_last.pt"))
    assert len(validated) == 1 and abs(validated[0] - scored) <= 1e-3, (validated, scored)

    generate = evaluate + ["--path", ckpt, "--gen-subset", "valid", "--prefix-size", "2", "--max-len-b", "4",
                           "--beam", "1"]
    generate[generate.index("--batch-size") + 1] = "8"
    _, log = fairseq("generate", generate)
    assert sorted(int(line.split("\t")[0][2:]) for line in log.splitlines() if line.startswith("H-")) == list(
        range(blocks)), log[-3000:]
