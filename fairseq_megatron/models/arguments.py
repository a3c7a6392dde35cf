"""The command-line options our model adds to those of fairseq's
``transformer_lm`` (``fairseq/models/transformer_lm.py``), each with its
help text: the parallel sizes beyond ``--model-parallel-size``, and the
speed options applied to a built model from outside
(:mod:`fairseq_megatron.training.parallelize`). What they refuse is
checked by their owners: the model's (:mod:`fairseq_megatron.models.options`),
training's (:mod:`fairseq_megatron.training.options`), the layout's sizes
(:class:`fairseq_megatron.parallel.layout.ParallelLayout`).
"""

import argparse

MODEL_ARGUMENTS = (
    ("--compile-layers", dict(
        action="store_true",
        help="torch.compile the decoder layers for training steps (fuses layer norm, bias, "
             "GeLU, dropout and residual adds), and the vocab-parallel loss's softmax passes. "
             "At model-parallel size 1 without --checkpoint-activations the whole layer stack "
             "is one compiled region (fewer host calls per step); otherwise each layer is. "
             "The first steps pay the compilation")),
    ("--cuda-graphs", dict(
        action="store_true",
        help="with --compile-layers at model-parallel size 1 without --checkpoint-activations "
             "(training refuses it otherwise), "
             "replay the compiled layer stack as CUDA graphs (torch.compile mode "
             "'reduce-overhead'): the host launches each training step's layers with one call "
             "forward and one backward. Pays where the host limits the step (smaller models); "
             "the graphs keep their own memory pool, and each new batch shape records another "
             "graph, so train with fixed shapes (--sample-break-mode none). Refused with "
             "--update-freq > 1 (replays would overwrite the accumulating gradients). No effect on CPU")),
    ("--sequence-parallel", dict(
        action="store_true",
        help="in training, keep layer norms, dropout and residuals on T / N sequence shards "
             "(all-gather + reduce-scatter instead of all-reduce; Megatron-LM v3). Needs "
             "--tokens-per-sample divisible by --model-parallel-size; batches whose length "
             "is not run the plain tensor-parallel path")),
    ("--bf16-autocast", dict(
        action="store_true",
        help="training forward passes run under torch.autocast(bfloat16) with fp32 weights, "
             "fp32 gradients and no loss scaling (train without --fp16/--amp; fairseq's own "
             "--bf16 means TPU). Evaluation and generation are not affected")),
    ("--fp8", dict(
        action="store_true",
        help="training passes compute the matrix products of the decoder layers' linears (q/k/v, "
             "attention output, FFN) in float8 through torchao's float8 training (pip install "
             "'fairseq_megatron[fp8]'); needs a GPU of compute capability 8.9 or newer (Ada, Hopper). "
             "Weights, gradients, optimizer state and checkpoints keep their dtype; the output "
             "projection, evaluation and generation stay in high precision. Use with --bf16-autocast "
             "(or fp32) and --compile-layers; refused with --fp16, --memory-efficient-fp16, --amp and "
             "pipeline stages")),
    ("--fp8-recipe", dict(
        choices=["tensorwise", "rowwise"], default="tensorwise",
        help="torchao's float8 scaling with --fp8: tensorwise (one dynamic scale per tensor, e5m2 "
             "gradients; the faster) or rowwise (a power-of-two scale per row, e4m3 throughout)")),
    ("--pipeline-model-parallel-size", dict(
        type=int, metavar="P", default=1,
        help="split the decoder layers evenly over P pipeline stages, one per process (with "
             "--model-parallel-size T the world size is a multiple of T x P); training runs "
             "each update's --update-freq micro-batches through the 1F1B schedule, so it needs "
             "--update-freq >= P, --sample-break-mode none and the vocab_parallel_cross_entropy "
             "criterion. Checkpoints hold one file per stage and tensor part; evaluation and "
             "generation load them at one stage")),
    ("--virtual-pipeline-model-parallel-size", dict(
        type=int, metavar="V", default=1,
        help="with --pipeline-model-parallel-size P, give each stage V model chunks of "
             "L / (P x V) layers (stage s holds chunks s, s + P, ...) and run the interleaved 1F1B "
             "schedule: the pipeline bubble shrinks by V for V times the stages' point-to-point "
             "messages. Needs the layers divisible by P x V and --update-freq divisible by P; "
             "checkpoints keep the global layer numbers, so they load at any P and V")),
    ("--account-for-embedding-in-pipeline-split", dict(
        action="store_true",
        help="with --pipeline-model-parallel-size above 1, count the embedding as one decoder layer in the "
             "split: the layers plus one are split evenly over the P x V model chunks, and the first chunk "
             "holds one decoder layer fewer (Megatron-Core's option). Checkpoints do not depend on it")),
    ("--account-for-loss-in-pipeline-split", dict(
        action="store_true",
        help="with --pipeline-model-parallel-size above 1, count the output projection and the loss as one "
             "decoder layer in the split: the last model chunk holds one decoder layer fewer, for a vocabulary "
             "whose output projection costs about a layer (2 x vocabulary against 24 x hidden + 4 x sequence "
             "FLOPs a token and hidden unit; Megatron-Core's option). Checkpoints do not depend on it")),
    ("--pipeline-schedule", dict(
        metavar="NAME",
        help="the schedule of the pipeline stages' micro-batches, one of torch's: 1f1b (the default; "
             "interleaved-1f1b with --virtual-pipeline-model-parallel-size above 1), interleaved-1f1b, "
             "interleaved-zb (zero bubble: each backward split into its input and weight passes, the weight "
             "passes filling the bubble; V chunks per stage, ZB-1P at V = 1), zbv and dualpipev (zero bubble "
             "over 2 chunks per stage placed in a V: stage s holds chunks s and 2P-1-s). dualpipev needs "
             "--update-freq of at least 2P, the others P. Checkpoints do not depend on it")),
    ("--context-parallel-size", dict(
        type=int, metavar="C", default=1,
        help="split each sequence over C ranks along time (Megatron-LM's context parallelism; rank i "
             "holds chunks i and 2C-1-i of 2C, for causal load balancing); attention all-gathers the "
             "keys and values within the C ranks. The world size is a multiple of T x C x P; the C "
             "ranks read the same batches (--batch-size counts whole sequences per model copy) and "
             "their gradients are averaged with the data-parallel ones. Needs --tokens-per-sample "
             "divisible by 2C, --sample-break-mode none and the vocab_parallel_cross_entropy "
             "criterion. Checkpoints do not depend on C; evaluation and generation run at C = 1")),
    ("--padded-vocab-size", dict(
        type=int, metavar="N",
        help="rows of the vocab-parallel embedding and softmax: the dictionary padded with "
             "madeupword symbols (default: its size rounded up to a multiple of 8 x the "
             "model-parallel size). Checkpoints record it, and fairseq-train takes it from the "
             "checkpoint it starts from")),
    ("--accept-other-dictionary", dict(
        action="store_true",
        help="load a checkpoint with a dict.txt whose symbols are not the ones it was trained with, in number "
             "alike (a deliberate change of the vocabulary); without it, fairseq-train and every tool refuse "
             "such a dict.txt, whose tokens would be looked up in other tokens' rows")),
    ("--masked-vocab-rows", dict(
        metavar="ROWS",
        help="vocabulary rows whose logits are minus infinity in every pass (rows A to B and C: "
             "'A-B,C'): the rows of a model imported from transformers that its source lacks "
             "(fairseq's special symbols, a duplicate row, the padding), so that the softmax is over "
             "exactly the source's rows. fairseq-megatron-reshard --from-hf records it in the checkpoint")),
)


# The options that decide the shapes and the function of the weights: a
# checkpoint's record of them describes its model whatever the command line
# of a run that starts from it says (:func:`architecture_from_checkpoint`).
# ``max_target_positions`` joins them for learned positions, whose rows it counts.
ARCHITECTURE_OPTIONS = (
    "decoder_layers", "decoder_embed_dim", "decoder_ffn_embed_dim", "decoder_attention_heads", "decoder_input_dim",
    "decoder_output_dim", "decoder_learned_pos", "no_token_positional_embeddings", "activation_fn",
    "no_scale_embedding", "share_decoder_input_output_embed", "no_decoder_final_norm", "layernorm_embedding",
    "padded_vocab_size", "masked_vocab_rows",
)


def architecture_defaults(arch: str) -> argparse.Namespace:
    """The model options of architecture ``arch`` (ours) when the command
    line gives none of them: the architecture function's, then the parser's
    (whose model options fairseq adds with no default,
    ``fairseq/options.py``, ``parse_args_and_arch``)."""
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY

    parser = argparse.ArgumentParser(allow_abbrev=False, argument_default=argparse.SUPPRESS)
    ARCH_MODEL_REGISTRY[arch].add_args(parser)
    args = parser.parse_args([])
    ARCH_CONFIG_REGISTRY[arch](args)
    return args


def architecture_from_checkpoint(model_cfg, recorded, arch: str, checkpoint: str) -> list:
    """Set in ``model_cfg`` (a run's model options) each of
    :data:`ARCHITECTURE_OPTIONS` that checkpoint ``checkpoint`` records
    (``recorded``: its model config) and the run left at the architecture's
    default: a model imported from transformers, or trained at another
    model-parallel size, then starts with no further flag. Returns the
    ``--flag value`` texts of what was taken.

    Raises:
        UsageError: an option the run gives (a value other than the
            architecture's default) that differs from the checkpoint's.
    """
    from fairseq_megatron.errors import UsageError

    def value(config, name):
        return config.get(name) if isinstance(config, dict) else getattr(config, name, None)

    defaults = architecture_defaults(arch)
    names = list(ARCHITECTURE_OPTIONS) + (["max_target_positions"] if value(recorded, "decoder_learned_pos") else [])
    taken = []
    for name in names:
        theirs, ours = value(recorded, name), value(model_cfg, name)
        if theirs is None or ours == theirs:
            continue
        flag = "--" + name.replace("_", "-")
        if ours is not None and ours != getattr(defaults, name, None):
            raise UsageError(f"{flag} {ours}: {checkpoint} holds a model with {flag} {theirs}; drop {flag} (a run "
                             f"that starts from a checkpoint takes its model's options from it)")
        setattr(model_cfg, name, theirs)
        taken.append(flag if theirs is True else f"{flag} {theirs}")
    return taken


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add :data:`MODEL_ARGUMENTS` to ``parser`` (the model's ``add_args``)."""
    for flag, options in MODEL_ARGUMENTS:
        parser.add_argument(flag, **options)
