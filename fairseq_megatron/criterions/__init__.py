from fairseq_megatron.criterions.vocab_parallel_cross_entropy import VocabParallelCrossEntropyCriterion  # noqa: F401
