"""Tensor, sequence, pipeline and data parallelism: process groups, the communication
functions between regions, the model-parallel RNG streams, the gradient norm
over model parts, and the ``mpu`` module fairseq imports."""
