"""Markers by directory: ``unit`` (in-process), ``distributed`` (gloo ranks
forked by ``tests.helpers.run_distributed``), ``e2e`` (fairseq's tools and
our scripts run as a user runs them), ``gpu`` (skipped without CUDA).
``make test-fast`` runs ``unit`` and ``distributed`` tests not marked
``slow``; ``make test`` runs everything.

Longest first: end-to-end tests are collected before the others, and those
marked ``minutes`` before all, so that the two pytest workers of ``make
test`` (which steal queued tests from each other) finish together instead of
one waiting on a long test the other started last."""

import os

import pytest

_KINDS = ("unit", "distributed", "e2e", "gpu")  # directories, in the order they run
_ORDER = {"e2e": 1, "distributed": 2, "unit": 3, "gpu": 4}


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    kind = {}
    for item in items:
        kind[item] = os.path.relpath(str(item.fspath), here).split(os.sep)[0]
        if kind[item] in _KINDS:
            item.add_marker(getattr(pytest.mark, kind[item]))
    items.sort(key=lambda item: 0 if item.get_closest_marker("minutes") else _ORDER.get(kind[item], 5))
