"""The package's structure, counted from its source: imports only go
downward (parallel -> modules -> models -> training / checkpoint ->
fairseq_integration -> cli), no import cycle, process groups are made in
``parallel/`` alone, no class over 250 lines and at most 2 functions over 60
(docs/architecture.md draws the layers)."""

import ast
import os

import fairseq_megatron

ROOT = os.path.dirname(fairseq_megatron.__file__)
# Each layer may import the layers below it (lower numbers), never those above.
LAYERS = {"errors": 0, "files": 0, "parallel": 0, "modules": 1, "models": 2, "training": 3, "checkpoint": 3, "criterions": 3,
          "fairseq_integration": 4, "hub": 5, "planner": 5, "model_copy": 5, "lm_eval_harness": 5, "__init__": 5, "user_dir": 6, "cli": 6}


def _modules() -> dict:
    """``{dotted name: parsed source}`` of every module of the package."""
    found = {}
    for directory, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                dotted = os.path.relpath(path, os.path.dirname(ROOT))[: -len(".py")].replace(os.sep, ".")
                with open(path) as f:
                    found[dotted] = ast.parse(f.read(), path)
    return found


MODULES = _modules()


def _imports(tree) -> set:
    """The package's modules that ``tree`` imports (anywhere in it), by dotted name."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names}
            named = {m for m in submodules if m in MODULES or f"{m}.__init__" in MODULES}
            names.update(named or {node.module})
    found = set()
    for name in names:
        if name.startswith("fairseq_megatron"):
            found.add(name if name in MODULES else f"{name}.__init__")
    return found & set(MODULES)


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1]]


def test_imports_only_go_downward_and_make_no_cycle():
    graph = {m: _imports(tree) - {m} for m, tree in MODULES.items()}
    upward = [f"{a} -> {b}" for a, targets in graph.items() for b in targets
              if _layer(b) > _layer(a) and not a.endswith("__init__")]
    assert upward == []
    # Tarjan's strongly connected components: any of more than one module is a cycle
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    assert cycles == []
    assert not any(m.startswith("fairseq_megatron.fairseq_integration") for m in
                   set().union(*(graph[m] for m in graph if m.startswith("fairseq_megatron.models"))))


def test_process_groups_are_made_in_parallel_alone():
    makers = {"new_group", "init_device_mesh", "DeviceMesh", "new_subgroups"}
    where = set()
    for module, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if name in makers:
                    where.add(module)
    assert where and all(m.startswith("fairseq_megatron.parallel.") for m in where), where


def test_no_class_over_250_lines_and_at_most_two_functions_over_60():
    classes, functions = [], []
    for module, tree in MODULES.items():
        for node in ast.walk(tree):
            length = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and length > 250:
                classes.append((module, node.name, length))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and length > 60:
                functions.append((module, node.name, length))
    assert classes == []
    assert len(functions) <= 2, functions
