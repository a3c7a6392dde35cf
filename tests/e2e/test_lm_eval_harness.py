"""The lm-evaluation-harness backend as users run it, on local tasks
(``--include_path``, JSON lines; nothing downloaded):

- ``fairseq-megatron-lm-eval`` under torchrun at 2 ranks (2 model copies,
  lm-eval splitting the documents over them; the model-parallel layouts are
  tests/distributed/test_lm_eval_harness.py's) gives the scores of the
  backend in one process, and one process writes the results, in lm-eval's
  layout;
- every request of a multiple-choice and a rolling-perplexity task gets the
  log-likelihood lm-eval's ``hf`` backend gives the ``--to-hf`` export of the
  same checkpoint (``add_bos_token=False``: the export's tokenizer would put
  ``</s>`` before every context; this backend's contexts start as the ``hf``
  backend's of GPT-2, and ``</s>`` prefixes an empty context and the first
  rolling window in both).

Tolerances: task scores to 4 decimals (lm-eval's table), relative above 1;
log-likelihoods 1e-4 relative (fp32 on both sides, summed in another order).
"""

import glob
import json
import os

import pytest

from fairseq_megatron import USER_DIR  # noqa: F401  (the package, imported as the tools import it)
from tests.helpers import fairseq
from tests.support import hf_models, lm_eval_requests

import lm_eval  # noqa: E402,F401  (the [test] extra installs it: these tests fail, not skip, without it)
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
TASKS = ["local_mc", "local_rolling", "local_generate"]


def _in_process(lm, tasks_dir):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=lm, tasks=TASKS, task_manager=TaskManager(include_defaults=False,
                                                                          include_path=tasks_dir))["results"]


def test_the_command_under_torchrun_scores_as_one_process(tmp_path, monkeypatch):
    from fairseq_megatron.lm_eval_harness import FairseqMegatronLM

    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    model = lm_eval_requests.model(str(tmp_path / "model"))
    tasks = str(tmp_path / "tasks")
    lm_eval_requests.write_tasks(tasks)
    args = f"path={model['size1']},encoder_json={model['encoder_json']},vocab_bpe={model['vocab_bpe']}"
    expected = _in_process(FairseqMegatronLM(path=model["size1"], encoder_json=model["encoder_json"],
                                             vocab_bpe=model["vocab_bpe"]), tasks)
    out = tmp_path / "results"
    _, log = fairseq("fairseq_megatron.cli.lm_eval_harness", [
        "--tasks", ",".join(TASKS), "--include_path", tasks, "--batch_size", "4", "--output_path", str(out),
        "--model_args", args], nproc=2)
    written = glob.glob(str(out / "*" / "results_*.json"))
    assert len(written) == 1 and log.count("|local_mc") == 1, (written, log[-3000:])  # one writer, one table
    results = json.load(open(written[0]))["results"]
    for task, metrics in expected.items():
        for name, value in metrics.items():
            if isinstance(value, float) and "stderr" not in name:
                found = results[task][name]  # 4 decimals, relative for the perplexities of a random model (~1e16)
                assert abs(found - value) <= 1e-4 * max(1.0, abs(value)), (task, name, found, value)
    assert expected["local_mc"]["acc,none"] >= 0 and "word_perplexity,none" in expected["local_rolling"]


def test_log_likelihoods_equal_the_hf_backend_on_the_export(tmp_path, monkeypatch):
    from fairseq.data import Dictionary
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager, get_task_dict

    from fairseq_megatron.checkpoint.hf_export import export_to_transformers
    from fairseq_megatron.checkpoint.hf_import import import_from_transformers
    from fairseq_megatron.lm_eval_harness import FairseqMegatronLM

    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    encoder_json, vocab_bpe = hf_models.small_bpe(str(tmp_path / "bpe"))
    hf_models.xglm(str(tmp_path / "xglm"), encoder_json, vocab_bpe)  # fairseq's dense models as published
    ours = str(tmp_path / "ours" / "model.pt")
    import_from_transformers(str(tmp_path / "xglm"), ours, 2, 1, encoder_json, vocab_bpe)
    export = str(tmp_path / "export")
    dictionary = Dictionary.load(os.path.join(os.path.dirname(ours), "dict.txt"))
    export_to_transformers(ours, export, dictionary, encoder_json, vocab_bpe)
    tasks = str(tmp_path / "tasks")
    lm_eval_requests.write_tasks(tasks)
    requests = {}
    for task in get_task_dict(["local_mc", "local_rolling"], TaskManager(include_defaults=False,
                                                                        include_path=tasks)).values():
        task.build_all_requests()
        for instance in task.instances:
            requests.setdefault(instance.request_type, []).append(instance)
    assert len(requests["loglikelihood"]) == 9 and len(requests["loglikelihood_rolling"]) == 6
    backends = [FairseqMegatronLM(path=ours, encoder_json=encoder_json, vocab_bpe=vocab_bpe, batch_size=4),
                HFLM(pretrained=export, batch_size=4, add_bos_token=False, device="cpu")]
    mine, theirs = ({kind: getattr(lm, kind)(reqs) for kind, reqs in requests.items()} for lm in backends)
    for (a, greedy_a), (b, greedy_b) in zip(mine["loglikelihood"], theirs["loglikelihood"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(b) and greedy_a == greedy_b, (a, b)
    for a, b in zip(mine["loglikelihood_rolling"], theirs["loglikelihood_rolling"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), (a, b)
