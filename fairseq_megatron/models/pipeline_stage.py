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
from typing import Optional

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


@dataclass(frozen=True)
class PipelineStageLayout:
    """Stage ``stage`` of ``stages`` of a decoder of ``layers`` layers.

    Raises (on construction):
        UsageError: ``stages`` does not divide ``layers``, or ``stage`` is
            not in ``0 .. stages - 1``.
    """

    stage: int
    stages: int
    layers: int
    tied_embeddings: bool

    def __post_init__(self):
        if self.stages < 1 or self.layers % self.stages:
            raise UsageError(f"--decoder-layers {self.layers} is not divisible by --pipeline-model-parallel-size "
                             f"{self.stages} (each stage holds the same number of layers)")
        if not 0 <= self.stage < self.stages:
            raise UsageError(f"pipeline stage {self.stage} of {self.stages} does not exist")

    @classmethod
    def of(cls, args, stage: Optional[int] = None) -> "PipelineStageLayout":
        """The layout of model config ``args`` (``--pipeline-model-parallel-size``,
        ``--decoder-layers``, ``--share-decoder-input-output-embed``) at
        ``stage``, by default this rank's stage in its pipeline group."""
        stages = pipeline_stages(args)
        if stage is None:
            stage = parallel_state.get_pipeline_model_parallel_rank() if stages > 1 else 0
        return cls(stage, stages, int(args.decoder_layers),
                   bool(safe_getattr(args, "share_decoder_input_output_embed", False)))

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def layer_range(self) -> range:
        """The indices of the decoder layers this stage holds."""
        per_stage = self.layers // self.stages
        return range(self.stage * per_stage, (self.stage + 1) * per_stage)

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
            return int(layer.group(1)) in self.layer_range
        if key == EMBEDDING_KEY:
            return self.holds_embedding
        if key.startswith(_FIRST_STAGE_PREFIXES):
            return self.is_first
        if key.startswith(_LAST_STAGE_PREFIXES):
            return self.is_last
        return True
