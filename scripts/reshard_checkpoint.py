#!/usr/bin/env python
"""Same as the ``fairseq-megatron-reshard`` command; see fairseq_megatron/cli/reshard_checkpoint.py."""
import sys

from fairseq_megatron.cli.reshard_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
