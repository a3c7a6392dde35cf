"""An lm-evaluation-harness backend for our checkpoints at any layout: ``fairseq_megatron``.

    torchrun --nproc_per_node 4 $(which fairseq-megatron-lm-eval) --tasks lambada_openai --batch_size 8 \\
        --model_args path=ckpt/checkpoint_best.pt,encoder_json=encoder.json,vocab_bpe=vocab.bpe,model_parallel_size=2

:class:`FairseqMegatronLM` is lm-eval's ``TemplateLM`` (``lm_eval/api/model.py``):
contexts and continuations are split and encoded as its ``hf`` backend does
(``lm_eval/models/huggingface.py``), with the GPT-2 BPE and the checkpoint's
``dict.txt`` (:func:`~fairseq_megatron.checkpoint.hf_tokenizer.fairseq_gpt2_tokenizer`:
the ids fairseq-preprocess writes), and fairseq's ``</s>`` as the prefix of
an empty context and of the first rolling window, as our models read text.
Inputs longer than the model's positions lose their left end, as the ``hf``
backend's do; ``loglikelihood_rolling`` uses lm-eval's rolling windows of
``max_length`` tokens. ``generate_until`` is greedy, and starts each prompt
after ``</s>`` as fairseq-generate does.

Parallelism: the launch's world is ``T x P x D`` ranks
(``model_parallel_size`` T, ``pipeline_model_parallel_size`` P; context
parallelism is refused). The backend's ``rank`` and ``world_size`` are the
data-parallel rank and size: the ranks of one model copy receive the same
requests and return the same results, its stages passing activations as a
pipeline does (:mod:`fairseq_megatron.model_copy`), and ``all_gather``,
``gather_object`` and ``barrier`` run over the data-parallel group. lm-eval
writes its results where ``rank`` and ``LOCAL_RANK`` are 0: the other ranks
of the first model copy are given a ``LOCAL_RANK`` of their own, so one
process writes.
"""

import os
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from fairseq_megatron.errors import UsageError
from fairseq_megatron.parallel import parallel_state

NAME = "fairseq_megatron"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ARGUMENTS = ("path", "data", "encoder_json", "vocab_bpe", "dtype", "max_length", "model_parallel_size",
             "pipeline_model_parallel_size", "context_parallel_size")


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"model argument {name}={value}: a whole number of at least 1")
    return value


@register_model(NAME)
class FairseqMegatronLM(TemplateLM):
    """lm-eval's model ``fairseq_megatron``: checkpoint ``path`` (fairseq's
    ``--path``; any layout it was saved in) with ``dict.txt`` from ``data``
    (default: the checkpoint's directory), GPT-2's ``encoder_json`` and
    ``vocab_bpe``, weights in ``dtype``, contexts of at most ``max_length``
    tokens (default: the model's positions), run at ``model_parallel_size``
    x ``pipeline_model_parallel_size`` per model copy; ``batch_size``
    sequences per forward pass (results do not depend on it).

    Raises:
        UsageError / FileNotFoundError / CheckpointError: an unknown model
            argument, a missing checkpoint or BPE file, a size that does not
            divide the model or the world, context parallelism; before the
            model is loaded where the arguments alone tell.
    """

    def __init__(self, path: Optional[str] = None, data: Optional[str] = None, encoder_json: Optional[str] = None,
                 vocab_bpe: Optional[str] = None, dtype: str = "float32", max_length: Optional[int] = None,
                 model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1, context_parallel_size: int = 1,
                 batch_size=1, max_batch_size=None, device: Optional[str] = None, **unknown):
        super().__init__()
        from fairseq.data import Dictionary

        from fairseq_megatron import hub, model_copy
        from fairseq_megatron.checkpoint.hf_tokenizer import fairseq_gpt2_tokenizer

        tensor, stages, data = self.check_arguments(path, data, encoder_json, vocab_bpe, dtype,
                                                    model_parallel_size, pipeline_model_parallel_size,
                                                    context_parallel_size, batch_size, **unknown)
        self.batch_size = int(batch_size)
        dictionary = os.path.join(data, "dict.txt")
        self.tokenizer = fairseq_gpt2_tokenizer(
            encoder_json, vocab_bpe, Dictionary.load(dictionary), name=f"the dictionary {dictionary}",
            advice="give model argument data=DIR, the directory of the dict.txt the model was trained with "
                   "(default: the checkpoint's), and the GPT-2 BPE files of that dictionary")
        hub.init_distributed_from_env()
        parallel_state.initialize_model_parallel(tensor, stages)
        self.model = model_copy.load(path, data, DTYPES[dtype], device)
        self.max_length = _positive("max_length", max_length) if max_length is not None else self.model.max_positions
        self._device = self.model.device
        if dist.is_initialized():
            self._rank = parallel_state.get_data_parallel_rank()
            self._world_size = parallel_state.get_data_parallel_world_size()
            if self._rank == 0 and dist.get_rank() != 0:  # one writer of lm-eval's results: global rank 0
                os.environ["LOCAL_RANK"] = str(dist.get_rank())

    @staticmethod
    def check_arguments(path: Optional[str] = None, data: Optional[str] = None, encoder_json: Optional[str] = None,
                        vocab_bpe: Optional[str] = None, dtype: str = "float32", model_parallel_size: int = 1,
                        pipeline_model_parallel_size: int = 1, context_parallel_size: int = 1, batch_size=1,
                        max_batch_size=None, device: Optional[str] = None, max_length=None, **unknown):
        """What the model arguments alone tell (the constructor's, and
        ``fairseq-megatron-lm-eval``'s before lm-eval loads its tasks):
        (tensor-parallel size, pipeline stages, the dictionary's directory).

        Raises:
            UsageError / FileNotFoundError: as the constructor.
        """
        from fairseq_megatron.checkpoint.part_files import find_part_files

        if unknown:
            raise UsageError(f"unknown model argument {sorted(unknown)[0]}: {NAME} takes {', '.join(ARGUMENTS)}")
        if path is None or encoder_json is None or vocab_bpe is None:
            missing = [n for n, v in (("path", path), ("encoder_json", encoder_json), ("vocab_bpe", vocab_bpe))
                       if v is None]
            raise UsageError(f"model argument {missing[0]}=... is needed (path: the checkpoint; encoder_json, "
                             f"vocab_bpe: GPT-2's BPE files)")
        if dtype not in DTYPES:
            raise UsageError(f"model argument dtype={dtype}: one of {', '.join(DTYPES)}")
        if _positive("context_parallel_size", context_parallel_size) > 1:
            raise UsageError(f"model argument context_parallel_size={context_parallel_size}: evaluation runs at "
                             f"context-parallel size 1 (use the ranks for tensor, pipeline or data parallelism)")
        try:
            _positive("batch_size", int(batch_size))
        except ValueError:
            raise UsageError(f"--batch_size {batch_size}: a whole number of at least 1 ({NAME} sets no batch "
                             f"size automatically)") from None
        tensor = _positive("model_parallel_size", model_parallel_size)
        stages = _positive("pipeline_model_parallel_size", pipeline_model_parallel_size)
        find_part_files(path)  # FileNotFoundError naming the files looked for
        data = data or os.path.dirname(os.path.abspath(path))
        for name, file in (("encoder_json", encoder_json), ("vocab_bpe", vocab_bpe),
                           ("data", os.path.join(data, "dict.txt"))):
            if not os.path.isfile(file):
                raise FileNotFoundError(f"model argument {name}: {file}: no such file")
        return tensor, stages, data

    # ------------------------------------------------------------ data parallelism

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` of every data-parallel rank, concatenated (0-dim: stacked)."""
        group = parallel_state.get_data_parallel_group()
        found = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(found, tensor.contiguous(), group=group)
        return torch.stack(found) if tensor.dim() == 0 else torch.cat(found)

    def gather_object(self, obj, dst: int = 0):
        """``obj`` of every data-parallel rank, as a list on data-parallel rank ``dst``, None elsewhere."""
        group = parallel_state.get_data_parallel_group()
        found = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, found, dst=dist.get_global_rank(group, dst), group=group)
        return found

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    # ------------------------------------------------------------ tokens

    @property
    def eot_token_id(self) -> int:
        return self.model.dictionary.eos()  # fairseq's </s>

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> List[int]:
        """Our dictionary's ids of ``string``, as eval-lm's inputs (nothing prepended)."""
        return self.tokenizer(string, add_special_tokens=False)["input_ids"]

    def tok_decode(self, tokens: List[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # ------------------------------------------------------------ scoring

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> List[Tuple[float, bool]]:
        """``(log-likelihood, is greedy)`` of each continuation, in batches of
        ``batch_size``, longest first; each input is the last ``max_length``
        tokens of context + continuation (the ``hf`` backend's truncation)."""
        order = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        results = []
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="Running loglikelihood requests")
        for chunk in order.get_batched(n=self.batch_size):
            windows = [(context + continuation)[-(self.max_length + 1):] for _, context, continuation in chunk]
            width = max(len(w) for w in windows) - 1
            pad = self.model.dictionary.pad()
            tokens = torch.tensor([w[:-1] + [pad] * (width - len(w) + 1) for w in windows])
            targets = torch.tensor([w[1:] + [pad] * (width - len(w) + 1) for w in windows])
            log_probs, greedy = self.model.score(tokens, targets)
            for row, ((request, _, continuation), window) in enumerate(zip(chunk, windows)):
                positions = slice(len(window) - 1 - len(continuation), len(window) - 1)
                answer = (float(log_probs[row, positions].sum()), bool(greedy[row, positions].all()))
                results.append(answer)
                if request is not None:
                    self.cache_hook.add_partial("loglikelihood", request, answer)
                bar.update(1)
        bar.close()
        return order.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        """Each string's log-likelihood over lm-eval's rolling windows of
        ``max_length`` tokens, the first after ``</s>``."""
        windows, counts = [], []
        for (string,) in tqdm([r.args for r in requests], disable=disable_tqdm or self.rank != 0):
            mine = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            windows += [(None, context, continuation) for context, continuation in mine]
            counts.append(len(mine))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=True)
        out, start = [], 0
        for request, count in zip(requests, counts):
            total = sum(score for score, _ in scores[start: start + count])
            start += count
            self.cache_hook.add_partial("loglikelihood_rolling", (request.args[0],), total)
            out.append(total)
        return out

    # ------------------------------------------------------------ generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        """Greedy continuations, each cut at the first stop string of its
        request (``until``; fairseq's ``</s>`` ends one too), of at most
        ``max_gen_toks`` tokens; the prompt is the last ``max_length -
        max_gen_toks`` tokens of ``</s>`` + context. Prompts of one length
        are generated together, ``batch_size`` at a time.

        Raises:
            UsageError: sampling asked for (``do_sample``, a temperature above 0).
        """
        order = Collator([r.args for r in requests], sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
                         group_by="gen_kwargs", group_fn=lambda r: r[1])
        results = []
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="Running generate_until requests")
        for chunk in order.get_batched(n=self.batch_size):
            kwargs = normalize_gen_kwargs(chunk[0][1], 256)
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
                raise UsageError(f"{NAME} generates greedily; this task asks for sampling "
                                 f"(do_sample={kwargs.get('do_sample')}, temperature={kwargs.get('temperature')})")
            until, most = handle_stop_sequences(kwargs.get("until"), eos=None), int(kwargs["max_gen_toks"])
            if most >= self.max_length:
                raise UsageError(f"max_gen_toks {most} leaves no room for a prompt in max_length {self.max_length}")
            prompts = [([self.eot_token_id] + self.tok_encode(context))[-(self.max_length - most):]
                       for context, _ in chunk]
            for group in _same_lengths(prompts):  # runs of the chunk, in its order
                results += self._greedy([prompts[i] for i in group], until, most)
            bar.update(len(chunk))
        bar.close()
        return order.get_original(results)

    def _greedy(self, prompts: List[List[int]], until: List[str], most: int) -> List[str]:
        """Greedy continuations of ``prompts`` (one length), decoded, cut at a stop string."""
        tokens = torch.tensor(prompts)
        state: dict = {}
        for i in range(1, tokens.size(1)):  # fairseq's incremental decoding reads one token per step
            self.model.greedy_next(tokens[:, :i], state)
        generated = [[] for _ in prompts]
        done = [False] * len(prompts)
        for _ in range(min(most, self.model.max_positions - tokens.size(1))):
            chosen = self.model.greedy_next(tokens, state)
            tokens = torch.cat([tokens, chosen.unsqueeze(1)], dim=1)
            for row, token in enumerate(chosen.tolist()):
                if done[row]:
                    continue
                if token == self.eot_token_id:
                    done[row] = True
                    continue
                generated[row].append(token)
                done[row] = any(stop and stop in self.tok_decode(generated[row]) for stop in until)
            if all(done):
                break
        out = []
        for ids in generated:
            text = self.tok_decode(ids)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            out.append(text)
        return out


def _same_lengths(prompts: List[List[int]]) -> List[List[int]]:
    """The indices of ``prompts``, in runs of equal length (they arrive longest first)."""
    groups: List[List[int]] = []
    for i, prompt in enumerate(prompts):
        if groups and len(prompts[groups[-1][0]]) == len(prompt):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups

