"""Checkpoints in model parts: which tensors are split how, the part files of
a checkpoint, resharding to another model-parallel size, and export to plain
fairseq."""
