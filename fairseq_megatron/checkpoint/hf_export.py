"""Export to Hugging Face transformers (``fairseq-megatron-reshard --to-hf``).

Our architectures are fairseq's ``transformer_lm`` with pre-norm layers, a
final layer norm, sinusoidal positions offset by the padding index, token
embeddings scaled by sqrt(d), biases everywhere and (usually) the output
projection tied to the embedding: the architecture transformers ships as
``XGLMForCausalLM`` (``transformers/models/xglm/modeling_xglm.py``; XGLM
was trained with fairseq). Parameter names map one to one
(``decoder.layers.N.*`` -> ``model.layers.N.*``, ``decoder.embed_tokens`` ->
``model.embed_tokens``, ``decoder.layer_norm`` -> ``model.layer_norm``, an
untied ``decoder.output_projection`` -> ``lm_head``). A checkpoint whose
options XGLM cannot express (learned or no positions, post-norm, no final
norm, an embedding layer norm, an activation XGLM lacks) is refused, as is a
dictionary whose padding index is not 1: XGLM's position offset is fixed at
2, fairseq's is ``pad + 1``.

The output directory holds ``config.json``, the weights as safetensors
(``model.safetensors``, or shards ``model-0000K-of-0000N.safetensors`` with
``model.safetensors.index.json`` above ``max_shard_bytes``, as transformers
writes them), ``generation_config.json`` (bos = decoder start = eos =
``</s>``, as fairseq's LMs start from ``</s>``; pad never generated, as in
fairseq's ``SequenceGenerator``), a short model card ``README.md``, with
``--dict`` the ``dict.txt`` it was given (the symbol of each row, which
``--from-hf`` reads back), and, given the GPT-2 BPE files, a tokenizer
(:mod:`.hf_tokenizer`).

Memory: the parts are merged one layer at a time (memory-mapped, as
:mod:`.resharding` reads them) and each shard is written and dropped as soon
as it is full, so the peak is about one shard plus one layer. Everything is
written into a new directory of its own beside the output
(``<output>.tmp-<random hex>``, :func:`~fairseq_megatron.files.new_temporary`)
and renamed to ``<output>`` at the end: an interrupted export leaves no
half-written model under the output's name, and removes nothing it did not
create.

A pipelined checkpoint is exported as its stages merged into one model
(:func:`~fairseq_megatron.checkpoint.resharding.merge_stages`), its output
projection tied to the embedding where it was trained so.
"""

import json
import os
import re
import shutil
from typing import Dict, List, Optional

import torch

from fairseq_megatron.checkpoint.layout import CheckpointError
from fairseq_megatron.checkpoint.part_files import is_write_failure, write_error
from fairseq_megatron.checkpoint.resharding import (
    PartFiles,
    config_value,
    model_config,
    model_part_groups,
    tensor_checksum,
)
from fairseq_megatron.errors import UsageError, check_directory_can_be_made
from fairseq_megatron.files import new_temporary, with_the_mode_of_a_new_file

# transformers' default shard size before version 5 (5 GB); a shard holds whole tensors.
MAX_SHARD_BYTES = 5 * 10**9
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# fairseq's --activation-fn -> transformers' ACT2FN name of the same function
# (gelu_accurate and gelu_fast are the tanh approximation, transformers' gelu_new).
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_accurate": "gelu_new", "gelu_fast": "gelu_new",
               "tanh": "tanh", "linear": "linear", "swish": "silu"}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(self_attn\.[qkv]_proj|self_attn\.out_proj|self_attn_layer_norm|fc1|fc2"
                    r"|final_layer_norm)\.(weight|bias)$")
_DROPPED = ("decoder.version", "decoder.embed_positions._float_tensor")


def require_transformers():
    """Import transformers and safetensors, or say how to install them.

    transformers imports torchaudio whenever the package is installed, and
    fairseq requires torchaudio: pip may pick one built for another torch,
    whose library then fails to load (``OSError``), and so would every
    ``from_pretrained`` of the export in the user's own process. That is
    refused here, with the fix, before anything is written (``make
    install`` removes such a torchaudio: fairseq's language models never
    import it).

    Raises:
        UsageError: transformers or safetensors is missing, or torchaudio
            is installed and cannot load.
    """
    import importlib.util
    import sys

    if "torchaudio" not in sys.modules and importlib.util.find_spec("torchaudio") is not None:
        try:
            import torchaudio  # noqa: F401
        except (ImportError, OSError) as e:
            import importlib.metadata

            try:
                installed = f"torchaudio {importlib.metadata.version('torchaudio')}"
            except importlib.metadata.PackageNotFoundError:
                installed = "torchaudio"
            raise UsageError(f"--to-hf: {installed} is installed and cannot load beside torch "
                             f"{torch.__version__} ({type(e).__name__}: {str(e).splitlines()[0]}); transformers "
                             f"imports it whenever it is installed, so the export would not load either: pip "
                             f"uninstall torchaudio (fairseq's language models do not use it)") from None
    try:
        import safetensors  # noqa: F401
        import transformers
    except ImportError as e:
        raise UsageError(f"--to-hf needs transformers and safetensors ({e.name} is missing): "
                         f"pip install 'fairseq_megatron[hf]'") from None
    return transformers


def xglm_config(config, vocab_size: int, dtype: torch.dtype) -> dict:
    """The ``XGLMConfig`` fields of our model config ``config`` (a checkpoint's
    ``cfg.model`` or ``args``).

    Raises:
        UsageError: an option XGLM cannot express.
    """
    def value(name, default=None):
        return config_value(config, name, default)

    refused = []
    if value("decoder_learned_pos", False):
        refused.append("learned positions (--decoder-learned-pos); XGLM's are sinusoidal")
    if value("no_token_positional_embeddings", False):
        refused.append("no positions (--no-token-positional-embeddings)")
    if not value("decoder_normalize_before", True):
        refused.append("post-norm layers; XGLM's are pre-norm")
    if value("no_decoder_final_norm", False):
        refused.append("no final layer norm (--no-decoder-final-norm)")
    if value("layernorm_embedding", False):
        refused.append("a layer norm after the embedding (--layernorm-embedding)")
    activation = value("activation_fn", "gelu")
    if activation not in ACTIVATIONS:
        refused.append(f"--activation-fn {activation}")
    if refused:
        raise UsageError(f"--to-hf: XGLM cannot express {'; '.join(refused)}")
    embed_dim = int(value("decoder_embed_dim"))
    return {
        "vocab_size": vocab_size,
        "max_position_embeddings": int(value("max_target_positions", None) or value("tokens_per_sample", 1024)),
        "d_model": embed_dim,
        "ffn_dim": int(value("decoder_ffn_embed_dim")),
        "num_layers": int(value("decoder_layers")),
        "attention_heads": int(value("decoder_attention_heads")),
        "activation_function": ACTIVATIONS[activation],
        "dropout": float(value("dropout", 0.1)),
        "attention_dropout": float(value("attention_dropout", 0.0)),
        "activation_dropout": float(value("activation_dropout", 0.0) or value("relu_dropout", 0.0) or 0.0),
        "layerdrop": float(value("decoder_layerdrop", 0.0) or 0.0),
        "scale_embedding": not value("no_scale_embedding", False),
        "tie_word_embeddings": bool(value("share_decoder_input_output_embed", False)),
        "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2, "decoder_start_token_id": 2,
        "dtype": str(dtype).replace("torch.", ""),
    }


def refuse_masked_rows(config, vocab_size: int, flag: str, target: str) -> None:
    """Refuse to export a model with masked vocabulary rows
    (``--masked-vocab-rows``, an import's) among the ``vocab_size`` rows
    exported: ``target`` has no such mask, and those rows (zero, or a second
    copy of a row) would take probability.

    Raises:
        UsageError: as said.
    """
    from fairseq_megatron.models.masked_vocab_rows import format_rows, parse_rows

    masked = [row for rows in parse_rows(config_value(config, "masked_vocab_rows")) for row in rows if row < vocab_size]
    if masked:
        raise UsageError(f"{flag}: the model never predicts its rows {format_rows(masked)} (--masked-vocab-rows, "
                         f"the rows an imported model's source lacks), which {target} cannot express")


def source_rows_beyond(config, vocab_size: int, rows: int) -> int:
    """Where the rows an export keeps end: at ``vocab_size`` (the
    dictionary's), or, for a model imported from transformers
    (``--masked-vocab-rows``), past the unmasked rows after it, which are
    its source's own rows beyond its tokenizer (OPT's 50265 to 50271), as
    the source computed its softmax over them; ``rows``: the checkpoint's."""
    from fairseq_megatron.models.masked_vocab_rows import parse_rows

    masked = parse_rows(config_value(config, "masked_vocab_rows"))
    if not masked:
        return vocab_size
    end = vocab_size
    while end < rows and not any(end in r for r in masked):
        end += 1
    return end


def hf_name(key: str) -> Optional[str]:
    """The XGLMForCausalLM parameter name of our key, or None for a key the
    export drops (fairseq's version marker, the positions' placeholder).

    Raises:
        CheckpointError: a key XGLM has no place for.
    """
    if key in _DROPPED:
        return None
    m = _LAYER.match(key)
    if m:
        return f"model.layers.{m.group(1)}.{m.group(2)}.{m.group(3)}"
    names = {"decoder.embed_tokens.weight": "model.embed_tokens.weight",
             "decoder.layer_norm.weight": "model.layer_norm.weight",
             "decoder.layer_norm.bias": "model.layer_norm.bias",
             "decoder.output_projection.weight": "lm_head.weight"}
    if key not in names:
        raise CheckpointError(f"--to-hf: XGLM has no parameter for {key}")
    return names[key]


def check_output_directory(output_dir: str) -> None:
    """Refuse an output directory that holds files (another model's, or
    anything else: the export would mix with them) or that a file stands in
    the way of.

    Raises:
        UsageError: as said.
    """
    check_directory_can_be_made(output_dir, f"--output {output_dir}")
    if os.path.isdir(output_dir) and os.listdir(output_dir):
        raise UsageError(f"--output {output_dir} is a directory that holds files; --to-hf writes a new or empty one")


class _ShardWriter:
    """Writes whole tensors into safetensors shards of at most ``max_bytes``
    (a larger tensor gets a shard of its own), each as soon as it is full."""

    def __init__(self, directory: str, max_bytes: int, verify: bool):
        self.directory, self.max_bytes, self.verify = directory, max_bytes, verify
        self.files: List[Dict[str, str]] = []  # per shard: {name: checksum}
        self.pending: Dict[str, torch.Tensor] = {}
        self.pending_bytes = self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        path = os.path.join(self.directory, f"shard-{len(self.files)}.safetensors")
        save_file(self.pending, path, metadata={"format": "pt"})
        with_the_mode_of_a_new_file(path)
        self.files.append({name: tensor_checksum(t) for name, t in self.pending.items()} if self.verify
                          else dict.fromkeys(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Give the shards transformers' names, write the index for several,
        and with ``verify`` re-read each and compare per-tensor checksums.

        Raises:
            CheckpointError: a shard reads back different.
        """
        from safetensors import safe_open

        self.flush()
        count = len(self.files)
        names = (["model.safetensors"] if count == 1 else
                 [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)])
        for k, (name, tensors) in enumerate(zip(names, self.files)):
            path = os.path.join(self.directory, name)
            os.replace(os.path.join(self.directory, f"shard-{k}.safetensors"), path)
            if self.verify:
                with safe_open(path, framework="pt") as f:
                    for key, checksum in tensors.items():
                        if tensor_checksum(f.get_tensor(key)) != checksum:
                            raise CheckpointError(f"verification of {path} failed at tensor {key}")
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {key: name for name, tensors in zip(names, self.files) for key in tensors}}
            with open(os.path.join(self.directory, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)


def _model_card(config: dict, source: str, tokenizer: bool) -> str:
    return f"""---
library_name: transformers
license: # fill in: the license of the checkpoint's weights
---

# {os.path.basename(os.path.normpath(os.path.dirname(os.path.abspath(source)))) or "model"}

A language model trained with fairseq and fairseq_megatron, exported with
`fairseq-megatron-reshard --to-hf` from `{source}`.

Architecture: `XGLMForCausalLM` (fairseq's `transformer_lm`: pre-norm,
sinusoidal positions, token embeddings scaled by sqrt(d)); {config["num_layers"]}
layers, hidden {config["d_model"]}, FFN {config["ffn_dim"]}, {config["attention_heads"]} heads, vocabulary
{config["vocab_size"]}, {config["dtype"]} weights, output projection
{"tied to" if config["tie_word_embeddings"] else "separate from"} the token embedding.

Token ids are those of the fairseq dictionary the model was trained with.
Sequences start with `</s>` (id 2), as fairseq's language models read them;
{"the tokenizer prepends it." if tokenizer else "no tokenizer was exported (no GPT-2 BPE files were given)."}
"""


def export_to_transformers(input_path: str, output_dir: str, dictionary=None, encoder_json: Optional[str] = None,
                           vocab_bpe: Optional[str] = None, dtype: Optional[str] = None, verify: bool = True,
                           max_shard_bytes: int = MAX_SHARD_BYTES, parts: Optional[PartFiles] = None) -> str:
    """Write checkpoint ``input_path`` (saved at any model-parallel size) as a
    transformers ``XGLMForCausalLM`` directory ``output_dir``.

    ``dictionary``: the fairseq ``Dictionary`` of the data (its size is the
    exported vocabulary; rows beyond it are ``madeupword`` padding, dropped
    as by ``--to-fairseq``); None keeps the rows of the dictionary the
    checkpoint records. ``encoder_json``/``vocab_bpe``: GPT-2's BPE files,
    to write a tokenizer onto ``dictionary``'s ids. ``dtype``: one of
    :data:`DTYPES`, default the checkpoint's. ``verify``: re-read every
    shard and compare per-tensor checksums.

    Raises:
        UsageError / CheckpointError / FileNotFoundError: missing,
            truncated or mixed parts; an option XGLM cannot express, masked
            vocabulary rows among those exported; a dictionary whose padding index is not 1 or that is not the
            checkpoint's; bad BPE files; an output directory holding files.
            All before anything is written.
    """
    transformers = require_transformers()
    check_output_directory(output_dir)
    if (encoder_json is None) != (vocab_bpe is None):
        raise UsageError("--encoder-json and --vocab-bpe go together: the tokenizer needs both")
    if encoder_json is not None and dictionary is None:
        raise UsageError("--encoder-json/--vocab-bpe need --dict: the tokenizer maps GPT-2 ids to its ids")
    if dictionary is not None and dictionary.pad() != 1:
        raise UsageError(f"--dict: padding index {dictionary.pad()}; XGLM's positions need 1, as fairseq's "
                         f"dictionaries have it")
    parts = parts or PartFiles(input_path)
    config = model_config(parts.metadata)
    rows = parts.padded_vocab_size
    vocab_size = len(dictionary) if dictionary is not None else (config_value(config, "dictionary_size") or rows)
    if vocab_size > rows:
        raise CheckpointError(f"vocab size {vocab_size} is larger than the checkpoint's {rows} rows")
    tied = _tied(parts)
    if bool(config_value(config, "share_decoder_input_output_embed", False)) != tied:
        raise CheckpointError(f"{input_path}: the config says the output projection is "
                              f"{'' if tied else 'not '}tied to the embedding, and the weights say otherwise")
    vocab_size = source_rows_beyond(config, vocab_size, rows)
    refuse_masked_rows(config, vocab_size, "--to-hf", "XGLM")
    hf_config = xglm_config(config, vocab_size, DTYPES[dtype] if dtype else torch.float32)
    tokenizer = None
    if encoder_json is not None:
        from fairseq_megatron.checkpoint.hf_tokenizer import fairseq_gpt2_tokenizer

        tokenizer = fairseq_gpt2_tokenizer(encoder_json, vocab_bpe, dictionary)
        tokenizer.model_max_length = hf_config["max_position_embeddings"]

    try:
        os.makedirs(os.path.dirname(os.path.abspath(output_dir)), exist_ok=True)
        tmp = new_temporary(output_dir, directory=True)
    except OSError as e:
        raise write_error(output_dir, e) from None
    try:
        writer = _ShardWriter(tmp, max_shard_bytes, verify)
        target_dtype = DTYPES[dtype] if dtype else None
        for group in model_part_groups(parts, 0, 1, check_replicas=True):
            for key, tensor in group.items():
                name = hf_name(key)
                if name is None or (tied and name == "lm_head.weight"):
                    continue  # tied: XGLM's lm_head is its embedding
                if target_dtype is None:
                    target_dtype = tensor.dtype  # the checkpoint's: that of its first weight
                    hf_config["dtype"] = str(target_dtype).replace("torch.", "")
                if name in ("model.embed_tokens.weight", "lm_head.weight"):
                    tensor = tensor[:vocab_size]
                writer.add(name, tensor.to(target_dtype))
            del group
        writer.finish()
        transformers.XGLMConfig(architectures=["XGLMForCausalLM"], **hf_config).save_pretrained(tmp)
        transformers.GenerationConfig(bos_token_id=2, decoder_start_token_id=2, eos_token_id=2, pad_token_id=1,
                                      suppress_tokens=[1]).save_pretrained(tmp)
        if dictionary is not None:  # what --from-hf reads back: the symbol of each row
            dictionary.save(os.path.join(tmp, "dict.txt"))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
            _name_the_fast_tokenizer_class(os.path.join(tmp, "tokenizer_config.json"))
        with open(os.path.join(tmp, "README.md"), "w", encoding="utf-8") as f:
            f.write(_model_card(hf_config, input_path, tokenizer is not None))
        if os.path.isdir(output_dir):
            os.rmdir(output_dir)  # empty, checked above
        os.replace(tmp, output_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # first: the space it took is free again
        if is_write_failure(e):
            raise write_error(output_dir, e) from None
        raise
    return output_dir


def _tied(parts: PartFiles) -> bool:
    """Whether the weights tie the output projection to the embedding: it is
    absent, the same tensor, or (a checkpoint that a resharding to one stage
    wrote with an earlier release, two copies of one pipelined embedding)
    equal to it in every part."""
    projection, embedding = "decoder.output_projection.weight", "decoder.embed_tokens.weight"
    if projection in parts.aliases or projection not in parts.keys:
        return True
    models = parts.models()
    same = all(torch.equal(m[projection], m[embedding]) for m in models)
    del models  # unmaps the files
    return same


def _name_the_fast_tokenizer_class(path: str) -> None:
    """``PreTrainedTokenizerFast``, a name every transformers version since 4
    resolves (version 5 writes its own ``TokenizersBackend``); without a class,
    AutoTokenizer would pick XGLM's SentencePiece tokenizer."""
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
