"""The weights of a transformers checkpoint directory, read one tensor at a time.

transformers saves a model as ``model.safetensors``, or as shards
``model-0000K-of-0000N.safetensors`` listed by ``model.safetensors.index.json``
(older saves: ``pytorch_model.bin`` and its ``pytorch_model.bin.index.json``).
:class:`SourceWeights` opens every file once, checks it before any tensor
is read (a file the index names that is missing, a truncated file, a
tensor the index places in a file that lacks it), and reads each tensor
when asked: safetensors maps the file, copies only that tensor and unmaps it
again (a map held open would keep every page read in the process's memory,
the whole source by the end); ``pytorch_model.bin`` is read through torch's
weights-only unpickler (:mod:`fairseq_megatron.checkpoint.safe_loading`),
memory-mapped, never run.
"""

import json
import os
from typing import Dict, List, Tuple

import torch

from fairseq_megatron.checkpoint.layout import CheckpointError
from fairseq_megatron.errors import UsageError

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PYTORCH, PYTORCH_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


class SourceWeights:
    """Every tensor of the transformers checkpoint in ``directory`` by name,
    its shape known without reading it.

    Raises (on construction):
        CheckpointError: no weights file, an index that is not JSON or names
            a missing file, a file that cannot be read (truncated, not
            safetensors or torch), a tensor the index places in a file that
            does not hold it.
    """

    def __init__(self, directory: str):
        self.directory = directory
        self._files: Dict[str, object] = {}  # file name -> {tensor: shape} (safetensors) or a memory-mapped state dict
        self._where: Dict[str, str] = {}  # tensor name -> file name
        self._index_path, index, single = self._find()
        for name in sorted(set(index.values())) if index else [single]:
            self._files[name] = self._open(name)
        if index:
            for tensor, name in index.items():
                if tensor not in self._keys(name):
                    raise CheckpointError(f"{self._path(name)} lacks the tensor {tensor} that "
                                          f"{self._index_path} places in it")
            self._where = dict(index)
        else:
            self._where = {tensor: single for tensor in self._keys(single)}

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _find(self) -> Tuple[str, Dict[str, str], str]:
        """``(index path, index, single file)``: the index and its tensor ->
        file map (empty without one), or the one weights file."""
        for index_name, single in ((SAFETENSORS_INDEX, SAFETENSORS), (PYTORCH_INDEX, PYTORCH)):
            index_path = self._path(index_name)
            if os.path.exists(index_path):
                try:
                    with open(index_path, encoding="utf-8") as f:
                        weight_map = json.load(f)["weight_map"]
                    names = sorted(set(weight_map.values()))
                except (ValueError, KeyError, TypeError, AttributeError) as e:
                    raise CheckpointError(f"{index_path} is not a transformers index of weights "
                                          f"({type(e).__name__}: {e})") from None
                for name in names:
                    if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
                        raise CheckpointError(f"{index_path} names {name!r}, not a file in {self.directory}")
                    if not os.path.exists(self._path(name)):
                        raise CheckpointError(f"{self._path(name)} is missing: {index_path} names it")
                return index_path, dict(weight_map), ""
            if os.path.exists(self._path(single)):
                return "", {}, single
        raise CheckpointError(f"{self.directory} holds no weights: none of {SAFETENSORS}, {SAFETENSORS_INDEX}, "
                              f"{PYTORCH}, {PYTORCH_INDEX}")

    def _open(self, name: str):
        """A safetensors file's ``{tensor: shape}`` (its header, checked
        whole), or a ``.bin`` file's state dict, memory-mapped."""
        path = self._path(name)
        if name.endswith(".safetensors"):
            try:
                from safetensors import safe_open
            except ImportError:
                raise UsageError(f"{path} needs safetensors to be read: pip install 'fairseq_megatron[hf]'") from None

            try:
                with safe_open(path, framework="pt") as f:
                    return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
            except Exception as e:  # safetensors' SafetensorError: truncated, not safetensors
                raise CheckpointError(f"cannot read {path}: {e}") from None
        from fairseq_megatron.checkpoint import safe_loading
        from fairseq_megatron.checkpoint.part_files import can_be_memory_mapped, check_whole

        check_whole(path)  # cut short: one line that says so
        try:
            state = safe_loading.load(path, mmap=can_be_memory_mapped(path))
        except CheckpointError:
            raise
        except Exception as e:  # truncated zip, not a torch file
            raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e}") from None
        if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
            raise CheckpointError(f"{path} is not a state dict of tensors")
        return state

    def _keys(self, name: str) -> List[str]:
        return list(self._files[name].keys())

    def names(self) -> List[str]:
        """Every tensor's name."""
        return list(self._where)

    def __contains__(self, tensor: str) -> bool:
        return tensor in self._where

    def shape(self, tensor: str) -> Tuple[int, ...]:
        """The tensor's shape, read from the file's header (safetensors) or map."""
        found = self._files[self._where[tensor]][tensor]
        return tuple(found.shape) if torch.is_tensor(found) else found

    def get(self, tensor: str) -> torch.Tensor:
        """The tensor, read now (its own memory, or a map of a ``.bin`` file)."""
        name = self._where[tensor]
        if not name.endswith(".safetensors"):
            return self._files[name][tensor]
        from safetensors import safe_open

        with safe_open(self._path(name), framework="pt") as f:
            return f.get_tensor(tensor)
