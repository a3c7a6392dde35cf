"""The training log's throughput (fairseq_megatron/training/throughput.py):
the model FLOPs per token counted on the model the trainer builds, against
the benchmark's count from the shape; the figures fairseq's meters give
from ``wps`` and ``gb_free``; which GPU names get which peak."""

import os
import sys

import pytest
from fairseq.logging import metrics

from fairseq_megatron.models.model_parallel_transformer_lm import ModelParallelTransformerLanguageModel
from fairseq_megatron.parallel.parallel_state import RankGroup
from fairseq_megatron.training.throughput import Throughput, peak_tflops, whole_model_parameters
from tests.helpers import LMTask, make_dictionary, model_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_whole_model_count_matches_the_benchmark_shape_formula(tensor_parallel_size):
    """Rank 0 of a model of ``T`` parts, built without process groups on the
    meta device, counts the parameters of the whole model: those
    ``scripts/benchmark.py`` computes from the tiny shape (tied embedding,
    sinusoidal positions; the vocabulary padded to a multiple of 8 x T)."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import benchmark

    shape = benchmark.SHAPES["tiny"]
    args = model_args(tensor_parallel_size, decoder_layers=shape["layers"], decoder_embed_dim=shape["hidden"],
                      decoder_ffn_embed_dim=shape["ffn"], decoder_attention_heads=shape["heads"],
                      tokens_per_sample=shape["seq_len"], max_target_positions=shape["seq_len"])
    dictionary = make_dictionary()
    task = LMTask(dictionary)
    task.initial_weights_may_be_loaded = True  # on the meta device: nothing drawn
    model = ModelParallelTransformerLanguageModel.build_model(args, task, tensor_parallel=RankGroup(
        tensor_parallel_size, 0))
    assert model.decoder.layers[0].fc1.weight.shape[0] == shape["ffn"] // tensor_parallel_size  # a part: 1 / T
    vocab = len(dictionary)  # padded by the build, to a multiple of 8 x T
    assert vocab % (8 * tensor_parallel_size) == 0
    assert whole_model_parameters(model, tensor_parallel_size) == benchmark.count_params(shape, vocab)


def _logged(throughput, wps, gb_free=None):
    """The throughput figures fairseq's meters give, ``wps`` (an average:
    fixed, where fairseq's speed meter depends on the clock) and ``gb_free``
    logged as fairseq-train logs them in a step."""
    with metrics.aggregate(new_root=True) as meters:
        metrics.log_scalar("wps", wps)
        if gb_free is not None:
            metrics.log_scalar("gb_free", gb_free, weight=0)
        throughput.log()
        return {k: v for k, v in meters.get_smoothed_values().items() if k not in ("wps", "gb_free")}


def test_per_gpu_figures_from_fairseqs_meters():
    """4 ranks, 8000 tokens/s over all: 2000 per GPU; 1e9 FLOPs per token:
    2 TFLOP/s per GPU, 2 / 989 of an H100 SXM's dense bf16 peak; 79 GiB of
    which 70 stayed free: 9 GiB at the peak."""
    h100 = Throughput(1e9, 4, device_name="NVIDIA H100 80GB HBM3", total_gib=79.0)
    logged = _logged(h100, 8000.0, gb_free=70.0)
    assert logged == pytest.approx({"tps": 2000.0, "tflops": 2.0, "mfu": 100 * 2.0 / 989, "gb_peak": 9.0},
                                   rel=1e-12)  # float arithmetic on exact inputs
    cpu = _logged(Throughput(1e9, 2), 8000.0)
    assert set(cpu) == {"tps", "tflops", "gb_peak"}  # no MFU on a CPU
    assert (cpu["tps"], cpu["tflops"]) == (4000.0, 4.0)
    assert 0 < cpu["gb_peak"] < 1000  # this process's peak resident set, GiB
    unknown = _logged(Throughput(1e9, 1, device_name="NVIDIA GeForce RTX 4090", total_gib=24.0), 1000.0, 20.0)
    assert "mfu" not in unknown and unknown["tflops"] == 1.0


def test_peak_rates_by_device_name():
    """The names ``torch.cuda.get_device_name`` gives, and the vendors'
    dense bf16 (V100: fp16) tensor rates in TFLOP/s; a name that contains
    another kind's (GH200 and H200, A10G and A10, L40S and L4) gets its own."""
    expected = {
        "NVIDIA H100 80GB HBM3": 989, "NVIDIA H100 PCIe": 756, "NVIDIA H100 NVL": 835, "NVIDIA H200": 989,
        "NVIDIA H200 NVL": 835, "NVIDIA GH200 480GB": 989, "NVIDIA B200": 2250, "NVIDIA A100-SXM4-80GB": 312,
        "NVIDIA A100 80GB PCIe": 312, "NVIDIA A10": 125, "NVIDIA A10G": None, "NVIDIA L4": 121, "NVIDIA L40S": 362,
        "Tesla V100-SXM2-16GB": 125, "Tesla V100-PCIE-32GB": 112, "NVIDIA GeForce RTX 4090": None,
    }
    assert {name: peak_tflops(name) for name in expected} == expected

