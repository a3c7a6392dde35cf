"""Workers for the pipeline-parallel tests: fairseq's trainer (our
``MegatronTrainer``) at ``T x P x D`` ranks, stepping on batches made here.

The batches are those fairseq's language-modeling task gives an update
under ``--sample-break-mode none``: ``--update-freq`` samples of
``--batch-size`` rows of ``--tokens-per-sample`` tokens, except where the
epoch ends: a last batch of fewer rows, a last block of fewer positions
(right-padded), and a last update with fewer samples than ``--update-freq``.
"""

import hashlib

import torch
import torch.distributed as dist

from tests.support.partition import expected_partition_dim
from fairseq_megatron.parallel import parallel_state

ROWS, LENGTH, VOCAB = 4, 16, 64  # --batch-size, --tokens-per-sample, dummy_lm's dictionary (60 + 4 specials)
PAD = 1


def sample(seed: int, rows: int = ROWS, length: int = LENGTH, short_tail: int = 0) -> dict:
    """A fairseq LM sample of ``rows`` x ``length`` tokens; with ``short_tail``
    its last row is a block ``short_tail`` tokens shorter, padded."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, VOCAB, (rows, length + 1), generator=g)
    src, tgt = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    if short_tail:
        src[-1, -short_tail:] = PAD
        tgt[-1, -short_tail:] = PAD
    return {"id": torch.arange(rows) + seed * 100, "nsentences": rows, "ntokens": int(tgt.ne(PAD).sum()),
            "net_input": {"src_tokens": src, "src_lengths": src.ne(PAD).sum(1)}, "target": tgt}


def epoch(updates: int, micro_batches: int, data_parallel_rank: int = 0) -> list:
    """``updates`` updates of ``micro_batches`` samples for one data-parallel
    rank; the last update is the epoch's end: one sample fewer, its last
    batch of 2 rows whose last row is a block 5 tokens short."""
    out = []
    for u in range(updates):
        seeds = [1000 * data_parallel_rank + micro_batches * u + i for i in range(micro_batches)]
        if u < updates - 1:
            out.append([sample(s) for s in seeds])
        else:
            out.append([sample(s) for s in seeds[:-2]] + [sample(seeds[-2], rows=2, short_tail=5)])
    return out


def epoch_part(total: int, first: int, updates: int, micro_batches: int, data_parallel_rank: int = 0) -> list:
    """Updates ``first`` to ``first + updates - 1`` (from 0) of :func:`epoch`
    of ``total`` updates: where a run resumed from a checkpoint saved after
    update ``first`` goes on."""
    return epoch(total, micro_batches, data_parallel_rank)[first: first + updates]


def build(tensor: int, stages: int, micro_batches: int, layers: int, extra=(), context: int = 1, tied: bool = True):
    """Our trainer for a ``layers`` x 32 ``transformer_lm_megatron_11b``
    (tied embeddings unless not ``tied``, no dropout) on fairseq's dummy_lm
    task, with this world's groups made for ``tensor`` x ``context`` x ``stages``."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from fairseq_megatron.fairseq_integration.trainer import build_trainer
    from fairseq_megatron.parallel.rng_tracker import model_parallel_manual_seed

    parallel_state.initialize_model_parallel(tensor, stages, context)
    model_parallel_manual_seed(3)
    torch.manual_seed(3)
    args = options.parse_args_and_arch(options.get_training_parser(), input_args=[
        "--task", "dummy_lm", "--tokens-per-sample", str(LENGTH), "--dict-size", str(VOCAB - 4),
        "--batch-size", str(ROWS), "--arch", "transformer_lm_megatron_11b", "--decoder-layers", str(layers),
        "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "4",
        *(["--share-decoder-input-output-embed"] if tied else []), "--dropout", "0", "--attention-dropout", "0",
        "--criterion", "vocab_parallel_cross_entropy", "--optimizer", "adam", "--lr", "1e-3", "--clip-norm", "0.5",
        "--seed", "3", "--update-freq", str(micro_batches), "--model-parallel-size", str(tensor),
        "--pipeline-model-parallel-size", str(stages), "--context-parallel-size", str(context),
        "--ddp-backend", "legacy_ddp", "--cpu",
        "--distributed-world-size", str(dist.get_world_size()), *extra])
    cfg = convert_namespace_to_omegaconf(args)
    if tensor > 1:  # what fairseq's distributed_init does at --model-parallel-size > 1
        from fairseq.distributed import utils as distributed_utils

        distributed_utils._USE_MEGATRON = True  # its data-parallel group is then the mpu's
        cfg.checkpoint.checkpoint_suffix = f"-model_part-{parallel_state.get_tensor_model_parallel_rank()}"
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    return build_trainer(cfg, task, model, task.build_criterion(cfg.criterion))


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(_whole(t).detach().contiguous().numpy().tobytes()).hexdigest()


def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t``, or the whole of a DTensor sharded over data-parallel ranks
    (collective: every rank of its group asks, in the same order)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train(rank, world_size, tensor, stages, micro_batches, layers, updates, extra=(), context=1, batches=epoch,
          tied=True, checkpoint=None, validate=False):
    """Train ``updates`` updates of ``batches`` (:func:`epoch`: this rank's
    data-parallel shard). Returns per update the loss per token and the
    gradient norm (as the trainer computed them), this rank's coordinates,
    its context-parallel rank and size and the length of the first held
    layer's input in the last pass, its parameter names, the tied
    embedding's digest on the stages that hold it, and at the end its
    parameters and their last gradients.

    ``checkpoint`` (a dict, optional): ``restore``, a checkpoint the trainer
    loads first (as fairseq-train's ``--restore-file``; with
    ``reset_optimizer`` its optimizer state afresh, as ``--reset-optimizer``
    and ``--finetune-from-model``); ``save_to``, where it saves one after
    update ``save_after`` (every rank its part, as fairseq-train does), then
    trains on. ``validate``: the result holds ``valid_loss``, the loss of
    one validation step on a sample of its own after the last update (the
    schedule's forward alone, ``eval``)."""
    torch.set_num_threads(1)  # up to 4 ranks share the machine's cores; the model is tiny
    checkpoint = checkpoint or {}
    trainer = build(tensor, stages, micro_batches, layers, extra, context, tied)
    if "restore" in checkpoint:
        trainer.load_checkpoint(checkpoint["restore"], reset_optimizer=checkpoint.get("reset_optimizer", False))
    else:
        trainer.get_model().run_deferred_initialisation()
    norms, losses, embedding_digests = [], [], []
    clip = trainer.clip_grad_norm

    def recorded_norm(clip_norm):
        norm = clip(clip_norm)
        norms.append(float(norm))
        return norm

    trainer.clip_grad_norm = recorded_norm
    reduce = trainer._reduce_and_log_stats

    def recorded_loss(logging_outputs, sample_size, grad_norm=None):
        losses.append(float(sum(float(o["loss"]) for o in logging_outputs)) / float(sample_size))
        return reduce(logging_outputs, sample_size, grad_norm)

    trainer._reduce_and_log_stats = recorded_loss
    decoder = trainer.get_model().decoder
    layer_input = []
    next(iter(decoder.held_layers())).register_forward_pre_hook(lambda _, args: layer_input.append(args[0].size(0)))
    for done, samples in enumerate(batches(updates, micro_batches, parallel_state.get_data_parallel_rank()), 1):
        trainer.train_step(samples)
        if done == checkpoint.get("save_after"):
            trainer.consolidate_optimizer()  # as fairseq's save_checkpoint does first
            trainer.save_checkpoint(checkpoint["save_to"], {})
            dist.barrier()  # every part written before any rank goes on (fairseq's save ends in one)
        if decoder.embed_tokens is not None:
            embedding_digests.append(_digest(decoder.embed_tokens.weight))
    trainer._reduce_and_log_stats = reduce
    valid_loss = float(trainer.valid_step(sample(7777))["loss"]) if validate else None
    model = trainer.get_model()
    from fairseq_megatron.training.memory import fairseq_optimizer_state_bytes, gradient_bytes, parameter_bytes

    return {
        "memory": (parameter_bytes(model), gradient_bytes(model), fairseq_optimizer_state_bytes(trainer.optimizer)),
        "sharded": [n for n, p in model.named_parameters() if hasattr(p, "device_mesh")],
        "valid_loss": valid_loss,
        "schedule": type(trainer.pipeline._schedule).__name__ if trainer.pipeline is not None else None,
        "optimizer_steps": sorted({int(v["step"]) for v in trainer.optimizer.optimizer.state.values() if "step" in v}),
        "coordinates": (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_data_parallel_rank(),
                        parallel_state.get_pipeline_model_parallel_rank()),
        "context": (parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_world_size()),
        "first_layer_input_length": layer_input[-1],
        "layers": sorted({int(n.split(".")[2]) for n, _ in model.named_parameters() if n.startswith("decoder.layers.")}),
        "names": [n for n, _ in model.named_parameters()],
        "losses": losses,
        "norms": norms,
        "embedding_digests": embedding_digests,
        "params": {n: _whole(p).detach().clone() for n, p in model.state_dict().items() if "version" not in n
                   and "_float_tensor" not in n},
        "grads": {n: _whole(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None},
    }


def whole_model(results: list, key: str) -> dict:
    """The whole model's tensors from every rank's ``results[...][key]`` of
    one model copy (data-parallel rank 0, context-parallel rank 0): stages
    merged by name, tensor parts concatenated along their partition dimension."""
    copy0 = [r for r in results if r["coordinates"][1] == 0 and r["context"][0] == 0]
    merged = {}
    for stage in sorted({r["coordinates"][2] for r in copy0}):
        parts = sorted((r for r in copy0 if r["coordinates"][2] == stage), key=lambda r: r["coordinates"][0])
        for name in parts[0][key]:
            dim = expected_partition_dim(name)
            tensors = [p[key][name] for p in parts]
            merged[name] = tensors[0] if dim is None else torch.cat(tensors, dim)
    return merged


# The tolerances of runs that differ only in the order of fp32 sums (the
# reasons: tests/distributed/test_pipeline_parallel.py's docstring).
LOSS_TOL = dict(rtol=1e-5, atol=0.0)
GRAD_TOL = dict(rtol=0.0, atol=1e-7)
WEIGHT_TOL = dict(rtol=0.0, atol=1e-6)
LR = 1e-3  # build's --lr
KEY_BIAS_TOL = dict(rtol=0.0)  # atol: lr per update


def compare_runs(results, reference, loss_tol=LOSS_TOL, grad_tol=GRAD_TOL, weight_tol=WEIGHT_TOL):
    """Assert that the runs ``results`` and ``reference`` (:func:`train`'s,
    every rank) logged the same loss and gradient norm per update, ended with
    the same gradients and (unless ``weight_tol`` is None) the same weights,
    whole models compared (:func:`whole_model`). The attention's key bias,
    whose gradient is zero up to rounding, is compared at lr per update.
    Returns the largest differences found (relative for losses and norms,
    absolute for gradients and weights, the key bias left out), for a report."""
    ref = reference[0]
    found = {"loss": 0.0, "norm": 0.0, "grad": 0.0, "weight": 0.0}
    for r in results:
        assert len(r["losses"]) == len(r["norms"]) == len(ref["losses"])
        for what, key in (("loss", "losses"), ("norm", "norms")):
            mine, theirs = torch.tensor(r[key]), torch.tensor(ref[key])
            torch.testing.assert_close(mine, theirs, **loss_tol)
            found[what] = max(found[what], ((mine - theirs).abs() / theirs.abs()).max().item())
    grads, ref_grads = whole_model(results, "grads"), whole_model(reference, "grads")
    assert sorted(grads) == sorted(ref_grads)
    for name in ref_grads:
        torch.testing.assert_close(grads[name].float(), ref_grads[name].float(), **grad_tol, msg=name)
        found["grad"] = max(found["grad"], (grads[name].float() - ref_grads[name].float()).abs().max().item())
    if weight_tol is None:
        return found
    params, ref_params = whole_model(results, "params"), whole_model(reference, "params")
    assert sorted(params) == sorted(ref_params)
    for name in ref_params:
        tol = dict(KEY_BIAS_TOL, atol=len(ref["losses"]) * LR) if name.endswith("k_proj.bias") else weight_tol
        torch.testing.assert_close(params[name], ref_params[name], **tol, msg=name)
        if not name.endswith("k_proj.bias"):
            found["weight"] = max(found["weight"], (params[name] - ref_params[name]).abs().max().item())
    return found
