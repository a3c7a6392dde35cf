"""A checkpoint laid out as fairseq's April-2020 code wrote the published
Megatron-11b: 8 part files in torch's pre-1.6 format, fp16 weights, an
argparse ``args`` with that era's fields and none of this package's, no
``output_projection.weight`` (tied to the embedding), and in each part its
own value of the uninitialised buffer ``decoder.embed_positions._float_tensor``
(NaN in some). A tiny model with 8 heads, so that 8 parts divide it, on the
trained fixture's data and dictionary (its weights are drawn, not trained:
the tools only have to agree with each other)."""

import math
import os
import subprocess
import sys
from argparse import Namespace

import torch
from fairseq.data import Dictionary

from fairseq_megatron import USER_DIR
from fairseq_megatron.checkpoint.export import export_to_fairseq
from fairseq_megatron.checkpoint.layout import split_model_state
from tests.support.partition import expected_partition_dims
from fairseq_megatron.cli import reshard_checkpoint
from fairseq_megatron.models.model_parallel_transformer_lm import ModelParallelTransformerLanguageModel
from tests.e2e.common import HUB_SCRIPT, eval_args, eval_loss, evaluated_tokens, hypotheses, train_args
from tests.helpers import ENV, LMTask, fairseq, model_args

DIMS = {"decoder_layers": 2, "decoder_embed_dim": 64, "decoder_ffn_embed_dim": 256, "decoder_attention_heads": 8}
# what fairseq's hub needs of an export: stock fairseq only, no plugin
STOCK_HUB = r"""
import sys
from fairseq.models.transformer_lm import TransformerLanguageModel
assert "fairseq_megatron" not in sys.modules
lm = TransformerLanguageModel.from_pretrained(sys.argv[1], "model.pt", data_name_or_path=sys.argv[2])
print(type(lm.models[0]).__name__, lm.cfg.task._name)
"""


def _release_2020(data, folder):
    """Write the 8 parts under ``folder/model.pt``; returns that path."""
    dictionary = Dictionary.load(os.path.join(data, "dict.txt"))
    padded = math.ceil(len(dictionary) / 64) * 64  # 8 parts of a multiple of 8 rows, as size 8 pads
    torch.manual_seed(11)
    model = ModelParallelTransformerLanguageModel.build_model(
        model_args(1, **DIMS, tokens_per_sample=32, max_target_positions=32, padded_vocab_size=padded),
        LMTask(dictionary))
    full = {k: v for k, v in model.state_dict().items() if k != "decoder.output_projection.weight"}
    args = Namespace(  # fairseq's training args of 2020, as the release's parts hold them
        arch="transformer_lm_megatron_11b", task="language_modeling", criterion="vocab_parallel_cross_entropy",
        optimizer="adam", lr=[0.00015], data=data, sample_break_mode="none", tokens_per_sample=32,
        max_target_positions=32, output_dictionary_size=-1, self_target=False, future_target=False,
        past_target=False, add_bos_token=False, model_parallel_size=8, distributed_world_size=8, fp16=True,
        seed=1, dropout=0.1, attention_dropout=0.1, activation_fn="gelu", share_decoder_input_output_embed=True,
        decoder_normalize_before=True, decoder_learned_pos=False, no_token_positional_embeddings=False,
        decoder_input_dim=64, decoder_output_dim=64, **DIMS)
    os.makedirs(folder)
    for rank, part in enumerate(split_model_state(full, 8, expected_partition_dims(full))):
        part = {k: v.half() if v.is_floating_point() and not k.endswith(".version") else v for k, v in part.items()}
        part["decoder.embed_positions._float_tensor"] = torch.tensor([(0.0, float("nan"), -3.5e38)[rank % 3]])
        state = {"args": args, "model": part, "optimizer_history": [
            {"criterion_name": "VocabParallelCrossEntropyCriterion", "optimizer_name": "FP16Optimizer",
             "lr_scheduler_state": {"best": None}, "num_updates": 1000}], "extra_state": {"epoch": 1}}
        torch.save(state, os.path.join(folder, f"model-model_part-{rank}.pt"), _use_new_zipfile_serialization=False)
    return os.path.join(folder, "model.pt")


def test_the_2020_layout_loads_at_every_size_in_every_tool(trained, tmp_path, capsys):
    """fairseq-eval-lm at sizes 1, 2 and 8 (the parts joined or split in
    memory) give the same loss, and so do the resharding tool's 2 parts at
    size 2 and its ``--to-fairseq`` export in stock fairseq without the
    plugin (whose hub loads it: the export carries a task config);
    fairseq-generate at sizes 1 and 2 gives the same greedy hypotheses;
    this package's hub generates from it; fine-tuning starts from it at
    size 2. Tolerance: eval-lm prints 4
    decimals, and fp32 sums in another order across parts differ by ~1e-6."""
    data = trained["data"]
    path = _release_2020(data, str(tmp_path / "megatron_2020"))

    losses = {}
    for size in (1, 2, 8):
        _, out = fairseq("eval_lm", eval_args(data, path, size), nproc=size if size > 1 else None, timeout=240)
        joined = f"8 model part(s), loaded at model-parallel size {size}"  # at size 8 each rank reads its part
        assert (joined in out) == (size != 8), out[-3000:]
        losses[size] = (eval_loss(out), evaluated_tokens(out))

    resharded = str(tmp_path / "mp2" / "model.pt")
    assert reshard_checkpoint.main(["--input", path, "--output", resharded, "--model-parallel-size", "2"]) == 0
    _, out = fairseq("eval_lm", eval_args(data, resharded, 2), nproc=2)
    losses["resharded"] = (eval_loss(out), evaluated_tokens(out))

    exported = str(tmp_path / "plain" / "model.pt")
    export_to_fairseq(path, exported)
    stock_args = [a for a in eval_args(data, exported, 1) if a not in (USER_DIR, "--user-dir")]
    _, out = fairseq("eval_lm", stock_args)
    assert "fairseq_megatron" not in out
    losses["stock"] = (eval_loss(out), evaluated_tokens(out))
    hub = subprocess.run([sys.executable, "-c", STOCK_HUB, os.path.dirname(exported), data], capture_output=True,
                         text=True, env=ENV, timeout=300)
    assert hub.returncode == 0 and hub.stdout.split() == ["TransformerLanguageModel", "language_modeling"], (
        hub.stdout + hub.stderr)[-3000:]

    reference, tokens = losses[1]
    for where, (loss, count) in losses.items():
        assert count == tokens and abs(loss - reference) <= 2e-4, (where, losses)

    generate = [data, "--user-dir", USER_DIR, "--cpu", "--task", "language_modeling", "--path", path,
                "--gen-subset", "test", "--sample-break-mode", "none", "--tokens-per-sample", "32",
                "--prefix-size", "2", "--max-len-b", "6", "--batch-size", "8", "--beam", "1"]
    _, one = fairseq("generate", generate + ["--model-parallel-size", "1"])
    _, two = fairseq("generate", generate + ["--model-parallel-size", "2"], nproc=2)
    assert len(hypotheses(one)) >= 10 and hypotheses(one) == hypotheses(two)

    hub_out = tmp_path / "hub"
    hub_out.mkdir()
    run = subprocess.run([sys.executable, "-c", HUB_SCRIPT, path, data, str(hub_out), "1"], capture_output=True,
                         text=True, env=ENV, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (hub_out / "rank0.txt").read_text().startswith("size=1 greedy: return the"), run.stderr[-3000:]

    _, log = fairseq("train", train_args(data, str(tmp_path / "finetuned"), max_update=1) + [
        "--finetune-from-model", path, "--decoder-attention-heads", "8", "--decoder-ffn-embed-dim", "256"], nproc=2)
    assert "8 model part(s), loaded at model-parallel size 2" in log and "num_updates" in log, log[-3000:]
