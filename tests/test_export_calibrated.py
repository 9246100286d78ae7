"""The ArviZ export of a calibrated guide agrees with ``pb.predict``: a temperature defined per
draw is applied to ``log_likelihood`` and ``posterior_predictive`` (and recorded in the
attributes); the pooled form, which no draw carries, is exported uncalibrated with a warning
that says so; an uncalibrated guide (or T = 1) exports as before. Held-out data is exported
without the training-set ``num_data`` warning."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
import torch

import pyrobayes as pb
from pyrobayes.calibration import set_temperature
from pyrobayes.diagnostics import UncalibratedExportWarning
from pyrobayes.models import LoRAXS
from tests.common import mlp_problem, split_batches

S = 12
NUM_DATA = 48


def _fitted(family: str, likelihood: str = "categorical"):
    """A fitted MLP 6 -> 10 -> 3 with LoRA-XS cores on both layers (a Gaussian: one output, a
    core on the first layer and a point head), and its batches."""
    p = mlp_problem(
        (6, 10, 1 if likelihood == "gaussian" else 3),
        LoRAXS(rank=2, target_modules=["0"] if likelihood == "gaussian" else ["0", "2"]),
        num_data=NUM_DATA,
        seed=0,
        data_seed=1,
        likelihood=likelihood,
        trainable_modules=["2"] if likelihood == "gaussian" else [],
        **({"obs_scale": 0.7} if likelihood == "gaussian" else {}),
    )
    data = split_batches(p.x, p.y, 20)
    guide = pb.posterior(p.model, family)
    pb.fit(p.model, guide, data, epochs=2, lr=0.05, seed=0)
    return p, guide, data


def _export(p, guide, data, seed=3):
    return pb.to_inference_data(p.model, guide, data, num_samples=S, seed=seed)


def _per_draw_log_probs(p, guide, data) -> np.ndarray:
    """``(S, N)`` log p_T(y_n | x_n, θ_s) read off ``pb.predict`` (same seed, same draws)."""
    pred = pb.predict(p.model, guide, data, num_samples=S, seed=3, samples_per_forward=S)
    picked = pred.log_probs.gather(-1, p.y.expand(pred.log_probs.shape[0], -1).unsqueeze(-1))
    return picked.squeeze(-1).numpy()


def test_a_per_draw_temperature_is_applied_as_predict_applies_it():
    p, guide, data = _fitted("meanfield")
    plain = _export(p, guide, data)
    set_temperature(guide, 2.5, pool=False)
    idata = _export(p, guide, data)
    ll = idata.log_likelihood["obs"].values[0]  # (S, N)
    np.testing.assert_allclose(ll, _per_draw_log_probs(p, guide, data), atol=1e-10)
    assert not np.allclose(ll, plain.log_likelihood["obs"].values[0])
    for attrs in (idata.attrs, idata.posterior.attrs, idata.log_likelihood.attrs):
        assert attrs["temperature"] == 2.5
        assert attrs["temperature_pooled"] == 0 and attrs["temperature_applied"] == 1
    # the posterior's density is not the predictive's: sample_stats are the model's own
    for name in ("log_q", "log_prior", "log_joint", "lp"):
        np.testing.assert_array_equal(idata.sample_stats[name], plain.sample_stats[name])
    np.testing.assert_array_equal(idata.posterior["0.core"], plain.posterior["0.core"])


def test_a_pooled_temperature_on_a_point_mass_is_applied_per_draw():
    p, guide, data = _fitted("map")
    set_temperature(guide, 0.4)  # pooled (pb.calibrate's default): exact for one distinct draw
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        idata = _export(p, guide, data)
    pred = pb.predict(p.model, guide, data)  # one row for a point mass, tempered by T
    expected = pred.log_probs[0].gather(-1, p.y.unsqueeze(-1)).squeeze(-1).numpy()
    ll = idata.log_likelihood["obs"].values[0]
    for row in ll:
        np.testing.assert_allclose(row, expected, atol=1e-10)
    assert idata.attrs["temperature_pooled"] == 1 and idata.attrs["temperature_applied"] == 1
    # the predictive draws come from the tempered draw: at T -> 0 its mode, always
    set_temperature(guide, 1e-3)
    sharp = _export(p, guide, data).posterior_predictive["obs"].values[0]
    modes = pred.log_probs[0].argmax(-1).numpy()
    assert (sharp == modes).all()


def test_pb_calibrate_then_export_agrees_with_predict():
    p, guide, data = _fitted("map")
    value = pb.calibrate(p.model, guide, data, num_samples=1)
    assert value != 1.0
    idata = _export(p, guide, data)
    pred = pb.predict(p.model, guide, data)
    expected = pred.log_probs[0].gather(-1, p.y.unsqueeze(-1)).squeeze(-1).numpy()
    np.testing.assert_allclose(idata.log_likelihood["obs"].values[0, 0], expected, atol=1e-10)
    assert idata.attrs["temperature"] == pytest.approx(value)


def test_a_pooled_temperature_on_a_spread_posterior_is_exported_uncalibrated_with_a_warning():
    p, guide, data = _fitted("meanfield")
    plain = _export(p, guide, data)
    set_temperature(guide, 0.5)  # pooled: tempers the average, not any draw
    with pytest.warns(UncalibratedExportWarning, match="exported UNCALIBRATED") as caught:
        idata = _export(p, guide, data)
    assert "T = 0.5" in str(caught[0].message) and "pool=False" in str(caught[0].message)
    for group in ("log_likelihood", "posterior_predictive"):
        np.testing.assert_array_equal(idata[group]["obs"], plain[group]["obs"])
    assert idata.attrs["temperature"] == 0.5
    assert idata.attrs["temperature_pooled"] == 1 and idata.attrs["temperature_applied"] == 0


def test_a_gaussian_temperature_scales_every_draws_sigma():
    p, guide, data = _fitted("meanfield", likelihood="gaussian")
    set_temperature(guide, 1.8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        idata = _export(p, guide, data)
    pred = pb.predict(p.model, guide, data, num_samples=S, seed=3, samples_per_forward=S)
    assert pred.scale == pytest.approx(1.8 * 0.7)
    expected = torch.distributions.Normal(pred.loc, pred.scale).log_prob(p.y).numpy()
    np.testing.assert_allclose(idata.log_likelihood["obs"].values[0], expected, atol=1e-10)
    assert idata.attrs["temperature_applied"] == 1 and idata.attrs["temperature_pooled"] == 0
    # the predictive draws spread T times as far around the draws' means
    spread = idata.posterior_predictive["obs"].values[0] - pred.loc.numpy()
    assert 1.5 * 0.7 < spread.std() < 2.1 * 0.7


@pytest.mark.parametrize("family", ["meanfield", "map"])
def test_uncalibrated_and_unit_temperature_exports_are_unchanged(family):
    p, guide, data = _fitted(family)
    plain = _export(p, guide, data)
    assert not any("temperature" in k for k in plain.attrs)
    np.testing.assert_allclose(
        plain.log_likelihood["obs"].values[0],
        _per_draw_log_probs(p, guide, data)
        if family != "map"
        else np.broadcast_to(_per_draw_log_probs(p, guide, data), (S, NUM_DATA)),
        atol=1e-10,
    )
    set_temperature(guide, 1.0, pool=False)
    unit = _export(p, guide, data)
    for group in ("log_likelihood", "posterior_predictive", "sample_stats", "posterior"):
        for name in plain[group].data_vars:
            np.testing.assert_array_equal(unit[group][name], plain[group][name])
    assert unit.attrs["temperature"] == 1.0


def test_held_out_data_is_exported_without_the_num_data_warning(caplog):
    p, guide, data = _fitted("meanfield")
    held_out = data[:1]  # 20 of the model's 48 examples
    with caplog.at_level(logging.WARNING, logger="pyrobayes"):
        idata = pb.to_inference_data(p.model, guide, held_out, num_samples=4, seed=0)
    assert idata.log_likelihood.sizes["obs_dim_0"] == 20
    assert not [r for r in caplog.records if "num_data" in r.getMessage()]
    # the k-hat diagnostics read the training set: there a mismatch is still logged
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pyrobayes"):
        pb.diagnose(p.model, guide, held_out, num_samples=20, num_predictive_samples=4)
    assert any("model.num_data=48 but the data has 20" in r.getMessage() for r in caplog.records)
