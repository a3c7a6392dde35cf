"""Tensor-model-parallel Transformer language model and the Megatron architectures.

Registered under fairseq's own names (``model_parallel_transformer_lm``,
``transformer_lm_megatron``, ``transformer_lm_megatron_11b``; see
:mod:`fairseq_megatron.models.registry`), so the Megatron-11b recipe and checkpoints
work unchanged. State-dict keys and per-rank shapes are those of fairseq's
``model_parallel/models/transformer_lm.py`` + ``transformer.py``; the
decoder is :mod:`fairseq_megatron.models.model_parallel_transformer_decoder`.
"""

from typing import Optional

import torch
from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq.models.transformer_lm import TransformerLanguageModel, base_lm_architecture
from fairseq.utils import safe_getattr

from fairseq_megatron.errors import UsageError
from fairseq_megatron.models.arguments import add_model_arguments
from fairseq_megatron.models.masked_vocab_rows import parse_rows
from fairseq_megatron.models.model_parallel_transformer_decoder import ModelParallelTransformerDecoder
from fairseq_megatron.models.options import (
    check_dictionary_size,
    dictionary_checksum,
    check_options,
    pad_dictionary,
)
from fairseq_megatron.models.registry import take_over_model, take_over_model_architecture
from fairseq_megatron.modules import VocabParallelEmbedding, sharding
from fairseq_megatron.parallel import parallel_state

DEFAULT_MAX_TARGET_POSITIONS = 1024


@take_over_model("model_parallel_transformer_lm")
class ModelParallelTransformerLanguageModel(TransformerLanguageModel):
    """Decoder-only LM whose layers are split across the tensor-model-parallel group.

    Build with fairseq (``--arch transformer_lm_megatron_11b
    --model-parallel-size N``). Forward: ``src_tokens`` ``(B, T)`` ->
    logits ``(B, T, V)`` on every rank (gathered), or ``(B, T, V / N)`` with
    ``gather_logits=False`` (what the vocab-parallel criterion asks for).

    Raises (from ``build_model``):
        UsageError (a ValueError): the checkpoint's
            ``model_parallel_size`` differs from the running group size;
            the dictionary is not
            the one the checkpoint was trained with; and what
            :func:`check_options` refuses (heads or FFN size not divisible by
            the model-parallel size, conflicting precision flags,
            transformer_lm options these layers do not implement).
        NotImplementedError: adaptive input/softmax or character embeddings.
    """

    @staticmethod
    def add_args(parser):
        TransformerLanguageModel.add_args(parser)
        add_model_arguments(parser)

    @classmethod
    def build_model(cls, args, task, tensor_parallel=parallel_state.DEFAULT_GROUP):
        """The model for ``args`` as this rank's part (``tensor_parallel``:
        default this rank's group; a
        :class:`~fairseq_megatron.parallel.parallel_state.RankGroup` builds
        rank ``k`` of ``T`` without process groups), built once on the
        ``meta`` device with its initial weights queued
        (:class:`~fairseq_megatron.modules.sharding.DeferredInitialisation`),
        then drawn, unless whoever builds it fills them itself: our
        ``language_modeling`` task for every load of a checkpoint
        (``task.initial_weights_may_be_loaded``), and fairseq-train, whose
        trainer draws them after parallelizing the model, where no
        checkpoint fills them (``args.initial_weights_after_build``, set by
        :func:`~fairseq_megatron.fairseq_integration.train.main`). Such a
        model stays on ``meta`` until :meth:`materialize`;
        :meth:`load_state_dict` materializes it and drops the draws for a
        strict load, draws them first for a partial one, and
        :meth:`run_deferred_initialisation` draws them. Drawing is nearly all
        of the build: every rank draws each layer's full master tensor
        (:mod:`fairseq_megatron.modules.sharding`).
        """
        initialisation = sharding.DeferredInitialisation()
        model = cls._build(args, task, tensor_parallel, initialisation)
        model.deferred_initialisation = initialisation
        if not (getattr(task, "initial_weights_may_be_loaded", False)
                or safe_getattr(args, "initial_weights_after_build", False)):
            model.run_deferred_initialisation()
        return model

    @classmethod
    def _build(cls, args, task, tensor_parallel=parallel_state.DEFAULT_GROUP,
               initialisation: Optional[sharding.DeferredInitialisation] = None):
        """The model for ``args``, its sharded weights queued on
        ``initialisation`` (on the ``meta`` device until it runs), or drawn
        now where it is None."""
        tensor_parallel = parallel_state.resolve_tensor_parallel(tensor_parallel)
        base_lm_architecture(args)
        size = tensor_parallel.size
        wanted = safe_getattr(args, "model_parallel_size", None)
        wanted = 1 if wanted is None else int(wanted)
        if wanted != size:
            raise UsageError(
                f"the model is configured for model-parallel size {wanted} but this run's "
                f"model-parallel group has {size} rank(s); pass --model-parallel-size "
                f"{size} with a checkpoint saved at that size (or reshard the checkpoint)"
            )
        check_options(args, size)
        if args.decoder_layers_to_keep:
            args.decoder_layers = len(args.decoder_layers_to_keep.split(","))
        if safe_getattr(args, "max_target_positions", None) is None:
            args.max_target_positions = safe_getattr(args, "tokens_per_sample", DEFAULT_MAX_TARGET_POSITIONS)

        recorded = safe_getattr(args, "padded_vocab_size", None)
        # A checkpoint's config (fairseq-eval-lm, -generate, the hub) records the
        # dictionary its model was trained with; a new model records its own.
        dictionary = task.source_dictionary
        trained_with = safe_getattr(args, "dictionary_size", None)
        check_dictionary_size(dictionary.symbols, len(dictionary), trained_with, "the checkpoint's model",
                              safe_getattr(args, "dictionary_checksum", None),
                              bool(safe_getattr(args, "accept_other_dictionary", False)))
        if trained_with is None:
            args.dictionary_size = len(dictionary)
        if safe_getattr(args, "dictionary_checksum", None) is None or safe_getattr(args, "accept_other_dictionary",
                                                                                   False):
            args.dictionary_checksum = dictionary_checksum(dictionary.symbols[:args.dictionary_size])
        args.padded_vocab_size = pad_dictionary(dictionary, size, recorded)
        if pad_dictionary(task.target_dictionary, size, args.padded_vocab_size) != args.padded_vocab_size:
            raise ValueError("source and target dictionaries differ in size")
        parse_rows(safe_getattr(args, "masked_vocab_rows", None), args.padded_vocab_size)  # refuses rows beyond

        embed_tokens = VocabParallelEmbedding(len(dictionary), args.decoder_input_dim, dictionary.pad(),
                                              group=tensor_parallel, initialisation=initialisation)
        return cls(ModelParallelTransformerDecoder(args, task.target_dictionary, embed_tokens, tensor_parallel,
                                                   initialisation))

    @classmethod
    def build_embedding(cls, args, dictionary, embed_dim, path=None):
        return VocabParallelEmbedding(len(dictionary), embed_dim, dictionary.pad())

    def get_targets(self, sample, net_output):
        """fairseq's (``sample["target"]``, ``(B, T)``); under context
        parallelism the targets of this rank's output positions, ``(B, T' / C)``
        (:meth:`~fairseq_megatron.models.model_parallel_transformer_decoder.ModelParallelTransformerDecoder.local_targets`)."""
        return self.decoder.local_targets(sample["target"])

    # The draws left out of this model's build (see build_model); None once
    # they ran or a checkpoint made them needless.
    deferred_initialisation: Optional[sharding.DeferredInitialisation] = None

    def materialize(self, device=None) -> None:
        """Give the weights a deferred build left on the ``meta`` device
        memory on ``device`` (default: torch's default device, where a build
        that draws at once makes them, as its biases), NaN-filled until a checkpoint or the deferred
        draws fill them (:meth:`~fairseq_megatron.modules.sharding.DeferredInitialisation.materialize`).
        Call it after dropping what this rank does not hold."""
        if self.deferred_initialisation is not None:
            self.deferred_initialisation.materialize(self, device)

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        """fairseq's, for a model whose initialisation is deferred as well: a
        strict load fills every parameter (or raises), so the draws are
        dropped; before a non-strict one they run, as the parameters the
        state dict lacks keep their initial values. A parameter sharded over
        data-parallel ranks (a ``DTensor``) takes this rank's piece of the
        whole tensor the checkpoint holds."""
        self.materialize()
        if not strict:
            self.run_deferred_initialisation()
        state_dict = sharded_like_the_parameters(self, state_dict)
        result = super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)
        self.deferred_initialisation = None  # strict: every parameter was filled
        return result

    def run_deferred_initialisation(self) -> bool:
        """Draw the initial weights that the build deferred, if any are
        still due (materializing them first); True if it drew them."""
        deferred = self.deferred_initialisation
        if deferred is None:
            return False
        self.materialize()
        self.deferred_initialisation = None
        deferred.run()
        return True


def sharded_like_the_parameters(model, state_dict):
    """``state_dict`` with each whole tensor for a parameter that ``model``
    holds sharded (a ``DTensor``, sharded data parallelism) replaced by a
    ``DTensor`` of this rank's piece of it, so that torch's loading copies
    shard into shard. Returns ``state_dict`` itself where nothing is sharded."""
    sharded = {key: param for key, param in model.state_dict(keep_vars=True).items() if hasattr(param, "device_mesh")}
    if not sharded:
        return state_dict
    from torch.distributed.tensor import DTensor

    out = type(state_dict)(state_dict)
    for key, param in sharded.items():
        value = state_dict.get(key)
        if torch.is_tensor(value) and not hasattr(value, "device_mesh"):
            out[key] = DTensor.from_local(sharding.local_piece(param, value).to(param.device, param.dtype),
                                          param.device_mesh, param.placements, shape=param.shape,
                                          stride=param.stride(), run_check=False)
    return out


def _megatron_common(args, ffn_multiple: int) -> None:
    args.decoder_embed_dim = safe_getattr(args, "decoder_embed_dim", 3072)
    args.decoder_ffn_embed_dim = safe_getattr(args, "decoder_ffn_embed_dim", args.decoder_embed_dim * ffn_multiple)
    args.decoder_layers = safe_getattr(args, "decoder_layers", 72)
    args.decoder_attention_heads = safe_getattr(args, "decoder_attention_heads", 32)
    args.dropout = safe_getattr(args, "dropout", 0.1)
    args.attention_dropout = safe_getattr(args, "attention_dropout", 0.1)
    args.activation_fn = safe_getattr(args, "activation_fn", "gelu")
    base_lm_architecture(args)  # pre-norm, sinusoidal positions, final layer norm
    check_options(args, int(safe_getattr(args, "model_parallel_size", 1) or 1))


@take_over_model_architecture("model_parallel_transformer_lm", "transformer_lm_megatron")
def transformer_lm_megatron(args):
    """72 layers, hidden 3072, FFN 4 x 3072 = 12288, 32 heads, gelu, dropout 0.1."""
    _megatron_common(args, ffn_multiple=4)


@take_over_model_architecture("model_parallel_transformer_lm", "transformer_lm_megatron_11b")
def transformer_lm_megatron_11b(args):
    """Megatron-11b: 72 layers, hidden 3072, FFN 6 x 3072 = 18432, 32 heads, gelu, dropout 0.1."""
    _megatron_common(args, ffn_multiple=6)


def is_our_model(model) -> bool:
    """Whether ``model`` (possibly wrapped, e.g. in DDP) is one of our LMs."""
    for _ in range(3):  # fairseq's ModuleProxyWrapper around torch's DDP around the model, at most
        if isinstance(model, ModelParallelTransformerLanguageModel):
            return True
        model = getattr(model, "module", None) if isinstance(model, torch.nn.Module) else None
    return False


def is_model_parallel_arch(name) -> bool:
    """Whether ``name`` (a config's ``_name`` or ``arch``) is an architecture
    of :class:`ModelParallelTransformerLanguageModel`."""
    return isinstance(name, str) and issubclass(
        ARCH_MODEL_REGISTRY.get(name, type(None)), ModelParallelTransformerLanguageModel)


def leave_initial_weights_to_the_trainer(model_cfg, leave: bool = True) -> None:
    """Say in model config ``model_cfg`` (an ``argparse.Namespace`` or a
    ``DictConfig``) whether the trainer that follows the build draws the
    initial weights (``initial_weights_after_build``, read by
    :meth:`ModelParallelTransformerLanguageModel.build_model`); unsaid again
    once the trainer has the model, so that no checkpoint records it."""
    from omegaconf import DictConfig, open_dict

    if isinstance(model_cfg, DictConfig):
        with open_dict(model_cfg):
            if leave:
                model_cfg.initial_weights_after_build = True
            else:
                model_cfg.pop("initial_weights_after_build", None)
    elif leave:
        model_cfg.initial_weights_after_build = True
    else:
        vars(model_cfg).pop("initial_weights_after_build", None)

