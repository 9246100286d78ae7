"""Laplace with one prior precision per site (``prior_structure="layerwise"``), against
laplace-torch's layer-wise prior on the same network at the same point, and reductions to the
scalar prior."""

from __future__ import annotations

import math

import pytest
import torch

import pyrobayes as pb
from pyrobayes.guides import LaplaceGuide
from pyrobayes.infer.evidence import eigen_coordinates, likelihood_mode_log_evidence
from pyrobayes.infer.laplace import fit_laplace, glm_moments
from tests.common import conjugate_core, tensor_loader
from tests.guides.test_laplace_subset import _dense_precision, _head_latent, _plain_net

laplace = pytest.importorskip("laplace")

POSTERIOR_MODE = pb.infer.Laplace(evidence="posterior_mode")


def _moved(guide: LaplaceGuide) -> LaplaceGuide:
    """The guide's point moved away from its initial values (a non-zero head and cores)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for s in guide.sites:
            loc = guide.loc(s)
            loc.add_(0.3 * torch.randn(loc.shape, generator=gen, dtype=loc.dtype))
    return guide


def _laplace_torch_all(model, guide, x, y):
    """laplace-torch's ``subset_of_weights="all"`` Kronecker Laplace over the guide's sites."""
    net = _plain_net(model, guide)
    for p in net.parameters():
        p.requires_grad_(False)
    for s in guide.sites:
        net.get_parameter(model.latent_sites[s].param_name).requires_grad_(True)
    la = laplace.Laplace(net, "classification", subset_of_weights="all", hessian_structure="kron")
    la.fit(tensor_loader(x, y, 20))
    by_param = {model.latent_sites[s].param_name: s for s in guide.sites}
    order = [by_param[n] for n, p in net.named_parameters() if p.requires_grad]
    return la, order


@pytest.mark.filterwarnings("ignore:By default `link_approx` is `probit`")
def test_layerwise_equals_laplace_torch_layerwise_prior() -> None:
    """Cores and a latent head, one τ per site by laplace-torch's evidence: the posterior
    precision and GLM covariance are laplace-torch's at that prior vector, the vector maximises
    laplace-torch's log marginal likelihood in every coordinate, and it reaches at least what
    laplace-torch's own layer-wise optimiser finds."""
    model, x, y = _head_latent()
    guide = _moved(LaplaceGuide(model, structure="kron", prior_structure="layerwise"))
    fit_laplace(model, guide, tensor_loader(x, y, 20), settings=POSTERIOR_MODE)
    taus = guide.site_prior_precisions()
    assert set(taus) == {"0.core", "2.core", "4.weight", "4.bias"}
    # the sites' τ differ: one scalar could not be all of them (the point of the option)
    assert max(taus.values()) / min(taus.values()) > 2.0
    assert guide.prior_precision == pytest.approx(
        math.exp(sum(math.log(t) for t in taus.values()) / 4), rel=1e-12
    )
    la, order = _laplace_torch_all(model, guide, x, y)
    vec = torch.tensor([taus[s] for s in order], dtype=torch.float64)
    la.prior_precision = vec
    ours = _dense_precision(guide, order)
    torch.testing.assert_close(ours, la.posterior_precision.to_matrix(), rtol=1e-10, atol=1e-10)
    _, cov = glm_moments(model, guide, x[:5])
    _, ref_var = la._glm_predictive_distribution(x[:5])
    torch.testing.assert_close(cov, ref_var, rtol=1e-10, atol=1e-12)

    def lml(v: torch.Tensor) -> float:
        return float(la.log_marginal_likelihood(prior_precision=v))

    best = lml(vec)
    for i in range(len(order)):  # golden section to 1e-8 in log τ: 1% either side is lower
        for factor in (1.01, 1 / 1.01):
            moved = vec.clone()
            moved[i] *= factor
            assert lml(moved) < best
    la.optimize_prior_precision(method="marglik", prior_structure="layerwise", n_steps=300)
    # laplace-torch's Adam on log τ reaches our per-site maximum, not beyond it
    assert float(la.log_marginal_likelihood()) <= best + 1e-9 * abs(best)


def test_layerwise_default_evidence_maximises_each_sites_term() -> None:
    """The default evidence (at the likelihood's mode) is a sum over sites; each ``τ_l``
    maximises its own site's term (or sits at the search bound, towards which its term rises),
    and the sum at the per-site vector exceeds the scalar maximum's."""
    model, x, y = _head_latent()
    data = tensor_loader(x, y, 20)
    guide = _moved(LaplaceGuide(model, structure="kron", prior_structure="layerwise"))
    fit_laplace(model, guide, data)
    scalar = _moved(LaplaceGuide(model, structure="kron"))
    fit_laplace(model, scalar, data)
    total, total_at_scalar = 0.0, 0.0
    upper = math.exp(pb.infer.Laplace().log_prior_bounds[1])
    interior = 0
    for site, tau in guide.site_prior_precisions().items():
        lam, coords = eigen_coordinates(guide, sites=[site])
        value = likelihood_mode_log_evidence(lam, coords, tau)
        assert value > likelihood_mode_log_evidence(lam, coords, tau / 1.01)
        if tau < upper / 1.01:  # an interior maximum; at the bound the term still rises to it
            interior += 1
            assert value > likelihood_mode_log_evidence(lam, coords, tau * 1.01)
        total += value
        total_at_scalar += likelihood_mode_log_evidence(lam, coords, scalar.prior_precision)
    lam, coords = eigen_coordinates(scalar)
    assert total_at_scalar == pytest.approx(
        likelihood_mode_log_evidence(lam, coords, scalar.prior_precision), rel=1e-10
    )
    assert total > total_at_scalar
    # here the random cores are not determined by the data (λ θ² < 1: their τ at the bound, no
    # spread) while the head is: one τ for both was a compromise
    assert interior >= 2


@pytest.mark.parametrize("evidence", ["likelihood_mode", "posterior_mode"])
@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_one_site_layerwise_equals_scalar(structure: str, evidence: str) -> None:
    """With one latent site the layer-wise prior is the scalar one: the same τ (both searches
    run the same golden section on the same function, laplace-torch's for the scalar
    posterior-mode evidence, ours per site: 1e-6 relative covers the search's 40 golden steps
    from a grid of step 0.25 in log τ, 0.25·0.618⁴⁰ ≈ 1e-9, and the functions' rounding)."""
    prob = conjugate_core(noise=0.5, prior_scale=1.0)
    data = tensor_loader(prob.x, prob.y, 64)
    settings = pb.infer.Laplace(evidence=evidence)
    taus = []
    for prior_structure in ("scalar", "layerwise"):
        guide = _moved(
            LaplaceGuide(prob.model, structure=structure, prior_structure=prior_structure)
        )
        fit_laplace(prob.model, guide, data, settings=settings)
        taus.append(guide.prior_precision)
        if prior_structure == "layerwise":
            assert guide.site_prior_precisions() == {prob.site: pytest.approx(taus[-1])}
    assert taus[1] == pytest.approx(taus[0], rel=1e-6)


def test_layerwise_saved_loaded_and_scaled(tmp_path) -> None:
    """The per-site τ are saved with the posterior; ``set_prior_precision`` (what
    ``select_prior_precision`` moves) scales them all and keeps their ratios."""
    model, x, y = _head_latent()
    guide = _moved(LaplaceGuide(model, structure="kron", prior_structure="layerwise"))
    fit_laplace(model, guide, tensor_loader(x, y, 20))
    taus = guide.site_prior_precisions()
    loaded = pb.load(pb.save(guide, tmp_path / "lw.safetensors"), model)
    assert loaded.prior_structure == "layerwise" and loaded.site_prior_precisions() == taus
    before = pb.predict(model, guide, [(x[:5], y[:5])]).mean_probs
    after = pb.predict(model, loaded, [(x[:5], y[:5])]).mean_probs
    torch.testing.assert_close(after, before, rtol=0.0, atol=0.0)
    guide.set_prior_precision(3.0 * guide.prior_precision)
    for site, tau in guide.site_prior_precisions().items():
        assert tau == pytest.approx(3.0 * taus[site], rel=1e-12)
    # a fixed τ gives every site that τ
    fixed = LaplaceGuide(model, structure="kron", prior_structure="layerwise", prior_precision=0.7)
    fit_laplace(model, fixed, tensor_loader(x, y, 20))
    assert list(fixed.site_prior_precisions().values()) == pytest.approx([0.7] * 4, rel=1e-12)


def test_layerwise_errors_name_what_to_do() -> None:
    model, _, _ = _head_latent()
    with pytest.raises(
        ValueError, match=r"prior_structure must be one of \['scalar', 'layerwise'\]"
    ):
        LaplaceGuide(model, prior_structure="diag")
    guide = LaplaceGuide(model, prior_structure="layerwise")
    with pytest.raises(ValueError, match="prior_optimization='evidence' with it"):
        pb.infer.make_fitter(
            model, guide, optimizer=pb.infer.Laplace(prior_optimization="alternate"), lr=0.1
        )
    with pytest.raises(ValueError, match="needs prior_structure='layerwise'"):
        LaplaceGuide(model).set_site_prior_precisions({"0.core": 1.0})
    with pytest.raises(ValueError, match=r"missing \['2.core', '4.weight', '4.bias'\]"):
        guide.set_site_prior_precisions({"0.core": 1.0})
