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
from typing import Dict, List, Optional

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
        PaLM, appendix B)."""
        return 6 * self.parameters() + 12 * self.layers * self.hidden * self.seq_len


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

    def as_dict(self) -> Dict:
        return dataclasses.asdict(self)


def plan(m: ModelShape, gpus: int, gpus_per_node: int, gpu_memory_gb: float, micro_batch: int,
         global_batch: int, precision: str = "fp16", checkpointing: bool = False,
         sequence_parallel: bool = False, flash_attention: bool = True,
         tp: Optional[int] = None, pp: Optional[int] = None, offloading: bool = False,
         zero_sharding: bool = False, optimizer: str = "adam") -> List[Layout]:
    """Every valid (TP, PP, DP) layout with its memory per GPU.

    ``offloading`` (``--offload-activations``) implies ``checkpointing``.
    ``zero_sharding`` (fairseq's ``--zero-sharding os``) divides the
    optimizer's own state (Adam's moments, Adafactor's statistics) by the
    data-parallel size. ``optimizer``: ``"adam"`` or ``"adafactor"``.

    Valid: TP divides the heads and the FFN size and stays within a node
    (TP divides ``gpus_per_node``), PP divides the layers, DP = gpus / (TP*PP)
    is whole, the global batch is a whole number of micro batches per
    data-parallel rank (gradient accumulation = global / (micro * DP)), and
    with PP > 1 there are at least PP micro batches per update (the 1F1B
    schedule that ``--pipeline-model-parallel-size`` trains with runs the
    update's ``--update-freq`` micro batches and needs one per stage).

    ``tp`` / ``pp`` restrict the search to one tensor / pipeline size.

    Raises:
        PlanError: the global batch is not a multiple of the micro batch, a
            requested ``tp`` does not divide the heads or FFN size (or exceeds
            a node), a requested ``pp`` does not divide the layers, or no
            layout is valid (the message says why).
    """
    if precision not in BYTES_PER_PARAM:
        raise PlanError(f"precision must be one of {sorted(BYTES_PER_PARAM)}")
    if optimizer not in ("adam", "adafactor"):
        raise PlanError(f"optimizer must be adam or adafactor, not {optimizer!r}")
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
    w_b, g_b, o_b = BYTES_PER_PARAM[precision]
    gb = 1e9
    layer_params = m.parameters() - m.vocab * m.hidden - 2 * m.hidden - (m.seq_len * m.hidden if m.learned_positions else 0)
    layer_params //= m.layers
    layouts = []
    for t in [tp] if tp else _divisors(min(gpus_per_node, gpus)):
        if not splits(t):
            continue
        for p in [pp] if pp else _divisors(m.layers):
            if gpus % (t * p):
                continue
            dp = gpus // (t * p)
            if global_batch % (micro_batch * dp):
                continue
            accumulation = global_batch // (micro_batch * dp)
            if p > 1 and accumulation < p:
                continue  # fewer micro batches than stages: 1F1B cannot run
            # first pipeline stage: embedding + L/PP layers (the heaviest stage)
            embed = m.vocab * m.hidden + (m.seq_len * m.hidden if m.learned_positions else 0)
            params = (embed + layer_params * (m.layers // p)) // t + (2 * m.hidden if p == 1 else 0)
            in_flight = min(p, accumulation)  # 1F1B: micro batches alive on the first stage
            per_layer = functools.partial(activation_bytes_per_layer, m, micro_batch, t, sequence_parallel,
                                          flash_attention=flash_attention, precision=precision)
            kept = per_layer(checkpointing=checkpointing or offloading) * (m.layers // p) * in_flight
            act, host = (0, kept) if offloading else (kept, 0)
            if checkpointing or offloading:
                act += per_layer(checkpointing=False)  # the layer being recomputed
            act += 4 * m.seq_len * micro_batch * m.vocab / t  # fp32 logits for the loss
            if optimizer == "adam":
                state = ADAM_MOMENT_BYTES * params
            else:
                state = 4 * adafactor_state_elements(m, t, m.layers // p, embedding=True, final_norm=p == 1)
            master = (o_b - ADAM_MOMENT_BYTES) * params  # fp32 master weights (--fp16): 4 bytes each
            optim = (master + (state / dp if zero_sharding else state)) / gb
            weights, grads = params * w_b / gb, params * g_b / gb
            total = weights + grads + optim + act / gb
            layouts.append(Layout(t, p, dp, accumulation, params, weights, grads, optim, act / gb, total,
                                  total <= gpu_memory_gb, (p - 1) / accumulation, host / gb))
    if not layouts:
        raise PlanError(_why_no_layout(m, gpus, gpus_per_node, micro_batch, global_batch))
    return layouts


_LOWER_MEMORY = ("lower it with activation checkpointing, sequence parallelism, ZeRO sharding (several "
                 "data-parallel ranks), Adafactor or a smaller micro batch")


def recommend(layouts: List[Layout]) -> (Optional[Layout], str):
    """The layout to start with, and why."""
    fitting = [lay for lay in layouts if lay.fits]
    if not fitting:
        best = min(layouts, key=lambda lay: lay.total_gb)
        return None, (f"no layout fits; the smallest needs {best.total_gb:.1f} GB per GPU "
                      f"(TP={best.tp}, PP={best.pp}): {_LOWER_MEMORY}, or use more GPUs")
    best = min(fitting, key=lambda lay: (lay.tp * lay.pp, lay.pp, lay.tp))
    reason = (f"TP={best.tp}, PP={best.pp}, DP={best.dp} is the smallest model-parallel degree that fits "
              f"({best.total_gb:.1f} GB per GPU): the most data parallelism, tensor-parallel all-reduces "
              f"kept inside a node")
    if best.pp > 1:
        reason += (f", pipeline bubble {best.pipeline_bubble:.0%} with {best.grad_accumulation} micro batches "
                   f"(fairseq-train --model-parallel-size {best.tp} --pipeline-model-parallel-size {best.pp} "
                   f"--update-freq {best.grad_accumulation} --sample-break-mode none"
                   + (" --ddp-backend legacy_ddp" if best.dp > 1 else "") + ")")
    return best, reason


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
