#!/usr/bin/env python
"""Run the stored loss baseline's tiny training run at each layout and
compare its per-update losses and gradient norms with
``tests/assets/losses/`` (the default), or write them there (``--write``).

    python scripts/loss_baseline.py                # compare every layout
    python scripts/loss_baseline.py --write        # regenerate every file
    python scripts/loss_baseline.py --write P2 C2  # regenerate two

Regenerate only for a change meant to move the losses, and say which and
why in the commit message: the files are what catches a change that moves
every layout together (tests/support/loss_baseline.py). Runs on CPU
processes (gloo), one layout after another, up to 4 processes.
"""

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.support import loss_baseline  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("layouts", nargs="*", metavar="LAYOUT", help=f"of {', '.join(loss_baseline.LAYOUTS)} (default: all)")
    p.add_argument("--write", action="store_true", help="write the files instead of comparing with them")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    unknown = [name for name in args.layouts if name not in loss_baseline.LAYOUTS]
    if unknown:
        p.error(f"unknown layout {unknown[0]}: one of {', '.join(loss_baseline.LAYOUTS)}")
    import torch

    failed = 0
    for name in args.layouts or list(loss_baseline.LAYOUTS):
        with tempfile.TemporaryDirectory() as tmp:
            record = loss_baseline.run(name, tmp)
        if args.write:
            loss_baseline.write(name, record)
            print(f"{name}: wrote {os.path.relpath(loss_baseline.path_of(name))} (losses {record['losses'][0]:.6f} "
                  f"... {record['losses'][-1]:.6f})")
            continue
        if not os.path.exists(loss_baseline.path_of(name)):
            print(f"{name}: no stored file {loss_baseline.path_of(name)} (write it with --write)")
            failed += 1
            continue
        want = loss_baseline.stored(name)
        worst = max(abs(a - b) / abs(b) for key in ("losses", "norms") for a, b in zip(record[key], want[key]))
        ok = all(torch.allclose(torch.tensor(record[key]), torch.tensor(want[key]), **loss_baseline.TOLERANCE)
                 for key in ("losses", "norms"))
        failed += not ok
        print(f"{name}: {'equal' if ok else 'DIFFERENT'} (largest relative difference {worst:.2e}, tolerance "
              f"{loss_baseline.TOLERANCE['rtol']:.0e})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
