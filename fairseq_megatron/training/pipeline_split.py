"""The pipeline split: what a built model keeps of itself as one pipeline stage.

The model is built whole, as at one stage (its sharded weights on the
``meta`` device when its initial weights are deferred, so the layers of the
other stages cost no memory); :func:`split_for_stage` then drops what this
rank's stage does not hold (:class:`~fairseq_megatron.models.pipeline_stage.PipelineStageLayout`:
the first stage keeps the embeddings, the last the final layer norm, the
output projection and, with tied embeddings, its own copy of the token
embedding), as torchtitan's pipeline splitting deletes the modules of other
stages. The layers kept keep their global numbers (``decoder.layers.5.`` on
the stage that holds layer 5), so a stage's state-dict keys are the whole
model's. The deferred draws (:class:`~fairseq_megatron.modules.sharding.DeferredInitialisation`)
then draw and throw away the dropped layers' weights, so the layers kept get
bitwise the weights they have in a one-stage model.
"""

import torch.nn as nn

from fairseq_megatron.models.pipeline_stage import PipelineStageLayout


def split_for_stage(model: nn.Module, stage: PipelineStageLayout) -> None:
    """Keep in ``model`` (a ``model_parallel_transformer_lm``) only what
    ``stage`` holds; nothing to do at one stage. The last stage's copy of a
    tied embedding is tagged ``shared`` (its gradient norm is counted on the
    first stage)."""
    if stage.stages == 1:
        return
    decoder = model.decoder
    decoder.layers = nn.ModuleDict({str(i): decoder.layers[i] for i in stage.held_layers})
    if not stage.holds_embedding:
        decoder.embed_tokens = None
    if not stage.is_first:
        decoder.embed_positions = None
        decoder.layernorm_embedding = None
    if not stage.is_last:
        decoder.layer_norm = None
        decoder.output_projection = None
    if stage.holds_embedding_copy:
        decoder.embed_tokens.set_parameter_attributes("weight", shared=True)
