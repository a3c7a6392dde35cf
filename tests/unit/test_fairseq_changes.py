"""docs/fairseq-changes.md and the code cannot drift apart: its table of
replaced fairseq attributes is the one ``scripts/fairseq_changes.py`` makes
from ``patching.REPLACEMENTS``, and every test it names exists."""

import ast
import importlib.util
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "fairseq-changes.md")


def test_the_table_of_replacements_is_the_codes(capsys):
    spec = importlib.util.spec_from_file_location("fairseq_changes", os.path.join(ROOT, "scripts/fairseq_changes.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.table().count("\n| `fairseq") >= 10
    assert script.main(["--check"]) == 0, capsys.readouterr().err


def test_every_test_the_document_names_exists():
    references = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", open(DOC).read())
    assert len(references) >= 20
    missing = []
    for path, name in references:
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        functions = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        if name not in functions:
            missing.append(f"{path}::{name}")
    assert not missing, missing
