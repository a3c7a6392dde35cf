"""Memory per GPU of one pipeline stage under a parallel layout.

Formulas (all per GPU, in bytes unless said otherwise):

* Mixed-precision Adam: fairseq's ``--fp16`` (its ``FP16Optimizer``) keeps
  the 2-byte weights and gradients, one flat fp32 copy of the weights
  (the master weights) with an fp32 gradient of its own
  (``build_fp32_params``: ``fp32_params.grad``), and Adam's two fp32
  moments: 2 + (2 + 4) + (4 + 8) = 20 bytes per parameter (the ZeRO paper's
  16, Rajbhandari et al. 2020, section 3.1, plus the fp32 gradient copy);
  fp32 training: 4 + 4 + 8. fairseq's ``--memory-efficient-fp16`` (the
  Megatron-11b recipe) keeps no fp32 copy: its Adam upcasts each fp16
  weight during the step, so 2 + 2 + 8. This package's ``--bf16-autocast``
  keeps fp32 weights and gradients (4 + 4 + 8) with 16-bit activations.
  fairseq's ``--zero-sharding os`` (ZeRO stage 1 through fairscale's OSS;
  Rajbhandari et al. 2020, section 5.1) splits Adam's m and v, 8 bytes, over
  the D data-parallel ranks of each model part; fairseq's fp32 master weights
  stay whole on every rank: 4 + 8/D with ``--fp16``, 8/D in fp32 and with
  ``--memory-efficient-fp16``. OSS
  hands out whole parameters (each to the rank holding the fewest elements
  so far), so a rank may hold up to one parameter's moments more than 1/D.
* ``--ddp-backend fully_sharded`` (torch's FSDP2; ZeRO stage 3, or 2 with
  ``--no-reshard-after-forward``; Rajbhandari et al. 2020, section 5) keeps
  fp32 weights, fp32 gradients and the optimizer state, each split over the
  D data-parallel ranks: (4 + 4 + 8) / D for Adam, in every precision (the
  sharded fp32 weights are the master weights). On top, what is gathered
  whole in the compute dtype (2 bytes with ``--fp16``, else 4): at stage 3
  two layers and the embedding, at stage 2 the whole stage from its forward
  to its backward, and one layer's gradients before their reduce-scatter.
* fairseq's Adafactor (``--optimizer adafactor``, no ``--beta1``: its
  default; Shazeer and Stern 2018, section 3) keeps, in fp32, a row and a
  column mean of the squared gradient for each weight matrix (``r + c``
  numbers for ``r x c``) and a full second moment for each vector (biases,
  layer norms): for Megatron-11b 0.003 bytes per parameter (0.01 at TP=8), against
  Adam's 8. fp32 master weights come on top with ``--fp16``, as for Adam.
* Activations of one layer, micro batch b, sequence s, heads a, TP size t,
  FFN ratio r = f/h, 16-bit activations and 1-byte dropout masks
  (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", section 4, generalised from r = 4 to any r):

  ===============================  ==============================================
  no tensor parallelism            ``s*b*h*(18 + 4r) + 5*a*s^2*b``
  tensor parallel                  ``s*b*h*(10 + (8 + 4r)/t) + 5*a*s^2*b/t``
  tensor + sequence parallel       ``(s*b*h*(18 + 4r) + 5*a*s^2*b) / t``
  full activation checkpointing    ``2*s*b*h`` (``/t`` with sequence parallel)
  ===============================  ==============================================

  With context parallelism over C ranks each holds ``s / C`` positions: the
  terms in ``s*b*h`` divide by C, and so does the attention matrix (its
  ``s / C`` queries attend to all ``s`` keys). Of the paper's ``10*s*b*h``,
  ``2*s*b*h`` are the two dropout masks of 1 byte per element
  (``mask_bytes``; a CPU's dropout keeps them in the activations' dtype).

  This package's layer keeps more than the paper counts: the q, k and v
  projections run as one GEMM on their weights concatenated at run time,
  which the backward keeps (``3h^2/t`` elements in the weights' dtype; under
  bf16 autocast each weight's bf16 copy instead, ``(4h^2 + 2hf)/t``).
  Beside one micro-batch's layers a stage holds, while it runs a backward,
  the gradient of the hidden states (``s*b*h``, ``/t`` with sequence
  parallelism) and of the widest activation, the FFN's (``s*b*f/t``); a
  pipeline stage keeps each micro-batch's output (``s*b*h``) until its
  backward; the first stage the embedding dropout's mask, the last the final
  layer norm's input and output and the logits (``s*b*V/t``), with their
  gradient in fp32 and again in the logits' dtype when the backward starts.
  ``fairseq-megatron-plan --dry-run`` (:mod:`~fairseq_megatron.planner.dry_run`)
  measured these on the full models' shapes.

  With checkpointing, a layer's backward first recomputes its forward, so
  one layer's activations without checkpointing are also allocated (counted
  once: layers are recomputed one at a time). ``--offload-activations`` moves
  the ``2*s*b*h`` kept per layer to host memory (reported apart).

  (r = 4 gives the paper's 34 and 24/t.) The GELU keeps its 16-bit input,
  as the paper counts: this package's layer calls ``F.gelu`` (fairseq's
  ``gelu`` would keep an fp32 copy, ``2*r*s*b*h/t`` more). With flash attention
  (``scaled_dot_product_attention``, as this package uses) the ``5*a*s^2*b``
  term of the attention matrix is not stored; without it each of the
  ``a*s^2*b`` scores keeps its soft-max and the dropout's output in the
  activations' dtype and the dropout's mask (``2e + mask_bytes``: the
  paper's 5 in 16-bit).
* Micro-batches in flight (torch's schedules, :mod:`fairseq_megatron.training.pipeline_schedule`):
  a stage keeps each chunk forward's activations until its backward, or
  under the schedules that split the backward until its weight pass; how
  many it holds at its peak depends on the schedule
  (:func:`~fairseq_megatron.training.pipeline_schedules.activations_in_flight`,
  whose docstring gives each schedule's count and source). Under 1F1B the
  first of ``P`` stages runs ``P`` forwards before its first backward, so
  it keeps ``L`` layers' worth of activations whatever ``P`` (Korthikanti
  et al. 2022, section 4.2.3), the last stage one micro-batch's; the
  interleaved schedule's first stage ``L * (1 + (P - 1) / (P * V))``.
  Between a chunk's input backward and its weight pass torch keeps the
  gradient flowing into each weight's operation
  (:func:`weight_pass_inputs_bytes_per_layer`; on the chunk that computes
  the logits their gradient too).
* The V-shaped schedules (``zbv``, ``dualpipev``) place chunks ``s`` and
  ``2P - 1 - s`` on stage ``s``: stage 0 holds both ends of the model (the
  embedding, the final layer norm, the tied output projection as the same
  tensor, the logits), stage ``P - 1`` two middle chunks and no embedding.
"""

import dataclasses
import functools
from typing import Optional, Tuple

from fairseq_megatron.models.pipeline_stage import V_SHAPE
from fairseq_megatron.planner.errors import PlanError
from fairseq_megatron.planner.shape import ModelShape
from fairseq_megatron.training.pipeline_schedules import SCHEDULES, Schedule, activations_in_flight

BYTES_PER_PARAM = {
    # precision: (weights, gradients, optimizer state)
    "fp16": (2, 6, 12),
    "bf16": (2, 6, 12),
    "fp32": (4, 4, 8),
    "memory-efficient-fp16": (2, 2, 8),
    "bf16-autocast": (4, 4, 8),
}
ACTIVATION_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "memory-efficient-fp16": 2, "bf16-autocast": 2}
ADAM_MOMENT_BYTES = 8  # m and v in fp32, the part of the optimizer state --zero-sharding os splits
FULLY_SHARDED = ("zero2", "zero3")


@dataclasses.dataclass
class Training:
    """How a model is trained, as far as memory and time go: ``precision``
    (a key of :data:`BYTES_PER_PARAM`), ``optimizer`` (``"adam"`` or
    ``"adafactor"``), activation ``checkpointing`` (``offloading`` implies
    it), sequence parallelism, flash attention, ``zero_sharding`` (fairseq's
    ``--zero-sharding os``) and ``fully_sharded`` (None, ``"zero3"`` or
    ``"zero2"``: ``--ddp-backend fully_sharded`` without or with
    ``--no-reshard-after-forward``) and ``fused_elementwise`` (fairseq-train's
    ``--compile-layers``: each dropout and the residual add after it run as
    one kernel; time only, :mod:`~fairseq_megatron.planner.step_time`)."""

    micro_batch: int
    precision: str = "fp16"
    checkpointing: bool = False
    sequence_parallel: bool = False
    flash_attention: bool = True
    offloading: bool = False
    zero_sharding: bool = False
    optimizer: str = "adam"
    fully_sharded: Optional[str] = None
    fused_elementwise: bool = False

    def check(self) -> None:
        """Raises PlanError for a value the planner does not know."""
        if self.precision not in BYTES_PER_PARAM:
            raise PlanError(f"precision must be one of {sorted(BYTES_PER_PARAM)}")
        if self.optimizer not in ("adam", "adafactor"):
            raise PlanError(f"optimizer must be adam or adafactor, not {self.optimizer!r}")
        if self.fully_sharded not in (None, *FULLY_SHARDED):
            raise PlanError(f"fully_sharded must be one of {FULLY_SHARDED}, not {self.fully_sharded!r}")
        if self.fully_sharded and self.zero_sharding:
            raise PlanError("--zero-sharding and --fully-sharded exclude each other (fully sharded data "
                            "parallelism shards the optimizer state itself)")
        if self.fully_sharded and self.precision == "bf16":
            raise PlanError("fully sharded training takes fp16, memory-efficient-fp16, fp32 or bf16-autocast "
                            "(fairseq's --bf16 means TPU)")

    @property
    def activation_bytes(self) -> int:
        """Bytes of one activation element."""
        return ACTIVATION_BYTES[self.precision]

    @property
    def compute_bytes(self) -> int:
        """Bytes of a weight as the layers compute with it (what fully sharded training gathers)."""
        return 2 if self.precision in ("fp16", "bf16", "memory-efficient-fp16") else 4


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """One GPU's memory in bytes: ``params`` (elements held), ``weights``,
    ``gradients``, ``optimizer`` (state, master weights included),
    ``activations`` (the most alive at once), ``host`` (offloaded layer
    inputs, in host memory), ``gathered`` (what fully sharded training
    gathers whole while it computes) and ``unsaved``, the part of
    ``activations`` autograd does not save for the backward (what
    :class:`~fairseq_megatron.training.memory.SavedActivations` does not
    count): the stage's outputs in flight, the backward's gradients, the
    gradients kept for weight passes."""

    params: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    host: float
    gathered: float
    unsaved: float = 0.0

    @property
    def total(self) -> float:
        """Bytes on the GPU."""
        return self.weights + self.gradients + self.optimizer + self.gathered + self.activations


def adafactor_state_elements(m: ModelShape, tp: int, layers: int, embedding: bool, final_norm: bool) -> int:
    """fp32 numbers fairseq's Adafactor (``beta1=None``) keeps for the
    parameters one GPU holds: ``layers`` decoder layers split ``tp`` ways,
    plus the vocab-parallel embedding (tied with the output projection, and
    the learned positions if any) and the final layer norm when asked.
    Weight matrices keep ``rows + cols``, vectors one number per element;
    the 0-dim ``RMS`` kept per parameter tensor is not counted. Layer
    shapes as built by this package: q, k, v and fc1 column-parallel
    (``out / tp x in``), out_proj and fc2 row-parallel (``out x in / tp``,
    full bias), layer norms replicated."""
    h, f, t = m.hidden, m.ffn, tp
    matrices = 4 * (h // t + h) + (f // t + h) + (h + f // t)  # q, k, v, out_proj; fc1; fc2
    vectors = 3 * (h // t) + h + f // t + h + 4 * h  # q/k/v, out_proj, fc1, fc2 biases; two layer norms
    n = layers * (matrices + vectors)
    if embedding:
        n += m.vocab // t + h + ((m.seq_len + h) if m.learned_positions else 0)
    if final_norm:
        n += 2 * h
    return n


def activation_bytes_per_layer(m: ModelShape, micro_batch: int, tp: int, sequence_parallel: bool,
                               checkpointing: bool, flash_attention: bool = True,
                               precision: str = "fp16", context_parallel: int = 1, mask_bytes: float = 1) -> float:
    """Stored activations of one layer on one GPU, bytes (Korthikanti et al.
    2022, section 4, with this package's additions; the table in this
    module's docstring), for this GPU's ``seq_len / context_parallel``
    positions. ``mask_bytes``: bytes of a dropout mask element (1 on a GPU;
    a CPU's dropout keeps its mask in the activations' dtype)."""
    s, b, h, a, c, t = m.seq_len, micro_batch, m.hidden, m.heads, context_parallel, tp
    e = ACTIVATION_BYTES[precision]
    scale = e / 2  # the formulas count 16-bit activations
    if checkpointing:
        return 2 * s * b * h * scale / c / (t if sequence_parallel else 1)
    r = m.ffn / h
    # without flash attention: the soft-max output and the dropout's output in the activations' dtype and its mask
    # (the paper's 5 bytes per score in 16-bit with 1-byte masks)
    attention_matrix = 0 if flash_attention else (2 * e + mask_bytes) * a * s * s * b / c
    replicated = s * b * h * (8 * scale + 2 * mask_bytes) / c  # layer norms' inputs and outputs, the two masks
    split = s * b * h * (8 + 4 * r) * scale / c + attention_matrix
    kept = kept_weight_bytes(m, t, precision)
    return (replicated + split) / t + kept if sequence_parallel else replicated + split / t + kept


def kept_weight_bytes(m: ModelShape, tp: int, precision: str) -> float:
    """Weights one layer's forward creates and keeps for its backward: the
    q, k and v projections' weights concatenated (one GEMM, ``3h^2/T``
    elements in the weights' dtype), or under bf16 autocast the bf16 copy
    of every weight (``(4h^2 + 2hf)/T``)."""
    h = m.hidden
    if precision == "bf16-autocast":
        return 2 * (4 * h * h + 2 * h * m.ffn) / tp
    return BYTES_PER_PARAM[precision][0] * 3 * h * h / tp


def model_ends_bytes(m: ModelShape, micro_batch: int, tp: int, precision: str, first: bool, last: bool,
                     context_parallel: int = 1, mask_bytes: float = 1, sequence_parallel: bool = False) -> float:
    """Activations of one micro-batch outside the layers: on the first stage
    the embedding dropout's mask; on the last the final layer norm's input
    and output, the logits (``s*b*V/T``, the activations' dtype) and, when
    the backward starts, their gradient in fp32 and again in the logits' dtype."""
    e = ACTIVATION_BYTES[precision]
    tokens = m.seq_len * micro_batch / context_parallel
    split = tp if sequence_parallel else 1
    ends = mask_bytes * tokens * m.hidden / split if first else 0
    if last:
        ends += 2 * e * tokens * m.hidden / split + (2 * e + 4) * tokens * m.vocab / tp
    return ends


def default_schedule(vp: int) -> Schedule:
    """The schedule fairseq-train runs without ``--pipeline-schedule``:
    interleaved 1F1B with more than one chunk per stage, else 1F1B."""
    return SCHEDULES["interleaved-1f1b" if vp > 1 else "1f1b"]


def chunk_passes_in_flight(stage: int, pp: int, vp: int, micro_batches: int, schedule: Optional[str] = None) -> int:
    """Chunk forwards (``L / (P * V)`` layers each) whose activations
    ``stage`` of ``pp`` holds at once under ``schedule`` (by default
    :func:`default_schedule`):
    :func:`~fairseq_megatron.training.pipeline_schedules.activations_in_flight`."""
    chosen = SCHEDULES[schedule] if schedule else default_schedule(vp)
    return activations_in_flight(chosen, stage, pp, vp, micro_batches).forwards


def weight_pass_inputs_bytes_per_layer(m: ModelShape, micro_batch: int, tp: int, sequence_parallel: bool,
                                       precision: str = "fp16", context_parallel: int = 1) -> float:
    """Bytes one layer keeps between a micro-batch's input backward and its
    weight pass under a split backward, on one GPU: torch's
    ``stage_backward_input`` keeps the gradient flowing into each operation
    that has weights (``param_groups``' ``grads``): the fused q/k/v
    projection's output (``3h / T``), the output projection's and the second
    FFN matrix's (``h`` each, before their all-reduce or reduce-scatter), the
    first FFN matrix's (``f / T``) and the two layer norms' (``h``, ``/ T``
    with sequence parallelism): ``s*b*(7h + f)`` elements without tensor
    parallelism, in the activations' dtype."""
    s, b, h, f, t = m.seq_len / context_parallel, micro_batch, m.hidden, m.ffn, tp
    norms = 2 * h / (t if sequence_parallel else 1)
    return ACTIVATION_BYTES[precision] * s * b * (3 * h / t + f / t + 2 * h + norms)


def _pipeline_and_backward_bytes(m: ModelShape, tp: int, pp: int, cp: int, in_flight: int, training: Training,
                                 last_stage: bool) -> float:
    """Activations beyond the layers' own: a pipeline stage keeps each
    chunk's output until its backward (torch's ``PipelineStage``; all but
    the model's last chunk), and the backward holds the gradient of the
    hidden states and of the widest activation, the FFN's, at once."""
    e, tokens = training.activation_bytes, m.seq_len * training.micro_batch / cp
    outputs = 0 if pp == 1 else (in_flight - 1 if last_stage else in_flight)
    hidden = e * tokens * m.hidden
    return outputs * hidden + hidden / (tp if training.sequence_parallel else 1) + e * tokens * m.ffn / tp


def _stage_activations(m: ModelShape, t: int, pp: int, cp: int, vp: int, accumulation: int, training: Training,
                       chosen: Schedule, stage_index: int, first: bool, last: bool,
                       mask_bytes: float) -> Tuple[float, float, float]:
    """The most activation bytes stage ``stage_index`` holds at once on the
    GPU, in host memory (offloaded), and of the first those autograd does not
    save (``StageMemory.unsaved``), under schedule ``chosen``; ``first``
    and ``last``: it holds the model's first / last chunk."""
    layers = m.layers // pp
    peak = activations_in_flight(chosen, stage_index, pp, vp, accumulation)
    in_flight = peak.forwards
    per_layer = functools.partial(activation_bytes_per_layer, m, training.micro_batch, t, training.sequence_parallel,
                                  flash_attention=training.flash_attention, precision=training.precision,
                                  context_parallel=cp, mask_bytes=mask_bytes)
    ends = functools.partial(model_ends_bytes, m, training.micro_batch, t, training.precision, context_parallel=cp,
                             mask_bytes=mask_bytes, sequence_parallel=training.sequence_parallel)
    kept = per_layer(checkpointing=training.checkpointing) * layers * in_flight / vp
    act, host = (0, kept) if training.offloading else (kept, 0)
    unsaved = _pipeline_and_backward_bytes(m, t, pp, cp, in_flight, training, last)
    act += ends(first, False) * in_flight / vp + unsaved
    if training.checkpointing:
        act += per_layer(checkpointing=False)  # the layer being recomputed
    tokens = m.seq_len * training.micro_batch / cp
    if last:
        act += ends(False, True)  # one micro-batch's logits: the last stage runs its backward at once
        unsaved += (training.activation_bytes + 4) * tokens * m.vocab / t  # their gradient, fp32 and the logits'
    kept_for_weights = 0.0
    if peak.weight_passes:  # the gradients a split backward keeps for its weight passes (an upper bound on the
        # model's first chunk, whose whole backward torch runs at the weight pass: its input takes no gradient)
        kept_for_weights = peak.weight_passes * layers / vp * weight_pass_inputs_bytes_per_layer(
            m, training.micro_batch, t, training.sequence_parallel, training.precision, cp)
        if last:  # the logits' gradient, for the output projection's weight pass
            kept_for_weights += peak.weight_passes * training.activation_bytes * tokens * m.vocab / t
    return act + kept_for_weights, host, unsaved + kept_for_weights


def stage_memory(m: ModelShape, tp: int, pp: int, dp: int, accumulation: int, training: Training,
                 cp: int = 1, vp: int = 1, stage: str = "first", mask_bytes: float = 1,
                 schedule: Optional[str] = None) -> StageMemory:
    """The memory of one GPU of the ``"first"`` pipeline stage (the
    embedding, ``L / PP`` layers and the most micro-batches in flight) or
    of the ``"last"`` (its layers, the final layer norm, the tied output
    projection's copy of the embedding, and the logits); the same with one
    stage. ``schedule``: a ``--pipeline-schedule`` name (default: what
    fairseq-train runs with ``vp`` chunks, :func:`default_schedule`); under
    the V-shaped ones the first stage holds both ends of the model and the
    last neither (this module's docstring).

    Under fully sharded data parallelism (FSDP2, one unit per decoder layer
    and one for the rest) every rank keeps fp32 weights, fp32 gradients and
    the optimizer state, each ``1 / DP`` (the sharded fp32 weights are the
    master weights: no copy), plus what is gathered in the compute dtype
    (16-bit for ``--fp16``, else fp32) while it computes: with ``"zero3"``
    two layers (the one computing and the one prefetched), the root unit
    (the embedding, kept from the forward to the backward), and one layer's
    unsharded gradients before they are reduce-scattered; with ``"zero2"``
    every layer's weights from its forward to its backward, and the same
    gradients. Zhao et al. 2023, "PyTorch FSDP", section 3.
    """
    w_b, g_b, o_b = BYTES_PER_PARAM[training.precision]
    t, layers = tp, m.layers // pp
    chosen = SCHEDULES[schedule] if schedule else default_schedule(vp)
    first, last = stage == "first", stage == "last" or pp == 1  # the stage holds the first chunk; the last chunk
    if pp > 1 and chosen.placement == V_SHAPE:
        last = first  # stage 0 holds both ends, stage P - 1 neither
    embed = m.embedding_parameters() if first else (m.vocab * m.hidden if last else 0)
    params = (embed + m.layer_parameters() * layers) // t + (2 * m.hidden if last else 0)
    act, host, unsaved = _stage_activations(m, t, pp, cp, vp, accumulation, training, chosen, 0 if stage == "first" else pp - 1,
                                   first, last, mask_bytes)
    if training.optimizer == "adam":
        state = ADAM_MOMENT_BYTES * params
    else:
        state = 4 * adafactor_state_elements(m, t, layers, embedding=bool(embed), final_norm=last)
    gathered = 0.0
    shards = dp * cp  # fully sharded over the data- and context-parallel ranks, as gradients are averaged
    if training.fully_sharded:
        compute = training.compute_bytes
        weights, grads, optim = 4 * params / shards, 4 * params / shards, state / shards
        unit = compute * m.layer_parameters() // t
        held = params if training.fully_sharded == "zero2" else 2 * m.layer_parameters() // t + embed // t
        gathered = compute * held + unit
    else:
        master = (o_b - ADAM_MOMENT_BYTES) * params  # fp32 master weights (--fp16): 4 bytes each
        grads = params * g_b
        weights, optim = params * w_b, master + (state / shards if training.zero_sharding else state)
    return StageMemory(params, weights, grads, optim, act, host, gathered, unsaved)
