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
