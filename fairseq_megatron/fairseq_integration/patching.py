"""How the other modules of this package change fairseq: stand-ins for a
module as one fairseq module sees it, and names replaced inside the
``fairseq_cli`` modules wherever their code looks them up. Nothing here
changes fairseq by itself.
"""

import functools
import os
import sys
import types
from typing import Optional

import torch


class StandIn(types.ModuleType):
    """Stands in for module ``stands_for`` as a global of one fairseq module:
    that module's names (looked up on each use), except those a subclass
    defines."""

    def __init__(self, stands_for: types.ModuleType):
        super().__init__(stands_for.__name__)
        self.stands_for = stands_for

    def __getattr__(self, name):
        return getattr(self.stands_for, name)


class TorchStandIn(StandIn):
    """Stands in for ``torch`` as the global ``torch`` of one fairseq module."""

    def __init__(self):
        super().__init__(torch)


def cli_modules(module_name: str) -> list:
    """The module objects of a fairseq_cli module: the imported one and, when
    it runs as ``python -m fairseq_cli.X``, ``__main__`` (a second module
    object executing the same file, with its own globals)."""
    import importlib

    modules = [importlib.import_module(module_name)]
    main_module = sys.modules.get("__main__")
    spec = getattr(main_module, "__spec__", None)
    if spec is not None and spec.name == module_name and hasattr(main_module, "main"):
        modules.append(main_module)
    return modules


def replace_in_cli_module(module_name: str, name: str, replace) -> None:
    """Set global ``name`` of fairseq_cli module ``module_name`` to
    ``replace(current value)`` wherever that module's code looks it up: in
    each module object of :func:`cli_modules` and in the globals its
    ``main`` runs with. Those differ in a process that multiprocessing
    spawned from ``python -m fairseq_cli.X`` (fairseq's own launcher): it
    re-runs the main module with runpy and copies the result into
    ``__mp_main__``, so the functions keep runpy's dictionary."""
    import inspect

    namespaces = []
    for module in cli_modules(module_name):
        for namespace in (vars(module), inspect.unwrap(module.main).__globals__):
            if not any(namespace is seen for seen in namespaces):
                namespaces.append(namespace)
    for namespace in namespaces:
        namespace[name] = replace(namespace[name])


def patch_cli_main(module_name: str, wrap) -> None:
    """Replace ``main`` of a fairseq_cli module by ``wrap(original_main, module)``."""
    for module in cli_modules(module_name):
        module.main = functools.wraps(module.main)(wrap(module.main, module))


def fairseq_tool() -> Optional[str]:
    """The fairseq command-line tool this process runs, by its module name
    (``eval_lm`` for ``python -m fairseq_cli.eval_lm`` or the
    ``fairseq-eval-lm`` script); None in a Python program that imported the
    package. ``fairseq-megatron-hydra-train`` (or ``python -m
    fairseq_megatron.cli.hydra_train``) counts as fairseq's hydra_train."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name.startswith("fairseq_cli."):
        return spec.name[len("fairseq_cli."):]
    if spec is not None and spec.name == "fairseq_megatron.cli.hydra_train":
        return "hydra_train"
    script = os.path.basename(sys.argv[0] if sys.argv else "")
    if script == "fairseq-megatron-hydra-train":
        return "hydra_train"
    return script[len("fairseq-"):].replace("-", "_") if script.startswith("fairseq-") else None
