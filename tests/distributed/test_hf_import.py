"""Models imported from transformers (``fairseq-megatron-reshard --from-hf``)
compute transformers' log-probabilities at every layout: GPT-2 (tied, with
its logits far below 0, and untied), OPT and XGLM with a GPT-2 vocabulary,
imported at size 1, T4 and T2 x P2 and run at that layout,
each rank loading only its own part file (its stage's layers, its share of
the vocabulary), the stages passing activations as a pipeline does.

Tolerance: 1e-5 (max abs) on log-softmax over the whole output, fp32
forward passes on both sides: the tensor-parallel ranks sum partial
products in another order than one device (a few fp32 ulps of logits of
magnitude ~20).
"""

import copy
import os

import pytest
import torch
import torch.distributed as dist
from fairseq.data import Dictionary

from fairseq_megatron.checkpoint import safe_loading
from fairseq_megatron.checkpoint.hf_import import import_from_transformers
from fairseq_megatron.checkpoint.names import part_path, stage_path
from fairseq_megatron.models.model_parallel_transformer_lm import ModelParallelTransformerLanguageModel
from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.parallel.mappings import gather_from_tensor_model_parallel_region
from fairseq_megatron.training.pipeline_split import split_for_stage
from fairseq_megatron.training.pipeline_schedule import ChunkModule
from fairseq_megatron.training.pipeline_schedules import stage_layout
from tests.helpers import LMTask, run_distributed
from tests.support import hf_models

pytestmark = pytest.mark.slow  # seconds each (models built, processes started): left out of make test-fast

# size 1; T4 (heads and vocabulary in four); T2 x P2 (parts and stages together): T2, P2 and T4 x P2 are
# the same paths with other counts
LAYOUTS = [(1, 1), (4, 1), (2, 2)]
ROWS, LENGTH = 3, 24
TOLERANCE = 1e-5  # see the module docstring


def _part_file(path: str, tensor: int, stages: int) -> str:
    rank, stage = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    if stages > 1:
        return stage_path(path, rank, stage)
    return part_path(path, rank) if tensor > 1 else path


def _log_probs(path: str, tokens: torch.Tensor, tensor: int, stages: int):
    """This rank's part of checkpoint ``path``, loaded alone, run on
    ``tokens``: the log-probabilities ``(B, T, V)`` on the last stage's
    first tensor rank (None elsewhere), and what this rank held."""
    state = safe_loading.load(_part_file(path, tensor, stages))
    args = copy.deepcopy(state["cfg"]["model"])
    dictionary = Dictionary.load(os.path.join(os.path.dirname(path), "dict.txt"))
    model = ModelParallelTransformerLanguageModel.build_model(args, LMTask(dictionary))
    stage = stage_layout(args)
    split_for_stage(model, stage)
    model.materialize()
    model.load_state_dict(state["model"], strict=True)
    model.eval()
    held = {"layers": sorted(int(k.split(".")[2]) for k in state["model"] if k.endswith("fc1.weight")),
            "vocabulary rows": None if model.decoder.embed_tokens is None else model.decoder.embed_tokens.weight.size(0)}
    chunk = ChunkModule(model.decoder, stage.chunks[0])
    ranks = parallel_state.get_pipeline_model_parallel_ranks()
    with torch.no_grad():
        if stage.is_first:
            x = chunk(tokens)
        else:
            x = torch.empty(LENGTH, ROWS, args.decoder_embed_dim)
            dist.recv(x, src=ranks[stage.stage - 1])
            x = chunk(x)
        if not stage.is_last:
            dist.send(x, dst=ranks[stage.stage + 1])
            return None, held
        logits = gather_from_tensor_model_parallel_region(x, parallel_state.get_tensor_model_parallel_group())
    first = parallel_state.get_tensor_model_parallel_rank() == 0
    return (torch.log_softmax(logits.double(), -1) if first else None), held


def _worker(rank, world_size, tensor, stages, paths, tokens):
    parallel_state.initialize_model_parallel(tensor, stages)
    assert parallel_state.get_tensor_model_parallel_world_size() == tensor
    assert parallel_state.get_pipeline_model_parallel_world_size() == stages
    return {name: _log_probs(path, tokens[name], tensor, stages) for name, path in paths.items()}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Each model's directory, its input ids and transformers' log-probabilities for them."""
    root = tmp_path_factory.mktemp("hf")
    encoder_json, vocab_bpe = hf_models.small_bpe(root / "bpe")
    out = {}
    for name, build in hf_models.BUILDERS.items():
        directory = str(root / name)
        build(directory, encoder_json, vocab_bpe)
        eos = 2 if not name.startswith("gpt2") else hf_models.source_ids(directory, ["<|endoftext|>"])[0][0]
        stream = [i for line in hf_models.source_ids(directory, hf_models.TEXT) for i in line + [eos]]
        ids = torch.tensor(stream[: ROWS * LENGTH]).view(ROWS, LENGTH)
        # GPT-2's own ids are GPT-2 BPE ids: its untied copy is imported without the BPE files
        bpe = (None, None) if name == "gpt2-untied" else (encoder_json, vocab_bpe)
        out[name] = {"dir": directory, "ids": ids, "eos": eos, "bpe": bpe,
                     "log_probs": hf_models.source_log_probs(directory, ids)}
    return out


def _our_ids(name: str, source) -> torch.Tensor:
    """Our dictionary's ids for the source's: GPT-2's rows follow fairseq's 4
    special symbols, its end-of-text token is fairseq's </s> (2); OPT's and
    XGLM's rows are numbered as fairseq's dictionary already."""
    ids = source["ids"]
    if not name.startswith("gpt2"):
        return ids
    return torch.where(ids == source["eos"], torch.full_like(ids, 2), ids + 4)


def _compare(name: str, source, ours: torch.Tensor) -> None:
    theirs = source["log_probs"]
    rows = theirs.size(-1)
    if name.startswith("gpt2"):
        eos = source["eos"]
        where = torch.tensor([2 if k == eos else k + 4 for k in range(rows)])  # our row of each source row
    else:
        where = torch.arange(rows)
    assert (ours[..., where] - theirs).abs().max().item() <= TOLERANCE
    others = torch.ones(ours.size(-1), dtype=torch.bool)
    others[where] = False
    assert torch.isneginf(ours[..., others]).all()  # every row the source lacks is masked


@pytest.mark.parametrize("tensor,stages", LAYOUTS, ids=[f"T{t}xP{p}" for t, p in LAYOUTS])
def test_imported_models_compute_the_source_log_probabilities(sources, tensor, stages, tmp_path):
    paths, tokens = {}, {}
    for name, source in sources.items():
        paths[name] = str(tmp_path / name / "model.pt")
        import_from_transformers(source["dir"], paths[name], tensor, stages, *source["bpe"])
        tokens[name] = _our_ids(name, source)
    results = run_distributed(_worker, tensor * stages, tmp_path, tensor, stages, paths, tokens)
    layers, multiple = hf_models.LAYERS, 8 * hf_models.HEADS  # the vocabulary's padding: 8 x gcd(heads, FFN)
    for rank, result in enumerate(results):
        stage = rank // tensor  # Megatron's order, tensor fastest (no data or context parallelism here)
        for name, (log_probs, held) in result.items():
            assert held["layers"] == list(range(stage * layers // stages, (stage + 1) * layers // stages))
            tied = name != "gpt2-untied"
            if stage == 0 or (stage == stages - 1 and tied):  # the embedding, or the last stage's tied copy
                assert held["vocabulary rows"] * tensor % multiple == 0
            else:
                assert held["vocabulary rows"] is None
            if rank != (stages - 1) * tensor:
                assert log_probs is None
                continue
            if tied:
                assert log_probs.size(-1) == held["vocabulary rows"] * tensor  # this rank held 1 / T of the rows
            _compare(name, sources[name], log_probs)
