"""Silent cases, round 4 (Laplace, its predictives and the predictive): a non-finite posterior
precision ``H + τ I`` is refused by every predictive, not only the linearised ones."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import pyrobayes as pb
from pyrobayes.fitted_head import HeadChangedWarning
from pyrobayes.testing import tiny_problem

_REFUSED = "the LaplaceGuide's posterior precision H + τ I is not usable"


def _quiet_fit(*args: Any, **kwargs: Any) -> pb.FitResult:
    """A set-up fit whose warnings (τ at its bound on a tiny problem) are not the point."""
    kwargs.setdefault("progress", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pb.fit(*args, **kwargs)


def _fitted_laplace(structure: str, **options: Any) -> tuple[Any, Any, list[Any]]:
    model, data = tiny_problem()
    guide = pb.posterior(model, "laplace", structure=structure, **options)
    _quiet_fit(model, guide, data, epochs=0)
    return model, guide, data


def _spoil(guide: Any, where: str, value: float) -> None:
    """Write ``value`` into site ``2.core``'s curvature or eigenbasis, or into τ."""
    with torch.no_grad():
        if where == "curvature":
            guide.curvature("2.core").view(-1)[1] = value
        elif where == "tau":
            guide.lap_prior_precision.fill_(value)
        else:
            guide.eigvecs("2.core")[0].view(-1)[0] = value


# ---------------------------------------------------------------- 1. pred_type="nn"
_CASES = [
    (structure, where, value)
    for structure in ("kron", "diag")
    for where in ("curvature", "tau", "eigvecs")
    for value in (float("inf"), float("nan"), -float("inf"))
    if not (structure == "diag" and where == "eigvecs")
]


@pytest.mark.parametrize("pred_type", ["nn", "glm", "probit"])
@pytest.mark.parametrize(("structure", "where", "value"), _CASES)
def test_a_non_finite_precision_is_refused_by_every_predictive(structure, where, value, pred_type):
    """pred_type="nn" sampled the network at draws of q, unchecked: a +inf Kronecker curvature
    or τ passes torch's check of the precision (inf > 0) and gave draws with no spread there (a
    finite, overconfident predictive, no word), an inf eigenvector NaN draws blamed on "a
    diverged fit", and a NaN one an error named after get_posterior, not predict."""
    model, guide, data = _fitted_laplace(structure)
    guide.pred_type = pred_type
    _spoil(guide, where, value)
    with pytest.raises(FloatingPointError) as caught:
        pb.predict(model, guide, data, num_samples=4)
    message = str(caught.value)
    assert message.startswith("predict: ") and _REFUSED in message
    assert "site '2.core'" in message and "tensor(" not in message


def test_sample_posterior_refuses_a_plus_inf_kronecker_curvature():
    """Every consumer of the draws (calibration, diagnostics, export), not only predict."""
    _, guide, _ = _fitted_laplace("kron")
    _spoil(guide, "curvature", float("inf"))
    with pytest.raises(FloatingPointError, match=r"LaplaceGuide\.sample_posterior: .*2\.core"):
        guide.sample_posterior(3)


# ---------------------------------------------------------------- 2. the curvature's data
def _laplace(structure: str = "kron") -> tuple[Any, Any, list[Any]]:
    model, data = tiny_problem()
    return model, pb.posterior(model, "laplace", structure=structure), data


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_empty_curvature_data_is_refused_by_name(structure):
    """laplace-torch's next(iter(loader)) raised a bare StopIteration (no message)."""
    model, guide, _ = _laplace(structure)
    with pytest.raises(ValueError, match="the curvature data hold no examples"):
        _quiet_fit(model, guide, [], epochs=0)
    assert not guide.is_fitted


def test_one_shot_curvature_data_is_refused():
    """A generator was counted (consumed) for len(dataset), then read empty."""
    model, guide, data = _laplace()
    with pytest.raises(TypeError, match="one-shot iterator .*Pass a list of batches"):
        _quiet_fit(model, guide, (b for b in data), epochs=0)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda x, y: (x, y + 10), r"class labels \[10, 11, 12\] outside 0 \.\. 2 \(3 classes\)"),
        (lambda x, y: (x, -1 - y), r"class labels \[-3, -2, -1\] outside 0 \.\. 2"),
        (lambda x, y: (x, y[:4]), r"labels of shape \(4,\) for 8 examples"),
        (lambda x, y: (x,), "carries no labels"),
        (lambda x, y: (x[:0], y[:0]), "holds no examples"),
    ],
)
def test_bad_curvature_labels_are_refused_by_batch(edit, expected):
    """Out-of-range labels gave laplace-torch's "IndexError: Target 10 is out of bounds" (a
    device-side assert on a GPU), too few labels curvlinops' "number of loss terms must be
    divisible", none an AttributeError on None, an empty batch a ZeroDivisionError."""
    model, guide, data = _laplace()
    spoiled = [data[0], edit(*data[1]), *data[2:]]
    with pytest.raises(ValueError, match="batch 1 of the curvature data .*" + expected):
        _quiet_fit(model, guide, spoiled, epochs=0)


# ---------------------------------------------------------------- 3. a regression's noise σ
def _regression(obs_scale: Any = "learn") -> tuple[Any, list[Any]]:
    from torch import nn

    from pyrobayes.models import FineTuneModel, LoRAXS
    from pyrobayes.models.likelihoods import Gaussian

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    model = FineTuneModel(
        net,
        LoRAXS(rank=2, target_modules=["0", "2"]),
        num_data=32,
        trainable_modules=["4"],
        likelihood=Gaussian(obs_scale),
    )
    x = torch.randn(32, 4)
    return model, [(x[i : i + 8], x[i : i + 8, 0]) for i in range(0, 32, 8)]


@pytest.mark.parametrize("structure", ["kron", "diag"])
@pytest.mark.parametrize("raw", [float("nan"), -1000.0])
def test_a_learned_noise_of_nan_or_zero_is_refused_by_the_curvature(structure, raw):
    """σ = softplus(ρ) NaN or 0 (ρ = -1000 underflows): laplace-torch scales the GGN by 1/σ². A Kronecker
    curvature was stored NaN/inf unchecked (the factors were checked before the scaling) and
    τ chosen on it (0.0087 for NaN, with no word); the failure came at predict, blamed on the
    training data."""
    model, data = _regression()
    guide = pb.posterior(model, "laplace", structure=structure)
    with torch.no_grad():
        model.likelihood.raw_scale.fill_(raw)
    with pytest.raises(FloatingPointError, match=r"noise σ \(obs_scale\) is (nan|0\.0)"):
        _quiet_fit(model, guide, data, epochs=0)
    assert not guide.is_fitted


def test_a_noise_that_overflows_the_kronecker_curvature_is_refused_at_the_fit():
    """σ = softplus(ρ) > 0 whose 1/σ² overflows (ρ = -50 in float32, -400 in float64): the
    scaled Kronecker curvature was stored inf without a check (the fit passed; predict refused
    it later, blaming the training data)."""
    model, data = _regression()
    guide = pb.posterior(model, "laplace", structure="kron")
    raw = -50.0 if model.likelihood.raw_scale.dtype == torch.float32 else -400.0
    with torch.no_grad():
        model.likelihood.raw_scale.fill_(raw)
    assert model.likelihood.obs_scale > 0
    with pytest.raises(FloatingPointError, match=r"curvature of site\(s\) \['0\.core'\]"):
        _quiet_fit(model, guide, data, epochs=0)


@pytest.mark.parametrize("pred_type", ["glm", "nn"])
def test_predict_refuses_a_nan_learned_noise(pred_type):
    """The prediction came back with scale = nan: every NLL and interval NaN, no word."""
    model, data = _regression()
    guide = pb.posterior(model, "laplace", pred_type=pred_type)
    _quiet_fit(model, guide, data, epochs=0)
    with torch.no_grad():
        model.likelihood.raw_scale.fill_(float("nan"))
    with warnings.catch_warnings():  # σ is a point parameter: "the head changed" (true)
        warnings.simplefilter("ignore", HeadChangedWarning)
        with pytest.raises(FloatingPointError, match=r"predict: the Gaussian likelihood's noise"):
            pb.predict(model, guide, data)


# ---------------------------------------------------------------- 4. the τ searches
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_the_evidence_search_refuses_a_log_evidence_non_finite_everywhere(value):
    """It returned τ = exp(-4.75) = 0.0087 for NaN everywhere (the golden section inside the
    first grid cell) with no warning, the lower bound for +inf."""
    from pyrobayes.infer.laplace import tune_prior_precision

    with pytest.raises(FloatingPointError, match="NaN or inf at every τ"):
        tune_prior_precision(lambda tau: value)


def test_select_prior_precision_refuses_a_non_finite_nll_at_every_factor(monkeypatch):
    """It kept the smallest factor (min over all-inf scores), with only an end-of-grid note."""
    from pyrobayes.infer import prior_precision

    model, guide, data = _fitted_laplace("kron")
    tau0 = guide.prior_precision
    monkeypatch.setattr(prior_precision, "_held_out_nll", lambda *a, **k: float("inf"))
    with pytest.raises(FloatingPointError, match="held-out NLL is NaN or inf at every factor"):
        prior_precision.select_prior_precision(model, guide, data)
    assert guide.prior_precision == tau0


# ---------------------------------------------------------------- 5. SWAG
def test_swag_step_refuses_a_non_finite_iterate():
    """A NaN iterate made the mean and M_2 NaN for good; the posterior failed much later in
    torch's Cholesky ("not positive-definite"), naming nothing."""
    from pyrobayes.infer.swag import SwagCollector

    collector = SwagCollector(3, 2)
    collector.step(torch.ones(3))
    with pytest.raises(FloatingPointError, match=r"swag_step: .*1 of 3 values NaN or inf"):
        collector.step(torch.tensor([1.0, float("nan"), 2.0]))
    assert int(collector.state.num_collected) == 1
    assert bool(torch.isfinite(collector.state.mean).all())
