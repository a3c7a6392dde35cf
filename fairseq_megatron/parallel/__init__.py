"""Tensor, context, data and pipeline parallelism: the parallel layout and the
one check of its sizes, the process groups made from it on torch's
DeviceMesh, the communication functions between regions, the model-parallel
RNG streams and the gradient norm over model parts."""
