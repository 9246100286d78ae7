"""Laplace over a subset of the sites (laplace-torch's ``subset_of_weights``) and Kronecker curvature
for layers with a bias, against laplace-torch on the same network at the same point."""

from __future__ import annotations

import copy

import pytest
import torch

import pyrobayes as pb
from pyrobayes.guides import LaplaceGuide
from pyrobayes.infer.laplace import fit_laplace, glm_moments
from pyrobayes.models import FineTuneModel, LoRAXS
from tests.common import mlp, mlp_problem, tensor_loader

laplace = pytest.importorskip("laplace")

TAU = 0.7


def _head_latent(dtype: torch.dtype = torch.float64, *, point_head: bool = False):
    """LoRA-XS cores on layers 0 and 2 and the head "4" (weight and bias) as latent sites, or
    (``point_head``) the head a point parameter, the library's default for a task head."""
    head = {"trainable_modules": ["4"]} if point_head else {"latent_modules": ["4"]}
    prob = mlp_problem(
        (5, 8, 8, 3),
        LoRAXS(rank=3, target_modules=["0", "2"]),
        num_data=60,
        seed=3,
        **{"trainable_modules": [], **head},
    )
    model = prob.model.to(dtype)
    x = prob.x.to(dtype)
    return model, x, prob.y


def _guide(model, x, y, **kw) -> LaplaceGuide:
    guide = LaplaceGuide(model, prior_precision=TAU, **kw)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a point away from the initial values (a non-zero head and cores)
        for s in guide.sites:
            loc = guide.loc(s)
            loc.add_(0.3 * torch.randn(loc.shape, generator=gen, dtype=loc.dtype))
    fit_laplace(model, guide, tensor_loader(x, y, 20))
    return guide


def _plain_net(model, guide) -> torch.nn.Module:
    """A copy of the network with every site at the guide's point, as a laplace-torch user has."""
    net = copy.deepcopy(model.net)
    with torch.no_grad():
        for s in guide.sites:
            net.get_parameter(model.latent_sites[s].param_name).copy_(guide.loc(s))
    for p in net.parameters():
        p.requires_grad_(True)
    return net


def _laplace_torch(net, x, y, subset: str, structure: str = "kron"):
    """laplace-torch's Laplace over ``subset`` of ``net`` at τ = TAU, fitted on (x, y)."""
    la = laplace.Laplace(
        net,
        "classification",
        subset_of_weights=subset,
        hessian_structure=structure,
        prior_precision=TAU,
    )
    la.fit(tensor_loader(x, y, 20))
    return la


def _dense_precision(guide: LaplaceGuide, sites: list[str]) -> torch.Tensor:
    return torch.block_diag(*(guide.posterior_precision(s) for s in sites))


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_last_layer_equals_laplace_torch_last_layer(structure: str) -> None:
    """subset="last_layer" on a head with a bias is laplace-torch's last-layer Laplace: the same
    posterior precision, GLM moments, probit predictive and log marginal likelihood."""
    model, x, y = _head_latent()
    guide = _guide(model, x, y, structure=structure, subset="last_layer")
    assert guide.latent_subset == ["4.weight", "4.bias"]
    net = _plain_net(model, guide)
    la = _laplace_torch(net, x, y, "last_layer", structure)
    ref = la.posterior_precision
    ref = ref.to_matrix() if structure == "kron" else torch.diag(ref)
    ours = _dense_precision(guide, ["4.weight", "4.bias"])
    assert ref.shape == (27, 27)
    # float64; the same laplace-torch factors (kron) or the same GGN by another route (diag)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)
    assert (ref - TAU * torch.eye(27)).abs().max() > 10 * TAU  # the data term is not negligible
    mean, cov = glm_moments(model, guide, x[:7])
    ref_mean, ref_var = la._glm_predictive_distribution(x[:7])
    torch.testing.assert_close(mean, ref_mean, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(cov, ref_var, rtol=1e-10, atol=1e-12)
    guide.pred_type = "probit"
    ours_p = pb.predict(model, guide, [(x[:7], y[:7])]).mean_probs
    ref_p = la(x[:7], pred_type="glm", link_approx="probit")
    torch.testing.assert_close(ours_p, ref_p, rtol=1e-10, atol=1e-12)
    # the sites outside the subset are held at their point: a draw leaves them there
    draws = guide.sample_posterior(3)
    for s in ("0.core", "2.core"):
        torch.testing.assert_close(draws[s], guide.loc(s).detach().expand(3, 3, 3))
    assert not torch.allclose(draws["4.bias"][0], guide.loc("4.bias"))


def test_last_layer_evidence_equals_laplace_torch() -> None:
    """The tuned τ maximises laplace-torch's own last-layer log marginal likelihood."""
    model, x, y = _head_latent()
    guide = LaplaceGuide(model, structure="kron", subset="last_layer")
    # laplace-torch's evidence: the point taken as the posterior's mode
    settings = pb.infer.Laplace(evidence="posterior_mode")
    la = fit_laplace(model, guide, tensor_loader(x, y, 20), settings=settings)
    net = _plain_net(model, guide)
    ref = laplace.Laplace(
        net, "classification", subset_of_weights="last_layer", hessian_structure="kron"
    )
    ref.fit(tensor_loader(x, y, 20))
    tau = guide.prior_precision

    def lml(t: float) -> float:
        return float(ref.log_marginal_likelihood(prior_precision=torch.tensor(t)))

    assert lml(tau) == pytest.approx(float(la.log_marginal_likelihood()), rel=1e-10)
    # a maximum: 1% either side is lower (golden section to 1e-8 in log τ)
    assert lml(tau) > max(lml(tau * 1.01), lml(tau / 1.01))


def test_adapter_and_head_jointly_equal_laplace_torch_all() -> None:
    """subset="all" with a latent head: cores and head in one Kronecker-factored posterior, equal
    to laplace-torch's ``subset_of_weights="all"`` over the same tensors (weight ⊗ blocks and
    a dense block per bias)."""
    model, x, y = _head_latent()
    guide = _guide(model, x, y, structure="kron")
    net = _plain_net(model, guide)
    for p in net.parameters():
        p.requires_grad_(False)
    for s in guide.sites:
        net.get_parameter(model.latent_sites[s].param_name).requires_grad_(True)
    la = _laplace_torch(net, x, y, "all")
    order = [n for n, p in net.named_parameters() if p.requires_grad]
    by_param = {model.latent_sites[s].param_name: s for s in guide.sites}
    ours = _dense_precision(guide, [by_param[n] for n in order])
    torch.testing.assert_close(ours, la.posterior_precision.to_matrix(), rtol=1e-10, atol=1e-10)
    mean, cov = glm_moments(model, guide, x[:5])
    ref_mean, ref_var = la._glm_predictive_distribution(x[:5])
    torch.testing.assert_close(cov, ref_var, rtol=1e-10, atol=1e-12)


def test_kron_bias_blocks_are_the_exact_hessian_blocks() -> None:
    """One linear Gaussian output: K-FAC's weight block ``G ⊗ A`` and its bias block ``G`` are the
    exact Hessian's diagonal blocks (G = 1/σ² per example: no approximation within a block)."""
    torch.manual_seed(0)
    net = mlp(4, 1, activation=None)
    model = FineTuneModel(
        net, latent_modules=["0"], likelihood="gaussian", obs_scale=0.3, num_data=30
    ).double()
    x = torch.randn(30, 4, dtype=torch.float64)
    y = torch.randn(30, dtype=torch.float64)
    guide = LaplaceGuide(model, structure="kron", prior_precision=TAU)
    fit_laplace(model, guide, tensor_loader(x, y, 10))
    w, b = guide.loc("0.weight").detach(), guide.loc("0.bias").detach()

    def neg_log_joint(flat: torch.Tensor) -> torch.Tensor:
        f = model.output(x, {"0.weight": flat[:4].reshape(1, 4), "0.bias": flat[4:]})
        nll = -torch.distributions.Normal(f, 0.3).log_prob(y).sum()
        return nll + 0.5 * TAU * flat.square().sum()

    hess = torch.autograd.functional.hessian(neg_log_joint, torch.cat([w.reshape(-1), b]))
    torch.testing.assert_close(
        guide.posterior_precision("0.weight"), hess[:4, :4], rtol=1e-10, atol=1e-10
    )
    torch.testing.assert_close(
        guide.posterior_precision("0.bias"), hess[4:, 4:], rtol=1e-10, atol=1e-10
    )
    q = guide.get_posterior("0.bias")
    torch.testing.assert_close(q.covariance_matrix, torch.linalg.inv(hess[4:, 4:]))


def test_glm_monte_carlo_with_subset_matches_laplace_torch() -> None:
    """The Monte Carlo GLM predictive of a last-layer posterior against laplace-torch's ``mc``.

    20 000 draws each: a mean probability's Monte Carlo sd is ≤ 0.5/√20000 = .0035, the
    difference of two independent estimates ≤ .005; atol .02 is four of those."""
    model, x, y = _head_latent()
    guide = _guide(model, x, y, structure="kron", subset="last_layer", link_samples=20_000)
    la = laplace.Laplace(
        _plain_net(model, guide),
        "classification",
        subset_of_weights="last_layer",
        hessian_structure="kron",
        prior_precision=TAU,
    )
    la.fit(tensor_loader(x, y, 20))
    ours = pb.predict(model, guide, [(x[:6], y[:6])]).mean_probs
    torch.manual_seed(1)
    ref = la(x[:6], pred_type="glm", link_approx="mc", n_samples=20_000)
    torch.testing.assert_close(ours, ref, rtol=0.0, atol=0.02)
    probit = la(x[:6], pred_type="glm", link_approx="probit")
    assert (ref - probit).abs().max() > 1e-3  # the Monte Carlo is not the probit approximation


def test_adapter_subset_holds_the_head() -> None:
    model, x, y = _head_latent()
    guide = _guide(model, x, y, structure="kron", subset="adapter")
    assert guide.latent_subset == ["0.core", "2.core"]
    assert set(guide.fixed_point()) == {"4.weight", "4.bias"}
    draws = guide.sample_posterior(2)
    torch.testing.assert_close(draws["4.weight"][1], guide.loc("4.weight").detach())
    with pytest.raises(ValueError, match="'4.bias' is outside subset"):
        guide.posterior_precision("4.bias")


def test_subset_errors_name_what_to_do() -> None:
    prob = mlp_problem((5, 8, 3), LoRAXS(rank=2, target_modules=["0"]), num_data=10, seed=0)
    with pytest.raises(
        ValueError, match=r"subset='last_layer' needs a whole layer.*latent_modules"
    ):
        LaplaceGuide(prob.model, subset="last_layer")
    with pytest.raises(ValueError, match=r"unknown sites \['nope'\]"):
        LaplaceGuide(prob.model, subset=["nope"])
    with pytest.raises(ValueError, match="subset must be 'all', 'adapter', 'last_layer'"):
        LaplaceGuide(prob.model, subset="head")


def test_subset_saved_and_loaded(tmp_path) -> None:
    """The subset is part of the saved configuration; a loaded guide predicts the same."""
    model, x, y = _head_latent()
    guide = _guide(model, x, y, structure="kron", subset="last_layer", pred_type="probit")
    path = pb.save(guide, tmp_path / "ll.safetensors")
    loaded = pb.load(path, model)
    assert loaded.subset == guide.subset and loaded.latent_subset == ["4.weight", "4.bias"]
    before = pb.predict(model, guide, [(x[:5], y[:5])]).mean_probs
    after = pb.predict(model, loaded, [(x[:5], y[:5])]).mean_probs
    torch.testing.assert_close(after, before, rtol=0.0, atol=0.0)


def test_head_made_latent_after_a_map_fit_is_laplace_torch_last_layer() -> None:
    """A MAP trained with a point head (the library's default model), then
    ``model.make_latent(["4"])`` and ``posterior(..., init=map_guide, subset="last_layer")``: the
    trained head is the linearisation point, and the posterior precision and probit predictive
    are laplace-torch's last-layer Laplace on that same MAP network, as a laplace-torch user
    would fit it."""
    model, x, y = _head_latent(point_head=True)
    map_guide = pb.posterior(model, "map")
    pb.fit(model, map_guide, tensor_loader(x, y, 20), epochs=20, lr=1e-2, progress=False)
    trained = {k: v.detach().clone() for k, v in model.point_params.items()}
    assert model.make_latent(["4"]) == ["4.weight", "4.bias"]
    assert not model.point_params and {"4.weight", "4.bias"} <= set(model.latent_sites)
    guide = pb.posterior(model, "laplace", init=map_guide, subset="last_layer", prior_precision=TAU)
    pb.fit(model, guide, tensor_loader(x, y, 20), epochs=0, progress=False)
    for name in ("4.weight", "4.bias"):  # the point is the trained head, the cores the MAP's
        torch.testing.assert_close(guide.loc(name).detach(), trained[name], rtol=0, atol=0)
    for site in ("0.core", "2.core"):
        torch.testing.assert_close(guide.loc(site).detach(), map_guide.loc(site).detach())
    net = _plain_net(model, guide)
    la = _laplace_torch(net, x, y, "last_layer")
    ours = _dense_precision(guide, ["4.weight", "4.bias"])
    torch.testing.assert_close(ours, la.posterior_precision.to_matrix(), rtol=1e-10, atol=1e-10)
    guide.pred_type = "probit"
    ours_p = pb.predict(model, guide, [(x[:7], y[:7])]).mean_probs
    ref_p = la(x[:7], pred_type="glm", link_approx="probit")
    torch.testing.assert_close(ours_p, ref_p, rtol=1e-10, atol=1e-12)
    # a module that is not a point parameter (an adapted layer, or the head twice) is refused
    for bad in ("0", "4", "nope", "nope.deeper"):
        with pytest.raises(ValueError, match=f"make_latent: '{bad}' is not a point-estimated"):
            model.make_latent([bad])


def test_a_guide_built_before_make_latent_is_not_fitted_again() -> None:
    # the MAP guide has no site for the head made latent after it: fitting it again trained
    # the head neither as a point parameter nor as the guide's (its values froze in silence)
    model, x, y = _head_latent(point_head=True)
    map_guide = pb.posterior(model, "map")
    data = tensor_loader(x, y, 20)
    pb.fit(model, map_guide, data, epochs=2, lr=1e-2, progress=False)
    model.make_latent(["4"])
    with pytest.raises(
        ValueError, match=r"no posterior over the model's latent sites \['4.bias', "
    ):
        pb.fit(model, map_guide, data, epochs=1, lr=1e-2, progress=False)
    # the recipe: a new guide over every site (starting from the fitted one)
    guide = pb.posterior(model, "laplace", init=map_guide)
    pb.fit(model, guide, data, epochs=0, progress=False)


def test_head_made_latent_on_a_rebuilt_model_with_the_map_head() -> None:
    """A post-hoc Laplace on a *rebuilt* model (the same pretrained network, the MAP's head
    copied over, then made latent: what the demo's job does per family) starts at the MAP like
    the same-model route and gives the same posterior; a rebuilt model whose head was not
    copied is refused by name."""
    model, x, y = _head_latent(point_head=True)
    rebuilt, _, _ = _head_latent(point_head=True)  # same seed: the same network and cores
    map_guide = pb.posterior(model, "map")
    pb.fit(model, map_guide, tensor_loader(x, y, 20), epochs=20, lr=1e-2, progress=False)
    untrained = {k: v.detach().clone() for k, v in rebuilt.point_params.items()}
    with torch.no_grad():
        for k, v in model.point_params.items():
            rebuilt.point_params[k].copy_(v)
    rebuilt.make_latent(["4"])
    same = copy.deepcopy((model, map_guide))
    same[0].make_latent(["4"])
    guides = []
    for m, init in ((rebuilt, map_guide), same):
        guide = pb.posterior(m, "laplace", init=init, prior_precision=TAU)
        pb.fit(m, guide, tensor_loader(x, y, 20), epochs=0, progress=False)
        guides.append(guide)
    for site in ("0.core", "2.core", "4.weight", "4.bias"):
        torch.testing.assert_close(guides[0].loc(site), guides[1].loc(site), rtol=0, atol=0)
        torch.testing.assert_close(
            guides[0].posterior_precision(site), guides[1].posterior_precision(site)
        )
    # the head left at its initial values: not the MAP's model, refused (sites differ)
    stale, _, _ = _head_latent(point_head=True)
    with torch.no_grad():
        for k, v in untrained.items():
            stale.point_params[k].copy_(v)
    stale.make_latent(["4"])
    with pytest.raises(ValueError, match=r"covers other sites than the new LaplaceGuide"):
        pb.posterior(stale, "laplace", init=map_guide)


def test_a_head_made_latent_is_made_latent_again_on_load(tmp_path) -> None:
    """A posterior saved with the head made latent post hoc loads onto a freshly built model
    (the head a point parameter again): ``load`` makes it latent as it was, and the loaded
    posterior predicts exactly as the saved one."""
    model, x, y = _head_latent(point_head=True)
    map_guide = pb.posterior(model, "map")
    pb.fit(model, map_guide, tensor_loader(x, y, 20), epochs=5, lr=1e-2, progress=False)
    model.make_latent(["4"])
    guide = pb.posterior(model, "laplace", init=map_guide, prior_structure="layerwise")
    pb.fit(model, guide, tensor_loader(x, y, 20), epochs=0, progress=False)
    path = pb.save(guide, tmp_path / "head.safetensors")
    fresh, _, _ = _head_latent(point_head=True)
    assert "4.weight" in fresh.point_params
    loaded = pb.load(path, fresh)
    assert "4.weight" not in fresh.point_params and "4.weight" in fresh.latent_sites
    assert loaded.site_prior_precisions() == guide.site_prior_precisions()
    before = pb.predict(model, guide, [(x[:5], y[:5])]).mean_probs
    after = pb.predict(fresh, loaded, [(x[:5], y[:5])]).mean_probs
    torch.testing.assert_close(after, before, rtol=0.0, atol=0.0)
