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
from typing import Optional

import torch
import torch.distributed as dist
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
from fairseq_megatron.modules.float8 import Float8Training, use_float8
from fairseq_megatron.modules.float8 import emulated as float8_emulated
from fairseq_megatron.training.padding import has_padding
from fairseq_megatron.models.options import (
    pipeline_stages,
    data_parallel_backend_being_built,
    check_data_parallel_backend,
    check_dictionary_size,
    check_options,
    check_processes,
    pad_dictionary,
)
from fairseq_megatron.models.pipeline_stage import PipelineStageLayout
from fairseq_megatron.models.registry import take_over_model, take_over_model_architecture

logger = logging.getLogger(__name__)

DEFAULT_MAX_TARGET_POSITIONS = 1024


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
            "--fp8", action="store_true",
            help="training passes compute the matrix products of the decoder layers' linears (q/k/v, "
                 "attention output, FFN) in float8 through torchao's float8 training (pip install "
                 "'fairseq_megatron[fp8]'); needs a GPU of compute capability 8.9 or newer (Ada, Hopper). "
                 "Weights, gradients, optimizer state and checkpoints keep their dtype; the output "
                 "projection, evaluation and generation stay in high precision. Use with --bf16-autocast "
                 "(or fp32) and --compile-layers; refused with --fp16, --memory-efficient-fp16, --amp and "
                 "pipeline stages",
        )
        parser.add_argument(
            "--fp8-recipe", choices=["tensorwise", "rowwise"], default="tensorwise",
            help="torchao's float8 scaling with --fp8: tensorwise (one dynamic scale per tensor, e5m2 "
                 "gradients; the faster) or rowwise (a power-of-two scale per row, e4m3 throughout)",
        )
        parser.add_argument(
            "--pipeline-model-parallel-size", type=int, metavar="P", default=1,
            help="split the decoder layers evenly over P pipeline stages, one per process (with "
                 "--model-parallel-size T the world size is a multiple of T x P); training runs "
                 "each update's --update-freq micro-batches through the 1F1B schedule, so it needs "
                 "--update-freq >= P, --sample-break-mode none and the vocab_parallel_cross_entropy "
                 "criterion. Checkpoints hold one file per stage and tensor part; evaluation and "
                 "generation load them at one stage",
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
        """The model for ``args``, its initial weights drawn now, or, where a
        checkpoint may fill them (fairseq-train, which builds before it looks
        for one; any load of a checkpoint through our task, whose
        ``initial_weights_may_be_loaded`` says so), only if none does: :meth:`load_state_dict` drops them
        for a strict load and draws them first for a partial one, and
        :meth:`run_deferred_initialisation` draws them (the trainer calls it
        when no checkpoint was loaded). Drawing is nearly all of the build:
        every rank draws each layer's full master tensor
        (:mod:`fairseq_megatron.modules.sharding`), minutes for Megatron-11b.
        If anything else in the build drew from the default generator
        (fairseq's ``--decoder-learned-pos`` embedding), the deferred draws
        would come out of order, so the model is built again as usual."""
        stages = pipeline_stages(args)
        if dist.is_initialized() and (not parallel_state.model_parallel_is_initialized()
                                      or parallel_state.get_pipeline_model_parallel_world_size() != stages):
            # fairseq creates tensor-parallel groups only (none at size 1): the pipeline's groups are made here
            parallel_state.initialize_model_parallel(parallel_state.get_tensor_model_parallel_world_size()
                                                     if parallel_state.model_parallel_is_initialized() else 1,
                                                     stages)
        from fairseq_megatron.fairseq_integration.patching import fairseq_tool

        # our language_modeling task says so for any load of a checkpoint; fairseq-train, with any task,
        # builds the model before it looks for one (our trainer draws the weights if it finds none)
        if not (getattr(task, "initial_weights_may_be_loaded", False) or fairseq_tool() in ("train", "hydra_train")):
            return cls._build(args, task)
        with sharding.initialisation_deferred() as deferred:
            model = cls._build(args, task)
        if deferred.generator_moved():
            torch.set_rng_state(deferred.generator_state)
            del model, deferred  # and the queue's references to its parameters, before the second build
            return cls._build(args, task)
        model.deferred_initialisation = deferred
        return model

    @classmethod
    def _build(cls, args, task):
        base_lm_architecture(args)
        group_size = parallel_state.get_tensor_model_parallel_world_size()
        wanted = safe_getattr(args, "model_parallel_size", None)
        wanted = 1 if wanted is None else int(wanted)
        check_processes(wanted, parallel_state.world_size(None), pipeline_stages(args))
        if wanted != group_size:
            raise UsageError(
                f"the model is configured for model-parallel size {wanted} but this run's "
                f"model-parallel group has {group_size} rank(s); pass --model-parallel-size "
                f"{group_size} with a checkpoint saved at that size (or reshard the checkpoint)"
            )
        check_data_parallel_backend(data_parallel_backend_being_built(), group_size,
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

        stage = PipelineStageLayout.of(args)
        with contextlib.nullcontext() if stage.holds_embedding else sharding.draws_discarded():
            embed_tokens = cls.build_embedding(args, task.source_dictionary, args.decoder_input_dim)
        decoder = ModelParallelTransformerDecoder(args, task.target_dictionary, embed_tokens)
        return cls(decoder)

    @classmethod
    def build_embedding(cls, args, dictionary, embed_dim, path=None):
        return VocabParallelEmbedding(len(dictionary), embed_dim, dictionary.pad())

    # The draws left out of this model's build (see build_model); None once
    # they ran or a checkpoint made them needless.
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
        self.fp8_recipe = None  # torchao's recipe with --fp8; its layers' settings come with the first train()
        if safe_getattr(args, "fp8", False):
            self.fp8_recipe = safe_getattr(args, "fp8_recipe", None) or "tensorwise"
        self.float8 = None
        self._compiled_layer_stack = None
        self.pipeline_stage = PipelineStageLayout.of(args)
        self._layers_built = 0
        super().__init__(args, dictionary, embed_tokens, no_encoder_attn=True)
        self._keep_this_stage_only()
        if self.compile_layer_stack:
            self.compile_run_layers()

    def _keep_this_stage_only(self) -> None:
        """Drop the modules of the other pipeline stages (built, see
        :meth:`build_decoder_layer`, only to keep the generator's sequence)."""
        stage = self.pipeline_stage
        if stage.stages == 1:
            return
        if not stage.holds_embedding:
            self.embed_tokens = None
        if not stage.is_first:
            self.embed_positions = None
            self.layernorm_embedding = None
        if not stage.is_last:
            self.layer_norm = None
            self.output_projection = None

    @property
    def stage_layers(self):
        """The decoder layers this pipeline stage holds (all of them at one stage), in order."""
        r = self.pipeline_stage.layer_range
        return self.layers[r.start:r.stop]

    def compile_run_layers(self, backend: str = "inductor") -> None:
        """Make training passes run :meth:`run_layers` through ``torch.compile``
        (``backend``: torch.compile's), as one region for all layers.

        Why the whole stack: compiled one layer at a time, every layer costs
        the host a guard check and a compiled-graph call forward and backward,
        and for smaller models the GPU then waits for the host; as one region
        the host queues the whole stack at once (docs/benchmarks.md). At
        model-parallel size > 1 the layers swap random generators
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
        kernels one at a time. The weight gradients then live in the
        graphs' memory pool until the next replay, which is why
        :meth:`ModelParallelTransformerLanguageModel.build_model` refuses
        gradient accumulation (``--update-freq`` > 1) with it. It pays where
        the host limits the step (docs/benchmarks.md).
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
            UsageError: ``--fp8`` without torchao (the first call in training
                mode gives the layers their float8 settings: :meth:`use_float8`).
        """
        if mode and self.cuda_graphs and self._compiled_layer_stack is None:
            raise UsageError(
                "--cuda-graphs replays the compiled layer stack: it needs --compile-layers at "
                "--model-parallel-size 1 without --checkpoint-activations or --offload-activations"
            )
        if mode and self.fp8_recipe is not None and self.float8 is None:
            self.use_float8()
        return super().train(mode)

    def use_float8(self) -> None:
        """Make the decoder layers' training passes compute their linears'
        products in float8 (``--fp8``; :mod:`fairseq_megatron.modules.float8`)
        with torchao's ``--fp8-recipe``, emulated in the test mode
        (``FAIRSEQ_MEGATRON_FP8_EMULATE=1``). The first :meth:`train` calls
        it, not the build: evaluating an ``--fp8`` checkpoint needs neither
        torchao nor a float8 GPU. The output projection is left alone.

        Raises:
            UsageError: torchao is not installed.
        """
        self.float8 = Float8Training.of_recipe(self.fp8_recipe, emulate=float8_emulated())
        use_float8(self.layers, self.float8)
        logger.info(f"--fp8: in training passes the decoder layers' linears (q/k/v, attention output, FFN) compute "
                    f"their products in float8 (torchao, {self.fp8_recipe} scaling"
                    f"{', emulated: the test mode' if self.float8.config.emulate else ''})")

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
        result = super().upgrade_state_dict_named(state_dict, name)
        if self.output_projection is None:  # fairseq added the tied projection's key (a stage before the last)
            state_dict.pop(f"{name}.output_projection.weight", None)
        return result

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        """Layer ``k`` (the k-th call) of the decoder; a layer of another
        pipeline stage is built with its draws discarded
        (:func:`~fairseq_megatron.modules.sharding.draws_discarded`) and
        replaced by a :class:`LayerOnAnotherStage`, so that the layers of
        this stage get the weights they have in a one-stage model."""
        index, self._layers_built = self._layers_built, self._layers_built + 1
        if not isinstance(cfg, TransformerConfig):
            cfg = TransformerConfig.from_namespace(cfg)
        if index not in self.pipeline_stage.layer_range:
            with sharding.draws_discarded():
                ModelParallelTransformerDecoderLayer(cfg, group=self.tensor_model_parallel_group)
            return LayerOnAnotherStage(index, self.pipeline_stage)
        layer = ModelParallelTransformerDecoderLayer(cfg, group=self.tensor_model_parallel_group)
        if self.compile_layers and not self.compile_layer_stack:
            layer = compile_for_training(layer)
        if cfg.checkpoint_activations or cfg.offload_activations:  # fairseq: the latter implies the former
            layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
        return layer

    def build_output_projection(self, cfg, dictionary, embed_tokens):
        stage = self.pipeline_stage
        with contextlib.nullcontext() if stage.is_last else sharding.draws_discarded():
            self._build_output_projection(cfg, dictionary, embed_tokens)

    def _build_output_projection(self, cfg, dictionary, embed_tokens):
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
        if self.pipeline_stage.stages > 1:
            raise RuntimeError(f"this decoder is pipeline stage {self.pipeline_stage.stage} of "
                               f"{self.pipeline_stage.stages}: its passes run through the pipeline schedule "
                               f"(forward_stage); evaluation loads the checkpoint at one stage")
        x, self_attn_padding_mask = self.embed(prev_output_tokens, incremental_state)
        self_attn_mask = None
        if incremental_state is None and not full_context_alignment:
            self_attn_mask = self.buffered_future_mask(x)  # (T, T), from the full length
        x, inner_states = self.run_layers_of_this_stage(x, self_attn_mask, self_attn_padding_mask, incremental_state)
        return self.final_layer_norm(x), {"attn": [None], "inner_states": inner_states}

    def embed(self, prev_output_tokens, incremental_state=None):
        """Tokens ``(B, T)`` -> the first layer's input ``(T, B, C)`` (scaled
        token embeddings plus positions, dropout applied) and the key padding
        mask ``(B, T)`` (None where the batch holds no padding). With an
        incremental state, the last position only (``T = 1``)."""
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
        padding_mask = None
        if has_padding(prev_output_tokens, self.padding_idx):  # read on the host when fairseq-train marked it
            padding_mask = prev_output_tokens.eq(self.padding_idx)
        return x.transpose(0, 1), padding_mask

    def run_layers_of_this_stage(self, x, self_attn_mask, self_attn_padding_mask, incremental_state=None):
        """This stage's layers on ``x`` ``(T, B, C)`` -> ``(x, inner_states)``,
        with sequence parallelism around them where it applies: ``x`` is split
        to ``(T / N, B, C)`` before the first layer and gathered after the
        last (a training pass through the compiled layer stack keeps only the
        last output in ``inner_states``)."""
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
        return x, inner_states

    def final_layer_norm(self, x):
        """The last layer's output ``(T, B, C)`` -> features ``(B, T, C)``."""
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        x = x.transpose(0, 1)
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        return x

    def forward_stage(self, x):
        """This pipeline stage's share of a training or validation pass, as
        torch's pipeline schedule calls it: the first stage takes tokens
        ``(B, T)``, the others the previous stage's output ``(T, B, C)``; the
        last returns this tensor rank's logits ``(B, T, V / N)``, the others
        ``(T, B, C)``. No key padding mask: the micro-batches are full
        blocks, padded only at their ends (fairseq's right padding), and the
        causal mask already keeps every real position from attending to
        them; their targets are padding, which the loss ignores."""
        stage = self.pipeline_stage
        with self._training_autocast(x.device):
            if stage.is_first:
                x, _ = self.embed(x)
            x, _ = self.run_layers_of_this_stage(x, self.buffered_future_mask(x), None)
            if stage.is_last:
                return self.output_layer(self.final_layer_norm(x), gather_logits=False)
        return x.contiguous()  # sent to the next stage as it is laid out

    def run_layers(self, x, self_attn_mask, self_attn_padding_mask, incremental_state, sequence_parallel: bool):
        """Every decoder layer in turn: ``x`` ``(T, B, C)`` (or the ``(T / N, B, C)``
        sequence shard) -> ``(x, inner_states)``, the input and each layer's
        output. Masks as in :class:`ModelParallelTransformerDecoderLayer`.

        With ``--offload-activations`` a pass with autograd keeps only the last
        output (``inner_states == [x]``): each layer then holds its input in
        host memory, and a list of them would hold them on the device."""
        keep_inner_states = not (self.offload_activations and torch.is_grad_enabled())
        inner_states = [x] if keep_inner_states else []
        for layer in self.stage_layers:
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
        if self.bf16_autocast and self.training and self.version.dtype == torch.float32:
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


class LayerOnAnotherStage(nn.Module):
    """The place of a decoder layer that another pipeline stage holds: no
    parameters, and a clear error if called."""

    def __init__(self, index: int, stage: PipelineStageLayout):
        super().__init__()
        self.index, self.stage = index, stage

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"decoder layer {self.index} is on another pipeline stage (this is stage "
                           f"{self.stage.stage} of {self.stage.stages}, layers {self.stage.layer_range.start}-"
                           f"{self.stage.layer_range.stop - 1})")

    def extra_repr(self) -> str:
        return f"layer {self.index}"
