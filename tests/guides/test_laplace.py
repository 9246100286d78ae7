"""Laplace (L-LoRA-XS) guide: exact curvature, agreement with laplace-torch, predictives, I/O."""

from __future__ import annotations

import math

import pytest
import torch

import pyrobayes as pb
from pyrobayes.guides import LaplaceGuide
from pyrobayes.infer.laplace import fit_laplace, glm_moments, glm_predict
from pyrobayes.models import FineTuneModel, LoRAXS
from tests.common import conjugate_core, mlp_problem, split_batches, tensor_loader

laplace = pytest.importorskip("laplace")


def _linear_one_output(num_data: int = 40, noise: float = 0.3, rank: int = 3):
    prob = mlp_problem(
        (6, 4, 1),
        LoRAXS(rank=rank, target_modules=["0"]),
        num_data=num_data,
        seed=2,
        activation=None,
        likelihood="gaussian",
        obs_scale=noise,
        trainable_modules=[],
    )
    return prob.model, prob.x, prob.y, tensor_loader(prob.x, prob.y, 16)


def _mlp(num_data: int = 60):
    prob = mlp_problem(
        (5, 8, 8, 3),
        LoRAXS(rank=3, target_modules=["0", "2"]),
        num_data=num_data,
        seed=3,
        trainable_modules=["4"],
    )
    return prob.model, prob.x, prob.y, tensor_loader(prob.x, prob.y, 20)


@pytest.mark.parametrize("rank", [3, 1])  # 1: a 1×1 core, whose G ⊗ A laplace-torch stores whole
@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_ggn_equals_exact_hessian_linear_gaussian(structure: str, rank: int) -> None:
    """SPECS 2(d) 5: f is linear in R with one output, so GGN = Hessian and K-FAC is exact."""
    model, x, y, loader = _linear_one_output(rank=rank)
    tau = 0.7
    guide = LaplaceGuide(model, structure=structure, prior_precision=tau)
    site = next(iter(guide.sites))
    with torch.no_grad():
        guide.loc(site).copy_(0.1 * torch.randn(rank, rank))
    fit_laplace(model, guide, loader)

    def neg_log_joint(core: torch.Tensor) -> torch.Tensor:
        f = model.output(x, {site: core})
        nll = -torch.distributions.Normal(f, 0.3).log_prob(y).sum()
        return nll + 0.5 * tau * core.square().sum()

    hess = torch.autograd.functional.hessian(neg_log_joint, guide.loc(site).detach())
    hess = hess.reshape(rank * rank, rank * rank)
    ours = guide.posterior_precision(site)
    if structure == "kron":
        torch.testing.assert_close(ours, hess, rtol=1e-5, atol=1e-5 * hess.abs().max())
    else:
        torch.testing.assert_close(ours.diagonal(), hess.diagonal(), rtol=1e-5, atol=0.0)
    assert hess.abs().max() > 10 * tau  # the data term dominates: the check is not just τI


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_exact_posterior_on_conjugate_core(structure: str) -> None:
    """At the exact posterior mean, Laplace with τ = 1/s_p² is the exact (diagonal) posterior."""
    prob = conjugate_core()
    guide = LaplaceGuide(prob.model, structure=structure, prior_precision="model")
    with torch.no_grad():
        guide.loc(prob.site).copy_(prob.post_loc)
    fit_laplace(prob.model, guide, tensor_loader(prob.x, prob.y, 16))
    q = guide.get_posterior(prob.site)
    torch.testing.assert_close(q.variance.sqrt(), prob.post_scale, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(q.mean, prob.post_loc)


def _direct_laplace(model, guide, loader, structure):
    """laplace-torch run by hand on model.net at the guide's MAP, cores only, head fixed."""
    net = model.net
    for p in net.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        for s in guide.sites:
            p = net.get_parameter(model.latent_sites[s].param_name)
            p.copy_(guide.loc(s))
            p.requires_grad_(True)
    la = laplace.Laplace(
        net, "classification", subset_of_weights="all", hessian_structure=structure
    )
    la.fit(loader)
    la.prior_precision = torch.tensor(guide.prior_precision)
    return la


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_agrees_with_laplace_torch(structure: str) -> None:
    model, x, y, loader = _mlp()
    guide = LaplaceGuide(model, structure=structure)
    # MAP stage, then curvature + marglik τ: laplace-torch's evidence (θ̂ as the posterior's mode)
    laplace_torch_evidence = pb.infer.Laplace(evidence="posterior_mode")
    pb.fit(
        model,
        guide,
        loader,
        epochs=10,
        lr=0.05,
        optim=pb.Optimization(optimizer=laplace_torch_evidence),
    )
    assert guide.is_fitted
    lo, hi = pb.infer.Laplace().log_prior_bounds  # the default search bounds
    assert math.exp(lo) <= guide.prior_precision <= math.exp(hi)
    la = _direct_laplace(model, guide, loader, structure)
    # posterior precision, block by block (sites in network order = laplace-torch's order)
    if structure == "kron":
        dense = la.posterior_precision.to_matrix()
    else:
        dense = torch.diag(la.posterior_precision)
    blocks = torch.block_diag(*[guide.posterior_precision(s) for s in guide.sites])
    torch.testing.assert_close(blocks, dense, rtol=1e-6, atol=1e-8)

    # the chosen τ maximises laplace-torch's marginal likelihood over the bounded range
    def marglik(t: float) -> float:
        return float(la.log_marginal_likelihood(prior_precision=torch.tensor(t)))

    grid = torch.linspace(lo, hi, 301).exp()
    assert marglik(guide.prior_precision) >= max(marglik(float(t)) for t in grid) - 1e-6
    la.prior_precision = torch.tensor(guide.prior_precision)
    # GLM predictive: moments and probit probabilities
    f_mu, f_var = la._glm_predictive_distribution(x)
    mean, cov = glm_moments(model, guide, x)
    torch.testing.assert_close(mean, f_mu, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(cov, f_var, rtol=1e-6, atol=1e-10)
    probs = la(x, pred_type="glm", link_approx="probit")
    ours = glm_predict(model, guide, loader, link="probit")
    torch.testing.assert_close(ours.mean_probs, probs, rtol=1e-6, atol=1e-8)


def test_predictives_and_save_load(tmp_path) -> None:
    model, x, y, loader = _mlp()
    guide = LaplaceGuide(model, structure="kron")
    with pytest.raises(RuntimeError, match="LaplaceGuide is not fitted"):
        guide.sample_posterior(2)
    pb.fit(model, guide, loader, epochs=8, lr=0.05)
    nn_pred = pb.predict(model, guide, loader, num_samples=8)
    mc = glm_predict(model, guide, loader, link="mc", num_samples=2000)
    probit = glm_predict(model, guide, loader, link="probit")
    # the default (GLM) predictive draws guide.link_samples = 100, whatever num_samples says
    assert nn_pred.log_probs.shape == (100, 60, 3) and mc.log_probs.shape == (2000, 60, 3)
    # probit is an approximation of the MC GLM predictive: close, not equal
    assert (mc.mean_probs - probit.mean_probs).abs().max() < 0.05
    path = pb.save(guide, tmp_path / "laplace.safetensors")
    loaded = pb.load(path, model)
    assert isinstance(loaded, LaplaceGuide) and loaded.prior_precision == guide.prior_precision
    for s in guide.sites:
        torch.testing.assert_close(loaded.posterior_precision(s), guide.posterior_precision(s))
    torch.testing.assert_close(glm_predict(model, loaded, loader).mean_probs, probit.mean_probs)
    counts = pb.count_parameters(loaded)
    assert counts["latent"] == 18 and counts["head"] == 27
    assert counts["posterior_storage"] == 1 + 2 * (2 * 9 + 9 + 9)


def test_dict_batches_tiny_bert() -> None:
    from tests.common import tiny_bert

    torch.manual_seed(0)
    model = FineTuneModel(
        tiny_bert(num_labels=2), LoRAXS(rank=2, target_modules=["query"]), num_data=16
    )
    batches = [
        {
            "input_ids": torch.randint(1, 90, (8, 6)),
            "attention_mask": torch.ones(8, 6, dtype=torch.long),
            "labels": torch.randint(0, 2, (8,)),
        }
        for _ in range(2)
    ]
    guide = LaplaceGuide(model, structure="kron")
    pb.fit(model, guide, batches, epochs=2, lr=0.01)
    assert guide.is_fitted
    pred = glm_predict(model, guide, batches)
    assert pred.log_probs.shape == (1, 16, 2)
    assert torch.isfinite(pred.log_probs).all()


def test_kron_laplace_over_plain_lora_factors() -> None:
    # LoRA's A and B are called as nn.Linear modules for one parameter set, so laplace-torch's
    # Kronecker backend sees their inputs (it raised KeyError on lora_A before)
    prob = mlp_problem(
        (6, 16, 3),
        pb.models.LoRA(rank=2, target_modules=["0"]),
        num_data=64,
        seed=0,
        trainable_modules=["2"],
    )
    model, loader = prob.model, split_batches(prob.x, prob.y, 16)
    guide = LaplaceGuide(model, structure="kron")
    pb.fit(model, guide, loader, epochs=3, lr=1e-2)
    assert set(guide.sites) == {"0.lora_A", "0.lora_B"}
    for site, shape in guide.sites.items():
        precision = guide.posterior_precision(site)
        n = int(torch.Size(shape).numel())
        assert precision.shape == (n, n)
        assert torch.linalg.eigvalsh(precision).min() > 0  # a proper Gaussian
    draws = guide.sample_posterior(3, generator=torch.Generator().manual_seed(0))
    assert draws["0.lora_A"].shape == (3, 2, 6) and torch.isfinite(draws["0.lora_B"]).all()


# ------------------------------------------------------------------------------------------------
# issue 30: non-finite curvature inputs, laplace-torch's exit(), validation without assert
# ------------------------------------------------------------------------------------------------


def _map_then_laplace(x: torch.Tensor, y: torch.Tensor, **kw):
    prob = mlp_problem((5, 8, 3), LoRAXS(rank=2, target_modules=["0"]), num_data=len(x), seed=0)
    map_guide = pb.posterior(prob.model, "map")
    pb.fit(prob.model, map_guide, tensor_loader(prob.x[: len(x)], prob.y[: len(x)], 8), epochs=1)
    guide = pb.posterior(prob.model, "laplace", init=map_guide, **kw)
    return prob.model, guide


def test_nan_input_row_refused_before_the_curvature() -> None:
    """A NaN row reaching the curvature (laplace-torch's eigendecomposition then calls exit())."""
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    x[11, 2] = float("nan")
    model, guide = _map_then_laplace(x, y)
    with pytest.raises(
        ValueError, match=r"batch 1 of the curvature data has non-finite inputs.*rows \[3\]"
    ):
        pb.fit(model, guide, tensor_loader(x, y, 8), epochs=0)
    assert not guide.is_fitted


def test_laplace_torch_exit_becomes_an_exception(monkeypatch) -> None:
    """laplace-torch's symeig calls exit() when its eigendecomposition fails: the process would
    end with status 0 and no message. The SystemExit is turned into a FloatingPointError."""
    import laplace.utils.matrix as lt_matrix

    def failing_symeig(matrix: torch.Tensor):
        exit()  # what laplace.utils.utils.symeig does after its jitter retry fails

    monkeypatch.setattr(lt_matrix, "symeig", failing_symeig)
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    model, guide = _map_then_laplace(x, y, structure="kron")
    with pytest.raises(
        FloatingPointError, match="laplace-torch stopped while fitting the curvature"
    ):
        pb.fit(model, guide, tensor_loader(x, y, 8), epochs=0)


def test_non_finite_point_refused() -> None:
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    model, guide = _map_then_laplace(x, y)
    with torch.no_grad():
        guide.loc("0.core")[0, 0] = float("inf")
    with pytest.raises(ValueError, match="point of site '0.core' holds non-finite values"):
        pb.fit(model, guide, tensor_loader(x, y, 8), epochs=0)


def test_set_curvature_kron_needs_eigenvectors() -> None:
    model, _, _, _ = _mlp()
    guide = LaplaceGuide(model, structure="kron")
    with pytest.raises(ValueError, match="needs the eigenvectors eigvecs_out and eigvecs_in"):
        guide.set_curvature("0.core", torch.ones(3, 3))


def test_changing_pred_type_drops_a_temperature_fitted_for_the_old_predictive() -> None:
    # T fitted under "glm" was applied to "nn" (whose own T differs) without a word
    from pyrobayes.calibration import TEMPERATURE_BUFFER, temperature

    model, x, y, loader = _mlp()
    guide = LaplaceGuide(model, structure="kron", prior_precision=0.05)
    pb.fit(model, guide, loader, epochs=4, lr=0.05)
    fitted = pb.calibrate(model, guide, loader)
    assert fitted != 1.0 and temperature(guide) == fitted
    guide.pred_type = "glm"  # the same predictive: the temperature stays, silently
    assert temperature(guide) == fitted
    with pytest.warns(
        UserWarning,
        match=r"LaplaceGuide\.pred_type: LaplaceGuide was calibrated \(T = .*pred_type='glm'.*"
        r"pred_type='nn'.*removed\. Call pyrobayes\.calibrate",
    ):
        guide.pred_type = "nn"
    assert guide.pred_type == "nn" and TEMPERATURE_BUFFER not in guide._buffers
    # the predictive is now the uncalibrated one, and calibrating it again works
    untempered = pb.predict(model, guide, loader, num_samples=4, seed=0)
    assert pb.calibrate(model, guide, loader) != fitted
    pb.calibration.set_temperature(guide, None)
    torch.testing.assert_close(
        pb.predict(model, guide, loader, num_samples=4, seed=0).log_probs, untempered.log_probs
    )
    guide.pred_type = "probit"  # uncalibrated: nothing to drop, no warning (errors would fail)
