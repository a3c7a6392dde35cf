#!/usr/bin/env python
"""Same as the ``fairseq-megatron-plan`` command; see fairseq_megatron/cli/plan_parallelism.py."""
import sys

from fairseq_megatron.cli.plan_parallelism import main

if __name__ == "__main__":
    sys.exit(main())
