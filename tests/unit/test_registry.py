"""fairseq's model-parallel names resolve to this package; the Megatron-11b
recipe parses with only --user-dir added; the arch dims are fairseq's."""

import os

from fairseq import options
from fairseq.criterions import CRITERION_REGISTRY
from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY

from fairseq_megatron import USER_DIR
from fairseq_megatron.criterions import VocabParallelCrossEntropyCriterion
from fairseq_megatron.models import ModelParallelTransformerLanguageModel

# The training command of fairseq's examples/megatron_11b/README.md, plus --user-dir.
RECIPE = [
    "data-bin", "--user-dir", USER_DIR,
    "--distributed-world-size", "8", "--memory-efficient-fp16", "--num-workers", "2",
    "--model-parallel-size", "8", "--criterion", "vocab_parallel_cross_entropy",
    "--task", "language_modeling", "--sample-break-mode", "none", "--tokens-per-sample", "1024",
    "--arch", "transformer_lm_megatron_11b", "--share-decoder-input-output-embed",
    "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--adam-eps", "1e-08",
    "--lr", "0.00015", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "3000",
    "--weight-decay", "0.01", "--dropout", "0.1", "--attention-dropout", "0.1",
    "--batch-size", "2", "--max-update", "300000",
]


def _parse(argv):
    parser = options.get_training_parser()
    return options.parse_args_and_arch(parser, input_args=argv)


def test_names_point_at_this_package():
    assert MODEL_REGISTRY["model_parallel_transformer_lm"] is ModelParallelTransformerLanguageModel
    for arch in ("transformer_lm_megatron", "transformer_lm_megatron_11b"):
        assert ARCH_MODEL_REGISTRY[arch] is ModelParallelTransformerLanguageModel
    assert CRITERION_REGISTRY["vocab_parallel_cross_entropy"] is VocabParallelCrossEntropyCriterion


def test_recipe_parses_with_megatron_11b_dims():
    args = _parse(RECIPE)
    assert (args.arch, args.criterion, args.model_parallel_size) == (
        "transformer_lm_megatron_11b", "vocab_parallel_cross_entropy", 8)
    # fairseq's model_parallel/models/transformer_lm.py: 3072 hidden, FFN 6x, 72 layers, 32 heads
    assert args.decoder_embed_dim == 3072
    assert args.decoder_ffn_embed_dim == 3072 * 6 == 18432
    assert args.decoder_layers == 72
    assert args.decoder_attention_heads == 32
    assert args.activation_fn == "gelu"
    assert (args.dropout, args.attention_dropout) == (0.1, 0.1)
    assert args.decoder_normalize_before is True  # pre-norm
    assert args.decoder_learned_pos is False  # sinusoidal positions
    assert args.share_decoder_input_output_embed is True


def test_transformer_lm_megatron_dims_and_overrides():
    argv = [a if a != "transformer_lm_megatron_11b" else "transformer_lm_megatron" for a in RECIPE]
    args = _parse(argv)
    assert (args.decoder_embed_dim, args.decoder_ffn_embed_dim) == (3072, 3072 * 4)
    small = _parse(RECIPE + ["--decoder-layers", "2", "--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "256"])
    assert (small.decoder_layers, small.decoder_embed_dim, small.decoder_ffn_embed_dim) == (2, 64, 256)


def test_speed_flags_parse():
    """The training-speed flags are fairseq-train options of our model (the
    unit tests build models from a Namespace and would not notice a flag
    missing from the parser); absent unless given (fairseq suppresses model
    argument defaults; the model reads them with safe_getattr)."""
    flags = ["--compile-layers", "--cuda-graphs", "--bf16-autocast", "--sequence-parallel"]
    # --bf16-autocast keeps fp32 weights, so it replaces the recipe's --memory-efficient-fp16
    # (check_options refuses the pair while parsing).
    fp32_recipe = [a for a in RECIPE if a != "--memory-efficient-fp16"]
    on, off = _parse(fp32_recipe + flags), _parse(fp32_recipe)
    for flag in flags:
        name = flag[2:].replace("-", "_")
        assert getattr(on, name) is True and getattr(off, name, False) is False, flag


def test_user_dir_module_prints_the_plugin_directory(capsys):
    """``USER_DIR=$(python -m fairseq_megatron.user_dir)``, as the README installs it."""
    import runpy

    runpy.run_module("fairseq_megatron.user_dir", run_name="__main__")
    printed = capsys.readouterr().out.strip()
    assert printed == USER_DIR and os.path.isfile(os.path.join(printed, "__init__.py"))
