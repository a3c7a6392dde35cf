"""Training aids: the fused AdamW, activation checkpointing and regional
compilation, padding known on the host."""
