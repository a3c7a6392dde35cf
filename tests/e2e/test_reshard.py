"""fairseq-megatron-reshard: training on from resharded parts, and the export
to stock fairseq: its transformer_lm loads the export without this package
and computes our logits.

Logit tolerance (fp32): rtol=atol=1e-5, as in tests/distributed/test_model_parity.py:
the weights are bitwise the same at every size; only the order of the fp32
sums in row-parallel layers and the gathered vocabulary changes (~1e-6)."""

import os
import subprocess
import sys

import pytest
import torch

from fairseq_megatron import USER_DIR
from fairseq_megatron.checkpoint.export import export_to_fairseq
from fairseq_megatron.checkpoint.resharding import reshard
from fairseq_megatron.cli import reshard_checkpoint
from tests.e2e.common import eval_args, eval_loss, evaluated_tokens, per_update, train_args, train_without_dropout
from tests.helpers import fairseq, make_batch, make_dictionary
from tests.support.checkpoint_resharding import TOL, WORDS, build_at_size, save_checkpoint

# Stock fairseq, in a process that never imports this package, runs the export.
STOCK_FAIRSEQ = r"""
import sys, torch
from omegaconf import OmegaConf
import fairseq.models
from fairseq.data import Dictionary
assert "fairseq_megatron" not in sys.modules
path, tokens_path, out_path, words = sys.argv[1:5]
state = torch.load(path, weights_only=True)  # plain tensors and Python values only
d = Dictionary()
for i in range(int(words)):
    d.add_symbol(f"w{i}")
class Task:
    source_dictionary = target_dictionary = d
cfg = OmegaConf.create(state["cfg"])
model = fairseq.models.build_model(cfg.model, Task(), from_checkpoint=True)
model.load_state_dict(state["model"], strict=True)
model.eval()
with torch.no_grad():
    torch.save(model(torch.load(tokens_path))[0], out_path)
print(type(model).__name__)
"""


def test_resharded_optimizer_state_resumes_training_at_another_size(trained, tmp_path, capsys):
    """A size-2 checkpoint resharded to size 1 with --keep-optimizer trains on
    at size 1 with the same loss and ``gnorm`` per update as the original
    parts trained on at size 2; with --reset-optimizer (all there was before)
    the losses part after the first update, so the comparison can fail.

    The dictionary has 500 symbols: size 2 pads it to 512 rows, a fresh
    model at size 1 to 504. fairseq-train builds its model before loading:
    it takes the checkpoint's 512 rows (fairseq said "Cannot load model
    parameters"), also when it fine-tunes from the size-2 parts (joined in
    memory), in the current and in PyTorch's pre-1.6 format, starting there
    from the same weights as the reset run. Dropout is off, so both sizes
    compute the same function; tolerance: one unit of the 3 printed
    decimals (fp32 summation order)."""
    data, size2, size1 = (tmp_path / d for d in ("bin500", "size2", "size1"))
    text = trained["root"] / "text"
    fairseq("preprocess", ["--only-source", "--trainpref", f"{text}/train.txt", "--destdir", str(data),
                           "--nwordssrc", "500"])
    fairseq("train", train_args(str(data), str(size2), max_update=4), nproc=2)
    assert reshard_checkpoint.main(["--input", str(size2 / "checkpoint_last.pt"), "--output",
                                    str(size1 / "checkpoint_last.pt"), "--model-parallel-size", "1",
                                    "--keep-optimizer"]) == 0
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"train on with: fairseq-train ... --model-parallel-size 1 --restore-file {size1 / 'checkpoint_last.pt'}")

    def train_on(save_dir, size, *extra, reset_optimizer=False):
        start = 0 if reset_optimizer or "--finetune-from-model" in extra else 4  # a reset starts the count anew
        rc, log = train_without_dropout(str(data), save_dir, start + 3, size, "--no-save", *extra,
                                        *(["--reset-optimizer"] if reset_optimizer else []))
        assert f"(epoch 1 @ {start} updates)" in log, log[-3000:]
        assert "--padded-vocab-size 512" in log  # taken from the checkpoint, and said
        return {key: per_update(log, key) for key in ("loss", "gnorm")}

    at_2 = train_on(size2, 2)
    at_1 = train_on(size1, 1)
    reset = train_on(size1, 1, reset_optimizer=True)
    for key in ("loss", "gnorm"):
        assert len(at_2[key]) == len(at_1[key]) == 3, (key, at_2, at_1)
        for a, b in zip(at_2[key], at_1[key]):
            assert abs(a - b) <= 1.1e-3, (key, at_2, at_1)
    assert reset["loss"][0] == at_1["loss"][0]  # the same weights and batch before the first update
    # then Adam's moments start from zero: the losses part by far more than the tolerance
    assert max(abs(a - b) for a, b in zip(reset["loss"][1:], at_1["loss"][1:])) > 10 * 1.1e-3, (reset, at_1)
    # fine-tuning at size 1 from the size-2 parts, also from parts saved by PyTorch < 1.6 (read whole)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for name in ("checkpoint_last-model_part-0.pt", "checkpoint_last-model_part-1.pt"):
        torch.save(torch.load(size2 / name, weights_only=False), legacy / name, _use_new_zipfile_serialization=False)
    tuned = [train_on(tmp_path / "finetune", 1, "--finetune-from-model", str(source / "checkpoint_last.pt"))
             for source in (size2, legacy)]
    assert tuned[0] == tuned[1] and len(tuned[0]["loss"]) == 3, tuned  # the same weights, read either way


def test_export_evaluates_in_stock_fairseq_without_user_dir(trained):
    path = os.path.join(trained["ckpt"], "checkpoint_last.pt")
    _, ours = fairseq("eval_lm", eval_args(trained["data"], path, 2), nproc=2)
    plain = str(trained["root"] / "plain" / "model.pt")
    export_to_fairseq(path, plain)
    stock_args = [a for a in eval_args(trained["data"], plain, 1) if a != USER_DIR and a != "--user-dir"]
    assert "--user-dir" not in stock_args
    _, stock = fairseq("eval_lm", stock_args)
    assert "fairseq_megatron" not in stock
    assert evaluated_tokens(stock) == evaluated_tokens(ours)
    assert abs(eval_loss(stock) - eval_loss(ours)) <= 2e-4, (eval_loss(stock), eval_loss(ours))


@pytest.mark.parametrize("cut_vocab", [False, True], ids=["all-rows", "cut-to-dictionary"])
def test_export_to_fairseq_loads_in_stock_transformer_lm(tmp_path, cut_vocab):
    src = str(tmp_path / "src" / "model.pt")
    os.makedirs(os.path.dirname(src))
    save_checkpoint(src, 2)
    merged = str(tmp_path / "mp1" / "model.pt")
    reshard(src, merged, 1)
    exported = str(tmp_path / "plain" / "model.pt")
    vocab = 4 + WORDS if cut_vocab else None
    export_to_fairseq(src, exported, vocab_size=vocab)

    tokens, _ = make_batch(make_dictionary(WORDS), seed=5)
    torch.save(tokens, tmp_path / "tokens.pt")
    # stock fairseq builds len(dictionary) rows: pad the test dictionary like the data's would be
    words = WORDS if cut_vocab else 64 - 4
    proc = subprocess.run([sys.executable, "-c", STOCK_FAIRSEQ, exported, str(tmp_path / "tokens.pt"),
                           str(tmp_path / "stock.pt"), str(words)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("TransformerLanguageModel")
    stock = torch.load(tmp_path / "stock.pt")

    state = torch.load(merged, weights_only=False)
    model, _ = build_at_size(1, state["cfg"]["model"])
    model.load_state_dict(state["model"], strict=True)
    model.eval()
    with torch.no_grad():
        ours = model(tokens)[0]
    rows = 4 + WORDS if cut_vocab else 64
    assert stock.shape[-1] == rows
    torch.testing.assert_close(stock, ours[..., :rows], **TOL)
