"""Training aids independent of fairseq: the fused AdamW, activation
checkpointing and regional compilation, padding known on the host."""
