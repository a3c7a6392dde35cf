"""A decoder-only language model's shape, its parameters and its FLOPs.

* Parameters of a pre-norm decoder with hidden h, FFN f, L layers, padded
  vocabulary V (tied input/output embedding), optional learned positions s:
  ``V*h [+ s*h] + L*(4h^2 + 4h  +  2hf + f + h  +  4h) + 2h``
  (attention, FFN, two layer norms; final layer norm). With f = 4h this is
  Megatron-LM's ``12*L*h^2 * (1 + 13/(12h) + (V+s)/(12*L*h))``
  (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
  GPU Clusters Using Megatron-LM", eq. 2).
* Training FLOPs, counted as that paper counts them (eq. 3, generalised
  from f = 4h to any f): one layer's forward on one sequence is
  ``2*s*(4h^2 + 2hf) + 4*s^2*h`` (the four attention projections and the
  two FFN matrices; the attention scores and their weighted sum, counted in
  full although causal attention needs half), the output projection's
  ``2*s*h*V``; the backward costs twice the forward, and activation
  recomputation (``--checkpoint-activations``) runs each layer's forward
  once more. With f = 4h and recomputation:
  ``96*B*s*L*h^2 * (1 + s/(6h) + V/(16*L*h))`` for B sequences (eq. 3).
"""

import dataclasses

from fairseq_megatron.planner.errors import PlanError


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
        return self.embedding_parameters() + self.layers * self.layer_parameters() + 2 * self.hidden

    def layer_parameters(self) -> int:
        """Parameters of one decoder layer at model-parallel size 1."""
        h, f = self.hidden, self.ffn
        return (4 * h * h + 4 * h) + (2 * h * f + f + h) + 4 * h

    def embedding_parameters(self) -> int:
        """The token embedding (tied with the output projection) and the learned positions, if any."""
        return self.vocab * self.hidden + (self.seq_len * self.hidden if self.learned_positions else 0)

    def flops_per_token(self) -> float:
        """Model FLOPs per trained token (forward + backward, no recompute):
        ``6 * parameters + 12 * layers * hidden * seq_len``, the attention
        scores and their weighted sum counted in full (Chowdhery et al. 2022,
        PaLM, appendix B), the count the training log uses
        (:func:`~fairseq_megatron.training.throughput.model_flops_per_token`)."""
        from fairseq_megatron.training.throughput import model_flops_per_token

        return model_flops_per_token(self.parameters(), self.layers, self.hidden, self.seq_len)

    def layer_forward_flops(self, seq_len: int = None) -> float:
        """FLOPs of one layer's forward pass on one sequence of ``seq_len``
        tokens (default: the model's): ``2*s*(4h^2 + 2hf) + 4*s^2*h``
        (Narayanan et al. 2021, section 5.1)."""
        s, h = seq_len or self.seq_len, self.hidden
        return 2 * s * (4 * h * h + 2 * h * self.ffn) + 4 * s * s * h

    def logits_forward_flops(self) -> float:
        """FLOPs of the output projection on one sequence: ``2*s*h*V``."""
        return 2 * self.seq_len * self.hidden * self.vocab

    def training_flops(self, sequences: int, recompute: bool) -> float:
        """FLOPs of a training step over ``sequences`` sequences, as
        Narayanan et al. 2021 count them (eq. 3): forward and backward
        (twice the forward), and with ``recompute`` every layer's forward
        once more; the output projection is not recomputed."""
        passes = 4 if recompute else 3
        return sequences * (passes * self.layers * self.layer_forward_flops() + 3 * self.logits_forward_flops())


def megatron_arch_shape(arch: str, vocab: int = 51200, seq_len: int = 1024) -> ModelShape:
    """The shape of an arch registered by this package (``transformer_lm_megatron[_11b]``).

    Raises:
        PlanError: ``arch`` is not registered.
    """
    from argparse import Namespace

    from fairseq.models import ARCH_CONFIG_REGISTRY

    import fairseq_megatron  # noqa: F401  (registers the archs)

    if arch not in ARCH_CONFIG_REGISTRY:
        raise PlanError(f"unknown arch {arch!r}")
    args = Namespace()
    ARCH_CONFIG_REGISTRY[arch](args)
    return ModelShape(args.decoder_layers, args.decoder_embed_dim, args.decoder_attention_heads,
                      args.decoder_ffn_embed_dim, vocab, seq_len, learned_positions=args.decoder_learned_pos)


def model_tflops_per_step(m: ModelShape, global_batch: int) -> float:
    """Model TFLOPs (1e12 FLOPs) of one optimizer step over ``global_batch``
    sequences of ``m.seq_len`` tokens, without recomputation (:meth:`ModelShape.flops_per_token`)."""
    return m.flops_per_token() * global_batch * m.seq_len / 1e12


def humanize(n: float) -> str:
    """``n`` with a T/B/M/K suffix and two decimals (``1.31e9`` -> ``"1.31B"``)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))
