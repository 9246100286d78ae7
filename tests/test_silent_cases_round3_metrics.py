"""Silent cases, round 3, in the metrics, the diagnostics and the ArviZ export.

* A seed given as a NumPy integer (from ``np.random``, a config array) failed in torch's
  ``manual_seed`` with "an integer is required" (``to_inference_data``, ``diagnose``,
  ``ece_floor``): it is taken, as ``pyrobayes.predict`` takes it, and a float is named.
* ``diagnose`` of a Laplace guide (``pred_type="glm"``, its default, or ``"probit"``)
  reported the calibration of the network at each draw, not that of the linearised
  predictive ``pyrobayes.predict`` gives (another accuracy and ECE), silently.
* ``diagnose``'s ``num_predictive_samples`` below 0 dropped the calibration report silently, a
  float one failed deep in the evaluation ("slice indices must be integers"), and ``num_bins``
  < 1 was refused only after every draw had been evaluated; ``Diagnostics.num_samples`` was
  the S asked for, not the S drawn (a mixture rounds S up to whole rounds of its components).
* Metrics of a stack of no draws (``(0, N, C)``) gave a NaN ECE and Brier score, and "math
  domain error" for the NLL and the report.
* ``auroc`` of NumPy arrays or lists failed with ``AttributeError: ... has no attribute 'dim'``.
* The export's ``sites`` (and ``plot_posterior_summary``'s ``var_names``) given as one ``str``
  were read as one-letter names; ``max_site_numel=None`` failed in a comparison and ``-1``
  summarised every site and drew one draw per pass over the data.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import pyrobayes as pb
from pyrobayes import metrics
from pyrobayes.diagnostics import plot_posterior_summary, select_sites
from pyrobayes.models import LoRAXS
from pyrobayes.testing import tiny_problem

from .common import mlp_problem


def _fitted(family: str = "meanfield") -> tuple[Any, Any, list[Any]]:
    """The conformance kit's tiny classifier, fitted for two epochs by ``family``."""
    model, data = tiny_problem()
    guide = pb.posterior(model, family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny problem's fit notes are not the point
        pb.fit(model, guide, data, epochs=2, seed=0, progress=False)
    return model, guide, data


# ------------------------------------------------------------------ seeds as NumPy integers


@pytest.mark.parametrize("seed", [np.int64(3), np.int32(3)])
def test_a_numpy_integer_seed_is_taken_by_the_export_and_diagnose(seed: Any) -> None:
    model, guide, data = _fitted()
    idata = pb.to_inference_data(model, guide, data, num_samples=4, seed=seed)
    plain = pb.to_inference_data(model, guide, data, num_samples=4, seed=3)
    np.testing.assert_array_equal(
        idata.log_likelihood["obs"].values, plain.log_likelihood["obs"].values
    )
    assert idata.attrs["seed"] == 3
    result = pb.diagnose(model, guide, data, num_samples=30, seed=seed)
    assert result.elbo == pb.diagnose(model, guide, data, num_samples=30, seed=3).elbo


def test_a_float_seed_is_named_by_the_export_and_ece_floor() -> None:
    model, guide, data = _fitted()
    with pytest.raises(TypeError, match=r"^to_inference_data: seed must be an integer"):
        pb.to_inference_data(model, guide, data, num_samples=4, seed=1.0)
    with pytest.raises(TypeError, match=r"^diagnose: seed must be an integer"):
        pb.diagnose(model, guide, data, num_samples=4, seed=1.0)
    probs = torch.softmax(torch.randn(2, 10, 3, generator=torch.Generator().manual_seed(0)), -1)
    assert metrics.ece_floor(probs, seed=np.int64(5)) == metrics.ece_floor(probs, seed=5)
    with pytest.raises(TypeError, match=r"ece_floor: seed must be an integer.*pass seed=2"):
        metrics.ece_floor(probs, seed=2.0)


# ------------------------------------------------- diagnose of a linearised (Laplace) guide


def _laplace() -> tuple[Any, Any, list[Any]]:
    """A Laplace posterior over a tanh MLP's LoRA-XS cores, at a point away from 0 where the
    network is visibly non-linear (so the linearised predictive differs from the network's)."""
    prob = mlp_problem(
        (6, 10, 3),
        LoRAXS(rank=2, target_modules=["0", "2"]),
        num_data=40,
        seed=0,
        data_seed=0,
        trainable_modules=[],
    )
    data = [(prob.x[:20], prob.y[:20]), (prob.x[20:], prob.y[20:])]
    guide = pb.posterior(prob.model, "laplace", prior_precision=0.3)
    with torch.no_grad():
        for site in guide.sites:
            guide.loc(site).normal_(0.0, 1.0, generator=torch.Generator().manual_seed(5))
    pb.fit(prob.model, guide, data, epochs=0)
    return prob.model, guide, data


@pytest.mark.parametrize("pred_type", ["glm", "probit"])
def test_diagnose_reports_the_calibration_of_the_linearised_predictive(pred_type: str) -> None:
    model, guide, data = _laplace()
    guide.pred_type = pred_type
    prediction = pb.predict(model, guide, data, num_samples=40, seed=0)
    expected = metrics.report(prediction, prediction.targets)
    result = pb.diagnose(model, guide, data, num_samples=40, seed=0, num_predictive_samples=40)
    for key in ("accuracy", "nll", "ece", "brier", "entropy"):
        assert result.calibration[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-9), key
    assert result.calibration["num_predictive_samples"] == prediction.num_samples
    # the network's own predictive (pred_type="nn") is another one: the test can tell them apart
    guide.pred_type = "nn"
    network = pb.diagnose(model, guide, data, num_samples=40, seed=0, num_predictive_samples=40)
    assert abs(network.calibration["ece"] - expected["ece"]) > 1e-3
    assert network.khat == result.khat  # k-hat is the posterior's, whatever the predictive


# ------------------------------------------------------------------- diagnose's arguments


def test_diagnose_checks_its_calibration_arguments_before_the_draws(monkeypatch) -> None:
    import pyrobayes.diagnostics.khat as khat_module

    model, guide, data = _fitted()

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the draws were evaluated before the arguments were checked")

    monkeypatch.setattr(khat_module, "evaluate_draws", never)
    with pytest.raises(ValueError, match=r"diagnose: num_predictive_samples must be an integer"):
        pb.diagnose(model, guide, data, num_samples=30, num_predictive_samples=-1)
    with pytest.raises(TypeError, match=r"num_predictive_samples.*pass num_predictive_samples=5"):
        pb.diagnose(model, guide, data, num_samples=30, num_predictive_samples=5.0)
    with pytest.raises(ValueError, match=r"diagnose: num_bins must be an integer >= 1; got 0"):
        pb.diagnose(model, guide, data, num_samples=30, num_bins=0)


def test_diagnose_counts_the_draws_it_evaluated() -> None:
    model, guide, data = _fitted("ibdr")  # 4 particles: S = 30 is drawn as 32
    result = pb.diagnose(model, guide, data, num_samples=np.int64(30))
    assert result.log_ratios is not None
    assert result.num_samples == len(result.log_ratios) == 32
    assert type(result.num_samples) is int
    json.dumps(result.to_dict())  # "JSON-able" (a NumPy integer S was not)
    assert result.calibration["num_predictive_samples"] == 32


# ------------------------------------------------------------------------- no draws (S = 0)


@pytest.mark.parametrize(
    "metric",
    [
        lambda p, y: metrics.ece(p, y),
        lambda p, y: metrics.brier_score(p, y),
        lambda p, y: metrics.nll(p, y),
        lambda p, y: metrics.report(p, y),
    ],
    ids=["ece", "brier", "nll", "report"],
)
def test_metrics_of_no_draws_are_refused_not_nan(metric: Any) -> None:
    labels = torch.tensor([0, 1, 2, 1])
    with pytest.raises(ValueError, match=r"probs of shape \(0, 4, 3\) holds no draws \(S = 0\)"):
        metric(torch.zeros(0, 4, 3), labels)
    result = metric(torch.full((1, 4, 3), 1 / 3), labels)  # one draw is a predictive
    values = result.values() if isinstance(result, dict) else [result]
    assert all(math.isfinite(v) for v in values)


def test_ood_predictions_of_no_draws_or_classes_are_named() -> None:
    probs = torch.full((2, 4, 3), 1 / 3)
    labels = torch.tensor([0, 1, 2, 1])
    with pytest.raises(ValueError, match=r"ood_probs of shape \(0, 5, 3\) holds no draws"):
        metrics.report(probs, labels, ood_probs=torch.zeros(0, 5, 3))
    with pytest.raises(ValueError, match=r"holds no classes \(C = 0\)"):
        metrics.predictive_entropy(torch.zeros(2, 4, 0))


# ----------------------------------------------------------------- AUROC of NumPy arrays


@pytest.mark.parametrize(
    ("scores", "labels", "name"),
    [
        (np.array([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]), "scores"),
        ([0.1, 0.4, 0.35, 0.8], torch.tensor([0, 0, 1, 1]), "scores"),
        (torch.tensor([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1]), "labels"),
    ],
)
def test_auroc_names_arguments_that_are_not_tensors(scores: Any, labels: Any, name: str) -> None:
    with pytest.raises(TypeError, match=rf"auroc: {name} must be a torch.Tensor.*torch.as_tensor"):
        metrics.auroc(scores, labels)
    assert metrics.auroc(torch.as_tensor(scores), torch.as_tensor(labels)) == 0.75


# ---------------------------------------------------- one site as a str, max_site_numel


def test_one_site_may_be_named_by_a_str() -> None:
    model, guide, data = _fitted()
    site = next(iter(model.latent_sites))
    idata = pb.to_inference_data(model, guide, data, num_samples=4, sites=site)
    other = [s for s in model.latent_sites if s != site]
    assert list(idata.posterior.data_vars) == [site, *(f"{s}_norm" for s in other)]
    assert select_sites({site: torch.Size([2, 2])}, site) == ([site], [])


@pytest.mark.parametrize(
    ("value", "error"), [(None, TypeError), (-1, ValueError), (math.nan, ValueError)]
)
def test_max_site_numel_that_is_no_budget_is_refused(value: Any, error: type) -> None:
    model, guide, data = _fitted()
    with pytest.raises(error, match=r"max_site_numel must be a number >= 0.*float\('inf'\)"):
        pb.to_inference_data(model, guide, data, num_samples=4, max_site_numel=value)


@pytest.mark.parametrize("value", [math.inf, np.int64(10_000), 0])
def test_max_site_numel_numbers_are_taken(value: Any) -> None:
    model, guide, data = _fitted()
    idata = pb.to_inference_data(model, guide, data, num_samples=4, max_site_numel=value)
    assert idata.attrs["omitted_sites"] == ("" if value else ",".join(model.latent_sites))


def test_plot_posterior_summary_takes_one_variable_as_a_str(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    model, guide, data = _fitted()
    idata = pb.to_inference_data(model, guide, data, num_samples=4)
    site = next(iter(model.latent_sites))
    path = plot_posterior_summary(idata, tmp_path / "one.png", var_names=site)
    assert path.stat().st_size > 0
