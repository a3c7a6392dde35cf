"""What one pipeline stage of the decoder holds.

The decoder's ``L`` layers are split evenly over ``P`` stages (or with one
fewer on the first and last, :class:`PipelineStageLayout`'s
``account_for_embedding`` and ``account_for_loss``): stage ``s``
holds layers ``s L / P`` to ``(s + 1) L / P - 1``, the first stage also the
token and position embeddings, the last the final layer norm and the output
projection (Megatron-LM ``megatron/core/models/gpt/gpt_model.py``:
``pre_process`` and ``post_process``). With model chunks the layers are
split over ``P x V`` virtual stages, which the schedule places
(:mod:`fairseq_megatron.training.pipeline_schedules`; in the V placement of the
zero-bubble schedules stage 0 holds the first chunk and the last). With
tied input and output embeddings (``--share-decoder-input-output-embed``,
as Megatron-11b) a last stage other than the first keeps its own copy of
the embedding weight for the projection; the two copies start equal and
their gradients are summed over the embedding group every update
(:mod:`fairseq_megatron.training.pipeline_schedule`).

A stage's modules and state-dict keys are those of the whole model, layer
numbers included (``decoder.layers.5.`` on the stage that holds layer 5), so
the stages of a checkpoint merge by taking the union of their keys and a
whole model splits by :meth:`PipelineStageLayout.holds`.
"""

import re
from dataclasses import dataclass
from typing import List, NamedTuple

from fairseq.utils import safe_getattr

from fairseq_megatron.errors import UsageError

_LAYER_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.")
_FIRST_STAGE_PREFIXES = ("decoder.embed_positions.", "decoder.layernorm_embedding.")
_LAST_STAGE_PREFIXES = ("decoder.layer_norm.", "decoder.output_projection.")
EMBEDDING_KEY = "decoder.embed_tokens.weight"
LOOP, V_SHAPE = "loop", "v"  # the placements of model chunks on stages (PipelineStageLayout)


def pipeline_stages(args) -> int:
    """``--pipeline-model-parallel-size`` of ``args`` (1 where not given)."""
    stages = safe_getattr(args, "pipeline_model_parallel_size", None)
    return 1 if stages is None else int(stages)


class Chunk(NamedTuple):
    """One virtual stage (model chunk): its index among the ``P x V``
    virtual stages (the order a micro-batch passes them), its layers, and
    whether it embeds the tokens (the first) or computes the logits (the
    last)."""

    index: int
    layers: range
    is_first: bool
    is_last: bool


@dataclass(frozen=True)
class PipelineStageLayout:
    """Stage ``stage`` of ``stages`` of a decoder of ``layers`` layers, each
    stage holding ``virtual`` model chunks (Narayanan et al. 2021, section
    2.2.2, the interleaved schedule; Megatron-Core's
    ``--virtual-pipeline-model-parallel-size``): the ``P x V`` virtual stages
    hold ``L / (P x V)`` consecutive layers each, placed as the schedule
    places them (:mod:`fairseq_megatron.training.pipeline_schedules`):
    ``placement`` ``"loop"``, stage ``s`` holds virtual stages ``s, s + P, ...``
    (torch's loop placement); ``"v"`` (two chunks), stage ``s`` holds
    ``s`` and ``2P - 1 - s``, so stage 0 holds the first chunk and the last.

    ``account_for_embedding`` / ``account_for_loss`` (Megatron-Core's
    ``--account-for-embedding-in-pipeline-split`` and
    ``--account-for-loss-in-pipeline-split``, ``TransformerConfig``): the
    embedding / the output projection and loss count as one layer each in
    the split, so the ``L + e + l`` layers are split evenly over the
    virtual stages and the first / last chunk holds one decoder layer fewer
    than the others; for a vocabulary whose output projection costs about
    a layer (Megatron-11b: ``2 h V`` FLOPs a token against a layer's
    ``24 h^2 + 4 s h``) the last stage then does the others' work.

    Raises (on construction):
        UsageError: ``stages x virtual`` does not divide ``layers`` (plus
            the embedding and loss counted), a chunk left without a decoder
            layer, a V placement of other than 2 chunks, or ``stage`` is
            not in ``0 .. stages - 1``.
    """

    stage: int
    stages: int
    layers: int
    tied_embeddings: bool
    virtual: int = 1
    placement: str = LOOP
    account_for_embedding: bool = False
    account_for_loss: bool = False

    def __post_init__(self):
        counted = self.layers + self.account_for_embedding + self.account_for_loss
        if self.stages < 1 or self.virtual < 1 or counted % (self.stages * self.virtual):
            flags = f"--pipeline-model-parallel-size {self.stages}"
            if self.placement == V_SHAPE:
                flags += f" x {self.virtual} model chunks per stage (--pipeline-schedule zbv and dualpipev)"
            elif self.virtual > 1:
                flags += f" x --virtual-pipeline-model-parallel-size {self.virtual}"
            raise UsageError(f"--decoder-layers {self.layers}{self._counted_as_layers()} is not divisible by {flags} "
                             f"(each stage holds the same number of layers)")
        if min(len(chunk.layers) for chunk in self._all_chunks()) < 1:
            raise UsageError(f"--decoder-layers {self.layers}{self._counted_as_layers()} over {self.stages} x "
                             f"{self.virtual} model chunks leaves the first or last chunk without a decoder layer: "
                             f"drop --account-for-embedding-in-pipeline-split or --account-for-loss-in-pipeline-split")
        if not 0 <= self.stage < self.stages:
            raise UsageError(f"pipeline stage {self.stage} of {self.stages} does not exist")
        if self.placement not in (LOOP, V_SHAPE) or (self.placement == V_SHAPE and self.virtual != 2):
            raise UsageError(f"a {self.placement!r} placement of {self.virtual} model chunks per stage does not exist")

    def chunk_indices(self, stage: int) -> List[int]:
        """The virtual stages ``stage`` holds, in the order of its chunks."""
        total = self.stages * self.virtual
        if self.placement == V_SHAPE:
            return [stage, total - 1 - stage]
        return list(range(stage, total, self.stages))

    def _counted_as_layers(self) -> str:
        counted = [what for what, flag in (("the embedding", self.account_for_embedding),
                                           ("the loss", self.account_for_loss)) if flag]
        each = "counted as a layer" if len(counted) == 1 else "each counted as a layer"
        return f" + {len(counted)} ({' and '.join(counted)}, {each})" if counted else ""

    def _all_chunks(self) -> List[Chunk]:
        """Every virtual stage, in the order a micro-batch passes them: ``n``
        counted layers each, the first's less the embedding and the last's
        less the loss where they count."""
        total = self.stages * self.virtual
        first = int(self.account_for_embedding)
        per_chunk = (self.layers + first + self.account_for_loss) // total
        return [Chunk(i, range(max(0, i * per_chunk - first), min(self.layers, (i + 1) * per_chunk - first)),
                      i == 0, i == total - 1) for i in range(total)]

    @property
    def chunks(self) -> List[Chunk]:
        """This stage's model chunks, in order (one without interleaving)."""
        every = self._all_chunks()
        return [every[i] for i in self.chunk_indices(self.stage)]

    @property
    def last_stage(self) -> int:
        """The stage that holds the last chunk, and computes the loss: ``P - 1``,
        or 0 in the V placement."""
        return 0 if self.placement == V_SHAPE else self.stages - 1

    def holds_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` is on this stage."""
        return any(index in chunk.layers for chunk in self.chunks)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """Whether this stage holds the last chunk (the final layer norm, the output projection, the loss)."""
        return self.stage == self.last_stage

    @property
    def held_layers(self) -> List[int]:
        """The indices of the decoder layers this stage holds, ascending."""
        return [index for chunk in self.chunks for index in chunk.layers]

    @property
    def holds_embedding(self) -> bool:
        """The token embedding: the first stage's input, and with tied
        embeddings the last stage's copy for the output projection."""
        return self.is_first or (self.is_last and self.tied_embeddings)

    @property
    def holds_embedding_copy(self) -> bool:
        """Whether this stage's embedding weight is the last stage's copy of
        the first stage's (counted once, in the gradient norm, on the first)."""
        return self.tied_copies and self.is_last

    @property
    def tied_copies(self) -> bool:
        """Whether the tied embedding has two copies, on the first stage and
        on the last, whose gradients are summed every update (not where one
        stage holds both ends: one stage, or the V placement)."""
        return self.tied_embeddings and self.last_stage != 0

    def holds(self, key: str) -> bool:
        """Whether state-dict key ``key`` of the whole model belongs to this
        stage (keys of no stage in particular, such as ``decoder.version``,
        belong to every stage)."""
        layer = _LAYER_KEY.match(key)
        if layer:
            return self.holds_layer(int(layer.group(1)))
        if key == EMBEDDING_KEY:
            return self.holds_embedding
        if key.startswith(_FIRST_STAGE_PREFIXES):
            return self.is_first
        if key.startswith(_LAST_STAGE_PREFIXES):
            return self.is_last
        return True
