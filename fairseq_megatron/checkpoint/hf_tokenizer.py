"""A Hugging Face tokenizer that maps text straight to fairseq dictionary ids.

fairseq's GPT-2 pipeline encodes a line in two steps: GPT-2's byte-level BPE
gives GPT-2 ids (``encoder.json``, merges from ``vocab.bpe``), written as
text; ``fairseq-preprocess`` then looks each id up as a symbol of
``dict.txt``, whose line ``k`` is fairseq id ``k + 4`` (after ``<s>``,
``<pad>``, ``</s>``, ``<unk>``), and appends ``</s>``. A language model reads
``</s>`` first. :func:`fairseq_gpt2_tokenizer` folds both steps into one
``tokenizers`` BPE whose vocabulary holds fairseq's ids, and prepends
``</s>`` as fairseq's LM datasets do.

A GPT-2 piece missing from ``dict.txt`` is ``<unk>`` (3) in fairseq, so
several pieces would share one id. A tokenizers BPE cannot hold that: it
keys its merges by the ids of the pieces merged (the merges of one piece
would apply to the others) and saves its vocabulary id by id (all but one
of the pieces would be lost). A dictionary that lacks any GPT-2 piece is
therefore refused, rather than writing a tokenizer that splits some text
differently from fairseq's encoder; export the model without the tokenizer,
or use a dict.txt that lists every GPT-2 id, as fairseq's GPT-2 dictionary
does.
"""

import json
from typing import Dict, List, Tuple

from fairseq_megatron.errors import UsageError

SPECIAL_SYMBOLS = ("<s>", "<pad>", "</s>", "<unk>")  # fairseq's Dictionary: ids 0, 1, 2, 3


def read_gpt2_files(encoder_json: str, vocab_bpe: str) -> Tuple[Dict[str, int], List[Tuple[str, str]]]:
    """GPT-2's ``{piece: id}`` and its merges in rank order.

    Raises:
        UsageError: ``encoder.json`` is not a JSON object of piece -> id, or
            ``vocab.bpe`` has no ``#version`` header, no merges or a line that
            is not two pieces.
        FileNotFoundError: a file is missing.
    """
    with open(encoder_json, encoding="utf-8") as f:
        try:
            encoder = json.load(f)
        except ValueError as e:
            raise UsageError(f"--encoder-json {encoder_json} is not JSON: {e}") from None
    if not isinstance(encoder, dict) or not all(isinstance(v, int) for v in encoder.values()):
        raise UsageError(f"--encoder-json {encoder_json} is not a JSON object of piece -> id")
    with open(vocab_bpe, encoding="utf-8") as f:
        lines = f.read().split("\n")
    if not lines[0].startswith("#version"):
        raise UsageError(f"--vocab-bpe {vocab_bpe} has no '#version' header line: not GPT-2's vocab.bpe")
    merges = []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        pair = line.split()
        if len(pair) != 2:
            raise UsageError(f"--vocab-bpe {vocab_bpe} line {number} is not a merge of two pieces: {line[:80]!r}")
        merges.append((pair[0], pair[1]))
    if not merges:
        raise UsageError(f"--vocab-bpe {vocab_bpe} holds no merges")
    return encoder, merges


EXPORT_ADVICE = "export without --encoder-json/--vocab-bpe, or use a dict.txt that lists every GPT-2 id"


def fairseq_ids(encoder: Dict[str, int], merges: List[Tuple[str, str]], dictionary, name: str = "--dict",
                advice: str = EXPORT_ADVICE) -> Dict[str, int]:
    """``{piece: fairseq id}`` for every GPT-2 piece and fairseq's special
    symbols; ``name`` and ``advice``: how the refusals name the dictionary
    and what they advise (the export's flags by default).

    Raises:
        UsageError: ``dictionary`` lacks a GPT-2 id, or a merge names a piece
            ``encoder`` lacks.
    """
    unk = dictionary.unk()
    vocab = {piece: dictionary.index(str(gpt2_id)) for piece, gpt2_id in encoder.items()}
    if all(i == unk for i in vocab.values()):
        raise UsageError(f"{name} holds none of the GPT-2 ids of the encoder: not a GPT-2 BPE dictionary; {advice}")
    unknown = sorted({piece for pair in merges for piece in pair} - vocab.keys())
    if unknown:
        raise UsageError(f"--vocab-bpe merges pieces that --encoder-json lacks, e.g. {unknown[0]!r}")
    missing = sorted((gpt2_id, piece) for piece, gpt2_id in encoder.items() if vocab[piece] == unk)
    if missing:
        gpt2_id, piece = missing[0]
        raise UsageError(
            f"{name} lacks {len(missing)} of the {len(encoder)} GPT-2 ids (e.g. {gpt2_id}, {piece!r}): fairseq reads "
            f"them all as <unk>, which a tokenizers BPE cannot reproduce; {advice}"
        )
    for index, symbol in enumerate(SPECIAL_SYMBOLS):
        if dictionary.index(symbol) != index:
            raise UsageError(f"{name}: {symbol} is not id {index}, as fairseq's dictionaries have it")
        vocab[symbol] = index
    return vocab


def fairseq_gpt2_tokenizer(encoder_json: str, vocab_bpe: str, dictionary, name: str = "--dict",
                           advice: str = EXPORT_ADVICE):
    """A ``transformers`` fast tokenizer giving, for a line, ``[2] + ids`` where
    ``ids`` are what fairseq's GPT-2 encoder and ``dictionary`` make of it
    (``examples/megatron_11b/bpe_encode.py`` then ``fairseq-preprocess``);
    its bos and eos are ``</s>`` (2), pad 1, unk 3. Save it with
    ``save_pretrained``.

    Raises:
        UsageError: as :func:`read_gpt2_files` and :func:`fairseq_ids`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    encoder, merges = read_gpt2_files(encoder_json, vocab_bpe)
    vocab = fairseq_ids(encoder, merges, dictionary, name, advice)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    # GPT-2's pre-tokenizer regex and byte map, no space added before a line
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    eos = (SPECIAL_SYMBOLS[2], 2)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{eos[0]} $A", pair=f"{eos[0]} $A {eos[0]} $B", special_tokens=[eos])
    tokenizer.add_special_tokens(list(SPECIAL_SYMBOLS))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="</s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>", model_max_length=int(1e30))
