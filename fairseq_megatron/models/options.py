"""The options of our model: the checks that refuse what it cannot be built
with, and the dictionary padding that depends on the model-parallel size.
The architecture functions call :func:`check_options` while fairseq parses
its command line; ``build_model`` calls the rest. The training options are
checked by training (:mod:`fairseq_megatron.training.options`), the
parallel sizes where the layout is built
(:class:`fairseq_megatron.parallel.layout.ParallelLayout`).
"""

import hashlib
import os
from typing import Optional, Sequence

from fairseq.utils import safe_getattr

from fairseq_megatron.errors import UsageError
from fairseq_megatron.models.pipeline_stage import pipeline_stages
from fairseq_megatron.parallel.layout import check_size


def split_dimensions(heads: Optional[int], ffn: Optional[int], padded_vocab: Optional[int] = None):
    """The dimensions the model-parallel size must divide, as
    ``(what, flag, size)``: the attention heads and the FFN units, which are
    split over the ranks, and the padded vocabulary rows (when known). The one
    list every check of a model-parallel size uses (command-line options,
    checkpoints, the planner)."""
    return [(what, flag, int(n)) for what, flag, n in (
        ("attention heads", "--decoder-attention-heads", heads),
        ("FFN size", "--decoder-ffn-embed-dim", ffn),
        ("padded vocabulary", "--padded-vocab-size", padded_vocab),
    ) if n is not None]


def undivided_dimension(size: int, heads: Optional[int], ffn: Optional[int], padded_vocab: Optional[int] = None):
    """The first of :func:`split_dimensions` that ``size`` does not divide,
    ``(what, flag, size)``, or None."""
    return next(((what, flag, n) for what, flag, n in split_dimensions(heads, ffn, padded_vocab) if n % size),
                None)


def dictionary_checksum(symbols: Sequence[str]) -> str:
    """A checksum of a dictionary's ``symbols`` in order (fairseq's four
    special symbols first; not the counts of ``dict.txt``): what a
    checkpoint records as ``dictionary_checksum``."""
    return hashlib.sha256("\n".join(symbols).encode("utf-8")).hexdigest()[:32]


def check_dictionary_size(symbols: Sequence[str], size: int, trained_with: Optional[int], checkpoint: str,
                          checksum: Optional[str] = None, accept_other: bool = False) -> None:
    """Refuse a dictionary other than the one a checkpoint's model was trained with.

    ``symbols`` is the dictionary's symbol list (fairseq's four special
    symbols first; padding may follow), ``size`` its length before padding,
    ``trained_with`` the length the checkpoint records (``dictionary_size``;
    None for checkpoints from before the record, which are not checked),
    ``checkpoint`` how the message names it. The same dictionary has that
    many symbols, or more only by ``madeupwordNNNN`` padding symbols (a
    dictionary saved after padding); and where the checkpoint records the
    :func:`dictionary_checksum` of its symbols (``checksum``), the same
    symbols in the same order: a ``dict.txt`` of the same size in another
    order, or another corpus's, trained and evaluated without a word (its
    every token looked up in another token's row). ``accept_other``
    (``--accept-other-dictionary``) lets a deliberately changed dictionary
    of the same size through.

    Padding to a recorded vocabulary size (see :func:`pad_dictionary`) would
    take a shorter dictionary without a word, where fairseq's non-parallel
    model failed to load it ("size mismatch"): every token would then be
    looked up in rows learnt for other symbols.

    Raises:
        UsageError: the sizes differ, or the symbols.
    """
    if trained_with is None:
        return
    if size < trained_with or not all(s.startswith("madeupword") for s in symbols[trained_with:]):
        raise UsageError(
            f"the dictionary has {size} symbols but {checkpoint} was trained with {trained_with}: "
            f"wrong dict.txt for this checkpoint"
        )
    if checksum is not None and not accept_other and dictionary_checksum(symbols[:trained_with]) != checksum:
        raise UsageError(
            f"the dictionary has the {trained_with} symbols {checkpoint} was trained with in number, but not the "
            f"same symbols in the same order: wrong dict.txt for this checkpoint (to change it deliberately: "
            f"--accept-other-dictionary, or in the evaluation tools --model-overrides "
            f"\"{{'accept_other_dictionary': True}}\")"
        )


def pad_dictionary(dictionary, model_parallel_size: int, padded_vocab_size: Optional[int] = None) -> int:
    """Pad ``dictionary`` in place with ``madeupwordNNNN`` symbols; return its new size.

    A new model pads to a multiple of ``8 * model_parallel_size``, as fairseq
    does, so the size depends on the model-parallel size it was first built
    with. That size is then recorded in the model config
    (``padded_vocab_size``) and reused exactly, so a checkpoint resharded to
    another model-parallel size keeps every embedding row and the same
    softmax over the same vocabulary.

    Raises:
        UsageError: the dictionary is larger than ``padded_vocab_size``, or
            the size is not divisible by the model-parallel size.
    """
    if padded_vocab_size is None:
        dictionary.pad_to_multiple_(8 * model_parallel_size)
    else:
        if len(dictionary) > padded_vocab_size:
            raise UsageError(
                f"the dictionary has {len(dictionary)} symbols but the vocabulary has {padded_vocab_size} rows "
                f"(--padded-vocab-size, or a checkpoint's record of it): a --padded-vocab-size too small, "
                f"or the wrong dict.txt for the checkpoint"
            )
        i = 0
        while len(dictionary) < padded_vocab_size:
            symbol = f"madeupword{i:04d}"
            if symbol not in dictionary.indices:
                dictionary.add_symbol(symbol, n=0)
            i += 1
    if len(dictionary) % model_parallel_size != 0:
        raise UsageError(
            f"padded vocabulary size {len(dictionary)} is not divisible by the "
            f"model-parallel size {model_parallel_size}"
        )
    return len(dictionary)


def check_options(args, model_parallel_size: int) -> None:
    """Refuse options this model cannot be built with, from the options
    alone: sizes the model-parallel size does not divide, what context
    parallelism (:func:`check_context_parallel_options`) and ``--fp8``
    (:func:`check_fp8_options`) need of the model, its batches and its
    loss, and transformer_lm options the layers do not implement. The training
    options are training's to check
    (:func:`fairseq_megatron.training.options.check_training_options`), the
    parallel sizes the layout's.

    fairseq's parser gives our archs every transformer_lm option; these the
    layers would ignore: NormFormer's scalings (``--scale-attn``,
    ``--scale-fc``, ``--scale-heads``, ``--scale-resids``), quantization noise,
    BASE layers, xformers attention; input/output dimensions other than the
    embedding's failed in the first forward on mismatched shapes. Checkpoints
    without these options (the published Megatron-11b's 2020 ``args``) pass.

    Called by the architecture functions, which fairseq-train runs while
    parsing its command line (so bad options stop it before it creates
    ``--save-dir``), and again by ``build_model`` for configs that did not
    pass through them (checkpoints, Hydra).

    Raises:
        UsageError: the first refusal, naming the options to change.
        NotImplementedError: adaptive input/softmax or character embeddings.
    """
    undivided = undivided_dimension(model_parallel_size, args.decoder_attention_heads, args.decoder_ffn_embed_dim)
    if undivided is not None:
        _, flag, value = undivided
        raise UsageError(f"{flag} {value} is not divisible by --model-parallel-size {model_parallel_size}")
    if args.decoder_embed_dim % args.decoder_attention_heads != 0:
        raise UsageError(f"--decoder-embed-dim {args.decoder_embed_dim} is not divisible by "
                         f"--decoder-attention-heads {args.decoder_attention_heads}")
    check_positions(args)
    check_context_parallel_options(args)
    check_fp8_options(args, model_parallel_size)
    check_implemented(args)


def check_positions(args) -> None:
    """Refuse a number of positions whose table alone cannot be held here:
    fairseq builds the positional embedding of ``--max-target-positions``
    (default ``--tokens-per-sample``) rows, plus the padding index's, of
    ``--decoder-embed-dim`` fp32 values, sinusoidal or learned, whole on
    every rank; past the machine's memory that was an allocator's traceback
    (``--tokens-per-sample 1000000000``: 128 GB at dimension 32).

    Raises:
        UsageError: the table is larger than this machine's memory.
    """
    if safe_getattr(args, "no_token_positional_embeddings", False):
        return
    positions = safe_getattr(args, "max_target_positions", None) or safe_getattr(args, "tokens_per_sample", None)
    if positions is None:
        return
    table = (int(positions) + 2) * int(args.decoder_embed_dim) * 4  # rows from pad + 1 on, fp32
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if table > memory:
        flag = "--max-target-positions" if safe_getattr(args, "max_target_positions", None) else "--tokens-per-sample"
        raise UsageError(f"{flag} {positions}: the model's table of positions alone would take {table / 1e9:,.1f} GB "
                         f"({positions:,} rows of {args.decoder_embed_dim} fp32 values), more than this machine's "
                         f"{memory / 1e9:,.1f} GB of memory; give the length of the sequences the model reads")


def check_context_parallel_options(args) -> None:
    """Refuse context parallelism that cannot split the sequences, from the options alone.

    Each of the ``C`` ranks holds two of ``2C`` equal chunks of every
    sequence, so ``--tokens-per-sample`` must divide by ``2C`` (a shorter
    batch is padded); the ranks split blocks of that many tokens, which
    ``--sample-break-mode none`` makes (the other modes make padded batches
    of sentences, whose later chunks would hold mostly padding); each rank
    computes the loss of its own positions from its vocabulary shard with
    ``vocab_parallel_cross_entropy``, which counts each sequence once over
    the ``C`` ranks. The training options are checked where ``args`` holds
    them.

    Raises:
        UsageError: the first refusal, naming the option to change.
    """
    context = safe_getattr(args, "context_parallel_size", None)
    context = 1 if context is None else int(context)
    check_size("context", context)
    if context == 1:
        return
    length = safe_getattr(args, "tokens_per_sample", None)
    if length is not None and length % (2 * context):
        raise UsageError(f"--tokens-per-sample {length} is not divisible by 2 x --context-parallel-size {context} "
                         f"= {2 * context}: each of the {context} ranks holds 2 of {2 * context} equal chunks "
                         f"of a sequence")
    check_blocks_and_loss(args, f"--context-parallel-size {context}", "the ranks split blocks of "
                          "--tokens-per-sample tokens", "each rank computes the loss of its own positions")


def check_blocks_and_loss(args, given: str, why_blocks: str, why_loss: str) -> None:
    """What splitting a batch between ranks (``given``: the flag and its
    value) needs of the data and the loss: ``--sample-break-mode none``
    (``why_blocks``) and the ``vocab_parallel_cross_entropy`` criterion
    (``why_loss``).

    Raises:
        UsageError: another break mode or criterion.
    """
    break_mode = safe_getattr(args, "sample_break_mode", None)
    if break_mode is not None and break_mode != "none":
        raise UsageError(f"--sample-break-mode {break_mode} with {given}: {why_blocks}; use --sample-break-mode none")
    criterion = safe_getattr(args, "criterion", None)
    if criterion is not None and criterion != "vocab_parallel_cross_entropy":
        raise UsageError(f"--criterion {criterion} with {given}: {why_loss}; use --criterion "
                         f"vocab_parallel_cross_entropy")


def check_implemented(args) -> None:
    """Refuse the transformer_lm options these layers do not implement (see
    :func:`check_options`).

    Raises:
        UsageError: naming the options given.
        NotImplementedError: adaptive input/softmax or character embeddings.
    """
    embed_dim = args.decoder_embed_dim
    given = [f"--{flag.replace('_', '-')}" for flag in ("scale_attn", "scale_fc", "scale_heads", "scale_resids")
             if safe_getattr(args, flag, False)]
    given += [f"--{flag.replace('_', '-')} {safe_getattr(args, flag)}"
              for flag in ("quant_noise_pq", "quant_noise_scalar", "base_layers", "decoder_xformers_att_config")
              if safe_getattr(args, flag, None)]
    given += [f"--{flag.replace('_', '-')} {safe_getattr(args, flag)}"
              for flag in ("decoder_input_dim", "decoder_output_dim")
              if safe_getattr(args, flag, embed_dim) != embed_dim]
    if given:
        raise UsageError(f"{' '.join(given)}: not implemented by the model-parallel decoder; drop it "
                         f"(fairseq's own transformer_lm has it, without model parallelism)")
    if (safe_getattr(args, "character_embeddings", False) or safe_getattr(args, "adaptive_input", False)
            or safe_getattr(args, "adaptive_softmax_cutoff", None)):
        raise NotImplementedError(
            "character embeddings, adaptive input and adaptive softmax are not model parallel"
        )


# torch._scaled_mm, the float8 GEMM, needs both dimensions of its second
# operand divisible by 16; torchao pads nothing unless told to.
FLOAT8_GEMM_MULTIPLE = 16


def check_fp8_options(args, model_parallel_size: int) -> None:
    """Refuse ``--fp8`` where it cannot run, from the options alone.

    - ``--fp16``, ``--memory-efficient-fp16``, ``--amp``: torchao's float8
      training takes its high-precision operands in bf16 (``--bf16-autocast``)
      or fp32, the two it is made and tested for; fp16 weights and loss
      scaling with it are untested here.
    - ``--pipeline-model-parallel-size`` > 1: untested with pipeline stages.
    - Float8 GEMMs need these multiples of 16: each linear's input and output
      features on one rank (the embedding dim C, C / N and FFN / N at
      model-parallel size N), and the tokens of a batch, whose sum is the
      inner dimension of the weight gradient's product. Batches of
      ``--tokens-per-sample`` tokens per row (``--sample-break-mode none``)
      keep every batch a multiple when that is one; other break modes make
      rows of any length. Checked on the options of every run, emulated or
      not, so that the test mode refuses what a GPU would fail on.

    Tensor and sequence parallelism, ``--compile-layers``, ``--cuda-graphs``
    and activation checkpointing run with it. What needs the machine (torchao
    installed, a float8 GPU) is :func:`check_fp8_environment`'s.

    Raises:
        UsageError: the first refusal, naming the option to change.
    """
    if not safe_getattr(args, "fp8", False):
        return
    half = [f"--{f.replace('_', '-')}" for f in ("fp16", "memory_efficient_fp16", "amp")
            if safe_getattr(args, f, False)]
    if half:
        raise UsageError(f"--fp8 with {' '.join(half)}: torchao's float8 training takes bf16 or fp32 operands; "
                         f"train with --bf16-autocast (fp32 weights) instead")
    stages = pipeline_stages(args)
    if stages > 1:
        raise UsageError(f"--fp8 with --pipeline-model-parallel-size {stages}: float8 is untested with pipeline "
                         f"stages; drop one of the two")
    embed_dim, ffn = int(args.decoder_embed_dim), int(args.decoder_ffn_embed_dim)
    for flag, value, parts in (("--decoder-embed-dim", embed_dim, 1),
                               ("--decoder-embed-dim", embed_dim, model_parallel_size),
                               ("--decoder-ffn-embed-dim", ffn, model_parallel_size)):
        if (value // parts) % FLOAT8_GEMM_MULTIPLE:
            raise UsageError(f"--fp8 needs the linears' features on each rank a multiple of {FLOAT8_GEMM_MULTIPLE} "
                             f"(float8 GEMMs): {flag} {value} at --model-parallel-size {model_parallel_size} "
                             f"gives {value // parts}")
    break_mode = safe_getattr(args, "sample_break_mode", None)
    tokens_per_sample = safe_getattr(args, "tokens_per_sample", None)
    if break_mode is not None and break_mode != "none":
        raise UsageError(f"--fp8 with --sample-break-mode {break_mode}: float8 GEMMs need each batch's token "
                         f"count a multiple of {FLOAT8_GEMM_MULTIPLE}; use --sample-break-mode none")
    if tokens_per_sample is not None and int(tokens_per_sample) % FLOAT8_GEMM_MULTIPLE:
        raise UsageError(f"--fp8 with --tokens-per-sample {tokens_per_sample}: float8 GEMMs need each batch's "
                         f"token count a multiple of {FLOAT8_GEMM_MULTIPLE}; use a multiple of it")
