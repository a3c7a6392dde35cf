from fairseq_megatron.models.model_parallel_transformer_decoder import ModelParallelTransformerDecoder  # noqa: F401
from fairseq_megatron.models.model_parallel_transformer_lm import ModelParallelTransformerLanguageModel  # noqa: F401
