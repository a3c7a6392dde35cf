"""What the tests of the lm-evaluation-harness backend share: a model with
GPT-2 BPE files, one fixed list of requests of each kind, local tasks
(YAML over JSON lines, nothing downloaded), and the backend's answers."""

import json
import os

from tests.support import hf_models
from tests.support.bpe_text import VARIED

LOGLIKELIHOOD = [
    ("The capital of France is", " Paris"), ("The capital of France is", " Rome"),
    ("Language models assign", " probabilities to sequences"), ("", "Hello world!"),
    ("fairseq trains transformer language models;", " Megatron splits their layers"),
    ("numbers 12,345.67 and", " 3.14159"), ("   leading spaces, tabs ", "and (brackets)"),
] + [(VARIED[0] * 4, " the end")]  # longer than the model's positions: cut from the left
ROLLING = VARIED + [" ".join(hf_models.TEXT)]  # the last one takes several windows
GENERATE = ["The capital of France", "Language models", "fairseq trains transformer", "Hello world",
            "The capital of Italy"]
GEN_KWARGS = {"until": ["."], "max_gen_toks": 8, "do_sample": False}


def model(root):
    """A GPT-2 (logits far below 0) imported at size 1 and at T2 x P2, and its BPE files:
    ``{"encoder_json", "vocab_bpe", "size1", "t2p2"}``."""
    from fairseq_megatron.checkpoint.hf_import import import_from_transformers

    encoder_json, vocab_bpe = hf_models.small_bpe(os.path.join(root, "bpe"))
    hf_models.gpt2(os.path.join(root, "gpt2"), encoder_json, vocab_bpe, far_below_zero=True)
    out = {"encoder_json": encoder_json, "vocab_bpe": vocab_bpe}
    for name, tensor, stages in (("size1", 1, 1), ("t2p2", 2, 2)):
        out[name] = os.path.join(root, name, "model.pt")
        import_from_transformers(os.path.join(root, "gpt2"), out[name], tensor, stages)
    return out


def requests():
    """lm-eval's ``Instance`` of each request of the fixed lists, by request type."""
    from lm_eval.api.instance import Instance

    return {
        "loglikelihood": [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(LOGLIKELIHOOD)],
        "loglikelihood_rolling": [Instance("loglikelihood_rolling", {}, (s,), i) for i, s in enumerate(ROLLING)],
        "generate_until": [Instance("generate_until", {}, (p, dict(GEN_KWARGS)), i) for i, p in enumerate(GENERATE)],
    }


def answers(lm) -> dict:
    """The backend's answers to :func:`requests`."""
    return {kind: getattr(lm, kind)(reqs, disable_tqdm=True) for kind, reqs in requests().items()}


def write_tasks(directory: str) -> None:
    """Local tasks: ``local_mc`` (multiple choice), ``local_rolling``
    (Wikitext-style rolling perplexity, one line per document) and
    ``local_generate`` (greedy generation until a period)."""
    os.makedirs(directory, exist_ok=True)
    docs = {
        "mc": [{"question": q, "choices": [" Paris", " Rome", " probabilities"], "answer": a}
               for q, a in (("The capital of France is", 0), ("The capital of Italy is", 1),
                            ("Language models assign", 2))],
        "rolling": [{"text": line} for line in hf_models.TEXT[:6]],
        "generate": [{"prompt": p, "answer": " Paris."} for p in GENERATE],
    }
    for name, rows in docs.items():
        with open(os.path.join(directory, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    common = f"dataset_path: json\ntest_split: test\n"
    tasks = {
        "local_mc": "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
                    "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n",
        "local_rolling": "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
                         "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n",
        "local_generate": "output_type: generate_until\ndoc_to_text: \"{{prompt}}\"\ndoc_to_target: \"{{answer}}\"\n"
                          "generation_kwargs:\n  until: [\".\"]\n  max_gen_toks: 8\n  do_sample: false\n"
                          "metric_list:\n  - metric: exact_match\n",
    }
    for task, body in tasks.items():
        data = os.path.join(directory, task.split("_", 1)[1] + ".jsonl")
        with open(os.path.join(directory, f"{task}.yaml"), "w") as f:
            f.write(f"task: {task}\n{common}dataset_kwargs:\n  data_files:\n    test: {data}\n{body}")
