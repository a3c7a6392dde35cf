#!/usr/bin/env python
"""Time of one lm-evaluation-harness run on CPU: the ``fairseq_megatron`` backend on our checkpoint
against lm-eval's ``hf`` backend on its ``--to-hf`` export, the same tasks, one process each.

    python scripts/benchmark_lm_eval.py --work-dir /tmp/lm_eval_bench [--layers 6 --hidden 512 --docs 200]

Builds, from the docstrings of Python's standard library (nothing is
downloaded): a byte-level BPE in GPT-2's file format, a random
``XGLMForCausalLM`` of the given shape over it (fairseq's dense models as
transformers publishes them), our checkpoint of it (``--from-hf``) and its
export (``--to-hf``), and two local tasks (a rolling perplexity over
``--docs`` lines and a multiple choice over as many questions). Then runs
``fairseq-megatron-lm-eval`` and ``lm_eval --model hf`` (``add_bos_token=False``,
``--device cpu``) on them in child processes, each ``--repeats`` times,
alternating, and prints the wall times (start-up included) and the scores,
which must agree.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_corpus  # noqa: E402  isort:skip

TASKS = {
    "bench_rolling": ("loglikelihood_rolling", 'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
                      "metric_list:\n  - metric: word_perplexity\n"),
    "bench_mc": ("multiple_choice", 'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
                 'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'),
}


def build(work: str, layers: int, hidden: int, docs: int, vocab: int) -> dict:
    """The BPE files, the XGLM directory, our checkpoint, its export and the tasks, under ``work``."""
    import torch
    import transformers
    from tokenizers import ByteLevelBPETokenizer, Tokenizer, decoders, models, pre_tokenizers

    root = make_corpus.sysconfig.get_paths()["stdlib"]
    text = make_corpus.build_corpus(make_corpus.stdlib_files(root), root, max_bytes=2_000_000)
    lines = [line for line in text["train"] if 40 < len(line) < 400]
    bpe_dir = os.path.join(work, "bpe")
    os.makedirs(bpe_dir, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(lines, vocab_size=vocab, min_frequency=2, show_progress=False)
    bpe.save_model(bpe_dir)
    encoder_json, vocab_bpe = os.path.join(bpe_dir, "vocab.json"), os.path.join(bpe_dir, "merges.txt")
    pieces = list(json.load(open(encoder_json)))
    ids = {s: i for i, s in enumerate(["<s>", "<pad>", "</s>", "<unk>"] + pieces)}  # a fairseq dictionary's order
    merges = [tuple(m.split()) for m in open(vocab_bpe, encoding="utf-8").read().split("\n")[1:] if m.strip()]
    tokenizer = Tokenizer(models.BPE(vocab=ids, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    source = os.path.join(work, "xglm")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                         pad_token="<pad>", unk_token="<unk>").save_pretrained(source)
    torch.manual_seed(0)
    config = transformers.XGLMConfig(num_layers=layers, d_model=hidden, ffn_dim=4 * hidden, attention_heads=8,
                                     max_position_embeddings=512, vocab_size=len(ids))  # the export keeps as many
    transformers.XGLMForCausalLM(config).save_pretrained(source)
    ours = os.path.join(work, "ours", "model.pt")
    tool = [sys.executable, "-m", "fairseq_megatron.cli.reshard_checkpoint"]
    subprocess.run([*tool, "--from-hf", source, "--output", ours, "--model-parallel-size", "1", "--encoder-json",
                    encoder_json, "--vocab-bpe", vocab_bpe], check=True, capture_output=True)
    export = os.path.join(work, "export")
    subprocess.run([*tool, "--input", ours, "--output", export, "--to-hf", "--dict",
                    os.path.join(os.path.dirname(ours), "dict.txt"), "--encoder-json", encoder_json,
                    "--vocab-bpe", vocab_bpe], check=True, capture_output=True)
    tasks = os.path.join(work, "tasks")
    os.makedirs(tasks, exist_ok=True)
    rng = random.Random(0)
    rows = {"bench_rolling": [{"text": line} for line in lines[:docs]],
            "bench_mc": [{"question": " ".join(line.split()[:8]), "choices": [" " + w for w in line.split()[8:12]],
                          "answer": rng.randrange(4)} for line in lines[docs: 2 * docs] if len(line.split()) > 12]}
    for task, (kind, body) in TASKS.items():
        data = os.path.join(tasks, f"{task}.jsonl")
        with open(data, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows[task])
        with open(os.path.join(tasks, f"{task}.yaml"), "w") as f:
            f.write(f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                    f"test_split: test\noutput_type: {kind}\n{body}")
    return {"encoder_json": encoder_json, "vocab_bpe": vocab_bpe, "ours": ours, "export": export, "tasks": tasks}


def run(command, out: str):
    """Wall seconds of ``command`` and the scores it wrote under ``out``."""
    start = time.time()
    subprocess.run(command, check=True, capture_output=True, env=dict(os.environ, HF_DATASETS_OFFLINE="1",
                                                                      HF_HUB_OFFLINE="1"))
    seconds = time.time() - start
    found = [os.path.join(d, f) for d, _, files in os.walk(out) for f in files if f.startswith("results_")]
    results = json.load(open(max(found, key=os.path.getmtime)))["results"]
    return seconds, {t: {k: v for k, v in m.items() if "stderr" not in k and isinstance(v, float)}
                     for t, m in results.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--docs", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    built = build(args.work_dir, args.layers, args.hidden, args.docs, args.vocab)
    common = ["--tasks", ",".join(TASKS), "--include_path", built["tasks"], "--batch_size", str(args.batch_size)]
    commands = {
        "fairseq_megatron": [sys.executable, "-m", "fairseq_megatron.cli.lm_eval_harness", *common, "--model_args",
                             f"path={built['ours']},encoder_json={built['encoder_json']},"
                             f"vocab_bpe={built['vocab_bpe']}"],
        "hf (export)": [sys.executable, "-m", "lm_eval", "--model", "hf", *common, "--device", "cpu",
                        "--model_args", f"pretrained={built['export']},add_bos_token=False"],
    }
    times = {name: [] for name in commands}
    scores = {}
    for _ in range(args.repeats):
        for name, command in commands.items():
            out = os.path.join(args.work_dir, "results", name.split()[0])
            seconds, scores[name] = run([*command, "--output_path", out], out)
            times[name].append(seconds)
            print(f"{name}: {seconds:.1f} s", flush=True)
    print(f"\n{args.layers} x {args.hidden}, {args.docs} rolling documents and multiple-choice questions, "
          f"batch size {args.batch_size}, {args.repeats} runs each (wall time, start-up included):")
    for name in commands:
        print(f"{name:>18}: {min(times[name]):.1f} s best, {sum(times[name]) / len(times[name]):.1f} s mean; "
              f"{json.dumps(scores[name], sort_keys=True)}")


if __name__ == "__main__":
    main()
