"""fairseq-interactive under torchrun."""

import os

from fairseq_megatron import USER_DIR
from tests.e2e.common import hypotheses
from tests.helpers import fairseq


def test_fairseq_interactive_reads_standard_input_at_world_size_4(trained):
    """Prompts piped into torchrun at model-parallel size 2 in a world of 4:
    each prompt answered and printed once. Upstream every rank read standard
    input, the ranks split the lines and the run hung in a collective."""
    args = [trained["data"], "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling",
            "--path", os.path.join(trained["ckpt"], "checkpoint_last.pt"), "--model-parallel-size", "2",
            "--beam", "1", "--max-len-b", "8"]
    _, out = fairseq("interactive", args, nproc=4, stdin="the function\nreturn a\nis the\n", timeout=180)
    assert all(f"as rank {r}" in out for r in range(4)) and "as rank 4" not in out  # fairseq's per-rank line
    hyps = hypotheses(out)
    assert sorted(hyps) == ["H-0", "H-1", "H-2"]  # once per prompt, not once per rank or group
    assert [hyps[f"H-{i}"].split()[:2] for i in range(3)] == [["the", "function"], ["return", "a"], ["is", "the"]]


def test_a_prompt_longer_than_the_model_is_one_error_line(trained):
    """fairseq-interactive given a prompt of 40 words for a model of 32
    positions: fairseq raised a bare Exception (a traceback) telling the
    user to skip the "example"; it is now one line that says it is the
    prompt, and how long (the session stops there, as fairseq's did)."""
    args = [trained["data"], "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling",
            "--path", os.path.join(trained["ckpt"], "checkpoint_last.pt"), "--beam", "1", "--max-len-b", "4"]
    rc, out = fairseq("interactive", args, stdin=" ".join(["the"] * 40) + "\n", check=False)
    assert rc == 1 and out.rstrip().splitlines()[-1] == (
        "error: a prompt of 41 tokens is longer than the model's positions (max_positions=32): shorten it, "
        "or skip such prompts with --skip-invalid-size-inputs-valid-test"), out[-3000:]
