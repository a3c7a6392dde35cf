"""The GPUs and networks a plan is timed on, and what collectives cost there.

Presets (``--gpu``), from the vendors' published figures:

=============  ======  ============  ==========  =========  ===========  ============
preset         memory  16-bit peak   fp32 peak   HBM        NVLink, per  network, per
                       (dense)                               direction    GPU
=============  ======  ============  ==========  =========  ===========  ============
a100-80gb      80 GB   312 TFLOP/s   19.5        2,039 GB/s 300 GB/s     25 GB/s
h100-80gb      80 GB   989 TFLOP/s   67          3,350 GB/s 450 GB/s     50 GB/s
h200           141 GB  989 TFLOP/s   67          4,800 GB/s 450 GB/s     50 GB/s
=============  ======  ============  ==========  =========  ===========  ============

* A100 80GB SXM: NVIDIA A100 Tensor Core GPU datasheet (2021): FP16/BF16
  Tensor Core 312 TFLOPS (624 with sparsity), FP32 19.5 TFLOPS, 2,039 GB/s,
  NVLink 600 GB/s (both directions). Network: the DGX A100 node of the
  Megatron-LM paper's Selene cluster, eight 200 Gb/s HDR InfiniBand
  adapters for eight GPUs (Narayanan et al. 2021, section 5).
* H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet: FP16/BF16 1,979
  TFLOPS with sparsity (989 dense), FP32 67 TFLOPS, 3.35 TB/s, NVLink
  900 GB/s; DGX H100: eight 400 Gb/s ConnectX-7 adapters.
* H200 SXM: NVIDIA H200 datasheet: the H100's compute, 141 GB of HBM3e at
  4.8 TB/s, NVLink 900 GB/s; DGX H200: eight 400 Gb/s ConnectX-7.

fp32 training's matrix products run at the fp32 peak (torch leaves TF32
off for them by default); every other precision's at the 16-bit one.

What a program reaches of those peaks, stated once here:

* :data:`COMPUTE_EFFICIENCY` of the 16-bit (or fp32) peak for the matrix
  products, and :data:`MEMORY_EFFICIENCY` of the HBM bandwidth for the
  element-wise kernels (layer norms, dropout, residual adds, GeLU, softmax,
  the optimizer step), which are bound by memory traffic: the model's two
  assumed constants. docs/planning.md compares what they give with the
  Megatron-LM paper's Table 1 and with measured runs.
* :data:`LINK_EFFICIENCY` of a link's bandwidth for NCCL's collectives: its
  own cost model caps the ring's bus bandwidth on A100 at 235 GB/s of
  NVLink's 300 (``src/graph/tuning.cc``, ``compCap80``), 78%.
* Latency: NCCL's cost model for ring collectives with the Simple protocol
  (``tuning.cc``, ``baseLat`` and ``hwLat``): 8.4 µs, plus 3.4 µs per step
  over NVLink and 9.6 µs per step over the network; an all-gather or
  reduce-scatter over ``n`` ranks takes ``n - 1`` steps, an all-reduce
  twice that.

Collectives (:func:`collective_seconds`) are timed in two levels, inside
the nodes and across them, for a group of ``n`` ranks with ``k`` in each
node (the hierarchical form of the ring's cost; Thakur et al. 2005,
"Optimization of Collective Communication Operations in MPICH", for the
ring): an all-gather or reduce-scatter of ``S`` bytes takes
``(k - 1)/k * S / B_node + (n/k - 1)/(n/k) * S / (k * B_net)``, an
all-reduce twice that; ``B_node`` is a GPU's NVLink bandwidth,
``B_net`` its network adapter's (the ``k`` ranks of a node use ``k``
adapters at once).
"""

import dataclasses
import math

from fairseq_megatron.planner.errors import PlanError

COMPUTE_EFFICIENCY = 0.75
MEMORY_EFFICIENCY = 0.8
LINK_EFFICIENCY = 235 / 300
NCCL_BASE_LATENCY = 8.4e-6  # seconds
NCCL_NVLINK_STEP_LATENCY = 3.4e-6
NCCL_NETWORK_STEP_LATENCY = 9.6e-6


@dataclasses.dataclass(frozen=True)
class GPU:
    """A GPU and its links: ``memory_gb`` (1e9 bytes), ``peak_tflops``
    (dense 16-bit tensor-core peak, 1e12 FLOP/s), ``fp32_tflops``,
    ``memory_bandwidth`` (HBM, GB/s), ``intra_node_bandwidth`` (NVLink, GB/s
    per direction) and ``inter_node_bandwidth`` (its network adapter, GB/s)."""

    name: str
    memory_gb: float
    peak_tflops: float
    fp32_tflops: float
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float


GPUS = {
    "a100-80gb": GPU("a100-80gb", 80, 312, 19.5, 2039, 300, 25),
    "h100-80gb": GPU("h100-80gb", 80, 989, 67, 3350, 450, 50),
    "h200": GPU("h200", 141, 989, 67, 4800, 450, 50),
}


@dataclasses.dataclass(frozen=True)
class Cluster:
    """``gpus`` GPUs of kind ``gpu``, ``gpus_per_node`` per node."""

    gpus: int
    gpus_per_node: int
    gpu: GPU

    def check(self) -> None:
        """Raises PlanError for a size or bandwidth the plan cannot use."""
        for name in ("memory_gb", "peak_tflops", "fp32_tflops", "memory_bandwidth", "intra_node_bandwidth",
                     "inter_node_bandwidth"):
            value = getattr(self.gpu, name)
            if not 0 < value < math.inf:
                raise PlanError(f"{name.replace('_', ' ')} must be a positive finite number, not {value}")

    def matmul_flops(self, precision: str) -> float:
        """FLOP/s a GPU's matrix products reach in ``precision`` (a key of the planner's precisions)."""
        peak = self.gpu.fp32_tflops if precision == "fp32" else self.gpu.peak_tflops
        return peak * 1e12 * COMPUTE_EFFICIENCY

    def memory_bytes_per_second(self) -> float:
        """Bytes per second the element-wise kernels move."""
        return self.gpu.memory_bandwidth * 1e9 * MEMORY_EFFICIENCY

    def ranks_per_node(self, size: int, stride: int) -> int:
        """Of a group of ``size`` ranks ``stride`` apart (consecutive groups
        of the layout's grid), how many share a node."""
        return max(1, min(size, self.gpus_per_node // stride))

    def collective_seconds(self, kind: str, nbytes: float, size: int, stride: int) -> float:
        """Seconds of a ring ``kind`` (``"all_reduce"``, ``"all_gather"``,
        ``"reduce_scatter"``) of ``nbytes`` bytes (the whole tensor: the
        reduced one, the gathered output, the scattered input) among ``size``
        ranks ``stride`` apart in the layout's grid; 0 for a group of one."""
        if size <= 1 or nbytes <= 0:
            return 0.0
        per_node = self.ranks_per_node(size, stride)
        nodes = size // per_node
        twice = 2 if kind == "all_reduce" else 1
        steps, network_steps = twice * (size - 1), twice * (nodes - 1)
        latency = (NCCL_BASE_LATENCY + (steps - network_steps) * NCCL_NVLINK_STEP_LATENCY
                   + network_steps * NCCL_NETWORK_STEP_LATENCY)
        inside = (per_node - 1) / per_node * nbytes / (self.gpu.intra_node_bandwidth * 1e9 * LINK_EFFICIENCY)
        across = (nodes - 1) / nodes * nbytes / (per_node * self.gpu.inter_node_bandwidth * 1e9 * LINK_EFFICIENCY)
        return latency + twice * (inside + across)

    def network_bytes(self, kind: str, nbytes: float, size: int, stride: int) -> float:
        """Bytes each GPU's network adapter carries for the collective of
        :meth:`collective_seconds` (0 within a node)."""
        if size <= 1:
            return 0.0
        per_node = self.ranks_per_node(size, stride)
        nodes = size // per_node
        return (2 if kind == "all_reduce" else 1) * (nodes - 1) / nodes * nbytes / per_node

    def send_seconds(self, nbytes: float, across_nodes: bool) -> float:
        """Seconds of a point-to-point transfer of ``nbytes`` between two
        GPUs, through NVLink or each GPU's network adapter."""
        bandwidth = self.gpu.inter_node_bandwidth if across_nodes else self.gpu.intra_node_bandwidth
        step = NCCL_NETWORK_STEP_LATENCY if across_nodes else NCCL_NVLINK_STEP_LATENCY
        return NCCL_BASE_LATENCY + step + nbytes / (bandwidth * 1e9 * LINK_EFFICIENCY)
