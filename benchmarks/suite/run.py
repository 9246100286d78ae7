"""The benchmark suite: posterior families against what a user would pick instead (issue 27).

For every task and seed, in one run and on the same MAP network where the method is post-hoc:

* ``map`` - ``pb.posterior(model, "map")`` fitted with the task's settings;
* ``map+ts`` - that MAP with a temperature fitted on the calibration split (``pb.calibrate``);
* ``ensemble`` - a deep ensemble of M MAPs (M = 4; members differ in the new head's
  initialisation and the data order), probabilities averaged; ``ensemble+ts`` calibrated;
* ``laplace-torch`` - ``laplace.Laplace(net, "classification", subset_of_weights="last_layer",
  hessian_structure="kron")`` + ``optimize_prior_precision()`` on the MAP network (the adapter
  merged, ``pb.models.merged_network``), its default predictive (GLM, probit); regression:
  ``"regression"`` with the MAP's learned noise as ``sigma_noise``; ``laplace-torch+ts`` with a
  temperature on the calibration split, and ``laplace-torch-gs`` (classification) with its other
  documented prior-precision choice, ``method="gridsearch"`` on the calibration split;
* every family, ``pb.posterior(model, family)`` with the task's fit settings (post-hoc families
  from the MAP above), and ``<family>+ts`` calibrated on the calibration split; on the MLP
  tasks also ``meanfield-lora``, mean-field on the plain LoRA adapter the symmetrized guide
  needs (its paired base), and ``meanfield-lora-a``, the same with only ``A`` latent.

Splits (tasks.py): ``train``; ``calibration`` for every choice (temperatures, laplace-torch's
grid search, early stopping on the text tasks); ``validation`` for the reported metrics, never
tuned on (the project evaluates on validation splits only; no dataset's test split is read).
Metrics on the validation split: accuracy, NLL, ECE (15 bins), Brier; OOD AUROC of the
**predictive entropy** of the posterior predictive (ID = 0, OOD = 1; the max-probability AUROC is
kept too, ``auroc_maxprob_*``); regression: RMSE and NLL. Fit and predict seconds; posterior
storage; the objective's reported terms (e.g. mean-field's KL) at the first step and at the end,
and the loss and terms as 20 window means over the fit. Paired differences (per seed, then mean
and standard deviation over seeds) against MAP and each anchor are computed by ``report.py``.

Run::

    make bench-suite                                   # digits, mnist, diabetes: 10 seeds, every family
                                                       # (and autompg: 10 seeds, autompg.json)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/suite/run.py --tasks polarity --seeds 0 \\
        --families map laplace ivon --out benchmarks/results/suite/polarity.json
    .venv/bin/python benchmarks/suite/run.py --quick --out /tmp/suite.json   # the test suite's
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import importlib.metadata
import inspect
import json
import logging
import math
import os
import platform
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import pyro
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from tasks import SKIP, TASKS, Task  # noqa: E402

import pyrobayes as pb  # noqa: E402
from pyrobayes.calibration import apply_temperature, fit_temperature, set_temperature  # noqa: E402
from pyrobayes.predictive import Prediction  # noqa: E402

logger = logging.getLogger("suite")
RESULTS = HERE.parents[0] / "results" / "suite" / "suite.json"
FAMILIES = (
    "map",
    "meanfield",
    "ivon",
    "kron-ivon",
    "swag",
    "laplace",
    "symmetrized",
    "ibdr",
    "signorm",
)
ANCHORS = ("map", "map+ts", "ensemble", "laplace-torch")


# ------------------------------------------------------------------------------------ fitting
def _fit(task: Task, model: Any, guide: Any, settings: dict[str, Any], seed: int) -> dict[str, Any]:
    """``pb.fit`` with the family's settings; validated early stopping where the task uses it."""
    epochs = int(settings.get("epochs", task.epochs))
    if task.quick:
        epochs = min(epochs, task.epochs)
    kwargs: dict[str, Any] = {
        "epochs": epochs,
        "lr": float(settings.get("lr", task.lr)),
        "seed": seed,
    }
    params = inspect.signature(pb.fit).parameters
    validate = task.patience is not None and settings.get("validate", True) and epochs > 0
    # a fit whose settings choose on held-out data (Laplace(prior_optimization="validation"))
    # is given the calibration split even without epochs to select among
    validate = validate or bool(getattr(settings.get("optimizer"), "needs_validation", False))
    if "progress" in params:
        kwargs["progress"] = False
    # the fit's settings (pb.infer.IVON, SWAG, ...) and a learning-rate schedule
    optim = {k: settings[k] for k in ("optimizer", "scheduler") if settings.get(k) is not None}
    if optim:
        kwargs["optim"] = pb.Optimization(**optim)
    if validate:
        patience = settings.get("patience", task.patience)
        patience = None if patience is None else int(patience)
        if hasattr(pb, "Validation"):
            kwargs["validation"] = pb.Validation(
                data=task.calibration, select_by="nll", patience=patience
            )
        else:
            kwargs.update(val_data=task.calibration, select_by="nll", patience=patience)
    start = time.perf_counter()
    result = pb.fit(model, guide, task.train, **kwargs)
    fit_s = time.perf_counter() - start
    state = getattr(result, "state", {}) or {}
    return {
        "fit_s": fit_s,
        "epochs_run": int(state.get("epoch", epochs)),
        "best_epoch": state.get("best_epoch"),
        # the calibration split's NLL after every epoch of a validated fit: what any other
        # patience would have chosen, read off the same run
        "calibration_nll": [float(h["nll"]) for h in state.get("validation") or []],
        # Laplace's τ and, where it was chosen on held-out data, the evidence's it started from
        **{
            {"prior_precision_start": "prior_precision_evidence"}.get(k, k): float(v)
            for k, v in state.items()
            if k in ("prior_precision", "prior_precision_start")
        },
        **_curves(result),
    }


def _curves(result: Any, points: int = 20) -> dict[str, Any]:
    """The objective's reported terms at the first step and over the last 10 steps (e.g.
    mean-field's ``kl`` = KL(q || p) / N: does the posterior scale leave its initial value?),
    and the loss and each term as ``points`` window means ``[[first step, last step, mean],
    ...]`` over the fit (``loss_curve``, ``<term>_curve``: the ELBO curve of the variational
    families without the minibatch noise of single steps)."""
    out: dict[str, Any] = {}
    terms = (getattr(result, "state", {}) or {}).get("terms") or {}
    losses = getattr(result, "losses", None)
    series_of = {f"{k}": v for k, v in terms.items()}
    if losses is not None:
        series_of["loss"] = losses
    for name, series in series_of.items():
        series = torch.as_tensor(series, dtype=torch.float64).reshape(-1)
        if not series.numel():
            continue
        if name != "loss":
            out[f"{name}_first"] = float(series[0])
            out[f"{name}_last"] = float(series[-10:].mean())
        edges = torch.linspace(0, len(series), min(points, len(series)) + 1).round().long()
        out[f"{name}_curve"] = [
            [int(a), int(b) - 1, float(series[a:b].mean())]
            for a, b in zip(edges[:-1].tolist(), edges[1:].tolist(), strict=True)
            if b > a
        ]
    return out


def _predict(task: Task, model: Any, guide: Any) -> tuple[Prediction, dict[str, Prediction], float]:
    start = time.perf_counter()
    pred = pb.predict(model, guide, task.validation, num_samples=task.num_samples, seed=0)
    seconds = time.perf_counter() - start
    ood = {
        k: pb.predict(model, guide, v, num_samples=task.num_samples, seed=0)
        for k, v in task.ood.items()
    }
    return pred, ood, seconds


def _scores(pred: Prediction, ood: dict[str, Prediction]) -> dict[str, float]:
    assert pred.targets is not None
    r = pb.metrics.report(pred, pred.targets)
    if pred.log_probs is None:
        return {"rmse": r["rmse"], "nll": r["nll"]}
    out = {k: r[k] for k in ("accuracy", "nll", "ece", "brier")}
    id_ent = pb.metrics.predictive_entropy(pred.probs)
    id_max = pb.metrics.max_prob_score(pred.probs)
    id_mi = pb.metrics.mutual_information(pred.probs)
    for name, o in ood.items():
        out[f"auroc_{name}"] = pb.metrics.ood_auroc(id_ent, pb.metrics.predictive_entropy(o.probs))
        out[f"auroc_maxprob_{name}"] = pb.metrics.ood_auroc(
            id_max, pb.metrics.max_prob_score(o.probs)
        )
        if pred.probs.shape[0] > 1:  # the epistemic part needs draws (a point mass has MI = 0)
            out[f"auroc_mi_{name}"] = pb.metrics.ood_auroc(
                id_mi, pb.metrics.mutual_information(o.probs)
            )
    return out


def _with_ts(task: Task, model: Any, guide: Any) -> tuple[dict[str, float], float, float]:
    """The guide calibrated on the calibration split: validation scores, T, its seconds."""
    start = time.perf_counter()
    t = pb.calibrate(model, guide, task.calibration, num_samples=task.num_samples, seed=0)
    seconds = time.perf_counter() - start
    pred, ood, _ = _predict(task, model, guide)
    set_temperature(guide, None)
    return _scores(pred, ood), t, seconds


def _stack(preds: list[Prediction]) -> Prediction:
    """A classification ensemble's members as the draws of one predictive (probabilities
    averaged)."""
    return Prediction(log_probs=torch.cat([p.log_probs for p in preds]), targets=preds[0].targets)


def _storage(guide: Any) -> int:
    try:
        return int(pb.count_parameters(guide).get("posterior_storage", 0))
    except Exception:  # accounting is informative only
        return -1


# ------------------------------------------------------------------------------------ anchors
def _ensemble(
    task: Task, seed: int, members: list[tuple[Any, Any]], fit_s: float, m: int
) -> dict[str, Any]:
    """Members 1..M-1 fitted here (member 0 is the MAP); scores with and without TS."""
    settings = task.settings.get("map", {})
    total = fit_s
    for k in range(1, m):
        pyro.clear_param_store()
        model = task.build_model("map", k)
        guide = pb.posterior(model, "map")
        total += _fit(task, model, guide, settings, 1000 * seed + k)["fit_s"]
        members.append((model, guide))
    start = time.perf_counter()
    parts = [_predict(task, mo, g) for mo, g in members]
    predict_s = time.perf_counter() - start
    if task.kind == "regression":
        loc = torch.cat([p[0].loc for p in parts])
        sigma = torch.tensor([float(p[0].scale) for p in parts]).reshape(-1, *[1] * (loc.dim() - 1))
        pred = Prediction(loc=loc, targets=parts[0][0].targets)
        r = pb.metrics.regression_report(loc, pred.targets, sigma.expand_as(loc))
        val = [_predict_cal(task, mo, g) for mo, g in members]
        vloc = torch.cat([v.loc for v in val])

        def nll_at(tt: float) -> float:
            return pb.metrics.regression_report(vloc, val[0].targets, (tt * sigma).expand_as(vloc))[
                "nll"
            ]

        t = _argmin_log(nll_at)
        r_ts = pb.metrics.regression_report(loc, pred.targets, (t * sigma).expand_as(loc))
        return {
            "ensemble": {
                "rmse": r["rmse"],
                "nll": r["nll"],
                "fit_s": total,
                "predict_s": predict_s,
            },
            "ensemble+ts": {
                "rmse": r_ts["rmse"],
                "nll": r_ts["nll"],
                "temperature": t,
                "fit_s": total,
            },
        }
    pred = _stack([p[0] for p in parts])
    ood = {k: _stack([p[1][k] for p in parts]) for k in task.ood}
    val_pred = _stack([_predict_cal(task, mo, g) for mo, g in members])
    t = fit_temperature(val_pred)
    ts = _scores(apply_temperature(pred, t), {k: apply_temperature(v, t) for k, v in ood.items()})
    return {
        "ensemble": {**_scores(pred, ood), "fit_s": total, "predict_s": predict_s},
        "ensemble+ts": {**ts, "temperature": t, "fit_s": total},
    }


def _argmin_log(f: Any, low: float = 0.05, high: float = 20.0) -> float:
    grid = [
        math.exp(math.log(low) + i * (math.log(high) - math.log(low)) / 200) for i in range(201)
    ]
    return min(grid, key=f)


def _predict_cal(task: Task, model: Any, guide: Any) -> Prediction:
    return pb.predict(model, guide, task.calibration, num_samples=task.num_samples, seed=0)


def fit_laplace_torch(task: Task, model: Any, guide: Any) -> tuple[Any, float]:
    """laplace-torch's last-layer Kronecker Laplace on the MAP network (adapter merged), with
    its documented defaults: ``fit`` on the training loader, ``optimize_prior_precision(
    method="marglik")`` (regression: the MAP's learned noise as ``sigma_noise``); and the
    seconds of the fit and the prior precision (the merge of the adapter not counted)."""
    from laplace import Laplace

    assert task.la_net is not None
    net = task.la_net(model, guide).eval()
    for p in net.parameters():
        p.requires_grad_(True)
    start = time.perf_counter()
    if task.kind == "regression":
        la = Laplace(
            net,
            "regression",
            subset_of_weights="last_layer",
            hessian_structure="kron",
            sigma_noise=float(model.likelihood.obs_scale),
        )
    else:
        la = Laplace(
            net, "classification", subset_of_weights="last_layer", hessian_structure="kron"
        )
    la.fit(task.la_data(task.train))
    with warnings.catch_warnings():  # its notice that the default link is probit (we use it)
        warnings.filterwarnings("ignore", message="By default `link_approx` is `probit`")
        la.optimize_prior_precision(method="marglik", pred_type="glm", link_approx="probit")
    return la, time.perf_counter() - start


def _laplace_torch(task: Task, model: Any, guide: Any, map_fit_s: float) -> dict[str, Any]:
    """laplace-torch's last-layer Kronecker Laplace with marginal-likelihood prior precision,
    with its documented defaults, on the MAP network (adapter merged): ``fit`` on the training
    loader (N = the training set), ``optimize_prior_precision(method="marglik")``, the GLM
    predictive with the probit link. Also ``laplace-torch+ts`` (that predictive with a
    temperature fitted on the calibration split) and, for classification, ``laplace-torch-gs``
    (the prior precision grid-searched on the calibration split's NLL, as laplace-torch's
    README example does on a validation loader; not on the MiniLM tasks,
    ``Task.la_gridsearch``). Diagnostics kept: the
    prior precisions (and the MAP's own prior precision ``1 / prior_scale²``), the log marginal
    likelihood, the mean predictive variance of the logits (classification) or of f
    (regression) on the validation split."""
    la, fit_s = fit_laplace_torch(task, model, guide)

    def run(loader: Any) -> tuple[Prediction, float]:
        """The predictive on ``loader`` and the mean variance of f (per logit) under it."""
        outs, ys, variances = [], [], []
        for batch in loader:
            if isinstance(batch, dict):
                x, y = batch, batch.get("labels")
            elif isinstance(batch, (list, tuple)) and len(batch) == 2:
                x, y = batch
            else:
                x, y = (batch[0] if isinstance(batch, (list, tuple)) else batch), None
            if task.kind == "regression":
                f_mu, f_var = la(x)
                outs.append((f_mu.detach().reshape(-1), f_var.detach().reshape(-1)))
                variances.append(f_var.detach().reshape(-1))
            else:
                outs.append(la(x, pred_type="glm", link_approx="probit").detach())
                _, f_var = la._glm_predictive_distribution(x)  # (n, C, C)
                variances.append(f_var.detach().diagonal(dim1=-2, dim2=-1).reshape(-1))
            if y is not None:
                ys.append(y)
        targets = torch.cat(ys) if ys else None
        mean_var = float(torch.cat(variances).mean())
        if task.kind == "regression":
            mu = torch.cat([o[0] for o in outs]).unsqueeze(0)
            var = torch.cat([o[1] for o in outs]).unsqueeze(0)
            pred = Prediction(loc=mu, scale=float(la.sigma_noise), loc_var=var, targets=targets)
            return pred, mean_var
        probs = torch.cat(outs).clamp_min(1e-12)
        return Prediction(log_probs=probs.log().unsqueeze(0), targets=targets), mean_var

    def predict_all() -> tuple[Prediction, dict[str, Prediction], float, float]:
        start = time.perf_counter()
        pred, mean_var = run(task.validation)
        seconds = time.perf_counter() - start
        ood = {k: run(v)[0] for k, v in task.ood.items()}
        return pred, ood, seconds, mean_var

    prior_scale = getattr(model, "prior_scale", None)
    diagnostics = {
        "map_prior_precision": (
            1.0 / float(prior_scale) ** 2 if isinstance(prior_scale, (int, float)) else None
        ),
    }
    with torch.no_grad():
        pred, ood, predict_s, mean_var = predict_all()
    marglik = float(la.log_marginal_likelihood().detach())
    out: dict[str, Any] = {
        "laplace-torch": {
            **_scores(pred, ood),
            "fit_s": map_fit_s + fit_s,
            "posthoc_s": fit_s,
            "predict_s": predict_s,
            "prior_precision": float(la.prior_precision.mean()),
            "log_marglik": marglik,
            "f_var_mean": mean_var,
            **diagnostics,
        }
    }
    with torch.no_grad():
        cal_pred, _ = run(task.calibration)
    t = fit_temperature(cal_pred)
    out["laplace-torch+ts"] = {
        **_scores(apply_temperature(pred, t), {k: apply_temperature(v, t) for k, v in ood.items()}),
        "temperature": t,
        "fit_s": map_fit_s + fit_s,
    }
    if task.kind == "classification" and task.la_gridsearch:
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="By default `link_approx` is `probit`")
            la.optimize_prior_precision(
                method="gridsearch",
                pred_type="glm",
                link_approx="probit",
                val_loader=task.la_data(task.calibration),
            )
        gs_s = time.perf_counter() - start
        with torch.no_grad():
            pred, ood, predict_s, mean_var = predict_all()
        out["laplace-torch-gs"] = {
            **_scores(pred, ood),
            "fit_s": map_fit_s + fit_s + gs_s,
            "predict_s": predict_s,
            "prior_precision": float(la.prior_precision.mean()),
            "f_var_mean": mean_var,
        }
    return out


# ------------------------------------------------------------------------------------ one run
def run_seed(
    task: Task,
    seed: int,
    families: list[str],
    members: int,
    save: Any = lambda out: None,
    laplace_torch: bool = True,
) -> dict[str, Any]:
    """Every method on one seed; ``save(out)`` after each (a long run keeps what it finished).
    Order: MAP (+ TS), laplace-torch (unless ``laplace_torch`` is false), the families
    (post-hoc ones from that MAP), and the deep ensemble last (M - 1 more MAP fits;
    ``members < 2``: no ensemble)."""
    out: dict[str, Any] = {}
    map_model, map_guide, info = fit_map(task, seed)
    pred, ood, predict_s = _predict(task, map_model, map_guide)
    out["map"] = {
        **_scores(pred, ood),
        **info,
        "predict_s": predict_s,
        "storage": _storage(map_guide),
    }
    if task.kind == "regression":
        out["map"]["sigma"] = float(map_model.likelihood.obs_scale)
    ts, t, cal_s = _with_ts(task, map_model, map_guide)
    out["map+ts"] = {**ts, "temperature": t, "fit_s": info["fit_s"] + cal_s, "predict_s": predict_s}
    map_state = copy.deepcopy(map_guide.state_dict())
    head = {k: v.detach().clone() for k, v in map_model.point_params.items()}
    logger.info("[%s seed %d] map: %s", task.name, seed, _short(out["map"]))
    save(out)
    anchors = [("laplace-torch", lambda: _laplace_torch(task, map_model, map_guide, info["fit_s"]))]
    ensemble = [
        (
            "ensemble",
            lambda: _ensemble(task, seed, [(map_model, map_guide)], info["fit_s"], members),
        )
    ]
    if laplace_torch:
        _anchors(task, seed, anchors, out)
        save(out)
    # variant rows: those of the families run, and any named in ``families`` itself
    variants = [
        name
        for name, st in task.settings.items()
        if name not in FAMILIES and (st.get("family") in families or name in families)
    ]
    for family in [*(f for f in families if f in FAMILIES), *variants]:
        if family == "map":
            continue
        if (task.name, family) in SKIP:
            out[family] = {"skipped": SKIP[(task.name, family)]}
            continue
        settings = task.settings.get(family, {})
        try:
            pyro.clear_param_store()
            init = None
            if settings.get("init") == "map":
                head_latent = bool(settings.get("head_latent"))
                map_guide.load_state_dict(map_state)
                # copied together when the head is made latent: init's model must be the model
                model, init = (
                    copy.deepcopy((map_model, map_guide))
                    if head_latent
                    else (copy.deepcopy(map_model), map_guide)
                )
                with torch.no_grad():
                    for k, v in head.items():
                        model.point_params[k].copy_(v)
                if head_latent:  # the MAP's trained head made latent post hoc
                    model.make_latent([task.head])
            else:
                model = task.build_model(family, 0)
            guide = pb.posterior(
                model, settings.get("family", family), init=init, **settings.get("options", {})
            )
            fi = _fit(task, model, guide, settings, 1000 * seed)
            if getattr(guide, "prior_structure", None) == "layerwise":
                fi["site_prior_precisions"] = guide.site_prior_precisions()
            if settings.get("select_prior_precision"):
                start = time.perf_counter()
                fi["prior_precision_evidence"] = guide.prior_precision
                pb.infer.select_prior_precision(
                    model, guide, task.calibration, num_samples=task.num_samples
                )
                fi["prior_precision"] = guide.prior_precision
                fi["fit_s"] += time.perf_counter() - start
            if init is not None:
                fi["fit_s"] += info["fit_s"]  # a post-hoc family's cost includes its MAP
            pred, ood, predict_s = _predict(task, model, guide)
            out[family] = {
                **_scores(pred, ood),
                **fi,
                "predict_s": predict_s,
                "storage": _storage(guide),
            }
            if task.kind == "regression":
                out[family]["sigma"] = float(model.likelihood.obs_scale)
            ts, t, cal_s = _with_ts(task, model, guide)
            out[f"{family}+ts"] = {**ts, "temperature": t, "fit_s": fi["fit_s"] + cal_s}
        except Exception as err:
            logger.error("[%s seed %d] %s failed: %s", task.name, seed, family, err)
            out[family] = {
                "error": f"{type(err).__name__}: {err}",
                "trace": traceback.format_exc()[-2000:],
            }
        logger.info("[%s seed %d] %s: %s", task.name, seed, family, _short(out[family]))
        save(out)
    if members >= 2:
        _anchors(task, seed, ensemble, out)
        save(out)
    return out


def _anchors(task: Task, seed: int, anchors: list[tuple[str, Any]], out: dict[str, Any]) -> None:
    for name, fn in anchors:
        try:
            res = fn()
            out.update(res if name in ("ensemble", "laplace-torch") else {name: res})
        except Exception as err:  # an anchor that fails is reported, not fatal
            logger.error("[%s seed %d] %s failed: %s", task.name, seed, name, err)
            out[name] = {
                "error": f"{type(err).__name__}: {err}",
                "trace": traceback.format_exc()[-2000:],
            }
        logger.info("[%s seed %d] %s: %s", task.name, seed, name, _short(out.get(name, {})))


def _short(record: dict[str, Any]) -> str:
    keys = ("accuracy", "rmse", "nll", "ece", "fit_s", "error", "skipped")
    return " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in record.items()
        if k in keys
    )


def _record(
    results: dict[str, Any],
    name: str,
    task: Task,
    settings: dict[str, Any],
    runs: dict[str, Any],
    members: int,
) -> None:
    results["tasks"][name] = {
        "kind": task.kind,
        "info": dict(task.info),
        "fit": {"epochs": task.epochs, "lr": task.lr, "patience": task.patience},
        "num_samples": task.num_samples,
        "members": members,
        "settings": settings,
        "runs": runs,
    }


def _git_state(root: Path = HERE.parents[1]) -> dict[str, Any]:
    """The commit the run used and the library files that differed from it (uncommitted work
    in a shared tree changes what a run measures). Git runs in the repository ``root``: its
    pathspec ``pyrobayes`` is relative to the working directory (from ``benchmarks/suite``
    it named nothing, and every run before 2026-12-05 recorded ``modified: []``)."""
    import subprocess

    def git(*args: str) -> str:
        try:
            done = subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=30, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout.rstrip("\n")  # porcelain lines start with a status column

    return {
        "commit": git("rev-parse", "HEAD"),
        "modified": git("status", "--porcelain", "--", "pyrobayes").splitlines(),
    }


def _variant_names() -> list[str]:
    """The variant rows a task may run (each fits a family under other settings)."""
    from tasks import MLP_SETTINGS, text_settings

    names = [n for n, st in MLP_SETTINGS.items() if "family" in st]
    try:
        names += [n for n, st in text_settings().items() if "family" in st]
    except ImportError:  # the text tasks' extras are missing; their variants are too
        pass
    return sorted(set(names))


def provenance(script: str, argv: list[str] | None) -> dict[str, Any]:
    """When and how a result was made: the date, ``script`` with its arguments, the commit."""
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([script, *(argv if argv is not None else sys.argv[1:])]),
        "git": _git_state(),
    }


def fit_map(task: Task, seed: int) -> tuple[Any, Any, dict[str, Any]]:
    """The MAP of ``seed`` exactly as :func:`run_seed` fits it: model, guide, the fit's record."""
    pyro.clear_param_store()
    settings = task.settings.get("map", {})
    model = task.build_model("map", 0)
    guide = pb.posterior(model, "map", **settings.get("options", {}))
    return model, guide, _fit(task, model, guide, settings, 1000 * seed)


def _temperature_form() -> str:
    """``"pooled"`` where ``pb.calibrate`` tempers the averaged predictive (``pool=True``, its
    default), else ``"per draw"`` (a package before the pooled form)."""
    return "pooled" if "pool" in inspect.signature(pb.calibrate).parameters else "per draw"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tasks", nargs="+", default=["digits", "mnist", "diabetes"], choices=list(TASKS)
    )
    parser.add_argument(
        "--families",
        nargs="+",
        default=list(FAMILIES),
        help="families (each with its variant rows) or variant rows by name, e.g. laplace-head",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--members", type=int, default=4, help="M, the deep ensemble's size")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one seed (the tests)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-report", action="store_true", help="skip the markdown and plot")
    parser.add_argument(
        "--update-only",
        action="store_true",
        help="MAP (+ TS) and --families only, no laplace-torch and no ensemble: a result that "
        "only updates a finished one (merge.py --base keeps the base's anchors); implies "
        "--members 1 and --no-report",
    )
    args = parser.parse_args(argv)
    if args.update_only:
        args.members, args.no_report = 1, True
    torch.set_num_threads(args.threads)
    seeds = args.seeds[:1] if args.quick else args.seeds
    members = min(args.members, 2) if args.quick else args.members
    known = [*pb.available_guides(), *_variant_names()]
    unknown = [f for f in args.families if f not in known]
    if unknown:
        raise SystemExit(f"--families: unknown {unknown}; available: {known}")
    results: dict[str, Any] = {
        **provenance("benchmarks/suite/run.py", argv),
        "torch": torch.__version__,
        "pyro": pyro.__version__,
        # the laplace-torch anchors' version: 0.5 reset its grid-search metric between prior
        # precisions (0.3's accumulated over the grid, so laplace-torch-gs picked the grid's top)
        "laplace_torch": importlib.metadata.version("laplace-torch"),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.python_version()}",
        "threads": args.threads,
        "loadavg_start": os.getloadavg(),
        "quick": args.quick,
        "update_only": args.update_only,
        "members": members,
        "seeds": seeds,
        # how the +ts rows temper a predictive with draws (pyrobayes.calibrate's default form)
        "temperature": _temperature_form(),
        "auroc_score": "predictive entropy (auroc_<set>); max probability (auroc_maxprob_<set>); "
        "mutual information between label and parameters, posteriors with draws only "
        "(auroc_mi_<set>)",
        "tasks": {},
    }
    for name in args.tasks:
        runs = {}
        settings_used: dict[str, Any] = {}
        for seed in seeds:
            t0 = time.perf_counter()
            task = TASKS[name](seed, args.quick)
            settings_used = {
                f: {k: v for k, v in task.settings.get(f, {}).items() if k != "adapter_fn"}
                for f in [
                    *args.families,
                    *(v for v, st in task.settings.items() if st.get("family") in args.families),
                ]
            }

            def save(
                out: dict[str, Any],
                name: str = name,
                seed: int = seed,
                task: Task = task,
                runs: dict[str, Any] = runs,
                settings: dict[str, Any] = settings_used,
            ) -> None:
                runs[str(seed)] = out
                _record(results, name, task, settings, runs, members)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(results, indent=1, default=str))

            runs[str(seed)] = run_seed(
                task, seed, list(args.families), members, save, not args.update_only
            )
            logger.info("[%s seed %d] done in %.0f s", name, seed, time.perf_counter() - t0)
            _record(results, name, task, settings_used, runs, members)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1, default=str))  # after every seed
    results["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str))
    logger.info("wrote %s", args.out)
    if not args.no_report:
        import report

        report.write_report(results, args.out.with_suffix(".md"))
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("pyrobayes", "laplace"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # imported before any timed fit: a run that skips the laplace-torch anchor (--update-only)
    # otherwise charged laplace-torch's import (~2 s) to its first Laplace fit
    try:
        import laplace  # noqa: F401
    except ImportError:  # without the laplace extra the Laplace rows fail and say so
        pass
    main()
