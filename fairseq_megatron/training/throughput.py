"""Training throughput in the log: tokens/s, model TFLOP/s and MFU per GPU, and peak memory.

Every ``--log-interval`` fairseq-train logs, beside fairseq's own ``wps``
(the tokens of every model copy per second):

- ``tps``: tokens per second per GPU (per process on a CPU): ``wps / W``
  over the ``W`` ranks of the world;
- ``tflops``: model TFLOP/s per GPU, ``tps x`` :func:`model_flops_per_token` ``/ 1e12``;
- ``mfu``: model FLOPs utilization, ``tflops`` as a percentage of the GPU's
  dense bf16/fp16 tensor peak (:func:`peak_tflops`: the vendor's figure,
  whatever precision the run trains in); left out on a CPU and for a GPU
  the table does not know;
- ``gb_peak``: GiB; on a GPU the most memory its tensors held during the
  interval's last step (``torch.cuda.max_memory_allocated``: fairseq's own
  ``gb_free`` read the other way round), on a CPU the process's peak
  resident set size since it started.

Each is a value fairseq computes when it writes the log line from the meters
it keeps (``metrics.log_derived``): nothing is read from the device per
step, and nothing is saved in checkpoints. The log is rank 0's (the first
pipeline stage, whose memory the 1F1B schedule fills most).
``scripts/benchmark.py`` reads ``tps`` and ``tflops`` from this log.
"""

import logging
import re
import resource
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from fairseq.logging import metrics
from fairseq.utils import safe_getattr

logger = logging.getLogger(__name__)


def model_flops_per_token(parameters: int, layers: int, hidden: int, seq_len: int) -> float:
    """Model FLOPs per trained token, forward and backward, no recomputation
    counted: ``6 N + 12 L h s`` for ``N`` parameters, ``L`` layers of hidden
    size ``h`` and sequences of ``s`` tokens. Each parameter costs a
    multiply-add per token forward and two backward (``6 N``), and each
    layer's attention scores and weighted sum ``4 h s`` more FLOPs per token
    forward, three times that with the backward (``12 L h s``, counted in
    full although the causal mask halves them). Narayanan et al. 2021,
    appendix; Chowdhery et al. 2022 (PaLM), appendix B."""
    return 6 * parameters + 12 * layers * hidden * seq_len


def whole_model_parameters(model: nn.Module, tensor_parallel_size: int) -> int:
    """The parameters of the whole model of which ``model`` is one
    tensor-parallel rank's part, as built (every layer, both ends; before a
    pipeline split; weights on the ``meta`` device count too): each
    parameter tagged ``tensor_model_parallel``
    (:mod:`~fairseq_megatron.modules.parameter_attributes`) is one of
    ``tensor_parallel_size`` equal shards, the others are whole on every
    rank; a tied parameter counts once."""
    return sum(p.numel() * (tensor_parallel_size if getattr(p, "tensor_model_parallel", False) else 1)
               for p in model.parameters())


@dataclass(frozen=True)
class PeakRate:
    """A GPU kind's dense bf16/fp16 tensor rate: the CUDA device names it
    matches (``pattern``, a regular expression searched in the name), its
    TFLOP/s, and the vendor's page that gives it."""

    pattern: str
    tflops: float
    source: str


# NVIDIA's figures for bf16 (fp16 on the V100, which has no bf16) tensor-core products without sparsity: the
# datasheets give twice these "with sparsity". First match wins: the more specific names come first.
PEAK_RATES = (
    PeakRate(r"GH200", 989, "https://www.nvidia.com/en-us/data-center/grace-hopper-superchip/"),
    PeakRate(r"H100 NVL", 835, "https://www.nvidia.com/en-us/data-center/h100/"),
    PeakRate(r"H100 PCIe", 756, "https://www.nvidia.com/en-us/data-center/h100/"),
    PeakRate(r"H100", 989, "https://www.nvidia.com/en-us/data-center/h100/ (SXM)"),
    PeakRate(r"H200 NVL", 835, "https://www.nvidia.com/en-us/data-center/h200/"),
    PeakRate(r"H200", 989, "https://www.nvidia.com/en-us/data-center/h200/ (SXM)"),
    PeakRate(r"B200", 2250, "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200, per GPU)"),
    PeakRate(r"A100", 312, "https://www.nvidia.com/en-us/data-center/a100/"),
    PeakRate(r"\bA10\b", 125, "https://www.nvidia.com/en-us/data-center/products/a10-gpu/"),
    PeakRate(r"L40S", 362, "https://www.nvidia.com/en-us/data-center/l40s/"),
    PeakRate(r"\bL4\b", 121, "https://www.nvidia.com/en-us/data-center/l4/"),
    PeakRate(r"V100-SXM2", 125, "https://www.nvidia.com/en-us/data-center/v100/ (fp16)"),
    PeakRate(r"V100-PCIE", 112, "https://www.nvidia.com/en-us/data-center/v100/ (fp16)"),
)


def peak_tflops(device_name: str) -> Optional[float]:
    """The dense bf16/fp16 tensor TFLOP/s of the GPU ``torch.cuda.get_device_name()``
    calls ``device_name`` (:data:`PEAK_RATES`), or None for a kind not in the table."""
    return next((rate.tflops for rate in PEAK_RATES if re.search(rate.pattern, device_name)), None)


def _peak_resident_gib() -> float:
    """This process's peak resident set size, GiB (Linux counts ``ru_maxrss`` in KiB, macOS in bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2 ** 30 if sys.platform == "darwin" else 2 ** 20)


class Throughput:
    """The per-step figures of the module docstring for one run:
    ``flops_per_token`` (:func:`model_flops_per_token`) on each of
    ``world_size`` ranks, on the GPU ``device_name`` (None: the CPU) whose
    peak is ``peak`` TFLOP/s (None: not known), with ``total_gib`` of
    memory (the GPU's, as fairseq counts it for ``gb_free``)."""

    def __init__(self, flops_per_token: float, world_size: int, device_name: Optional[str] = None,
                 total_gib: Optional[float] = None):
        self.flops_per_token = flops_per_token
        self.world_size = world_size
        self.device_name = device_name
        self.peak = peak_tflops(device_name) if device_name is not None else None
        self.total_gib = total_gib
        self._reading = None  # (which count of which meter, tokens per second per rank): one clock read per line

    @classmethod
    def of(cls, model: nn.Module, tensor_parallel_size: int, world_size: int, cfg) -> "Throughput":
        """For ``model`` as built (whole: :func:`whole_model_parameters`),
        trained on ``world_size`` ranks with fairseq-train's configuration
        ``cfg`` (``--decoder-layers``, ``--decoder-embed-dim``,
        ``--tokens-per-sample``; ``--cpu``)."""
        args = cfg.model
        seq_len = safe_getattr(getattr(cfg, "task", None), "tokens_per_sample", None) or args.max_target_positions
        parameters = whole_model_parameters(model, tensor_parallel_size)
        flops = model_flops_per_token(parameters, int(args.decoder_layers), int(args.decoder_embed_dim), int(seq_len))
        on_gpu = torch.cuda.is_available() and not cfg.common.cpu
        name = torch.cuda.get_device_name() if on_gpu else None
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2 ** 30 if on_gpu else None
        throughput = cls(flops, world_size, name, total)
        mfu = (f"MFU of {name}'s {throughput.peak:g} TFLOP/s dense bf16/fp16" if throughput.peak else
               f"no MFU: {name} is not in the table of peak rates" if name else "no MFU on a CPU")
        logger.info(f"throughput per GPU of {world_size} in the log: 6 N + 12 L h s = {flops:,.0f} model FLOPs per "
                    f"token (N = {parameters:,} parameters); {mfu}")
        return throughput

    def _tokens_per_rank(self, meters) -> float:
        """``wps`` over the ranks. fairseq's speed meter divides by the time
        elapsed when it is read; read once for each count of tokens, so that
        the figures of one log line share one reading of the clock."""
        if "wps" not in meters:
            return 0.0
        wps = meters["wps"]
        count = (id(wps), getattr(wps, "n", None), getattr(wps, "start", None))
        if self._reading is None or self._reading[0] != count:
            self._reading = (count, wps.avg / self.world_size)
        return self._reading[1]

    def _tflops(self, meters) -> float:
        return self._tokens_per_rank(meters) * self.flops_per_token / 1e12

    def _peak_gib(self, meters) -> float:
        if self.total_gib is None:
            return _peak_resident_gib()
        return self.total_gib - meters["gb_free"].val if "gb_free" in meters else 0.0

    def log(self) -> None:
        """Add the figures to the meters being aggregated (each computed when
        the log line is written); call after the task logged ``wps``."""
        metrics.log_derived("tps", self._tokens_per_rank, priority=95)
        metrics.log_derived("tflops", self._tflops, priority=96)
        if self.peak:
            metrics.log_derived("mfu", lambda meters: 100 * self._tflops(meters) / self.peak, priority=97)
        metrics.log_derived("gb_peak", self._peak_gib, priority=1501)
