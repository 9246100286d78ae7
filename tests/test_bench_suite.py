"""The benchmark suite's ``--quick`` form end to end (benchmarks/suite/run.py, tiny models)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("laplace")
pytest.importorskip("sklearn")

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "suite"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"suite_{name}", SUITE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_suite_runs_every_family_and_anchor(tmp_path: Path) -> None:
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # as the script runs (the test session's may differ)
    sys.path.insert(0, str(SUITE))
    try:
        run = _load("run")
        out = tmp_path / "quick.json"
        results = run.main(["--quick", "--out", str(out)])
    finally:
        sys.path.remove(str(SUITE))
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
    on_disk = json.loads(out.read_text())
    assert on_disk["quick"] and set(on_disk["tasks"]) == {"digits", "diabetes"}
    assert results["tasks"].keys() == on_disk["tasks"].keys()
    for name, task in on_disk["tasks"].items():
        record = task["runs"]["0"]
        metric = "rmse" if task["kind"] == "regression" else "accuracy"
        for method in ("map", "map+ts", "ensemble", "ensemble+ts", "laplace-torch"):
            assert "error" not in record[method], (name, method, record[method])
            assert math.isfinite(record[method]["nll"]) and math.isfinite(record[method][metric])
        # temperature scaling is fitted on the validation split, so on the test split it may
        # lose; the predictive's means (accuracy / RMSE) never change with T
        assert record["map+ts"][metric] == record["map"][metric]
        assert record["map+ts"]["temperature"] > 0
        for family in run.FAMILIES:
            rec = record[family]
            if "skipped" in rec:  # a family the task cannot run says why
                assert (name, family) in run.SKIP
                continue
            assert "error" not in rec, (name, family, rec.get("error"))
            assert math.isfinite(rec["nll"]) and rec["fit_s"] >= 0
            if family != "map":
                assert math.isfinite(record[f"{family}+ts"]["nll"])
        if task["kind"] == "classification":
            assert 0.0 <= record["map"]["auroc_digits7-9"] <= 1.0
    # laplace-torch runs on the MAP network (adapter merged): same accuracy as the MAP's point
    digits = on_disk["tasks"]["digits"]["runs"]["0"]
    assert digits["laplace-torch"]["accuracy"] == pytest.approx(digits["map"]["accuracy"], abs=0.02)
    # the markdown report: both tables for every task, a row per method
    md = out.with_suffix(".md").read_text()
    assert md.count("Paired differences") == 2
    assert "| swag+ts |" in md and "| laplace-torch |" in md
    report = _load("report")
    diff = report.paired(on_disk["tasks"]["digits"], "map+ts", "map", "nll")
    assert diff[2] == 1 and diff[1] is None  # one seed: a difference without a spread
    assert diff[0] == pytest.approx(digits["map+ts"]["nll"] - digits["map"]["nll"])
    # docs/choosing.md's generator on the same results: every task, the targets, no stale text
    sys.path.insert(0, str(SUITE))
    try:
        choosing = _load("choosing")
        page = choosing.page(on_disk["tasks"], {"digits": "quick.json", "diabetes": "quick.json"})
    finally:
        sys.path.remove(str(SUITE))
    assert "## Issue 27's targets" in page and "## In short" in page
    assert page.count("One seed only: no paired spread") == 2  # no winner is called on one seed
    # its python block is complete: it runs on its own and calibration lowers the test NLL
    block = page.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(block, "choosing.md", "exec"), namespace)  # noqa: S102
    assert (
        namespace["T"] > 0
        and namespace["after"].log_probs.shape == namespace["before"].log_probs.shape
    )
