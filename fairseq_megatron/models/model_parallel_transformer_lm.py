"""Tensor-model-parallel Transformer language model and the Megatron architectures.

Registered under fairseq's own names (``model_parallel_transformer_lm``,
``transformer_lm_megatron``, ``transformer_lm_megatron_11b``; see
:mod:`fairseq_megatron.models.registry`), so the Megatron-11b recipe and checkpoints
work unchanged. State-dict keys and per-rank shapes are those of fairseq's
``model_parallel/models/transformer_lm.py`` + ``transformer.py``.
"""

import contextlib
import functools
import logging
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq.models.transformer import TransformerConfig, TransformerDecoder
from fairseq.models.transformer_lm import TransformerLanguageModel, base_lm_architecture
from fairseq.utils import safe_getattr

from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.training.activation_checkpointing import checkpoint_wrapper, compile_for_training, runs_compiled
from fairseq_megatron.errors import UsageError
from fairseq_megatron.modules import (
    ColumnParallelLinear,
    ModelParallelTransformerDecoderLayer,
    VocabParallelEmbedding,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from fairseq_megatron.modules import sharding
from fairseq_megatron.training.padding import has_padding
from fairseq_megatron.models.registry import take_over_model, take_over_model_architecture

logger = logging.getLogger(__name__)

DEFAULT_MAX_TARGET_POSITIONS = 1024


def check_dictionary_size(symbols: Sequence[str], size: int, trained_with: Optional[int], checkpoint: str) -> None:
    """Refuse a dictionary other than the one a checkpoint's model was trained with.

    ``symbols`` is the dictionary's symbol list (fairseq's four special
    symbols first; padding may follow), ``size`` its length before padding,
    ``trained_with`` the length the checkpoint records (``dictionary_size``;
    None for checkpoints from before the record, which are not checked),
    ``checkpoint`` how the message names it. The same dictionary has that
    many symbols, or more only by ``madeupwordNNNN`` padding symbols (a
    dictionary saved after padding).

    Padding to a recorded vocabulary size (see :func:`pad_dictionary`) would
    take a shorter dictionary without a word, where fairseq's non-parallel
    model failed to load it ("size mismatch"): every token would then be
    looked up in rows learnt for other symbols.

    Raises:
        UsageError: the sizes differ.
    """
    if trained_with is None:
        return
    if size < trained_with or not all(s.startswith("madeupword") for s in symbols[trained_with:]):
        raise UsageError(
            f"the dictionary has {size} symbols but {checkpoint} was trained with {trained_with}: "
            f"wrong dict.txt for this checkpoint"
        )


def pad_dictionary(dictionary, model_parallel_size: int, padded_vocab_size: Optional[int] = None) -> int:
    """Pad ``dictionary`` in place with ``madeupwordNNNN`` symbols; return its new size.

    A new model pads to a multiple of ``8 * model_parallel_size``, as fairseq
    does, so the size depends on the model-parallel size it was first built
    with. That size is then recorded in the model config
    (``padded_vocab_size``) and reused exactly, so a checkpoint resharded to
    another model-parallel size keeps every embedding row and the same
    softmax over the same vocabulary.

    Raises:
        UsageError: the dictionary is larger than ``padded_vocab_size``, or
            the size is not divisible by the model-parallel size.
    """
    if padded_vocab_size is None:
        dictionary.pad_to_multiple_(8 * model_parallel_size)
    else:
        if len(dictionary) > padded_vocab_size:
            raise UsageError(
                f"the dictionary has {len(dictionary)} symbols but the vocabulary has {padded_vocab_size} rows "
                f"(--padded-vocab-size, or a checkpoint's record of it): a --padded-vocab-size too small, "
                f"or the wrong dict.txt for the checkpoint"
            )
        i = 0
        while len(dictionary) < padded_vocab_size:
            symbol = f"madeupword{i:04d}"
            if symbol not in dictionary.indices:
                dictionary.add_symbol(symbol, n=0)
            i += 1
    if len(dictionary) % model_parallel_size != 0:
        raise UsageError(
            f"padded vocabulary size {len(dictionary)} is not divisible by the "
            f"model-parallel size {model_parallel_size}"
        )
    return len(dictionary)


def check_processes(model_parallel_size: int, processes: int) -> None:
    """Refuse ``model_parallel_size`` model parts in one process.

    ``processes`` is the run's world size (1 when torch.distributed is not
    initialised: no launcher). A world size that ``model_parallel_size``
    does not divide is refused where the groups are made
    (:func:`fairseq_megatron.parallel.parallel_state.initialize_model_parallel`).

    Raises:
        UsageError: ``model_parallel_size`` < 1 (fairseq ran 0 or a negative
            size as size 1, or failed later on a group size that differs), or
            > 1 and ``processes`` == 1.
    """
    if model_parallel_size < 1:
        raise UsageError(f"--model-parallel-size {model_parallel_size}: the number of model parts is at least 1")
    if model_parallel_size > 1 and processes == 1:
        raise UsageError(
            f"--model-parallel-size {model_parallel_size} needs {model_parallel_size} processes, one per model "
            f"part, and this run is one process: launch it with torchrun --nproc_per_node {model_parallel_size} "
            f"(or give fairseq --distributed-world-size {model_parallel_size} on a machine with "
            f"{model_parallel_size} GPUs)"
        )


def check_data_parallel_backend(ddp_backend: str, model_parallel_size: int, cpu: bool) -> None:
    """Refuse fairseq-train's ``--ddp-backend fully_sharded`` for this model.

    fairseq-train then builds the model inside fairscale's ``enable_wrap``
    (``fairseq/distributed/fully_sharded_data_parallel.py``) to wrap it in
    FSDP, which flattens the parameters and shards them over the
    data-parallel ranks. At model-parallel size > 1 the gradient norm
    (:mod:`fairseq_megatron.parallel.grad_norm`: each parameter's rule found by name,
    summed over the model-parallel group only) and the model part files
    expect every rank to hold its whole part, so that is refused; on CPU
    (``cpu``, or no CUDA) fairscale's FSDP fails with "Torch not compiled
    with CUDA enabled". Other backends pass.

    Raises:
        UsageError: either case.
    """
    if ddp_backend != "fully_sharded":
        return
    others = "use --ddp-backend pytorch_ddp (the default), no_c10d or legacy_ddp"
    if model_parallel_size > 1:
        raise UsageError(f"--ddp-backend fully_sharded does not work with --model-parallel-size "
                         f"{model_parallel_size} (FSDP would shard the model parts over the data-parallel "
                         f"ranks); {others}")
    if cpu or not torch.cuda.is_available():
        raise UsageError(f"--ddp-backend fully_sharded needs CUDA GPUs (fairscale's FSDP); on CPU {others}")


def check_training_precision(common) -> None:
    """Refuse fairseq-train precision flags that fail later on this machine.

    ``common``: fairseq's ``cfg.common``. ``--bf16`` means TPU in fairseq
    0.12 (it sets ``--tpu``; FAIRSEQ_FACTS.md) and without ``torch_xla``
    fairseq-train failed with "'NoneType' object has no attribute
    'xla_device'". ``--fp16`` on CPU (``--cpu``, or no CUDA) failed in
    ``fairseq/optim/fp16_optimizer.py``, whose fp32 master weights go to the
    current CUDA device: "Torch not compiled with CUDA enabled".
    ``--memory-efficient-fp16`` and ``--amp`` run there and pass.

    Raises:
        UsageError: either case, naming the flag to use instead.
    """
    import importlib.util

    if (common.bf16 or common.memory_efficient_bf16) and importlib.util.find_spec("torch_xla") is None:
        flag = "--memory-efficient-bf16" if common.memory_efficient_bf16 else "--bf16"
        raise UsageError(f"fairseq's {flag} means TPU (it needs torch_xla); for bf16 on a GPU or CPU "
                         f"use --bf16-autocast (fp32 weights, bf16 autocast)")
    fp16_optimizer = common.fp16 and not common.memory_efficient_fp16  # fairseq sets fp16 for both
    if fp16_optimizer and (common.cpu or not torch.cuda.is_available()):
        raise UsageError("--fp16 needs a CUDA GPU (fairseq's FP16 optimizer keeps its fp32 master weights "
                         "there); on CPU train in fp32 or with --bf16-autocast")


def _data_parallel_backend_being_built() -> str:
    """``fully_sharded`` while fairseq-train builds the model inside
    fairscale's ``enable_wrap`` (its FSDP backend), else ``pytorch_ddp``.
    Not the config's ``ddp_backend``: a checkpoint's config records the
    backend of its training, and evaluating it builds the model without FSDP."""
    from fairscale.nn.wrap.auto_wrap import ConfigAutoWrap

    return "fully_sharded" if ConfigAutoWrap.in_autowrap_context else "pytorch_ddp"


def check_options(args, model_parallel_size: int) -> None:
    """Refuse options this model cannot be built or trained with, from the
    options alone: sizes the model-parallel size does not divide, conflicting
    precision flags, ``--cuda-graphs`` with gradient accumulation, and
    transformer_lm options the layers do not implement.

    fairseq's parser gives our archs every transformer_lm option; these the
    layers would ignore: NormFormer's scalings (``--scale-attn``,
    ``--scale-fc``, ``--scale-heads``, ``--scale-resids``), quantization noise,
    BASE layers, xformers attention; input/output dimensions other than the
    embedding's failed in the first forward on mismatched shapes. Checkpoints
    without these options (the published Megatron-11b's 2020 ``args``) pass.

    Called by the architecture functions, which fairseq-train runs while
    parsing its command line (so bad options stop it before it creates
    ``--save-dir``), and again by ``build_model`` for configs that did not
    pass through them (checkpoints, Hydra).

    Raises:
        UsageError: the first refusal, naming the options to change.
        NotImplementedError: adaptive input/softmax or character embeddings.
    """
    for flag, value in (
        ("--decoder-attention-heads", args.decoder_attention_heads),
        ("--decoder-ffn-embed-dim", args.decoder_ffn_embed_dim),
    ):
        if value % model_parallel_size != 0:
            raise UsageError(f"{flag} {value} is not divisible by --model-parallel-size {model_parallel_size}")
    if args.decoder_embed_dim % args.decoder_attention_heads != 0:
        raise UsageError(f"--decoder-embed-dim {args.decoder_embed_dim} is not divisible by "
                         f"--decoder-attention-heads {args.decoder_attention_heads}")
    if safe_getattr(args, "bf16_autocast", False):
        half = [f"--{f.replace('_', '-')}" for f in ("fp16", "memory_efficient_fp16", "amp")
                if safe_getattr(args, f, False)]
        if half:
            raise UsageError(f"--bf16-autocast trains fp32 weights under bf16 autocast; drop {' '.join(half)}")
    accumulated = max(safe_getattr(args, "update_freq", None) or [1])
    if safe_getattr(args, "cuda_graphs", False) and accumulated > 1:
        # The backward graph's weight gradients live in the graphs' memory
        # pool; the next micro-batch's replay overwrites the gradient being
        # accumulated (pytorch/pytorch#96693: silently wrong sums).
        raise UsageError(
            f"--cuda-graphs with --update-freq {accumulated}: a CUDA graph replay would overwrite "
            "the gradients being accumulated; use --update-freq 1 (a larger --batch-size instead)"
        )
    embed_dim = args.decoder_embed_dim
    given = [f"--{flag.replace('_', '-')}" for flag in ("scale_attn", "scale_fc", "scale_heads", "scale_resids")
             if safe_getattr(args, flag, False)]
    given += [f"--{flag.replace('_', '-')} {safe_getattr(args, flag)}"
              for flag in ("quant_noise_pq", "quant_noise_scalar", "base_layers", "decoder_xformers_att_config")
              if safe_getattr(args, flag, None)]
    given += [f"--{flag.replace('_', '-')} {safe_getattr(args, flag)}"
              for flag in ("decoder_input_dim", "decoder_output_dim")
              if safe_getattr(args, flag, embed_dim) != embed_dim]
    if given:
        raise UsageError(f"{' '.join(given)}: not implemented by the model-parallel decoder; drop it "
                         f"(fairseq's own transformer_lm has it, without model parallelism)")
    if (safe_getattr(args, "character_embeddings", False) or safe_getattr(args, "adaptive_input", False)
            or safe_getattr(args, "adaptive_softmax_cutoff", None)):
        raise NotImplementedError(
            "character embeddings, adaptive input and adaptive softmax are not model parallel"
        )


@take_over_model("model_parallel_transformer_lm")
class ModelParallelTransformerLanguageModel(TransformerLanguageModel):
    """Decoder-only LM whose layers are split across the tensor-model-parallel group.

    Build with fairseq (``--arch transformer_lm_megatron_11b
    --model-parallel-size N``). Forward: ``src_tokens`` ``(B, T)`` ->
    logits ``(B, T, V)`` on every rank (gathered), or ``(B, T, V / N)`` with
    ``gather_logits=False`` (what the vocab-parallel criterion asks for).

    Raises (from ``build_model``):
        UsageError (a ValueError): ``--model-parallel-size`` above 1 in a
            single process (no launcher); the checkpoint's
            ``model_parallel_size`` differs from the running group size;
            FSDP at model-parallel size > 1 or on CPU; the dictionary is not
            the one the checkpoint was trained with; and what
            :func:`check_options` refuses (heads or FFN size not divisible by
            the model-parallel size, conflicting precision flags,
            transformer_lm options these layers do not implement).
        NotImplementedError: adaptive input/softmax or character embeddings.
    """

    @staticmethod
    def add_args(parser):
        TransformerLanguageModel.add_args(parser)
        parser.add_argument(
            "--compile-layers", action="store_true",
            help="torch.compile the decoder layers for training steps (fuses layer norm, bias, "
                 "GeLU, dropout and residual adds), and the vocab-parallel loss's softmax passes. "
                 "At model-parallel size 1 without --checkpoint-activations the whole layer stack "
                 "is one compiled region (fewer host calls per step); otherwise each layer is. "
                 "The first steps pay the compilation",
        )
        parser.add_argument(
            "--cuda-graphs", action="store_true",
            help="with --compile-layers at model-parallel size 1 without --checkpoint-activations "
                 "(training refuses it otherwise), "
                 "replay the compiled layer stack as CUDA graphs (torch.compile mode "
                 "'reduce-overhead'): the host launches each training step's layers with one call "
                 "forward and one backward. Pays where the host limits the step (smaller models); "
                 "the graphs keep their own memory pool, and each new batch shape records another "
                 "graph, so train with fixed shapes (--sample-break-mode none). Refused with "
                 "--update-freq > 1 (replays would overwrite the accumulating gradients). No effect on CPU",
        )
        parser.add_argument(
            "--sequence-parallel", action="store_true",
            help="in training, keep layer norms, dropout and residuals on T / N sequence shards "
                 "(all-gather + reduce-scatter instead of all-reduce; Megatron-LM v3). Needs "
                 "--tokens-per-sample divisible by --model-parallel-size; batches whose length "
                 "is not run the plain tensor-parallel path",
        )
        parser.add_argument(
            "--bf16-autocast", action="store_true",
            help="training forward passes run under torch.autocast(bfloat16) with fp32 weights, "
                 "fp32 gradients and no loss scaling (train without --fp16/--amp; fairseq's own "
                 "--bf16 means TPU). Evaluation and generation are not affected",
        )
        parser.add_argument(
            "--padded-vocab-size", type=int, metavar="N",
            help="rows of the vocab-parallel embedding and softmax: the dictionary padded with "
                 "madeupword symbols (default: its size rounded up to a multiple of 8 x the "
                 "model-parallel size). Checkpoints record it; training on from a checkpoint "
                 "resharded to another model-parallel size needs the recorded value when the "
                 "default at the new size differs (fairseq-train says so)",
        )

    @classmethod
    def build_model(cls, args, task):
        base_lm_architecture(args)
        group_size = parallel_state.get_tensor_model_parallel_world_size()
        wanted = safe_getattr(args, "model_parallel_size", None)
        wanted = 1 if wanted is None else int(wanted)
        check_processes(wanted, parallel_state.world_size(None))
        if wanted != group_size:
            raise UsageError(
                f"the model is configured for model-parallel size {wanted} but this run's "
                f"model-parallel group has {group_size} rank(s); pass --model-parallel-size "
                f"{group_size} with a checkpoint saved at that size (or reshard the checkpoint)"
            )
        check_data_parallel_backend(_data_parallel_backend_being_built(), group_size,
                                    cpu=safe_getattr(args, "cpu", False))
        check_options(args, group_size)
        if args.decoder_layers_to_keep:
            args.decoder_layers = len(args.decoder_layers_to_keep.split(","))
        if safe_getattr(args, "max_target_positions", None) is None:
            args.max_target_positions = safe_getattr(args, "tokens_per_sample", DEFAULT_MAX_TARGET_POSITIONS)

        recorded = safe_getattr(args, "padded_vocab_size", None)
        # A checkpoint's config (fairseq-eval-lm, -generate, the hub) records the
        # dictionary its model was trained with; a new model records its own.
        dictionary = task.source_dictionary
        trained_with = safe_getattr(args, "dictionary_size", None)
        check_dictionary_size(dictionary.symbols, len(dictionary), trained_with, "the checkpoint's model")
        if trained_with is None:
            args.dictionary_size = len(dictionary)
        args.padded_vocab_size = pad_dictionary(dictionary, group_size, recorded)
        if pad_dictionary(task.target_dictionary, group_size, args.padded_vocab_size) != args.padded_vocab_size:
            raise ValueError("source and target dictionaries differ in size")

        embed_tokens = cls.build_embedding(args, task.source_dictionary, args.decoder_input_dim)
        decoder = ModelParallelTransformerDecoder(args, task.target_dictionary, embed_tokens)
        return cls(decoder)

    @classmethod
    def build_embedding(cls, args, dictionary, embed_dim, path=None):
        return VocabParallelEmbedding(len(dictionary), embed_dim, dictionary.pad())

    # The draws left out of this model's build, when fairseq-train built it
    # before knowing whether a checkpoint would fill it (fairseq_integration
    # step 27); None once they ran or a checkpoint made them needless.
    deferred_initialisation: Optional[sharding.DeferredInitialisation] = None

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        """fairseq's, for a model whose initialisation is deferred as well: a
        strict load fills every parameter (or raises), so the draws are
        dropped; before a non-strict one they run, as the parameters the
        state dict lacks keep their initial values."""
        if not strict:
            self.run_deferred_initialisation()
        result = super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)
        self.deferred_initialisation = None  # strict: every parameter was filled
        return result

    def run_deferred_initialisation(self) -> bool:
        """Draw the initial weights that the build deferred, if any are
        still due; True if it drew them."""
        deferred, self.deferred_initialisation = self.deferred_initialisation, None
        if deferred is None:
            return False
        deferred.run()
        return True


class ModelParallelTransformerDecoder(parallel_state.SharesProcessGroupsWhenCopied, TransformerDecoder):
    """fairseq's TransformerDecoder with model-parallel layers and output projection.

    The output projection uses the vocab-parallel embedding weight
    (``--share-decoder-input-output-embed``, as Megatron-11b) or its own
    ``(V / N, C)`` column-parallel weight. Logits are gathered to the full
    vocabulary unless the caller passes ``gather_logits=False``, whatever
    criterion a checkpoint was trained with (fairseq's own decoder decided by
    the stored criterion name, which broke eval-lm and generation: fairseq
    issues 2358, 3507).
    """

    def __init__(self, args, dictionary, embed_tokens):
        self.tensor_model_parallel_group = parallel_state.get_tensor_model_parallel_group()
        self.compile_layers = bool(safe_getattr(args, "compile_layers", False))
        self.sequence_parallel = bool(safe_getattr(args, "sequence_parallel", False))
        self.bf16_autocast = bool(safe_getattr(args, "bf16_autocast", False))
        # Compile granularity (--compile-layers): the whole stack where nothing in
        # it breaks the graph, else each layer (see compile_run_layers).
        self.compile_layer_stack = (
            self.compile_layers
            and parallel_state.world_size(self.tensor_model_parallel_group) == 1
            and not safe_getattr(args, "checkpoint_activations", False)
            and not safe_getattr(args, "offload_activations", False)  # implies checkpointing
        )
        self.cuda_graphs = bool(safe_getattr(args, "cuda_graphs", False))
        self.offload_activations = bool(safe_getattr(args, "offload_activations", False))
        self._compiled_layer_stack = None
        super().__init__(args, dictionary, embed_tokens, no_encoder_attn=True)
        if self.compile_layer_stack:
            self.compile_run_layers()

    def compile_run_layers(self, backend: str = "inductor") -> None:
        """Make training passes run :meth:`run_layers` through ``torch.compile``
        (``backend``: torch.compile's), as one region for all layers.

        Why the whole stack: compiled one layer at a time, every layer costs
        the host a guard check and a compiled-graph call forward and backward,
        and at 350M parameters on an H100 the GPU then waits for the host
        (kernels busy 54 ms of an 83 ms step); as one region, fairseq-train
        there went from 91k to 114k-118k tokens/s (scripts/benchmark.py,
        README). At model-parallel size > 1 the layers swap random generators
        around sharded dropout, which dynamo cannot trace, and activation
        checkpointing replays that swap; those keep per-layer compilation.
        Evaluation and incremental decoding stay eager, as in
        :func:`~fairseq_megatron.training.activation_checkpointing.compile_for_training`.
        The region is :meth:`run_layers_to_last_output`: its one output is
        the last layer's (see there why not every layer's).

        With ``--cuda-graphs`` (inductor only) the region is compiled in
        torch.compile's ``reduce-overhead`` mode: after warm-up and recording
        calls for each new batch shape, each training pass replays one CUDA
        graph forward and one backward instead of launching the stack's
        kernels one at a time (a whole training step ran about 1,400 GPU
        operations at 354M, profiled). The weight gradients then live in the
        graphs' memory pool until the next replay, which is why
        :meth:`ModelParallelTransformerLanguageModel.build_model` refuses
        gradient accumulation (``--update-freq`` > 1) with it. On an
        H100 at 354M fairseq-train reached 136k tokens/s with it and 114k
        without (two calls on the lent device; README); at 1.31B, where the
        GPU is busy anyway, 51.8k and 50.6k.
        """
        self._layer_stack_backend = backend
        if self.cuda_graphs and backend == "inductor":
            self._compiled_layer_stack = torch.compile(self.run_layers_to_last_output, mode="reduce-overhead")
        else:
            self._compiled_layer_stack = torch.compile(self.run_layers_to_last_output, backend=backend)

    def __deepcopy__(self, memo):
        """A copy (fairseq's ``--store-ema``, or a user's) compiles its own layer
        stack: the original's compiled function runs the original's layers."""
        copied = super().__deepcopy__(memo)
        if self._compiled_layer_stack is not None:
            copied.compile_run_layers(self._layer_stack_backend)
        return copied

    def train(self, mode: bool = True):
        """``nn.Module.train``; refuses training mode when ``--cuda-graphs`` has
        no compiled layer stack to replay.

        Raises:
            UsageError: ``--cuda-graphs`` without ``--compile-layers``, at
                model-parallel size > 1 or with ``--checkpoint-activations`` (or
                ``--offload-activations``, which implies it).
                Checked here, not when building: a checkpoint trained with the
                flag still loads for evaluation at any model-parallel size, and
                fairseq's trainer calls ``train()`` before the part of a step
                whose errors make it write ``crash.pt``.
        """
        if mode and self.cuda_graphs and self._compiled_layer_stack is None:
            raise UsageError(
                "--cuda-graphs replays the compiled layer stack: it needs --compile-layers at "
                "--model-parallel-size 1 without --checkpoint-activations or --offload-activations"
            )
        return super().train(mode)

    def upgrade_state_dict_named(self, state_dict, name):
        """fairseq's upgrade, minus one false alarm: a state dict without the
        ``{name}.version`` buffer was taken for a checkpoint from before the
        final layer norm existed, and the norm was deleted from this decoder
        (``TransformerDecoderBase.upgrade_state_dict_named``). fairseq's EMA
        (``--store-ema``) loads such a dict into its copy after every update,
        since it skips keys named "version" (``fairseq/models/ema/ema.py``):
        the EMA model then ran without its final layer norm and was saved
        without it. A dict that holds the final norm's weights is no such old
        checkpoint; it gets the current version."""
        version_key = f"{name}.version"  # fairseq's key (the model names its decoder "decoder")
        if version_key not in state_dict and f"{name}.layer_norm.weight" in state_dict:
            state_dict[version_key] = self.version.detach().clone()
        return super().upgrade_state_dict_named(state_dict, name)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        if not isinstance(cfg, TransformerConfig):
            cfg = TransformerConfig.from_namespace(cfg)
        layer = ModelParallelTransformerDecoderLayer(cfg, group=self.tensor_model_parallel_group)
        if self.compile_layers and not self.compile_layer_stack:
            layer = compile_for_training(layer)
        if cfg.checkpoint_activations or cfg.offload_activations:  # fairseq: the latter implies the former
            layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
        return layer

    def build_output_projection(self, cfg, dictionary, embed_tokens):
        if self.share_input_output_embed:
            # nn.Linear whose weight *is* the embedding shard, (V / N, C): keeps
            # fairseq's key decoder.output_projection.weight, tied as in fairseq.
            # Its own weight is replaced at once; where a checkpoint's weights
            # follow, it is not even drawn (2.6 s of CPU for Megatron-11b's).
            # Deferred, the draw (thrown away again) keeps its place in the
            # generator's sequence, so the layers after it get their weights.
            shape = (embed_tokens.weight.shape[1], embed_tokens.weight.shape[0])
            linear = nn.Linear
            if sharding.draw_later(functools.partial(nn.Linear, *shape, bias=False)):
                linear = functools.partial(torch.nn.utils.skip_init, nn.Linear)
            self.output_projection = linear(*shape, bias=False)
            self.output_projection.weight = embed_tokens.weight
        else:
            dim = self.output_embed_dim
            self.output_projection = ColumnParallelLinear(
                dim, len(dictionary), bias=False,
                init_method=lambda w: nn.init.normal_(w, mean=0.0, std=dim ** -0.5),
                group=self.tensor_model_parallel_group,
            )

    def _use_sequence_parallel(self, x, incremental_state) -> bool:
        """Sequence parallelism runs in training passes whose length T divides
        by the group size; otherwise the same layers take the plain
        tensor-parallel path (identical results, all-reduce communication)."""
        n = parallel_state.world_size(self.tensor_model_parallel_group)
        return (self.sequence_parallel and n > 1 and self.training and incremental_state is None
                and x.size(0) % n == 0)

    def extract_features_scriptable(
        self,
        prev_output_tokens,
        encoder_out=None,
        incremental_state=None,
        full_context_alignment: bool = False,
        alignment_layer: Optional[int] = None,
        alignment_heads: Optional[int] = None,
    ):
        """fairseq's ``TransformerDecoderBase.extract_features_scriptable`` for a
        decoder-only LM, plus sequence parallelism around the layer stack:
        the embedded input ``(T, B, C)`` is split to ``(T / N, B, C)`` before the
        first layer and gathered after the last, so the final layer norm and
        the output projection see the whole sequence.

        Returns features ``(B, T, C)`` and ``{"attn": [None], "inner_states"}``
        (the inner states are sequence shards when sequence parallelism ran;
        a training pass through the compiled layer stack keeps only the last).
        """
        if encoder_out is not None:
            raise NotImplementedError("ModelParallelTransformerDecoder is decoder-only")
        positions = None
        if self.embed_positions is not None:
            positions = self.embed_positions(prev_output_tokens, incremental_state=incremental_state)
        if incremental_state is not None:
            prev_output_tokens = prev_output_tokens[:, -1:]
            if positions is not None:
                positions = positions[:, -1:]
        prev_output_tokens = prev_output_tokens.contiguous()
        x = self.embed_scale * self.embed_tokens(prev_output_tokens)
        if self.project_in_dim is not None:
            x = self.project_in_dim(x)
        if positions is not None:
            x += positions
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        x = self.dropout_module(x)
        x = x.transpose(0, 1)  # (T, B, C)

        self_attn_padding_mask = None
        if has_padding(prev_output_tokens, self.padding_idx):  # read on the host when fairseq-train marked it
            self_attn_padding_mask = prev_output_tokens.eq(self.padding_idx)
        self_attn_mask = None
        if incremental_state is None and not full_context_alignment:
            self_attn_mask = self.buffered_future_mask(x)  # (T, T), from the full length

        group = self.tensor_model_parallel_group
        sequence_parallel = self._use_sequence_parallel(x, incremental_state)
        if sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, group)
        if self._compiled_layer_stack is not None and runs_compiled(self, incremental_state):
            x = self._compiled_layer_stack(x, self_attn_mask, self_attn_padding_mask, sequence_parallel)
            inner_states = [x]
        else:
            x, inner_states = self.run_layers(x, self_attn_mask, self_attn_padding_mask, incremental_state,
                                              sequence_parallel)
        if sequence_parallel:
            x = gather_from_sequence_parallel_region(x, group, to_tensor_parallel_region=False)

        if self.layer_norm is not None:
            x = self.layer_norm(x)
        x = x.transpose(0, 1)  # (B, T, C)
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        return x, {"attn": [None], "inner_states": inner_states}

    def run_layers(self, x, self_attn_mask, self_attn_padding_mask, incremental_state, sequence_parallel: bool):
        """Every decoder layer in turn: ``x`` ``(T, B, C)`` (or the ``(T / N, B, C)``
        sequence shard) -> ``(x, inner_states)``, the input and each layer's
        output. Masks as in :class:`ModelParallelTransformerDecoderLayer`.

        With ``--offload-activations`` a pass with autograd keeps only the last
        output (``inner_states == [x]``): each layer then holds its input in
        host memory, and a list of them would hold them on the device."""
        keep_inner_states = not (self.offload_activations and torch.is_grad_enabled())
        inner_states = [x] if keep_inner_states else []
        for layer in self.layers:
            x, _, _ = layer(
                x, None, None, incremental_state,
                self_attn_mask=self_attn_mask,
                self_attn_padding_mask=self_attn_padding_mask,
                sequence_parallel=sequence_parallel,
            )
            if keep_inner_states:
                inner_states.append(x)
        return x, inner_states if keep_inner_states else [x]

    def run_layers_to_last_output(self, x, self_attn_mask, self_attn_padding_mask, sequence_parallel: bool):
        """:meth:`run_layers` for a training pass, returning the last layer's
        output alone (``inner_states`` is then ``[x]``, as with
        ``--offload-activations``): the region that ``--compile-layers``
        compiles as a whole. Were every layer's output an output of the
        compiled region, autograd would hand its backward a gradient for each
        of them, which AOT autograd fills with zeros for those the loss does
        not use, and CUDA graphs copy into their static inputs: L - 1
        activation-sized zero fills and copies per step for nothing."""
        x, _ = self.run_layers(x, self_attn_mask, self_attn_padding_mask, None, sequence_parallel)
        return x

    def forward(
        self,
        prev_output_tokens,
        encoder_out=None,
        incremental_state=None,
        features_only: bool = False,
        full_context_alignment: bool = False,
        alignment_layer: Optional[int] = None,
        alignment_heads: Optional[int] = None,
        src_lengths=None,
        return_all_hiddens: bool = False,
        gather_logits: bool = True,
    ):
        """``prev_output_tokens`` ``(B, T)`` -> (logits ``(B, T, V)`` or
        ``(B, T, V / N)`` with ``gather_logits=False``, extra dict).

        With ``--bf16-autocast`` a training pass over fp32 weights runs under
        ``torch.autocast(bfloat16)``: matrix multiplies and attention in bf16,
        layer norms in fp32, logits in bf16 (the criterion computes the loss
        in fp32).
        """
        with self._training_autocast(prev_output_tokens.device):
            x, extra = self.extract_features(
                prev_output_tokens,
                encoder_out=encoder_out,
                incremental_state=incremental_state,
                full_context_alignment=full_context_alignment,
                alignment_layer=alignment_layer,
                alignment_heads=alignment_heads,
            )
            if not features_only:
                x = self.output_layer(x, gather_logits=gather_logits)
        return x, extra

    def _training_autocast(self, device: torch.device):
        """bf16 autocast for ``--bf16-autocast`` training passes; a no-op
        otherwise, and for weights that are not fp32 (``--fp16`` already made
        them half precision)."""
        if self.bf16_autocast and self.training and self.embed_tokens.weight.dtype == torch.float32:
            return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def output_layer(self, features, gather_logits: bool = True):
        """``(B, T, C)`` replicated -> ``(B, T, V)`` replicated, or this rank's
        ``(B, T, V / N)`` shard with ``gather_logits=False``."""
        group = self.tensor_model_parallel_group
        x = copy_to_tensor_model_parallel_region(features, group)
        logits = F.linear(x, self.output_projection.weight)
        if gather_logits:
            logits = gather_from_tensor_model_parallel_region(logits, group)
        return logits


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


def is_model_parallel_arch(name) -> bool:
    """Whether ``name`` (a config's ``_name`` or ``arch``) is an architecture
    of :class:`ModelParallelTransformerLanguageModel`."""
    return isinstance(name, str) and issubclass(
        ARCH_MODEL_REGISTRY.get(name, type(None)), ModelParallelTransformerLanguageModel)
