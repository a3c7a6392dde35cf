"""The lm-evaluation-harness backend at every layout: one fixed list of
requests (log-likelihoods with contexts cut from the left, empty contexts,
rolling windows, greedy generation) answered at P2 (a checkpoint in
T2 x P2 files, stages passing activations), T2 x P2 and D2, with batches of
1 and 8, as at size 1 in this process with batches of 1. Each rank reports its
data-parallel rank and world size (the backend's) and what it held.

Tolerance: 1e-4 relative on log-likelihoods, the "identical to 4 decimals"
of task scores; what is summed differs only by the order of fp32 partial
products between layouts and batch shapes. Greedy choices and generated
text are compared exactly.
"""

import pytest
import torch
import torch.distributed as dist

from fairseq_megatron.parallel import parallel_state
from tests.helpers import run_distributed
from tests.support import lm_eval_requests

import lm_eval  # noqa: E402,F401  (the [test] extra installs it: these tests fail, not skip, without it)

pytestmark = pytest.mark.slow  # seconds each (models built, processes started): left out of make test-fast

# P2 (from T2 x P2 files: resharded in memory), T2 x P2 and D2; size 1 with batches of 8 and T2 alone are
# the same paths as these with fewer ranks (the reference is size 1 with batches of 1)
LAYOUTS = [(1, 2, 1, "t2p2"), (2, 2, 1, "t2p2"), (1, 1, 2, "size1")]


def _worker(rank, world_size, tensor, stages, model, checkpoint):
    from fairseq_megatron.lm_eval_harness import FairseqMegatronLM

    lm = FairseqMegatronLM(path=model[checkpoint], encoder_json=model["encoder_json"], vocab_bpe=model["vocab_bpe"],
                           model_parallel_size=tensor, pipeline_model_parallel_size=stages)
    layers = sorted(int(k.split(".")[2]) for k in lm.model.model.state_dict() if k.endswith("fc1.weight"))
    by_batch = {}
    for batch_size in (1, 8):
        lm.batch_size = batch_size
        by_batch[batch_size] = lm_eval_requests.answers(lm)
    gathered = lm.all_gather(torch.tensor(rank))
    return {"answers": by_batch, "rank": lm.rank, "world": lm.world_size, "layers": layers,
            "tensor": parallel_state.get_tensor_model_parallel_world_size(), "gathered": gathered.tolist(),
            "global": dist.get_rank()}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return lm_eval_requests.model(str(tmp_path_factory.mktemp("lm_eval")))


@pytest.fixture(scope="module")
def reference(model):
    """Size 1, batches of 1, in this process."""
    from fairseq_megatron.lm_eval_harness import FairseqMegatronLM

    lm = FairseqMegatronLM(path=model["size1"], encoder_json=model["encoder_json"], vocab_bpe=model["vocab_bpe"])
    return lm_eval_requests.answers(lm)


def _same(ours: dict, reference: dict) -> None:
    for (a, greedy_a), (b, greedy_b) in zip(ours["loglikelihood"], reference["loglikelihood"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(b) and greedy_a == greedy_b, (a, b)
    for a, b in zip(ours["loglikelihood_rolling"], reference["loglikelihood_rolling"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), (a, b)
    assert ours["generate_until"] == reference["generate_until"]


@pytest.mark.parametrize("tensor,stages,data,checkpoint", LAYOUTS, ids=[f"T{t}xP{p}xD{d}" for t, p, d, _ in LAYOUTS])
def test_every_layout_and_batch_size_answers_as_size_1(model, reference, tmp_path, tensor, stages, data, checkpoint):
    assert len(reference["generate_until"]) == len(lm_eval_requests.GENERATE)
    assert all(score < -20 for score, _ in reference["loglikelihood"])  # far below 0: every masked row matters
    results = run_distributed(_worker, tensor * stages * data, tmp_path, tensor, stages, model, checkpoint)
    for result in results:
        g = result["global"]
        stage, copy = g // (tensor * data), (g // tensor) % data  # Megatron's order: tensor, data, pipeline
        assert (result["rank"], result["world"], result["tensor"]) == (copy, data, tensor)
        assert result["gathered"] == [r for r in range(tensor * stages * data)
                                      if r % tensor == g % tensor and r // (tensor * data) == stage]
        assert result["layers"] == list(range(stage * 2 // stages, (stage + 1) * 2 // stages))  # 2 layers
        for batch_size in (1, 8):
            _same(result["answers"][batch_size], reference)


def _refusal(rank, world_size, model, tensor):
    from fairseq_megatron.lm_eval_harness import FairseqMegatronLM

    try:
        FairseqMegatronLM(path=model["size1"], encoder_json=model["encoder_json"], vocab_bpe=model["vocab_bpe"],
                          model_parallel_size=tensor)
    except ValueError as e:  # UsageError, CheckpointError
        return str(e)
    return None


def test_sizes_that_do_not_divide_the_world_or_the_model_are_one_line_on_every_rank(model, tmp_path):
    said = run_distributed(_refusal, 3, tmp_path / "world", model, 2)
    assert all(s is not None and "world size 3 is not divisible" in s for s in said), said
    said = run_distributed(_refusal, 3, tmp_path / "model", model, 3)
    assert all(s is not None and "does not divide the attention heads (4)" in s for s in said), said
