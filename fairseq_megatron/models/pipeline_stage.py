"""What one pipeline stage of the decoder holds.

The decoder's ``L`` layers are split evenly over ``P`` stages: stage ``s``
holds layers ``s L / P`` to ``(s + 1) L / P - 1``, the first stage also the
token and position embeddings, the last the final layer norm and the output
projection (Megatron-LM ``megatron/core/models/gpt/gpt_model.py``:
``pre_process`` and ``post_process``). With tied input and output
embeddings (``--share-decoder-input-output-embed``, as Megatron-11b) the last
stage keeps its own copy of the embedding weight for the projection; the
two copies start equal and their gradients are summed over the embedding
group every update (:mod:`fairseq_megatron.training.pipeline_schedule`).

A stage's modules and state-dict keys are those of the whole model, layer
numbers included (``decoder.layers.5.`` on the stage that holds layer 5), so
the stages of a checkpoint merge by taking the union of their keys and a
whole model splits by :meth:`PipelineStageLayout.holds`.
"""

import re
from dataclasses import dataclass
from typing import List, NamedTuple, Optional

from fairseq.utils import safe_getattr

from fairseq_megatron.errors import UsageError
from fairseq_megatron.parallel import parallel_state

_LAYER_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.")
_FIRST_STAGE_PREFIXES = ("decoder.embed_positions.", "decoder.layernorm_embedding.")
_LAST_STAGE_PREFIXES = ("decoder.layer_norm.", "decoder.output_projection.")
EMBEDDING_KEY = "decoder.embed_tokens.weight"


def pipeline_stages(args) -> int:
    """``--pipeline-model-parallel-size`` of ``args`` (1 where not given)."""
    stages = safe_getattr(args, "pipeline_model_parallel_size", None)
    return 1 if stages is None else int(stages)


def virtual_stages(args) -> int:
    """``--virtual-pipeline-model-parallel-size`` of ``args`` (1 where not given)."""
    virtual = safe_getattr(args, "virtual_pipeline_model_parallel_size", None)
    return 1 if virtual is None else int(virtual)


class Chunk(NamedTuple):
    """One virtual stage (model chunk) of the interleaved schedule: its index
    among the ``P x V`` virtual stages, its layers, and whether it embeds the
    tokens (the first) or computes the logits (the last)."""

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
    hold ``L / (P x V)`` consecutive layers each, and stage ``s`` holds virtual
    stages ``s, s + P, ...`` (torch's loop placement).

    Raises (on construction):
        UsageError: ``stages x virtual`` does not divide ``layers``, or
            ``stage`` is not in ``0 .. stages - 1``.
    """

    stage: int
    stages: int
    layers: int
    tied_embeddings: bool
    virtual: int = 1

    def __post_init__(self):
        if self.stages < 1 or self.virtual < 1 or self.layers % (self.stages * self.virtual):
            flags = f"--pipeline-model-parallel-size {self.stages}"
            if self.virtual > 1:
                flags += f" x --virtual-pipeline-model-parallel-size {self.virtual}"
            raise UsageError(f"--decoder-layers {self.layers} is not divisible by {flags} (each stage holds the same "
                             f"number of layers)")
        if not 0 <= self.stage < self.stages:
            raise UsageError(f"pipeline stage {self.stage} of {self.stages} does not exist")

    @classmethod
    def of(cls, args, stage: Optional[int] = None) -> "PipelineStageLayout":
        """The layout of model config ``args`` (``--pipeline-model-parallel-size``,
        ``--virtual-pipeline-model-parallel-size``, ``--decoder-layers``,
        ``--share-decoder-input-output-embed``) at ``stage``, by default this
        rank's stage in its pipeline group."""
        stages = pipeline_stages(args)
        if stage is None:
            stage = parallel_state.get_pipeline_model_parallel_rank() if stages > 1 else 0
        return cls(stage, stages, int(args.decoder_layers),
                   bool(safe_getattr(args, "share_decoder_input_output_embed", False)), virtual_stages(args))

    @property
    def chunks(self) -> List[Chunk]:
        """This stage's model chunks, in order (one without interleaving)."""
        total = self.stages * self.virtual
        per_chunk = self.layers // total
        return [Chunk(i, range(i * per_chunk, (i + 1) * per_chunk), i == 0, i == total - 1)
                for i in range(self.stage, total, self.stages)]

    def holds_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` is on this stage."""
        return any(index in chunk.layers for chunk in self.chunks)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

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
        return self.stages > 1 and self.is_last and self.tied_embeddings

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
