"""Kronecker IVON: exact multi-output linear-Gaussian posterior, reductions, plumbing."""

from __future__ import annotations

import math

import pyro
import pytest
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.distributions import KronEigenNormal, MatrixNormal
from pyrobayes.guides import IVONGuide, KroneckerIVONGuide
from pyrobayes.guides.kron import damped_eigenvalues, eigh_factor
from pyrobayes.infer.ivon import IVONOptimizer, ivon_step_, mean_step_, per_example_nll
from pyrobayes.infer.kron import KronCurvature, kron_precondition
from pyrobayes.models import FineTuneModel
from tests.common import conjugate_core


def _multi_output(num=50, d_in=4, d_out=3, noise=0.5, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(d_in, d_out, bias=bias)
    with torch.no_grad():
        lin.weight.zero_()
        if bias:
            lin.bias.zero_()
    model = FineTuneModel(
        nn.Sequential(lin),
        latent_modules=["0"],
        likelihood="gaussian",
        obs_scale=noise,
        num_data=num,
        prior_scale=1.0,
        trainable_modules=[],
    )
    # correlated inputs: XᵀX is far from diagonal, so the Kronecker structure matters
    x = torch.randn(num, d_in, generator=g) @ torch.randn(d_in, d_in, generator=g)
    w = torch.randn(d_out, d_in, generator=g)
    y = x @ w.T + noise * torch.randn(num, d_out, generator=g)
    prec = torch.kron(torch.eye(d_out), x.T @ x / noise**2) + torch.eye(d_in * d_out)  # row-major
    cov = torch.linalg.inv(prec)
    mean = (cov @ (x.T @ y / noise**2).T.reshape(-1)).reshape(d_out, d_in)
    return model, x, y, mean, cov


def test_exact_multi_output_linear_gaussian_posterior():
    # SPECS 5b.2 deterministic test: full batch, β2 = 0, fisher ggn, λ = N, exact damping
    model, x, y, mean, cov = _multi_output()
    guide = KroneckerIVONGuide(model)
    # β2 = 0 (the factors), the GGN ("ggn_last" is its alias), re-decomposed every step
    settings = pb.infer.KronIVON(beta2=0.0, fisher="ggn_last", T_inv=1)
    locs = []

    def record(step: int, value: float) -> None:
        if step > 100:
            locs.append(guide.loc("0.weight").detach().clone())

    pb.fit(
        model,
        guide,
        [(x, y)],
        lr=0.1,
        seed=0,
        optim=pb.Optimization(optimizer=settings, num_steps=300),
        progress=pb.Progress(callback=record),
    )
    post = guide.get_posterior("0.weight")
    assert isinstance(post, KronEigenNormal)
    # the fitted precision is exactly the posterior's (up to round-off)
    dense = post.to_dense_covariance(row_major=True)
    assert float((dense - cov).norm() / cov.norm()) < 1e-10
    # and 10⁵ samples reproduce it (MC error of a 12×12 covariance ≈ 0.5 %)
    torch.manual_seed(1)
    draws = post.sample((100_000,)).reshape(100_000, -1)
    emp = torch.cov(draws.T)
    assert float((emp - cov).norm() / cov.norm()) < 0.02
    # the Polyak-averaged mean is the posterior mean (single iterates jitter by ~σ/√…)
    sd = cov.diagonal().sqrt().reshape(mean.shape)
    assert float(((torch.stack(locs).mean(0) - mean) / sd).abs().max()) < 0.25


def test_factored_damping_is_a_matrix_normal_with_noisy_kfac_covariance():
    model, x, y, mean, cov = _multi_output()
    guide = KroneckerIVONGuide(model, damping="factored")
    settings = pb.infer.KronIVON(beta2=0.0, fisher="ggn", T_inv=1)
    pb.fit(
        model,
        guide,
        [(x, y)],
        lr=0.1,
        seed=0,
        optim=pb.Optimization(optimizer=settings, num_steps=3),
    )
    post = guide.get_posterior("0.weight")
    assert isinstance(post, MatrixNormal)
    A, G = guide.factors("0.weight")
    lam, delta = guide.ess, guide.weight_decay
    pi = math.sqrt((A.trace() / 4) / (G.trace() / 3))
    U = torch.linalg.inv(G + math.sqrt(delta) / pi * torch.eye(3)) / lam
    V = torch.linalg.inv(A + pi * math.sqrt(delta) * torch.eye(4))
    torch.testing.assert_close(post.row_covariance, U)
    torch.testing.assert_close(post.col_covariance, V)


def test_lora_xs_core_hooks_give_the_exact_posterior():
    # a = down·x, ∂s = scaling·upᵀ∂y: the core's GGN factors are exact for the conjugate fixture
    prob = conjugate_core(num_data=64)
    guide = KroneckerIVONGuide(prob.model)
    settings = pb.infer.KronIVON(beta2=0.0, fisher="ggn", T_inv=1)
    pb.fit(
        prob.model,
        guide,
        [(prob.x, prob.y)],
        lr=0.05,
        seed=0,
        optim=pb.Optimization(optimizer=settings, num_steps=2),
    )
    post = guide.get_posterior(prob.site)
    torch.testing.assert_close(post.variance.sqrt(), prob.post_scale, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("fisher", ["empirical", "mc"])
def test_stochastic_flavours_fit_and_predict(fisher):
    model, x, y, mean, cov = _multi_output(bias=True)
    guide = KroneckerIVONGuide(model)
    settings = pb.infer.KronIVON(fisher=fisher, mc_samples=2, T_stats=2, T_inv=5)
    assert guide.is_kron("0.weight") and not guide.is_kron("0.bias")
    data = [(x[i : i + 10], y[i : i + 10]) for i in range(0, 50, 10)]
    optim = pb.Optimization(optimizer=settings)
    result = pb.fit(model, guide, data, epochs=20, lr=0.1, seed=0, optim=optim)
    assert torch.isfinite(result.losses).all()
    assert result.losses[-20:].mean() < result.losses[:5].mean()
    A, G = guide.factors("0.weight")
    assert torch.linalg.eigvalsh(A).min() >= 0 and torch.linalg.eigvalsh(G).min() >= 0
    assert not torch.allclose(A, A.diagonal().diag())  # correlated inputs were recorded
    pred = pyro.infer.Predictive(model, guide=guide, num_samples=4)((x[:6],))
    assert pred["obs"].shape[0] == 4 and pred["obs"].shape[-2:] == (6, 3)
    assert pb.posterior(model, "kron-ivon").family == "kron-ivon"


@pytest.mark.slow
def test_mc_fisher_matches_the_ggn_in_expectation_for_gaussian():
    # for a Gaussian likelihood E_y[∇l∇lᵀ] = GGN: the MC-Fisher G is unbiased for I/s²
    model, x, y, mean, cov = _multi_output()
    guide = KroneckerIVONGuide(model)
    settings = pb.infer.KronIVON(beta2=0.995, fisher="mc", mc_samples=4)
    optim = pb.Optimization(optimizer=settings, num_steps=800)
    pb.fit(model, guide, [(x, y)], lr=0.05, seed=0, optim=optim)
    _, G = guide.factors("0.weight")
    # G started at I (h0 = 1) and relaxes to I/s² = 4 I with rate 5e-3 per step
    target = 4.0 * (1 - 0.995**800) + 0.995**800
    torch.testing.assert_close(G, target * torch.eye(3), rtol=0.0, atol=0.25)


def test_save_load_keeps_factors(tmp_path):
    model, x, y, *_ = _multi_output(bias=True)
    guide = KroneckerIVONGuide(model)
    optim = pb.Optimization(optimizer=pb.infer.KronIVON(mc_samples=2), num_steps=7)
    pb.fit(model, guide, [(x, y)], optim=optim, lr=0.1, seed=0)
    pb.save(guide, tmp_path / "p.safetensors")
    again = pb.load(tmp_path / "p.safetensors", model)
    assert isinstance(again, KroneckerIVONGuide)
    for a, b in zip(again.factors("0.weight"), guide.factors("0.weight"), strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(again.hess("0.bias"), guide.hess("0.bias"))


# ---------------------------------------------------------------------------- reductions
def test_diagonal_factors_reduce_to_diagonal_ivon_update():
    # with A = diag(a), G = diag(γ) the Kronecker mean step is IVON's with h = γ aᵀ
    torch.manual_seed(0)
    d_out, d_in = 3, 4
    a = torch.rand(d_in) + 0.1
    g = torch.rand(d_out) + 0.1
    (a_, Q_A), (g_, Q_G) = eigh_factor(a.diag()), eigh_factor(g.diag())
    D = damped_eigenvalues(a_, g_, 0.05)
    hyper = dict(lr=0.3, hess_init=0.5, beta1=0.9, weight_decay=0.05, clip_radius=math.inf)
    flags = dict(debias=True, rescale_lr=True)
    M, mom = torch.randn(d_out, d_in), torch.zeros(d_out, d_in)
    m, mom_d, h = M.clone(), torch.zeros(d_out, d_in), g[:, None] * a[None, :]
    for t in range(20):
        grad = torch.randn(d_out, d_in)
        mean_step_(M, mom, grad, t, lambda d: kron_precondition(d, Q_A, Q_G, D), **hyper, **flags)
        # β2 = 1: the curvature is held fixed (the estimators differ)
        ivon_step_(m, mom_d, h, grad, torch.zeros_like(h), t, beta2=1.0, **hyper)
        torch.testing.assert_close(M, m, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(mom, mom_d, rtol=1e-12, atol=1e-12)
    # the preconditioner is (A⊗G + δI)⁻¹ exactly, also for non-diagonal factors
    A = torch.randn(d_in, d_in)
    A = A @ A.T
    G = torch.randn(d_out, d_out)
    G = G @ G.T
    (a_, Q_A), (g_, Q_G) = eigh_factor(A), eigh_factor(G)
    delta = torch.randn(d_out, d_in)
    P = kron_precondition(delta.clone(), Q_A, Q_G, damped_eigenvalues(a_, g_, 0.05))
    dense = torch.kron(G, A) + 0.05 * torch.eye(d_in * d_out)  # row-major vec
    torch.testing.assert_close(P.reshape(-1), torch.linalg.solve(dense, delta.reshape(-1)))


def test_kron_guide_with_frozen_isotropic_factors_equals_ivon_guide(monkeypatch):
    # A = G = sqrt(h0) I frozen (β2 = 1) and IVON's h = h0 frozen: same noise, same trajectory.
    # The settings refuse β2 = 1 (h would never learn); the test sets it in their hyperparameters
    # (β2 = 1 − 2⁻⁵³ is not enough: it rotates the eigenbasis of the isotropic factors, and so
    # the noise the Kronecker guide draws)
    hyper = pb.infer.IVON.hyper
    monkeypatch.setattr(
        pb.infer.IVON,
        "hyper",
        lambda self, *a, **k: {**hyper(self, *a, **k), "beta2": 1.0, "diag_beta2": 1.0},
    )
    runs = []
    for cls in (IVONGuide, KroneckerIVONGuide):
        model, x, y, *_ = _multi_output(bias=True)
        guide = cls(model, hess_init=0.3)
        settings = pb.infer.IVON(mc_samples=2)
        traj = []
        pb.fit(
            model,
            guide,
            [(x[:25], y[:25]), (x[25:], y[25:])],
            lr=0.1,
            seed=3,
            optim=pb.Optimization(optimizer=settings, num_steps=30),
            progress=pb.Progress(
                callback=lambda s, v, g=guide, t=traj: t.append(g.loc("0.weight").detach().clone())
            ),
        )
        runs.append((traj, guide))
    for w_ivon, w_kron in zip(runs[0][0], runs[1][0], strict=True):
        torch.testing.assert_close(w_kron, w_ivon, rtol=1e-10, atol=1e-12)
    # and the posteriors coincide as distributions
    w = torch.randn(5, 3, 4)
    torch.testing.assert_close(
        runs[1][1].get_posterior("0.weight").log_prob(w),
        runs[0][1].get_posterior("0.weight").log_prob(w),
    )


def _three_cores():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    model = FineTuneModel(
        net,
        pb.models.LoRAXS(rank=3, target_modules=["0", "2"]),
        latent_modules=["4"],
        num_data=40,
        trainable_modules=[],
    )
    return model  # two 3x3 cores (one run of the flat layout) + a 3x8 weight and its bias


@pytest.mark.parametrize("damping", ["exact", "factored"])
def test_same_shape_sites_batched_equal_one_by_one(damping):
    # the batched perturbation and mean update over same-shape cores equal the per-site formulas
    model = _three_cores()
    guide = KroneckerIVONGuide(model, damping=damping)
    g = torch.Generator().manual_seed(1)
    for site in guide.sites:  # distinct SPD factors per site
        if guide.is_kron(site):
            for F_ in guide.factors(site):
                m = torch.randn(F_.shape[0], F_.shape[0], generator=g)
                F_.copy_(m @ m.T + 0.1 * torch.eye(F_.shape[0]))
    guide.refresh()
    curvature = KronCurvature(model, guide)
    curvature.remove()
    assert [len(sites) for sites, *_ in curvature.runs] == [2, 1]  # the two cores form one run
    numel = sum(guide.sites[s].numel() for s in curvature.sites)
    eps = torch.randn(5, numel, generator=g)
    batched = curvature.perturbation(eps)
    one_by_one, offset = [], 0
    for site in curvature.sites:
        n, shape = guide.sites[site].numel(), guide.sites[site]
        e = eps[:, offset : offset + n].reshape(5, 1, *shape)
        one_by_one.append(guide.kron_perturbation([site], e).reshape(5, -1))
        offset += n
    torch.testing.assert_close(batched, torch.cat(one_by_one, 1), rtol=1e-12, atol=1e-12)
    # and the guide's site-order perturbation (σ ⊙ ε at the diagonal bias) agrees with them
    eps = torch.randn(5, sum(s.numel() for s in guide.sites.values()), generator=g)
    flat = guide.perturbation(eps)
    bias = [s for s in guide.sites if not guide.is_kron(s)]
    assert len(bias) == 1 and list(guide.sites)[-1] == bias[0]
    torch.testing.assert_close(flat[:, :numel], curvature.perturbation(eps[:, :numel]))
    torch.testing.assert_close(flat[:, numel:], eps[:, numel:] * guide.scale(bias[0]))
    # the stacked mean step = the mean step per site
    sites = curvature.runs[0][0]
    M = torch.randn(len(sites), 3, 3, generator=g)
    mom = torch.randn(len(sites), 3, 3, generator=g)
    grad = torch.randn(len(sites), 3, 3, generator=g)
    kw = dict(lr=0.3, hess_init=0.5, beta1=0.9, weight_decay=0.01, clip_radius=0.05)
    kw.update(debias=True, rescale_lr=True)
    stacked = M.clone(), mom.clone()
    Q_A, Q_G, D = guide.basis(sites)
    mean_step_(*stacked, grad, 4, lambda d: kron_precondition(d, Q_A, Q_G, D), **kw)
    for k, site in enumerate(sites):
        basis = guide.basis([site])
        M_k, mom_k = M[k : k + 1].clone(), mom[k : k + 1].clone()
        mean_step_(
            M_k, mom_k, grad[k : k + 1], 4, lambda d, b=basis: kron_precondition(d, *b), **kw
        )
        torch.testing.assert_close(stacked[0][k : k + 1], M_k, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(stacked[1][k : k + 1], mom_k, rtol=1e-12, atol=1e-12)


def test_factored_damping_broadcasts_one_pi_per_stacked_pair():
    g = torch.Generator().manual_seed(2)
    a, gam = torch.rand(4, 3, generator=g) + 0.1, torch.rand(4, 3, generator=g) + 0.1
    stacked = damped_eigenvalues(a, gam, 0.05, "factored")
    for k in range(4):
        torch.testing.assert_close(
            stacked[k], damped_eigenvalues(a[k], gam[k], 0.05, "factored"), rtol=1e-14, atol=0
        )


def test_lora_factors_are_kronecker_sites_with_their_own_statistics():
    # LoRA A and B are linear layers of their own: A's input factor is E[x xᵀ] over the batch
    # (no dependence on the sampled weights), with β2 = 0 it is exactly xᵀx / B after one step
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    model = FineTuneModel(
        net, pb.models.LoRA(rank=2, target_modules=["0"]), num_data=32, trainable_modules=["2"]
    )
    guide = KroneckerIVONGuide(model)
    sites = {model.latent_sites[s].kind: s for s in guide.sites}
    assert set(sites) == {"lora_A", "lora_B"} and all(guide.is_kron(s) for s in sites.values())
    x, y = torch.randn(32, 5), torch.randint(0, 3, (32,))
    pb.fit(
        model,
        guide,
        [(x, y)],
        lr=0.1,
        seed=0,
        optim=pb.Optimization(optimizer=pb.infer.KronIVON(beta2=0.0, T_inv=1), num_steps=1),
    )
    A_in, G_A = guide.factors(sites["lora_A"])
    assert A_in.shape == (5, 5) and G_A.shape == (2, 2)
    torch.testing.assert_close(A_in, x.T @ x / 32, rtol=1e-12, atol=1e-12)
    A_B, G_B = guide.factors(sites["lora_B"])
    assert A_B.shape == (2, 2) and G_B.shape == (7, 7)
    for F_ in (G_A, A_B, G_B):  # recorded (not the isotropic init) and PSD
        assert not torch.allclose(F_, F_[0, 0] * torch.eye(F_.shape[0]))
        assert torch.linalg.eigvalsh(F_).min() > -1e-12
    # and it fits: the loss goes down over a few epochs, predictions are finite
    result = pb.fit(model, guide, [(x, y)], optim=pb.Optimization(num_steps=30), lr=0.5, seed=1)
    assert result.losses[-5:].mean() < result.losses[:5].mean()
    pred = pb.predict(model, guide, [(x, y)], num_samples=4)
    assert torch.isfinite(pred.log_probs).all()


def _one_step_keeping_the_draw(model, guide, batch, mc_samples=1) -> dict[str, torch.Tensor]:
    """One ``pb.fit`` step on ``batch`` (β2 = 0, ``mc_samples`` draws); returns the weights its
    training sample drew."""
    drawn: dict[str, torch.Tensor] = {}
    sample = IVONOptimizer.training_sample

    def keep_the_draw(self, num, inputs=None):
        values = sample(self, num, inputs)
        drawn.update({k: v.detach().clone() for k, v in values.items()})
        return values

    settings = pb.infer.KronIVON(beta2=0.0, T_inv=1, mc_samples=mc_samples)
    IVONOptimizer.training_sample = keep_the_draw
    try:
        pb.fit(
            model,
            guide,
            [batch],
            lr=0.1,
            seed=0,
            optim=pb.Optimization(optimizer=settings, num_steps=1),
        )
    finally:
        IVONOptimizer.training_sample = sample
    return drawn


@pytest.mark.parametrize("adapter", ["loraxs", "lora"])
def test_empirical_factors_equal_the_gram_matrices_of_the_step(adapter):
    # β2 = 0: after one step A = Â = Σ aᵀa / rows over the core inputs and G = Ĝ = B Σ gᵀg over
    # the gradients of the mean NLL at the core outputs, at the weights the step drew. LoRA-XS:
    # two same-shape cores (the batched path); LoRA: A (r, d_in) and B (d_out, r) (per site).
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    if adapter == "loraxs":
        adapt, suffixes = pb.models.LoRAXS(rank=2, target_modules=["0", "2"]), ["core"]
    else:
        adapt, suffixes = pb.models.LoRA(rank=2, target_modules=["0"]), ["lora_A", "lora_B"]
    model = FineTuneModel(net, adapt, num_data=10, trainable_modules=[])  # cores only
    guide = KroneckerIVONGuide(model)
    x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))
    drawn = _one_step_keeping_the_draw(model, guide, (x, y), mc_samples=2)
    # the reference: the same forward at the drawn weights, with plain hooks and retain_grad
    seen: dict[str, list] = {}
    handles = []
    for site in guide.kron_sites:
        path = model.latent_sites[site].module_path
        suffix = suffixes[0] if adapter == "loraxs" else site.rsplit(".", 1)[-1]
        module = model.net.get_submodule(f"{path}.{suffix}")

        def hook(mod, inputs, out, site=site):
            out.retain_grad()
            seen[site] = [inputs[0].detach(), out]

        handles.append(module.register_forward_hook(hook))
    params = model.batched_output(x, {k: v.requires_grad_() for k, v in drawn.items()})
    per_example_nll(model, params, y, 2, 10).mean().backward()
    for h in handles:
        h.remove()
    assert len(seen) == len(guide.kron_sites) == 2
    for site, (a, out) in seen.items():
        a = a.reshape(-1, a.shape[-1])
        g = out.grad.reshape(-1, out.shape[-1])
        A, G = guide.factors(site)
        torch.testing.assert_close(A, a.T @ a / a.shape[0], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(G, seen[site][0].shape[0] * (g.T @ g), rtol=1e-12, atol=1e-14)
        assert G.abs().max() > 0  # a real gradient, not an empty statistic


@pytest.mark.parametrize("damping", ["exact", "factored"])
@pytest.mark.parametrize(
    "knobs", [{}, {"clip_radius": 0.02}, {"debias": False, "rescale_lr": False}]
)
def test_in_place_kron_step_equals_a_dense_reference(damping, knobs):
    # the batched in-place Kronecker mean step against the dense formula per stacked site:
    # g ← β1 g + (1−β1) ĝ, M ← M − α(h0+δ) clip(P⁻¹ vec(g/(1−β1ᵗ) + δM), ±r) with the
    # preconditioner P = (Q_G ⊗ Q_A) diag(vec D) (Q_G ⊗ Q_A)ᵀ (row-major vec)
    torch.manual_seed(0)
    K, d_out, d_in = 2, 3, 4
    a, Q_A = eigh_factor(_spd(K, d_in))
    g, Q_G = eigh_factor(_spd(K, d_out))
    M, mom = torch.randn(K, d_out, d_in), 0.1 * torch.randn(K, d_out, d_in)
    kw = dict(lr=0.3, hess_init=0.5, beta1=0.8, weight_decay=0.1)
    knobs = {"clip_radius": math.inf, "debias": True, "rescale_lr": True, **knobs}
    D = damped_eigenvalues(a, g, kw["weight_decay"], damping)
    for step in (0, 3):
        grad = torch.randn(K, d_out, d_in)
        ref_mom = kw["beta1"] * mom + (1 - kw["beta1"]) * grad
        bias = 1 - kw["beta1"] ** (step + 1) if knobs["debias"] else 1.0
        ref_M = torch.empty_like(M)
        for k in range(K):
            Q = torch.kron(Q_G[k], Q_A[k])
            P = Q @ torch.diag(D[k].reshape(-1)) @ Q.T
            d = torch.linalg.solve(P, (ref_mom[k] / bias + kw["weight_decay"] * M[k]).reshape(-1))
            d = d.clamp(-knobs["clip_radius"], knobs["clip_radius"]).reshape(d_out, d_in)
            scale = (
                kw["lr"] * (kw["hess_init"] + kw["weight_decay"])
                if knobs["rescale_lr"]
                else kw["lr"]
            )
            ref_M[k] = M[k] - scale * d
        M_, mom_ = M.clone(), mom.clone()
        mean_step_(M_, mom_, grad, step, lambda d: kron_precondition(d, Q_A, Q_G, D), **kw, **knobs)
        torch.testing.assert_close(mom_, ref_mom, rtol=1e-13, atol=1e-14)
        torch.testing.assert_close(M_, ref_M, rtol=1e-12, atol=1e-13)
        M, mom = ref_M, ref_mom


def _spd(K: int, d: int) -> torch.Tensor:
    X = torch.randn(K, 3 * d, d)
    return X.mT @ X / (3 * d)


def test_sites_with_equal_inputs_and_different_outputs():
    # same input width, different output widths: the Gram matrices are formed per site (the
    # batched path needs equal input *and* output shapes)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    model = FineTuneModel(net, latent_modules=["0", "2"], num_data=20, trainable_modules=[])
    guide = KroneckerIVONGuide(model)
    x, y = torch.randn(20, 6), torch.randint(0, 3, (20,))
    pb.fit(
        model,
        guide,
        [(x, y)],
        lr=0.1,
        seed=0,
        optim=pb.Optimization(optimizer=pb.infer.KronIVON(beta2=0.0, T_inv=1), num_steps=2),
    )
    assert len(guide.kron_sites) == 2  # the two weights (the biases are diagonal sites)
    shapes = {s: tuple(guide.factors(s)[1].shape) for s in guide.kron_sites}
    assert sorted(shapes.values()) == [(3, 3), (6, 6)]
    assert all(F.abs().max() > 0 for s in guide.kron_sites for F in guide.factors(s))


def test_input_factor_skips_padded_tokens():
    # token batches (tiny BERT, LoRA-XS on query/value): with β2 = 0 one step leaves
    # A = Â = Σ aᵀa / (real rows) over the non-padding token rows of the S-fold expanded batch
    # (the (B, T) mask tiled S times, sample-major), and G = B Σ gᵀg over all rows, padded rows
    # carrying no gradient. Padding is not data: counting it biases Â towards the pad activations.
    from tests.common import tiny_bert

    torch.manual_seed(0)
    model = FineTuneModel(
        tiny_bert(num_labels=2),
        pb.models.LoRAXS(rank=2, target_modules=["query", "value"]),
        num_data=6,
        trainable_modules=[],
    )
    S, B, T = 2, 6, 7
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 4:] = 0
    mask[3, 2:] = 0
    batch = {
        "input_ids": torch.randint(1, 90, (B, T)),
        "attention_mask": mask,
        "labels": torch.randint(0, 2, (B,)),
    }
    guide = KroneckerIVONGuide(model)
    drawn = _one_step_keeping_the_draw(model, guide, batch, mc_samples=S)
    seen: dict[str, list] = {}
    handles = []
    for site in guide.kron_sites:
        path = model.latent_sites[site].module_path

        def hook(mod, inputs, out, site=site):
            out.retain_grad()
            seen[site] = [inputs[0].detach(), out]

        handles.append(model.net.get_submodule(f"{path}.core").register_forward_hook(hook))
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    params = model.batched_output(inputs, {k: v.requires_grad_() for k, v in drawn.items()})
    per_example_nll(model, params, batch["labels"], S, B).mean().backward()
    for h in handles:
        h.remove()
    real = mask.bool().repeat(S, 1)  # (S·B, T): row s·B + b is example b
    assert len(seen) == 4
    for site, (a, out) in seen.items():
        assert a.shape[:2] == (S * B, T)
        A, G = guide.factors(site)
        kept = a[real]
        torch.testing.assert_close(A, kept.T @ kept / kept.shape[0], rtol=1e-12, atol=1e-14)
        every = a.reshape(-1, a.shape[-1])
        assert not torch.allclose(A, every.T @ every / every.shape[0], rtol=1e-3)
        g = out.grad
        assert torch.equal(g[~real], torch.zeros_like(g[~real]))  # padding gets no gradient
        g = g.reshape(-1, g.shape[-1])
        torch.testing.assert_close(G, S * B * (g.T @ g), rtol=1e-12, atol=1e-14)
        assert G.abs().max() > 0


@pytest.mark.parametrize("damping", ["exact", "factored"])
def test_a_float16_networks_draws_spread_as_the_float32_networks(damping):
    """Inputs of size ~25 on 600 examples put λ(A ⊗ G + δ) near 2e5, past float16's largest
    65504: q built in the network's float16 had an infinite precision and every draw equal to
    its mean (damping="exact"; the factored form's covariance factors fit float16 here, and
    are float32 now too). q stays in the state's float32 (the model runs each draw in float16); the
    fitted statistics agree to float16's rounding of the inputs, and the draws' spread to 10%
    (50 draws: the sd of a sample sd is about sd/sqrt(2·50) = 10%, and both fits share the
    seed)."""
    spread = {}
    for dtype in (torch.float32, torch.float16):
        torch.manual_seed(0)
        x = torch.randn(600, 4) * 25  # (an sd under 30: no raw-input warning)
        y = (x @ torch.randn(4, 3)).argmax(-1)
        net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)
        adapter = pb.models.LoRAXS(rank=3, target_modules=["0"])
        model = FineTuneModel(net, adapter, num_data=600, trainable_modules=["2"])
        guide = pb.posterior(model, "kron-ivon", damping=damping)
        data = [(x[i : i + 30].to(dtype), y[i : i + 30]) for i in range(0, 600, 30)]
        pb.fit(model, guide, data, epochs=2, lr=1e-3, seed=0, progress=False)
        torch.manual_seed(1)
        draws = guide.sample_posterior(50)["0.core"].float()
        assert not (draws == draws[:1]).all(0).any()  # no coordinate constant over the draws
        spread[dtype] = float(draws.std(0).mean())
        pred = pb.predict(model, guide, data[:1], num_samples=4, seed=0)
        assert torch.isfinite(pred.probs).all()
    assert spread[torch.float16] == pytest.approx(spread[torch.float32], rel=0.1)
