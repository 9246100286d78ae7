"""Test set-up shared by the whole suite (after Pyro's tests/conftest.py).

Every test runs in float64 unless ``PYROBAYES_DTYPE`` says otherwise, with Pyro validation on, a
clean param store and a fixed seed (``@pytest.mark.seed(n)`` overrides the default 0).
"""

from __future__ import annotations

import os

import pyro
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_default_dtype(getattr(torch, os.environ.get("PYROBAYES_DTYPE", "float64")))
# small tensors: one thread avoids contention (measured 30x slower fits with 2 under load)
torch.set_num_threads(1)


def pytest_terminal_summary(terminalreporter) -> None:
    from tests.doc_snippets import write_summary  # how many README/docs blocks ran (test_docs.py)

    write_summary(terminalreporter)


def pytest_runtest_setup(item: pytest.Item) -> None:
    pyro.clear_param_store()
    pyro.enable_validation(True)
    marker = item.get_closest_marker("seed")
    pyro.set_rng_seed(marker.args[0] if marker else 0)
    if item.get_closest_marker("gpu") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules with process-spawning tests (``integration``: examples, the CLI demo, killed fits,
    gloo ranks) first, each module's tests kept together and in order.

    ``make test`` runs ``pytest -n 2 --dist loadscope`` (pytest-xdist): each module goes whole to
    one worker (its module fixtures, such as a demo run in a subprocess or a dozen killed fits,
    are built once, and its tests keep their order), modules in this order, so the longest ones
    start first instead of one finishing alone at the end.
    """
    spawning = {item.path for item in items if item.get_closest_marker("integration")}
    items.sort(key=lambda item: item.path not in spawning)  # stable
