"""``pyrobayes.infer.select_prior_precision``: the Laplace prior precision of least held-out NLL
(laplace-torch's grid search), checked against the predictive evaluated at every grid point."""

from __future__ import annotations

import pytest
import torch

import pyrobayes as pb
from pyrobayes.infer import select_prior_precision
from pyrobayes.infer.laplace import fit_laplace
from pyrobayes.infer.prior_precision import DEFAULT_FACTORS
from pyrobayes.models import LoRAXS
from tests.common import mlp_problem, tensor_loader

pytest.importorskip("laplace")


def _problem(prior_precision: float | str):
    """LoRA-XS cores on a teacher-labelled MLP task: train and held-out loaders, a fitted Laplace.

    The labels are the argmax of the network at a perturbed point, so the MAP generalises and
    the held-out NLL depends on how wide the posterior is.
    """
    prob = mlp_problem(
        (4, 16, 16, 3), LoRAXS(rank=3, target_modules=["0", "2"]), num_data=80, seed=5
    )
    model = prob.model.to(torch.float64)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(200, 4, generator=gen, dtype=torch.float64)
    teacher = pb.posterior(model, "map")
    with torch.no_grad():
        for s in teacher.sites:
            teacher.loc(s).add_(
                torch.randn(teacher.loc(s).shape, generator=gen, dtype=torch.float64)
            )
        logits = pb.predict(
            model, teacher, tensor_loader(x, torch.zeros(200, dtype=torch.long), 50)
        )
    y = logits.probs.mean(0).argmax(-1)
    train, held_out = tensor_loader(x[:80], y[:80], 20), tensor_loader(x[80:], y[80:], 40)
    guide = pb.posterior(model, "laplace", prior_precision=prior_precision)
    pb.fit(model, guide, train, epochs=60, lr=3e-2, seed=0, progress=False)
    return model, guide, train, held_out


def _nll(model, guide, data) -> float:
    pred = pb.predict(model, guide, data, num_samples=32, seed=0)
    return float(pb.metrics.nll(pred.probs, pred.targets, log_probs=pred.log_probs))


def test_selected_prior_precision_has_the_least_held_out_nll_on_its_grid() -> None:
    # a prior far too weak for the data (τ = 1e-3): the posterior keeps the prior's variance in
    # every direction the 80 examples leave open, and the predictive is under-confident
    model, guide, _, held_out = _problem(1e-3)
    tau0 = guide.prior_precision
    before = _nll(model, guide, held_out)
    factors = (1e-1, 1.0, 1e1, 1e2, 1e3, 1e4, 1e5)
    tau = select_prior_precision(model, guide, held_out, factors=factors)
    assert guide.prior_precision == pytest.approx(tau)
    after = _nll(model, guide, held_out)
    # the held-out NLL at every grid point, evaluated independently of the selection
    grid = {}
    for f in factors:
        guide.set_prior_precision(tau0 * f)
        grid[f] = _nll(model, guide, held_out)
    guide.set_prior_precision(tau)
    chosen = min(grid, key=lambda f: grid[f])
    assert tau == pytest.approx(tau0 * chosen)
    assert after == pytest.approx(min(grid.values()), rel=1e-9)
    # the weak prior is what the selection corrects: a larger τ and a strictly lower NLL
    assert tau > tau0
    assert after < before - 1e-3


def test_selection_keeps_the_current_prior_precision_when_it_is_best() -> None:
    model, guide, _, held_out = _problem("marglik")
    tau0 = guide.prior_precision
    # a grid without 1 gets it added, so the result is never worse than the current τ
    tau = select_prior_precision(model, guide, held_out, factors=(1e-3, 1e3))
    nll = {f: None for f in (1e-3, 1.0, 1e3)}
    for f in nll:
        guide.set_prior_precision(tau0 * f)
        nll[f] = _nll(model, guide, held_out)
    guide.set_prior_precision(tau)
    assert _nll(model, guide, held_out) == pytest.approx(min(nll.values()), rel=1e-9)
    assert tau / tau0 in [pytest.approx(f) for f in nll]
    assert DEFAULT_FACTORS[0] == pytest.approx(1e-2) and DEFAULT_FACTORS[-1] == pytest.approx(1e4)
    assert 1.0 in DEFAULT_FACTORS


def test_selection_refuses_what_it_cannot_use() -> None:
    model, guide, train, held_out = _problem(1.0)
    with pytest.raises(TypeError, match="expected a Laplace posterior"):
        select_prior_precision(model, pb.posterior(model, "map"), held_out)
    with pytest.raises(ValueError, match="factors must be finite numbers > 0"):
        select_prior_precision(model, guide, held_out, factors=(0.0, 1.0))
    with pytest.raises(ValueError, match="no batches"):
        select_prior_precision(model, guide, [])
    # a generator: the first grid point's pass used it up ("yielded no batches" before)
    with pytest.raises(TypeError, match="one-shot iterator .* read for every τ of the grid"):
        select_prior_precision(model, guide, iter(held_out))
    assert guide.prior_precision == pytest.approx(1.0)  # a failed selection leaves τ as it was
    pb.calibrate(model, guide, held_out)
    with pytest.raises(ValueError, match="Select τ first, then call pyrobayes.calibrate"):
        select_prior_precision(model, guide, held_out)
    unfitted = pb.posterior(model, "laplace")
    with pytest.raises(RuntimeError, match="not fitted"):
        select_prior_precision(model, unfitted, held_out)
    fit_laplace(model, unfitted, train)  # and a fitted one is accepted
    assert select_prior_precision(model, unfitted, held_out, factors=(1.0,)) > 0


def test_the_fit_setting_selects_tau_on_the_fits_validation_data() -> None:
    """``pb.infer.Laplace(prior_optimization="validation")``: the same τ as the post-hoc call on
    the data passed as ``validation=``; without held-out data the fit refuses before training."""
    model, fitted, train, held_out = _problem(1e-3)
    reference = pb.posterior(model, "laplace", init=fitted, prior_precision=1e-3)
    plain = pb.fit(model, reference, train, epochs=0, progress=False)
    # a fit without a search reports the τ it used, and no starting τ
    assert plain.state["prior_precision"] == pytest.approx(1e-3, rel=1e-12)
    assert "prior_precision_start" not in plain.state
    expected = select_prior_precision(model, reference, held_out)
    assert expected > 1e-3  # the weak prior moves (as in the first test)
    settings = pb.infer.Laplace(prior_optimization="validation")
    guide = pb.posterior(model, "laplace", init=fitted, prior_precision=1e-3)
    result = pb.fit(
        model,
        guide,
        train,
        epochs=0,
        progress=False,
        validation=pb.Validation(held_out),
        optim=pb.Optimization(optimizer=settings),
    )
    assert guide.prior_precision == pytest.approx(expected, rel=1e-12)
    assert result.state["fitter"] == "LaplaceFitter"
    # the fit reports the τ it chose and the one it started from (the guide's)
    assert result.state["prior_precision"] == guide.prior_precision
    assert result.state["prior_precision_start"] == pytest.approx(1e-3, rel=1e-12)
    assert settings.needs_validation and not pb.infer.Laplace().needs_validation
    again = pb.posterior(model, "laplace", init=fitted, prior_precision=1e-3)
    with pytest.raises(ValueError, match=r"validation=pyrobayes.Validation\(val_loader\)"):
        pb.fit(
            model, again, train, epochs=0, progress=False, optim=pb.Optimization(optimizer=settings)
        )
    assert not again.is_fitted  # refused before the curvature was fitted
    with pytest.raises(ValueError, match="'evidence', 'alternate' or 'validation'"):
        pb.infer.Laplace(prior_optimization="heldout")


@pytest.mark.parametrize("pred_type", ["glm", "probit"])
def test_the_grid_reuses_the_held_out_jacobians_with_the_same_result(
    monkeypatch, pred_type
) -> None:
    """The linearised predictive's network passes (f(x; θ̂), J(x)) do not depend on τ: the
    grid forms them once, and every grid point's prediction equals ``pb.predict``'s exactly
    (the same floating-point operations on the same Jacobians); above the memory bound each
    point runs its own passes, with the same choice."""
    from pyrobayes import linearized
    from pyrobayes.infer import prior_precision as pp

    model, guide, _, held_out = _problem(1e-3)
    guide.pred_type = pred_type
    lin = linearized.linearize(model, guide, held_out)
    assert lin is not None and lin.contrast == (pred_type == "glm")
    for tau in (1e-3, 1.0):
        guide.set_prior_precision(tau)
        cached = linearized.linearized_predict(
            model, guide, [], num_samples=32, seed=0, linearization=lin
        )
        plain = pb.predict(model, guide, held_out, num_samples=32, seed=0)
        assert torch.equal(cached.log_probs, plain.log_probs)
        assert torch.equal(cached.targets, plain.targets)
    guide.set_prior_precision(1e-3)
    assert linearized.linearize(model, guide, held_out, max_bytes=100) is None  # over the bound
    passes = []
    original = linearized.output_jacobians
    monkeypatch.setattr(
        linearized, "output_jacobians", lambda *a, **k: passes.append(1) or original(*a, **k)
    )
    factors = (1.0, 1e2, 1e4)
    tau_cached = select_prior_precision(model, guide, held_out, factors=factors)
    cached_passes = len(passes)
    assert cached_passes == len(held_out)  # one pass per batch for the whole grid
    guide.set_prior_precision(1e-3)
    monkeypatch.setattr(pp, "LINEARIZATION_MAX_BYTES", 0)  # every grid point runs its passes
    tau_plain = select_prior_precision(model, guide, held_out, factors=factors)
    # (the attempt to keep them stops at the first chunk over the bound: one pass more)
    assert len(passes) - cached_passes == len(factors) * len(held_out) + 1
    assert tau_plain == tau_cached
    # a predictive type changed after forming the Jacobians is refused, not mixed up
    guide.pred_type = "probit" if pred_type == "glm" else "glm"
    with pytest.raises(ValueError, match="call linearize\\(\\) again"):
        linearized.linearized_predict(model, guide, [], linearization=lin)


def test_set_prior_precision_refuses_what_is_not_a_precision_and_drops_a_temperature() -> None:
    # τ = 0 or -1 (log τ passed for τ: log_prior_bounds are natural logs) was accepted: the
    # covariance became (H − I)⁻¹ and draws reached 29 against 1.3, without a word
    model, guide, _, _ = _problem(1.0)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="set_prior_precision: τ must be a finite number > 0"):
            guide.set_prior_precision(bad)
    assert guide.prior_precision == 1.0
    pb.calibration.set_temperature(guide, 0.9)
    with pytest.warns(UserWarning, match=r"set_prior_precision: LaplaceGuide was calibrated"):
        guide.set_prior_precision(2.0)  # a temperature of the old τ's predictive calibrates
    assert guide.prior_precision == 2.0 and pb.calibration.temperature(guide) == 1.0
