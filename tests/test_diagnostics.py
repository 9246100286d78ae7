"""PSIS k-hat of guides on the conjugate LoRA-XS core, calibration report, reliability diagram."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import pyrobayes as pb
from pyrobayes.diagnostics.khat import Diagnostics, diagnose, khat_interpretation, khat_threshold
from pyrobayes.diagnostics.plots import reliability_diagram
from pyrobayes.guides import DeltaGuide, MeanFieldGuide
from pyrobayes.metrics import calibration_error, report
from pyrobayes.models import LoRAXS

from .common import conjugate_core, mlp_problem, split_batches

#: these tests check the predictive's arithmetic on guides at their initialisation, on purpose;
#: the never-fitted warning itself is tested in tests/test_fitted_head.py
pytestmark = pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")

NUM_DRAWS = 1000  # S >= 1000 for a stable k-hat (SPECS 6, step 1)


@pytest.fixture(scope="module")
def core3():
    return conjugate_core()  # 3×3 core: 9 latent dimensions


@pytest.fixture(scope="module")
def core5():
    return conjugate_core(rank=5)  # 5×5 core: 25 latent dimensions


def _guide(prob, variance_ratio: float) -> MeanFieldGuide:
    """Exact posterior mean, posterior variance divided by ``variance_ratio`` (c in SPECS 6)."""
    guide = MeanFieldGuide(prob.model)
    guide.set_site(prob.site, loc=prob.post_loc, scale=prob.post_scale / math.sqrt(variance_ratio))
    return guide


def test_exact_guide_on_conjugate_core(core3):
    """q = p(θ | D): log ratios are the constant log p(D), so k-hat < 0.5, ESS = S, ELBO = log Z.

    The fixture's closed form matches the model to ~1e-6 nats (measured spread of r_s 2.6e-6),
    hence the 1e-4 tolerances. k-hat is then fitted to round-off-level noise; measured -0.13.
    """
    result = diagnose(core3.model, _guide(core3, 1.0), [(core3.x, core3.y)], num_samples=NUM_DRAWS)
    assert result.khat < 0.5
    assert result.interpretation.startswith("good")
    assert result.ess > 0.999 * NUM_DRAWS
    assert result.elbo == pytest.approx(core3.log_evidence, abs=1e-4)
    assert result.log_evidence == pytest.approx(core3.log_evidence, abs=1e-4)
    assert np.ptp(result.log_ratios) < 1e-4
    assert result.num_examples == core3.x.shape[0]
    assert result.calibration == {}  # Gaussian likelihood: no classification metrics
    summary = result.to_dict()
    assert "log_ratios" not in summary and summary["khat"] == result.khat
    json.dumps(summary)


def test_overdispersed_guide_is_good(core3):
    """σ_q = 1.2 σ_post per coordinate (c = 1/1.44 < 1): the weights are bounded, k < 0.

    Measured over 40 seeds (S = 1000, 9 dims): k-hat mean -0.12, sd 0.08, max 0.04, so
    k-hat < 0.5 has a margin of 7.6 sd. Being a worse fit than the exact guide, its ELBO is
    lower than log p(D), and log Z estimated by importance sampling is close to the truth.
    """
    result = diagnose(
        core3.model, _guide(core3, 1 / 1.44), [(core3.x, core3.y)], num_samples=NUM_DRAWS
    )
    assert result.khat < 0.5
    assert result.elbo < core3.log_evidence - 0.1  # KL(q‖p) = 9·(1.44 - 1 - ln 1.44)/2 = 0.34
    # E_q[w²]/E_q[w]² = ∫p²/q = (a/√(2 - 1/a²))^d with a = 1.2, d = 9: 1.050^9 = 1.55, so
    # ESS/S ≈ 1/1.55 = 0.645 (measured 0.657); the relative sd of the log Z estimate is
    # √(0.55/S) = 0.023, so the 0.1 tolerance is > 4 sd.
    assert 0.5 * NUM_DRAWS < result.ess < 0.8 * NUM_DRAWS
    assert result.log_evidence == pytest.approx(core3.log_evidence, abs=0.1)


def test_underdispersed_guide_is_flagged(core5):
    """Variance shrunk by c = 3 per coordinate (σ_q = σ_post/√3) in 25 dimensions.

    Analytic anchor (SPECS 6): for p = N(0, 1), q = N(0, 1/c) the weights have Pareto tail index
    k = 1 - 1/c = 2/3 per coordinate, and in many dimensions the pre-asymptotic k-hat at
    S = 1000 is larger (d = 10: median 0.93, sd 0.14 per single fit). Single fits are too noisy
    for a hard test (measured here, 40 seeds: d = 9 mean 0.92 sd 0.16, min 0.57; d = 16 mean
    1.03 sd 0.20). With d = 25 (5×5 core): mean 1.195, sd 0.193 over 40 seeds. The mean of
    R = 4 independent fits has sd 0.193/√4 = 0.097, so "mean k-hat > 0.7" holds with a margin
    of (1.195 - 0.7)/0.097 = 5.1 sd.
    """
    guide = _guide(core5, 3.0)
    data = [(core5.x, core5.y)]
    fits = [diagnose(core5.model, guide, data, num_samples=NUM_DRAWS, seed=s) for s in range(4)]
    k_mean = float(np.mean([f.khat for f in fits]))
    assert k_mean > 0.7
    assert all(f.interpretation.startswith(("bad", "ok")) for f in fits if f.khat >= 0.5)
    # the importance weights are dominated by a few draws: ESS far below S
    assert max(f.ess for f in fits) < 0.5 * NUM_DRAWS
    # underdispersion lowers the ELBO below log Z (KL(q‖p) = 25·(1/3 - 1 + ln 3)/2 = 5.4)
    assert all(f.elbo < core5.log_evidence - 2.0 for f in fits)


def test_khat_interpretation_thresholds():
    assert khat_interpretation(0.3).startswith("good")
    assert khat_interpretation(-math.inf).startswith("good")
    assert khat_interpretation(0.6).startswith("ok")
    assert khat_interpretation(0.7).startswith("bad")
    assert khat_interpretation(1.3).startswith("bad")
    assert khat_interpretation(math.nan).startswith("undefined")
    # 1 - 1/log10(S): S = 100 -> 0.5, S = 1000 -> 0.667, large S -> capped at 0.7
    assert khat_threshold(100) == pytest.approx(0.5)
    assert khat_threshold(1000) == pytest.approx(2 / 3)
    assert khat_threshold(10**6) == 0.7
    assert "threshold" in khat_interpretation(0.6, num_samples=100)
    assert "threshold" not in khat_interpretation(0.6, num_samples=10**6)


@pytest.mark.parametrize("num_samples", [11, 30, 50, 80, 100, 1000, 2000])
def test_a_khat_at_or_above_the_small_sample_threshold_reads_bad(num_samples):
    """Vehtari et al. (2024): with S draws any k-hat >= min(1 - 1/log10 S, 0.7) is unreliable.
    S = 30 (threshold 0.32) read k-hat 0.45 as "good ... can be trusted"."""
    threshold = khat_threshold(num_samples)
    for k in np.linspace(max(threshold, -0.5), 0.7, 8)[:-1]:
        text = khat_interpretation(float(k), num_samples)
        assert text.startswith("bad"), (k, text)
        assert "more draws" in text and f"S = {num_samples}" in text
        # the number of draws it names has a threshold above k-hat, one fewer not
        needed = int(text.split("S >= ")[1].split()[0])
        assert khat_threshold(needed) > k >= khat_threshold(needed - 1)
    below = threshold - 0.01
    assert khat_interpretation(below, num_samples).startswith("good" if below < 0.5 else "ok")
    # k-hat >= 0.7 keeps its wording, whatever S
    assert khat_interpretation(0.8, num_samples).startswith("bad (k-hat >= 0.7)")


def test_diagnose_reads_a_khat_above_its_small_sample_threshold_as_bad(monkeypatch):
    # a fitted guide gave k-hat 0.44 at S = 30 (threshold 0.32), read "good ... can be trusted";
    # the Pareto fit is pinned to that value here
    import pyrobayes.diagnostics.khat as khat_module

    monkeypatch.setattr(khat_module, "psis_smooth", lambda log_ratios: (log_ratios, 0.44))
    prob = mlp_problem((4, 6, 3), LoRAXS(rank=2, target_modules=["0"]), num_data=40, seed=0)
    guide = MeanFieldGuide(prob.model, init_scale=0.3)
    result = diagnose(prob.model, guide, split_batches(prob.x, prob.y, 20), num_samples=30)
    assert (result.khat, result.khat_threshold) == (0.44, pytest.approx(0.3230, abs=1e-4))
    assert result.interpretation.startswith("bad (k-hat 0.44 >= 0.32")
    assert "diagnose with more draws (S >= 62" in result.interpretation


def _classifier():
    prob = mlp_problem((5, 8, 4), LoRAXS(rank=2, target_modules=["0"]), num_data=60, data_seed=1)
    return prob.model, split_batches(prob.x, prob.y, 32), prob.y


@pytest.mark.parametrize("pool", [True, False])
def test_the_calibration_report_applies_the_guides_temperature(pool):
    """A guide calibrated by pb.calibrate: diagnose reported the untempered predictive (NLL
    0.314 against predict's 0.217 at T = 2.45); now the same numbers as report(pb.predict)
    under the same draws, in the pooled and the per-draw form."""
    model, data, y = _classifier()
    guide = MeanFieldGuide(model, init_scale=0.5)
    draws = {"num_samples": 50, "seed": 4, "samples_per_forward": 50}
    untempered = report(pb.predict(model, guide, data, **draws), y, num_bins=10)
    pb.calibration.set_temperature(guide, 2.5, pool=pool)
    result = diagnose(model, guide, data, num_samples=50, seed=4, num_bins=10)
    expected = report(pb.predict(model, guide, data, **draws), y, num_bins=10)
    assert abs(expected["nll"] - untempered["nll"]) > 1e-3  # T changes what is reported
    for key, value in expected.items():  # (pooled: the mutual information is NaN in both)
        assert result.calibration[key] == pytest.approx(value, rel=1e-9, abs=1e-12, nan_ok=True)


def test_calibration_report_of_the_same_draws():
    """Diagnose with S = P draws reports metrics.report of pb.predict with the same seed."""
    model, data, y = _classifier()
    guide = MeanFieldGuide(model, init_scale=0.5)
    result = diagnose(model, guide, data, num_samples=50, seed=4, num_predictive_samples=50)
    pred = pb.predict(model, guide, data, num_samples=50, seed=4, samples_per_forward=50)
    expected = report(pred, y, num_bins=10)
    result10 = diagnose(model, guide, data, num_samples=50, seed=4, num_bins=10)
    for key, value in expected.items():
        assert result10.calibration[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert result.calibration["ece_bins"] == 15.0
    assert result.calibration["num_predictive_samples"] == 50.0
    assert isinstance(result, Diagnostics)
    assert math.isfinite(result.khat) and 1.0 <= result.ess <= 50.0


def test_point_mass_guide_has_undefined_khat():
    model, data, _ = _classifier()
    result = diagnose(model, DeltaGuide(model), data, num_samples=100)
    assert math.isnan(result.khat)
    assert result.interpretation.startswith("undefined")
    assert result.num_samples == 1
    assert 0.0 <= result.calibration["accuracy"] <= 1.0


def test_reliability_diagram_bars_are_bin_accuracies():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(3.0 * torch.randn(4, 300, 5, generator=g), dim=-1)  # (S, N, C)
    labels = torch.randint(0, 5, (300,), generator=g)
    calib = calibration_error(probs, labels, num_bins=12)
    fig = reliability_diagram(probs, labels, num_bins=12)
    assert isinstance(fig, Figure)
    bars = fig.axes[0].patches
    assert len(bars) == 12
    heights = np.array([bar.get_height() for bar in bars])
    np.testing.assert_allclose(heights, calib.bin_accuracy.numpy(), atol=1e-12)
    assert (calib.bin_counts > 0).sum() >= 5  # several non-empty bins: a non-trivial check
    assert f"{calib.ece:.3f}" in fig.axes[0].get_title()
    # drawing into a given axes returns that axes' figure
    fig2 = Figure()
    ax = fig2.add_subplot(1, 1, 1)
    assert reliability_diagram(probs, labels, ax=ax) is fig2
