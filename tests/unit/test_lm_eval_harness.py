"""The lm-evaluation-harness backend in one process (size 1): greedy
generation is fairseq-generate's greedy search, the rolling perplexity of
one-line documents is what fairseq-eval-lm's scorer gives the same tokens,
and bad input is one line.

Tolerance: 1e-4 relative on summed log-likelihoods (fp32 log-softmax on
both sides, summed in another order); generated text exactly.
"""

import math
import os
import re

import pytest
import torch

from tests.e2e.common import bpe_encode
from tests.helpers import fairseq
from tests.support import hf_models, lm_eval_requests

import lm_eval  # noqa: E402,F401  (the [test] extra installs it: these tests fail, not skip, without it)

pytestmark = pytest.mark.slow  # seconds each (models built, processes started): left out of make test-fast


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return lm_eval_requests.model(str(tmp_path_factory.mktemp("lm_eval")))


@pytest.fixture(scope="module")
def lm(model):
    from fairseq_megatron.lm_eval_harness import FairseqMegatronLM

    return FairseqMegatronLM(path=model["size1"], encoder_json=model["encoder_json"], vocab_bpe=model["vocab_bpe"],
                             batch_size=4)


def test_generate_until_is_fairseqs_greedy_search(model, lm):
    """fairseq's ``SequenceGenerator`` with beam 1 (fairseq-generate's greedy
    search, through the hub) from ``</s>`` + the prompt, as the backend."""
    from lm_eval.api.instance import Instance

    from fairseq_megatron.hub import from_pretrained

    hub = from_pretrained(model["size1"], cpu=True)
    requests = [Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": 10, "do_sample": False}), i)
                for i, p in enumerate(lm_eval_requests.GENERATE)]
    ours = lm.generate_until(requests, disable_tqdm=True)
    for prompt, text in zip(lm_eval_requests.GENERATE, ours, strict=True):
        ids = lm.tok_encode(prompt)
        hypo = hub.generate([torch.tensor(ids)], beam=1, max_len_b=len(ids) + 10)[0][0]["tokens"].tolist()
        generated = hypo[len(ids):]
        generated = generated[: generated.index(2)] if 2 in generated else generated  # up to </s>
        assert text == lm.tok_decode(generated[:10]) and text, (prompt, text)


def test_rolling_word_perplexity_is_eval_lms_over_the_same_tokens(model, lm, tmp_path):
    """Documents of one line each, binarized as for fairseq-eval-lm
    (bpe_encode.py, fairseq-preprocess with the checkpoint's dict.txt) and
    scored by its ``SequenceScorer`` one line per sample after ``</s>``
    (``--sample-break-mode eos``): each line's log-likelihood without the
    ``</s>`` fairseq predicts at its end (lm-eval's windows predict none) is
    the backend's rolling log-likelihood, and the word perplexity over lm-eval's
    word count is the same."""
    from fairseq import options, tasks
    from fairseq.sequence_scorer import SequenceScorer
    from lm_eval.api.instance import Instance
    from lm_eval.api.task import ConfigurableTask

    # one window each; stripped, as bpe_encode.py strips the lines of a file
    lines = [line for line in dict.fromkeys(hf_models.TEXT) if len(lm.tok_encode(line)) < lm.max_length
             and line == line.strip()]
    assert len(lines) >= 5
    (tmp_path / "test.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    bpe_encode.encode_files(bpe_encode.GPT2BPE(model["encoder_json"], model["vocab_bpe"]),
                            [str(tmp_path / "test.txt")], [str(tmp_path / "test.bpe")])
    data = str(tmp_path / "bin")
    fairseq("preprocess", ["--only-source", "--srcdict", os.path.join(os.path.dirname(model["size1"]), "dict.txt"),
                           "--testpref", str(tmp_path / "test.bpe"), "--destdir", data])
    args = options.parse_args_and_arch(options.get_eval_lm_parser(), [
        data, "--task", "language_modeling", "--sample-break-mode", "eos", "--tokens-per-sample", "64"])
    task = tasks.setup_task(args)
    task.load_dataset("test")
    scorer = SequenceScorer(task.target_dictionary)
    per_line = {}
    with torch.no_grad():
        for batch in task.eval_lm_dataloader(task.dataset("test"), batch_size=4, max_positions=64):
            for sample_id, hypo, target in zip(batch["id"].tolist(), scorer.generate([lm.model.model], batch),
                                               batch["target"]):
                scores, tokens = hypo[0]["positional_scores"], target[target.ne(1)]
                assert tokens[-1].item() == 2 and len(tokens) <= lm.max_length  # one window of the backend
                per_line[sample_id] = scores[:-1].double().sum().item()  # without the final </s>
    ours = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (line,), i)
                                     for i, line in enumerate(lines)], disable_tqdm=True)
    assert sorted(per_line) == list(range(len(lines))), per_line
    theirs = [per_line[i] for i in range(len(lines))]
    for a, b in zip(ours, theirs, strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), (a, b)
    words = sum(ConfigurableTask.count_words(line) for line in lines)
    assert abs(math.exp(-sum(ours) / words) / math.exp(-sum(theirs) / words) - 1) <= 1e-3


def test_bad_input_is_one_line(model, capsys, tmp_path):
    """The command's one line for our refusals, before lm-eval loads its
    tasks, and lm-eval's (one run, which loads them); every model argument's
    refusal, by the constructor lm-eval calls."""
    from fairseq_megatron.cli import lm_eval_harness
    from fairseq_megatron.lm_eval_harness import FairseqMegatronLM

    files = dict(encoder_json=model["encoder_json"], vocab_bpe=model["vocab_bpe"])
    other = tmp_path / "other"  # another corpus's dictionary: the first 100 rows of the model's
    other.mkdir()
    lines = open(os.path.join(os.path.dirname(model["size1"]), "dict.txt")).readlines()
    (other / "dict.txt").write_text("".join(lines[:100]))
    lm_eval_requests.write_tasks(str(tmp_path))

    def refused(*argv):
        assert lm_eval_harness.main(["--include_path", str(tmp_path), *argv]) == 1
        err = capsys.readouterr().err.strip().splitlines()  # lm-eval's log lines, then ours
        errors = [line for line in err if line.startswith("error: ")]
        assert errors == err[-1:] and not any("Traceback" in line for line in err), err
        return err[-1]

    assert "unknown model argument pretrained" in refused(
        "--tasks", "local_mc", "--model_args", f"pretrained=x,path={model['size1']}")
    # the model's arguments are checked before lm-eval indexes its tasks (seconds); then lm-eval's own refusal
    assert "model argument encoder_json=... is needed" in refused("--tasks", "no_such_task", "--model_args", "path=x")
    valid = f"path={model['size1']},encoder_json={model['encoder_json']},vocab_bpe={model['vocab_bpe']}"
    assert "Tasks not found: no_such_task" in refused("--tasks", "no_such_task", "--model_args", valid)
    assert "--model hf" in refused("--model", "hf", "--tasks", "local_mc")
    for args, said in (
            (dict(path="/nowhere/model.pt", **files), "/nowhere/model.pt"),
            (dict(path=model["size1"], encoder_json="/no.json", vocab_bpe="/no.bpe"), "encoder_json: /no.json: no such"),
            (dict(path=model["size1"], encoder_json=model["encoder_json"]), "model argument vocab_bpe=... is needed"),
            (dict(path=model["size1"], context_parallel_size=2, **files), "evaluation runs at context-parallel size 1"),
            (dict(path=model["size1"], batch_size="auto", **files), "sets no batch size automatically"),
            (dict(path=model["size1"], dtype="float64", **files), "dtype=float64: one of"),
            (dict(path=model["size1"], model_parallel_size=2, **files), "needs 2 processes, one per model part"),
            (dict(path=model["size1"], data=str(other), **files),
             f"the dictionary {other / 'dict.txt'} lacks "),
    ):
        with pytest.raises((ValueError, FileNotFoundError), match=re.escape(said)):
            FairseqMegatronLM(**args)


def test_a_task_that_samples_is_one_line(lm):
    from lm_eval.api.instance import Instance

    from fairseq_megatron.errors import UsageError

    with pytest.raises(UsageError, match="generates greedily; this task asks for sampling"):
        lm.generate_until([Instance("generate_until", {}, ("Hello", {"do_sample": True, "temperature": 0.7}), 0)])


def test_ctrl_c_is_one_line_and_exit_130(model, capsys, tmp_path, monkeypatch):
    """Ctrl-C during the evaluation (here: raised where lm-eval runs it) is
    one line, exit status 130, nothing written (it printed a traceback)."""
    from lm_eval._cli.harness import HarnessCLI

    from fairseq_megatron.cli import lm_eval_harness

    def interrupted(self, args):
        raise KeyboardInterrupt

    monkeypatch.setattr(HarnessCLI, "execute", interrupted)
    args = f"path={model['size1']},encoder_json={model['encoder_json']},vocab_bpe={model['vocab_bpe']}"
    out = tmp_path / "results"
    assert lm_eval_harness.main(["--tasks", "local_mc", "--model_args", args, "--output_path", str(out)]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: interrupted; no results written"
    assert not out.exists()
