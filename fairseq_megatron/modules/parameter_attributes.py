"""How each parameter is split, said by the parameter itself.

Megatron-Core tags every parameter where the layer creates it
(``megatron/core/tensor_parallel/layers.py``,
``set_tensor_model_parallel_attributes``), and so do these layers, with the
same names:

* ``tensor_model_parallel``: whether the tensor-parallel ranks hold
  different slices of it (False: every rank holds all of it, a replicated
  parameter such as a layer norm's or a row-parallel bias);
* ``partition_dim``: the dimension along which it is sliced (-1 when replicated);
* ``partition_stride``: 1 (contiguous slices, rank 0's first).

and for the token embedding tied to the output projection
(``--share-decoder-input-output-embed``), as Megatron-Core's language
module marks it:

* ``shared_embedding``: True on the embedding weight wherever it is held
  (both ends of a pipeline): its gradients are summed over the embedding group;
* ``shared``: True on the last pipeline stage's copy of it: the gradient
  norm counts it once, on the first stage.

The gradient norm, the checkpoint layout, resharding and both exports read
these attributes, not parameter names. torch drops a parameter's Python
attributes whenever it makes a new parameter (``copy.deepcopy``,
``to_empty`` from the ``meta`` device, ``load_state_dict(assign=True)``):
:class:`KeepsParameterAttributes` records them on the module and puts them
back after each of these.
"""

from typing import Any, Dict, Optional

import torch
import torch.nn as nn

from fairseq_megatron.parallel.parallel_state import SharesProcessGroupsWhenCopied

ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "shared_embedding", "shared")
"""Every attribute this package sets on a parameter (copied onto any replacement)."""


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool, dim: int, stride: int = 1) -> None:
    """Megatron-Core's function of that name: ``dim`` is -1 for a replicated parameter."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(param: torch.Tensor) -> None:
    """Mark ``param`` replicated unless it says otherwise (Megatron-Core's function of that name)."""
    if not hasattr(param, "tensor_model_parallel"):
        set_tensor_model_parallel_attributes(param, False, -1, 1)


def copy_parameter_attributes(source: torch.Tensor, destination: torch.Tensor) -> None:
    """Give ``destination`` every attribute of :data:`ATTRIBUTES` that ``source`` has."""
    for name in ATTRIBUTES:
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


def partition_dim(param: torch.Tensor) -> Optional[int]:
    """The dimension along which tensor-parallel ranks split ``param``; None
    where every rank holds all of it.

    Raises:
        ValueError: ``param`` carries no ``tensor_model_parallel`` attribute
            (a parameter this package did not create or tag).
    """
    if not hasattr(param, "tensor_model_parallel"):
        raise ValueError(f"a parameter of shape {tuple(param.shape)} does not say how it is split "
                         f"(no tensor_model_parallel attribute)")
    return param.partition_dim if param.tensor_model_parallel else None


class KeepsParameterAttributes(SharesProcessGroupsWhenCopied):
    """Mixin for this package's modules (before ``nn.Module`` in the bases).

    :meth:`set_parameter_attributes` records attributes of one of the
    module's own parameters and sets them; :meth:`tag_parameters` sets them
    again on whatever parameter now has that name, and marks every
    parameter of the module's other descendants that says nothing as
    replicated (fairseq's layer norms and positions inside our layers).
    It runs after ``_apply`` (``to``, ``half``, ``to_empty``), after a
    ``load_state_dict`` of the module (also with ``assign=True``) and on
    the module's ``copy.deepcopy``. A copy shares process groups
    (:class:`~fairseq_megatron.parallel.parallel_state.SharesProcessGroupsWhenCopied`).
    """

    def set_parameter_attributes(self, name: str, **attributes: Any) -> None:
        """Record ``attributes`` (of :data:`ATTRIBUTES`) of parameter ``name`` and set them."""
        recorded: Dict[str, Dict[str, Any]] = vars(self).setdefault("_parameter_attributes", {})
        recorded.setdefault(name, {}).update(attributes)
        self.tag_parameters()

    def set_tensor_parallel_split(self, name: str, dim: Optional[int]) -> None:
        """Record that parameter ``name`` is split along ``dim`` (None: replicated)."""
        self.set_parameter_attributes(name, tensor_model_parallel=dim is not None,
                                      partition_dim=-1 if dim is None else dim, partition_stride=1)

    def tag_parameters(self) -> None:
        """Set the recorded attributes again, and mark the untagged
        parameters of descendants that are not themselves tagging modules
        replicated."""
        if not vars(self).get("_retags_after_load"):
            self.register_load_state_dict_post_hook(_tag_after_load)
            self._retags_after_load = True
        for name, attributes in vars(self).get("_parameter_attributes", {}).items():
            param = self._parameters.get(name)
            if param is not None:
                for key, value in attributes.items():
                    setattr(param, key, value)
        _mark_replicated(self)

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        # every tagging module below too, not only this one: a parameter two modules hold (the tied
        # embedding and output projection) is converted once for each, and torch converts a tensor
        # subclass (FSDP2's DTensor) by swapping the tensors' contents, Python attributes included
        for child in self.modules():
            if isinstance(child, KeepsParameterAttributes):
                child.tag_parameters()
        return module

    def __deepcopy__(self, memo):
        copied = super().__deepcopy__(memo)
        copied.tag_parameters()
        return copied


def _mark_replicated(module: nn.Module) -> None:
    for param in module._parameters.values():
        if param is not None:
            set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    for child in module.children():
        if not isinstance(child, KeepsParameterAttributes):
            _mark_replicated(child)


def _tag_after_load(module: KeepsParameterAttributes, incompatible_keys) -> None:
    module.tag_parameters()
