"""Multi-label classification: the Bernoulli likelihood end to end (fits of every family, the
predictive, metrics, temperature, Laplace's curvature, the Hugging Face problem_type, ArviZ)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import pyrobayes as pb
from pyrobayes.infer.kron import _output_hessian_roots
from pyrobayes.linearized import _chunk_predictive
from pyrobayes.models import LoRA, LoRAXS
from pyrobayes.models.likelihoods import (
    Bernoulli,
    bernoulli_log_probs,
    check_class_targets,
    make_likelihood,
)
from tests import families
from tests.common import DEVICES, mlp, tiny_bert


def _problem(family: str | None = None, num_data: int = 64, noise: float = 0.3):
    torch.manual_seed(0)
    net = families.net_for(family, mlp(5, 8, 8, 3))
    adapter = families.adapter_for(family, LoRAXS(rank=2, target_modules=["0", "2"]))
    model = pb.models.FineTuneModel(
        net, adapter, likelihood="bernoulli", num_data=num_data, trainable_modules=["4"]
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(num_data, 5, generator=g)
    w = torch.randn(5, 3, generator=g)
    y = (x @ w + noise * torch.randn(num_data, 3, generator=g) > 0).float()
    return model, [(x[i : i + 16], y[i : i + 16]) for i in range(0, num_data, 16)]


# ------------------------------------------------------------------------------ likelihood


def test_log_prob_is_the_summed_binary_cross_entropy() -> None:
    z, y = torch.randn(2, 6, 4), torch.randint(0, 2, (6, 4))
    lik = make_likelihood("bernoulli")
    expected = -F.binary_cross_entropy_with_logits(
        z, y.to(z.dtype).expand(2, 6, 4), reduction="none"
    ).sum(-1)
    assert torch.equal(lik.log_prob(z, y), expected)  # (S, B): one value per example
    assert torch.equal(lik.log_prob(z, y.bool()), expected)
    assert isinstance(make_likelihood("multilabel"), Bernoulli)
    # bf16 logits are scored in float32 (a bf16 BCE rounds to 2^-8 relative)
    lp = lik.log_prob(z.bfloat16(), y)
    assert lp.dtype == torch.float32
    ref = -F.binary_cross_entropy_with_logits(z.bfloat16().float(), y.float().expand(2, 6, 4))
    assert torch.allclose(lp.mean() / 4, ref, atol=1e-6)


def test_targets_outside_0_1_and_wrong_shapes_are_refused() -> None:
    lik, z = make_likelihood("bernoulli"), torch.randn(5, 3)
    with pytest.raises(ValueError, match=r"targets must be 0 or 1.*examples \[1\]"):
        lik.log_prob(z, torch.tensor([[0, 1, 0], [2, 0, 1], [1, 1, 0], [0, 0, 0], [1, 0, 1]]))
    with pytest.raises(ValueError, match="targets must be 0 or 1"):
        lik.log_prob(z, torch.full((5, 3), 0.5))
    with pytest.raises(ValueError, match=r"targets of shape \(5, 2\).*logits \(5, 3\)"):
        lik.log_prob(z, torch.zeros(5, 2))
    with pytest.raises(ValueError, match=r"targets of shape \(5,\).*likelihood='categorical'"):
        lik.log_prob(z, torch.zeros(5, dtype=torch.long))
    # the categorical likelihood's advice for (B, C) 0/1 targets names the Bernoulli one
    with pytest.raises(ValueError, match="likelihood='bernoulli'"):
        check_class_targets(torch.ones(5, 3, dtype=torch.long), (5, 3))


# ---------------------------------------------------------------------------- every family

FAMILIES = ["map", "meanfield", "ivon", "kron-ivon", "swag", "laplace", "symmetrized", "ibdr"]
FAMILIES += ["signorm"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.filterwarnings("ignore:I_K saturated:RuntimeWarning")  # symmetrized's bonus, inert
def test_every_family_fits_a_multi_label_problem(family: str) -> None:
    model, batches = _problem(family)
    guide = families.posterior(model, family)
    optimizer = families.OPTIMIZERS.get(family)
    kw = {} if optimizer is None else {"optim": pb.Optimization(optimizer=optimizer)}
    # the NLL at the model's initial values, before the fit
    p0 = pb.predict(model, guide, batches, values=model.init_values())
    nll_before = pb.metrics.report(p0, p0.targets)["nll"]
    pb.fit(model, guide, batches, epochs=30, lr=1e-2, **kw)
    pred = pb.predict(model, guide, batches, num_samples=4)
    probs = pred.label_probs
    assert probs.shape == (64, 3) and bool(((probs >= 0) & (probs <= 1)).all())
    assert pred.log_probs.shape[1:] == (64, 3, 2)
    nll_after = pb.metrics.report(pred, pred.targets)["nll"]
    assert nll_after < nll_before, (nll_before, nll_after)


def test_ibdr_refuses_a_diversity_term_on_multi_label_data() -> None:
    model, batches = _problem("ibdr")
    guide = families.posterior(model, "ibdr")
    with pytest.raises(ValueError, match="alpha=0"):
        optim = pb.Optimization(optimizer=pb.infer.IBDR(alpha=0.1))
        pb.fit(model, guide, batches, epochs=1, optim=optim)


# --------------------------------------------------------------------- curvature, predictive


def test_ggn_roots_give_the_bernoulli_output_hessian() -> None:
    # Σ_k v_k v_kᵀ must be ∇²_f (−log p(y|f)) = diag(p (1 − p)), computed independently here
    z = torch.randn(2, 4, 3, dtype=torch.float64)
    roots = torch.stack(_output_hessian_roots(Bernoulli(), z), -1)  # (S, B, L, K)
    ggn = roots @ roots.mT
    y = torch.randint(0, 2, (4, 3)).double()
    hess = torch.func.vmap(
        torch.func.vmap(
            torch.func.hessian(
                lambda f, t: F.binary_cross_entropy_with_logits(f, t, reduction="sum")
            ),
            in_dims=(0, 0),
        ),
        in_dims=(0, None),
    )(z, y)
    assert torch.allclose(ggn, hess, atol=1e-12)


def test_probit_predictive_matches_monte_carlo_of_the_same_gaussian() -> None:
    torch.manual_seed(0)
    mean = torch.randn(6, 3, dtype=torch.float64) * 2
    var = torch.rand(6, 3, dtype=torch.float64) * 3

    class Cov:
        @staticmethod
        def functional_covariance(jac):
            return torch.diag_embed(var)

    lp, _ = _chunk_predictive(Cov(), mean, {"s": torch.zeros(6, 3, 1)}, None, True, True)
    assert lp.shape == (1, 6, 3, 2)
    n = 400_000
    draws = torch.sigmoid(mean + var.sqrt() * torch.randn(n, 6, 3, dtype=torch.float64))
    mc = draws.mean(0)
    # Monte Carlo error: 4 sd of a mean of N draws of a value in [0, 1] (sd <= 1/2) is 2/√N
    # = 0.0032; the probit approximation of the logistic-Gaussian integral is within 0.02
    # (MacKay 1992; Daunizeau 2017, Fig. 1), so the two together bound the difference
    tol = 4 * draws.std(0).max() / math.sqrt(n) + 0.02
    assert (lp[0, ..., 1].exp() - mc).abs().max() < tol


# -------------------------------------------------------------------- temperature, metrics


def test_temperature_reduces_the_validation_nll_of_an_over_confident_map() -> None:
    model, batches = _problem(num_data=96, noise=1.5)
    train, val = batches[:4], batches[4:]
    guide = pb.posterior(model, "map")
    pb.fit(model, guide, train, epochs=100, lr=3e-2)
    fitted = pb.predict(model, guide, val)
    logits = fitted.log_probs[..., 1] - fitted.log_probs[..., 0]
    # over-confident: the MAP's logits scaled up 4x
    before = dataclasses.replace(fitted, log_probs=bernoulli_log_probs(4 * logits))
    assert pb.calibration.apply_temperature(before, 1.0) is before  # T = 1: a no-op
    nll_before = pb.metrics.report(before, before.targets)["nll"]
    t = pb.calibration.fit_temperature(before, before.targets)
    after = pb.calibration.apply_temperature(before, t)
    nll_after = pb.metrics.report(after, after.targets)["nll"]
    assert t > 1 and nll_after < nll_before, (t, nll_before, nll_after)
    # the tempered prediction is the Bernoulli of the logits / T
    assert torch.allclose(after.log_probs, bernoulli_log_probs(4 * logits / t), atol=1e-5)


def test_metrics_against_hand_computed_values() -> None:
    p = torch.tensor([[0.9, 0.2], [0.4, 0.7]])
    y = torch.tensor([[1, 0], [1, 1]])
    m = pb.metrics
    assert m.hamming_accuracy(p, y) == pytest.approx(3 / 4)
    assert m.subset_accuracy(p, y) == pytest.approx(1 / 2)
    nll = -(math.log(0.9 * 0.8) + math.log(0.4 * 0.7)) / 2
    assert m.multilabel_nll(p, y) == pytest.approx(nll, rel=1e-6)
    brier = (0.1**2 + 0.2**2 + 0.6**2 + 0.3**2) / 4
    assert m.multilabel_brier(p, y) == pytest.approx(brier, rel=1e-6)
    # one bin per confidence here: |conf − correct| averaged, conf = 0.9, 0.8, 0.6, 0.7
    ece = (abs(0.9 - 1) + abs(0.8 - 1) + abs(0.6 - 0) + abs(0.7 - 1)) / 4
    assert m.multilabel_calibration_error(p, y, num_bins=10).ece == pytest.approx(ece, 1e-6)

    def h(q: float) -> float:
        return -(q * math.log(q) + (1 - q) * math.log(1 - q))

    entropy = torch.tensor([(h(0.9) + h(0.2)) / 2, (h(0.4) + h(0.7)) / 2])
    assert torch.allclose(m.mean_binary_entropy(p), entropy)
    report = m.report(torch.stack((1 - p, p), -1).unsqueeze(0), y)
    assert report["nll"] == pytest.approx(nll, rel=1e-6) and report["accuracy"] == 0.75
    with pytest.raises(ValueError, match="probabilities in"):
        m.hamming_accuracy(p * 3, y)


# --------------------------------------------------------------------- Hugging Face, ArviZ


def test_a_hugging_face_multi_label_classifier_fits_with_bernoulli() -> None:
    torch.manual_seed(0)
    net = tiny_bert(num_labels=3, problem_type="multi_label_classification")
    with pytest.raises(ValueError, match="likelihood='bernoulli'"):
        pb.models.FineTuneModel(net, LoRA(rank=2, target_modules=["query"]))
    model = pb.models.FineTuneModel(
        net, LoRA(rank=2, target_modules=["query"]), likelihood="bernoulli", num_data=8
    )
    ids = torch.randint(1, 99, (8, 6))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    batch["labels"] = torch.randint(0, 2, (8, 3)).float()
    guide = pb.posterior(model, "map")
    pb.fit(model, guide, [batch], epochs=2, lr=1e-3)
    pred = pb.predict(model, guide, [batch])
    assert pred.label_probs.shape == (8, 3)


def test_arviz_export_has_each_examples_log_likelihood() -> None:
    model, batches = _problem()
    guide = pb.posterior(model, "meanfield")
    pb.fit(model, guide, batches, epochs=2, lr=1e-2)
    tree = pb.diagnostics.to_datatree(model, guide, batches[:2], num_samples=4)
    ll = torch.as_tensor(tree["log_likelihood"]["obs"].values)
    assert ll.shape == (1, 4, 32)
    values = {s: v.unsqueeze(0) for s, v in guide.mean().items()} if False else None
    del values
    assert bool((ll < 0).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("structure", "num_data"), [("diag", 40), ("kron", 1)])
def test_laplace_curvature_is_the_dense_bernoulli_ggn(
    structure: str, num_data: int, device: str
) -> None:
    """Laplace's precision over a LoRA-XS core against the GGN formed densely here:
    ``Σ_n J_nᵀ diag(p_n (1 − p_n)) J_n + τ I`` with ``J_n`` the Jacobian of the example's L
    logits in the core (``torch.func.jacrev``). The diagonal structure keeps its diagonal
    exactly; K-FAC is exact for one example (its two factors are then the GGN's own: one
    input to the core, shared by the L outputs). On CUDA with ``-m gpu``."""
    from pyrobayes.guides import LaplaceGuide
    from pyrobayes.infer.laplace import fit_laplace

    torch.manual_seed(0)
    rank, tau = 3, 1e-4
    model = pb.models.FineTuneModel(
        mlp(5, 8, 3),
        LoRAXS(rank=rank, target_modules=["0"]),
        likelihood="bernoulli",
        num_data=num_data,
        trainable_modules=[],
    ).double()
    model.to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(num_data, 5, generator=g, dtype=torch.float64).to(device)
    y = (torch.rand(num_data, 3, generator=g) < 0.5).double().to(device)
    guide = LaplaceGuide(model, structure=structure, prior_precision=tau)
    site = next(iter(guide.sites))
    with torch.no_grad():
        guide.loc(site).copy_(0.5 * torch.randn(rank, rank, dtype=torch.float64, device=device))
    fit_laplace(model, guide, [(x, y)])
    core = guide.loc(site).detach()

    def logits(c: torch.Tensor) -> torch.Tensor:
        return model.output(x, {site: c})

    jac = torch.func.jacrev(logits)(core).reshape(num_data, 3, rank * rank)
    f = logits(core)
    weight = torch.sigmoid(f) * torch.sigmoid(-f)  # (N, L): the BCE's Hessian in the logits
    eye = torch.eye(rank * rank, dtype=torch.float64, device=device)
    dense = torch.einsum("nlp,nl,nlq->pq", jac, weight, jac) + tau * eye
    ours = guide.posterior_precision(site).double()
    assert (dense.diagonal() - tau).max() > 100 * tau  # the data term is seen, not just τI
    if structure == "kron":
        torch.testing.assert_close(ours, dense, rtol=1e-6, atol=1e-8)
    else:
        torch.testing.assert_close(ours.diagonal(), dense.diagonal(), rtol=1e-6, atol=1e-8)


def test_calibrate_counts_a_multi_label_split_in_binary_predictions() -> None:
    """``pb.calibrate``'s small-sample warning counts the held-out targets' values: for
    multi-label data the (example, label) pairs, each a binary prediction T tempers. The
    message said "examples" for them (7 examples × 3 labels read as 21 examples)."""
    model, batches = _problem(num_data=64)
    guide = pb.posterior(model, "map")
    pb.fit(model, guide, batches, epochs=3, lr=1e-2)
    held_out = [(batches[0][0][:7], batches[0][1][:7])]
    with pytest.warns(UserWarning, match=r"21 held-out binary predictions \(example × label"):
        pb.calibrate(model, guide, held_out)


def test_sigma_norm_tau_sweep_refuses_a_multi_label_model_by_name() -> None:
    """``tau_sweep`` scores one class per example; on a multi-label model it failed inside
    torch (``gather(): Expected dtype int32/int64``) after fitting the first τ."""
    from pyrobayes.infer.signorm import tau_sweep

    model, batches = _problem("signorm")
    with pytest.raises(ValueError, match="tau_sweep scores one class per example.*'bernoulli'"):
        tau_sweep(lambda: model, batches, batches, taus=(0.5,), epochs=1)
