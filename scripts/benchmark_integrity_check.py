"""Time the CRC-32 check that every tool runs on a checkpoint file it reads
(``fairseq_megatron.checkpoint.integrity.check_integrity``), on one part
file of the given size saved by ``torch.save`` as fairseq-train saves one.

    python scripts/benchmark_integrity_check.py --work-dir /tmp/crc --gb 2.8

Prints seconds and seconds per GB for each of ``--repeats`` checks (the
file is in the page cache after it is written; the first check of a file
just copied from elsewhere also waits for the disk).
"""

import argparse
import os
import sys
import time

import torch


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", required=True, help="where the part file is written (removed at the end)")
    p.add_argument("--gb", type=float, default=2.8, help="size of the part file in GB (fp16 weights)")
    p.add_argument("--repeats", type=int, default=3)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from fairseq_megatron.checkpoint import integrity

    os.makedirs(args.work_dir, exist_ok=True)
    path = os.path.join(args.work_dir, "model-model_part-0.pt")
    elements = int(args.gb * 1e9 / 2)
    layers = 16
    model = {f"decoder.layers.{i}.fc1.weight": torch.empty(elements // layers, dtype=torch.float16).normal_()
             for i in range(layers)}
    torch.save({"model": model, "optimizer_history": [{"num_updates": 1}]}, path)
    del model
    size = os.path.getsize(path)
    try:
        for _ in range(args.repeats):
            integrity._CHECKED.clear()  # measure the read, not the memo of an earlier check
            start = time.perf_counter()
            assert integrity.check_integrity(path)
            seconds = time.perf_counter() - start
            print(f"{size / 1e9:.2f} GB checked in {seconds:.2f} s: {seconds / (size / 1e9):.2f} s per GB")
    finally:
        os.remove(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
