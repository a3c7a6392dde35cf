"""fairseq's training and validation steps for one pipeline stage, run by
torch's pipeline schedules (``torch.distributed.pipelining``).

fairseq's trainer accumulates an update's ``--update-freq`` samples one
after another: each goes forward and backward through the whole model. In a
pipeline each rank holds one stage (:mod:`fairseq_megatron.models.pipeline_stage`),
and the update's samples are its micro-batches: PipeDream-Flush's 1F1B
schedule (Narayanan et al. 2021, section 2.2.1) keeps at most ``P``
micro-batches in flight per stage, runs one forward and one backward in
turn once the pipeline is full, and flushes at the end of the update; the
interleaved and zero-bubble schedules of ``--pipeline-schedule``
(:mod:`fairseq_megatron.training.pipeline_schedules`) run model chunks and
split backwards. The schedules are torch's own (``Schedule1F1B``,
``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``,
``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``); this module adapts
fairseq's batches and bookkeeping to them:

- :func:`stack_micro_batches`: the update's samples become one batch of
  ``m`` micro-batches of one shape ``(B, T)``, which the schedule splits
  along the batch dimension. The stages' receive buffers have that shape,
  so samples of fewer rows or positions (an epoch's last batch, the last
  group of an epoch that has fewer than ``m`` samples, an empty sample
  where a data-parallel rank ran out of data) are padded with rows whose
  targets are all padding: their loss and gradient are zero and they add
  nothing to the sample size.
- :meth:`PipelineSchedule.train_step` / :meth:`~PipelineSchedule.valid_step`
  take the place of the task's (``fairseq/tasks/fairseq_task.py``) for the
  trainer: the last stage computes each micro-batch's summed loss with the
  criterion, torch's schedule runs the backward (gradients summed over
  micro-batches: ``scale_grads=False``, since fairseq divides by the
  sample size itself), and the loss is sent from the last stage to the
  others, so that every rank logs the same numbers. Validation runs the
  schedule's forward-only path on batches padded the same way.
- Tied embeddings (``--share-decoder-input-output-embed``): the gradients of
  the first stage's embedding and of the last stage's copy are summed over
  the embedding group after each backward, so the two copies take the same
  update (Megatron-LM ``_allreduce_word_embedding_grads``); where stage 0
  holds both ends (the V placement) the one tensor takes both gradients.

With ``--fp16`` fairseq's optimizer scales the loss in its ``backward``;
here the loss function scales each micro-batch's loss by the optimizer's
scaler, and ``optimizer.backward`` is then called on a zero leaf so that
fairseq's fp16 wrappers record that gradients are new.
"""

import contextlib
import functools
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from fairseq import utils

from fairseq_megatron.errors import UsageError
from fairseq_megatron.models.pipeline_stage import V_SHAPE, Chunk, PipelineStageLayout
from fairseq_megatron.training.pipeline_schedules import SCHEDULES, Schedule
from fairseq_megatron.parallel import parallel_state

def _rows(sample) -> int:
    if not sample or "net_input" not in sample:
        return 0
    return sample["net_input"]["src_tokens"].size(0)


def stack_micro_batches(samples: List[Optional[dict]], micro_batches: int, rows: int, length: int,
                        pad: int) -> dict:
    """fairseq language-modeling samples (``src_tokens`` and ``target`` of
    ``(b, t)`` with ``b <= rows``, ``t <= length``; None or ``{}`` for none)
    -> one sample of ``micro_batches x rows`` rows of ``length`` positions,
    micro-batch ``i`` being ``samples[i]`` padded (padded tokens and targets
    are ``pad``); ``ntokens`` and ``nsentences`` count the real rows only.
    CPU tensors.

    Raises:
        UsageError: more samples than ``micro_batches``, a sample of more
            than ``rows`` rows or ``length`` positions.
    """
    real = [s for s in samples if _rows(s)]
    if len(samples) > micro_batches:
        raise UsageError(f"{len(samples)} samples for an update of {micro_batches} micro-batches")
    tokens = torch.full((micro_batches * rows, length), pad, dtype=torch.long)
    target = torch.full((micro_batches * rows, length), pad, dtype=torch.long)
    ntokens = nsentences = 0
    for i, sample in enumerate(samples):
        b = _rows(sample)
        if not b:
            continue
        src, tgt = sample["net_input"]["src_tokens"], sample["target"]
        if b > rows or src.size(1) > length:
            raise UsageError(f"a batch of {b} x {src.size(1)} tokens does not fit the pipeline's micro-batch of "
                             f"{rows} x {length} (--batch-size or --max-tokens, and --tokens-per-sample, set it)")
        tokens[i * rows: i * rows + b, : src.size(1)] = src
        target[i * rows: i * rows + b, : tgt.size(1)] = tgt
        ntokens += int(sample["ntokens"])
        nsentences += b
    return {
        "id": torch.cat([torch.as_tensor(s["id"]).reshape(-1) for s in real]) if real else
        torch.zeros(0, dtype=torch.long),
        "nsentences": nsentences,
        "ntokens": ntokens,
        "net_input": {"src_tokens": tokens, "src_lengths": tokens.ne(pad).sum(1)},
        "target": target,
    }


class ChunkModule(nn.Module):
    """What torch's ``PipelineStage`` calls: one model chunk (a virtual
    stage; the whole stage without interleaving) of a training or validation
    pass through ``decoder`` (split for this stage,
    :mod:`fairseq_megatron.training.pipeline_split`). It holds the chunk's
    modules, and nothing of the other chunks: its layers, the embeddings on
    the first chunk, the final layer norm and the output projection (with
    the embedding it is tied to) on the last. Each is a root unit of sharded
    data parallelism."""

    def __init__(self, decoder, chunk: Chunk):
        super().__init__()
        self.chunk = chunk
        self._decoder = (decoder,)  # its methods; a tuple, so that it is no submodule
        self.layers = nn.ModuleList([decoder.layers[str(i)] if isinstance(decoder.layers, nn.ModuleDict)
                                     else decoder.layers[i] for i in chunk.layers])
        if chunk.is_first:
            self.embed_tokens, self.embed_positions = decoder.embed_tokens, decoder.embed_positions
            self.layernorm_embedding = decoder.layernorm_embedding
        if chunk.is_last:
            self.layer_norm, self.output_projection = decoder.layer_norm, decoder.output_projection
            if decoder.share_input_output_embed:
                self.embed_tokens = decoder.embed_tokens

    def forward(self, x):
        """The first chunk takes tokens ``(B, T)``, the others the previous
        chunk's output ``(T, B, C)``; the last returns this tensor rank's
        logits ``(B, T, V / N)``, the others ``(T, B, C)``. No key padding
        mask: the micro-batches are full blocks, padded only at their ends
        (fairseq's right padding), and the causal mask already keeps every
        real position from attending to them; their targets are padding,
        which the loss ignores."""
        decoder = self._decoder[0]
        if self.chunk.is_first:
            x, _ = decoder.embed(x)
        x, _ = decoder.run_layers(x, decoder.buffered_future_mask(x), None, layers=list(self.layers))
        if self.chunk.is_last:
            return decoder.output_layer(decoder.final_layer_norm(x), gather_logits=False)
        return x.contiguous()  # sent to the next chunk as it is laid out


@functools.lru_cache(maxsize=None)
def _evaluable_stage_class():
    """torch's ``PipelineStage``, except that without a backward (``eval``)
    it takes no input gradient from the next chunk on its own rank and hands
    none on: torch's V-shaped schedules (``ScheduleZBVZeroBubble``,
    ``ScheduleDualPipeV``) still pass them between a rank's two chunks in
    ``eval``, which torch's stage refuses ("can't steal_bwd_input if this
    stage doesn't have backward"; ``torch/distributed/pipelining/schedules.py``,
    ``_PipelineScheduleRuntime``)."""
    from torch.distributed.pipelining import PipelineStage

    class EvaluablePipelineStage(PipelineStage):
        def get_local_bwd_output(self, mb_index):
            return super().get_local_bwd_output(mb_index) if self.has_backward else ()

        def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index):
            if self.has_backward:
                super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    return EvaluablePipelineStage


class PipelineSchedule:
    """One pipeline stage of a ``model_parallel_transformer_lm`` and torch's
    schedule over it, with fairseq's ``train_step``/``valid_step``
    (see the module docstring).

    ``model``: this rank's stage (unwrapped; split for ``stage``);
    ``chunk_modules``: the :class:`ChunkModule` of each of its model chunks,
    as :func:`~fairseq_megatron.training.parallelize.parallelize` made them;
    ``micro_batches``: ``m``, the update's ``--update-freq``; ``rows`` x
    ``length``: the micro-batch shape ``(B, T)``; ``pad``: the padding
    index; ``schedule``: the ``--pipeline-schedule``'s (by default 1F1B,
    or with model chunks, ``stage.virtual`` > 1, torch's
    ``ScheduleInterleaved1F1B``: Narayanan et al. 2021, section 2.2.2). The
    options it needs (micro-batches enough for the schedule, full blocks)
    are checked before it is built
    (:func:`~fairseq_megatron.training.options.check_pipeline_options`).
    """

    def __init__(self, model, stage: PipelineStageLayout, chunk_modules, micro_batches: int, rows: int, length: int,
                 pad: int, schedule: Optional[Schedule] = None):
        self.model = model
        self.stage = stage
        self.chunk_modules = list(chunk_modules)  # what torch's PipelineStage runs, one per model chunk
        self.micro_batches, self.rows, self.length, self.pad = micro_batches, rows, length, pad
        self.schedule = schedule or SCHEDULES["interleaved-1f1b" if stage.virtual > 1 else "1f1b"]
        self.group = parallel_state.get_pipeline_model_parallel_group()
        self.last_rank = parallel_state.get_pipeline_model_parallel_ranks()[stage.last_stage]
        self._schedule = None
        self._loss_fn = None  # what the schedule's loss function calls, set per step

    def micro_batches_of(self, samples: List[Optional[dict]]) -> dict:
        """The update's samples as one batch of :attr:`micro_batches` (:func:`stack_micro_batches`)."""
        return stack_micro_batches(samples, self.micro_batches, self.rows, self.length, self.pad)

    def _built(self, device: torch.device):
        """torch's schedule class of :attr:`schedule` over this stage's
        chunks, made at the first step (its module is imported here: its
        import is slow, and every process of every fairseq tool would
        otherwise pay for it)."""
        from torch.distributed import pipelining

        if self._schedule is None:
            virtual_stages = self.stage.stages * self.stage.virtual
            stage_class = _evaluable_stage_class() if self.schedule.placement == V_SHAPE else pipelining.PipelineStage
            stages = [stage_class(module, module.chunk.index, virtual_stages, device, group=self.group)
                      for module in self.chunk_modules]
            loss_fn = lambda out, tgt: self._loss_fn(out, tgt)  # noqa: E731 (set per step)
            schedule_class = getattr(pipelining.schedules, self.schedule.torch_class)
            self._schedule = schedule_class(stages[0] if self.schedule.name == "1f1b" else stages,
                                            self.micro_batches, loss_fn=loss_fn, scale_grads=False)
        return self._schedule

    def _run(self, sample: dict, criterion, scale, train: bool) -> torch.Tensor:
        """Run the schedule over ``sample`` (``m x B`` rows); the summed loss
        of its micro-batches, on every stage (0-dim fp32)."""
        tokens, target = sample["net_input"]["src_tokens"], sample["target"]
        unscaled = {}  # id of the loss returned to the schedule -> the criterion's loss

        def loss(output, target):
            value = criterion.compute_loss(self.model, (output, None), {"target": target})[0].float()
            returned = scale(value)
            unscaled[id(returned)] = value.detach()
            return returned

        self._loss_fn = loss
        schedule = self._built(tokens.device)
        args = (tokens,) if self.stage.is_first else ()
        target = target if self.stage.is_last else None
        losses = []  # the micro-batches' losses (the schedule also calls the loss function to infer shapes)
        if train:
            schedule.step(*args, target=target, losses=losses, return_outputs=False)
        else:
            schedule.eval(*args, target=target, losses=losses)
        total = torch.stack([unscaled[id(value)] for value in losses]).sum() if losses else \
            torch.zeros((), device=tokens.device)
        if self.stage.stages > 1:
            dist.broadcast(total, src=self.last_rank, group=self.group)
        return total

    def _logging_output(self, loss: torch.Tensor, sample: dict, criterion):
        sample_size = sample["nsentences"] if getattr(criterion, "sentence_avg", False) else sample["ntokens"]
        return loss, sample_size, {"loss": loss.data, "ntokens": sample["ntokens"],
                                   "nsentences": sample["nsentences"], "sample_size": sample_size}

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False, **kwargs):
        """fairseq's ``FairseqTask.train_step`` for the update's stacked
        micro-batches: forward and backward through the schedule (on this
        schedule's stage; ``model`` is the trainer's, possibly wrapped for
        data parallelism, which all-reduces the gradients afterwards). Returns
        ``(loss, sample_size, logging_output)``, the same on every stage."""
        self.model.train()
        self.model.set_num_updates(update_num)
        scaler = getattr(optimizer, "scaler", None)

        def scale(loss):
            if ignore_grad:
                loss = loss * 0.0
            return scaler.scale(loss) if scaler is not None else loss

        loss = self._run(sample, criterion, scale, train=True)
        self._sum_embedding_grads()
        optimizer.backward(torch.zeros((), requires_grad=True))  # the backward ran; fp16 wrappers take note
        return self._logging_output(loss, sample, criterion)

    def valid_step(self, sample, model, criterion):
        """fairseq's ``FairseqTask.valid_step``: the forward-only schedule
        over ``sample`` cut into batches of ``m x B`` rows (each padded)."""
        self.model.eval()
        capacity = self.micro_batches * self.rows
        tokens, target = sample["net_input"]["src_tokens"], sample["target"]
        ids = torch.as_tensor(sample["id"]).reshape(-1)  # fairseq's dummy_lm gives one id for the batch
        total = None
        with torch.no_grad():
            for start in range(0, max(tokens.size(0), 1), capacity):
                pieces = [{"id": ids[i: i + self.rows],
                           "ntokens": int(target[i: i + self.rows].ne(self.pad).sum()),
                           "net_input": {"src_tokens": tokens[i: i + self.rows].cpu()},
                           "target": target[i: i + self.rows].cpu()}
                          for i in range(start, min(start + capacity, tokens.size(0)), self.rows)]
                batch = utils.apply_to_sample(lambda t: t.to(tokens.device), self.micro_batches_of(pieces))
                loss = self._run(batch, criterion, lambda value: value, train=False)
                total = loss if total is None else total + loss
        stats = {"ntokens": int(sample["ntokens"]), "nsentences": tokens.size(0)}
        return self._logging_output(total, stats, criterion)

    @contextlib.contextmanager
    def steps_of(self, task):
        """Within this context ``task.train_step`` and ``task.valid_step``
        are this schedule's (fairseq's ``Trainer.train_step`` and
        ``valid_step`` call them for each sample); a validation sample that
        is empty goes to the task's own."""
        def valid_step(sample, model, criterion, **kwargs):
            if not sample:
                return type(task).valid_step(task, sample, model, criterion, **kwargs)
            return self.valid_step(sample, model, criterion)

        task.train_step, task.valid_step = self.train_step, valid_step
        try:
            yield
        finally:
            del task.train_step, task.valid_step

    def _sum_embedding_grads(self) -> None:
        """Sum the gradients of the tied embedding's two copies (first and
        last stage: the parameters tagged ``shared_embedding``) over the
        embedding group; nothing where one stage holds both ends."""
        if not self.stage.tied_copies:
            return
        for weight in self.model.parameters():
            if getattr(weight, "shared_embedding", False):
                self._sum_over_embedding_group(weight)

    @staticmethod
    def _sum_over_embedding_group(weight) -> None:
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        grad = weight.grad
        # sharded over data-parallel ranks (a DTensor): both stages hold the same shard of it
        dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad,
                        group=parallel_state.get_embedding_group())

