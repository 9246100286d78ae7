"""Temperature scaling of the posterior predictive (``pyrobayes.calibrate``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.calibration import (
    POOL_BUFFER,
    TEMPERATURE_BUFFER,
    apply_temperature,
    fit_temperature,
    pooled,
    set_temperature,
    temperature,
    tempered_nll,
)
from pyrobayes.models import LoRAXS
from tests.common import tensor_loader

#: these tests check the predictive's arithmetic on guides at their initialisation, on purpose;
#: the never-fitted warning itself is tested in tests/test_fitted_head.py
pytestmark = pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")


def _teacher_problem(logit_scale: float, *, num: int = 3000, seed: int = 0, obs: str = "cat"):
    """A linear model whose frozen weight is ``logit_scale`` times the teacher's that drew the
    labels, ``y ~ softmax(W x)``: over-confident for ``logit_scale > 1``, under- below 1. The
    LoRA-XS core starts at zero (init_scale=0), so the MAP guide's prediction is the scaled
    teacher's and the population-optimal temperature is exactly ``logit_scale``."""
    g = torch.Generator().manual_seed(seed)
    d, c = 6, 4
    w = 1.5 * torch.randn(c, d, generator=g)
    x = torch.randn(num, d, generator=g)
    if obs == "cat":
        y = torch.multinomial(torch.softmax(x @ w.T, -1), 1, generator=g).squeeze(-1)
        out = c
    else:
        y = (x @ w[0]) + 0.5 * torch.randn(num, generator=g)
        out = 1
    lin = nn.Linear(d, out, bias=False)
    with torch.no_grad():
        lin.weight.copy_(logit_scale * (w if obs == "cat" else w[:1]))
    kwargs = {"likelihood": "gaussian", "obs_scale": 0.5 / logit_scale} if obs != "cat" else {}
    model = pb.models.FineTuneModel(
        nn.Sequential(lin),
        LoRAXS(rank=1, projection="svd", target_modules=["0"], init_scale=0.0),
        num_data=num,
        trainable_modules=[],
        **kwargs,
    )
    half = num // 2
    return model, tensor_loader(x[:half], y[:half], 500), tensor_loader(x[half:], y[half:], 500)


def _nll(model, guide, data) -> float:
    pred = pb.predict(model, guide, data, num_samples=8, seed=0)
    return pb.metrics.report(pred, pred.targets)["nll"]


@pytest.mark.parametrize("scale", [4.0, 0.3])
def test_calibrate_recovers_the_temperature_and_reduces_validation_nll(scale: float) -> None:
    model, val, test = _teacher_problem(scale)
    guide = pb.posterior(model, "map")
    before_val, before_test = _nll(model, guide, val), _nll(model, guide, test)
    t = pb.calibrate(model, guide, val)
    # the population optimum is T = scale (logits scale·Wx, labels from softmax(Wx)); the MLE
    # of one parameter from 1,500 examples has a relative standard error of a few percent
    # (Fisher information of log T ≈ N·Var[log-likelihood slope] ≳ 1500·0.3), so ±20% is > 5 SE
    assert abs(math.log(t / scale)) < math.log(1.2), t
    assert temperature(guide) == pytest.approx(t)
    after_val, after_test = _nll(model, guide, val), _nll(model, guide, test)
    assert after_val < before_val - 0.02  # a mis-scaled predictive by 4x / 0.3x: a large gain
    assert after_test < before_test  # and it transfers to held-out data of the same law
    # T is the minimiser: both neighbours of the fitted value are worse on the validation data
    for factor in (0.9, 1.1):
        set_temperature(guide, t * factor)
        assert _nll(model, guide, val) > after_val


def test_calibrate_tempers_the_averaged_predictive_by_default() -> None:
    model, val, _ = _teacher_problem(3.0)
    guide = pb.posterior(model, "meanfield", init_scale=0.3)
    raw = pb.predict(model, guide, val, num_samples=8, seed=0)
    t = pb.calibrate(model, guide, val, num_samples=8)
    assert pooled(guide)
    tempered = pb.predict(model, guide, val, num_samples=8, seed=0)
    # p_T = softmax(log p̄ / T), p̄ = (1/S) Σ_s softmax(f_s) of the same draws: one row
    expected = torch.softmax(raw.mean_probs.log() / t, dim=-1)
    assert tempered.log_probs.shape[0] == 1
    torch.testing.assert_close(tempered.mean_probs, expected, rtol=1e-5, atol=1e-6)
    assert _nll(model, guide, val) < pb.metrics.report(raw, raw.targets)["nll"]
    # T minimises the pooled NLL: its neighbours are worse on the same draws
    for factor in (0.9, 1.1):
        assert float(tempered_nll(raw, raw.targets, t * factor)) > float(
            tempered_nll(raw, raw.targets, t)
        )


def test_calibrate_per_draw_tempers_inside_the_posterior_average() -> None:
    model, val, _ = _teacher_problem(3.0)
    guide = pb.posterior(model, "meanfield", init_scale=0.3)
    raw = pb.predict(model, guide, val, num_samples=8, seed=0)
    t = pb.calibrate(model, guide, val, num_samples=8, pool=False)
    assert not pooled(guide)
    tempered = pb.predict(model, guide, val, num_samples=8, seed=0)
    # p_T = (1/S) Σ_s softmax(f_s / T) of the same draws (not softmax(log p̄ / T))
    expected = torch.softmax(raw.log_probs / t, dim=-1).mean(0)
    assert tempered.log_probs.shape[0] == 8
    torch.testing.assert_close(tempered.mean_probs, expected, rtol=1e-5, atol=1e-6)
    assert _nll(model, guide, val) < pb.metrics.report(raw, raw.targets)["nll"]


def test_pooling_is_exactly_guo_et_al_for_a_point_mass() -> None:
    model, val, _ = _teacher_problem(3.0)
    guide = pb.posterior(model, "map")
    raw = pb.predict(model, guide, val)
    for pool in (True, False):  # one draw: both forms are softmax(f / T)
        torch.testing.assert_close(
            apply_temperature(raw, 2.5, pool=pool).log_probs,
            torch.log_softmax(raw.log_probs / 2.5, dim=-1),
            rtol=1e-6,
            atol=1e-7,
        )


def test_a_file_calibrated_per_draw_before_pooling_keeps_its_form(tmp_path) -> None:
    """A posterior file with a temperature but no pool flag (written before the pooled form)
    applies T per draw, as it was fitted; a pooled file loads pooled."""
    model, val, _ = _teacher_problem(3.0)
    guide = pb.posterior(model, "meanfield", init_scale=0.3)
    pb.calibrate(model, guide, val, num_samples=8, pool=False)
    per_draw = pb.predict(model, guide, val, num_samples=8, seed=0)
    del guide._buffers[POOL_BUFFER]  # what such a file holds
    pb.save(guide, tmp_path / "old.safetensors")
    fresh = pb.posterior(model, "meanfield", init_scale=0.3)
    loaded = pb.load(tmp_path / "old.safetensors", model)
    assert not pooled(loaded) and POOL_BUFFER not in dict(loaded.named_buffers())
    torch.testing.assert_close(
        pb.predict(model, loaded, val, num_samples=8, seed=0).log_probs, per_draw.log_probs
    )
    pb.calibrate(model, fresh, val, num_samples=8)
    pb.save(fresh, tmp_path / "new.safetensors")
    pb.io.load_state(loaded, tmp_path / "new.safetensors")  # the flag comes with the file
    assert pooled(loaded) and temperature(loaded) == temperature(fresh)


def test_temperature_one_is_bit_identical() -> None:
    model, val, _ = _teacher_problem(2.0)
    guide = pb.posterior(model, "meanfield", init_scale=0.3)
    plain = pb.predict(model, guide, val, num_samples=4, seed=0)
    set_temperature(guide, 1.0)
    assert TEMPERATURE_BUFFER in dict(guide.named_buffers())
    same = pb.predict(model, guide, val, num_samples=4, seed=0)
    assert torch.equal(plain.log_probs, same.log_probs)


def test_the_temperature_survives_save_and_load(tmp_path) -> None:
    model, val, _ = _teacher_problem(3.0)
    guide = pb.posterior(model, "map")
    t = pb.calibrate(model, guide, val)
    before = pb.predict(model, guide, val).log_probs
    path = tmp_path / "calibrated.safetensors"
    pb.save(guide, path)
    loaded = pb.load(path, model)
    assert temperature(loaded) == t
    assert torch.equal(pb.predict(model, loaded, val).log_probs, before)
    # an uncalibrated file loaded into a calibrated guide drops the temperature
    plain = pb.posterior(model, "map")
    pb.save(plain, tmp_path / "plain.safetensors")
    pb.io.load_state(loaded, tmp_path / "plain.safetensors")
    assert TEMPERATURE_BUFFER not in dict(loaded.named_buffers())
    assert temperature(loaded) == 1.0


@pytest.mark.parametrize("family", ["map", "laplace"])
def test_a_fit_removes_the_temperature_of_the_posterior_it_replaces(family: str) -> None:
    # T = 3 fitted for the scaled teacher's MAP; fitting again moves the posterior, after which
    # that T would temper every later prediction (and the fit's validation) with no basis
    model, train, val = _teacher_problem(3.0)
    guide = pb.posterior(model, family)
    pb.fit(model, guide, train, epochs=1, lr=1e-3)
    t = pb.calibrate(model, guide, val)
    assert t > 1.5
    with pytest.warns(
        UserWarning, match=rf"fit: {type(guide).__name__} was calibrated .*calibrate"
    ):
        pb.fit(model, guide, train, epochs=1, lr=1e-3)
    assert TEMPERATURE_BUFFER not in dict(guide.named_buffers()) and temperature(guide) == 1.0
    if family == "laplace":  # the post-hoc refit of the curvature alone says the same
        pb.calibrate(model, guide, val)
        with pytest.warns(UserWarning, match="fit_laplace: LaplaceGuide was calibrated"):
            pb.infer.laplace.fit_laplace(model, guide, train)
        assert temperature(guide) == 1.0
    # an uncalibrated guide fits without a word (warnings are errors in the suite)
    pb.fit(model, guide, train, epochs=1, lr=1e-3)


def test_regression_scales_the_predictive_standard_deviation() -> None:
    # noise σ = 0.5 / 4 against a true 0.5 (means 4x too large too): over-confident by far
    model, val, _ = _teacher_problem(4.0, obs="reg")
    guide = pb.posterior(model, "map")
    raw = pb.predict(model, guide, val)
    # the means 4x too large need a σ scale beyond the default bounds: it stops there, and says so
    with pytest.warns(UserWarning, match=r"T = 20 is at the upper end of bounds=\(0.05, 20.0\)"):
        t = pb.calibrate(model, guide, val)
    tempered = pb.predict(model, guide, val)
    assert t > 1.0
    assert tempered.scale == pytest.approx(raw.scale * t)
    assert torch.equal(tempered.loc, raw.loc)  # the means (and the RMSE) never change
    r0, r1 = pb.metrics.report(raw, raw.targets), pb.metrics.report(tempered, tempered.targets)
    assert r1["nll"] < r0["nll"] - 0.1 and r1["rmse"] == r0["rmse"]


def test_bad_input_is_refused_with_the_site_named() -> None:
    model, val, _ = _teacher_problem(2.0)
    guide = pb.posterior(model, "map")
    with pytest.raises(ValueError, match="calibrate: val_data yielded no batches"):
        pb.calibrate(model, guide, [])
    unlabelled = [(torch.randn(5, 6),)]
    with pytest.raises(ValueError, match="calibrate: val_data has no labels"):
        pb.calibrate(model, guide, unlabelled)
    with pytest.raises(ValueError, match="calibrate: bounds"):
        pb.calibrate(model, guide, val, bounds=(2.0, 1.0))
    with pytest.raises(ValueError, match="set_temperature: the temperature must be a finite"):
        set_temperature(guide, -1.0)
    assert TEMPERATURE_BUFFER not in dict(guide.named_buffers())  # nothing was stored


def test_a_tiny_calibration_set_warns_that_t_is_poorly_determined() -> None:
    model, val, _ = _teacher_problem(3.0)
    x, y = next(iter(val))
    guide = pb.posterior(model, "map")
    # 10 examples: the standard error of log T is about 1/sqrt(0.3 · 10) ≈ 0.6
    with pytest.warns(UserWarning, match=r"fitted on 10 held-out examples, fewer than 30"):
        t = pb.calibrate(model, guide, [(x[:10], y[:10])])
    assert temperature(guide) == t  # stored all the same
    pb.calibrate(model, guide, [(x[:30], y[:30])])  # 30: no warning (warnings are errors here)
    # a Gaussian σ scale is better determined per value (Fisher information 2, not ~0.3)
    model, val, _ = _teacher_problem(1.0, obs="reg")
    x, y = next(iter(val))
    with pytest.warns(UserWarning, match=r"fitted on 4 held-out target values, fewer than 5"):
        pb.calibrate(model, pb.posterior(model, "map"), [(x[:4], y[:4])])
    pb.calibrate(model, pb.posterior(model, "map"), [(x[:5], y[:5])])


def test_a_temperature_at_the_end_of_bounds_warns_naming_it() -> None:
    model, val, _ = _teacher_problem(3.0)
    guide = pb.posterior(model, "map")
    # labels that are the predictive's own argmax: the NLL falls all the way to T -> 0
    x = torch.cat([b[0] for b in val])
    argmax = pb.predict(model, guide, [(x,)]).log_probs[0].argmax(-1)
    with pytest.warns(UserWarning, match=r"T = 0.05 is at the lower end of bounds=\(0.05, 20.0\)"):
        assert pb.calibrate(model, guide, [(x, argmax)]) == pytest.approx(0.05)
    with pytest.warns(UserWarning, match=r"T = 0.01 is at the lower end of bounds=\(0.01, 0.5\)"):
        pb.calibrate(model, guide, [(x, argmax)], bounds=(0.01, 0.5))


def test_a_pooled_prediction_reports_no_mutual_information() -> None:
    # the pooled T averages the draws into one row: MI 0 and an MI AUROC of 0.5 said nothing
    model, val, _ = _teacher_problem(3.0)
    guide = pb.posterior(model, "meanfield", init_scale=0.3)
    ood = [(4.0 * torch.randn(200, 6, generator=torch.Generator().manual_seed(5)),)]
    raw, raw_ood = pb.predict(model, guide, val), pb.predict(model, guide, ood)
    assert raw.pooled_draws is None
    before = pb.metrics.report(raw, raw.targets, ood_probs=raw_ood)
    assert before["mutual_information"] > 0 and before["auroc_mi"] != 0.5
    pb.calibrate(model, guide, val)
    pred, pred_ood = pb.predict(model, guide, val), pb.predict(model, guide, ood)
    assert pred.num_samples == 1 and pred.pooled_draws == 32 == pred_ood.pooled_draws
    result = pb.metrics.report(pred, pred.targets)  # no OOD scores asked: NaN, no warning
    assert math.isnan(result["mutual_information"]) and math.isfinite(result["nll"])
    with pytest.warns(UserWarning, match=r"averaged 32 posterior draws into one row"):
        result = pb.metrics.report(pred, pred.targets, ood_probs=pred_ood)
    assert math.isnan(result["auroc_mi"]) and math.isnan(result["mutual_information"])
    assert 0 < result["auroc_entropy"] < 1  # the other scores are the calibrated predictive's
    # a temperature per draw keeps the draws, and their mutual information
    pb.calibrate(model, guide, val, pool=False)
    per_draw = pb.predict(model, guide, val)
    assert per_draw.pooled_draws is None and per_draw.num_samples == 32
    assert pb.metrics.report(per_draw, per_draw.targets)["mutual_information"] > 0
    # a number, as the benchmarks apply it, marks the prediction the same way
    assert apply_temperature(raw, 2.0).pooled_draws == 32
    assert apply_temperature(raw, 2.0, pool=False).pooled_draws is None


def test_a_temperature_given_as_any_real_number_is_applied_and_a_bad_one_refused() -> None:
    # apply_temperature read anything but a Python int/float as a guide without a temperature:
    # torch.tensor(T) and np.float32(T) silently applied T = 1; a negative T reversed the ranking
    import numpy as np

    g = torch.Generator().manual_seed(0)
    logits = 6 * torch.randn(1, 200, 3, generator=g)
    y = torch.distributions.Categorical(logits=logits[0] / 3).sample()
    pred = pb.predictive.Prediction(log_probs=logits.log_softmax(-1), targets=y)
    expected = apply_temperature(pred, 3.0).log_probs
    assert not torch.allclose(expected, pred.log_probs)
    for value in (torch.tensor(3.0), torch.tensor([3.0]), np.float32(3.0), np.float64(3.0), 3):
        assert torch.allclose(apply_temperature(pred, value).log_probs, expected), value
    for bad, error in ((-3.0, ValueError), (0.0, ValueError), (math.inf, ValueError)):
        with pytest.raises(error, match="apply_temperature: the temperature must be a finite"):
            apply_temperature(pred, bad)
    for bad in ("3", True, torch.ones(2), object()):
        with pytest.raises(TypeError, match="apply_temperature: the temperature must be a finite"):
            apply_temperature(pred, bad)
    with pytest.raises(ValueError, match="tempered_nll: the temperature must be a finite"):
        tempered_nll(pred, y, -1.0)
    with pytest.raises(ValueError, match="tempered_nll: the temperature must be > 0"):
        tempered_nll(pred, y, torch.tensor(-1.0, requires_grad=True))


def test_fit_temperature_refuses_log_probs_that_are_not_log_probabilities() -> None:
    # a Prediction built by hand from probabilities or raw logits gave T = 0.27 or 4.5 for a
    # model whose T is about 1, without a word
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(4, 300, 3, generator=g)
    y = torch.distributions.Categorical(logits=logits.mean(0)).sample()
    Prediction = pb.predictive.Prediction
    fit_temperature(Prediction(log_probs=logits.log_softmax(-1), targets=y))  # accepted
    for wrong in (logits.softmax(-1), logits):
        with pytest.raises(ValueError, match=r"fit_temperature: exp\(prediction.log_probs\)"):
            fit_temperature(Prediction(log_probs=wrong, targets=y))


def test_a_tempered_prediction_is_not_tempered_nor_fitted_twice() -> None:
    # predict applies a calibrated guide's T; applying it (or fitting T) again on that result
    # compounded the two without a word
    model, val, test = _teacher_problem(3.0)
    guide = pb.posterior(model, "map")
    t = pb.calibrate(model, guide, val)
    pred = pb.predict(model, guide, test)
    assert pred.temperature == pytest.approx(t)
    with pytest.raises(ValueError, match=r"apply_temperature: this prediction was tempered"):
        apply_temperature(pred, guide)
    with pytest.raises(ValueError, match=r"fit_temperature: this prediction was tempered"):
        fit_temperature(pred)
    set_temperature(guide, None)
    raw = pb.predict(model, guide, test)
    assert raw.temperature is None
    again = apply_temperature(raw, t)  # the uncalibrated one: tempered once, as predict does
    assert again.temperature == pytest.approx(t)
    assert torch.allclose(again.log_probs, pred.log_probs, atol=1e-6)
