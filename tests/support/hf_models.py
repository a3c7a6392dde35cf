"""Small transformers checkpoints of the three imported architectures, made
here from configurations (nothing is downloaded), with their tokenizers
over a byte-level BPE in GPT-2's file format (``encoder.json`` and
``vocab.bpe``, as ``examples/megatron_11b/bpe_encode.py`` reads them):

- GPT-2: rows are BPE ids, the end-of-text token last (GPT-2's 50256);
- OPT: ``<s> <pad> </s> <unk>``, the pieces in another order (RoBERTa's and
  OPT's dictionaries order them by frequency), two of fairseq's
  ``madeupword`` symbols and ``<mask>``, and more rows than tokens (OPT-125m:
  50272 rows, 50265 tokens);
- XGLM with a GPT-2 BPE tokenizer numbered like OPT's: fairseq's dense
  models as transformers publishes them.

Weights are drawn with a larger spread than transformers' initialisation,
so that the layers change the logits well beyond rounding; ``far_below_zero``
shifts every logit of GPT-2 to about -36, as a real model's sit, so that a
zero row left unmasked (logit 0) would take nearly all the probability.
"""

import json
import os
import random
from typing import Dict, List, Tuple

import torch

from tests.support.bpe_text import VARIED

LAYERS, EMBED, HEADS, POSITIONS = 2, 32, 4, 64
FFN = {"gpt2": 128, "opt": 64, "xglm": 64}
TEXT = VARIED + [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "Language models assign probabilities to sequences of tokens.",
    "fairseq trains transformer language models; Megatron splits their layers over GPUs.",
] * 3


def small_bpe(root) -> Tuple[str, str]:
    """A byte-level BPE of 300 pieces trained on :data:`TEXT`, saved as GPT-2's
    ``encoder.json`` and ``vocab.bpe``: their paths."""
    from tokenizers import ByteLevelBPETokenizer

    os.makedirs(root, exist_ok=True)
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(TEXT, vocab_size=300, min_frequency=1, show_progress=False)
    tokenizer.save_model(str(root))
    encoder_json, vocab_bpe = os.path.join(root, "encoder.json"), os.path.join(root, "vocab.bpe")
    os.replace(os.path.join(root, "vocab.json"), encoder_json)
    os.replace(os.path.join(root, "merges.txt"), vocab_bpe)
    return encoder_json, vocab_bpe


def _save_tokenizer(directory: str, vocab: Dict[str, int], vocab_bpe: str, **specials) -> None:
    """A byte-level BPE tokenizer over ``vocab`` and the merges of
    ``vocab_bpe``, saved as transformers saves one (``tokenizer.json``):
    GPT-2's pre-tokenizer and byte map, no prefix space, no special tokens added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    with open(vocab_bpe, encoding="utf-8") as f:
        merges = [tuple(line.split()) for line in f.read().split("\n")[1:] if line.strip()]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    os.makedirs(directory, exist_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **specials).save_pretrained(directory)


def _spread(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or "ln_f" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if name.endswith("weight")
                        else 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))


def gpt2(directory: str, encoder_json: str, vocab_bpe: str, tied: bool = True, far_below_zero: bool = False,
         seed: int = 1) -> None:
    """A ``GPT2LMHeadModel`` whose rows are the BPE's ids and the end-of-text token's (last), with its tokenizer."""
    import transformers

    encoder = json.load(open(encoder_json, encoding="utf-8"))
    eos = len(encoder)
    _save_tokenizer(directory, {**encoder, "<|endoftext|>": eos}, vocab_bpe, eos_token="<|endoftext|>",
                    bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    config = transformers.GPT2Config(n_layer=LAYERS, n_embd=EMBED, n_head=HEADS, n_inner=FFN["gpt2"],
                                     n_positions=POSITIONS, vocab_size=eos + 1, eos_token_id=eos, bos_token_id=eos,
                                     tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config)
    _spread(model, seed)
    if far_below_zero:
        with torch.no_grad():  # every row shares a direction that the final layer norm's bias points away from
            g = torch.Generator().manual_seed(seed + 1)
            u = torch.randn(EMBED, generator=g)
            u *= 6 / u.norm()
            model.transformer.wte.weight.add_(u)
            if not tied:
                model.lm_head.weight.add_(u)
            model.transformer.ln_f.bias.copy_(-u)
    model.save_pretrained(directory)


def _fairseq_numbered(encoder_json: str, seed: int) -> Dict[str, int]:
    """A vocabulary numbered as a fairseq dictionary: specials 0-3, the
    pieces shuffled, two padding symbols, ``<mask>`` last (RoBERTa's)."""
    pieces = list(json.load(open(encoder_json, encoding="utf-8")))
    random.Random(seed).shuffle(pieces)
    symbols = ["<s>", "<pad>", "</s>", "<unk>"] + pieces + ["madeupword0000", "madeupword0001", "<mask>"]
    return {s: i for i, s in enumerate(symbols)}


def opt(directory: str, encoder_json: str, vocab_bpe: str, seed: int = 2) -> None:
    """An ``OPTForCausalLM`` over :func:`_fairseq_numbered`'s vocabulary, with 8 rows more than tokens."""
    import transformers

    vocab = _fairseq_numbered(encoder_json, seed)
    _save_tokenizer(directory, vocab, vocab_bpe, bos_token="</s>", eos_token="</s>", pad_token="<pad>",
                    unk_token="<unk>")
    config = transformers.OPTConfig(num_hidden_layers=LAYERS, hidden_size=EMBED, ffn_dim=FFN["opt"],
                                    num_attention_heads=HEADS, max_position_embeddings=POSITIONS,
                                    vocab_size=len(vocab) + 8, word_embed_proj_dim=EMBED)
    torch.manual_seed(seed)
    model = transformers.OPTForCausalLM(config)
    _spread(model, seed)
    model.save_pretrained(directory)


def xglm(directory: str, encoder_json: str, vocab_bpe: str, seed: int = 3, extra_rows: int = 0) -> None:
    """An ``XGLMForCausalLM`` with a GPT-2 BPE tokenizer numbered as a fairseq
    dictionary (fairseq's dense models as published), with ``extra_rows``
    embedding rows beyond its tokenizer's."""
    import transformers

    vocab = _fairseq_numbered(encoder_json, seed)
    _save_tokenizer(directory, vocab, vocab_bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                    unk_token="<unk>")
    config = transformers.XGLMConfig(num_layers=LAYERS, d_model=EMBED, ffn_dim=FFN["xglm"], attention_heads=HEADS,
                                     max_position_embeddings=POSITIONS, vocab_size=len(vocab) + extra_rows)
    torch.manual_seed(seed)
    model = transformers.XGLMForCausalLM(config)
    _spread(model, seed)
    model.save_pretrained(directory)


BUILDERS = {"gpt2": lambda d, e, v: gpt2(d, e, v, far_below_zero=True),
            "gpt2-untied": lambda d, e, v: gpt2(d, e, v, tied=False),
            "opt": opt, "xglm": xglm}


def source_ids(directory: str, text: List[str]) -> List[List[int]]:
    """The transformers tokenizer's ids for each line of ``text`` (no special tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    return [tokenizer(line, add_special_tokens=False)["input_ids"] for line in text]


def source_log_probs(directory: str, ids: torch.Tensor) -> torch.Tensor:
    """transformers' log-softmax over the whole output for ``ids`` ``(B, T)``, fp64 ``(B, T, rows)``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory)
    model.eval()
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.double(), -1)
