"""One copy of a model for scoring and greedy generation, over this rank's
tensor-parallel and pipeline groups.

:func:`load` gives each rank of a model copy its share of a checkpoint saved
at any layout (its tensor part of its pipeline stage, read or resharded in
memory: :func:`~fairseq_megatron.checkpoint.loading.part_for_evaluation`);
no rank holds the whole model when the run has pipeline stages. A
:class:`ModelCopy` runs a batch through the stages as a pipeline does (the
first stage embeds the tokens and sends its output to the next; the last
computes the logits, gathered over the tensor-parallel group) and returns,
on every rank of the copy, what a caller scores with: the log-probability of
given targets, whether each is the greedy choice, or the greedy next token.
Only those small results travel back from the last stage, never the logits.

Every rank of a copy must make the same calls with the same tokens; the
copies of a data-parallel run are independent. Mirrors the evaluation half of
Megatron-LM's ``text_generation`` (``forward_step``: one pass through the
pipeline stages with point-to-point sends).
"""

import os
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from fairseq_megatron.errors import UsageError
from fairseq_megatron.parallel import parallel_state


class ModelCopy:
    """This rank's stage ``model`` (one tensor part of it) of a model copy of
    ``stages`` pipeline stages; ``dictionary``: the model's (padded)."""

    def __init__(self, model, dictionary, stage):
        self.model, self.dictionary, self.stage = model, dictionary, stage
        self.decoder = model.decoder
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.ranks = parallel_state.get_pipeline_model_parallel_ranks()  # global ranks, stage order
        self.pipeline_group = parallel_state.get_pipeline_model_parallel_group()
        self.max_positions = int(self.decoder.max_positions())

    @property
    def stages(self) -> int:
        return self.stage.stages

    def _last_stage_logits(self, tokens: torch.Tensor, incremental_state=None) -> Optional[torch.Tensor]:
        """``tokens`` ``(B, T)`` through every stage: the logits ``(B, T', V)``
        on the last stage (``T' = 1`` with an ``incremental_state``, the last
        position), None on the others."""
        decoder, stage = self.decoder, self.stage
        if stage.is_first:
            x, padding_mask = decoder.embed(tokens, incremental_state)
        else:
            length = 1 if incremental_state is not None else tokens.size(1)
            x = torch.empty(length, tokens.size(0), decoder.embed_dim, device=self.device, dtype=self.dtype)
            dist.recv(x, src=self.ranks[stage.stage - 1])
            padding_mask = tokens.eq(decoder.padding_idx) if incremental_state is None else None
            if padding_mask is not None and not padding_mask.any():
                padding_mask = None
        mask = decoder.buffered_future_mask(x) if incremental_state is None else None
        x, _ = decoder.run_layers(x, mask, padding_mask, incremental_state)
        if not stage.is_last:
            dist.send(x.contiguous(), dst=self.ranks[stage.stage + 1])
            return None
        return decoder.output_layer(decoder.final_layer_norm(x))

    def _from_the_last_stage(self, result: Optional[torch.Tensor], shape, dtype) -> torch.Tensor:
        """``result`` of the last stage, on every stage (a broadcast over the pipeline group)."""
        if self.stages == 1:
            return result
        if result is None:
            result = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(result, src=self.ranks[-1], group=self.pipeline_group)
        return result

    @torch.no_grad()
    def score(self, tokens: torch.Tensor, targets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """For ``tokens`` ``(B, T)`` (right-padded) and the ``targets``
        ``(B, T)`` each position predicts: the log-probability of each target
        (log-softmax over the whole output in fp32, as fp64 ``(B, T)``, nats) and whether
        it is the greedy choice (bool ``(B, T)``), on every rank of the copy."""
        logits = self._last_stage_logits(tokens.to(self.device))
        scores = None
        if logits is not None:
            log_probs = torch.log_softmax(logits.float(), dim=-1)
            targets = targets.to(self.device)
            picked = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            greedy = logits.argmax(dim=-1).eq(targets)
            scores = torch.stack([picked.double(), greedy.double()])
        scores = self._from_the_last_stage(scores, (2, *tokens.shape), torch.float64)
        return scores[0].cpu(), scores[1].bool().cpu()

    @torch.no_grad()
    def greedy_next(self, tokens: torch.Tensor, incremental_state: dict) -> torch.Tensor:
        """The greedy next token ``(B,)`` after ``tokens`` ``(B, T)`` (no
        padding), on every rank of the copy. ``incremental_state``: one dict
        per sequence being generated, empty at its first step (each stage
        keeps its layers' keys and values in it)."""
        logits = self._last_stage_logits(tokens.to(self.device), incremental_state)
        chosen = None if logits is None else logits[:, -1].argmax(dim=-1)
        return self._from_the_last_stage(chosen, (tokens.size(0),), torch.long).cpu()


def load(path: str, data: Optional[str] = None, dtype: Optional[torch.dtype] = None,
         device: Optional[str] = None) -> ModelCopy:
    """This rank's share of checkpoint ``path`` (fairseq's ``--path``
    convention; any layout it was saved in) at this run's layout
    (:mod:`~fairseq_megatron.parallel.parallel_state`: tensor and pipeline
    sizes), with ``dict.txt`` from ``data`` (default: the checkpoint's
    directory), in eval mode, cast to ``dtype`` (default: as built, fp32),
    on ``device`` (default, and for ``"cuda"`` and ``"cuda:0"``, lm-eval's
    default on every rank: this rank's GPU where there is one, else CPU).

    Raises:
        FileNotFoundError: no checkpoint, or no ``dict.txt``.
        UsageError / CheckpointError: what the checkpoint loaders refuse
            (parts missing or cut short, a size that does not divide the
            model, a dictionary not the checkpoint's).
    """
    from fairseq import tasks

    from fairseq_megatron.checkpoint.loading import part_for_evaluation
    from fairseq_megatron.models.model_parallel_transformer_lm import is_our_model
    from fairseq_megatron.models.pipeline_stage import PipelineStageLayout
    from fairseq_megatron.training.pipeline_split import split_for_stage

    data = data or os.path.dirname(os.path.abspath(path))
    if not os.path.isfile(os.path.join(data, "dict.txt")):
        raise FileNotFoundError(f"{os.path.join(data, 'dict.txt')}: no such file (the dictionary of the model; "
                                f"give the directory that holds it as data)")
    _, state = part_for_evaluation(path)
    cfg = state["cfg"]
    cfg.task.data = data
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    model_cfg = cfg.model
    for name in ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size"):
        if getattr(model_cfg, name, None) not in (None, 1):
            setattr(model_cfg, name, 1)  # built whole, then split for this rank's stage
    task = tasks.setup_task(cfg.task)
    model = task.build_model(model_cfg, from_checkpoint=True)
    if not is_our_model(model):
        raise UsageError(f"{path} is not a checkpoint of fairseq_megatron's language models")
    stage = PipelineStageLayout(parallel_state.get_pipeline_model_parallel_rank(), stages,
                                int(model_cfg.decoder_layers), bool(model.decoder.share_input_output_embed))
    split_for_stage(model, stage)
    model.materialize()
    model.load_state_dict(state["model"], strict=True, model_cfg=model_cfg)
    del state
    if device is None or str(device).startswith("cuda") and not torch.cuda.is_available():
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device in ("cuda", "cuda:0"):  # this rank's GPU (lm-eval's default is cuda:0 on every rank)
        device = f"cuda:{torch.cuda.current_device()}"
    model.to(device=device, dtype=dtype)
    model.eval()
    return ModelCopy(model, task.source_dictionary, stage)
