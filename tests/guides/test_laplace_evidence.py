"""Laplace prior precision by the evidence: post hoc at a fixed MAP, or alternating with MAP refits.

On the linear-Gaussian LoRA-XS core (``tests.common.conjugate_core``) the network output is
``f(θ) = f₀ + K θ`` exactly, so with ``A = KᵀK/σ²`` and ``b = Kᵀ(y − f₀)/σ²``

- the MAP (= exact posterior mean) under the prior ``N(0, τ⁻¹ I)`` is ``m(τ) = (A + τ I)⁻¹ b``;
- the exact log evidence of the Bayesian linear model (MacKay 1992) is
  ``log p(y|τ) = −½ [n log 2πσ² + Σᵢ log(1 + λᵢ/τ) + ‖y − f₀‖²/σ² − bᵀ m(τ)]``, ``λ = eig(A)``;
- full-batch gradient descent with step ``η`` on the MAP objective ``½ θᵀ(A + τ I)θ − bᵀθ``
  contracts the error by ``ρ(τ) = maxᵢ |1 − η(λᵢ + τ)|`` per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import pyrobayes as pb
from pyrobayes.guides import LaplaceGuide
from tests.common import conjugate_core, tensor_loader

pytest.importorskip("laplace")

NOISE = 0.5
LR = 0.045  # full-batch GD step: η (λ_max + τ) < 2 for every τ visited below (λ_max = 36)
EPOCHS = 200  # initial MAP training (one step per epoch: a single batch of all 64 examples)
REFIT_EPOCHS = 100  # steps per MAP refit of the alternating option


@dataclass
class Exact:
    """The closed forms of the conjugate core: ``A``, ``b``, ``eig(A)`` and the evidence."""

    a: torch.Tensor
    b: torch.Tensor
    lam: torch.Tensor
    sq_resid: float
    n: int
    shape: torch.Size

    def mean(self, tau: float) -> torch.Tensor:
        """``m(τ) = (A + τ I)⁻¹ b``, the exact posterior mean (= MAP) under ``N(0, τ⁻¹ I)``."""
        eye = torch.eye(self.b.numel(), dtype=self.b.dtype)
        return torch.linalg.solve(self.a + tau * eye, self.b).reshape(self.shape)

    def log_evidence(self, tau: float) -> float:
        quad = self.sq_resid / NOISE**2 - float(self.b @ self.mean(tau).reshape(-1))
        logdet = float(torch.log1p(self.lam / tau).sum())
        return -0.5 * (self.n * math.log(2 * math.pi * NOISE**2) + logdet + quad)

    def rho(self, tau: float) -> float:
        """GD contraction factor per step under ``τ``."""
        return float((1.0 - LR * (self.lam + tau)).abs().max())


def _exact(prob) -> Exact:
    model, site = prob.model, prob.site
    shape = model.latent_sites[site].shape
    zero = torch.zeros(shape)

    def f(core: torch.Tensor) -> torch.Tensor:
        return model.output(prob.x, {site: core})

    f0 = f(zero).detach()
    k = torch.autograd.functional.jacobian(f, zero).reshape(-1, zero.numel())  # f is linear in θ
    resid = (prob.y - f0).reshape(-1)
    a = k.T @ k / NOISE**2
    b = k.T @ resid / NOISE**2
    lam = torch.linalg.eigvalsh(a)
    return Exact(a, b, lam, float(resid @ resid), resid.numel(), shape)


def _argmax_log(fn: Callable[[float], float], lo: float = -8.0, hi: float = 8.0) -> float:
    """``argmax_τ fn(τ)`` over ``log τ ∈ [lo, hi]``: a grid, then golden section to 1e-12."""
    xs = torch.linspace(lo, hi, 321, dtype=torch.float64).tolist()
    i = max(range(len(xs)), key=lambda j: fn(math.exp(xs[j])))
    a, b = xs[max(i - 1, 0)], xs[min(i + 1, len(xs) - 1)]
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    while b - a > 1e-12:
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if fn(math.exp(c)) >= fn(math.exp(d)):
            b = d
        else:
            a = c
    return math.exp(0.5 * (a + b))


MAP_TOL = 1e-9  # the refits' relative-gradient tolerance (alternate_map_tol) in these tests


def _fit(prior_scale: float, structure: str, mode: str, evidence: str | None = None):
    prob = conjugate_core(noise=NOISE, prior_scale=prior_scale)
    model = prob.model
    loader = tensor_loader(prob.x, prob.y, 64)
    guide = LaplaceGuide(model, structure=structure)
    settings = pb.infer.Laplace(
        prior_optimization=mode,
        evidence=evidence,
        alternate_tol=1e-3,
        alternate_epochs=REFIT_EPOCHS,
        alternate_map_tol=MAP_TOL,
        optimizer=torch.optim.SGD,
    )
    init = guide.loc(prob.site).detach().clone()
    fitter = pb.infer.make_fitter(model, guide, optimizer=settings, lr=LR)
    model.train(True)
    fitter.begin(loader)
    for epoch in range(EPOCHS):
        for batch in loader:
            fitter.step(batch)
        fitter.epoch_end(epoch)
    fitter.end(loader)
    model.train(False)
    return prob, guide, fitter, init


@pytest.mark.parametrize(("structure", "prior_scale"), [("kron", 0.5), ("diag", 3.0)])
def test_alternating_reaches_exact_evidence_optimum(structure: str, prior_scale: float) -> None:
    prob, guide, fitter, _ = _fit(prior_scale, structure, "alternate")
    exact = _exact(prob)
    tau0 = 1.0 / prior_scale**2
    # the closed form agrees with conjugate_core's evidence (a dense Gaussian) at τ₀
    assert exact.log_evidence(tau0) == pytest.approx(prob.log_evidence, rel=1e-12)
    tau_star = _argmax_log(exact.log_evidence)  # measured: 1.02630
    # measured: 1.02658 from τ₀ = 4 (kron, +2.7e-4), 1.02562 from τ₀ = 1/9 (diag, −6.7e-4)
    tau = guide.prior_precision
    assert abs(tau / tau_star - 1.0) < 0.01
    assert abs(tau0 / tau_star - 1.0) > 0.5  # it started far away
    assert prob.model.prior_scale == prior_scale  # the refits' prior is restored
    # the history: τ₀, then the evidence maximiser after each MAP; the guide keeps the last MAP's τ
    trace = fitter.prior_precisions
    assert trace[0] == tau0 and trace[-2] == tau and len(trace) >= 4
    assert abs(math.log(trace[-1] / trace[-2])) < 1e-3
    # The mean is the MAP under the guide's τ: the last refit stopped at a relative gradient
    # r = ‖∇U(μ)‖/‖τμ‖ < MAP_TOL, and U(θ) = ½θᵀ(A + τI)θ − bᵀθ + c is (λ_min + τ)-strongly
    # convex, so ‖μ − m(τ)‖ ≤ ‖∇U(μ)‖/(λ_min + τ) = r ‖τμ‖/(λ_min + τ) (+ float64 rounding).
    mu = guide.mean()[prob.site]
    residual = fitter.map_residuals[-1]
    assert residual < MAP_TOL
    gd_tol = residual * tau * float(mu.norm()) / (float(exact.lam.min()) + tau) + 1e-12
    assert float((mu - exact.mean(tau)).norm()) <= gd_tol
    # ... and so the exact posterior mean at τ* up to the τ gap: ‖dm/dτ‖ = ‖(A+τI)⁻¹ m‖ ≤
    # ‖m‖/(λ_min + τ) along the path between τ and τ*. Measured: 9e-5 (kron), 2.2e-4 (diag).
    gap = abs(tau - tau_star) * float(exact.mean(min(tau, tau_star)).norm())
    gap /= float(exact.lam.min()) + min(tau, tau_star)
    assert float((mu - exact.mean(tau_star)).norm()) <= gd_tol + gap
    # mean and covariance share the prior: the covariance is the exact posterior's at τ
    var = guide.get_posterior(prob.site).variance
    exact_var = torch.diagonal(torch.linalg.inv(exact.a + tau * torch.eye(exact.b.numel())))
    torch.testing.assert_close(var.reshape(-1), exact_var, rtol=1e-6, atol=0.0)


def test_evidence_default_keeps_the_map_of_the_initial_prior() -> None:
    """``"evidence"`` (the default) with laplace-torch's evidence: τ moves, the mean stays the MAP
    under τ₀ = 1/s_p²."""
    prior_scale = 0.5
    prob, guide, fitter, init = _fit(prior_scale, "kron", "evidence", "posterior_mode")
    assert fitter.settings.prior_optimization == "evidence"
    assert pb.infer.Laplace().prior_optimization == "evidence"  # the default
    exact = _exact(prob)
    tau0 = 1.0 / prior_scale**2
    # GD from the initial core for EPOCHS steps under τ₀: error ≤ ‖θ_init − m(τ₀)‖ ρ(τ₀)^EPOCHS
    # (+ rounding). Measured: 2e-15.
    mu = guide.mean()[prob.site]
    m0 = exact.mean(tau0)
    gd_tol = float((init - m0).norm()) * exact.rho(tau0) ** EPOCHS + 1e-12
    assert float((mu - m0).norm()) <= gd_tol
    # τ maximises the Laplace evidence with θ* = m(τ₀) and H = A held (exact H here):
    # −τ/2 ‖θ*‖² + d/2 log τ − ½ Σ log(λᵢ + τ); golden section in fit_laplace to ~1e-8 in log τ
    sq, d = float(m0.square().sum()), exact.b.numel()

    def post_hoc(tau: float) -> float:
        return (
            -0.5 * tau * sq
            + 0.5 * d * math.log(tau)
            - 0.5 * float(torch.log(exact.lam + tau).sum())
        )

    tau = guide.prior_precision
    assert tau == pytest.approx(_argmax_log(post_hoc), rel=1e-6)  # measured: τ = 1.4401
    tau_star = _argmax_log(exact.log_evidence)
    assert abs(tau / tau_star - 1.0) > 0.3  # not the evidence optimum of the whole model
    # the known offset: the mean belongs to τ₀, the covariance to τ; in posterior sd the mean is
    # 0.92 sd (max over entries) off the MAP under its own covariance's prior, 1.16 sd off the
    # exact posterior mean at τ*
    sd = guide.get_posterior(prob.site).variance.sqrt()
    assert float(((mu - exact.mean(tau)) / sd).abs().max()) > 0.5
    assert float(((mu - exact.mean(tau_star)) / sd).abs().max()) > 0.5


def test_options_validated_and_saved(tmp_path) -> None:
    prob = conjugate_core()
    with pytest.raises(ValueError, match="prior_optimization"):
        pb.infer.Laplace(prior_optimization="mackay")
    with pytest.raises(ValueError, match="alternate_max_iter"):
        pb.infer.Laplace(prior_optimization="alternate", alternate_max_iter=0)
    alternate = pb.infer.Laplace(prior_optimization="alternate", alternate_epochs=2)
    with pytest.raises(ValueError, match="needs the guide's prior_precision=.marglik."):
        pb.infer.make_fitter(
            prob.model, LaplaceGuide(prob.model, prior_precision="model"), optimizer=alternate
        )
    # the deprecated guide keywords are checked by name too, before the warning
    with pytest.raises(ValueError, match="prior_optimization"):
        LaplaceGuide(prob.model, prior_optimization="mackay")
    with pytest.raises(ValueError, match="needs prior_precision=.marglik."):
        LaplaceGuide(prob.model, prior_precision="model", prior_optimization="alternate")
    guide = LaplaceGuide(prob.model, structure="diag")
    loader = tensor_loader(prob.x, prob.y, 16)
    pb.fit(prob.model, guide, loader, epochs=2, lr=0.05, optim=pb.Optimization(optimizer=alternate))
    assert guide.is_fitted and prob.model.prior_scale == 1.0
    loaded = pb.load(pb.save(guide, tmp_path / "alt.safetensors"), prob.model)
    assert "prior_optimization" not in loaded.config()  # the fit's, not the posterior's
    assert loaded.prior_precision == guide.prior_precision


def _sd_offsets(prob, guide, exact: Exact, tau_star: float) -> tuple[float, float]:
    """Max over entries of |μ − m(τ)|/sd and |τ/τ* − 1| of a fitted alternating guide."""
    tau = guide.prior_precision
    mu = guide.mean()[prob.site]
    sd = guide.get_posterior(prob.site).variance.sqrt()
    return float(((mu - exact.mean(tau)) / sd).abs().max()), abs(tau / tau_star - 1.0)


def test_alternating_after_a_schedule_decayed_to_zero() -> None:
    """A linear schedule ends at lr 0; the refits run at the rate the fit started with (the
    schedule's initial_lr), so the iteration still reaches the evidence fixed point instead of
    returning the post-hoc τ with the mean of τ₀."""
    prob = conjugate_core(noise=NOISE, prior_scale=0.5)
    guide = LaplaceGuide(prob.model, structure="kron")
    settings = pb.infer.Laplace(
        prior_optimization="alternate", alternate_map_tol=MAP_TOL, optimizer=torch.optim.SGD
    )
    loader = tensor_loader(prob.x, prob.y, 64)
    optim = pb.Optimization(optimizer=settings, scheduler="linear")
    pb.fit(prob.model, guide, loader, epochs=EPOCHS, lr=LR, optim=optim, progress=False)
    exact = _exact(prob)
    tau_star = _argmax_log(exact.log_evidence)
    off_sd, off_tau = _sd_offsets(prob, guide, exact, tau_star)
    # the alternate_tol of 1e-3 in log τ bounds the last step, and the fixed point's τ error is
    # of that order (measured ~3e-4 above); the mean is the MAP of its τ to MAP_TOL (≈ 0 sd)
    assert off_tau < 0.01 and off_sd < 1e-6
    # the post-hoc τ at the MAP of τ₀ = 4 is 1.44 (test_evidence_default_...): 40% off τ*
    assert abs(guide.prior_precision - 1.4401) > 0.3


def test_alternating_defaults_reach_the_fixed_point_with_adam(caplog) -> None:
    """The defaults (Adam at fit's lr, minibatches of 16, refits to a relative gradient of 1e-2,
    at most 100 epochs each): τ within 1% of the exact evidence optimum and the mean within
    0.01 posterior sd of the MAP of its τ, without a warning (5 steps per refit left 2–4e-3 in τ
    and 0.02 sd). Measured: τ 8e-4 off, the mean .004 sd off."""
    prob = conjugate_core(noise=NOISE, prior_scale=0.5)
    guide = LaplaceGuide(prob.model, structure="diag")
    settings = pb.infer.Laplace(prior_optimization="alternate")
    assert settings.alternate_map_tol == 1e-2 and settings.alternate_epochs == 100
    optim = pb.Optimization(optimizer=settings)
    data = tensor_loader(prob.x, prob.y, 16)
    with caplog.at_level("WARNING", logger="pyrobayes.infer.laplace"):
        pb.fit(prob.model, guide, data, epochs=60, lr=0.05, progress=False, optim=optim)
    assert "not at the fixed point" not in caplog.text
    exact = _exact(prob)
    off_sd, off_tau = _sd_offsets(prob, guide, exact, _argmax_log(exact.log_evidence))
    assert off_tau < 0.01 and off_sd < 0.01, (off_tau, off_sd)


def test_alternating_warns_when_not_at_the_fixed_point(caplog) -> None:
    prob = conjugate_core(noise=NOISE, prior_scale=0.5)
    guide = LaplaceGuide(prob.model, structure="diag")
    settings = pb.infer.Laplace(prior_optimization="alternate", alternate_max_iter=1)
    optim = pb.Optimization(optimizer=settings)
    data = tensor_loader(prob.x, prob.y, 64)
    with caplog.at_level("WARNING", logger="pyrobayes.infer.laplace"):
        pb.fit(prob.model, guide, data, epochs=20, lr=0.05, progress=False, optim=optim)
    assert "not at the fixed point after 1 MAP refits" in caplog.text
    assert "alternate_max_iter" in caplog.text


def test_alternating_refuses_a_zero_learning_rate() -> None:
    prob = conjugate_core(noise=NOISE, prior_scale=0.5)
    guide = LaplaceGuide(prob.model)
    optim = pb.Optimization(optimizer=pb.infer.Laplace(prior_optimization="alternate"))
    data = tensor_loader(prob.x, prob.y, 64)
    with (
        pytest.warns(UserWarning, match="learning rate is 0"),
        pytest.raises(ValueError, match="learning rate 0.*pass alternate_lr > 0"),
    ):
        pb.fit(prob.model, guide, data, epochs=1, lr=0.0, progress=False, optim=optim)


# ------------------------------------------------------------------ the evidence at the likelihood's mode
def test_likelihood_mode_evidence_is_the_exact_linear_gaussian_evidence() -> None:
    """With the point at the likelihood's mode ``θ_ML = A⁻¹ b`` of the linear-Gaussian core, the
    formula plus ``log p(y | θ_ML)`` is the model's exact log evidence at every τ, and
    coordinates without curvature leave it unchanged whatever their value."""
    from pyrobayes.infer.evidence import eigen_coordinates, likelihood_mode_log_evidence

    prob = conjugate_core(noise=NOISE)
    exact = _exact(prob)
    a, b = exact.a.double(), exact.b.double()
    lam, q = torch.linalg.eigh(a)
    theta_ml = torch.linalg.solve(a, b)
    # log p(y|θ_ML) = −½[n log 2πσ² + ‖r‖²/σ² − bᵀ A⁻¹ b]  (‖r − Kθ‖²/σ² = ‖r‖²/σ² − 2bᵀθ + θᵀAθ)
    log_lik = -0.5 * (
        exact.n * math.log(2 * math.pi * NOISE**2) + exact.sq_resid / NOISE**2 - float(b @ theta_ml)
    )
    coords = q.T @ theta_ml
    for tau in (1e-3, 0.3, 1.0, 7.0, 1e3):
        got = log_lik + likelihood_mode_log_evidence(lam, coords, tau)
        assert got == pytest.approx(exact.log_evidence(tau), rel=1e-6, abs=1e-6)
    # undetermined coordinates (λ = 0), however large, cost nothing
    lam0 = torch.cat([lam, torch.zeros(5, dtype=lam.dtype)])
    coords0 = torch.cat([coords, torch.full((5,), 40.0, dtype=coords.dtype)])
    for tau in (0.3, 7.0):
        assert likelihood_mode_log_evidence(lam0, coords0, tau) == pytest.approx(
            likelihood_mode_log_evidence(lam, coords, tau), rel=1e-12
        )
    # eigen_coordinates needs a fitted guide with latent sites: checked on the fits below
    with pytest.raises(ValueError, match="no latent sites"):
        eigen_coordinates(type("Empty", (), {"sites": {}})())


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_likelihood_mode_evidence_post_hoc_reaches_the_exact_optimum(structure: str) -> None:
    """Trained under a negligible prior (τ₀ = 1e-6) the point is the likelihood's mode, and one
    post-hoc ``Laplace(evidence="likelihood_mode")`` reaches the exact evidence optimum τ*, which
    laplace-torch's posterior-mode evidence at the same point misses (it charges τ‖θ̂‖²)."""
    from pyrobayes.infer.evidence import eigen_coordinates

    prior_scale = 1e3
    prob = conjugate_core(noise=NOISE, prior_scale=prior_scale)
    exact = _exact(prob)
    loader = tensor_loader(prob.x, prob.y, 64)
    taus = {}
    for evidence in ("likelihood_mode", "posterior_mode"):
        torch.manual_seed(0)
        model = conjugate_core(noise=NOISE, prior_scale=prior_scale).model
        guide = LaplaceGuide(model, structure=structure)
        settings = pb.infer.Laplace(evidence=evidence, optimizer=torch.optim.SGD)
        pb.fit(
            model, guide, loader, epochs=EPOCHS, lr=LR, optim=pb.Optimization(optimizer=settings)
        )
        taus[evidence] = guide.prior_precision
        if evidence == "likelihood_mode":
            fitted = guide
    theta_ml = torch.linalg.solve(exact.a, exact.b).reshape(exact.shape)
    mu = fitted.mean()[prob.site]
    # GD under τ₀ = 1e-6 for EPOCHS steps: at m(τ₀) to 1e-12 (ρ^EPOCHS), and m(τ₀) is θ_ML up to
    # τ₀‖θ‖/λ_min ≈ 1e-6 relative; measured ‖μ − θ_ML‖/‖θ_ML‖ = 1.6e-7
    assert float((mu - theta_ml).norm()) < 1e-5 * float(theta_ml.norm())
    # the eigen-coordinates reproduce the guide's dense precision H + τI (rotation and order)
    lam, coords = eigen_coordinates(fitted)
    tau = fitted.prior_precision
    dense = fitted.posterior_precision(prob.site).double()
    h = dense - tau * torch.eye(dense.shape[0], dtype=dense.dtype)
    flat = mu.reshape(-1).double()
    assert float((lam * coords**2).sum()) == pytest.approx(float(flat @ h @ flat), rel=1e-9)
    assert float(torch.log1p(lam / tau).sum()) == pytest.approx(
        float(torch.logdet(dense)) - dense.shape[0] * math.log(tau), rel=1e-9
    )
    # laplace-torch's evidence (the posterior_mode fit) is the stored curvature's posterior-mode
    # formula: the same maximiser, golden section to ~1e-8 in log τ on both sides
    from pyrobayes.infer.evidence import posterior_mode_log_evidence
    from pyrobayes.infer.laplace import tune_prior_precision

    tau_pm = tune_prior_precision(lambda t: posterior_mode_log_evidence(lam, coords, t))
    assert tau_pm == pytest.approx(taus["posterior_mode"], rel=1e-6)
    # the curvature is exact here (A is diagonal by design), so τ is the exact evidence's optimum
    # up to the point's offset from θ_ML (τ = γ/Σ w²θ², so about twice its relative 1.6e-7) and
    # the golden section's ~1e-9 in log τ: measured |τ/τ* − 1| = 3.6e-7 (both structures); the
    # bound 1e-5 leaves a 30× margin. The posterior-mode evidence: measured −17.5%.
    tau_star = _argmax_log(exact.log_evidence)
    assert abs(taus["likelihood_mode"] / tau_star - 1.0) < 1e-5
    assert abs(taus["posterior_mode"] / tau_star - 1.0) > 0.1


def test_evidence_option_validated() -> None:
    with pytest.raises(ValueError, match="evidence 'likelihood_mode' or 'posterior_mode'"):
        pb.infer.Laplace(evidence="ml")
    with pytest.raises(ValueError, match="use evidence='posterior_mode' with it"):
        pb.infer.Laplace(prior_optimization="alternate", evidence="likelihood_mode")
    assert pb.infer.Laplace().evidence == "likelihood_mode"  # the default
    assert pb.infer.Laplace(prior_optimization="validation").evidence == "likelihood_mode"
    assert pb.infer.Laplace(prior_optimization="alternate").evidence == "posterior_mode"


def test_default_evidence_warns_when_it_returns_the_map(caplog) -> None:
    """A five-epoch MAP of a small MLP on 60 examples: no direction is determined beyond its
    posterior sd, the default evidence puts τ at its upper bound (the predictive is the MAP's)
    and says so, naming the alternatives; laplace-torch's evidence keeps a finite τ."""
    from tests.common import small_lora_xs_classifier

    prob = small_lora_xs_classifier()
    loader = tensor_loader(prob.x, prob.y, 20)
    taus = {}
    for evidence in ("likelihood_mode", "posterior_mode"):
        guide = LaplaceGuide(prob.model, structure="kron")
        settings = pb.infer.Laplace(evidence=evidence)
        with caplog.at_level("WARNING", logger="pyrobayes.infer.laplace"):
            caplog.clear()
            pb.fit(
                prob.model,
                guide,
                loader,
                epochs=5,
                lr=0.05,
                seed=0,
                optim=pb.Optimization(optimizer=settings),
            )
        taus[evidence] = guide.prior_precision
        warned = "evidence='posterior_mode'" in caplog.text
        assert warned == (evidence == "likelihood_mode")
    hi = pb.infer.Laplace().log_prior_bounds[1]
    assert taus["likelihood_mode"] == pytest.approx(math.exp(hi), rel=1e-6)
    assert taus["posterior_mode"] < math.exp(hi) / 10
