"""Parallelism planner: tensor/pipeline/data-parallel layouts, batch sizes and memory per GPU.

Formulas (all per GPU, in bytes unless said otherwise):

* Parameters of a pre-norm decoder with hidden h, FFN f, L layers, padded
  vocabulary V (tied input/output embedding), optional learned positions s:
  ``V*h [+ s*h] + L*(4h^2 + 4h  +  2hf + f + h  +  4h) + 2h``
  (attention, FFN, two layer norms; final layer norm). With f = 4h this is
  Megatron-LM's ``12*L*h^2 * (1 + 13/(12h) + (V+s)/(12*L*h))``
  (Narayanan et al. 2021, eq. 2).
* Mixed-precision Adam (Megatron-LM, ZeRO paper accounting): 2 bytes of
  fp16/bf16 weights + 2 of gradients + 12 of optimizer state (fp32 master
  weights, Adam m and v) per parameter; fp32 training: 4 + 4 + 8.
  fairseq's ``--memory-efficient-fp16`` (the Megatron-11b recipe) keeps no
  fp32 master weights: its Adam upcasts each fp16 weight during the step,
  so 2 + 2 + 8. This package's ``--bf16-autocast`` keeps fp32 weights and
  gradients (4 + 4 + 8) with 16-bit activations.
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

  With checkpointing, a layer's backward first recomputes its forward, so
  one layer's activations without checkpointing are also allocated (counted
  once: layers are recomputed one at a time). ``--offload-activations`` moves
  the ``2*s*b*h`` kept per layer to host memory (reported apart).

  (r = 4 gives the paper's 34 and 24/t.) The GELU keeps its 16-bit input,
  as the paper counts: this package's layer calls ``F.gelu`` (fairseq's
  ``gelu`` would keep an fp32 copy, ``2*r*s*b*h/t`` more). With flash attention
  (``scaled_dot_product_attention``, as this package uses) the ``5*a*s^2*b``
  term of the attention matrix is not stored. With 1F1B pipeline schedules
  the first stage keeps ``L`` layers' worth of activations in flight whatever
  the pipeline size (paper, section 4.2.3), plus the logits of the loss in
  fp32, ``4*s*b*V/t``.
* Model FLOPs per token: ``6*P + 12*L*h*s`` (forward + backward; the second
  term is attention's score and value products).
"""

import dataclasses
import functools
import math
from typing import Dict, List, Optional, Tuple

BYTES_PER_PARAM = {
    # precision: (weights, gradients, optimizer state)
    "fp16": (2, 2, 12),
    "bf16": (2, 2, 12),
    "fp32": (4, 4, 8),
    "memory-efficient-fp16": (2, 2, 8),
    "bf16-autocast": (4, 4, 8),
}
ACTIVATION_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "memory-efficient-fp16": 2, "bf16-autocast": 2}
ADAM_MOMENT_BYTES = 8  # m and v in fp32, the part of the optimizer state --zero-sharding os splits


class PlanError(ValueError):
    """A request that no layout can satisfy, with the reason."""


@dataclasses.dataclass
class ModelShape:
    """A decoder-only LM's shape: layers, hidden size, attention heads, FFN
    size, padded vocabulary rows and sequence length (tokens); learned or
    (default) sinusoidal positions."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq_len: int
    learned_positions: bool = False

    def parameters(self) -> int:
        """Exact parameter count of this package's model at model-parallel size 1."""
        h, f = self.hidden, self.ffn
        per_layer = (4 * h * h + 4 * h) + (2 * h * f + f + h) + 4 * h
        positions = self.seq_len * h if self.learned_positions else 0
        return self.vocab * h + positions + self.layers * per_layer + 2 * h

    def flops_per_token(self) -> float:
        """Model FLOPs per trained token (forward + backward, no recompute):
        ``6 * parameters + 12 * layers * hidden * seq_len``, the attention
        scores and their weighted sum counted in full (Chowdhery et al. 2022,
        PaLM, appendix B), the count the training log uses
        (:func:`~fairseq_megatron.training.throughput.model_flops_per_token`)."""
        from fairseq_megatron.training.throughput import model_flops_per_token

        return model_flops_per_token(self.parameters(), self.layers, self.hidden, self.seq_len)


def megatron_arch_shape(arch: str, vocab: int = 51200, seq_len: int = 1024) -> ModelShape:
    """The shape of an arch registered by this package (``transformer_lm_megatron[_11b]``)."""
    from argparse import Namespace

    from fairseq.models import ARCH_CONFIG_REGISTRY

    import fairseq_megatron  # noqa: F401  (registers the archs)

    if arch not in ARCH_CONFIG_REGISTRY:
        raise PlanError(f"unknown arch {arch!r}")
    args = Namespace()
    ARCH_CONFIG_REGISTRY[arch](args)
    return ModelShape(args.decoder_layers, args.decoder_embed_dim, args.decoder_attention_heads,
                      args.decoder_ffn_embed_dim, vocab, seq_len, learned_positions=args.decoder_learned_pos)


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
                               precision: str = "fp16") -> float:
    """Stored activations of one layer on one GPU, bytes (Korthikanti et al.
    2022, section 4; the table in this module's docstring)."""
    s, b, h, a = m.seq_len, micro_batch, m.hidden, m.heads
    scale = ACTIVATION_BYTES[precision] / 2  # the formulas count 16-bit activations
    if checkpointing:
        return 2 * s * b * h * scale / (tp if sequence_parallel else 1)
    r = m.ffn / h
    attention_matrix = 0 if flash_attention else 5 * a * s * s * b
    if sequence_parallel:
        return (s * b * h * (18 + 4 * r) + attention_matrix) * scale / tp
    return (s * b * h * (10 + (8 + 4 * r) / tp) + attention_matrix / tp) * scale


@dataclasses.dataclass
class Layout:
    """One (tensor, pipeline, data) parallel layout and its cost per GPU:
    gradient accumulation steps per optimizer step, parameters, and memory
    in GB (1e9 bytes) by kind; ``fits`` compares ``total_gb`` with the GPU's
    memory."""

    tp: int
    pp: int
    dp: int
    grad_accumulation: int
    params_per_gpu: int
    weights_gb: float
    gradients_gb: float
    optimizer_gb: float
    activations_gb: float
    total_gb: float
    fits: bool
    pipeline_bubble: float  # (PP - 1) / micro batches per step (Narayanan et al. 2021, section 2.2)
    host_activations_gb: float = 0.0  # the layer inputs --offload-activations keeps in host memory
    gathered_gb: float = 0.0  # fully sharded: weights and gradients gathered whole while computing
    sharding: str = "none"  # of the data-parallel copies: none, os (--zero-sharding os), zero2 or zero3

    def as_dict(self) -> Dict:
        return dataclasses.asdict(self)


FULLY_SHARDED = ("zero2", "zero3")


@dataclasses.dataclass
class Training:
    """How a model is trained, as far as memory goes: ``precision`` (a key of
    :data:`BYTES_PER_PARAM`), ``optimizer`` (``"adam"`` or ``"adafactor"``),
    activation ``checkpointing`` (``offloading`` implies it), sequence
    parallelism, flash attention, ``zero_sharding`` (fairseq's
    ``--zero-sharding os``) and ``fully_sharded`` (None, ``"zero3"`` or
    ``"zero2"``: ``--ddp-backend fully_sharded`` without or with
    ``--no-reshard-after-forward``)."""

    micro_batch: int
    precision: str = "fp16"
    checkpointing: bool = False
    sequence_parallel: bool = False
    flash_attention: bool = True
    offloading: bool = False
    zero_sharding: bool = False
    optimizer: str = "adam"
    fully_sharded: Optional[str] = None

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


def plan(m: ModelShape, gpus: int, gpus_per_node: int, gpu_memory_gb: float, micro_batch: int,
         global_batch: int, precision: str = "fp16", checkpointing: bool = False,
         sequence_parallel: bool = False, flash_attention: bool = True,
         tp: Optional[int] = None, pp: Optional[int] = None, offloading: bool = False,
         zero_sharding: bool = False, optimizer: str = "adam",
         fully_sharded: Optional[str] = None) -> List[Layout]:
    """Every valid (TP, PP, DP) layout with its memory per GPU.

    ``offloading`` (``--offload-activations``) implies ``checkpointing``.
    ``zero_sharding`` (fairseq's ``--zero-sharding os``) divides the
    optimizer's own state (Adam's moments, Adafactor's statistics) by the
    data-parallel size. ``fully_sharded`` (``"zero3"``, ``"zero2"``) divides
    weights, gradients and optimizer state by it (:func:`layout_memory`).
    ``optimizer``: ``"adam"`` or ``"adafactor"``.

    Valid: TP divides the heads and the FFN size and stays within a node
    (TP divides ``gpus_per_node``), PP divides the layers, DP = gpus / (TP*PP)
    is whole, the global batch is a whole number of micro batches per
    data-parallel rank (gradient accumulation = global / (micro * DP)), and
    with PP > 1 there are at least PP micro batches per update (the 1F1B
    schedule that ``--pipeline-model-parallel-size`` trains with runs the
    update's ``--update-freq`` micro batches and needs one per stage).

    ``tp`` / ``pp`` restrict the search to one tensor / pipeline size.

    Raises:
        PlanError: an unknown precision, optimizer or sharding; the global
            batch is not a multiple of the micro batch; a requested ``tp``
            does not divide the heads or FFN size (or exceeds a node), a
            requested ``pp`` does not divide the layers, or no layout is
            valid (the message says why).
    """
    training = Training(micro_batch, precision, checkpointing or offloading, sequence_parallel, flash_attention,
                        offloading, zero_sharding, optimizer, fully_sharded)
    training.check()
    layouts = [layout_memory(m, t, p, dp, accumulation, training, gpu_memory_gb)
               for t, p, dp, accumulation in candidate_layouts(m, gpus, gpus_per_node, micro_batch,
                                                               global_batch, tp, pp)]
    if not layouts:
        raise PlanError(_why_no_layout(m, gpus, gpus_per_node, micro_batch, global_batch))
    return layouts


def candidate_layouts(m: ModelShape, gpus: int, gpus_per_node: int, micro_batch: int, global_batch: int,
                      tp: Optional[int] = None, pp: Optional[int] = None) -> List[Tuple[int, int, int, int]]:
    """The valid ``(TP, PP, DP, gradient accumulation)`` of :func:`plan`.

    Raises:
        PlanError: as :func:`plan`, except for an empty list.
    """
    if global_batch % micro_batch != 0:
        raise PlanError(f"global batch {global_batch} is not a multiple of the micro batch {micro_batch}")
    if gpus % gpus_per_node != 0 and gpus > gpus_per_node:
        raise PlanError(f"{gpus} GPUs are not a whole number of nodes of {gpus_per_node}")
    from fairseq_megatron.models.options import undivided_dimension  # the model's rule for what TP must divide

    def splits(t: int) -> bool:
        return undivided_dimension(t, m.heads, m.ffn) is None and gpus_per_node % t == 0

    if tp is not None and not splits(tp):
        raise PlanError(f"tensor-parallel size {tp} must divide heads {m.heads}, FFN {m.ffn} and the "
                        f"{gpus_per_node} GPUs of a node")
    if pp is not None and m.layers % pp:
        raise PlanError(f"pipeline-parallel size {pp} does not divide the {m.layers} layers")
    found = []
    for t in [tp] if tp else _divisors(min(gpus_per_node, gpus)):
        for p in [pp] if pp else _divisors(m.layers):
            if not splits(t) or gpus % (t * p) or global_batch % (micro_batch * gpus // (t * p)):
                continue
            dp = gpus // (t * p)
            accumulation = global_batch // (micro_batch * dp)
            if p == 1 or accumulation >= p:  # 1F1B needs a micro batch per stage
                found.append((t, p, dp, accumulation))
    return found


def layout_memory(m: ModelShape, t: int, p: int, dp: int, accumulation: int, training: Training,
                  gpu_memory_gb: float) -> Layout:
    """The memory per GPU of one layout: the first pipeline stage's (the
    embedding and ``L / PP`` layers: the heaviest stage).

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
    gb = 1e9
    layer_params = (m.parameters() - m.vocab * m.hidden - 2 * m.hidden
                    - (m.seq_len * m.hidden if m.learned_positions else 0)) // m.layers
    embed = m.vocab * m.hidden + (m.seq_len * m.hidden if m.learned_positions else 0)
    params = (embed + layer_params * (m.layers // p)) // t + (2 * m.hidden if p == 1 else 0)
    in_flight = min(p, accumulation)  # 1F1B: micro batches alive on the first stage
    per_layer = functools.partial(activation_bytes_per_layer, m, training.micro_batch, t, training.sequence_parallel,
                                  flash_attention=training.flash_attention, precision=training.precision)
    kept = per_layer(checkpointing=training.checkpointing) * (m.layers // p) * in_flight
    act, host = (0, kept) if training.offloading else (kept, 0)
    if training.checkpointing:
        act += per_layer(checkpointing=False)  # the layer being recomputed
    act += 4 * m.seq_len * training.micro_batch * m.vocab / t  # fp32 logits for the loss
    if training.optimizer == "adam":
        state = ADAM_MOMENT_BYTES * params
    else:
        state = 4 * adafactor_state_elements(m, t, m.layers // p, embedding=True, final_norm=p == 1)
    gathered = 0.0
    if training.fully_sharded:
        compute = 2 if training.precision in ("fp16", "memory-efficient-fp16") else 4
        weights, grads, optim = 4 * params / dp, 4 * params / dp, state / dp
        unit = compute * layer_params // t
        held = params if training.fully_sharded == "zero2" else 2 * layer_params // t + embed // t
        gathered = compute * held + unit
    else:
        master = (o_b - ADAM_MOMENT_BYTES) * params  # fp32 master weights (--fp16): 4 bytes each
        weights, grads, optim = params * w_b, params * g_b, master + (state / dp if training.zero_sharding else state)
    total = (weights + grads + optim + gathered + act) / gb
    return Layout(t, p, dp, accumulation, params, weights / gb, grads / gb, optim / gb, act / gb, total,
                  total <= gpu_memory_gb, (p - 1) / accumulation, host / gb, gathered / gb,
                  training.fully_sharded or ("os" if training.zero_sharding else "none"))


def _lower_memory(sharding: str) -> str:
    """How to lower a layout's memory, for a layout of ``sharding`` (``Layout.sharding``):
    the sharding it already has is not advised again."""
    sharded = {"none": "fully sharded data parallelism or ZeRO sharding (several data-parallel ranks), ",
               "os": "fully sharded data parallelism (several data-parallel ranks), "}.get(sharding, "")
    return f"lower it with activation checkpointing, sequence parallelism, {sharded}Adafactor or a smaller micro batch"


def recommend(layouts: List[Layout], fully_sharded: Optional[List[Layout]] = None) -> (Optional[Layout], str):
    """The layout to start with, and why: the fitting one of the smallest
    model-parallel degree ``TP x PP``. ``fully_sharded``: the same request's
    layouts under fully sharded data parallelism, recommended instead where
    one fits with fewer pipeline stages (or where none of ``layouts`` fits)."""
    best = _smallest_model_parallel(layouts)
    sharded = _smallest_model_parallel(fully_sharded or [])
    if sharded is not None and (best is None or (sharded.pp, sharded.tp * sharded.pp) < (best.pp, best.tp * best.pp)):
        why = (f"fewer model-parallel ranks than TP={best.tp}, PP={best.pp} without it ({best.total_gb:.1f} GB per GPU)"
               if best is not None else "where no layout fits without it")
        return sharded, _with_command(sharded, f"fully sharded data parallelism fits TP={sharded.tp}, PP={sharded.pp}, "
                                               f"DP={sharded.dp} ({sharded.total_gb:.1f} GB per GPU), {why}")
    if best is None:
        smallest = min(layouts, key=lambda lay: lay.total_gb)
        sharding, tried = smallest.sharding, ""
        if fully_sharded:  # tried as well: not advised again
            sharded_smallest = min(fully_sharded, key=lambda lay: lay.total_gb)
            sharding, tried = sharded_smallest.sharding, (f", fully sharded {sharded_smallest.total_gb:.1f} GB "
                                                          f"(TP={sharded_smallest.tp}, PP={sharded_smallest.pp})")
        return None, (f"no layout fits; the smallest needs {smallest.total_gb:.1f} GB per GPU "
                      f"(TP={smallest.tp}, PP={smallest.pp}){tried}: {_lower_memory(sharding)}, or use more GPUs")
    return best, _with_command(best, f"TP={best.tp}, PP={best.pp}, DP={best.dp} is the smallest model-parallel "
                                     f"degree that fits ({best.total_gb:.1f} GB per GPU): the most data parallelism, "
                                     f"tensor-parallel all-reduces kept inside a node")


def _smallest_model_parallel(layouts: List[Layout]) -> Optional[Layout]:
    fitting = [lay for lay in layouts if lay.fits]
    return min(fitting, key=lambda lay: (lay.tp * lay.pp, lay.pp, lay.tp)) if fitting else None


def _with_command(best: Layout, reason: str) -> str:
    """``reason``, then the pipeline bubble and fairseq-train's flags for ``best``."""
    flags = []
    if best.pp > 1:
        reason += f", pipeline bubble {best.pipeline_bubble:.0%} with {best.grad_accumulation} micro batches"
        flags += [f"--pipeline-model-parallel-size {best.pp}", f"--update-freq {best.grad_accumulation}",
                  "--sample-break-mode none"]
    if best.sharding in FULLY_SHARDED:
        flags.append("--ddp-backend fully_sharded" + (" --no-reshard-after-forward" if best.sharding == "zero2" else ""))
    elif best.pp > 1 and best.dp > 1:
        flags.append("--ddp-backend legacy_ddp")
    if flags:
        reason += f" (fairseq-train --model-parallel-size {best.tp} {' '.join(flags)})"
    return reason


def _divisors(n: int) -> List[int]:
    """The divisors of ``n``, ascending, in O(sqrt(n)) steps (a billion layers take 31,623)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _why_no_layout(m, gpus, gpus_per_node, micro_batch, global_batch) -> str:
    tps = [t for t in _divisors(min(gpus_per_node, gpus)) if m.heads % t == 0 and m.ffn % t == 0]
    if not tps:
        return f"no tensor-parallel size within a node of {gpus_per_node} divides heads {m.heads} and FFN {m.ffn}"
    return (f"no layout of {gpus} GPUs gives a whole number of micro batches of {micro_batch} per data-parallel "
            f"rank for global batch {global_batch}")


def model_tflops_per_step(m: ModelShape, global_batch: int) -> float:
    """Model TFLOPs (1e12 FLOPs) of one optimizer step over ``global_batch``
    sequences of ``m.seq_len`` tokens."""
    return m.flops_per_token() * global_batch * m.seq_len / 1e12


def humanize(n: float) -> str:
    """``n`` with a T/B/M/K suffix and two decimals (``1.31e9`` -> ``"1.31B"``)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))
