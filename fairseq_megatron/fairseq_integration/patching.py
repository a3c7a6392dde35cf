"""The one way this package replaces a fairseq function: :func:`replace`.

Where fairseq offers no extension point (a registry, a subclass, a task
method), the plugin replaces a module attribute, once, with a function that
calls the original for everything that is not a run of our models. Each
replacement is recorded in :data:`REPLACEMENTS` with its reason; replacing
the same attribute twice raises, so wrappers never stack, and nothing else
in the package assigns to fairseq's modules or classes. The list is what
``docs/fairseq-changes.md`` documents and what the tests check (the
signatures of the originals are pinned there, so a fairseq upgrade that
changes one fails loudly).
"""

import importlib
import inspect
import os
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, List, Optional


@dataclass(frozen=True)
class Replacement:
    """One fairseq attribute this package replaced: ``owner.name`` was
    ``original`` and is now ``new``; ``why`` is the fairseq behaviour it
    changes, in one sentence."""

    owner: str
    name: str
    original: Any
    new: Any
    why: str


# Every replacement made by ``fairseq_integration.install``, in order. A list
# on the module because the replacements are process-wide by nature: they are
# made once per interpreter, whatever creates the plugin's objects later.
REPLACEMENTS: List[Replacement] = []


def replace(owner: types.ModuleType, name: str, new: Callable, why: str) -> None:
    """Set ``owner.name`` to ``new``, keeping the original as ``new.__wrapped__``
    and recording it.

    Raises:
        RuntimeError: ``owner.name`` was replaced already (wrappers must not
            stack: one function per fairseq attribute decides everything).
    """
    qualified = f"{owner.__name__}.{name}"
    if any(r.owner == owner.__name__ and r.name == name for r in REPLACEMENTS):
        raise RuntimeError(f"{qualified} is replaced already")
    original = getattr(owner, name, None)
    if inspect.isroutine(original) and inspect.isroutine(new):
        new.__wrapped__ = original  # for inspect.unwrap; name and docstring stay ours
    setattr(owner, name, new)
    REPLACEMENTS.append(Replacement(owner.__name__, name, original, new, why))


def replace_in_cli_module(module_name: str, name: str, new: Callable, why: str) -> None:
    """:func:`replace` for a global of a ``fairseq_cli`` tool, also where the
    tool's code looks the name up when it runs as ``python -m fairseq_cli.X``:
    there ``__main__`` executes the same file with globals of its own, and a
    process that multiprocessing spawned from it keeps runpy's copy of them
    (``__mp_main__``). Those are the same replacement, recorded once."""
    module = importlib.import_module(module_name)
    replace(module, name, new, why)
    main_module = sys.modules.get("__main__")
    spec = getattr(main_module, "__spec__", None)
    if spec is None or spec.name != module_name or not hasattr(main_module, "main"):
        return
    run_by_main = inspect.unwrap(main_module.main).__globals__
    for namespace in {id(vars(main_module)): vars(main_module), id(run_by_main): run_by_main}.values():
        namespace[name] = getattr(module, name)


class ModuleWith(types.ModuleType):
    """Module ``module`` as one fairseq_cli tool sees it, with ``overrides``
    in place of some of its names (looked up on each use otherwise): for a
    tool that calls a function through a module global
    (``progress_bar.progress_bar(...)``), where only that tool's calls
    should change."""

    def __init__(self, module: types.ModuleType, **overrides):
        super().__init__(module.__name__)
        self.__dict__.update(overrides)
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)


def original(owner: types.ModuleType, name: str) -> Any:
    """What ``owner.name`` was before :func:`replace`."""
    for r in REPLACEMENTS:
        if r.owner == owner.__name__ and r.name == name:
            return r.original
    raise KeyError(f"{owner.__name__}.{name} was not replaced")


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


def plugin_on_command_line() -> bool:
    """Whether this process is a fairseq tool given ``--user-dir`` naming this
    package (the way users ask for our models). Checks that apply before any
    model is known (the model-parallel size at launch, one-line errors for
    missing files) apply only then, so that the plugin imported for another
    reason leaves fairseq's behaviour alone."""
    if fairseq_tool() is None:
        return False
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = sys.argv[1:]
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg == "--user-dir" and i + 1 < len(argv) else (
            arg.split("=", 1)[1] if arg.startswith("--user-dir=") else None)
        if value is not None and os.path.abspath(value) == here:
            return True
    return any(arg.startswith("common.user_dir=") and os.path.abspath(arg.split("=", 1)[1]) == here
               for arg in argv)
