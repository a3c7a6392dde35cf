#!/usr/bin/env python
"""Change the model-parallel size of a checkpoint, or export it to plain fairseq or to transformers.

    fairseq-megatron-reshard --input megatron_11b/model.pt --output mp1/model.pt --model-parallel-size 1
    fairseq-megatron-reshard --input ckpt/checkpoint_best.pt --output plain/model.pt \\
        --to-fairseq --dict data-bin/dict.txt
    fairseq-megatron-reshard --input ckpt/checkpoint_best.pt --output hf_model --to-hf \\
        --dict data-bin/dict.txt --encoder-json encoder.json --vocab-bpe vocab.bpe
    fairseq-megatron-reshard --from-hf opt-125m --output opt_mp2/model.pt --model-parallel-size 2 \\
        --encoder-json encoder.json --vocab-bpe vocab.bpe

``--input`` is what you would pass to fairseq as ``--path``: the part files
``<name>-model_part-K.pt`` (or, of a pipelined checkpoint,
``<name>-model_part-K-stage-S.pt``) are found next to it. For size 1 the
output is one file, otherwise ``<output>-model_part-K.pt``; with
``--pipeline-model-parallel-size P`` > 1, ``<output>-model_part-K-stage-S.pt``. The model weights are kept, and
with ``--keep-optimizer`` the optimizer state too, so that training resumes
at the new size with ``--restore-file <output>``; without it, resume with
``--reset-optimizer``. The EMA weights of ``fairseq-train --store-ema`` are
resharded with the weights. Checkpoint files are read without running code
(torch's weights-only unpickler).

``--from-hf DIR`` imports a transformers checkpoint directory (GPT-2, OPT,
XGLM) instead of ``--input``: our parts at ``--model-parallel-size`` and
``--pipeline-model-parallel-size``, with ``dict.txt`` beside them
(:mod:`fairseq_megatron.checkpoint.hf_import`).
"""

import argparse
import os
import sys
from typing import Optional

from tqdm import tqdm

from fairseq_megatron.checkpoint.export import export_to_fairseq
from fairseq_megatron.checkpoint.hf_export import (
    DTYPES,
    MAX_SHARD_BYTES,
    check_output_directory,
    export_to_transformers,
    require_transformers,
)
from fairseq_megatron.checkpoint.resharding import (
    PartFiles,
    config_value,
    layer_groups,
    model_config,
    reshard,
)
from fairseq_megatron.errors import UsageError
from fairseq_megatron.models.options import check_dictionary_size


def read_dictionary(parts: PartFiles, dict_path: Optional[str], accept_other: bool = False):
    """fairseq's ``Dictionary`` of ``--dict dict_path`` (None without it),
    refused if other than the dictionary the checkpoint records.

    Raises:
        UsageError: ``dict_path`` is not a fairseq dict.txt, or not the
            checkpoint's dictionary.
        FileNotFoundError: ``dict_path`` does not exist.
    """
    from fairseq.data import Dictionary

    if dict_path is None:
        return None
    try:
        dictionary = Dictionary.load(dict_path)
    except OSError:
        raise
    except Exception as e:  # a line not "<token> <count>" (ValueError) or not UTF-8 (a bare Exception)
        raise UsageError(f"--dict {dict_path} is not a fairseq dict.txt: {e}") from None
    config = model_config(parts.metadata)
    check_dictionary_size(dictionary.symbols, len(dictionary), config_value(config, "dictionary_size"), parts.path,
                          config_value(config, "dictionary_checksum"), accept_other)
    return dictionary


def export_vocabulary_size(parts: PartFiles, dict_path: Optional[str], accept_other: bool = False) -> Optional[int]:
    """The vocabulary rows to export for ``--dict dict_path``: its symbols
    (fairseq's four special ones plus one per line); without ``--dict`` the
    size the checkpoint records (None, all rows, for checkpoints from before
    the record).

    Raises:
        UsageError / FileNotFoundError: as :func:`read_dictionary`.
    """
    dictionary = read_dictionary(parts, dict_path, accept_other)
    if dictionary is None:
        return config_value(model_config(parts.metadata), "dictionary_size")
    return len(dictionary)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", help="checkpoint path as given to fairseq --path")
    source.add_argument("--from-hf", metavar="DIR",
                        help="import a transformers checkpoint directory (GPT2LMHeadModel, OPTForCausalLM, "
                             "XGLMForCausalLM: config.json and safetensors or pytorch_model.bin) as our checkpoint "
                             "at --model-parallel-size (and --pipeline-model-parallel-size), writing dict.txt "
                             "beside it; needs the [hf] extra")
    parser.add_argument("--output", required=True, help="output .pt path; part suffixes are added for size > 1")
    parser.add_argument("--model-parallel-size", type=int, metavar="T",
                        help="new model-parallel size (required, except with --to-fairseq and --to-hf)")
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1, metavar="P",
                        help="new number of pipeline stages (default 1: one file per model part)")
    parser.add_argument("--to-fairseq", action="store_true",
                        help="write one checkpoint for fairseq's own transformer_lm (no --user-dir needed)")
    parser.add_argument("--dict", help="with --to-fairseq or --to-hf: the data's dict.txt; the vocabulary is cut to "
                             "its size (default: the size of the dictionary the checkpoint was trained with)")
    parser.add_argument("--accept-other-dictionary", action="store_true",
                        help="with --dict: take a dict.txt whose symbols are not those the checkpoint was trained "
                             "with, in number alike (a deliberate change); refused otherwise")
    parser.add_argument("--to-hf", action="store_true",
                        help="write --output as a directory for transformers' XGLMForCausalLM (safetensors, "
                             "config, generation config, model card; needs the [hf] extra)")
    parser.add_argument("--encoder-json", help="with --to-hf and --dict: GPT-2's encoder.json, to write a tokenizer "
                                               "onto the dictionary's ids; with --from-hf: to write the model's "
                                               "tokens as GPT-2 BPE ids in dict.txt (needed for OPT)")
    parser.add_argument("--vocab-bpe", help="with --encoder-json: GPT-2's vocab.bpe (merges); --from-hf checks them "
                                            "against the model's tokenizer")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="with --to-hf or --from-hf: the weights' dtype "
                                                                "(default: the checkpoint's)")
    parser.add_argument("--max-shard-size", type=float, metavar="GB",
                        help=f"with --to-hf: the largest safetensors file (default {MAX_SHARD_BYTES / 1e9:g}); the "
                             f"export holds about one shard and one layer in memory")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip re-reading each output and comparing per-tensor checksums")
    parser.add_argument("--keep-optimizer", action="store_true",
                        help="reshard the optimizer state too (Adam's moments), to resume training at the new size")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    try:
        if args.from_hf is not None:
            return _import(args)
        if args.keep_optimizer and args.to_fairseq:
            raise UsageError("--keep-optimizer and --to-fairseq exclude each other: the export "
                             "is for evaluation and holds no training state")
        export = "--to-fairseq" if args.to_fairseq else "--to-hf" if args.to_hf else None
        if args.to_fairseq and args.to_hf:
            raise UsageError("--to-fairseq and --to-hf exclude each other: one export per run")
        if args.keep_optimizer and args.to_hf:
            raise UsageError("--keep-optimizer and --to-hf exclude each other: the export holds no training state")
        if args.dict is not None and export is None:
            raise UsageError("--dict is read only with --to-fairseq or --to-hf: resharding keeps every vocabulary row")
        hf_only = [f"--{name.replace('_', '-')}" for name in ("encoder_json", "vocab_bpe", "dtype", "max_shard_size")
                   if getattr(args, name) is not None]
        if hf_only and not args.to_hf:
            raise UsageError(f"{' '.join(hf_only)}: read only with --to-hf or --from-hf")
        if args.pipeline_model_parallel_size < 1:
            raise UsageError(f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}: the number of "
                             f"pipeline stages is at least 1")
        if export and args.pipeline_model_parallel_size != 1:
            raise UsageError(f"{export} writes one model without pipeline stages: --pipeline-model-parallel-size "
                             f"{args.pipeline_model_parallel_size} cannot apply to it")
        if export and args.model_parallel_size not in (None, 1):
            raise UsageError(f"{export} writes one model without model parallelism: "
                             f"--model-parallel-size {args.model_parallel_size} cannot apply to it")
        if args.to_hf:
            require_transformers()
            check_output_directory(args.output)
            parts = PartFiles(args.input)
            dictionary = read_dictionary(parts, args.dict, args.accept_other_dictionary)
            if args.max_shard_size is not None and not args.max_shard_size > 0:
                raise UsageError(f"--max-shard-size {args.max_shard_size}: a size in GB above 0")
            shard_bytes = MAX_SHARD_BYTES if args.max_shard_size is None else int(args.max_shard_size * 1e9)
            print(export_to_transformers(args.input, args.output, dictionary, args.encoder_json, args.vocab_bpe,
                                         args.dtype, verify=args.verify, max_shard_bytes=shard_bytes, parts=parts))
            if args.encoder_json is None:
                print(f"no tokenizer written: AutoTokenizer.from_pretrained({args.output!r}) will not give this "
                      f"model's ids; a tokenizer needs a dictionary of GPT-2 BPE ids (--dict) and GPT-2's BPE files "
                      f"(--encoder-json, --vocab-bpe)", file=sys.stderr)
            return 0
        if args.to_fairseq:
            parts = PartFiles(args.input)
            vocab = export_vocabulary_size(parts, args.dict, args.accept_other_dictionary)
            print(export_to_fairseq(args.input, args.output, vocab_size=vocab, verify=args.verify, parts=parts))
            return 0
        if args.model_parallel_size is None or args.model_parallel_size < 1:
            given = "" if args.model_parallel_size is None else f" ({args.model_parallel_size})"
            raise UsageError(f"--model-parallel-size T{given}: the number of tensor parts to write, at least 1, is "
                             f"needed to reshard (with or without --pipeline-model-parallel-size); --to-fairseq and "
                             f"--to-hf write one model and take none")
        parts = PartFiles(args.input, args.keep_optimizer)  # read once, for the count and the resharding
        passes = 1 + args.keep_optimizer + len(parts.ema_entries)  # weights, optimizer, EMA weights
        steps = len(layer_groups(parts.keys)) * args.model_parallel_size * passes
        with tqdm(total=steps, desc="resharding", unit="layer", disable=None) as bar:
            written = reshard(args.input, args.output, args.model_parallel_size, verify=args.verify,
                              progress=lambda _: bar.update(), with_optimizer=args.keep_optimizer, parts=parts,
                              new_stages=args.pipeline_model_parallel_size)
        written += _dictionary_beside(args.input, args.output)
    except (UsageError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: {args.output} not written (nothing of it was left)", file=sys.stderr)
        return 130
    for path in written:
        print(path)
    if args.keep_optimizer:  # fairseq-train takes the padded vocabulary and the model's options from it
        print(f"train on with: fairseq-train ... --model-parallel-size {args.model_parallel_size} "
              f"--restore-file {args.output}", file=sys.stderr)
    return 0


def _dictionary_beside(checkpoint: str, output: str) -> list:
    """The input's ``dict.txt`` copied beside the output (the tools and the
    hub read it from the checkpoint's directory), where the output's
    directory has none; ``[its path]``, or ``[]``. One there that differs is
    left, with a line saying so.

    Raises:
        OSError: the copy failed (nothing is left of it).
    """
    import filecmp
    import shutil

    from fairseq_megatron.files import written_whole

    source = os.path.join(os.path.dirname(os.path.abspath(checkpoint)), "dict.txt")
    target = os.path.join(os.path.dirname(os.path.abspath(output)), "dict.txt")
    if not os.path.isfile(source) or os.path.abspath(source) == os.path.abspath(target):
        return []
    if os.path.exists(target):
        if not filecmp.cmp(source, target, shallow=False):
            print(f"{target} differs from {source}, the input's dictionary: left as it is", file=sys.stderr)
        return []
    with written_whole(target) as partial:
        shutil.copyfile(source, partial)
    return [target]


def _import(args) -> int:
    """``--from-hf``: the checks of the flags, then :func:`~fairseq_megatron.checkpoint.hf_import.import_from_transformers`."""
    from fairseq_megatron.checkpoint.hf_import import Import
    from fairseq_megatron.errors import check_directory_can_be_made
    from fairseq_megatron.fairseq_integration.save_dir import one_writer
    from fairseq_megatron.fairseq_integration.train import directories_missing, remove_while_empty

    others = [flag for flag, given in (("--to-fairseq", args.to_fairseq), ("--to-hf", args.to_hf),
                                       ("--keep-optimizer", args.keep_optimizer), ("--dict", args.dict is not None),
                                       ("--max-shard-size", args.max_shard_size is not None)) if given]
    if others:
        raise UsageError(f"--from-hf writes our checkpoint from a transformers one: {' '.join(others)} cannot apply")
    if args.model_parallel_size is None or args.model_parallel_size < 1:
        raise UsageError("--from-hf needs --model-parallel-size T (T >= 1): the model-parallel size to write")
    if args.pipeline_model_parallel_size < 1:
        raise UsageError(f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}: the number of "
                         f"pipeline stages is at least 1")
    source = Import(args.from_hf, args.model_parallel_size, args.pipeline_model_parallel_size, args.encoder_json,
                    args.vocab_bpe, args.dtype)
    directory = os.path.dirname(os.path.abspath(args.output))
    check_directory_can_be_made(directory, f"--output {args.output}")
    made = directories_missing(directory)
    try:
        with one_writer(directory, f"--output {args.output}"), tqdm(
                total=source.groups() * args.model_parallel_size, desc="importing", unit="layer", disable=None) as bar:
            written = source.write(args.output, verify=args.verify, progress=bar.update)
    except BaseException:
        remove_while_empty(made)  # nothing of the import stays, not even its directories
        raise
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
