#!/usr/bin/env python
"""Tokens/s of greedy decoding with the key/value cache versus recomputing the prefix.

    python scripts/benchmark_generation.py [--tokens 256 --layers 4 --dim 256 --device cpu]

Builds a transformer_lm_megatron_11b-shaped model with the given dimensions at
model-parallel size 1 (random weights: speed does not depend on them) and
generates ``--tokens`` tokens greedily from a one-token prompt, twice: with
incremental decoding (one new position per step, cached keys/values) and by
re-running the whole prefix every step. Prints tokens/s for both and the
speed-up. On GPU pass ``--device cuda`` (and ``--fp16``); ``--layers 72
--dim 3072 --ffn 18432 --heads 32`` is the Megatron-11b shape.
"""

import argparse
import sys
import time
from argparse import Namespace

import torch
from fairseq.data import Dictionary

from fairseq_megatron.models.model_parallel_transformer_lm import (
    ModelParallelTransformerLanguageModel,
    transformer_lm_megatron_11b,
)


class _Task:
    def __init__(self, d):
        self.source_dictionary = self.target_dictionary = d


def build(layers, dim, ffn, heads, vocab, max_positions):
    d = Dictionary()
    for i in range(vocab - d.nspecial):
        d.add_symbol(f"w{i}")
    args = Namespace(decoder_layers=layers, decoder_embed_dim=dim, decoder_ffn_embed_dim=ffn,
                     decoder_attention_heads=heads, share_decoder_input_output_embed=True,
                     dropout=0.0, attention_dropout=0.0, model_parallel_size=1,
                     tokens_per_sample=max_positions, max_target_positions=max_positions)
    transformer_lm_megatron_11b(args)
    return ModelParallelTransformerLanguageModel.build_model(args, _Task(d)).eval()


@torch.no_grad()
def greedy(model, prompt, steps, incremental):
    tokens, state = prompt, ({} if incremental else None)
    for _ in range(steps):
        logits = model(tokens, incremental_state=state)[0][:, -1]
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    return tokens


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--ffn", type=int, default=None, help="default: 6 x dim")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--skip-recompute", action="store_true", help="only time incremental decoding")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build(args.layers, args.dim, args.ffn or 6 * args.dim, args.heads, args.vocab, args.tokens + 8)
    model = model.to(device)
    if args.fp16:
        model = model.half()
    prompt = torch.tensor([[4]], device=device)
    greedy(model, prompt, 4, incremental=True)  # warm-up

    results = {}
    for name, incremental in (("incremental (kv cache)", True), ("recompute prefix", False)):
        if not incremental and args.skip_recompute:
            continue
        sync(device)
        start = time.perf_counter()
        out = greedy(model, prompt, args.tokens, incremental)
        sync(device)
        results[name] = (args.tokens / (time.perf_counter() - start), out)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.layers} x {args.dim}, {params / 1e6:.1f}M parameters, {device}, "
          f"{'fp16' if args.fp16 else 'fp32'}, {args.tokens} new tokens, batch 1, torch threads "
          f"{torch.get_num_threads()}")
    for name, (tps, _) in results.items():
        print(f"{name:>24}: {tps:8.1f} tokens/s")
    if len(results) == 2:
        (inc, out_inc), (full, out_full) = results.values()
        same = torch.equal(out_inc, out_full)
        print(f"{'speed-up':>24}: {inc / full:8.1f}x  (same tokens: {same})")
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
