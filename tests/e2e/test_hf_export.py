"""``fairseq-megatron-reshard --to-hf`` on a model trained at model-parallel
size 2 with a GPT-2 BPE (the ``small_megatron`` fixture), against fairseq's
own tools on the same checkpoint: the exported tokenizer gives the ids
fairseq-preprocess wrote, transformers' perplexity on the test split's
blocks is fairseq-eval-lm's, and greedy ``generate()`` continues each
prompt as fairseq-generate does. The Python snippets of README.md and
docs/checkpoints.md load the export in a fresh interpreter of this
environment, as a user's program does.

Tolerance: fairseq-eval-lm prints its loss with 4 decimals (base 2); the
transformers loss over the same blocks, summed in another order in fp32,
is held to that print's rounding plus 1e-4.
"""

import json
import math
import os
import re
import subprocess
import sys

import torch
from fairseq import options, tasks
from fairseq.data import Dictionary, data_utils

from fairseq_megatron import USER_DIR
from fairseq_megatron.checkpoint.hf_export import require_transformers
from tests.e2e.common import REPO, eval_loss, hypotheses
from tests.helpers import ENV, fairseq


def _export(small_megatron, gpt2_files, out):
    encoder_json, vocab_bpe, _ = gpt2_files
    folder = small_megatron["folder"]
    proc = subprocess.run([sys.executable, "-m", "fairseq_megatron.cli.reshard_checkpoint", "--input",
                           str(folder / "model.pt"), "--output", str(out), "--to-hf", "--dict",
                           str(folder / "dict.txt"), "--encoder-json", encoder_json, "--vocab-bpe", vocab_bpe],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(out)


def _test_blocks(data, tokens_per_sample):
    """The test split's batches as fairseq-eval-lm makes them (no context window)."""
    parser = options.get_eval_lm_parser()
    args = options.parse_args_and_arch(parser, [data, "--task", "language_modeling", "--tokens-per-sample",
                                                str(tokens_per_sample), "--sample-break-mode", "none"])
    task = tasks.setup_task(args)
    task.load_dataset("test")
    iterator = task.eval_lm_dataloader(task.dataset("test"), batch_size=4, max_positions=tokens_per_sample)
    return list(iterator)


def _python_block(document: str, containing: str) -> str:
    """The first ```python block of ``document`` (a path under the repository) that contains ``containing``."""
    with open(os.path.join(REPO, document), encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    return next(block for block in blocks if containing in block)


def test_the_documented_snippets_load_the_export_in_a_fresh_process(small_megatron, gpt2_files, tmp_path):
    """README.md's and docs/checkpoints.md's transformers snippets, run as
    they are in a fresh interpreter of this environment, on exports under
    the names they use. transformers imports torchaudio whenever it is
    installed, and the one fairseq pulled in could not load beside this
    torch: ``from_pretrained`` failed in every fresh process, while the
    export tool, which had hidden torchaudio inside its own, exited 0."""
    _export(small_megatron, gpt2_files, tmp_path / "megatron_11b_hf")
    os.symlink("megatron_11b_hf", tmp_path / "hf_model")
    snippets = [_python_block("README.md", "from_pretrained"), _python_block("docs/checkpoints.md", "from_pretrained")]
    program = "\n".join(snippets) + "\nprint('loaded', type(model).__name__, tokenizer('The')['input_ids'][0])\n"
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=ENV, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "loaded XGLMForCausalLM 2", proc.stdout[-3000:]


def test_the_export_scores_tokenizes_and_generates_as_fairseq(small_megatron, gpt2_files, tmp_path):
    transformers = require_transformers()
    out = tmp_path / "hf"
    _export(small_megatron, gpt2_files, out)
    assert json.load(open(out / "config.json"))["architectures"] == ["XGLMForCausalLM"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    model.eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    dictionary = Dictionary.load(str(small_megatron["folder"] / "dict.txt"))
    assert model.config.vocab_size == len(dictionary) and model.config.tie_word_embeddings

    # the tokenizer: the ids fairseq-preprocess wrote for the test split, line by line, after </s>
    test = data_utils.load_indexed_dataset(os.path.join(small_megatron["data"], "test"), dictionary)
    lines = [line for line in small_megatron["test_lines"] if line.strip()]
    assert len(test) == len(lines) >= 20
    for k, line in enumerate(lines):
        binarized = test[k].tolist()  # ids + </s>
        assert tokenizer(line.strip())["input_ids"] == [2] + binarized[:-1], line

    # perplexity: fairseq-eval-lm at model-parallel size 2 against transformers on the same blocks
    path = str(small_megatron["folder"] / "model.pt")
    _, log = fairseq("eval_lm", [small_megatron["data"], "--user-dir", USER_DIR, "--cpu", "--task",
                                 "language_modeling", "--path", path, "--gen-subset", "test", "--sample-break-mode",
                                 "none", "--tokens-per-sample", "32", "--batch-size", "4",
                                 "--model-parallel-size", "2"], nproc=2)
    nll, count = 0.0, 0
    with torch.no_grad():
        for batch in _test_blocks(small_megatron["data"], 32):
            src, target = batch["net_input"]["src_tokens"], batch["target"]
            logprobs = torch.log_softmax(model(input_ids=src, attention_mask=(src != 1).long()).logits.double(), -1)
            picked = logprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
            keep = target != 1
            nll -= picked[keep].sum().item()
            count += int(keep.sum())
    assert count == int(test.sizes.sum())
    assert abs(nll / count / math.log(2) - eval_loss(log)) <= 5e-5 + 1e-4, (nll / count / math.log(2), log[-500:])

    # greedy generation: fairseq-generate at size 2 continues the first 4 tokens of each test line
    _, log = fairseq("generate", [small_megatron["data"], "--user-dir", USER_DIR, "--cpu", "--task",
                                  "language_modeling", "--path", path, "--gen-subset", "test", "--sample-break-mode",
                                  "eos", "--tokens-per-sample", "64", "--prefix-size", "4", "--max-len-b", "24",
                                  "--batch-size", "4", "--beam", "1", "--model-parallel-size", "2",
                                  "--skip-invalid-size-inputs-valid-test"], nproc=2)
    generated = hypotheses(log)
    assert len(generated) >= 10, log[-3000:]
    for sample_id, text in generated.items():
        theirs = [dictionary.index(symbol) for symbol in text.split()]
        prompt = [2] + test[int(sample_id[2:])].tolist()[:4]
        assert theirs[:4] == prompt[1:]
        with torch.no_grad():
            ours = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=len(theirs) - 3,
                                  do_sample=False)[0, 1:].tolist()
        # fairseq stops at </s> or after --max-len-b 24 tokens, the prompt's 4 included;
        # transformers generates one more
        assert ours[: len(theirs)] == theirs and (len(theirs) == 24 or ours[len(theirs)] == 2), (theirs, ours)
