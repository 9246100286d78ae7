"""Two checks of the suite's anchors on digits (issue 27): is temperature scaling fitted right,
and is laplace-torch's last-layer Laplace used right?

For each seed the MAP is fitted exactly as ``run.py`` fits it (same task, settings and seed), then

* **temperature scaling** - ``pb.calibrate`` on the calibration split against a 301-point grid
  over ``log T`` in [-1.5, 1.5] (does the optimiser find the calibration NLL's minimum?); the
  calibration NLL at ``T = 1`` and at the fitted ``T``; the validation NLL at ``T = 1`` and at
  the fitted ``T``, and - for the diagnosis only, never used by the suite - the temperature the
  validation split itself would pick; the number of misclassified images in each split;
* **laplace-torch** - ``Laplace(net, "classification", subset_of_weights="last_layer",
  hessian_structure="kron")``, ``fit`` on the training loader, ``optimize_prior_precision(
  method="marglik", pred_type="glm", link_approx="probit")`` (its defaults): the prior
  precision it picks against the MAP's own prior precision (``1 / prior_scale²``), its log
  marginal likelihood at a few prior precisions, and at each the validation NLL and the mean
  variance of a logit under the GLM predictive; the norm of the last layer's input features
  (a logit's variance is ``φᵀ Σ φ``: large features and a weak prior make it large).

Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/suite/diagnose.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run  # noqa: E402
import tasks  # noqa: E402

import pyrobayes as pb  # noqa: E402
from pyrobayes.calibration import set_temperature, tempered_nll  # noqa: E402

logger = logging.getLogger("suite.diagnose")
OUT = HERE.parents[0] / "results" / "suite" / "diagnostics.json"
PRECISIONS = (0.1, 1.0, 10.0, 100.0, 1000.0)


def _errors(pred: Any) -> int:
    return int((pred.log_probs.logsumexp(0).argmax(-1) != pred.targets).sum())


def temperature_check(task: Any, model: Any, guide: Any) -> dict[str, Any]:
    """The fitted temperature against a grid, and what it does on each split."""
    cal = pb.predict(model, guide, task.calibration, num_samples=1, seed=0)
    val = pb.predict(model, guide, task.validation, num_samples=1, seed=0)
    t_fit = pb.calibrate(model, guide, task.calibration, num_samples=task.num_samples, seed=0)
    set_temperature(guide, None)
    grid = [math.exp(-1.5 + 3.0 * i / 300) for i in range(301)]
    cal_curve = [float(tempered_nll(cal, cal.targets, t)) for t in grid]
    val_curve = [float(tempered_nll(val, val.targets, t)) for t in grid]
    return {
        "t_fitted": t_fit,
        "t_grid_calibration": grid[min(range(301), key=cal_curve.__getitem__)],
        "calibration_nll_t1": float(tempered_nll(cal, cal.targets, 1.0)),
        "calibration_nll_fitted": float(tempered_nll(cal, cal.targets, t_fit)),
        "validation_nll_t1": float(tempered_nll(val, val.targets, 1.0)),
        "validation_nll_fitted": float(tempered_nll(val, val.targets, t_fit)),
        "t_validation_optimal": grid[min(range(301), key=val_curve.__getitem__)],
        "validation_nll_optimal": min(val_curve),
        "errors_calibration": _errors(cal),
        "errors_validation": _errors(val),
        "num_calibration": len(cal.targets),
        "num_validation": len(val.targets),
    }


def laplace_check(task: Any, model: Any, guide: Any) -> dict[str, Any]:
    """laplace-torch's marginal-likelihood prior precision and its predictive's spread."""
    from laplace import Laplace

    assert task.la_net is not None
    net = task.la_net(model, guide).eval()
    for p in net.parameters():
        p.requires_grad_(True)
    la = Laplace(net, "classification", subset_of_weights="last_layer", hessian_structure="kron")
    loader = task.la_data(task.train)
    la.fit(loader)
    la.optimize_prior_precision(method="marglik", pred_type="glm", link_approx="probit")
    chosen = float(la.prior_precision.mean())
    xv = torch.cat([b[0] for b in task.validation])
    yv = torch.cat([b[1] for b in task.validation])
    with torch.no_grad():
        features = net[:-1](xv)
    sweep = []
    for precision in (chosen, *PRECISIONS):
        prior = torch.tensor([precision])
        marglik = float(la.log_marginal_likelihood(prior_precision=prior).detach())
        la.prior_precision = prior
        with torch.no_grad():
            probs = la(xv, pred_type="glm", link_approx="probit")
            _, f_var = la._glm_predictive_distribution(xv)
        nll = float(-probs.clamp_min(1e-12).log().gather(1, yv[:, None]).mean())
        sweep.append(
            {
                "prior_precision": precision,
                "log_marglik": marglik,
                "validation_nll": nll,
                "logit_var_mean": float(f_var.diagonal(dim1=-2, dim2=-1).mean()),
                "max_prob_mean": float(probs.max(-1).values.mean()),
            }
        )
    with torch.no_grad():
        map_nll = float(torch.nn.functional.cross_entropy(net(xv), yv))
    return {
        "n_data": len(loader.dataset),
        "prior_precision_marglik": chosen,
        "map_prior_precision": 1.0 / float(model.prior_scale) ** 2,
        "feature_norm_mean": float(features.norm(dim=-1).mean()),
        "head_weight_norm": float(net[-1].weight.detach().norm()),
        "map_validation_nll": map_nll,
        "sweep": sweep,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the tests)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out: dict[str, Any] = {
        **run.provenance("benchmarks/suite/diagnose.py", argv),
        "quick": args.quick,
        "digits": {},
    }
    for seed in args.seeds:
        task = tasks.digits(seed, args.quick)
        model, guide, _ = run.fit_map(task, seed)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="By default `link_approx` is `probit`")
            out["digits"][str(seed)] = {
                "temperature": temperature_check(task, model, guide),
                "laplace_torch": laplace_check(task, model, guide),
            }
        logger.info("seed %d: %s", seed, json.dumps(out["digits"][str(seed)])[:400])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main()
