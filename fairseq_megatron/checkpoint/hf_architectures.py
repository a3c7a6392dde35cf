"""The transformers architectures that are fairseq ``transformer_lm``s, read as our model.

GPT-2, OPT and fairseq's dense language models (``XGLMForCausalLM``, which
``--to-hf`` also writes) are all pre-norm decoders with a final layer norm
and, usually, an output projection tied to the token embedding; they
differ in positions, activation, embedding scale and vocabulary order
(:mod:`.hf_vocabulary`). Each class here reads one of them: the model
options our ``transformer_lm_megatron`` needs to be the same function
(:meth:`Architecture.options`), and its tensors under our state-dict keys,
whole (one model part), a layer at a time.

========================  ==========================  ==========================  ===========================
                          ``GPT2LMHeadModel``          ``OPTForCausalLM``           ``XGLMForCausalLM``
========================  ==========================  ==========================  ===========================
positions                 learned, counted from 0:     learned, offset 2: fairseq's  sinusoidal, offset 2:
                          our rows 2.. (fairseq         rows as they are              fairseq's (no weights)
                          counts from ``pad + 1``)
activation                ``gelu_new`` = fairseq's     ``relu``                      ``gelu``
                          ``gelu_accurate``
token embedding scale     none                          none                          sqrt(d) (``scale_embedding``)
linear weights            ``Conv1D`` (in, out):         ``nn.Linear``, our names      ``nn.Linear``, our names
                          transposed; ``c_attn``
                          split into q, k, v
========================  ==========================  ==========================  ===========================

Sources: ``transformers/models/{gpt2,opt,xglm}/modeling_*.py``; fairseq's
``fairseq/models/transformer/transformer_decoder.py`` and
``fairseq/modules/{learned,sinusoidal}_positional_embedding.py``.
"""

import math
from typing import Dict, List, Optional, Tuple

import torch

from fairseq_megatron.checkpoint.hf_vocabulary import (
    VocabularyPlan,
    check_merges,
    check_specials,
    gpt2_symbols,
    read_dict_symbols,
    read_tokenizer,
    same_rows_plan,
    shifted_plan,
)
from fairseq_megatron.checkpoint.hf_weights import SourceWeights
from fairseq_megatron.checkpoint.layout import CheckpointError
from fairseq_megatron.errors import UsageError

# transformers' activation names -> fairseq's (--activation-fn) for the same function
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_accurate", "tanh": "tanh", "linear": "linear",
               "silu": "swish", "swish": "swish"}
# fairseq's LayerNorm (torch's default eps); transformers' OPT and XGLM use it too
LAYER_NORM_EPS = 1e-5
# the padding index of a fairseq dictionary; fairseq's positions start at PAD + 1
PAD = 1


class Architecture:
    """One transformers checkpoint (``config``: its ``config.json``;
    ``weights``: its tensors; ``directory``: where both are) read as our
    ``transformer_lm_megatron``. Subclasses give the names and conversions.

    Raises (on construction):
        UsageError: a configuration field fairseq's decoder cannot express,
            naming it.
    """

    name = ""
    layer_prefixes: Tuple[str, ...] = ()  # where the layers' tensors are: f"{prefix}{i}." + a name

    def __init__(self, config: dict, weights: SourceWeights, directory: str):
        self.config, self.weights, self.directory = config, weights, directory
        self.check_config()
        self.prefix = self._prefix()

    # ---------------------------------------------------------- what subclasses give

    def check_config(self) -> None:
        raise NotImplementedError

    def options(self) -> dict:
        """Our model options for this model (``decoder_layers``, ...,
        ``activation_fn``, ``decoder_learned_pos``, ``no_scale_embedding``,
        ``share_decoder_input_output_embed``, ``max_target_positions``,
        dropouts)."""
        raise NotImplementedError

    def layer_tensors(self, i: int) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
        """``{our name within layer i: (source name, source shape)}`` of the
        tensors read as they are."""
        raise NotImplementedError

    def read_layer(self, i: int) -> Dict[str, torch.Tensor]:
        """Layer ``i``'s tensors under our names (``self_attn.q_proj.weight``, ...), whole."""
        return {ours: self.weights.get(source) for ours, (source, _) in self.layer_tensors(i).items()}

    def embedding_names(self) -> Tuple[str, Optional[str]]:
        """The source names of the token embedding and of an untied output projection (None: tied)."""
        raise NotImplementedError

    def other_tensors(self) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
        """``{our key: (source name, source shape)}`` of the positions and the final layer norm."""
        raise NotImplementedError

    def read_others(self) -> Dict[str, torch.Tensor]:
        """The positions and the final layer norm under our keys."""
        return {ours: self.weights.get(source) for ours, (source, _) in self.other_tensors().items()}

    def vocabulary(self, multiple: int, encoder: Optional[Dict[str, int]], encoder_json: Optional[str],
                   merges: Optional[List[Tuple[str, str]]], vocab_bpe: Optional[str]) -> VocabularyPlan:
        """Our dictionary and where each row comes from (:mod:`.hf_vocabulary`),
        padded to ``multiple``; ``encoder``/``merges``: GPT-2's BPE files
        (``--encoder-json``/``--vocab-bpe``), where given."""
        raise NotImplementedError

    # ---------------------------------------------------------- shared

    def field(self, name: str, default=None):
        return self.config.get(name, default)

    def refuse(self, name: str, why: str) -> None:
        """Raise the one line for field ``name`` of ``config.json``."""
        raise UsageError(f"{self.directory}/config.json: {self.name} with {name} = {self.field(name)!r}: {why}")

    def require(self, *names: str) -> None:
        for name in names:
            value = self.field(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                self.refuse(name, "a positive whole number is needed")

    @property
    def rows(self) -> int:
        """The source's token-embedding rows."""
        return int(self.field("vocab_size"))

    @property
    def tied(self) -> bool:
        return bool(self.field("tie_word_embeddings", True))

    def _prefix(self) -> str:
        """The prefix this file's layer names carry (transformers saved some
        models from the base model, without the head's prefix)."""
        for prefix in self.layer_prefixes:
            if any(name.startswith(f"{prefix}0.") for name in self.weights.names()):
                return prefix
        raise CheckpointError(f"{self.directory} holds no tensor of layer 0 of a {self.name} "
                              f"(looked for {' or '.join(p + '0.*' for p in self.layer_prefixes)})")

    def expected(self) -> Dict[str, Tuple[int, ...]]:
        """Every source tensor the import reads, with the shape the config gives it."""
        out = {}
        for i in range(int(self.options()["decoder_layers"])):
            out.update(dict(self.layer_tensors(i).values()))
        out.update(dict(self.other_tensors().values()))
        embed, projection = self.embedding_names()
        dim = int(self.options()["decoder_embed_dim"])
        out[embed] = (self.rows, dim)
        if projection is not None:
            out[projection] = (self.rows, dim)
        return out

    def check_tensors(self) -> None:
        """Refuse a checkpoint that lacks a tensor the config implies, or holds one of another shape.

        Raises:
            CheckpointError: naming the tensor.
        """
        for name, shape in self.expected().items():
            if name not in self.weights:
                raise CheckpointError(f"{self.directory} lacks the tensor {name} of its {self.name}")
            found = self.weights.shape(name)
            if tuple(found) != tuple(shape):
                raise CheckpointError(f"{self.directory}: {name} has shape {tuple(found)}, its config.json gives "
                                      f"{tuple(shape)}")

    def tokenizer_plan(self, multiple: int, encoder, encoder_json, merges, vocab_bpe, why: str) -> VocabularyPlan:
        """:func:`~.hf_vocabulary.same_rows_plan` from the directory's
        tokenizer, its pieces written as GPT-2 BPE ids through ``encoder``
        (``why``: what the message says the encoder is needed for).

        Raises:
            UsageError: no tokenizer, no ``--encoder-json``, or what
                :mod:`.hf_vocabulary` refuses.
        """
        tokenizer = read_tokenizer(self.directory)
        if tokenizer is None:
            raise UsageError(f"{self.directory} holds no tokenizer (tokenizer.json or vocab.json): {why}")
        if encoder is None:
            raise UsageError(f"{self.name}: {why}; pass --encoder-json (GPT-2's encoder.json) and --vocab-bpe")
        check_specials(tokenizer, self.directory)
        if merges is not None:
            check_merges(tokenizer, merges, vocab_bpe, self.directory)
        self.check_rows(len(tokenizer.pieces))
        return same_rows_plan(self.rows, gpt2_symbols(tokenizer, encoder, encoder_json, 4, self.directory), multiple)

    def check_rows(self, tokens: int) -> None:
        """Refuse fewer embedding rows than tokenizer entries.

        Raises:
            CheckpointError: as said.
        """
        if self.rows < tokens:
            raise CheckpointError(f"{self.directory}: {self.rows} embedding rows (vocab_size) for the {tokens} "
                                  f"entries of its tokenizer")


class GPT2(Architecture):
    """``GPT2LMHeadModel`` (``transformers/models/gpt2/modeling_gpt2.py``)."""

    name = "GPT2LMHeadModel"
    layer_prefixes = ("transformer.h.", "h.")

    def check_config(self) -> None:
        self.require("n_layer", "n_embd", "n_head", "n_positions", "vocab_size")
        if self.field("activation_function", "gelu_new") != "gelu_new":
            self.refuse("activation_function", "fairseq's decoder has GPT-2's gelu_new (gelu_accurate), and this "
                                               "import reads no other for GPT-2")
        if not math.isclose(float(self.field("layer_norm_epsilon", LAYER_NORM_EPS)), LAYER_NORM_EPS):
            self.refuse("layer_norm_epsilon", f"fairseq's layer norms use {LAYER_NORM_EPS}")
        for flag, why in (("scale_attn_by_inverse_layer_idx", "fairseq's attention scales by 1/sqrt(head dim) alone"),
                          ("reorder_and_upcast_attn", "fairseq's attention has no such reordering"),
                          ("add_cross_attention", "a decoder-only LM has no cross-attention")):
            if self.field(flag, False):
                self.refuse(flag, why)
        if not self.field("scale_attn_weights", True):
            self.refuse("scale_attn_weights", "fairseq's attention always scales by 1/sqrt(head dim)")
        if self.field("n_embd") % self.field("n_head"):
            self.refuse("n_head", f"it does not divide n_embd {self.field('n_embd')}")

    def options(self) -> dict:
        embed = int(self.field("n_embd"))
        return {
            "decoder_layers": int(self.field("n_layer")), "decoder_embed_dim": embed,
            "decoder_ffn_embed_dim": int(self.field("n_inner") or 4 * embed),
            "decoder_attention_heads": int(self.field("n_head")), "activation_fn": "gelu_accurate",
            "decoder_learned_pos": True, "no_scale_embedding": True, "share_decoder_input_output_embed": self.tied,
            "max_target_positions": int(self.field("n_positions")),
            "dropout": float(self.field("resid_pdrop", 0.1)), "attention_dropout": float(self.field("attn_pdrop", 0.1)),
        }

    def layer_tensors(self, i: int) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
        p, c = f"{self.prefix}{i}.", int(self.field("n_embd"))
        f = self.options()["decoder_ffn_embed_dim"]
        return {
            "self_attn_layer_norm.weight": (p + "ln_1.weight", (c,)), "self_attn_layer_norm.bias": (p + "ln_1.bias", (c,)),
            "c_attn.weight": (p + "attn.c_attn.weight", (c, 3 * c)), "c_attn.bias": (p + "attn.c_attn.bias", (3 * c,)),
            "self_attn.out_proj.weight": (p + "attn.c_proj.weight", (c, c)),
            "self_attn.out_proj.bias": (p + "attn.c_proj.bias", (c,)),
            "final_layer_norm.weight": (p + "ln_2.weight", (c,)), "final_layer_norm.bias": (p + "ln_2.bias", (c,)),
            "fc1.weight": (p + "mlp.c_fc.weight", (c, f)), "fc1.bias": (p + "mlp.c_fc.bias", (f,)),
            "fc2.weight": (p + "mlp.c_proj.weight", (f, c)), "fc2.bias": (p + "mlp.c_proj.bias", (c,)),
        }

    def read_layer(self, i: int) -> Dict[str, torch.Tensor]:
        """GPT-2's ``Conv1D`` computes ``x @ W + b`` with ``W`` ``(in, out)``:
        ``nn.Linear``'s weight is ``W.T``; ``c_attn``'s output is q, k, v
        side by side."""
        layer = super().read_layer(i)
        for name in ("self_attn.out_proj.weight", "fc1.weight", "fc2.weight"):
            layer[name] = layer[name].t().contiguous()
        weight, bias = layer.pop("c_attn.weight").t(), layer.pop("c_attn.bias")
        for name, w, b in zip("qkv", weight.chunk(3, dim=0), bias.chunk(3, dim=0)):
            layer[f"self_attn.{name}_proj.weight"], layer[f"self_attn.{name}_proj.bias"] = w.contiguous(), b.clone()
        return layer

    def _top(self) -> str:
        return self.prefix[: -len("h.")]  # "transformer." or ""

    def embedding_names(self) -> Tuple[str, Optional[str]]:
        return f"{self._top()}wte.weight", None if self.tied else "lm_head.weight"

    def other_tensors(self) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
        c, top = int(self.field("n_embd")), self._top()
        return {"decoder.embed_positions.weight": (f"{top}wpe.weight", (int(self.field("n_positions")), c)),
                "decoder.layer_norm.weight": (f"{top}ln_f.weight", (c,)),
                "decoder.layer_norm.bias": (f"{top}ln_f.bias", (c,))}

    def read_others(self) -> Dict[str, torch.Tensor]:
        """GPT-2 counts positions from 0, fairseq's learned positions from
        ``PAD + 1`` = 2 (``fairseq/utils.py``, ``make_positions``): our rows 0
        and 1 are zero (row 1, the padding index's, is never read)."""
        out = super().read_others()
        positions = out["decoder.embed_positions.weight"]
        out["decoder.embed_positions.weight"] = torch.cat([positions.new_zeros(PAD + 1, positions.size(1)), positions])
        return out

    def vocabulary(self, multiple, encoder, encoder_json, merges, vocab_bpe) -> VocabularyPlan:
        """GPT-2's rows are GPT-2 BPE ids: without ``--encoder-json`` row k
        is the symbol ``k``; with it, the id ``encoder.json`` gives the
        piece of row k in the directory's tokenizer (the same for GPT-2's
        own files). fairseq's ``</s>`` is the end-of-text token
        (``eos_token_id``)."""
        eos = self.field("eos_token_id")
        if not isinstance(eos, int) or not 0 <= eos < self.rows:
            self.refuse("eos_token_id", f"fairseq's </s> takes the end-of-text token's row, which must be one of the "
                                        f"{self.rows} rows")
        tokenizer = read_tokenizer(self.directory)
        if tokenizer is not None:
            self.check_rows(len(tokenizer.pieces))
            if eos >= len(tokenizer.pieces):
                self.refuse("eos_token_id", f"the directory's tokenizer has {len(tokenizer.pieces)} tokens and none "
                                            f"of that id: it is not this model's tokenizer")
            if merges is not None:
                check_merges(tokenizer, merges, vocab_bpe, self.directory)
        if encoder is not None and tokenizer is not None:
            symbols = gpt2_symbols(tokenizer, encoder, encoder_json, 0, self.directory)
        else:
            symbols = [str(k) for k in range(len(tokenizer.pieces) if tokenizer is not None else self.rows)]
        return shifted_plan(self.rows, len(symbols), eos, symbols, multiple)


class OPT(Architecture):
    """``OPTForCausalLM`` (``transformers/models/opt/modeling_opt.py``; metaseq's models)."""

    name = "OPTForCausalLM"
    layer_prefixes = ("model.decoder.layers.", "decoder.layers.")

    def check_config(self) -> None:
        self.require("num_hidden_layers", "hidden_size", "ffn_dim", "num_attention_heads", "max_position_embeddings",
                     "vocab_size")
        if not self.field("do_layer_norm_before", True):
            self.refuse("do_layer_norm_before", "fairseq's decoder here is pre-norm (OPT-350m is post-norm)")
        if self.field("word_embed_proj_dim", self.field("hidden_size")) != self.field("hidden_size"):
            self.refuse("word_embed_proj_dim", f"it differs from hidden_size {self.field('hidden_size')} (OPT-350m's "
                                               f"projections in and out of the layers), which this decoder lacks")
        if not self.field("enable_bias", True):
            self.refuse("enable_bias", "fairseq's linears and layer norms have biases")
        if not self.field("layer_norm_elementwise_affine", True):
            self.refuse("layer_norm_elementwise_affine", "fairseq's layer norms have weights and biases")
        if self.field("_remove_final_layer_norm", False):
            self.refuse("_remove_final_layer_norm", "fairseq's pre-norm decoder ends in a layer norm")
        if self.field("activation_function", "relu") not in ACTIVATIONS:
            self.refuse("activation_function", f"fairseq has {', '.join(sorted(ACTIVATIONS))} of transformers' names")
        if self.field("hidden_size") % self.field("num_attention_heads"):
            self.refuse("num_attention_heads", f"it does not divide hidden_size {self.field('hidden_size')}")

    def options(self) -> dict:
        return {
            "decoder_layers": int(self.field("num_hidden_layers")), "decoder_embed_dim": int(self.field("hidden_size")),
            "decoder_ffn_embed_dim": int(self.field("ffn_dim")),
            "decoder_attention_heads": int(self.field("num_attention_heads")),
            "activation_fn": ACTIVATIONS[self.field("activation_function", "relu")],
            "decoder_learned_pos": True, "no_scale_embedding": True, "share_decoder_input_output_embed": self.tied,
            "max_target_positions": int(self.field("max_position_embeddings")),
            "dropout": float(self.field("dropout", 0.1)), "attention_dropout": float(self.field("attention_dropout", 0.0)),
            "activation_dropout": float(self.field("activation_dropout", 0.0)),
        }

    def layer_tensors(self, i: int) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
        return _same_names(f"{self.prefix}{i}.", int(self.field("hidden_size")), int(self.field("ffn_dim")))

    def _top(self) -> str:
        return self.prefix[: -len("layers.")]  # "model.decoder." or "decoder."

    def embedding_names(self) -> Tuple[str, Optional[str]]:
        return f"{self._top()}embed_tokens.weight", None if self.tied else "lm_head.weight"

    def other_tensors(self) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
        """OPT's learned positions are offset by 2 (``OPTLearnedPositionalEmbedding``),
        fairseq's by ``PAD + 1`` = 2: the same rows."""
        c, top = int(self.field("hidden_size")), self._top()
        positions = int(self.field("max_position_embeddings")) + PAD + 1
        return {"decoder.embed_positions.weight": (f"{top}embed_positions.weight", (positions, c)),
                "decoder.layer_norm.weight": (f"{top}final_layer_norm.weight", (c,)),
                "decoder.layer_norm.bias": (f"{top}final_layer_norm.bias", (c,))}

    def vocabulary(self, multiple, encoder, encoder_json, merges, vocab_bpe) -> VocabularyPlan:
        return self.tokenizer_plan(multiple, encoder, encoder_json, merges, vocab_bpe,
                                   "OPT's token ids are its own, not GPT-2 BPE ids, and its tokenizer maps them")


class XGLM(Architecture):
    """``XGLMForCausalLM`` (``transformers/models/xglm/modeling_xglm.py``):
    fairseq's dense language models as transformers publishes them, and
    what ``--to-hf`` writes."""

    name = "XGLMForCausalLM"
    layer_prefixes = ("model.layers.", "layers.")

    def check_config(self) -> None:
        self.require("num_layers", "d_model", "ffn_dim", "attention_heads", "max_position_embeddings", "vocab_size")
        if self.field("activation_function", "gelu") not in ACTIVATIONS:
            self.refuse("activation_function", f"fairseq has {', '.join(sorted(ACTIVATIONS))} of transformers' names")
        if self.field("pad_token_id", PAD) != PAD:
            self.refuse("pad_token_id", f"XGLM's sinusoidal positions are offset by the padding index, fairseq's "
                                        f"dictionaries have it at {PAD}")
        if self.field("add_cross_attention", False):
            self.refuse("add_cross_attention", "a decoder-only LM has no cross-attention")
        if self.field("d_model") % self.field("attention_heads"):
            self.refuse("attention_heads", f"it does not divide d_model {self.field('d_model')}")

    def options(self) -> dict:
        return {
            "decoder_layers": int(self.field("num_layers")), "decoder_embed_dim": int(self.field("d_model")),
            "decoder_ffn_embed_dim": int(self.field("ffn_dim")),
            "decoder_attention_heads": int(self.field("attention_heads")),
            "activation_fn": ACTIVATIONS[self.field("activation_function", "gelu")],
            "decoder_learned_pos": False, "no_scale_embedding": not self.field("scale_embedding", True),
            "share_decoder_input_output_embed": self.tied,
            "max_target_positions": int(self.field("max_position_embeddings")),
            "dropout": float(self.field("dropout", 0.1)), "attention_dropout": float(self.field("attention_dropout", 0.0)),
            "activation_dropout": float(self.field("activation_dropout", 0.0)),
        }

    def layer_tensors(self, i: int) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
        return _same_names(f"{self.prefix}{i}.", int(self.field("d_model")), int(self.field("ffn_dim")))

    def _top(self) -> str:
        return self.prefix[: -len("layers.")]  # "model." or ""

    def embedding_names(self) -> Tuple[str, Optional[str]]:
        return f"{self._top()}embed_tokens.weight", None if self.tied else "lm_head.weight"

    def other_tensors(self) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
        c, top = int(self.field("d_model")), self._top()
        return {"decoder.layer_norm.weight": (f"{top}layer_norm.weight", (c,)),
                "decoder.layer_norm.bias": (f"{top}layer_norm.bias", (c,))}

    def vocabulary(self, multiple, encoder, encoder_json, merges, vocab_bpe) -> VocabularyPlan:
        """A ``dict.txt`` beside the weights (``--to-hf`` writes the one it
        used) gives the symbols as they are; otherwise the tokenizer's pieces,
        as OPT's. A SentencePiece vocabulary (``facebook/xglm-*``) is
        refused: the data pipeline here is GPT-2 byte-level BPE."""
        import os

        dict_txt = os.path.join(self.directory, "dict.txt")
        if os.path.exists(dict_txt):
            symbols = read_dict_symbols(dict_txt)
            self.check_rows(4 + len(symbols))
            return same_rows_plan(self.rows, symbols, multiple)
        if os.path.exists(os.path.join(self.directory, "sentencepiece.bpe.model")):
            raise UsageError(f"{self.directory} is an XGLM with a SentencePiece vocabulary (facebook/xglm-*), which "
                             f"is not imported: fairseq_megatron's data pipeline is GPT-2 byte-level BPE (imported: "
                             f"GPT-2, OPT, and XGLM with a GPT-2 BPE tokenizer or the dict.txt --to-hf writes)")
        return self.tokenizer_plan(multiple, encoder, encoder_json, merges, vocab_bpe,
                                   "an XGLM without the dict.txt that --to-hf writes beside its weights has its "
                                   "tokenizer's ids, not GPT-2 BPE ids")


def _same_names(prefix: str, embed: int, ffn: int) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """A layer whose tensors have our names under ``prefix`` (OPT's and XGLM's, fairseq's own)."""
    shapes = {"self_attn.q_proj": (embed, embed), "self_attn.k_proj": (embed, embed), "self_attn.v_proj": (embed, embed),
              "self_attn.out_proj": (embed, embed), "self_attn_layer_norm": None, "fc1": (ffn, embed),
              "fc2": (embed, ffn), "final_layer_norm": None}
    out = {}
    for module, shape in shapes.items():
        out[f"{module}.weight"] = (f"{prefix}{module}.weight", shape or (embed,))
        out[f"{module}.bias"] = (f"{prefix}{module}.bias", (shape[0] if shape else embed,))
    return out


ARCHITECTURES = {cls.name: cls for cls in (GPT2, OPT, XGLM)}
MODEL_TYPES = {"gpt2": GPT2, "opt": OPT, "xglm": XGLM}


def architecture_of(config: dict, directory: str):
    """The :class:`Architecture` class for ``config.json`` ``config``: by its
    ``architectures`` list, else its ``model_type``.

    Raises:
        UsageError: any other architecture, naming it and the supported ones.
    """
    named = config.get("architectures") or []
    for name in named:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if not named and config.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[config["model_type"]]
    what = ", ".join(named) or f"model_type {config.get('model_type')!r}"
    raise UsageError(f"{directory}/config.json: {what} is not imported; --from-hf reads "
                     f"{', '.join(ARCHITECTURES)} (fairseq's transformer_lm family)")
