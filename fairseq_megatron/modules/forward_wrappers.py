"""Wrappers that replace a module's method on the instance, and copies that keep them.

Activation checkpointing, compilation and autocast are applied to a built
model from outside (:mod:`fairseq_megatron.training`): each replaces a
method of one module instance (``layer.forward``, the decoder's
``run_layers``) by a function bound to that module, and records itself
with :func:`record_wrapper`. ``copy.deepcopy`` keeps such a function as it
is, so the copy's method would run the original module, with the original's
weights (a copy made for fairseq's ``--store-ema``, or by a user):
:func:`rewrap` gives the copy wrappers of its own, in the original's order.
"""

from typing import Callable

import torch.nn as nn


def record_wrapper(module: nn.Module, attribute: str, wrap: Callable, **kwargs) -> None:
    """Record that ``wrap(module, **kwargs)`` replaced ``module.<attribute>``."""
    vars(module).setdefault("_method_wrappers", []).append((attribute, wrap, kwargs))


def wrappers_of(module: nn.Module) -> list:
    """``[(attribute, wrap, kwargs), ...]`` applied to ``module``, in order."""
    return list(vars(module).get("_method_wrappers", []))


def rewrap(copied: nn.Module) -> None:
    """Give ``copied``, a ``copy.deepcopy`` of a wrapped module, wrappers of
    its own: the copied instance attributes are dropped and each wrapper is
    applied again, in the original's order. Modules without wrappers are
    left alone."""
    wrappers = vars(copied).pop("_method_wrappers", [])
    for attribute in {attribute for attribute, _, _ in wrappers}:
        vars(copied).pop(attribute, None)
    for _, wrap, kwargs in wrappers:
        wrap(copied, **kwargs)
