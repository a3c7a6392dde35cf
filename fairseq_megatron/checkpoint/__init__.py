"""Checkpoints in model parts: which tensors are split how, the part files of
a checkpoint, a save as a commit, reading one save without writing or
running code, resharding to another model-parallel size, and export to
plain fairseq and to transformers."""
