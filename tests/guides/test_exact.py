"""Mean-field VI on a LoRA-XS core whose exact posterior is diagonal (STYLE §7.4 item 1)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import pyrobayes as pb
from tests.common import conjugate_core


def test_closed_form_is_the_posterior():
    # the fixture's algebra, checked against a brute-force dense Gaussian posterior
    prob = conjugate_core()
    layer = prob.model.net[0]
    s, noise = layer.scaling, 0.5
    rank = layer.rank
    z = layer.down @ prob.x.T  # (r, N)
    # y − W0 x = s·up·C·z + ε with C the core weight: vec over (i, j) of C, features s·up[:, i] z_j
    feats = torch.einsum("oi,jn->noij", layer.up, z).reshape(-1, rank * rank) * s
    target = (prob.y - prob.x @ layer.base.weight.T).reshape(-1)
    precision = torch.eye(rank * rank) + feats.T @ feats / noise**2
    mean = torch.linalg.solve(precision, feats.T @ target / noise**2)
    cov = torch.linalg.inv(precision)
    # x was built with pinv(down), so down·x reproduces the designed z only to ~1e-8 relative
    torch.testing.assert_close(mean.reshape(rank, rank), prob.post_loc, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(cov.diagonal().sqrt().reshape(rank, rank), prob.post_scale)
    off = cov - torch.diag(cov.diagonal())
    # diagonal (up to the pinv round-off above): mean-field contains the exact posterior
    assert off.abs().max() < 1e-5 * cov.diagonal().min()


def _fit_and_average(prob, guide, settings=None) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Fit ``guide`` to the conjugate core (full batch: the only noise is the
    reparameterization), anneal, and average the last 1000 iterates (Polyak) to remove the
    optimizer's jitter: the averaged ``(loc, scale)`` of the core's site and the annealing
    fit's ``FitResult``. ``settings``: the fit's settings record (e.g. ``pb.infer.MeanField``)."""
    data = [(prob.x, prob.y)]
    objective = pb.infer.objectives.ELBO(num_particles=32)
    optim = pb.Optimization(optimizer=settings, loss=objective, num_steps=1500)
    pb.fit(prob.model, guide, data, lr=0.02, optim=optim)
    locs, scales = [], []

    def record(step: int, value: float) -> None:
        if step > 500:
            locs.append(guide.loc(prob.site).detach().clone())
            scales.append(guide.scale(prob.site).detach().clone())

    result = pb.fit(
        prob.model, guide, data, lr=0.002, optim=optim, progress=pb.Progress(callback=record)
    )
    return torch.stack(locs).mean(0), torch.stack(scales).mean(0), result


def test_meanfield_recovers_exact_posterior():
    prob = conjugate_core()
    guide = pb.guides.MeanFieldGuide(prob.model, init_scale=0.1)
    loc, scale, _ = _fit_and_average(prob, guide)
    sd = prob.post_scale
    # Tolerances. Posterior sds here are 0.05-0.16. The averaged iterate's error comes from the
    # gradient noise of 32 particles: each step's data-term gradient has relative noise ≈ 1/√32,
    # Adam moves ≤ lr = 2e-3 per step, and averaging 1000 correlated iterates leaves ≲ 2e-3
    # absolute, i.e. ≤ 0.05 sd; we allow 0.1 sd for the mean and 5% for the scale.
    assert ((loc - prob.post_loc).abs() / sd).max() < 0.1, (loc, prob.post_loc)
    assert ((scale - sd).abs() / sd).max() < 0.05, (scale, sd)


def test_elbo_at_exact_posterior_equals_log_evidence():
    # when q is the exact posterior, ELBO = log p(y): check our objective's estimator
    prob = conjugate_core()
    guide = pb.guides.MeanFieldGuide(prob.model)
    guide.set_site(prob.site, loc=prob.post_loc, scale=prob.post_scale)
    objective = pb.infer.objectives.ELBO(num_particles=4000)
    torch.manual_seed(0)
    with torch.no_grad():
        negative_elbo = objective.loss(prob.model, guide, (prob.x, prob.y))
    # Normal log-probs are normalized, so −loss estimates log p(y) directly. MC sd of the data term with 4000 draws: the term's sd per
    # draw is ≈ √(2·r²) ≈ 4 nats here, so 4000 draws give ≈ 0.07 nats; 4σ ≈ 0.3.
    assert abs(-float(negative_elbo) - prob.log_evidence) < 0.3


def test_meanfield_joint_draws_and_kl_equal_the_separate_calls() -> None:
    # rsample_with_kl (the ELBO hot path) = rsample + kl_to_prior on the same RNG stream, and the
    # closed form equals torch's Normal-Normal KL for a non-zero prior mean and scale
    from torch.distributions import Normal, kl_divergence

    prob = conjugate_core()
    guide = pb.guides.MeanFieldGuide(prob.model, init_scale=0.3)

    class ShiftedPrior:
        def __getattr__(self, name):
            return getattr(prob.model, name)

        def prior_loc_scale(self, site):
            return 0.7, 2.5

    shifted = ShiftedPrior()
    torch.manual_seed(3)
    draws, kl = guide.rsample_with_kl(4, shifted)
    torch.manual_seed(3)
    draws_ref = guide.rsample(4)
    for site in guide.sites:
        torch.testing.assert_close(draws[site], draws_ref[site], rtol=0, atol=0)
    torch.testing.assert_close(kl, guide.kl_to_prior(shifted), rtol=1e-12, atol=1e-12)
    ref = sum(
        kl_divergence(Normal(guide.loc(s), guide.scale(s)), Normal(0.7, 2.5)).sum()
        for s in guide.sites
    )
    torch.testing.assert_close(kl, ref, rtol=1e-10, atol=1e-10)


def _type2_prior_scale(prob) -> float:
    """The prior scale s that maximises the evidence p(y | s) of the conjugate core (dense)."""
    layer = prob.model.net[0]
    scaling, noise, rank = layer.scaling, 0.5, layer.rank
    z = (layer.down @ prob.x.T).double()
    feats = torch.einsum("oi,jn->noij", layer.up.double(), z).reshape(-1, rank * rank) * scaling
    target = (prob.y - prob.x @ layer.base.weight.T).reshape(-1).double()
    eye = torch.eye(len(target), dtype=torch.float64)

    def neg_log_evidence(log_s: torch.Tensor) -> torch.Tensor:
        cov = log_s.exp() ** 2 * feats @ feats.T + noise**2 * eye
        return -torch.distributions.MultivariateNormal(torch.zeros_like(target), cov).log_prob(
            target
        )

    grid = torch.linspace(-4.0, 2.0, 601, dtype=torch.float64)
    log_s = grid[torch.stack([neg_log_evidence(g) for g in grid]).argmin()].clone()
    log_s.requires_grad_(True)
    for _ in range(50):  # Newton on log s from the grid's best point
        (g,) = torch.autograd.grad(neg_log_evidence(log_s), log_s, create_graph=True)
        (h,) = torch.autograd.grad(g, log_s)
        log_s = (log_s - g / h).detach().requires_grad_(True)
    return float(log_s.detach().exp())


def test_empirical_prior_meanfield_recovers_the_type2_posterior() -> None:
    """prior="empirical" maximises the ELBO over q and one prior scale per site. ELBO(q, s) ≤
    log p(y | s) with equality at q = p(θ | y, s), so the joint optimum is the exact posterior
    under the evidence-maximising prior scale s* (type-II maximum likelihood), and ŝ = s*
    there. On the conjugate core the exact posterior is diagonal, so mean-field can reach it."""
    prob = conjugate_core(prior_scale=5.0)  # the model's own prior, which EB must not use
    s_star = _type2_prior_scale(prob)
    assert abs(math.log(s_star / 5.0)) > 1.0  # far from it: the test tells them apart
    exact = conjugate_core(prior_scale=s_star)
    # at s*, s*² = mean(μ² + σ²) of the exact posterior (the EM fixed point of the evidence)
    moment = (exact.post_loc.square() + exact.post_scale.square()).mean()
    assert abs(float(moment.sqrt()) / s_star - 1) < 1e-4
    guide = pb.guides.MeanFieldGuide(prob.model, init_scale=0.1, prior="empirical")
    loc, scale, _ = _fit_and_average(prob, guide)
    sd = exact.post_scale
    # the tolerances of test_meanfield_recovers_exact_posterior (same optimiser, particles and
    # averaging; the reasoning there): 0.1 sd for the mean, 5% for the scale; ŝ is a root mean
    # square over the 9 entries of μ² + σ², each within those bounds, so within 5% too. The
    # model's own prior would miss: its exact posterior (s = 5) is 0.44 sd and 11.5% away.
    assert ((loc - exact.post_loc).abs() / sd).max() < 0.1, (loc, exact.post_loc)
    assert ((scale - sd).abs() / sd).max() < 0.05, (scale, sd)
    assert abs(float(guide.empirical_prior_scale(prob.site, prob.model)) / s_star - 1) < 0.05


def test_empirical_prior_kl_is_the_minimum_over_the_prior_scale() -> None:
    """KL_EB = min_s KL(q ‖ N(m, s²)) per site, reached at ŝ; zero when q is any isotropic
    N(m, c²) (the prior can take its scale)."""
    from torch.distributions import Normal, kl_divergence

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model = pb.models.FineTuneModel(
        net, pb.models.LoRA(rank=2, target_modules=["0"]), latent_modules=["2"], num_data=96
    )
    guide = pb.guides.MeanFieldGuide(model, init_scale=0.05, prior="empirical")
    with torch.no_grad():
        for site in guide.sites:
            guide.set_site(site, scale=torch.rand_like(guide.loc(site)) * 0.2 + 0.01)
        kl = guide.kl_to_prior(model)
        total = 0.0
        for site in guide.sites:
            q = Normal(guide.loc(site), guide.scale(site))
            s_hat = guide.empirical_prior_scale(site, model)
            at = float(kl_divergence(q, Normal(0.0, s_hat)).sum())
            for factor in (0.9, 0.99, 1.01, 1.1):  # the minimum: every other scale is worse
                assert float(kl_divergence(q, Normal(0.0, s_hat * factor)).sum()) > at
            total += at
        torch.testing.assert_close(kl, torch.tensor(total), rtol=1e-5, atol=1e-5)
        for site in guide.sites:
            guide.set_site(
                site,
                loc=torch.zeros_like(guide.loc(site)),
                scale=torch.full_like(guide.loc(site), 0.3),
            )
        torch.testing.assert_close(guide.kl_to_prior(model), torch.tensor(0.0), rtol=0, atol=1e-4)
    shared = pb.guides.MeanFieldGuide(model, init_scale=0.05, prior="empirical-shared")
    with torch.no_grad():
        for site in shared.sites:  # sites of different magnitudes: one scale cannot fit all
            shared.set_site(site, loc=guide.loc(site) * 3, scale=torch.rand_like(guide.loc(site)))
        s_hat = shared.empirical_prior_scale(None, model)

        def shared_kl(scale: float) -> float:
            return sum(
                float(
                    kl_divergence(Normal(shared.loc(s), shared.scale(s)), Normal(0.0, scale)).sum()
                )
                for s in shared.sites
            )

        for factor in (0.9, 0.99, 1.01, 1.1):
            assert shared_kl(float(s_hat) * factor) > shared_kl(float(s_hat))
        torch.testing.assert_close(
            shared.kl_to_prior(model), torch.tensor(shared_kl(float(s_hat))), rtol=1e-5, atol=1e-5
        )
        # one scale for all sites costs more than one per site
        assert float(shared.kl_to_prior(model)) > sum(
            float(
                kl_divergence(
                    Normal(shared.loc(s), shared.scale(s)),
                    Normal(0.0, shared.empirical_prior_scale(s, model)),
                ).sum()
            )
            for s in shared.sites
        )
    # the Monte Carlo KL would use the model's prior: refused, with the way out named
    with pytest.raises(ValueError, match=r"prior='empirical'.*analytic_kl=True"):
        pb.infer.objectives.ELBO(analytic_kl=False).loss(
            model, guide, (torch.randn(4, 8), torch.randint(0, 3, (4,)))
        )
    with pytest.raises(ValueError, match="expected prior 'model'"):
        pb.guides.MeanFieldGuide(model, prior="evidence")

    class Wider(pb.guides.MeanFieldGuide):  # another q: the closed form would not be its KL
        def get_posterior(self, site):
            return torch.distributions.Independent(
                Normal(self.loc(site), 2 * self.scale(site)), self.loc(site).dim()
            )

    with pytest.raises(ValueError, match="overrides get_posterior, so use prior='model'"):
        Wider(model, prior="empirical")


def test_meanfield_with_a_weighted_kl_recovers_the_tempered_posterior() -> None:
    """``MeanField(kl_weight=w)``: the fit minimises ``nll + w·KL``, whose optimum is the exact
    posterior of the likelihood raised to ``1/w``. On the conjugate core that posterior is
    Gaussian and diagonal: the data's precision and natural location scale by ``1/w``,
    ``Λ_w = τ + (Λ − τ)/w``, ``μ_w = (Λ μ)/(w Λ_w)`` (τ = 1, the core's prior precision)."""
    prob = conjugate_core()
    w, tau = 0.25, 1.0
    precision = prob.post_scale.pow(-2)
    precision_w = tau + (precision - tau) / w
    loc_w, sd_w = precision * prob.post_loc / (w * precision_w), precision_w.rsqrt()
    # the tempered posterior is another posterior: its sds are 0.53-0.59x the ELBO's here
    assert (sd_w / prob.post_scale).max() < 0.6
    guide = pb.guides.MeanFieldGuide(prob.model, init_scale=0.1)
    # the helper's ELBO(num_particles=32) is bound to kl_weight = w by the fitter
    loc, scale, result = _fit_and_average(prob, guide, pb.infer.MeanField(kl_weight=w))
    # the tolerances of test_meanfield_recovers_exact_posterior (same optimiser, particles and
    # averaging), relative to the tempered sds
    assert ((loc - loc_w).abs() / sd_w).max() < 0.1, (loc, loc_w)
    assert ((scale - sd_w).abs() / sd_w).max() < 0.05, (scale, sd_w)
    # the reported terms still add up to the optimised objective at every step:
    # loss = N·(nll + w·kl), kl the KL itself (float32 sums: 1e-5 relative)
    terms, num_data = result.state["terms"], prob.model.num_data
    total = num_data * (terms["nll"] + w * terms["kl"])
    torch.testing.assert_close(total, result.losses.to(total.dtype), rtol=1e-5, atol=1e-4)
    assert not torch.allclose(num_data * (terms["nll"] + terms["kl"]), total)


def test_a_weighted_kl_is_refused_where_it_has_no_meaning() -> None:
    prob = conjugate_core()
    guide = pb.guides.MeanFieldGuide(prob.model)
    with pytest.raises(ValueError, match=r"kl_weight must be a finite number > 0"):
        pb.infer.objectives.ELBO(kl_weight=0.0)
    with pytest.raises(ValueError, match=r"kl_weight"):
        pb.infer.MeanField(kl_weight=-1.0)
    with pytest.raises(ValueError, match=r"Symmetrized\(\): kl_weight=0\.5.*MeanField"):
        pb.infer.Symmetrized(kl_weight=0.5)
    with pytest.raises(TypeError, match=r"kl_weight=0\.5\) weights the KL of pyrobayes"):
        pb.infer.make_fitter(
            prob.model,
            guide,
            lr=0.01,
            loss=pb.infer.objectives.MAP(),
            optimizer=pb.infer.MeanField(kl_weight=0.5),
        )
