"""One rank's training step at full size, without its memory: the planner's
prediction checked against the package's own code.

As torchtitan's memory estimation does (``scripts/estimate/estimation.py``):
the default process group is torch's ``fake`` backend at the layout's full
world size (this process is one rank of it; every collective returns at
once), the model is this package's, built by fairseq's task from
fairseq-train's flags for the layout and prepared for training as the
trainer prepares it (:func:`~fairseq_megatron.training.parallelize.parallelize`,
then FSDP2 for ``--ddp-backend fully_sharded``), under
``FakeTensorMode``: every tensor has its shape, dtype and device and no
data, so a 175B model's stage is built and trained on a laptop.
Torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``) follows
every tensor the step creates and frees.

The step: fairseq's optimizer for the flags (``FP16Optimizer`` with
``--fp16``, ``MemoryEfficientFP16Optimizer``, Adam or Adafactor), the
vocab-parallel cross entropy, and the micro-batches in the order torch's
schedule runs them on this rank: with one stage two micro-batches (the
second's activations meet the first's gradients); on a pipeline stage the
warm-up forwards of 1F1B (or of the interleaved schedule), then each
backward of the oldest micro-batch after one more forward, twice, then the
rest; then the optimizer's step. Twice: the second step meets the
optimizer state the first one made (fairseq's optimizers make it at their
first step), as every later step of a run does. A chunk that is not the model's first
takes a fresh ``(T, B, C)`` input, as it would receive it, and a chunk that
is not the last is given a fresh output gradient.

What cannot run under fake tensors, and what the dry run does instead:

* fairseq's ``SinusoidalPositionalEmbedding`` reads its input's shape as a
  tensor (``torch.onnx.operators.shape_as_tensor``, an ONNX-tracing helper)
  and compares it with a number: it is handed the shape as numbers;
* the decoder asks whether the tokens hold padding (a read of their
  values): the tokens are marked as holding none, as fairseq-train's
  trainer marks its batches on the host (:mod:`fairseq_megatron.modules.padding`);
* fairseq's ``FP16Optimizer`` asks CUDA for the current device
  (``build_fp32_params``) even on a CPU: it is told device 0;
* the gradient-norm clipping and the loss scaler's overflow test read
  values: the step runs the optimizer without them (they allocate nothing
  that lasts); the trainer's fused AdamW, which it uses on CUDA only, takes
  fairseq's Adam's place over fp32 weights as on a GPU;
* attention dropout is set to 0: the fake tensors live on the CPU, whose
  attention with dropout keeps the probabilities (``s^2`` per head), while
  a GPU's flash attention keeps none (the planner counts flash attention).
"""

import contextlib
import dataclasses
from typing import Dict, List
from unittest import mock

from fairseq_megatron.planner.errors import PlanError
from fairseq_megatron.planner.layouts import Layout
from fairseq_megatron.planner.memory import Training, chunk_passes_in_flight, stage_memory
from fairseq_megatron.planner.recommendation import training_flags
from fairseq_megatron.planner.shape import ModelShape

# fairseq's loss scaler defaults its window to 2**14 / (data-parallel size x --update-freq), rounded down: 0
# for many GPUs and micro-batches (a division by zero in its update); the dry run gives it one
PRECISION_FLAGS = {"fp16": ["--fp16", "--fp16-scale-window", "128"],
                   "memory-efficient-fp16": ["--memory-efficient-fp16", "--fp16-scale-window", "128"], "fp32": [],
                   "bf16-autocast": ["--bf16-autocast"]}


@dataclasses.dataclass(frozen=True)
class DryRun:
    """Bytes one rank held in the dry run of its step: its ``weights``,
    ``gradients`` (fairseq's fp32 copy's included), ``optimizer`` state
    (fp32 master weights included) after the step, the most
    ``activations`` alive at once, and ``peak``, the most of everything at
    once (``MemTracker``'s peak). ``stage``: ``"first"`` or ``"last"``;
    ``rank`` of ``world_size``."""

    stage: str
    rank: int
    world_size: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    peak: int

    def by_kind(self) -> Dict[str, float]:
        """The four kinds the planner predicts, in GB."""
        return {"weights": self.weights / 1e9, "gradients": self.gradients / 1e9,
                "optimizer": self.optimizer / 1e9, "activations": self.activations / 1e9}


def fairseq_train_flags(m: ModelShape, layout: Layout, training: Training) -> List[str]:
    """fairseq-train's flags for one rank of ``layout`` training ``m``
    (fairseq's ``dummy_lm`` task: the batches' values do not matter here).

    Raises:
        PlanError: a precision fairseq-train has no flag for on a GPU (bf16).
    """
    if training.precision not in PRECISION_FLAGS:
        raise PlanError(f"the dry run takes --precision {', '.join(PRECISION_FLAGS)}, not {training.precision} "
                        f"(fairseq's --bf16 means TPU)")
    parallel = training_flags(layout)
    if "--sample-break-mode" in parallel:  # dummy_lm's samples are whole blocks already, and it has no such flag
        at = parallel.index("--sample-break-mode")
        del parallel[at: at + 2]
    flags = ["--task", "dummy_lm", "--dict-size", str(m.vocab - 8), "--tokens-per-sample", str(m.seq_len),
             "--arch", "transformer_lm_megatron", "--decoder-layers", str(m.layers),
             "--decoder-embed-dim", str(m.hidden), "--decoder-ffn-embed-dim", str(m.ffn),
             "--decoder-attention-heads", str(m.heads), "--share-decoder-input-output-embed",
             "--padded-vocab-size", str(m.vocab), "--criterion", "vocab_parallel_cross_entropy",
             "--optimizer", training.optimizer, "--lr", "1e-4", "--batch-size", str(training.micro_batch),
             "--dropout", "0.1", "--attention-dropout", "0", "--cpu", "--seed", "1",
             "--distributed-world-size", str(layout.tp * layout.pp * layout.cp * layout.dp),
             *parallel, *PRECISION_FLAGS[training.precision]]
    if m.learned_positions:
        flags.append("--decoder-learned-pos")
    if training.offloading:
        flags.append("--offload-activations")
    elif training.checkpointing:
        flags.append("--checkpoint-activations")
    if training.sequence_parallel:
        flags.append("--sequence-parallel")
    if training.fully_sharded == "zero2":
        flags.append("--no-reshard-after-forward")
    if training.zero_sharding:
        flags += ["--zero-sharding", "os"]
    return flags


def dry_run(m: ModelShape, layout: Layout, training: Training, stage: str = "first") -> DryRun:
    """Build the first rank of ``stage`` (``"first"`` or ``"last"``) of
    ``layout`` and run one training step under fake tensors (this module's
    docstring). The process's default process group and this package's
    parallel state are the dry run's while it runs, and released after.

    Raises:
        PlanError: another default process group exists in this process;
            a precision the dry run cannot run.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fairseq_megatron.parallel import parallel_state

    if dist.is_initialized():
        raise PlanError("the dry run needs a process without a default process group (it makes a fake one)")
    flags = fairseq_train_flags(m, layout, training)
    world = layout.tp * layout.cp * layout.dp * layout.pp
    rank = 0 if stage == "first" else layout.tp * layout.cp * layout.dp * (layout.pp - 1)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel(layout.tp, layout.pp, layout.cp)
        held = _step(flags, layout, training, stage)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return DryRun(stage, rank, world, **held)


@contextlib.contextmanager
def _what_fake_tensors_cannot_run():
    """The stand-ins of this module's docstring for reads of values."""
    import torch

    patches = [mock.patch("torch.onnx.operators.shape_as_tensor", lambda x: x.shape)]
    if not torch.cuda.is_available():
        patches.append(mock.patch("torch.cuda.current_device", lambda: 0))
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


def _step(flags: List[str], layout: Layout, training: Training, stage: str) -> Dict[str, int]:
    """Build, prepare and train this rank's stage under fake tensors; the bytes it held (:class:`DryRun`)."""
    import torch
    from fairseq import optim, options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from torch._subclasses.fake_tensor import FakeTensorMode

    import fairseq_megatron  # noqa: F401  (registers the model, criterion and task options)
    from fairseq_megatron.parallel import parallel_state
    from fairseq_megatron.parallel.rng_tracker import model_parallel_manual_seed
    from fairseq_megatron.training.parallelize import parallelize
    from fairseq_megatron.training.pipeline_schedule import ChunkModule

    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), flags))
    model_parallel_manual_seed(1)
    task = tasks.setup_task(cfg.task)
    with FakeTensorMode(allow_non_fake_inputs=True), _what_fake_tensors_cannot_run():
        model, criterion = task.build_model(cfg.model), task.build_criterion(cfg.criterion)
        parallelized = parallelize(model, parallel_state.get_process_groups(), cfg)  # FSDP2 shards here
        chunks = list(parallelized.chunk_modules) or \
            [ChunkModule(model.decoder, chunk) for chunk in parallelized.stage.chunks]
        if not training.fully_sharded and training.precision in ("fp16", "memory-efficient-fp16"):
            _half(model)  # fairseq's trainer calls model.half(), before it builds the optimizer
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = _fairseq_optimizer(cfg, params, training, optim)
        tracker = _activation_peak_tracker()
        masters = _fp32_masters(optimizer)
        tracker.track_external(model, *_torch_optimizers(optimizer), *masters,
                               *[master.grad for master in masters if master.grad is not None])
        with tracker:
            for _ in range(2):  # the second step meets the optimizer state the first made (fairseq's makes it lazily)
                optimizer.zero_grad()
                tracker.start_passes()
                _passes(model, criterion, chunks, optimizer, layout, training, stage, cfg)
                tracker.in_passes = False
                optimizer.step()
        held = _held(model, optimizer)
        return dict(held, activations=tracker.most_activations, peak=tracker.peak())


def _half(model) -> None:
    """``model.half()`` in place: ``nn.Module.half`` swaps each fake
    parameter for a new one, which torch refuses for tensors the fake mode
    holds weak references to."""
    import torch

    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(torch.float16)


def _fairseq_optimizer(cfg, params, training: Training, optim):
    """fairseq's optimizer for the flags, as the trainer builds it on a GPU
    (``MegatronTrainer._build_optimizer``): fairseq's Adam over fp32 weights
    (fp32 training, ``--bf16-autocast``, and ``--fp16``'s fp32 copy) runs as
    the fused AdamW (:mod:`fairseq_megatron.training.fused_adam`), which the
    trainer takes on CUDA only; fairseq's own would allocate the square root
    of the second moment of every weight at once in its step."""
    import torch
    from fairseq.optim.adam import Adam, FairseqAdam

    from fairseq_megatron.training.fused_adam import FairseqFusedAdam

    def fused(optimizer):
        if type(optimizer) is not FairseqAdam or type(optimizer._optimizer) is not Adam:
            return optimizer
        weights = [p for group in optimizer._optimizer.param_groups for p in group["params"]]
        return FairseqFusedAdam(optimizer) if all(p.dtype == torch.float32 for p in weights) else optimizer

    if training.fully_sharded or training.precision in ("fp32", "bf16-autocast"):
        return optim.build_optimizer(cfg.optimizer, params) if training.fully_sharded else \
            fused(optim.build_optimizer(cfg.optimizer, params))
    if training.precision == "memory-efficient-fp16":
        return optim.MemoryEfficientFP16Optimizer.build_optimizer(cfg, params)
    optimizer = optim.FP16Optimizer.build_optimizer(cfg, params)
    optimizer.fp32_optimizer = fused(optimizer.fp32_optimizer)
    return optimizer


def _torch_optimizers(optimizer) -> list:
    """The torch optimizers inside fairseq's wrappers (whose hooks the tracker uses)."""
    import torch

    found, todo = [], [optimizer]
    while todo:
        current = todo.pop()
        if isinstance(current, torch.optim.Optimizer):
            found.append(current)
            continue
        for name in ("_optimizer", "fp32_optimizer", "wrapped_optimizer", "optimizer"):
            inner = vars(current).get(name) if hasattr(current, "__dict__") else None
            if inner is not None and inner is not current:
                todo.append(inner)
                break
    return found


def _fp32_masters(optimizer) -> list:
    """fairseq's ``FP16Optimizer``'s fp32 copies of the weights (none for other optimizers)."""
    masters = getattr(optimizer, "fp32_params", None) or []
    return list(masters.values()) if isinstance(masters, dict) else list(masters)


def _held(model, optimizer) -> Dict[str, int]:
    """Bytes of the weights, gradients and optimizer state this rank holds
    (the local shards of sharded parameters; fairseq's fp32 copy of the
    weights counted with the optimizer state, its gradient with the
    gradients)."""
    import torch

    def size(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = list({id(p): p for p in model.parameters()}.values())
    weights = sum(size(p) for p in params)
    gradients = sum(size(p.grad) for p in params if p.grad is not None)
    state = 0
    for torch_optimizer in _torch_optimizers(optimizer):
        state += sum(size(v) for entries in torch_optimizer.state.values() for v in entries.values()
                     if torch.is_tensor(v) and v.dim() > 0)
    for master in _fp32_masters(optimizer):
        state += size(master)
        gradients += size(master.grad) if master.grad is not None else 0
    return {"weights": weights, "gradients": gradients, "optimizer": state}


def _passes(model, criterion, chunks, optimizer, layout: Layout, training: Training, stage: str, cfg) -> None:
    """This rank's forwards and backwards in its schedule's order (this module's docstring)."""
    import torch

    from fairseq_megatron.modules.padding import mark_padding

    model.train()
    b, s = training.micro_batch, cfg.task.tokens_per_sample
    vocab = model.decoder.embed_tokens.num_embeddings

    def batch():
        tokens, target = torch.randint(4, vocab, (b, s)), torch.randint(4, vocab, (b, s))
        mark_padding(tokens, model.decoder.padding_idx, False)
        return {"net_input": {"src_tokens": tokens, "src_lengths": torch.full((b,), s)}, "target": target,
                "ntokens": b * s, "nsentences": b, "id": torch.arange(b)}

    if layout.pp == 1:
        for _ in range(min(2, layout.grad_accumulation)):  # the second's activations meet the first's gradients
            optimizer.backward(criterion(model, batch())[0])
        return
    index = 0 if stage == "first" else layout.pp - 1
    in_flight = chunk_passes_in_flight(index, layout.pp, layout.vp, layout.grad_accumulation, layout.schedule)
    per_round = layout.grad_accumulation // max(1, layout.grad_accumulation // layout.pp)
    dtype = next(model.parameters()).dtype if training.precision in ("fp16", "memory-efficient-fp16") else \
        torch.float32
    hidden = (s // layout.cp, b, model.decoder.embed_dim)
    alive = []  # (output, chunk module, sample, input) of the forwards whose backward has not run

    def forward(step: int) -> None:
        chunk = chunks[(step // per_round) % len(chunks)]
        sample = batch()
        x = sample["net_input"]["src_tokens"] if chunk.chunk.is_first else \
            torch.empty(hidden, dtype=dtype, requires_grad=True)
        alive.append((chunk(x), chunk, sample, x))

    def backward() -> None:
        output, chunk, sample, x = alive.pop(0)
        if chunk.chunk.is_last:
            criterion.compute_loss(model, (output, None), sample)[0].float().backward()
        else:
            output.backward(torch.empty_like(output))
        x.grad = None  # sent to the previous stage

    forwards = min(layout.grad_accumulation * layout.vp, in_flight + 1)
    for step in range(in_flight - 1):
        forward(step)
    for step in range(in_flight - 1, forwards):  # the steady state: one forward, one backward
        forward(step)
        backward()
    while alive:
        backward()
    optimizer.backward(torch.zeros((), requires_grad=True))  # as the pipeline schedule tells fairseq's wrappers


def _activation_peak_tracker():
    """torch's ``MemTracker``, also keeping the most activation bytes alive
    at any time (what the forward made, ``ACT``, and the backward's
    temporaries, ``TEMP``: the gradients of activations, the recomputed
    layer), and following several forwards of a module before their
    backwards (a pipeline schedule's micro-batches in flight), which its
    module statistics refuse: a module's later forwards add no statistics,
    their tensors are tracked as any other."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class ActivationPeak(MemTracker):
        most_activations = 0
        in_passes = False  # activations are counted in the forwards and backwards, not the optimizer's step
        before = 0  # what was alive when the passes began (left by the step before)

        def _activations(self) -> int:
            return sum(snapshot.get(_MemRefType.ACT, 0) + snapshot.get(_MemRefType.TEMP, 0)
                       for snapshot in self._curr_mem_snap.values())

        def start_passes(self) -> None:
            self.in_passes, self.before = True, self._activations()

        def _pre_fw_hook(self, module, inputs) -> None:
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                return
            super()._pre_fw_hook(module, inputs)

        def _update_peak_stats(self, peak_state) -> None:
            # the tracker's own also updates every module's statistics at every operation: a time in
            # the number of modules that a 72-layer model makes minutes; only the totals are needed here
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot["Total"]:
                    self._peak_mem[device] = snapshot["Total"]
                    self._peak_mem_snap[device] = dict(snapshot)
            if self.in_passes:
                self.most_activations = max(self.most_activations, self._activations() - self.before)

        def peak(self) -> int:
            return max((snapshot["Total"] for snapshot in self.get_tracker_snapshot("peak").values()), default=0)

    return ActivationPeak()
