"""Gaussian-likelihood (regression) edge cases on the evaluation paths.

Held-out targets that are NaN, ±inf or bool are refused by name on every path that scores them
(predict, the metrics, calibrate, fit_temperature, the ArviZ export, diagnose); ``report`` scores
a regression prediction's OOD inputs by its predictive variance and refuses what it cannot use;
the export's observed targets have the shape of its log-likelihood and predictive draws; a
network whose output was squeezed to 0-dim, and a calibration at a bound of T, are explained in
regression terms.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import arviz as az
import pytest
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.calibration import fit_temperature, tempered_nll
from pyrobayes.metrics import ood_auroc, regression_report, report
from pyrobayes.models import FineTuneModel, LoRAXS
from pyrobayes.models.likelihoods import Gaussian, check_gaussian_targets
from pyrobayes.predictive import Prediction

from .common import mlp_problem, split_batches

ROOT = Path(__file__).resolve().parents[1]
NON_FINITE = re.compile(r"non-finite values \(\d+ NaN, \d+ inf of \d+\) at examples \[3\]")


def _problem(outputs: int = 1, obs_scale: float = 0.3, num_data: int = 40, seed: int = 0):
    """An MLP 4 -> 8 -> ``outputs`` with a rank-2 LoRA-XS core on the first layer and a point
    head, standard-normal targets ``(N,)`` (one output) or ``(N, outputs)``."""
    return mlp_problem(
        (4, 8, outputs),
        LoRAXS(rank=2, target_modules=["0"]),
        num_data=num_data,
        seed=seed,
        data_seed=seed + 1,
        likelihood="gaussian",
        obs_scale=obs_scale,
        trainable_modules=["2"],
    )


def _fitted(outputs: int = 1, obs_scale: float = 0.3, family: str = "meanfield"):
    prob = _problem(outputs, obs_scale)
    guide = pb.posterior(prob.model, family)
    pb.fit(prob.model, guide, split_batches(prob.x, prob.y, 20), epochs=2, lr=1e-2, seed=0)
    return prob, guide


def _with_bad(y: torch.Tensor, value: float, index: int = 23) -> torch.Tensor:
    """``y`` with ``value`` at example ``index`` (example 3 of the second batch of 20)."""
    y = y.clone()
    y[index] = value
    return y


# ------------------------------------------------------------------ 1. non-finite held-out targets
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("family", ["meanfield", "laplace"])  # laplace: the linearised predict
def test_predict_refuses_non_finite_held_out_targets(value, family):
    prob, guide = _fitted(family=family)
    data = split_batches(prob.x, _with_bad(prob.y, value), 20)
    with pytest.raises(ValueError, match=NON_FINITE) as err:
        pb.predict(prob.model, guide, data, num_samples=4)
    assert "drop those examples" in str(err.value)
    assert str(err.value).startswith("predict: batch 1: ")  # the second batch of 20


def test_the_export_and_diagnose_refuse_non_finite_targets_naming_the_batch():
    prob, guide = _fitted()
    data = split_batches(prob.x, _with_bad(prob.y, math.nan), 20)
    with pytest.raises(ValueError, match=r"^batch 1 of the data: Gaussian likelihood: "):
        pb.to_inference_data(prob.model, guide, data, num_samples=4)
    # diagnose read the NaN log-likelihood as "k-hat undefined", blaming the guide
    with pytest.raises(ValueError, match=NON_FINITE):
        pb.diagnose(prob.model, guide, data, num_samples=8)


def test_calibrate_refuses_non_finite_targets_with_the_likelihoods_message():
    prob, guide = _fitted()
    data = split_batches(prob.x, _with_bad(prob.y, math.nan), 20)
    # (was torch's "Expected value argument ... within the support (Real())")
    with pytest.raises(ValueError, match=NON_FINITE):
        pb.calibrate(prob.model, guide, data, num_samples=4)
    assert pb.calibration.temperature(guide) == 1.0


def test_the_metrics_refuse_non_finite_targets():
    prob, guide = _fitted()
    pred = pb.predict(prob.model, guide, split_batches(prob.x, prob.y, 20), num_samples=4)
    bad = _with_bad(pred.targets, math.nan)
    scores = [
        lambda: pb.metrics.gaussian_rmse(pred.loc, bad),  # was a silent NaN
        lambda: regression_report(pred.loc, bad),  # was {"rmse": nan}
        lambda: report(pred, bad),  # was torch's support error
        lambda: fit_temperature(pred, bad),
        lambda: tempered_nll(pred, bad, 1.0),
    ]
    for score in scores:
        with pytest.raises(ValueError, match="non-finite values"):
            score()


def test_a_linearised_predict_refuses_non_finite_targets():
    pytest.importorskip("laplace")
    prob, guide = _fitted(family="laplace")
    data = split_batches(prob.x, _with_bad(prob.y, math.inf), 20)
    with pytest.raises(ValueError, match=NON_FINITE):
        pb.predict(prob.model, guide, data)


def test_the_training_hot_path_leaves_the_finiteness_check_to_the_batch_check():
    # Gaussian.log_prob (the batched log-likelihood) costs no synchronisation: the training
    # batch's check refuses NaN targets before it (split_training_batch), check_targets after
    lik = Gaussian(0.5)
    params = torch.zeros(2, 3)
    targets = torch.tensor([0.0, math.nan, 1.0])
    assert lik.log_prob(params, targets)[:, 1].isnan().all()
    with pytest.raises(ValueError, match="non-finite"):
        lik.check_targets(params, targets)
    assert check_gaussian_targets(targets, (3,), finite=False) is targets


# ------------------------------------------------------------------ 2. report's OOD scores
def _regression_prediction(loc: torch.Tensor, scale: float = 0.5, **kw) -> Prediction:
    return Prediction(loc=loc, scale=scale, targets=torch.zeros(loc.shape[1:]), **kw)


def test_report_scores_regression_ood_inputs_by_the_predictive_variance():
    prob, guide = _fitted()
    ood_x = 5 * prob.x + 10
    pred = pb.predict(prob.model, guide, split_batches(prob.x, prob.y, 20), num_samples=8)
    ood = pb.predict(prob.model, guide, [ood_x], num_samples=8)
    result = report(pred, pred.targets, ood_probs=ood)
    assert set(result) == {"rmse", "nll", "auroc_variance"}
    # the mixture's variance: σ² plus the draws' variance of the means (1/S, the mixture's)
    variance = [p.loc.var(0, unbiased=False) + 0.3**2 for p in (pred, ood)]
    assert result["auroc_variance"] == ood_auroc(*variance)
    assert result["rmse"] == regression_report(pred.loc, pred.targets, 0.3)["rmse"]


def test_the_regression_ood_score_is_the_total_variance_averaged_over_outputs():
    # two examples each, three draws, two outputs. In-distribution: example 0's means do not
    # move, example 1's spread by [-1, 0, 1] on both outputs (variance 2/3 each). OOD: spreads
    # of 2x and 3x that on output 0 only (variances 8/3 and 6, 0 on output 1). Averaged over
    # the outputs OOD (4/3, 3) > in-distribution (0, 2/3): the AUROC is exactly 1 (output 1
    # alone would rank them the other way).
    base = torch.tensor([-1.0, 0.0, 1.0]).reshape(3, 1, 1)  # variance 2/3 over the draws
    ident = torch.cat([0 * base.expand(3, 1, 2), base.expand(3, 1, 2)], 1)  # (3, 2, 2)
    ood_spread = torch.cat([2 * base, 0 * base], -1)  # per output variance 8/3 and 0
    ood = torch.cat([ood_spread, torch.cat([3 * base, 0 * base], -1)], 1)  # (3, 2, 2)
    id_mean_var = torch.tensor([0.0, 2 / 3])  # per example, averaged over the 2 outputs
    ood_mean_var = torch.tensor([8 / 3 / 2, 6 / 2])
    assert id_mean_var.max() < ood_mean_var.min()
    result = report(
        _regression_prediction(ident), torch.zeros(2, 2), ood_probs=_regression_prediction(ood)
    )
    assert result["auroc_variance"] == 1.0
    # a closed-form variance (loc_var, the linearised predictive) counts: one draw, the OOD
    # example's loc_var larger
    one = torch.zeros(1, 2)
    id_pred = _regression_prediction(one, loc_var=torch.tensor([[0.1, 0.2]]))
    ood_pred = _regression_prediction(one, loc_var=torch.tensor([[0.3, 0.15]]))
    # scores 0.1, 0.2 against 0.3, 0.15 (σ² added to all): pairs (0.3 > 0.1, 0.2), (0.15 > 0.1)
    assert report(id_pred, torch.zeros(2), ood_probs=ood_pred)["auroc_variance"] == 0.75


@pytest.mark.parametrize(
    "ood, error, message",
    [
        ("not a prediction", TypeError, "got a str"),
        (torch.rand(4, 5, 3), TypeError, "got a tensor of shape"),
        (Prediction(log_probs=torch.zeros(1, 5, 2)), TypeError, "classification prediction"),
        (Prediction(loc=torch.zeros(2, 5, 3), scale=0.5), ValueError, "same event shape"),
    ],
)
def test_report_refuses_ood_probs_it_cannot_score(ood, error, message):
    pred = _regression_prediction(torch.randn(2, 4))
    with pytest.raises(error, match=message):
        report(pred, pred.targets, ood_probs=ood)


def test_report_gives_nan_for_a_regression_ood_score_without_epistemic_spread():
    pred = _regression_prediction(torch.randn(1, 4))  # one draw, no loc_var: σ² everywhere
    with pytest.warns(UserWarning, match="auroc_variance is NaN"):
        result = report(pred, pred.targets, ood_probs=_regression_prediction(torch.randn(1, 3)))
    assert math.isnan(result["auroc_variance"])


def test_report_warns_that_num_bins_does_not_apply_to_regression():
    pred = _regression_prediction(torch.randn(2, 4))
    with pytest.warns(UserWarning, match="num_bins=10 is ignored for a regression"):
        report(pred, pred.targets, num_bins=10)
    probs = torch.full((1, 4, 2), 0.5)
    assert report(probs, torch.tensor([0, 1, 0, 1]))["ece_bins"] == 15.0  # default unchanged


# ------------------------------------------------------------------ 3. export observed shape
@pytest.mark.filterwarnings(
    "ignore:Estimated shape parameter of Pareto distribution:UserWarning:arviz.stats.stats\\Z"
)
def test_the_export_stores_column_targets_in_the_likelihoods_shape():
    prob, guide = _fitted()
    data = split_batches(prob.x, prob.y.unsqueeze(-1), 20)  # (B, 1) targets, scalar output
    idata = pb.to_inference_data(prob.model, guide, data, num_samples=20)
    observed = dict(idata.observed_data["obs"].sizes)
    assert observed == {"obs_dim_0": 40}
    assert dict(idata.log_likelihood["obs"].sizes) == {"chain": 1, "draw": 20, **observed}
    assert dict(idata.posterior_predictive["obs"].sizes) == {"chain": 1, "draw": 20, **observed}
    assert az.loo_pit(idata, y="obs").shape == (40,)  # (failed: y_hat and y of equal rank)


# ------------------------------------------------------------------ 4. fit_temperature's targets
def test_fit_temperature_refuses_targets_in_another_shape():
    prob, guide = _fitted(outputs=3)
    pred = pb.predict(prob.model, guide, split_batches(prob.x, prob.y, 20), num_samples=4)
    assert pred.targets.shape == (40, 3)
    t = fit_temperature(pred, pred.targets)
    assert t == fit_temperature(pred)
    # (D, N): as many numbers, paired with the wrong means; was a different T silently
    with pytest.raises(
        ValueError, match=r"fit_temperature: .*shape \(3, 40\).*pass targets of shape \(40, 3\)"
    ):
        fit_temperature(pred, pred.targets.T.contiguous())
    with pytest.raises(ValueError, match=r"^tempered_nll: .*shape \(120,\)"):
        tempered_nll(pred, pred.targets.reshape(-1), t)
    labels = torch.tensor([0, 1, 1, 0, 1, 0])
    classified = Prediction(log_probs=torch.log_softmax(torch.randn(2, 6, 2), -1), targets=labels)
    assert fit_temperature(classified, labels.unsqueeze(-1)) == fit_temperature(classified)
    with pytest.raises(ValueError, match=r"^fit_temperature: labels of shape \(2, 3\)"):
        fit_temperature(classified, labels.reshape(2, 3))


# ------------------------------------------------------------------ 5. per-entry vs joint NLL
def test_report_scores_per_entry_where_the_export_scores_the_vector_as_the_docs_say():
    prob, guide = _fitted(outputs=3, family="map")
    data = split_batches(prob.x, prob.y, 20)
    pred = pb.predict(prob.model, guide, data)
    idata = pb.to_inference_data(prob.model, guide, data, num_samples=1)
    pointwise = torch.as_tensor(idata.log_likelihood["obs"].values).reshape(-1)  # (N,)
    # one draw: the report's per-entry NLL is the export's per-example NLL divided by D = 3
    nll = report(pred, pred.targets)["nll"]
    assert nll == pytest.approx(float(-pointwise.mean()) / 3, rel=1e-10)  # float64 rounding
    doc = " ".join((ROOT / "docs" / "methods" / "swag_laplace.md").read_text().split())
    assert "score the NLL per target entry" in doc and "D-vector jointly" in doc


# ------------------------------------------------------------------ 6. a squeezed network output
class _SqueezingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.l0(x))).squeeze()  # (B,), and () for B = 1


def test_a_squeezed_output_of_a_batch_of_one_is_explained():
    torch.manual_seed(0)
    model = FineTuneModel(
        _SqueezingNet(),
        LoRAXS(rank=2, target_modules=["l0"]),
        likelihood="gaussian",
        obs_scale=0.3,
        num_data=5,
        trainable_modules=["head"],
    )
    x, y = torch.randn(5, 4), torch.randn(5)
    guide = pb.posterior(model, "map")
    with pytest.raises(ValueError, match=r"0-dim output .*\(\.squeeze\(-1\)\)"):
        pb.fit(model, guide, split_batches(x, y, 4), epochs=1)  # batches of 4, then 1


class _SqueezingVectorNet(nn.Module):
    """Three outputs per example, ``.squeeze()``-ed: ``(B, 3)``, and ``(3,)`` for B = 1."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.l0(x))).squeeze()


@pytest.mark.parametrize("likelihood", ["gaussian", "categorical"])
@pytest.mark.parametrize("family", ["map", "laplace"])
def test_a_squeezed_vector_output_of_a_batch_of_one_is_not_read_as_several_examples(
    likelihood, family
):
    # before the check: the fit passed (the (3,) output of the last batch was read as three
    # scalar examples; with one draw its Gaussian log-density happened to be the right sum) and
    # predict then failed inside a reshape ("shape '[1, 1]' is invalid for input of size 3"),
    # Laplace's inside curvlinops ("expected >=2 dims")
    torch.manual_seed(0)
    options = {"obs_scale": 0.3} if likelihood == "gaussian" else {}
    model = FineTuneModel(
        _SqueezingVectorNet(),
        LoRAXS(rank=2, target_modules=["l0"]),
        likelihood=likelihood,
        num_data=9,
        trainable_modules=["head"],
        **options,
    )
    x = torch.randn(9, 4)
    y = torch.randn(9, 3) if likelihood == "gaussian" else torch.randint(0, 3, (9,))
    guide = pb.posterior(model, family)
    name = likelihood.capitalize()
    with pytest.raises(ValueError, match=rf"{name} likelihood: .*shape \(3,\) for a batch of one"):
        pb.fit(model, guide, split_batches(x, y, 4), epochs=2)  # batches of 4, 4, then 1
    # the same batches of more than one example fit and predict
    guide = pb.posterior(model, family)
    pb.fit(model, guide, split_batches(x[:8], y[:8], 4), epochs=2)
    pred = pb.predict(model, guide, split_batches(x[:8], y[:8], 4), num_samples=4)
    assert pred.targets.shape[0] == 8
    # and predicting on a batch of one is refused the same way
    with pytest.raises(ValueError, match=r"shape \(3,\) for a batch of one.*\.squeeze\(-1\)"):
        pb.predict(model, guide, split_batches(x[:1], y[:1], 1), num_samples=4)


# ------------------------------------------------------------------ 7. bool targets
def test_bool_targets_are_refused_by_the_likelihood():
    prob = _problem()
    guide = pb.posterior(prob.model, "map")
    with pytest.raises(ValueError, match=r"dtype torch\.bool.*y\.float\(\)"):
        pb.fit(prob.model, guide, split_batches(prob.x, prob.y > 0, 20), epochs=1)
    with pytest.raises(ValueError, match=r"dtype torch\.bool"):
        check_gaussian_targets(torch.ones(3, dtype=torch.bool), (3,))
    # integer targets (counts) stay accepted
    assert check_gaussian_targets(torch.arange(3), (3,)).dtype == torch.long


# ------------------------------------------------------------------ 8. T at a bound, in regression terms
@pytest.mark.parametrize(
    "obs_scale, end, advice",
    # MAP: T = RMS(residual) / σ; the standard-normal targets leave an RMS residual within
    # [0.3, 3] after 2 epochs, so T <= 3/1000 < 0.05 (lower end) and T >= 0.3/1e-4 > 20 (upper)
    [(1000.0, "lower", "far too large"), (1e-4, "upper", "far too small")],
)
def test_calibrate_at_a_bound_points_a_regression_at_its_noise_scale(obs_scale, end, advice):
    prob, guide = _fitted(obs_scale=obs_scale, family="map")
    with pytest.warns(UserWarning, match=rf"at the {end} end") as caught:
        pb.calibrate(prob.model, guide, split_batches(prob.x, prob.y, 20))
    message = " ".join(str(w.message) for w in caught)
    assert f"obs_scale) is probably {advice}" in message
    assert "predicted (almost) perfectly" not in message  # the classifier's wording


# ------------------------------------------------------------------ a learned σ far from the targets
def test_a_learned_noise_far_from_the_targets_scale_is_reported():
    # targets in the hundreds (diabetes' raw units), σ learned from softplus(ρ) = 1: Adam at
    # lr 1e-2 moved it to about 2 in 420 steps against residuals of 60-80, and the fit
    # followed r²/2σ², silently
    prob = _problem(obs_scale="learn")  # type: ignore[arg-type]
    guide = pb.posterior(prob.model, "map")
    with pytest.warns(
        UserWarning, match=r"standard deviation on the first batch is 1\d\d.*init_scale=1\d\d"
    ):
        pb.fit(prob.model, guide, split_batches(prob.x, 150.0 * prob.y, 20), epochs=1)
    # standardised targets: no warning (warnings are errors in the suite)
    prob = _problem(obs_scale="learn")  # type: ignore[arg-type]
    pb.fit(prob.model, pb.posterior(prob.model, "map"), split_batches(prob.x, prob.y, 20), epochs=1)


def test_nan_means_of_a_vector_output_name_the_examples_in_regression_terms():
    # the (S, N, D) means were laid flat before the NaN check: example 2 of 8 was named as
    # entry 7 of 24, and the message spoke of the ECE and Brier score regression has not
    means = torch.randn(2, 8, 3)
    means[:, 2, 1] = math.nan
    targets = torch.randn(8, 3)
    expected = r"means holds NaN at examples \[2\] \(of 8\): the RMSE and NLL would be NaN"
    for call in (
        lambda: regression_report(means, targets, 0.5),
        lambda: report(Prediction(loc=means, scale=0.5, targets=targets), targets),
        lambda: pb.metrics.gaussian_rmse(means[..., 1], targets[:, 1]),
    ):
        with pytest.raises(ValueError, match=expected) as info:
            call()
        assert "ECE" not in str(info.value) and "Brier" not in str(info.value)


def test_a_nan_ood_mean_of_a_regression_report_names_the_regression_score():
    """The NaN check of a regression report's OOD means said the 'NLL, ECE and Brier score'
    would be NaN: a regression has neither of the last two; the OOD score is the variance."""
    gen = torch.Generator().manual_seed(0)
    targets = torch.randn(6, generator=gen)
    pred = Prediction(loc=torch.randn(4, 6, generator=gen), scale=1.0, targets=targets)
    ood_loc = torch.randn(4, 5, generator=gen)
    ood_loc[:, 2] = float("nan")
    ood = Prediction(loc=ood_loc, scale=1.0)
    with pytest.raises(ValueError, match=r"examples \[2\].*OOD variance AUROC") as info:
        report(pred, targets, ood_probs=ood)
    assert "ECE" not in str(info.value)
