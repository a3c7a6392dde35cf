"""What the end-to-end tests share: the small model, its command lines, and what they parse from the logs."""

import os
import re
import sys

import torch

from fairseq_megatron import USER_DIR
from tests.helpers import fairseq

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
sys.path.insert(0, os.path.join(REPO, "examples", "megatron_11b"))
import bpe_encode  # noqa: E402,F401  isort:skip  (the folders above; for conftest.py)
import make_corpus  # noqa: E402  isort:skip

MODEL = [
    "--task", "language_modeling", "--arch", "transformer_lm_megatron_11b",
    "--decoder-layers", "2", "--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "256",
    "--decoder-attention-heads", "4", "--share-decoder-input-output-embed",
    "--sample-break-mode", "none", "--tokens-per-sample", "32",
]
# for scripts that report, as they exit, the gloo worker and transport threads left in their process
GLOO_THREADS = """
import atexit, os, sys


def gloo_threads():
    names = [open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")]
    return sum(name.startswith(("pt_gloo", "gloo")) for name in names)
"""

HUB_SCRIPT = GLOO_THREADS + """

def report_at_exit():  # registered before the package's own handler, so it runs after it, as Python finalizes
    with open(f"{sys.argv[3]}/threads{rank}.txt", "a") as f:
        print(f"at exit: {gloo_threads()}", file=f)


atexit.register(report_at_exit)
import torch
from fairseq_megatron.hub import from_pretrained
lm = from_pretrained(sys.argv[1], data=sys.argv[2], cpu=True, model_parallel_size=int(sys.argv[4]))
rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
prompt = "return the"
with open(f"{sys.argv[3]}/rank{rank}.txt", "w") as f:  # one file per rank: stdout lines would interleave
    print(f"size={size} greedy: " + lm.sample(prompt, beam=1, max_len_b=8), file=f)
    print(f"size={size} beam: " + lm.sample(prompt, beam=3, max_len_b=8), file=f)
    print(f"size={size} sampled: " + lm.sample(prompt, beam=1, sampling=True, sampling_topk=20, max_len_b=8), file=f)
with open(f"{sys.argv[3]}/threads{rank}.txt", "w") as f:
    print(f"loaded: {gloo_threads()}", file=f)
"""


def train_args(data, save_dir, max_update):
    return [data, "--user-dir", USER_DIR, "--cpu", *MODEL,
            "--criterion", "vocab_parallel_cross_entropy", "--model-parallel-size", "2",
            "--batch-size", "4", "--optimizer", "adam", "--lr", "0.001",
            "--max-update", str(max_update), "--save-dir", save_dir, "--no-epoch-checkpoints",
            "--disable-validation", "--log-format", "simple", "--log-interval", "1", "--seed", "3"]


def train_without_dropout(data, save_dir, max_update, model_parallel_size, *extra, groups=1, check=True):
    """fairseq-train at ``model_parallel_size`` on ``groups`` data-parallel
    groups with dropout off (every size then computes the same function):
    (rc, log). A run that succeeded must say it ran at that world size."""
    args = train_args(data, str(save_dir), max_update)
    args[args.index("--model-parallel-size") + 1] = str(model_parallel_size)
    args += ["--dropout", "0", "--attention-dropout", "0", *extra]
    nproc = groups * model_parallel_size
    rc, log = fairseq("train", args, nproc=nproc if nproc > 1 else None, check=check)
    assert rc or f"training on {nproc} devices" in log, log[-3000:]
    return rc, log


def eval_args(data, path, model_parallel_size):
    return [data, "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling", "--path", path,
            "--gen-subset", "test", "--sample-break-mode", "none", "--tokens-per-sample", "32",
            "--context-window", "16", "--batch-size", "4", "--model-parallel-size", str(model_parallel_size)]


def eval_loss(output):
    found = re.findall(r"Loss \(base 2\): ([0-9.]+)", output)
    assert found, output[-3000:]
    return float(found[-1])


def evaluated_tokens(output):
    return int(re.findall(r"Evaluated ([0-9,]+) tokens", output)[-1].replace(",", ""))


def binarized_corpus(root, max_bytes: int) -> str:
    """English text from the standard library's docstrings (``max_bytes``),
    split into ``root/text/{train,valid,test}.txt`` and binarized by
    fairseq-preprocess into ``root/bin``, which is returned. 512 symbols: a
    multiple of 16, so the model at size 2 adds no padding rows and stock
    fairseq (which never pads) builds the same vocabulary."""
    text, data = str(root / "text"), str(root / "bin")
    stdlib = make_corpus.sysconfig.get_paths()["stdlib"]
    corpus = make_corpus.build_corpus(make_corpus.stdlib_files(stdlib), stdlib, max_bytes=max_bytes)
    make_corpus.write_splits(corpus, text)
    fairseq("preprocess", ["--only-source", "--trainpref", f"{text}/train.txt", "--validpref",
                           f"{text}/valid.txt", "--testpref", f"{text}/test.txt", "--destdir", data,
                           "--nwordssrc", "512"])
    return data


def listing(directory):
    """``{name: (size, mtime_ns)}`` of the files in ``directory``."""
    return {e.name: (e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(directory)}


def hypotheses(output):
    """``{sample id: hypothesis}`` from fairseq-generate's ``H-<id>`` lines."""
    hyps = {}
    for line in output.splitlines():
        if line.startswith("H-"):
            sample_id, _score, text = line.split("\t")
            assert sample_id not in hyps, f"{sample_id} printed twice"
            hyps[sample_id] = text
    return hyps


def per_update(log, key):
    """``key=value`` of each logged update (``--log-format simple``, ``--log-interval 1``)."""
    return [float(v) for v in re.findall(rf"\| epoch \d+: +\d+ / \d+ .*?\b{key}=([0-9.]+)", log)]


def valid_losses(log):
    return [float(v) for v in re.findall(r"valid on 'valid' subset \| loss ([0-9.]+)", log)]


# Wikitext's raw format: headings, @-@ / @,@ / @.@ joins, blank lines.
RAW = [
    "",
    " = Valkyria Chronicles III = ",
    "",
    " It sold 2 @,@ 000 copies in 2011 – 2012 , they said . ",
    " The game 's battle system is a role @-@ playing one . ",
    "",
    " = = Gameplay = = ",
    "",
    " Its score was 7 @.@ 5 out of 10 . ",
]
# Detokenized by hand from the recipe's rules: Moses joins punctuation and
# 's to the previous word, then " @" and "@ " vanish, " =" and "= " become
# "=", and " – " becomes "–".
DETOK = [
    "",
    "=Valkyria Chronicles III=",
    "",
    "It sold 2,000 copies in 2011–2012, they said.",
    "The game's battle system is a role-playing one.",
    "",
    "==Gameplay==",
    "",
    "Its score was 7.5 out of 10.",
]


def train_and_valid_losses(log):
    """``{update: (loss, gnorm)}`` of the train_inner lines, and ``{update: valid loss}``."""
    train = {int(u): (float(loss), float(g)) for loss, u, g in
             re.findall(r"train_inner \| .* loss=([0-9.]+),.* num_updates=(\d+),.* gnorm=([0-9.]+)", log)}
    valid = {int(u): float(loss) for loss, u in
             re.findall(r"valid on 'valid' subset \| loss ([0-9.]+) \|.*\| num_updates (\d+)", log)}
    return train, valid


def train_and_validate(data, save_dir, max_update, nproc, *flags):
    """fairseq-train of the small model with dropout off, validated every 2
    updates and each update logged, on ``nproc`` processes (one without
    torchrun); ``flags``: the run's layout and its own options. Its log,
    which must say it ran on ``nproc`` devices."""
    args = [data, "--user-dir", USER_DIR, "--cpu", *MODEL, "--criterion", "vocab_parallel_cross_entropy",
            "--batch-size", "4", "--optimizer", "adam", "--lr", "0.001", "--clip-norm", "1.0",
            "--max-update", str(max_update), "--save-dir", str(save_dir), "--no-epoch-checkpoints",
            "--validate-interval-updates", "2", "--log-format", "simple", "--log-interval", "1", "--seed", "3",
            "--dropout", "0", "--attention-dropout", "0", *flags]
    _, log = fairseq("train", args, nproc=nproc if nproc > 1 else None)
    assert f"training on {nproc} devices" in log, log[-3000:]
    return log


def assert_close_per_update(a, b):
    """The same updates in ``a`` and ``b`` (of :func:`train_and_valid_losses`),
    some, each within 1e-3: losses and norms printed to 3 decimals."""
    assert a.keys() == b.keys() and a, (a, b)
    for k in a:
        torch.testing.assert_close(torch.tensor(a[k], dtype=torch.float64), torch.tensor(b[k], dtype=torch.float64),
                                   rtol=0, atol=1e-3, msg=f"update {k}")
