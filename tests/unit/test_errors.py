"""Clear errors for impossible configurations and bad checkpoints."""

import os
import re

import pytest
import torch

from fairseq_megatron.errors import UsageError
from fairseq_megatron.models.options import check_dictionary_size
from tests.helpers import build_model, make_batch, make_dictionary


def test_fully_sharded_refuses_what_fsdp2_does_not_do_in_one_line():
    """fairscale's options and what copies or replays the parameters whole
    are refused before any work; fairseq-train's fsdp_wrap gives our model
    back as it is (MegatronTrainer shards it), where fairscale's FSDP needed
    CUDA ("Torch not compiled with CUDA enabled") and flattened the parts."""
    from types import SimpleNamespace

    from fairscale.nn import FullyShardedDataParallel, enable_wrap

    from fairseq_megatron.fairseq_integration.train import fsdp_wrap
    from fairseq_megatron.training.fully_sharded import check_fully_sharded

    def refusal(**given):
        distributed = SimpleNamespace(ddp_backend="fully_sharded", cpu_offload=False, use_sharded_state=False,
                                      zero_sharding="none")
        common, ema, model = SimpleNamespace(amp=False), SimpleNamespace(store_ema=False), SimpleNamespace()
        checkpoint = SimpleNamespace(write_checkpoints_asynchronously=False, save_dir="ckpt", no_save=False)
        for name, value in given.items():
            for config in (distributed, common, ema, checkpoint, model):
                if hasattr(config, name) or (config is model and name == "cuda_graphs"):
                    setattr(config, name, value)
                    break
        try:
            check_fully_sharded(distributed, common, ema, model, checkpoint)
        except UsageError as e:
            return str(e)
        return None

    assert refusal() is None and refusal(save_dir="s3://bucket/ckpt", no_save=True) is None
    # each refused with its own reason, written out here as a user reads it
    for given, flag, reason in (
            (dict(cpu_offload=True), "--cpu-offload",
             "fairscale's FSDP option; torch's FSDP2 here keeps the parameter shards on the device"),
            (dict(use_sharded_state=True), "--use-sharded-state",
             "fairscale's FSDP option; checkpoints are always part files plus one optimizer shard per "
             "data-parallel rank"),
            (dict(zero_sharding="os"), "--zero-sharding os", "the optimizer state is sharded already, with the "
                                                             "parameters"),
            (dict(cuda_graphs=True), "--cuda-graphs", "FSDP2 gathers each layer's parameters into new memory every "
                                                      "step, which a replayed CUDA graph cannot follow"),
            (dict(store_ema=True), "--store-ema", "fairseq's EMA keeps a whole copy of the model on every rank"),
            (dict(amp=True), "--amp", "fairseq's AMP optimizer is not wired to FSDP2's mixed-precision policy; "
                                      "use --fp16 or --bf16-autocast, which are"),
            (dict(write_checkpoints_asynchronously=True), "--write-checkpoints-asynchronously",
             "every rank takes part in a save (each writes its optimizer shard, one commit of all)"),
            (dict(save_dir="s3://bucket/ckpt"), "--save-dir s3://bucket/ckpt (a remote file system)",
             "the save's commit renames every rank's files in a local directory")):
        assert refusal(**given) == (f"{flag} does not work with --ddp-backend fully_sharded ({reason}); drop it, "
                                    f"or use --ddp-backend pytorch_ddp"), flag
    with enable_wrap(wrapper_cls=FullyShardedDataParallel):
        model, _ = build_model(1, cpu=True)
        assert fsdp_wrap(model) is model


def test_heads_must_divide_the_embedding_and_the_vocabulary_must_fit():
    """At size 1: an embedding dim that the heads do not divide was reported
    as "not divisible by the model-parallel size (3)" (3 being the heads),
    and a --padded-vocab-size smaller than the dictionary blamed a
    checkpoint's embedding while training from scratch."""
    with pytest.raises(UsageError, match="^--decoder-embed-dim 64 is not divisible by --decoder-attention-heads 3$"):
        build_model(1, decoder_embed_dim=64, decoder_attention_heads=3)
    symbols = len(make_dictionary())
    with pytest.raises(UsageError, match=re.escape(
            f"the dictionary has {symbols} symbols but the vocabulary has 16 rows (--padded-vocab-size, or a "
            f"checkpoint's record of it): a --padded-vocab-size too small, or the wrong dict.txt")):
        build_model(1, padded_vocab_size=16)


def test_a_failed_fairseq_train_removes_only_the_empty_directories_it_made(tmp_path):
    """The clean-up after a failed fairseq-train of ours
    (:mod:`fairseq_megatron.fairseq_integration.train`): of ``runs/a/b``, made
    by the run, each directory goes while it is empty; one holding a file (a
    part saved before the failure) stays, and so does everything that
    existed before (``tmp_path``)."""
    from fairseq_megatron.fairseq_integration.train import directories_missing, remove_while_empty

    made = directories_missing(str(tmp_path / "runs" / "a" / "b"))
    assert made == [str(tmp_path / "runs" / "a" / "b"), str(tmp_path / "runs" / "a"), str(tmp_path / "runs")]
    os.makedirs(made[0])
    remove_while_empty(made)
    assert os.listdir(tmp_path) == []

    os.makedirs(made[0])
    open(os.path.join(made[0], "checkpoint_last-model_part-0.pt"), "w").close()
    remove_while_empty(made)
    assert os.listdir(made[0]) == ["checkpoint_last-model_part-0.pt"]


def test_model_parallel_size_without_distributed_init():
    """The layout, built by every entry point before any work, checks the
    sizes; a model built for size 2 in the single-process layout says so too."""
    from fairseq_megatron.parallel import parallel_state

    try:
        with pytest.raises(UsageError, match=re.escape(
                "--model-parallel-size 2 needs 2 processes, one per model part, and this run is one process: "
                "launch it with torchrun --nproc_per_node 2")):
            parallel_state.initialize_model_parallel(2)
        # fairseq ran 0 as size 1, and -1 failed on the group size only in a build
        for size in (0, -1):
            with pytest.raises(UsageError, match=re.escape(
                    f"--model-parallel-size {size}: the number of model parts is at least 1")):
                parallel_state.initialize_model_parallel(size)
        with pytest.raises(UsageError, match=re.escape(
                "--pipeline-model-parallel-size 0: the number of pipeline stages is at least 1")):
            parallel_state.initialize_model_parallel(1, 0)
        parallel_state.initialize_model_parallel(1)
        assert parallel_state.get_process_groups().mesh is None  # the single-process mode: no mesh
        with pytest.raises(UsageError, match=re.escape(
                "the model is configured for model-parallel size 2 but this run's model-parallel group has 1")):
            build_model(2)
    finally:
        parallel_state.destroy_model_parallel()


def test_training_precisions_that_fail_on_this_machine_are_refused(monkeypatch):
    """fairseq's --bf16 means TPU, and --fp16's optimizer needs CUDA: both
    failed with tracebacks after the model was built (fairseq-train's main
    calls this check first)."""
    import importlib.util
    from argparse import Namespace

    from fairseq_megatron.training.options import check_training_precision

    def common(**flags):
        fields = dict(bf16=False, memory_efficient_bf16=False, fp16=False, memory_efficient_fp16=False, cpu=False)
        return Namespace(**{**fields, **flags})

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch_xla" else object())
    for flags, refused in [
        (dict(bf16=True), "fairseq's --bf16 means TPU (it needs torch_xla); for bf16 on a GPU or CPU use "
                          "--bf16-autocast (fp32 weights, bf16 autocast)"),
        (dict(bf16=True, memory_efficient_bf16=True), "fairseq's --memory-efficient-bf16 means TPU"),
        (dict(fp16=True, cpu=True), "--fp16 needs a CUDA GPU (fairseq's FP16 optimizer keeps its fp32 master "
                                    "weights there); on CPU train in fp32 or with --bf16-autocast"),
    ]:
        with pytest.raises(UsageError, match="^" + re.escape(refused)):
            check_training_precision(common(**flags))
    for fine in (dict(), dict(fp16=True), dict(fp16=True, memory_efficient_fp16=True, cpu=True)):
        check_training_precision(common(**fine))  # GPU fp16, and CPU memory-efficient fp16, run
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match="^--fp16 needs a CUDA GPU"):
        check_training_precision(common(fp16=True))  # no --cpu, but no CUDA either
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    check_training_precision(common(bf16=True))  # with torch_xla: fairseq's TPU path, left alone


def test_bf16_autocast_refuses_fp16_training():
    """--bf16-autocast needs fp32 weights; with --fp16 it would silently do
    nothing (the weights are already half precision), so it is refused."""
    with pytest.raises(UsageError, match="--bf16-autocast trains fp32 weights under bf16 autocast; drop --fp16$"):
        build_model(1, bf16_autocast=True, fp16=True)
    with pytest.raises(UsageError, match="drop --amp$"):
        build_model(1, bf16_autocast=True, amp=True)
    build_model(1, bf16_autocast=True, fp16=False, amp=False)  # fp32 training: fine


def test_cuda_graphs_need_the_compiled_layer_stack():
    """--cuda-graphs replays the one compiled region of the whole stack; where
    there is none (no --compile-layers, or checkpointing) preparing the model
    for training refuses it (what MegatronTrainer applies:
    :func:`fairseq_megatron.training.parallelize.parallelize`), while
    evaluation of such a model, which applies none of it, still runs.
    Gradient accumulation, whose sums the replays would overwrite, is refused
    when the model is built."""
    from fairseq_megatron.models.model_parallel_transformer_lm import ModelParallelTransformerLanguageModel
    from tests.helpers import LMTask, model_args, parallelized

    tokens, _ = make_batch(make_dictionary())
    for overrides in ({}, {"compile_layers": True, "checkpoint_activations": True},
                      {"compile_layers": True, "offload_activations": True}):
        args = model_args(1, cuda_graphs=True, **overrides)
        model = ModelParallelTransformerLanguageModel.build_model(args, LMTask(make_dictionary()))
        model.eval()
        with torch.no_grad():
            model(tokens)
        with pytest.raises(UsageError,
                           match="--cuda-graphs replays the compiled layer stack: it needs --compile-layers"):
            parallelized(model, args)
    with pytest.raises(UsageError, match="--cuda-graphs with --update-freq 2: a CUDA graph replay would overwrite"):
        build_model(1, cuda_graphs=True, compile_layers=True, update_freq=[2])
    build_model(1, cuda_graphs=True, compile_layers=True, update_freq=[1])  # the supported case: fine


def test_a_dictionary_other_than_the_trained_one_is_refused():
    """A checkpoint records its dictionary's size before padding (build_model
    sets ``dictionary_size``); a model built from that config takes the same
    dictionary, or one saved after padding (more symbols, all madeupwords),
    and refuses a shorter or a longer one. Before the record, a shorter
    dictionary was padded up to the checkpoint's rows without a word."""
    model, _ = build_model(1)
    trained_with = len(make_dictionary())
    assert model.decoder.args.dictionary_size == trained_with  # a new model records its own
    with pytest.raises(UsageError, match=re.escape(
            f"the dictionary has {trained_with} symbols but the checkpoint's model was trained with "
            f"{trained_with + 1}: wrong dict.txt for this checkpoint")):
        build_model(1, dictionary_size=trained_with + 1)  # as fairseq-eval-lm builds from a checkpoint

    def dictionary(*extra):
        d = make_dictionary()
        for symbol in extra:
            d.add_symbol(symbol)
        return d.symbols

    trained = dictionary("one more")  # 65 symbols: padding adds 7
    check_dictionary_size(trained, len(trained), len(trained), "x.pt")
    check_dictionary_size(trained, len(trained), None, "x.pt")  # checkpoints from before the record
    padded = dictionary("one more", *(f"madeupword{i:04d}" for i in range(7)))  # saved after padding
    check_dictionary_size(padded, len(padded), len(trained), "x.pt")
    with pytest.raises(UsageError, match=re.escape(
            f"the dictionary has {len(trained) - 1} symbols but x.pt was trained with {len(trained)}: "
            f"wrong dict.txt for this checkpoint")):
        check_dictionary_size(trained[:-1], len(trained) - 1, len(trained), "x.pt")
    longer = dictionary("one more", "another")
    with pytest.raises(UsageError, match="wrong dict.txt"):
        check_dictionary_size(longer, len(longer), len(trained), "x.pt")


@pytest.mark.parametrize("overrides,given", [
    (dict(scale_attn=True, scale_resids=True), "--scale-attn --scale-resids"),
    (dict(quant_noise_pq=0.1), "--quant-noise-pq 0.1"),
    (dict(quant_noise_scalar=0.1), "--quant-noise-scalar 0.1"),
    (dict(base_layers=1), "--base-layers 1"),
    (dict(decoder_xformers_att_config='{"name": "scaled_dot_product"}'),
     '--decoder-xformers-att-config {"name": "scaled_dot_product"}'),
    (dict(decoder_input_dim=48), "--decoder-input-dim 48"),
    (dict(decoder_output_dim=48), "--decoder-output-dim 48"),
])
def test_transformer_lm_options_the_layers_lack_are_refused(overrides, given):
    """fairseq's parser gives our archs every transformer_lm option. These the
    model-parallel layers do not implement: NormFormer's scalings and the
    quantization noises were ignored (a model built without them; the pq
    noise also added a projection that the forward never used), BASE
    layers and xformers attention were ignored,
    and other input/output dims failed in the first forward ("mat1 and
    mat2 shapes cannot be multiplied"). Options our layers do implement
    build: layerdrop, relu, post-norm, an embedding layer norm."""
    with pytest.raises(UsageError) as refused:
        build_model(1, **overrides)
    assert str(refused.value) == (f"{given}: not implemented by the model-parallel decoder; drop it (fairseq's own "
                                  f"transformer_lm has it, without model parallelism)")
    model, dictionary = build_model(1, decoder_layerdrop=0.5, activation_fn="relu", decoder_normalize_before=False,
                                    layernorm_embedding=True)
    assert model(make_batch(dictionary)[0])[0].shape[-1] == len(dictionary)


@pytest.mark.parametrize("optimizer", ["adafactor", "adagrad", "adam"])
def test_fully_sharded_refuses_an_optimizer_that_is_not_pointwise(optimizer):
    """fairseq refused non-pointwise optimizers under fully_sharded (each
    rank updates its shard alone: Adafactor's row and column statistics of a
    shard are not those of the parameter); the refusal moved with the
    backend's checks and is kept, as one line."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from fairseq_megatron.training.data_parallel import FullyShardedDataParallel

    args = options.parse_args_and_arch(options.get_training_parser(), [
        "data", "--task", "language_modeling", "--arch", "transformer_lm_megatron", "--ddp-backend", "fully_sharded",
        "--optimizer", optimizer, "--criterion", "vocab_parallel_cross_entropy", "--lr", "0.001"])
    cfg = convert_namespace_to_omegaconf(args)
    if optimizer == "adam":
        FullyShardedDataParallel.check(cfg, 1, 2)
        return
    with pytest.raises(UsageError, match=f"--optimizer {optimizer} does not work with --ddp-backend fully_sharded"):
        FullyShardedDataParallel.check(cfg, 1, 2)


def test_a_table_of_positions_larger_than_memory_is_one_line_at_launch():
    """``fairseq-train --tokens-per-sample 1000000000`` died in the
    allocator building the sinusoidal table (128 GB at dimension 32); the
    architecture function, which fairseq runs while parsing, refuses it."""
    from fairseq_megatron.models.options import check_positions
    from tests.helpers import model_args

    args = model_args(1)
    check_positions(args)  # the tests' 16 positions
    args.max_target_positions, args.tokens_per_sample = None, 10 ** 9
    with pytest.raises(UsageError, match=r"--tokens-per-sample 1000000000: the model's table of positions alone "
                                         r"would take 128\.0 GB \(1,000,000,000 rows of 32 fp32 values\), more than "
                                         r"this machine's"):
        check_positions(args)


def test_a_dictionary_of_the_same_size_in_another_order_is_refused(tmp_path, capsys):
    """A dict.txt of the trained size but other symbols, or the same in
    another order, evaluated and trained without a word (perplexity 11,073
    instead of 208.7). A checkpoint records a checksum of its symbols in
    order: the model's build (fairseq-eval-lm, -generate, the hub, the
    lm-eval backend), fairseq-train's load and the exports' --dict refuse
    another, in one line; --accept-other-dictionary lets a deliberate change
    through; a checkpoint without the record loads as before."""
    from fairseq_megatron.checkpoint.loading import check_vocabulary
    from fairseq_megatron.cli import reshard_checkpoint
    from fairseq_megatron.models.model_parallel_transformer_lm import ModelParallelTransformerLanguageModel
    from fairseq_megatron.models.options import dictionary_checksum
    from tests.helpers import LMTask, model_args
    from tests.support.checkpoint_resharding import WORDS, save_checkpoint

    trained = make_dictionary()
    size = len(trained)
    recorded = dictionary_checksum(trained.symbols[:size])
    swapped = make_dictionary()
    swapped.symbols[5], swapped.symbols[6] = swapped.symbols[6], swapped.symbols[5]
    said = "symbols the checkpoint's model was trained with in number, but not the same symbols in the same order"

    def build(dictionary, **more):
        args = model_args(1, **{"dictionary_size": size, "dictionary_checksum": recorded, **more})
        return ModelParallelTransformerLanguageModel.build_model(args, LMTask(dictionary))

    assert build(make_dictionary()).decoder.args.dictionary_checksum == recorded
    with pytest.raises(UsageError, match=re.escape(said)):
        build(swapped)
    assert build(swapped, accept_other_dictionary=True).decoder.args.dictionary_checksum != recorded
    build(swapped, dictionary_checksum=None)  # saved before the record
    with pytest.raises(UsageError, match="not the same symbols in the same order"):
        check_vocabulary(swapped, size, 64, 64, size, "ckpt.pt", recorded)  # fairseq-train's load
    check_vocabulary(swapped, size, 64, 64, size, "ckpt.pt", recorded, accept_other=True)

    path = str(tmp_path / "src" / "model.pt")
    os.makedirs(os.path.dirname(path))
    save_checkpoint(path, 2)
    words = make_dictionary(WORDS)
    for part in (0, 1):
        state = torch.load(path.replace(".pt", f"-model_part-{part}.pt"), weights_only=False)
        state["cfg"]["model"].dictionary_checksum = dictionary_checksum(words.symbols)
        torch.save(state, path.replace(".pt", f"-model_part-{part}.pt"))
    words.symbols[4], words.symbols[5] = words.symbols[5], words.symbols[4]
    words.save(str(tmp_path / "dict.txt"))
    argv = ["--input", path, "--output", str(tmp_path / "plain" / "model.pt"), "--to-fairseq", "--dict",
            str(tmp_path / "dict.txt")]
    assert reshard_checkpoint.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the dictionary has the") and "not the same symbols in the same order" in err
    assert reshard_checkpoint.main(argv + ["--accept-other-dictionary"]) == 0
