"""Gaussian likelihood: target shapes checked on every path, and learned observation noise.

A scalar output takes targets ``(B,)`` or ``(B, 1)`` (laplace-torch's regression shape) with
identical results; a ``(B, D)`` output takes ``(B, D)``; any other shape raises a ``ValueError``
that names both shapes and the shape to pass (never a silent ``B × B`` broadcast).
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pyro
import pyro.optim
import pytest
import torch

import pyrobayes as pb
from pyrobayes.infer.fitter import trainable_parameters
from pyrobayes.infer.laplace import fit_laplace
from pyrobayes.models import LoRAXS
from pyrobayes.models.finetune import NOISE_PARAM
from tests.common import conjugate_core, mlp_problem, split_batches, tensor_loader

#: these tests check the predictive's arithmetic on guides at their initialisation, on purpose;
#: the never-fitted warning itself is tested in tests/test_fitted_head.py
pytestmark = pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")

pytest.importorskip("laplace")

ROOT = Path(__file__).resolve().parents[2]


def _problem(num_data: int = 48, outputs: int = 1, obs_scale: float | str = 0.3):
    """A linear network ``6 → 4 → outputs`` with a rank-3 LoRA-XS core on the first layer."""
    return mlp_problem(
        (6, 4, outputs),
        LoRAXS(rank=3, target_modules=["0"]),
        num_data=num_data,
        seed=2,
        data_seed=1,
        activation=None,
        likelihood="gaussian",
        obs_scale=obs_scale,
        trainable_modules=[],
    )


def _state(guide) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in guide.state_dict().items()}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0.0, atol=1e-10, msg=k)


def _draws(guide) -> dict[str, torch.Tensor]:
    return guide.sample_posterior(8, generator=torch.Generator().manual_seed(0))


# ------------------------------------------------------------------ (N, 1) == (N,)
@pytest.mark.parametrize("family", ["meanfield", "laplace", "ivon"])
def test_column_targets_give_the_same_posterior(family):
    fitted = []
    for column in (False, True):
        prob = _problem()
        assert prob.y.shape == (48,)
        y = prob.y.unsqueeze(-1) if column else prob.y
        guide = pb.posterior(prob.model, family)
        start = _state(guide)
        pb.fit(prob.model, guide, tensor_loader(prob.x, y, 16), epochs=20, lr=0.05, seed=0)
        fitted.append((_state(guide), _draws(guide), guide.mean()))
    (state_a, draws_a, mean_a), (state_b, draws_b, mean_b) = fitted
    _assert_same(state_a, state_b)
    _assert_same(draws_a, draws_b)
    _assert_same(mean_a, mean_b)
    # and the fit did something (the comparison is not between two initial states)
    assert any(not torch.equal(start[k], state_a[k]) for k in start if k in state_a)


def test_column_targets_give_the_exact_posterior():
    """Scalar output, targets (N, 1): Laplace at the MAP of the conjugate problem is exact."""
    torch.manual_seed(0)
    prob = conjugate_core(d_out=1, rank=1)
    assert prob.y.shape == (64, 1)
    # a 1 × 1 core: laplace-torch's K-FAC has no two factors for it, the diagonal is exact
    guide = pb.posterior(prob.model, "laplace", structure="diag", prior_precision="model")
    pb.fit(prob.model, guide, split_batches(prob.x, prob.y), epochs=150, lr=0.05, seed=0)
    q = guide.get_posterior(prob.site)
    # the broadcasting bug put this mean 3.2 posterior sd away; 1e-3 sd is the optimizer's slack
    torch.testing.assert_close(q.mean, prob.post_loc, rtol=0.0, atol=1e-3 * prob.post_scale.max())
    torch.testing.assert_close(q.variance.sqrt(), prob.post_scale, rtol=1e-5, atol=0.0)


def test_predict_report_and_selection_agree_between_shapes():
    prob = _problem()
    guide = pb.posterior(prob.model, "meanfield")
    pb.fit(prob.model, guide, tensor_loader(prob.x, prob.y, 16), epochs=20, lr=0.05, seed=0)
    reports, preds = [], []
    for y in (prob.y, prob.y.unsqueeze(-1)):
        pred = pb.predict(prob.model, guide, tensor_loader(prob.x, y, 16), num_samples=16)
        assert pred.targets is not None and pred.targets.shape == (48,)
        preds.append(pred)
        reports.append(pb.metrics.report(pred, y))
    assert reports[0] == reports[1]
    assert set(reports[0]) == {"rmse", "nll"}
    # the numbers are those of the predictive: a mixture of S Gaussians per example
    loc = preds[0].loc
    assert loc is not None and loc.shape == (16, 48)
    rmse = (loc.mean(0) - prob.y).pow(2).mean().sqrt().item()
    assert reports[0]["rmse"] == pytest.approx(rmse, rel=1e-12)
    log_p = torch.distributions.Normal(loc, 0.3).log_prob(prob.y)
    nll = -(torch.logsumexp(log_p, 0) - math.log(16)).mean().item()
    assert reports[0]["nll"] == pytest.approx(nll, rel=1e-6)
    assert reports[0]["rmse"] < 2 * prob.y.std().item()  # not a B × B broadcast (RMSE 2.46)
    # metrics.gaussian_rmse / gaussian_nll take (N, 1) targets too
    for y in (prob.y, prob.y.unsqueeze(-1)):
        assert pb.metrics.gaussian_rmse(loc, y) == pytest.approx(rmse, rel=1e-12)
        assert pb.metrics.gaussian_nll(loc, y, 0.3) == pytest.approx(nll, rel=1e-6)

    # validation selection by RMSE: the same history for both shapes
    histories = []
    for y in (prob.y, prob.y.unsqueeze(-1)):
        p = _problem()
        g = pb.posterior(p.model, "map")
        result = pb.fit(
            p.model,
            g,
            tensor_loader(p.x, p.y, 16),
            epochs=3,
            lr=0.05,
            seed=0,
            validation=pb.Validation(tensor_loader(p.x, y, 16), select_by="rmse"),
        )
        histories.append(result.state["validation"])
    assert histories[0] == histories[1] and len(histories[0]) == 3


def test_pyro_program_scores_column_targets_as_flat_ones():
    prob = _problem()
    guide = pb.posterior(prob.model, "meanfield")
    losses = []
    for y in (prob.y, prob.y.unsqueeze(-1)):
        pyro.set_rng_seed(0)
        losses.append(pyro.infer.Trace_ELBO(num_particles=4).loss(prob.model, guide, (prob.x, y)))
    assert losses[0] == losses[1]
    trace = pyro.poutine.trace(prob.model).get_trace((prob.x, prob.y.unsqueeze(-1)))
    assert trace.nodes["obs"]["value"].shape == (48,)
    assert trace.nodes["obs"]["fn"].batch_shape == (48,)


def test_vector_output_takes_matching_targets():
    prob = _problem(outputs=3)
    assert prob.y.shape == (48, 3)
    site = next(iter(prob.model.latent_sites))
    values = {site: torch.zeros(2, 3, 3)}
    params = prob.model.batched_output(prob.x, values)
    assert params.shape == (2, 48, 3)
    ll = prob.model.log_likelihood(params, prob.y)
    ref = torch.distributions.Normal(params, 0.3).log_prob(prob.y).sum(-1)
    torch.testing.assert_close(ll, ref)


# ------------------------------------------------------------------ wrong shapes raise
# (output width, target shape, the shape the error asks for); batches of 8 examples
WRONG = [
    pytest.param(1, (8, 2), "(8,) or (8, 1)", id="scalar-out-two-targets"),
    pytest.param(1, (9,), "(8,) or (8, 1)", id="scalar-out-batch-mismatch"),
    pytest.param(1, (9, 1), "(8,) or (8, 1)", id="scalar-out-column-batch-mismatch"),
    pytest.param(1, (8, 1, 1), "(8,) or (8, 1)", id="scalar-out-extra-dims"),
    pytest.param(3, (8,), "(8, 3)", id="vector-out-flat-targets"),
    pytest.param(3, (8, 1), "(8, 3)", id="vector-out-column-targets"),
    pytest.param(3, (8, 2), "(8, 3)", id="vector-out-wrong-width"),
    pytest.param(3, (7, 3), "(8, 3)", id="vector-out-batch-mismatch"),
]
PATHS = ["log_likelihood", "pyro", "predict", "report", "selection", "laplace"]


def _message(shape: tuple[int, ...], expected: str) -> str:
    return (
        re.escape(f"Gaussian likelihood: targets of shape {shape} do not match the ")
        + ".*"
        + re.escape(f"; pass targets of shape {expected}.")
    )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("outputs", "shape", "expected"), WRONG)
def test_wrong_target_shapes_raise(path, outputs, shape, expected):
    prob = _problem(outputs=outputs)
    model, x = prob.model, prob.x[:8]
    bad = torch.randn(shape)
    site = next(iter(model.latent_sites))
    match = _message(shape, expected)
    if path == "report":  # a valid prediction, then wrong targets for the metrics
        guide = pb.posterior(model, "meanfield")
        pred = pb.predict(model, guide, [(x, prob.y[:8])], num_samples=4)
        with pytest.raises(ValueError, match=match) as info:
            pb.metrics.report(pred, bad)
        assert "predictive mean" in str(info.value)
        return
    with pytest.raises(ValueError, match=match) as info:
        if path == "log_likelihood":
            params = model.batched_output(x, {site: torch.zeros(4, 3, 3)})
            model.log_likelihood(params, bad)
        elif path == "pyro":
            pyro.poutine.trace(model).get_trace((x, bad))
        elif path == "predict":
            pb.predict(model, pb.posterior(model, "meanfield"), [(x, bad)], num_samples=4)
        elif path == "selection":
            model.num_data = 8  # the fit's one batch
            guide = pb.posterior(model, "map")
            pb.fit(
                model,
                guide,
                [(x, prob.y[:8])],
                epochs=1,
                validation=pb.Validation([(x, bad)], select_by="rmse"),
            )
        else:
            fit_laplace(model, pb.posterior(model, "laplace"), [(x, bad)])
    assert "network output" in str(info.value)


def test_laplace_loader_checks_dict_batches():
    prob = _problem()
    guide = pb.posterior(prob.model, "laplace", prior_precision="model")
    with pytest.raises(ValueError, match=_message((8, 2), "(8,) or (8, 1)")):
        fit_laplace(prob.model, guide, [{"input": prob.x[:8], "labels": torch.randn(8, 2)}])


@pytest.mark.integration
def test_shape_errors_survive_python_O():
    """The check is a raise, not an assert: ``python -O`` keeps it."""
    code = (
        "import torch; from tests.common import mlp_problem; from pyrobayes.models import LoRAXS\n"
        "p = mlp_problem((6, 4, 1), LoRAXS(rank=3, target_modules=['0']), num_data=8, seed=0, "
        "activation=None, likelihood='gaussian')\n"
        "params = p.model.batched_output(p.x, {'0.core': torch.zeros(2, 3, 3)})\n"
        "try:\n    p.model.log_likelihood(params, torch.zeros(8, 2))\n"
        "except ValueError as e:\n    print('raised:', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-O", "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert "raised: Gaussian likelihood: targets of shape (8, 2)" in out.stdout, out.stderr


# ------------------------------------------------------------------ learned observation noise
def _noisy_problem(num_data: int, noise: float):
    """Data from the model itself at a known core, plus N(0, noise²) observation noise."""
    prob = _problem(num_data=num_data, obs_scale="learn")
    site = next(iter(prob.model.latent_sites))
    g = torch.Generator().manual_seed(5)
    core = torch.randn(3, 3, generator=g)
    with torch.no_grad():
        f = prob.model.output(prob.x, {site: core})
    return prob.model, prob.x, f + noise * torch.randn(num_data, generator=g), site


def test_learned_noise_recovers_a_known_level():
    n, sigma, p = 2000, 0.3, 9
    model, x, y, site = _noisy_problem(n, sigma)
    lik = model.likelihood
    assert lik.obs_scale == pytest.approx(1.0)  # starts at σ = 1
    guide = pb.posterior(model, "map")
    assert any(q is model.point_params[NOISE_PARAM] for q in trainable_parameters(model, guide))
    pb.fit(
        model, guide, [(x, y.unsqueeze(-1))], optim=pb.Optimization(num_steps=200), lr=0.05, seed=0
    )
    sigma_hat = lik.obs_scale
    # Tolerance. With Gaussian residuals e_n, σ̂² = (1/N) Σ e_n² has variance 2σ⁴/N, so by the
    # delta method (σ̂ = sqrt(σ̂²), dσ/dσ² = 1/(2σ)) sd(σ̂) ≈ σ/√(2N) = 0.3/√4000 ≈ 0.0047.
    # Fitting the p = 9 core entries by least squares leaves E[RSS] = σ²(N − p), a bias of
    # σ̂ − σ ≈ −σ p/(2N) ≈ −0.0007. Allow four standard errors plus that bias: ≈ 0.020.
    tol = 4 * sigma / math.sqrt(2 * n) + sigma * p / (2 * n)
    assert abs(sigma_hat - sigma) < tol, (sigma_hat, tol)
    # and σ̂ is the maximiser at the fitted mean: ∂/∂σ [N log σ + RSS/(2σ²)] = 0 ⇒ σ² = RSS/N
    with torch.no_grad():
        resid = y - model.output(x, {site: guide.mean()[site]})
    assert sigma_hat == pytest.approx(resid.pow(2).mean().sqrt().item(), rel=1e-3)
    # prediction uses the learned σ
    pred = pb.predict(model, guide, [(x, y)])
    assert pred.scale == pytest.approx(sigma_hat)


@pytest.mark.parametrize("family", ["map", "meanfield", "ivon", "kron-ivon", "laplace", "swag"])
def test_every_fitter_trains_the_learned_noise(family):
    model, x, y, _ = _noisy_problem(64, 0.3)
    guide = pb.posterior(model, family)
    pb.fit(model, guide, split_batches(x, y), epochs=10, lr=0.05, seed=0)
    # from σ = 1 towards 0.3 (IVON's preconditioned steps move it least: to ≈ 0.7 here)
    assert 0.1 < model.likelihood.obs_scale < 0.9, (family, model.likelihood.obs_scale)


def test_learned_noise_round_trips_through_save_and_load(tmp_path):
    model, x, y, _ = _noisy_problem(64, 0.3)
    guide = pb.posterior(model, "meanfield")
    pb.fit(model, guide, split_batches(x, y), epochs=5, lr=0.05, seed=0)
    sigma = model.likelihood.obs_scale
    assert sigma != pytest.approx(1.0)
    path = pb.save(guide, tmp_path / "post.safetensors")
    header = pb.io.read_header(path)
    assert header["likelihood"]["obs_scale"] == "learn"
    fresh, *_ = _noisy_problem(64, 0.3)
    assert fresh.likelihood.obs_scale == pytest.approx(1.0)
    loaded = pb.load(path, fresh)
    assert fresh.likelihood.obs_scale == sigma
    assert torch.equal(fresh.point_params[NOISE_PARAM], model.point_params[NOISE_PARAM])
    _assert_same(_state(loaded), _state(guide))


def test_learned_noise_in_the_pyro_program_and_laplace():
    model, x, y, _ = _noisy_problem(64, 0.3)
    raw = model.point_params[NOISE_PARAM]
    assert raw is model.likelihood.raw_scale
    # registered under the model's own prefix, the same tensor the fitters train
    pyro.poutine.trace(model).get_trace((x, y))
    key = f"{model._pyro_name}.{NOISE_PARAM}"
    assert pyro.get_param_store()[key] is raw
    # Pyro's SVI trains it
    guide = pb.posterior(model, "meanfield")
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), pyro.infer.Trace_ELBO())
    for _ in range(30):
        svi.step((x, y))
    assert model.likelihood.obs_scale < 0.9
    # a stored value other than the model's own wins in the program, as for the head
    pyro.get_param_store()[key] = torch.tensor(-3.0)
    obs = pyro.poutine.trace(model).get_trace((x, y)).nodes["obs"]["fn"]
    stored = torch.nn.functional.softplus(torch.tensor(-3.0))
    torch.testing.assert_close(obs.scale, stored.expand(64))
    pyro.get_param_store()[key] = raw
    # Laplace's sigma_noise is the current σ
    with torch.no_grad():
        raw.fill_(-0.5)
    la = fit_laplace(model, pb.posterior(model, "laplace"), split_batches(x, y))
    assert float(la.sigma_noise) == pytest.approx(model.likelihood.obs_scale)
    assert model.likelihood.obs_scale == pytest.approx(math.log1p(math.exp(-0.5)))


def test_learned_noise_follows_the_model_to_another_dtype():
    model, *_ = _noisy_problem(16, 0.3)
    model.double()
    raw = model.point_params[NOISE_PARAM]
    assert raw is model.likelihood.raw_scale and raw.dtype == torch.float64


@pytest.mark.parametrize("bad", ["learned", 0.0, -1.0])
def test_obs_scale_is_positive_or_learn(bad):
    with pytest.raises(ValueError, match="obs_scale"):
        _problem(obs_scale=bad)
