"""One-row predictives of a posterior with spread report no mutual information, not 0.

Laplace's probit predictive and a mixture's logit average give one row per example: its mutual
information is 0 by construction and an MI-based OOD AUROC 0.5, whatever the posterior. Like a
pooled temperature's row (tests/test_calibration.py), they are marked (``pooled_by``) and
``metrics.report`` gives NaN with a warning that names the option that keeps the draws.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import pyrobayes as pb
from tests.common import teacher_mlp


def _problem() -> tuple[pb.models.FineTuneModel, DataLoader, list, list]:
    model, x, y = teacher_mlp(200, num_data=150)
    train = DataLoader(TensorDataset(x[:150], y[:150]), batch_size=50, shuffle=True)
    test = [(x[150:], y[150:])]
    ood = [(5.0 * torch.randn(50, 4, generator=torch.Generator().manual_seed(1)),)]
    return model, train, test, ood


def _report(model, guide, test, ood) -> tuple[object, dict[str, float]]:
    pred = pb.predict(model, guide, test, num_samples=8)
    return pred, pb.metrics.report(pred, pred.targets, ood_probs=pb.predict(model, guide, ood))


def test_laplace_probit_reports_nan_mutual_information_and_says_why() -> None:
    model, train, test, ood = _problem()
    guide = pb.posterior(model, "laplace", prior_precision=0.1)
    pb.fit(model, guide, train, epochs=3, lr=1e-2, seed=0)
    pred, glm = _report(model, guide, test, ood)  # Monte Carlo draws: MI is measured
    assert pred.pooled_by is None and glm["mutual_information"] > 0
    guide.pred_type = "probit"
    with pytest.warns(UserWarning, match=r"probit approximation .*pred_type='glm'"):
        pred, probit = _report(model, guide, test, ood)
    assert pred.num_samples == 1 and "probit" in str(pred.pooled_by)
    assert math.isnan(probit["mutual_information"]) and math.isnan(probit["auroc_mi"])
    assert math.isfinite(probit["auroc_entropy"]) and math.isfinite(probit["nll"])


def test_a_mixtures_logit_average_reports_nan_mutual_information() -> None:
    model, train, test, ood = _problem()
    guide = pb.posterior(model, "ibdr", num_particles=4, init_scale=0.1)
    pb.fit(model, guide, train, epochs=2, lr=1e-2, seed=0)
    pred, probs = _report(model, guide, test, ood)
    assert pred.pooled_by is None and probs["mutual_information"] > 0
    guide.average = "logits"
    with pytest.warns(UserWarning, match=r"averaged logits .*average='probs'"):
        pred, logits = _report(model, guide, test, ood)
    assert pred.num_samples == 1 and pred.pooled_by is not None
    assert math.isnan(logits["mutual_information"]) and math.isnan(logits["auroc_mi"])


def test_one_draw_of_a_posterior_with_spread_reports_no_mutual_information():
    """``predict(..., num_samples=1)`` of a mean-field posterior gave ``mutual_information``
    0.0, by construction (one draw has no spread across draws), where S = 32 gave 8.6e-4 on
    digits, and ``auroc_mi`` was already NaN for it. A MAP's one draw keeps its exact 0."""
    import math

    import pyrobayes as pb
    from pyrobayes.testing import tiny_problem

    model, batches = tiny_problem(seed=0)
    guide = pb.posterior(model, "meanfield")
    pb.fit(model, guide, batches, epochs=2, lr=1e-2)
    one = pb.predict(model, guide, batches, num_samples=1, seed=0)
    assert "one draw of a posterior with spread" in (one.pooled_by or "")
    assert math.isnan(pb.metrics.report(one, one.targets)["mutual_information"])
    many = pb.predict(model, guide, batches, num_samples=8, seed=0)
    assert many.pooled_by is None
    assert pb.metrics.report(many, many.targets)["mutual_information"] > 0
    point = pb.posterior(model, "map")
    pb.fit(model, point, batches, epochs=1, lr=1e-2)
    map_pred = pb.predict(model, point, batches)
    assert map_pred.pooled_by is None
    assert pb.metrics.report(map_pred, map_pred.targets)["mutual_information"] == 0.0
