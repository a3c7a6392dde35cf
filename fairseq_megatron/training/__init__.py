"""What training applies to a built model from outside (``parallelize``: the
pipeline split, compilation and CUDA graphs, activation checkpointing and
offload, bf16 autocast, one concern per module), the pipeline schedule and
the fused AdamW."""
