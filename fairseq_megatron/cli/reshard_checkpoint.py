#!/usr/bin/env python
"""Change the model-parallel size of a fairseq_megatron / Megatron-11b checkpoint.

    fairseq-megatron-reshard --input ckpt/checkpoint_last.pt \\
        --output merged/model.pt --model-parallel-size 1

``--input`` is what you would pass to fairseq as ``--path``: the part files
``<name>-model_part-K.pt`` are found next to it. For size 1 the output is a
single file; otherwise ``<output>-model_part-K.pt``. Only load checkpoints you
trust (the files are fully unpickled).
"""

import argparse
import sys

from fairseq_megatron.checkpoint_resharding import CheckpointError, reshard


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="checkpoint path as given to fairseq --path")
    parser.add_argument("--output", required=True, help="output path (.pt); part suffixes are added for size > 1")
    parser.add_argument("--model-parallel-size", type=int, required=True, help="new model-parallel size")
    args = parser.parse_args(argv)
    if args.model_parallel_size < 1:
        parser.error("--model-parallel-size must be >= 1")
    try:
        written = reshard(args.input, args.output, args.model_parallel_size)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
