"""The predicted time of one training step (one optimizer update) under a
parallel layout, by cost.

Per micro-batch, on one GPU of the slowest pipeline stage (the last: it
also computes the output projection and the loss), in the order a
micro-batch meets them:

* **compute**: the stage's matrix-product FLOPs (:meth:`ModelShape.training_flops`'s
  count: forward, backward twice the forward, and the forward again with
  ``--checkpoint-activations``), split ``T x C`` ways, at
  :data:`~fairseq_megatron.planner.hardware.COMPUTE_EFFICIENCY` of the peak;
* **memory-bound**: the bytes the element-wise kernels read and write
  (counted below), at the HBM bandwidth the kernels reach;
* **tensor parallel**: per layer, each block's all-reduce forward and
  backward (Shoeybi et al. 2019, Fig. 3), again in the recomputed forward;
  with sequence parallelism an all-gather and a reduce-scatter instead, and
  in the backward one more all-gather of each column-parallel block's
  saved input shard (Korthikanti et al. 2022, section 4.2.2): messages of
  ``s*b*h`` activations (``/ C`` with context parallelism) within the
  tensor-parallel group, which stays in a node;
* **context parallel**: per layer, the all-gather of the keys and values of
  all ``s`` positions (``2*s*b*h/T`` activations) in the forward (and the
  recomputed one), again in the backward, and the reduce-scatter of their
  gradients;
* **pipeline transfers**: each of the ``V`` chunks of a stage receives a
  micro-batch's activations (``s*b*h/C``) and sends back their gradient,
  through the network once the model copy spans nodes (torch's schedules
  wait for each receive before computing); and once per step, after the
  backward, the all-reduce of the tied token embedding's gradient between
  the first stage, which holds the embedding, and the last, which holds its
  copy for the output projection (``V*h / T`` gradients, over the network
  once the model copy spans nodes; this package's
  ``PipelineSchedule._sum_embedding_grads``, as Megatron-LM's
  ``_allreduce_word_embedding_grads``, Narayanan et al. 2021's code, which
  also ran it after the flush).

A stage's step is then ``(m + (P - 1) / V) * cycle`` for ``m`` micro-batches
and a cycle of the costs above (the **pipeline bubble** is the
``(P - 1) / V`` part; Narayanan et al. 2021, section 2.2) under 1F1B and
interleaved 1F1B. Under each ``--pipeline-schedule`` the bubble is
:func:`~fairseq_megatron.training.pipeline_schedules.bubble`'s (its
docstring gives each schedule's formula and paper) for a forward ``F``, an
input backward ``B`` and a weight backward ``W`` that share the cycle as
their passes do: ``F = W`` one pass each, ``B`` the rest (one pass, two
with recomputation, which runs before the input backward); ZB-1P's
``(P - 1)(F + B - W)`` is then a third of 1F1B's, ZB-V's
``(P - 1)(F + B - 2W) / 2`` none. The split backward is counted at the
FLOPs of the whole one: the extra time its two graph walks took on a CPU
(docs/benchmarks.md) is not in the model. The V-shaped schedules keep the
tied embedding as one tensor on stage 0: no all-reduce of its gradient.
After it:

* **data parallel**: the all-reduce of this GPU's gradients (in their
  dtype) over the ``D x C`` ranks that average them; fairseq's DDP overlaps
  it with the last micro-batch's backward when there is one stage
  (``--ddp-backend pytorch_ddp``); with pipeline stages (``legacy_ddp``) it
  follows the backward. ``--zero-sharding os`` adds the broadcast of the
  updated weights. Fully sharded: per micro-batch, the all-gather of the
  stage's weights in the compute dtype before the forward (and again
  before the backward at ZeRO-3) and the reduce-scatter of the gradients,
  overlapped with the forward and the backward by FSDP2's prefetching:
  what exceeds the pass they overlap is exposed; and the copies into and
  out of the collectives' buffers are memory-bound work;
* **optimizer**: :data:`OPTIMIZER_BYTES` per parameter held, moved at the
  HBM bandwidth.

Element-wise bytes of one layer's forward, per GPU, for activations of
``e`` bytes and 1-byte dropout masks: two layer norms (read, write), two
dropouts (read, write, mask) and two residual adds (read two, write one):
``(14e + 2) * s*b*h`` (``/ T`` with sequence parallelism); with the
dropout and the residual add fused (``Training.fused_elementwise``:
torch.compile's kernels under ``--compile-layers``, as the Megatron-LM
paper's bias + dropout + add kernel, Narayanan et al. 2021, section 4.2),
each pair reads its two inputs and writes the sum and the mask:
``(10e + 2) * s*b*h``; GeLU:
``2e * s*b*f / T``; attention: with flash attention its inputs and output,
``4e * s*b*h / T``, without it the ``a*s^2*b / T`` scores written, soft-maxed,
dropped out and read again: ``(6e + 1)`` bytes each; all ``/ C``. The
backward moves twice the forward's bytes. The loss reads and writes the
fp32 logits ``s*b*V / T`` about ten times (:data:`LOSS_PASSES`).

The FLOPs per GPU reported (``predicted_tflops_per_gpu``) are the
step's :meth:`ModelShape.training_flops` over the predicted time and the
GPUs: Narayanan et al. 2021's count, recomputation included.
"""

import dataclasses
from typing import Dict, Optional, Tuple

from fairseq_megatron.models.pipeline_stage import V_SHAPE
from fairseq_megatron.planner.hardware import Cluster
from fairseq_megatron.planner.memory import Training, default_schedule
from fairseq_megatron.planner.shape import ModelShape
from fairseq_megatron.training.pipeline_schedules import SCHEDULES, bubble

OPTIMIZER_BYTES = 48  # weights, gradients and state read and written by the update, per parameter
LOSS_PASSES = 10  # fp32 passes over the logits: cast, max, subtract, exp, sum; the gradient's
COSTS = ("compute", "memory_bound", "tensor_parallel", "context_parallel", "pipeline_transfers", "pipeline_bubble",
         "data_parallel", "optimizer")


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of one step by cost (:data:`COSTS`, summing to :attr:`seconds`),
    the step's model FLOPs over all GPUs, the number of GPUs, and the bytes
    each GPU sends through its network adapter in the step."""

    costs: Dict[str, float]
    flops: float
    gpus: int
    network_bytes: float = 0.0

    @property
    def seconds(self) -> float:
        return sum(self.costs.values())

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOP/s per GPU (1e12 FLOP/s)."""
        return self.flops / self.seconds / self.gpus / 1e12

    def shares(self) -> Dict[str, float]:
        """Each cost's share of the step."""
        return {name: value / self.seconds for name, value in self.costs.items()}


def elementwise_bytes_per_layer(m: ModelShape, micro_batch: int, tp: int, cp: int, training: Training) -> float:
    """Bytes the element-wise kernels of one layer's forward move on one GPU (this module's docstring)."""
    e, s, b = training.activation_bytes, m.seq_len, micro_batch
    sbh = s * b * m.hidden / cp
    replicated = ((10 if training.fused_elementwise else 14) * e + 2) * sbh / (tp if training.sequence_parallel else 1)
    gelu = 2 * e * sbh * m.ffn / m.hidden / tp
    if training.flash_attention:
        attention = 4 * e * sbh / tp
    else:
        attention = (6 * e + 1) * m.heads * s * s * b / (tp * cp)
    return replicated + gelu + attention


def _tensor_parallel_seconds(m: ModelShape, tp: int, cp: int, training: Training, cluster: Cluster) -> float:
    """One micro-batch's tensor-parallel collectives on one layer."""
    message = m.seq_len * training.micro_batch * m.hidden * training.activation_bytes / cp
    forwards = 2 if training.checkpointing else 1
    if training.sequence_parallel:
        gather = cluster.collective_seconds("all_gather", message, tp, 1)
        scatter = cluster.collective_seconds("reduce_scatter", message, tp, 1)
        return forwards * 2 * (gather + scatter) + 4 * gather + 2 * scatter  # backward: 2 RS, 2 AG, 2 re-gathers
    return (2 * forwards + 2) * cluster.collective_seconds("all_reduce", message, tp, 1)


def _context_parallel_seconds(m: ModelShape, tp: int, cp: int, training: Training, cluster: Cluster) -> float:
    """One micro-batch's key/value all-gathers and gradient reduce-scatter on one layer."""
    keys_values = 2 * m.seq_len * training.micro_batch * m.hidden / tp * training.activation_bytes
    forwards = 2 if training.checkpointing else 1
    return ((forwards + 1) * cluster.collective_seconds("all_gather", keys_values, cp, tp)
            + cluster.collective_seconds("reduce_scatter", keys_values, cp, tp))


def _fully_sharded_seconds(work: float, passes: int, training: Training, cluster: Cluster, weights: float,
                           replicas: int, tp: int) -> float:
    """What one micro-batch's gathers and reduce-scatter of ``weights``
    bytes add to ``work`` seconds of its passes: each overlaps the pass it
    serves (the forward's ``1 / passes``, the backward's rest)."""
    gather = cluster.collective_seconds("all_gather", weights, replicas, tp)
    scatter = cluster.collective_seconds("reduce_scatter", weights, replicas, tp)
    gathers = 2 if training.fully_sharded == "zero3" else 1
    return (max(0.0, gather - work / passes)
            + max(0.0, (gathers - 1) * gather + scatter - work * (passes - 1) / passes))


def _gradient_reduction_seconds(training: Training, cluster: Cluster, params: int, replicas: int, tp: int,
                                pp: int, overlap: float) -> Tuple[float, float]:
    """Seconds the data-parallel gradient all-reduce (and ``--zero-sharding
    os``'s broadcast of the weights) adds after the backward, ``overlap``
    seconds of which it may hide behind with one stage; and the bytes it sends
    across nodes."""
    wide = training.precision in ("fp32", "bf16-autocast")
    gradients = params * (4 if wide else 2)
    seconds = cluster.collective_seconds("all_reduce", gradients, replicas, tp)
    sent = cluster.network_bytes("all_reduce", gradients, replicas, tp)
    if pp == 1:  # pytorch_ddp: overlapped with the last micro-batch's backward
        seconds = max(0.0, seconds - overlap)
    if training.zero_sharding:  # fairscale's OSS broadcasts each rank's updated weights
        seconds += cluster.collective_seconds("all_gather", gradients, replicas, tp)
        sent += cluster.network_bytes("all_gather", gradients, replicas, tp)
    return seconds, sent


def _embedding_reduction_seconds(m: ModelShape, tp: int, training: Training, cluster: Cluster, across_nodes: bool,
                                 shards: int) -> Tuple[float, float]:
    """Seconds of the all-reduce of the tied embedding's gradient (``V*h / T``
    elements in the gradients' dtype, split ``shards`` ways when fully
    sharded) between the first and the last pipeline stage, and the bytes it
    sends across nodes."""
    wide = training.precision in ("fp32", "bf16-autocast")
    gradients = m.vocab * m.hidden / tp * (4 if wide else 2) / shards
    stride = cluster.gpus_per_node if across_nodes else 1  # two stages in two nodes, or in one
    return (cluster.collective_seconds("all_reduce", gradients, 2, stride),
            cluster.network_bytes("all_reduce", gradients, 2, stride))


def step_time(m: ModelShape, tp: int, pp: int, dp: int, accumulation: int, training: Training, cluster: Cluster,
              params_per_gpu: int, cp: int = 1, vp: int = 1, global_batch: int = None,
              schedule: Optional[str] = None) -> StepTime:
    """The predicted seconds of one step of ``accumulation`` micro-batches
    per model copy (this module's docstring), for a GPU holding
    ``params_per_gpu`` parameters of its stage before any sharding.
    ``global_batch`` (sequences) defaults to ``micro_batch * accumulation * dp``;
    ``schedule``, a ``--pipeline-schedule`` name, to what fairseq-train runs
    with ``vp`` chunks per stage."""
    chosen = SCHEDULES[schedule] if schedule else default_schedule(vp)
    b, layers, passes = training.micro_batch, m.layers // pp, (4 if training.checkpointing else 3)
    rate, memory_rate = cluster.matmul_flops(training.precision), cluster.memory_bytes_per_second()
    logits = m.seq_len * b * m.vocab / (tp * cp)
    activation = m.seq_len * b * m.hidden * training.activation_bytes / cp  # a micro-batch's hidden states
    compute = (layers * m.layer_forward_flops() * passes + 3 * m.logits_forward_flops()) * b / (tp * cp) / rate
    moved = layers * elementwise_bytes_per_layer(m, b, tp, cp, training) * passes + LOSS_PASSES * 4 * logits
    tensor = layers * _tensor_parallel_seconds(m, tp, cp, training, cluster)
    if tp > 1:  # the output projection's input (its gradient all-reduced) and the loss's three reductions
        tensor += cluster.collective_seconds("all_reduce", activation, tp, 1)
        tensor += 3 * cluster.collective_seconds("all_reduce", 4 * m.seq_len * b / cp, tp, 1)
    context = layers * _context_parallel_seconds(m, tp, cp, training, cluster)
    across_nodes = cluster.gpus > cluster.gpus_per_node and pp > 1
    transfers = 2 * vp * cluster.send_seconds(activation, across_nodes) if pp > 1 else 0.0
    sent = accumulation * 2 * vp * activation if across_nodes else 0.0
    replicas, sharded, reduction = dp * cp, 0.0, 0.0  # the ranks that average each gradient
    if training.fully_sharded and replicas > 1:
        weights = params_per_gpu * training.compute_bytes
        gathers = 2 if training.fully_sharded == "zero3" else 1
        moved += (gathers + 1) * 2 * weights  # copy-out of each gather, copy-in of the reduce-scatter
        sharded = _fully_sharded_seconds(compute + moved / memory_rate + tensor + context, passes, training,
                                         cluster, weights, replicas, tp)
        sent += accumulation * (gathers + 1) * cluster.network_bytes("all_gather", weights, replicas, tp)
    cycle = compute + moved / memory_rate + tensor + context + transfers + sharded
    if not training.fully_sharded:
        reduction, reduced = _gradient_reduction_seconds(training, cluster, params_per_gpu, replicas, tp, pp,
                                                         cycle * (passes - 1) / passes)
        sent += reduced
    held = params_per_gpu / (replicas if training.fully_sharded else 1)
    embedding = 0.0
    if pp > 1 and chosen.placement != V_SHAPE:  # the tied embedding's two copies, on the first and the last stage
        embedding, embedding_sent = _embedding_reduction_seconds(m, tp, training, cluster, across_nodes,
                                                                 replicas if training.fully_sharded else 1)
        sent += embedding_sent
    costs = {
        "compute": accumulation * compute,
        "memory_bound": accumulation * (moved / memory_rate),
        "tensor_parallel": accumulation * tensor,
        "context_parallel": accumulation * context,
        "pipeline_transfers": accumulation * transfers + embedding,
        "pipeline_bubble": bubble(chosen, pp, vp, 1, passes - 2, 1) / passes * cycle,
        "data_parallel": accumulation * sharded + reduction,
        "optimizer": held * OPTIMIZER_BYTES / memory_rate,
    }
    sequences = global_batch or b * accumulation * dp
    return StepTime(costs, m.training_flops(sequences, training.checkpointing), tp * pp * dp * cp, sent)
