"""Model-parallel RNG tracker that works on CPU and CUDA.

Dropout on a tensor that is *sharded* across the tensor-model-parallel group
(attention probabilities of the local heads, the local slice of the FFN
activation) must use a different random stream on every model-parallel rank,
otherwise all shards drop the same positions. Dropout on a *replicated* tensor
(after the row-parallel projections) must use the same stream on every rank,
otherwise the replicas diverge. Megatron-LM solves this with a named-RNG
tracker (Shoeybi et al. 2019, section 3; ``megatron/core/tensor_parallel/random.py``):
the default generator is seeded identically on all ranks, and a second,
rank-dependent stream is swapped in with ``with tracker.fork(): ...``.

fairscale's tracker only swaps the CUDA generator and fails on CPU ("cuda rng
state model-parallel-rng is not added"). This one keeps one state per name and
device type and swaps whichever generator the tensor lives on.
"""

import contextlib
from typing import Dict, Union

import torch

from fairseq_megatron.parallel import parallel_state

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Megatron-LM's offset between the data-parallel seed and the model-parallel one.
_MODEL_PARALLEL_SEED_OFFSET = 2718


def _get_device_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_device_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named random streams, each with a lazily created state per device type.

    ``get_states()`` returns ``{name: {"seed": int, "cpu": ByteTensor, "cuda": ByteTensor}}``
    (device entries only for devices used so far); MegatronTrainer stores it in
    checkpoints as ``extra_state["rng_tracker_states"]``.
    """

    def __init__(self):
        self._seeds: Dict[str, int] = {}
        self._states: Dict[str, Dict[str, torch.Tensor]] = {}

    def reset(self) -> None:
        self._seeds.clear()
        self._states.clear()

    def is_initialized(self, name: str = MODEL_PARALLEL_RNG) -> bool:
        return name in self._seeds

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed``.

        Raises:
            ValueError: ``name`` exists already.
        """
        if name in self._seeds:
            raise ValueError(f"RNG state {name!r} already exists")
        self._seeds[name] = int(seed)
        self._states[name] = {}

    def get_states(self) -> Dict[str, Dict[str, Union[int, torch.Tensor]]]:
        return {
            name: {"seed": self._seeds[name], **{k: v.clone() for k, v in self._states[name].items()}}
            for name in self._seeds
        }

    def set_states(self, states) -> None:
        """Restore what :meth:`get_states` returned.

        Also accepts the Megatron/fairscale format ``{name: cuda ByteTensor}``
        found in checkpoints written with the original submodule.
        """
        self.reset()
        for name, entry in states.items():
            if isinstance(entry, torch.Tensor):  # Megatron / fairscale: CUDA state only
                entry = {"seed": 0, "cuda": entry}
            self._seeds[name] = int(entry.get("seed", 0))
            self._states[name] = {k: v.clone() for k, v in entry.items() if k != "seed"}

    def _state_for(self, name: str, device_type: str) -> torch.Tensor:
        states = self._states[name]
        if device_type not in states:
            gen = torch.Generator(device=device_type)
            gen.manual_seed(self._seeds[name])
            states[device_type] = gen.get_state()
        return states[device_type]

    @contextlib.contextmanager
    def fork(self, device: Union[str, torch.device] = "cpu", name: str = MODEL_PARALLEL_RNG):
        """Run the block with stream ``name`` as the default generator of ``device``.

        If the stream was never seeded and the tensor-model-parallel size is 1
        (a plain single-process run), the block runs on the default generator:
        with one rank there is nothing to decorrelate.

        Raises:
            RuntimeError: the stream was never seeded but model parallelism is on.
        """
        device_type = torch.device(device).type
        if name not in self._seeds:
            if parallel_state.get_tensor_model_parallel_world_size() == 1:
                yield
                return
            raise RuntimeError(
                f"RNG stream {name!r} was never seeded; call model_parallel_cuda_manual_seed"
            )
        saved = _get_device_state(device_type)
        _set_device_state(device_type, self._state_for(name, device_type))
        try:
            yield
        finally:
            self._states[name][device_type] = _get_device_state(device_type)
            _set_device_state(device_type, saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process's one tracker (Megatron-LM's ``get_cuda_rng_tracker``), seeded by
    :func:`model_parallel_manual_seed`."""
    return _TRACKER


# fairseq (MegatronTrainer) imports it under Megatron's name.
get_cuda_rng_tracker = get_rng_tracker


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the default generators with ``seed`` (same on all ranks) and the
    model-parallel stream with ``seed + 2718 + tensor_model_parallel_rank``.

    Mirrors Megatron-LM ``model_parallel_cuda_manual_seed``; fairseq calls it
    under that name from ``distributed_init``.
    """
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(
        MODEL_PARALLEL_RNG,
        seed + _MODEL_PARALLEL_SEED_OFFSET + parallel_state.get_tensor_model_parallel_rank(),
    )


model_parallel_cuda_manual_seed = model_parallel_manual_seed
