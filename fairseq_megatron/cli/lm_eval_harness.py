#!/usr/bin/env python
"""lm-evaluation-harness with the ``fairseq_megatron`` backend: ``fairseq-megatron-lm-eval``.

    fairseq-megatron-lm-eval --tasks my_task --include_path tasks/ --batch_size 8 --output_path results \\
        --model_args path=ckpt/checkpoint_best.pt,encoder_json=encoder.json,vocab_bpe=vocab.bpe
    torchrun --nproc_per_node 4 $(which fairseq-megatron-lm-eval) --tasks my_task --include_path tasks/ \\
        --model_args path=ckpt/checkpoint_best.pt,encoder_json=encoder.json,vocab_bpe=vocab.bpe,model_parallel_size=2

Takes lm-eval's own flags (``lm_eval run --help``: ``--tasks``,
``--num_fewshot``, ``--batch_size``, ``--limit``, ``--output_path``,
``--log_samples``, ``--include_path``, ``--seed``, ...) and runs lm-eval's
command line with ``--model fairseq_megatron``
(:mod:`fairseq_megatron.lm_eval_harness`, whose model arguments the
backend's docstring lists). Bad input (ours, and lm-eval's: an unknown
task) is one ``error:`` line and exit 1; ``FAIRSEQ_MEGATRON_TRACEBACK=1``
shows the traceback.
Needs the ``[eval]`` extra.
"""

import os
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        import lm_eval.__main__  # noqa: F401  (the harness and its command line)
    except ImportError as e:
        print(f"error: fairseq-megatron-lm-eval needs lm-evaluation-harness ({e.name} is missing): "
              f"pip install 'fairseq_megatron[eval]'", file=sys.stderr)
        return 1
    from fairseq_megatron.lm_eval_harness import NAME

    given = [a.split("=", 1)[1] if a.startswith("--model=") else argv[i + 1]
             for i, a in enumerate(argv) if a == "--model" and i + 1 < len(argv) or a.startswith("--model=")]
    if any(model != NAME for model in given):
        print(f"error: --model {given[0]}: this command runs lm-eval with --model {NAME}; for other backends run "
              f"lm_eval itself", file=sys.stderr)
        return 1
    if argv and argv[0] in ("run", "ls", "validate"):
        command, argv = argv[:1], argv[1:]
    else:
        command = ["run"]
    if command == ["run"] and not given and "-h" not in argv and "--help" not in argv:
        argv = ["--model", NAME] + argv
    sys.argv = ["fairseq-megatron-lm-eval"] + command + argv
    try:
        # lm-eval's cli_evaluate, with the model arguments checked before lm-eval indexes its tasks (seconds)
        from lm_eval._cli.harness import HarnessCLI
        from lm_eval.utils import setup_logging

        from fairseq_megatron.lm_eval_harness import FairseqMegatronLM

        setup_logging()
        parser = HarnessCLI()
        args = parser.parse_args()
        if command == ["run"] and getattr(args, "model", None) == NAME:
            FairseqMegatronLM.check_arguments(**(args.model_args or {}), batch_size=getattr(args, "batch_size", 1))
        parser.execute(args)
    except (ValueError, FileNotFoundError) as e:  # ours (UsageError, CheckpointError), and lm-eval's bad input
        if os.environ.get("FAIRSEQ_MEGATRON_TRACEBACK") == "1":
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: lm-eval writes its results only at the end, so nothing was written
        print("error: interrupted; no results written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
