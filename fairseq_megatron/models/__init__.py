from fairseq_megatron.models.model_parallel_transformer_lm import (  # noqa: F401
    ModelParallelTransformerDecoder,
    ModelParallelTransformerLanguageModel,
)
