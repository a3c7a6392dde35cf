"""The tensor-parallel Transformer decoder: its layers, and its forward with
tensor, sequence and context parallelism.

Everything else that changes how a training pass runs is applied to a built
model from outside, by :mod:`fairseq_megatron.training`: the pipeline
split, activation checkpointing and offload, compilation, CUDA graphs and
bf16 autocast. State-dict keys and per-rank shapes are those of fairseq's
``model_parallel/models/transformer.py``.

Context parallelism (``context_split``, which training sets where
``--context-parallel-size`` C > 1): passes without an incremental state
embed the whole sequence, padded to a multiple of ``2C``, and keep this
rank's ``T / C`` positions (``embed``); the layers run on them, with a mask
by global position (``buffered_future_mask``), and the output holds their
logits ``(B, T / C, V)``, whose targets are ``local_targets``.

Masked vocabulary rows (``--masked-vocab-rows``, an imported model's rows
that its source lacks): the output layer sets their logits to minus
infinity; each rank keeps the mask of its vocabulary shard as the
non-persistent buffer ``masked_vocab_rows``, ``(V / N,)`` bool, or None
(:mod:`fairseq_megatron.models.masked_vocab_rows`).
"""

import functools
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq.models.transformer import TransformerConfig, TransformerDecoder
from fairseq.modules import LearnedPositionalEmbedding, PositionalEmbedding
from fairseq.utils import safe_getattr

from fairseq_megatron.modules import (
    ColumnParallelLinear,
    ModelParallelTransformerDecoderLayer,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from fairseq_megatron.modules import sharding
from fairseq_megatron.modules.forward_wrappers import rewrap
from fairseq_megatron.modules.parameter_attributes import KeepsParameterAttributes
from fairseq_megatron.models.masked_vocab_rows import local_mask_of, mask_logits_
from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.modules.padding import has_padding, mark_padding


class ModelParallelTransformerDecoder(KeepsParameterAttributes, TransformerDecoder):
    """fairseq's TransformerDecoder with tensor-parallel layers and output projection.

    The output projection uses the vocab-parallel embedding weight
    (``--share-decoder-input-output-embed``, as Megatron-11b; the weight is
    then tagged ``shared_embedding``) or its own ``(V / N, C)``
    column-parallel weight. Logits are gathered to the full vocabulary
    unless the caller passes ``gather_logits=False``, whatever criterion a
    checkpoint was trained with (fairseq's own decoder decided by the stored
    criterion name, which broke eval-lm and generation: fairseq issues 2358,
    3507).

    ``tensor_parallel``: the group its layers split over (default: this
    rank's; a :class:`~fairseq_megatron.parallel.parallel_state.RankGroup`
    builds rank ``k`` of ``T`` without process groups).
    Context parallelism and masked vocabulary rows: see the module docstring.
    """

    context_split = None
    """How the context-parallel ranks split a sequence
    (:class:`~fairseq_megatron.parallel.context_parallel.ContextSplit`), or None."""

    def __init__(self, args, dictionary, embed_tokens, tensor_parallel=parallel_state.DEFAULT_GROUP,
                 initialisation: Optional[sharding.DeferredInitialisation] = None):
        self.tensor_parallel = parallel_state.resolve_tensor_parallel(tensor_parallel)
        self.sequence_parallel = bool(safe_getattr(args, "sequence_parallel", False))
        # every layer's output (fairseq's inner_states); activation offload turns this off
        self.keep_inner_states = True
        self._initialisation = initialisation  # for the build_* methods fairseq's constructor calls
        queued_before = len(initialisation) if initialisation is not None else 0
        super().__init__(args, dictionary, embed_tokens, no_encoder_attn=True)
        del self._initialisation
        _queue_learned_positions(self.embed_positions, initialisation, queued_before)
        if self.share_input_output_embed:
            self.embed_tokens.set_parameter_attributes("weight", shared_embedding=True)
        self.tag_parameters()  # fairseq's layer norms and positions: replicated
        self.register_buffer("masked_vocab_rows", local_mask_of(args, len(dictionary), self.tensor_parallel), False)

    def tag_parameters(self) -> None:
        """Tie the output projection to the embedding again where torch made a
        new parameter for one of them (``to_empty``, ``load_state_dict(assign=True)``
        make one per module), then tag
        (:meth:`~fairseq_megatron.modules.parameter_attributes.KeepsParameterAttributes.tag_parameters`)."""
        tied = self.share_input_output_embed and self.embed_tokens is not None and self.output_projection is not None
        if tied and self.output_projection.weight is not self.embed_tokens.weight:
            self.output_projection.weight = self.embed_tokens.weight
        super().tag_parameters()

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        if not isinstance(cfg, TransformerConfig):
            cfg = TransformerConfig.from_namespace(cfg)
        return ModelParallelTransformerDecoderLayer(cfg, group=self.tensor_parallel,
                                                    initialisation=self._initialisation)

    def build_output_projection(self, cfg, dictionary, embed_tokens):
        self.output_projection = tied_output_projection(embed_tokens, self._initialisation) \
            if self.share_input_output_embed else \
            output_projection(self.output_embed_dim, len(dictionary), self.tensor_parallel, self._initialisation)

    # ------------------------------------------------------------ the forward

    def extract_features_scriptable(
        self,
        prev_output_tokens,
        encoder_out=None,
        incremental_state=None,
        full_context_alignment: bool = False,
        alignment_layer: Optional[int] = None,
        alignment_heads: Optional[int] = None,
    ):
        """fairseq's ``TransformerDecoderBase.extract_features_scriptable`` for
        a decoder-only LM, with sequence parallelism around the layer stack
        (:meth:`run_layers`). Returns features ``(B, T, C)`` and ``{"attn":
        [None], "inner_states"}`` (the inner states are sequence shards when
        sequence parallelism ran).

        Raises:
            RuntimeError: the decoder holds one pipeline stage (its passes run
                through the pipeline schedule).
        """
        if encoder_out is not None:
            raise NotImplementedError("ModelParallelTransformerDecoder is decoder-only")
        if self.embed_tokens is None or self.output_projection is None:
            raise RuntimeError("this decoder holds one pipeline stage: its passes run through the pipeline "
                               "schedule; evaluation loads the checkpoint at one stage")
        x, self_attn_padding_mask = self.embed(prev_output_tokens, incremental_state)
        self_attn_mask = None
        if incremental_state is None and not full_context_alignment:
            self_attn_mask = self.buffered_future_mask(x)  # (T, T), from the full length
        x, inner_states = self.run_layers(x, self_attn_mask, self_attn_padding_mask, incremental_state)
        return self.final_layer_norm(x), {"attn": [None], "inner_states": inner_states}

    def embed(self, prev_output_tokens, incremental_state=None):
        """Tokens ``(B, T)`` -> the first layer's input ``(T, B, C)`` (scaled
        token embeddings plus positions, dropout applied) and the key padding
        mask ``(B, T)`` (None where the batch holds no padding). With an
        incremental state, the last position only (``T = 1``).

        With context parallelism (no incremental state): the tokens are
        padded to ``T'``, a multiple of ``2C``, embedded whole (fairseq's
        positions number the tokens they are given), and this rank's
        ``(T' / C, B, C)`` positions are returned, with the padding mask
        ``(B, T')`` in the order of the gathered keys."""
        split = self.context_split if incremental_state is None else None
        if split is not None:
            padded = split.pad(prev_output_tokens, self.padding_idx)
            if padded is not prev_output_tokens:
                mark_padding(padded, self.padding_idx, True)
            prev_output_tokens = padded
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
        x = x.transpose(0, 1).contiguous()  # returned as the first inner state: FSDP2 warns of a view there
        if split is not None:
            x = split.keep(x, 0)
            padding_mask = None if padding_mask is None else split.in_key_order(padding_mask, 1)
        return x, padding_mask

    def buffered_future_mask(self, tensor):
        """fairseq's future mask ``(T, T)`` for ``tensor`` ``(T, B, C)``
        (additive); with context parallelism ``tensor`` holds this rank's
        ``T / C`` positions and the mask is ``(T / C, T)`` over the gathered
        keys by global position, bool, True = blocked
        (:meth:`~fairseq_megatron.parallel.context_parallel.ContextSplit.causal_mask`)."""
        if self.context_split is None:
            return super().buffered_future_mask(tensor)
        return self.context_split.causal_mask(tensor.size(0), tensor.device)

    def local_targets(self, target):
        """The targets of this rank's output positions: ``target`` ``(B, T)``,
        or with context parallelism its positions of the padded ``(B, T')``,
        ``(B, T' / C)``, as :meth:`embed` keeps them."""
        split = self.context_split
        if split is None:
            return target
        return split.keep(split.pad(target, self.padding_idx), 1)

    def uses_sequence_parallel(self, x, incremental_state) -> bool:
        """Sequence parallelism runs in training passes whose length T divides
        by the group size; otherwise the same layers take the plain
        tensor-parallel path (identical results, all-reduce communication)."""
        n = self.tensor_parallel.size
        return (self.sequence_parallel and n > 1 and self.training and incremental_state is None
                and x.size(0) % n == 0)

    def run_layers(self, x, self_attn_mask, self_attn_padding_mask, incremental_state=None, layers=None):
        """The decoder layers this model holds (or ``layers``: one model
        chunk's) on ``x`` ``(T, B, C)`` -> ``(x, inner_states)``, with sequence
        parallelism around them where it applies: ``x`` is split to
        ``(T / N, B, C)`` before the first layer and gathered after the last."""
        group = self.tensor_parallel.group
        sequence_parallel = self.uses_sequence_parallel(x, incremental_state)
        if sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, group)
        x, inner_states = self.run_layer_stack(x, self_attn_mask, self_attn_padding_mask, incremental_state,
                                               sequence_parallel, layers)
        if sequence_parallel:
            x = gather_from_sequence_parallel_region(x, group, to_tensor_parallel_region=False)
        return x, inner_states

    def held_layers(self):
        """The decoder layers this model holds, in order (all of them, or
        after a pipeline split one stage's)."""
        return self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers

    def run_layer_stack(self, x, self_attn_mask, self_attn_padding_mask, incremental_state, sequence_parallel: bool,
                        layers=None):
        """Every decoder layer held (or of ``layers``), in turn: ``x`` ``(T, B, C)`` (or the
        ``(T / N, B, C)`` sequence shard) -> ``(x, inner_states)``, the input
        and each layer's output (only the last where :attr:`keep_inner_states`
        is off: with offloaded activations each layer's input lives in host
        memory, and a list of them would hold them on the device). Masks as
        in :class:`~fairseq_megatron.modules.ModelParallelTransformerDecoderLayer`.
        The region that whole-stack compilation replaces
        (:mod:`fairseq_megatron.training.compile`)."""
        keep = self.keep_inner_states or not torch.is_grad_enabled()
        inner_states = [x] if keep else []
        for layer in self.held_layers() if layers is None else layers:
            x, _, _ = layer(
                x, None, None, incremental_state,
                self_attn_mask=self_attn_mask,
                self_attn_padding_mask=self_attn_padding_mask,
                sequence_parallel=sequence_parallel,
            )
            if keep:
                inner_states.append(x)
        return x, inner_states if keep else [x]

    def final_layer_norm(self, x):
        """The last layer's output ``(T, B, C)`` -> features ``(B, T, C)``."""
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        x = x.transpose(0, 1)
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        return x

    def output_layer(self, features, gather_logits: bool = True):
        """``(B, T, C)`` replicated -> ``(B, T, V)`` replicated, or this rank's
        ``(B, T, V / N)`` shard with ``gather_logits=False``."""
        group = self.tensor_parallel.group
        x = copy_to_tensor_model_parallel_region(features, group)
        logits = mask_logits_(F.linear(x, self.output_projection.weight), self.masked_vocab_rows)
        if gather_logits:
            logits = gather_from_tensor_model_parallel_region(logits, group)
        return logits

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, features_only: bool = False,
                full_context_alignment: bool = False, alignment_layer: Optional[int] = None,
                alignment_heads: Optional[int] = None, src_lengths=None, return_all_hiddens: bool = False,
                gather_logits: bool = True):
        """``prev_output_tokens`` ``(B, T)`` -> (logits ``(B, T, V)`` or
        ``(B, T, V / N)`` with ``gather_logits=False``, extra dict)."""
        x, extra = self.extract_features(prev_output_tokens, encoder_out=encoder_out,
                                         incremental_state=incremental_state,
                                         full_context_alignment=full_context_alignment,
                                         alignment_layer=alignment_layer, alignment_heads=alignment_heads)
        if not features_only:
            x = self.output_layer(x, gather_logits=gather_logits)
        return x, extra

    def __deepcopy__(self, memo):
        """A copy (``--store-ema``, or a user's) with wrappers of its own (:func:`~.forward_wrappers.rewrap`)."""
        copied = super().__deepcopy__(memo)
        rewrap(copied)
        return copied

    def upgrade_state_dict_named(self, state_dict, name):
        """fairseq's upgrade, minus one false alarm (:func:`version_of_a_final_norm`)."""
        version_of_a_final_norm(state_dict, name, self.version)
        result = super().upgrade_state_dict_named(state_dict, name)
        if self.output_projection is None:  # fairseq added the tied projection's key (a stage before the last)
            state_dict.pop(f"{name}.output_projection.weight", None)
        return result


def tied_output_projection(embed_tokens: nn.Module,
                           initialisation: Optional[sharding.DeferredInitialisation] = None) -> nn.Linear:
    """An ``nn.Linear`` whose weight *is* the embedding shard, ``(V / N, C)``:
    it keeps fairseq's key ``decoder.output_projection.weight``, tied as in
    fairseq. Its own weight is replaced at once; where a checkpoint's
    weights follow, it is not even drawn (2.6 s of CPU for Megatron-11b's).
    Deferred, the draw (thrown away again) keeps its place in the
    generator's sequence, so the layers after it get their weights."""
    shape = (embed_tokens.weight.shape[1], embed_tokens.weight.shape[0])
    linear = nn.Linear
    if sharding.draw_later(functools.partial(nn.Linear, *shape, bias=False), initialisation):
        linear = functools.partial(torch.nn.utils.skip_init, nn.Linear, device="meta")
    projection = linear(*shape, bias=False)
    projection.weight = embed_tokens.weight
    return projection


def output_projection(dim: int, vocab: int, tensor_parallel,
                      initialisation: Optional[sharding.DeferredInitialisation] = None) -> ColumnParallelLinear:
    """The untied output projection: its own column-parallel weight
    ``(V / N, C)``, drawn as fairseq draws its own (normal, std ``C ** -0.5``)."""
    return ColumnParallelLinear(dim, vocab, bias=False, init_method=lambda w: nn.init.normal_(w, std=dim ** -0.5),
                                group=tensor_parallel, initialisation=initialisation)


def _queue_learned_positions(positions, initialisation: Optional[sharding.DeferredInitialisation],
                             index: int) -> None:
    """Queue at ``index`` of ``initialisation`` (where one is given) the draw
    of fairseq's learned positions, which its decoder draws as it builds
    them, after the embedding and before the layers: made again by fairseq's
    own builder (``fairseq/modules/positional_embedding.py``), so the
    generator moves as it did, and copied into the parameter that holds
    them then."""
    if initialisation is None or not isinstance(positions, LearnedPositionalEmbedding):
        return

    def draw(held) -> None:
        offset = positions.padding_idx + 1 if positions.padding_idx is not None else 0
        drawn = PositionalEmbedding(positions.num_embeddings - offset, positions.embedding_dim,
                                    positions.padding_idx, learned=True)
        target = held(positions.weight)
        if target is not None:
            sharding.fill_(target, drawn.weight.detach())

    initialisation.insert(index, draw)


def version_of_a_final_norm(state_dict: dict, name: str, version: torch.Tensor) -> None:
    """Give decoder ``name``'s state dict the current ``version`` where it
    holds the final layer norm's weights but no version. fairseq took a
    state dict without the ``{name}.version`` buffer for a checkpoint from
    before the final layer norm existed, and deleted the norm from the
    decoder (``TransformerDecoderBase.upgrade_state_dict_named``). fairseq's
    EMA (``--store-ema``) loads such a dict into its copy after every
    update, since it skips keys named "version" (``fairseq/models/ema/ema.py``):
    the EMA model then ran without its final layer norm and was saved
    without it. A dict that holds the final norm's weights is no such old
    checkpoint."""
    version_key = f"{name}.version"  # fairseq's key (the model names its decoder "decoder")
    if version_key not in state_dict and f"{name}.layer_norm.weight" in state_dict:
        state_dict[version_key] = version.detach().clone()
