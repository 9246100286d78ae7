"""benchmarks/gpu_check.py runs before a GPU is lent: its --tiny form on CPU, every family."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from pyrobayes.registry import _REGISTRY


@pytest.mark.integration
def test_gpu_check_runs_every_family_on_cpu_with_tiny_networks(tmp_path):
    path = Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "gpu_check.json"
    results = module.main(
        ["--tiny", "--device", "cpu", "--steps", "1", "--out", str(out),
         "--job-dir", str(tmp_path / "job")]
    )  # fmt: skip
    assert out.exists()
    families = {cls.family for cls in _REGISTRY.values()}
    assert set(results["models"]) == {"minilm", "llama7b"}
    for res in results["models"].values():
        assert math.isfinite(res["plain_map"]["step_s"]) and res["plain_map"]["step_s"] > 0
        assert set(res["families"]) == families
        for row in res["families"].values():
            assert math.isfinite(row["step_ratio"]) and row["step_ratio"] > 0
            assert "end_s" in row  # post-hoc families finished their posterior
        assert math.isfinite(res["predict_s16"]["ratio"])
    # the causal-LM job ran end to end: zero-shot, MAP and Laplace rows with finite metrics
    job = results["causal_lm_job"]
    assert [r["family"] for r in job["records"]] == ["zero-shot", "map", "laplace"]
    for r in job["records"]:
        assert 0.0 <= r["accuracy"] <= 1.0 and math.isfinite(r["nll"]) and r["nll"] > 0
    assert (tmp_path / "job" / "run" / "table.md").exists()


@pytest.mark.integration
def test_gpu_check_runs_the_llama_and_the_job_in_bfloat16_on_cpu(tmp_path):
    """The GPU run has the LLaMA and the causal-LM job in bfloat16; ``--tiny-bf16`` takes the same
    dtype paths on CPU (Laplace's Kronecker factors, SWAG's moments), so that they are known to
    run before a GPU is lent."""
    path = Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check_bf16", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(
        ["--tiny", "--tiny-bf16", "--device", "cpu", "--steps", "1", "--models", "llama7b",
         "--job-dir", str(tmp_path / "job")]
    )  # fmt: skip
    families = {cls.family for cls in _REGISTRY.values()}
    res = results["models"]["llama7b"]
    assert set(res["families"]) == families
    for row in res["families"].values():
        assert math.isfinite(row["step_ratio"]) and "end_s" in row
    job = results["causal_lm_job"]
    assert [r["family"] for r in job["records"]] == ["zero-shot", "map", "laplace"]
    for r in job["records"]:
        assert math.isfinite(r["nll"]) and r["nll"] > 0
