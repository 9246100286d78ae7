"""Every example runs with --smoke (NumPyro's test_examples pattern)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted(
    p for p in (Path(__file__).parents[1] / "examples").glob("*.py") if not p.name.startswith("_")
)


def test_there_are_examples():
    names = {p.stem for p in EXAMPLES}
    expected = {"map", "meanfield", "ivon_diag", "kron_ivon", "swag", "laplace_kron"}
    assert expected | {"posthoc_from_map", "causal_lm_multiple_choice"} <= names
    assert "symmetrized" in names
    assert "ibdr" in names
    assert "signorm" in names
    assert {"hf_classifier", "peft_roundtrip", "regression"} <= names


def _printed(stem: str) -> list[str]:
    """What an example's smoke output must contain: its metrics table (per example when the
    table is not a classification report)."""
    if stem == "regression":
        return ["| family | rmse | nll | learned sigma |"]
    if stem == "hf_classifier":  # a row for every registered family
        from pyrobayes.registry import available_guides, get_guide_class

        families = {get_guide_class(n).family for n in available_guides()}
        return ["| family | accuracy |"] + [f"| {f} | " for f in sorted(families)]
    return ["accuracy"]


@pytest.mark.integration
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
def test_example_smoke(script):
    # examples are named so they never shadow a package (an examples/laplace.py would hide laplace-torch)
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=script.parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for text in _printed(script.stem):  # the metrics report was printed
        assert text in proc.stdout, text
