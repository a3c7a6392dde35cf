"""The dictionary of a model imported from transformers, and where its rows come from.

fairseq's ``Dictionary`` has its four special symbols at ids 0-3 (``<s>``,
``<pad>``, ``</s>``, ``<unk>``), then one symbol per line of ``dict.txt``.
Our data pipeline (``examples/megatron_11b/bpe_encode.py``, then
``fairseq-preprocess --srcdict``) writes text as GPT-2 BPE ids, so the
symbols of an imported model's ``dict.txt`` are GPT-2 BPE ids, as in
Megatron-11b's (RoBERTa's) ``dict.txt``: the pipeline then gives every piece
of text the embedding row the source model gives it. A
:class:`VocabularyPlan` says, for each row of our (padded) embedding, which
row of the source's it takes, and which of our rows the output softmax
masks (:mod:`fairseq_megatron.models.masked_vocab_rows`).

Two plans, by how the source numbers its tokens:

- :func:`shifted_plan`, GPT-2's: row k is GPT-2 BPE id k and there are no
  special rows. Our row ``4 + k`` takes source row k; fairseq's ``</s>``
  (which fairseq appends to every line and predicts) takes the row of the
  end-of-text token; ``<s>``, ``<pad>``, ``<unk>`` and the second copy of the
  end-of-text row are masked.
- :func:`same_rows_plan`, OPT's and fairseq's dense models': the source
  already numbers its rows as a fairseq dictionary does (``<s> <pad> </s>
  <unk>`` at 0-3, then its pieces), so our row k is source row k, and each
  piece's symbol is its GPT-2 BPE id, looked up in GPT-2's ``encoder.json``
  (:func:`gpt2_symbols`), or, for a model that ``--to-hf`` wrote, the
  symbols of the ``dict.txt`` written beside it.

Rows the source has beyond its tokenizer (OPT: 50272 rows, 50265 tokens)
are its own padding and are kept as trained. Our rows beyond the source's
are the padding to :func:`padding_multiple`, zero and masked.
"""

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

from fairseq_megatron.checkpoint.hf_tokenizer import SPECIAL_SYMBOLS
from fairseq_megatron.checkpoint.layout import CheckpointError
from fairseq_megatron.errors import UsageError

# Symbols that stand for themselves in dict.txt: fairseq's padding symbols
# (Dictionary.pad_to_multiple_) and special symbols in angle brackets (``<mask>``),
# as RoBERTa's and OPT's vocabularies hold them. GPT-2's BPE never makes one
# of them from text (it splits "<mask>" into "<", "mask", ">").
_OWN_SYMBOL = re.compile(r"madeupword\d+|<[^\s<>]+>")


@dataclass
class VocabularyPlan:
    """Our vocabulary, row by row: ``symbols``, the symbols of ``dict.txt``
    (our rows 4, 5, ...; the dictionary is ``4 + len(symbols)`` symbols);
    ``source_rows``, for each of our padded rows, the source row it copies
    (-1: none, a zero row); ``masked``, our rows whose logits are minus
    infinity."""

    symbols: List[str]
    source_rows: List[int]
    masked: List[int]

    @property
    def dictionary_size(self) -> int:
        return len(SPECIAL_SYMBOLS) + len(self.symbols)

    @property
    def padded_vocab_size(self) -> int:
        return len(self.source_rows)

    def write_dict(self, path: str) -> None:
        """Write ``dict.txt`` (``symbol count`` lines, fairseq's format; every count 1)."""
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(f"{symbol} 1\n" for symbol in self.symbols)


def padding_multiple(heads: int, ffn: int) -> int:
    """The multiple the vocabulary is padded to: 8 x gcd(heads, FFN size),
    fairseq's 8 x the model-parallel size for the largest size that divides
    the model, so that the import loads at every model-parallel size that
    divides the heads and the FFN size."""
    return 8 * math.gcd(heads, ffn)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def shifted_plan(rows: int, tokens: int, eos_row: int, symbols: List[str], multiple: int) -> VocabularyPlan:
    """GPT-2's vocabulary (see the module docstring): ``rows`` source rows,
    ``tokens`` of them the tokenizer's (``symbols``, their GPT-2 BPE ids in
    row order), ``eos_row`` the end-of-text token's row."""
    specials = len(SPECIAL_SYMBOLS)
    padded = _round_up(specials + rows, multiple)
    source_rows = [-1, -1, eos_row, -1] + list(range(rows)) + [-1] * (padded - specials - rows)
    masked = [row for row, source in enumerate(source_rows) if source < 0] + [specials + eos_row]
    return VocabularyPlan(symbols[:tokens], source_rows, sorted(masked))


def same_rows_plan(rows: int, symbols: List[str], multiple: int) -> VocabularyPlan:
    """A source numbered as a fairseq dictionary (see the module docstring):
    ``rows`` source rows, ``symbols`` those of its rows 4, 5, ..."""
    padded = _round_up(rows, multiple)
    source_rows = list(range(rows)) + [-1] * (padded - rows)
    return VocabularyPlan(list(symbols), source_rows, list(range(rows, padded)))


# ------------------------------------------------------------------ tokenizers


@dataclass
class TokenizerVocabulary:
    """A transformers tokenizer's ``pieces`` in id order (ids 0 to n-1),
    which of them are its added or special tokens (``added``), and its BPE
    ``merges`` where it has them."""

    pieces: List[str]
    added: Set[str]
    merges: Optional[List[Tuple[str, str]]]


def _merge_pairs(merges) -> List[Tuple[str, str]]:
    """tokenizers' merges, ``"a b"`` strings or ``[a, b]`` pairs, as pairs."""
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def read_tokenizer(directory: str) -> Optional[TokenizerVocabulary]:
    """The vocabulary of the tokenizer saved in ``directory``
    (``tokenizer.json``, else ``vocab.json`` with ``merges.txt`` and
    ``added_tokens.json``), or None where it holds neither.

    Raises:
        UsageError: a file that is not what transformers writes, ids that
            are not 0 to n-1 without gaps, or a tokenizer that is not a BPE
            over pieces (a SentencePiece or WordPiece vocabulary).
    """
    fast, slow = os.path.join(directory, "tokenizer.json"), os.path.join(directory, "vocab.json")
    if os.path.exists(fast):
        data = _read_json(fast)
        model = data.get("model") if isinstance(data, dict) else None
        if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
            kind = model.get("type") if isinstance(model, dict) else None
            raise UsageError(f"{fast} is a {kind or 'non-BPE'} tokenizer, not a byte-level BPE as GPT-2's: "
                             f"its vocabulary cannot be written as GPT-2 BPE ids")
        vocab = dict(model["vocab"])
        added = {t["content"]: t["id"] for t in data.get("added_tokens") or []}
        merges = _merge_pairs(model.get("merges") or [])
        source = fast
    elif os.path.exists(slow):
        vocab = _read_json(slow)
        added_path = os.path.join(directory, "added_tokens.json")
        added = _read_json(added_path) if os.path.exists(added_path) else {}
        merges_path = os.path.join(directory, "merges.txt")
        merges = None
        if os.path.exists(merges_path):
            with open(merges_path, encoding="utf-8") as f:
                merges = [tuple(line.split()) for line in f.read().split("\n")[1:] if line.strip()]
        source = slow
    else:
        return None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in list(vocab.values()) + list(added.values())):
        raise UsageError(f"{source} is not a tokenizer vocabulary of piece -> id")
    by_id: Dict[int, str] = {}
    for piece, i in list(vocab.items()) + list(added.items()):
        if by_id.setdefault(i, piece) != piece:
            raise UsageError(f"{source}: id {i} is both {by_id[i]!r} and {piece!r}")
    missing = sorted(set(range(len(by_id))) - by_id.keys())
    if missing:
        raise UsageError(f"{source}: its token ids are not 0 to {len(by_id) - 1} (no token has id {missing[0]})")
    return TokenizerVocabulary([by_id[i] for i in range(len(by_id))], set(added), merges)


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as e:
        raise UsageError(f"{path} is not JSON: {e}") from None


def gpt2_symbols(tokenizer: TokenizerVocabulary, encoder: Dict[str, int], encoder_json: str, first: int,
                 where: str) -> List[str]:
    """The ``dict.txt`` symbols of ``tokenizer``'s pieces from id ``first``
    on: each piece's GPT-2 BPE id in ``encoder`` (GPT-2's ``encoder.json``,
    read from ``encoder_json``); the tokenizer's added or special tokens the
    encoder lacks, special symbols (``<mask>``) and fairseq's padding symbols
    (``madeupword0000``) stand as themselves (:data:`_OWN_SYMBOL`).
    ``where``: the tokenizer's directory, for messages.

    Raises:
        UsageError: a piece the encoder lacks, a symbol fairseq's
            ``dict.txt`` cannot hold (whitespace in it), or one symbol twice.
    """
    symbols, seen = [], {symbol: i for i, symbol in enumerate(SPECIAL_SYMBOLS)}
    for i, piece in enumerate(tokenizer.pieces[first:], start=first):
        if piece in encoder:
            symbol = str(encoder[piece])
        elif piece in tokenizer.added or _OWN_SYMBOL.fullmatch(piece):
            symbol = piece
            if not symbol or any(c.isspace() for c in symbol):
                raise UsageError(f"{where}'s token {piece!r} (id {i}) holds whitespace, which a fairseq dict.txt "
                                 f"symbol cannot")
        else:
            raise UsageError(f"--encoder-json {encoder_json} lacks the token {piece!r} (id {i} of {where}'s "
                             f"tokenizer): not the GPT-2 vocabulary this model's tokenizer is made of")
        if symbol in seen:
            raise UsageError(f"{where}'s tokens {seen[symbol]} and {i} are both {symbol!r} in --encoder-json "
                             f"{encoder_json}")
        seen[symbol] = i
        symbols.append(symbol)
    return symbols


def check_specials(tokenizer: TokenizerVocabulary, where: str) -> None:
    """Refuse a tokenizer numbered otherwise than a fairseq dictionary: its
    ids 0-3 must be ``<s> <pad> </s> <unk>`` (OPT's and fairseq's dense
    models' are), the rows fairseq's special symbols take.

    Raises:
        UsageError: as said.
    """
    found = tokenizer.pieces[: len(SPECIAL_SYMBOLS)]
    if tuple(found) != SPECIAL_SYMBOLS:
        raise UsageError(f"{where}'s tokenizer starts with {' '.join(found)}, not fairseq's {' '.join(SPECIAL_SYMBOLS)} "
                         f"at ids 0-3: its rows cannot be fairseq's dictionary rows")


def check_merges(tokenizer: TokenizerVocabulary, merges: List[Tuple[str, str]], vocab_bpe: str, where: str) -> None:
    """Refuse ``--vocab-bpe`` merges other than those of the model's own
    tokenizer (where it has them): our BPE would split some text otherwise.

    Raises:
        UsageError: the first merge that differs.
    """
    if tokenizer.merges is None:
        return
    for rank, (ours, theirs) in enumerate(zip(merges, tokenizer.merges)):
        if tuple(ours) != tuple(theirs):
            raise UsageError(f"--vocab-bpe {vocab_bpe} differs from {where}'s tokenizer at merge {rank + 1} "
                             f"({' '.join(ours)!r} against {' '.join(theirs)!r}): text would be split otherwise")
    if len(merges) != len(tokenizer.merges):
        raise UsageError(f"--vocab-bpe {vocab_bpe} holds {len(merges)} merges, {where}'s tokenizer "
                         f"{len(tokenizer.merges)}: text would be split otherwise")


def read_dict_symbols(path: str) -> List[str]:
    """The symbols of fairseq ``dict.txt`` ``path`` after the four special
    ones, in order.

    Raises:
        CheckpointError: not a fairseq ``dict.txt``.
    """
    from fairseq.data import Dictionary

    try:
        dictionary = Dictionary.load(path)
    except Exception as e:  # a line not "<token> <count>" (ValueError) or not UTF-8 (a bare Exception)
        raise CheckpointError(f"{path} is not a fairseq dict.txt: {e}") from None
    return dictionary.symbols[dictionary.nspecial:]
