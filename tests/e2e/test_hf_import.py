"""Models imported with ``fairseq-megatron-reshard --from-hf`` in fairseq's
own tools, run as a user runs them (a process per rank under torchrun's
environment), against transformers on the same tokens:

- GPT-2 (logits far below 0), imported at model-parallel size 2:
  fairseq-eval-lm's loss over the test split equals transformers' over the
  same blocks (``--sample-break-mode none --tokens-per-sample 32``: fairseq's
  blocks of 32 targets, each scored from the tokens of its own block only;
  fairseq's ``</s>`` at each line's end is GPT-2's end-of-text, and is scored);
- OPT, imported at size 2: fairseq-train ``--finetune-from-model`` at size 2
  with no flag of the model's architecture; its first update's loss is
  transformers' loss on the same batch (the epoch is that one batch), and
  the loss falls over 20 updates.

Tolerances: fairseq prints its losses (base 2) with 4 decimals (eval-lm)
and 3 (train); 1e-4 relative covers both the print's rounding (at most
5e-4 of a loss of ~10 bits) and fp32 sums in another order, with the
print's rounding added for eval-lm's loss of a few bits.
"""

import math
import random

import torch
from fairseq import options, tasks

from fairseq_megatron import USER_DIR
from tests.e2e.common import bpe_encode, eval_loss, per_update
from tests.helpers import fairseq
from tests.support import hf_models


def _blocks(data: str, split: str, tokens_per_sample: int, batch_size: int) -> list:
    """The batches of ``split`` as fairseq's language-modeling task makes them in order
    (``--sample-break-mode none``), with the source and target of each block."""
    parser = options.get_eval_lm_parser()
    args = options.parse_args_and_arch(parser, [data, "--task", "language_modeling", "--tokens-per-sample",
                                                str(tokens_per_sample), "--sample-break-mode", "none"])
    task = tasks.setup_task(args)
    task.load_dataset(split)
    return list(task.eval_lm_dataloader(task.dataset(split), batch_size=batch_size, max_positions=tokens_per_sample))


def _transformers_loss(directory: str, batches: list, to_source) -> tuple:
    """(bits per target token, targets) of transformers' model over ``batches``
    (our ids; ``to_source`` maps them to the model's), padding ignored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory)
    model.eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            src, target = batch["net_input"]["src_tokens"], batch["target"]
            keep = target != 1
            log_probs = torch.log_softmax(model(input_ids=to_source(src)).logits.double(), -1)
            picked = log_probs.gather(-1, to_source(target).unsqueeze(-1)).squeeze(-1)
            nll -= picked[keep].sum().item()
            count += int(keep.sum())
    return nll / count / math.log(2), count


def _import(source: str, out: str, *bpe) -> None:
    _, log = fairseq("fairseq_megatron.cli.reshard_checkpoint", ["--from-hf", source, "--output", out,
                                                                 "--model-parallel-size", "2", *bpe])
    assert log.strip().splitlines()[-1].endswith("dict.txt"), log[-2000:]


def test_eval_lm_of_an_imported_gpt2_equals_transformers(tmp_path):
    encoder_json, vocab_bpe = hf_models.small_bpe(tmp_path / "bpe")
    source = str(tmp_path / "gpt2")
    hf_models.gpt2(source, encoder_json, vocab_bpe, far_below_zero=True)
    model = tmp_path / "imported"
    _import(source, str(model / "model.pt"))  # GPT-2's rows are GPT-2 BPE ids: no BPE files needed
    (tmp_path / "test.txt").write_text("\n".join(hf_models.TEXT) + "\n", encoding="utf-8")
    bpe_encode.encode_files(bpe_encode.GPT2BPE(encoder_json, vocab_bpe), [str(tmp_path / "test.txt")],
                            [str(tmp_path / "test.bpe")])
    data = str(tmp_path / "bin")
    fairseq("preprocess", ["--only-source", "--srcdict", str(model / "dict.txt"), "--testpref",
                           str(tmp_path / "test.bpe"), "--destdir", data])
    _, log = fairseq("eval_lm", [data, "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling",
                                 "--path", str(model / "model.pt"), "--gen-subset", "test", "--sample-break-mode",
                                 "none", "--tokens-per-sample", "32", "--batch-size", "4",
                                 "--model-parallel-size", "2"], nproc=2)
    eos = hf_models.source_ids(source, ["<|endoftext|>"])[0][0]

    def to_source(ids):  # GPT-2's ids: fairseq's </s> is its end-of-text, every other row 4 places up
        return torch.where(ids == 2, torch.full_like(ids, eos), (ids - 4).clamp(min=0))  # padding: any row

    bits, count = _transformers_loss(source, _blocks(data, "test", 32, 4), to_source)
    assert count > 200 and f"{count} tokens" in log.replace(",", ""), log[-2000:]
    assert abs(eval_loss(log) - bits) <= 5e-5 + 1e-4 * bits, (eval_loss(log), bits)


def test_fine_tuning_an_imported_opt_starts_from_transformers_loss(tmp_path):
    encoder_json, vocab_bpe = hf_models.small_bpe(tmp_path / "bpe")
    source = str(tmp_path / "opt")
    hf_models.opt(source, encoder_json, vocab_bpe)
    model = tmp_path / "imported"
    _import(source, str(model / "model.pt"), "--encoder-json", encoder_json, "--vocab-bpe", vocab_bpe)
    # one batch per epoch: 4 lines of 31 GPT-2 BPE ids and their </s>, 4 blocks of 32 tokens
    rng = random.Random(0)
    (tmp_path / "train.bpe").write_text("".join(" ".join(str(rng.randrange(300)) for _ in range(31)) + "\n"
                                                for _ in range(4)))
    data = str(tmp_path / "bin")
    fairseq("preprocess", ["--only-source", "--srcdict", str(model / "dict.txt"), "--trainpref",
                           str(tmp_path / "train.bpe"), "--destdir", data])
    _, log = fairseq("train", [data, "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling",
                               "--arch", "transformer_lm_megatron", "--criterion", "vocab_parallel_cross_entropy",
                               "--model-parallel-size", "2", "--finetune-from-model", str(model / "model.pt"),
                               "--sample-break-mode", "none", "--tokens-per-sample", "32", "--batch-size", "4",
                               "--required-batch-size-multiple", "1", "--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0",
                               "--optimizer", "adam", "--lr", "0.001", "--max-update", "20", "--no-save",
                               "--disable-validation", "--log-format", "simple", "--log-interval", "1",
                               "--seed", "1"], nproc=2)
    assert "the model's options from" in log and "--decoder-learned-pos --activation-fn relu" in log, log[-3000:]
    losses = per_update(log, "loss")
    assert len(losses) == 20 and losses[-1] < losses[0] - 1, losses
    bits, count = _transformers_loss(source, _blocks(data, "train", 32, 4), lambda ids: ids)
    assert count == 128
    assert abs(losses[0] - bits) <= 1e-4 * bits, (losses[0], bits)  # the print rounds to 5e-4 of ~10 bits
