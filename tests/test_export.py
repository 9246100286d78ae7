"""ArviZ export: group layout, named dimensions, values cross-checked, az.summary / az.loo."""

from __future__ import annotations

import logging
import math

import arviz as az
import numpy as np
import pytest
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.diagnostics.export import select_sites, to_datatree, to_inference_data
from pyrobayes.diagnostics.plots import plot_posterior_summary
from pyrobayes.guides import MeanFieldGuide
from pyrobayes.models import FineTuneModel, LoRAXS

from .common import conjugate_core, mlp_problem

#: these tests check the predictive's arithmetic on guides at their initialisation, on purpose;
#: the never-fitted warning itself is tested in tests/test_fitted_head.py
pytestmark = pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")

NUM_SAMPLES = 40
NUM_DATA = 48
NUM_CLASSES = 3


# az.loo on a few dozen draws: ArviZ's k-hat threshold 1 - 1/log10(S) (0.38 at S = 40) is below
# the k-hat of some points; these tests check that LOO runs on the export, not its reliability
_FEW_DRAWS_LOO = pytest.mark.filterwarnings(
    "ignore:Estimated shape parameter of Pareto distribution:UserWarning:arviz.stats.stats\\Z"
)


def _classifier(seed: int = 0):
    """MLP 6 -> 10 -> 3 with LoRA-XS cores (rank 2) on both layers, random data, 3 classes."""
    prob = mlp_problem(
        (6, 10, NUM_CLASSES),
        LoRAXS(rank=2, target_modules=["0", "2"]),
        num_data=NUM_DATA,
        data_seed=seed,
        trainable_modules=[],
    )
    model, x, y = prob.model, prob.x, prob.y
    guide = MeanFieldGuide(model, init_scale=0.3)
    data = [(x[:20], y[:20]), (x[20:], y[20:])]
    return model, guide, data, y


@_FEW_DRAWS_LOO
def test_classification_export_groups_dims_and_values():
    model, guide, data, y = _classifier()
    losses = torch.tensor([5.0, 4.0, 3.5])
    idata = pb.to_inference_data(model, guide, data, num_samples=NUM_SAMPLES, seed=3, losses=losses)
    assert set(idata.groups()) == {
        "posterior",
        "posterior_predictive",
        "log_likelihood",
        "observed_data",
        "sample_stats",
        "optimization",
    }
    sites = list(model.latent_sites)
    assert sites == ["0.core", "2.core"]
    assert sorted(idata.posterior.data_vars) == sites
    for site in sites:
        assert idata.posterior[site].dims == ("chain", "draw", f"{site}_row", f"{site}_col")
        assert idata.posterior.sizes[f"{site}_row"] == 2
        assert idata.posterior.sizes[f"{site}_col"] == 2
    assert idata.posterior.sizes["chain"] == 1
    assert idata.posterior.sizes["draw"] == NUM_SAMPLES
    # posterior predictive: class draws in range, same sample dims as the posterior
    pp = idata.posterior_predictive["obs"]
    assert pp.dims == ("chain", "draw", "obs_dim_0")
    assert pp.shape == (1, NUM_SAMPLES, NUM_DATA)
    assert int(pp.min()) >= 0 and int(pp.max()) < NUM_CLASSES
    # log_likelihood matches observed_data in names and sizes
    assert list(idata.log_likelihood.data_vars) == list(idata.observed_data.data_vars) == ["obs"]
    assert idata.log_likelihood["obs"].dims == ("chain", "draw", "obs_dim_0")
    assert idata.observed_data["obs"].dims == ("obs_dim_0",)
    assert idata.log_likelihood.sizes["obs_dim_0"] == idata.observed_data.sizes["obs_dim_0"]
    np.testing.assert_array_equal(idata.observed_data["obs"].values, y.numpy())
    # values: the same seed gives the same draws in pyrobayes.predict, so the pointwise
    # log-likelihood must equal log p_s(y_n | x_n) read off its per-sample log-probabilities
    pred = pb.predict(
        model, guide, data, num_samples=NUM_SAMPLES, seed=3, samples_per_forward=NUM_SAMPLES
    )
    expected = pred.log_probs.gather(-1, y.expand(NUM_SAMPLES, -1).unsqueeze(-1)).squeeze(-1)
    np.testing.assert_allclose(idata.log_likelihood["obs"].values[0], expected.numpy(), atol=1e-10)
    # sample_stats: log_joint = Σ_i log-lik + log prior; log_q from the guide, per draw
    stats = idata.sample_stats
    assert stats["log_q"].dims == ("chain", "draw")
    ll_sum = idata.log_likelihood["obs"].values.sum(-1)
    np.testing.assert_allclose(
        stats["log_joint"].values, ll_sum + stats["log_prior"].values, rtol=1e-12
    )
    values = {s: torch.as_tensor(idata.posterior[s].values[0]) for s in sites}
    np.testing.assert_allclose(
        stats["log_q"].values[0], guide.log_prob(values).detach(), rtol=1e-10
    )
    np.testing.assert_allclose(stats["log_prior"].values[0], model.log_prior(values), rtol=1e-10)
    # optimization group: loss over dim step
    assert idata.optimization["loss"].dims == ("step",)
    np.testing.assert_array_equal(idata.optimization["loss"].values, losses.numpy())
    # attributes
    for attrs in (idata.attrs, idata.posterior.attrs, idata.log_likelihood.attrs):
        assert attrs["inference_library"] == "pyro"
        assert attrs["creation_library"] == "pyrobayes"
        assert attrs["creation_library_version"] == pb.__version__
        assert attrs["guide_family"] == "meanfield"
    # ArviZ's own statistics run on it
    summary = az.summary(idata, kind="stats")
    assert len(summary) == 8  # 2 sites × 2 × 2 scalars
    loo = az.loo(idata, pointwise=True)
    assert loo.n_data_points == NUM_DATA
    assert math.isfinite(loo.elpd_loo)
    waic = az.waic(idata)
    assert math.isfinite(waic.elpd_waic)
    # LOO can not beat the in-sample lppd: elpd_loo <= Σ_n log mean_s p(y_n | θ_s)
    lppd = float(
        np.sum(
            np.log(np.mean(np.exp(idata.log_likelihood["obs"].values[0]), axis=0)),
        )
    )
    assert loo.elpd_loo <= lppd + 1e-9


def test_alias_and_reproducibility():
    model, guide, data, _ = _classifier()
    assert to_inference_data is to_datatree
    a = to_datatree(model, guide, data, num_samples=10, seed=7)
    b = to_datatree(model, guide, data, num_samples=10, seed=7)
    c = to_datatree(model, guide, data, num_samples=10, seed=8)
    np.testing.assert_array_equal(a.posterior["0.core"].values, b.posterior["0.core"].values)
    np.testing.assert_array_equal(
        a.posterior_predictive["obs"].values, b.posterior_predictive["obs"].values
    )
    assert not np.array_equal(a.posterior["0.core"].values, c.posterior["0.core"].values)


@_FEW_DRAWS_LOO
def test_conjugate_gaussian_export_is_consistent_with_exact_posterior():
    """With q = the exact posterior, log p(θ_s, D) − log q(θ_s) = log p(D) for every draw.

    The check uses the exported posterior values with independently written densities for
    log q and log p(θ), so it ties together the posterior, log_likelihood and sample_stats.
    The fixture's closed form agrees with the model to about 1e-6 nats (measured spread of the
    log ratios 2.6e-6 over 1000 draws, float64), hence the 1e-4 tolerance.
    """
    prob = conjugate_core()
    guide = MeanFieldGuide(prob.model)
    guide.set_site(prob.site, loc=prob.post_loc, scale=prob.post_scale)
    data = [(prob.x[:40], prob.y[:40]), (prob.x[40:], prob.y[40:])]
    idata = to_datatree(prob.model, guide, data, num_samples=30, seed=1)
    num_data, d_out = prob.y.shape
    rank = prob.post_loc.shape[0]
    site = prob.site
    assert idata.posterior[site].dims == ("chain", "draw", f"{site}_row", f"{site}_col")
    assert idata.posterior.sizes[f"{site}_row"] == rank
    # Gaussian targets (N, d_out): predictive and observed keep the output axis, the pointwise
    # log-likelihood is one value per example (summed over outputs) for LOO over examples
    assert idata.posterior_predictive["obs"].shape == (1, 30, num_data, d_out)
    assert idata.observed_data["obs"].dims == ("obs_dim_0", "obs_dim_1")
    assert idata.log_likelihood["obs"].dims == ("chain", "draw", "obs_dim_0")
    assert idata.log_likelihood.sizes["obs_dim_0"] == idata.observed_data.sizes["obs_dim_0"]
    np.testing.assert_allclose(idata.observed_data["obs"].values, prob.y.numpy())
    core = torch.as_tensor(idata.posterior[site].values[0])  # (S, r, r)
    log_q = torch.distributions.Normal(prob.post_loc, prob.post_scale).log_prob(core).sum((1, 2))
    log_prior = torch.distributions.Normal(0.0, 1.0).log_prob(core).sum((1, 2))
    ll = torch.as_tensor(idata.log_likelihood["obs"].values[0]).sum(-1)
    np.testing.assert_allclose(ll + log_prior - log_q, prob.log_evidence, atol=1e-4)
    np.testing.assert_allclose(idata.sample_stats["log_q"].values[0], log_q, rtol=1e-10)
    np.testing.assert_allclose(
        idata.sample_stats["log_joint"].values[0], ll + log_prior, rtol=1e-10
    )
    assert math.isfinite(az.loo(idata).elpd_loo)


def test_large_posterior_is_summarised_and_drawn_in_chunks(caplog):
    model, guide, data, _ = _classifier()
    calls: list[int] = []
    original = guide.sample_posterior

    def spy(num_samples, *, generator=None):
        calls.append(num_samples)
        return original(num_samples, generator=generator)

    guide.sample_posterior = spy  # type: ignore[method-assign]
    total = 8  # two 2×2 cores
    with caplog.at_level(logging.INFO, logger="pyrobayes.diagnostics.draw_evaluation"):
        # one-shot iterator: the batches must be kept for the second chunk of draws
        idata = to_datatree(model, guide, iter(data), num_samples=10, max_site_numel=5)
    # greedy in declaration order: 0.core (4) fits in 5, 2.core does not
    assert list(idata.posterior.data_vars) == ["0.core", "2.core_norm"]
    assert idata.posterior["2.core_norm"].dims == ("chain", "draw")
    assert (idata.posterior["2.core_norm"].values > 0).all()
    assert idata.attrs["omitted_sites"] == "2.core"
    assert "2.core" in caplog.text
    # every call materialises at most max(S·max_site_numel, numel(θ)) = 50 scalars: 6 draws
    assert sum(calls) == 10 and max(calls) * total <= 10 * 5 and len(calls) == 2
    assert idata.log_likelihood.sizes["obs_dim_0"] == NUM_DATA
    assert idata.posterior_predictive.sizes["draw"] == 10


def test_select_sites_explicit_and_unknown():
    shapes = {"a": torch.Size([3, 3]), "b": torch.Size([100]), "c": torch.Size([2])}
    assert select_sites(shapes, None, 12) == (["a", "c"], ["b"])
    assert select_sites(shapes, None, 10_000) == (["a", "b", "c"], [])
    assert select_sites(shapes, ["b"], 1) == (["b"], ["a", "c"])
    with pytest.raises(KeyError, match="nope"):
        select_sites(shapes, ["nope"])


def test_bias_site_uses_dim_k_names():
    g = torch.Generator().manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 2))
    model = FineTuneModel(net, latent_modules=["0"], num_data=10, trainable_modules=[])
    guide = MeanFieldGuide(model)
    x, y = torch.randn(10, 3, generator=g), torch.randint(0, 2, (10,), generator=g)
    idata = to_datatree(model, guide, [(x, y)], num_samples=5)
    assert idata.posterior["0.bias"].dims == ("chain", "draw", "0.bias_dim_0")
    assert idata.posterior["0.weight"].dims == ("chain", "draw", "0.weight_row", "0.weight_col")


def test_plot_posterior_summary_writes_png(tmp_path):
    model, guide, data, _ = _classifier()
    idata = to_datatree(model, guide, data, num_samples=20)
    for kind in ("forest", "posterior"):
        out = plot_posterior_summary(
            idata, tmp_path / f"{kind}.png", var_names=["0.core"], kind=kind
        )
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_posterior_summary_writes_the_format_its_suffix_names(tmp_path):
    # format="png" was hard-coded: a .pdf path got PNG bytes
    model, guide, data, _ = _classifier()
    idata = to_datatree(model, guide, data, num_samples=8)
    magic = {"pdf": b"%PDF", "svg": b"<?xml", "png": b"\x89PNG", "PNG": b"\x89PNG"}
    for suffix, start in magic.items():
        out = plot_posterior_summary(idata, tmp_path / f"summary.{suffix}", max_rows=4)
        assert out.read_bytes().startswith(start), suffix
    bare = plot_posterior_summary(idata, tmp_path / "summary", max_rows=4)
    assert bare == tmp_path / "summary" and bare.read_bytes().startswith(b"\x89PNG")
    with pytest.raises(ValueError, match=r"'\.pnj', which names no format .*'\.pdf'"):
        plot_posterior_summary(idata, tmp_path / "summary.pnj")


@pytest.mark.parametrize("max_rows", [0, -5])
def test_plot_posterior_summary_refuses_max_rows_below_one(tmp_path, max_rows):
    model, guide, data, _ = _classifier()
    idata = to_datatree(model, guide, data, num_samples=8)
    with pytest.raises(ValueError, match=r"max_rows must be an integer >= 1"):
        plot_posterior_summary(idata, tmp_path / "out.png", max_rows=max_rows)
    assert not (tmp_path / "out.png").exists()


def test_plot_posterior_summary_shows_the_first_entries_of_a_large_posterior(tmp_path):
    """A forest of every scalar of a LoRA factor took minutes to draw (the demo's 9,216 rows):
    ``max_rows`` keeps index 0 of the leading dims and an equal share of the last dim."""
    from pyrobayes.diagnostics.plots import _first_entries

    model, guide, data, _ = _classifier()
    idata = to_datatree(model, guide, data, num_samples=20)
    sizes = {n: idata.posterior[n].shape[2:] for n in idata.posterior.data_vars}
    total = sum(int(math.prod(s)) for s in sizes.values())
    assert _first_entries(idata, None, total) is None  # within the budget: everything
    coords = _first_entries(idata, None, 2 * len(sizes))
    assert coords is not None
    for name, shape in sizes.items():
        dims = [d for d in idata.posterior[name].dims if d not in ("chain", "draw")]
        kept = [len(coords[d]) for d in dims]
        expected = [1] * (len(dims) - 1) + [min(2, shape[-1])] if dims else []
        assert kept == expected, name
    out = plot_posterior_summary(idata, tmp_path / "few.png", max_rows=2 * len(sizes))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_export_says_what_its_chains_and_draws_are():
    # a point mass exports S copies of one value (ArviZ's r-hat / ESS NaN, LOO k-hat > 0.7) and
    # a mixture one chain per component (r-hat = inf): the attribute says how to read them
    model, guide, data, _ = _classifier()
    idata = pb.to_inference_data(model, guide, data, num_samples=8)
    assert idata.attrs["draws"].startswith("independent draws of q in one chain")
    for family, start in (("map", "point mass"), ("ibdr", "equal-weight mixture")):
        other = pb.posterior(model, family)
        exported = pb.to_inference_data(model, other, data, num_samples=8)
        assert exported.attrs["draws"].startswith(start)
        assert exported.posterior.attrs["draws"] == exported.attrs["draws"]


def _fitted_laplace(likelihood: str):
    """A Laplace posterior (GLM predictive, its default) over a tanh MLP's LoRA-XS cores."""
    pytest.importorskip("laplace")
    prob = mlp_problem(
        (6, 10, NUM_CLASSES),  # (Gaussian: 3 outputs)
        LoRAXS(rank=2, target_modules=["0", "2"]),
        num_data=NUM_DATA,
        seed=0,
        data_seed=0,
        likelihood=likelihood,
        trainable_modules=[],
        **({"obs_scale": 0.5} if likelihood == "gaussian" else {}),
    )
    data = [(prob.x[:20], prob.y[:20]), (prob.x[20:], prob.y[20:])]
    guide = pb.posterior(prob.model, "laplace", prior_precision=0.3)
    with torch.no_grad():  # a point away from 0, where the network is visibly non-linear
        for site in guide.sites:
            guide.loc(site).normal_(0.0, 1.0, generator=torch.Generator().manual_seed(5))
    pb.fit(prob.model, guide, data, epochs=0)
    assert guide.pred_type == "glm"
    return prob.model, guide, data, prob.x, prob.y


def _linearized_reference(model, guide, x, num_samples, seed):
    """``f(x; θ̂) + J(x)(θ_s − θ̂)`` of the draws ``sample_posterior(S, seed)``, by jacrev."""
    point = guide.linearization_point()
    draws = guide.sample_posterior(num_samples, generator=torch.Generator().manual_seed(seed))
    mean = model.output(x, point).reshape(len(x), -1)  # (N, K)
    jac = torch.func.jacrev(lambda values: model.output(x, values))(point)
    shift = sum(
        torch.einsum(
            "nkd,sd->snk",
            jac[s].reshape(len(x), mean.shape[1], -1),
            (draws[s] - point[s]).reshape(num_samples, -1),
        )
        for s in point
    )
    return mean + shift, draws


def test_a_laplace_export_evaluates_the_predictive_that_predict_gives(monkeypatch):
    # log_likelihood was the sampled network's (pred_type="nn") while pb.predict gave the GLM
    # predictive: az.loo / az.waic described another predictive than the one reported
    model, guide, data, x, y = _fitted_laplace("categorical")
    num = guide.link_samples  # pb.predict's GLM draws: the same S and seed, the same draws
    idata = to_datatree(model, guide, data, num_samples=num, seed=0)
    assert idata.log_likelihood.attrs["predictive"] == "glm"
    exported = torch.as_tensor(idata.log_likelihood["obs"].values[0])  # (S, N)
    pred = pb.predict(model, guide, data, seed=0)
    glm = pred.log_probs.gather(-1, y.expand(num, -1).unsqueeze(-1)).squeeze(-1).double()
    torch.testing.assert_close(exported, glm, rtol=0, atol=1e-5)
    logits, draws = _linearized_reference(model, guide, x, num, seed=0)
    reference = torch.log_softmax(logits, -1).gather(-1, y.expand(num, -1).unsqueeze(-1))
    torch.testing.assert_close(exported, reference.squeeze(-1).double(), rtol=0, atol=1e-5)
    # the Jacobians a few examples at a time (as on CPU with long inputs): the same values
    from pyrobayes import linearized

    monkeypatch.setattr(linearized, "default_examples_per_forward", lambda inputs, device: 7)
    chunked = to_datatree(model, guide, data, num_samples=num, seed=0)
    np.testing.assert_allclose(
        chunked.log_likelihood["obs"].values, idata.log_likelihood["obs"].values, atol=1e-6
    )
    monkeypatch.undo()
    # (the network's draws differ: they are what the export held before)
    with torch.no_grad():
        network = torch.log_softmax(model.batched_output(x, draws), -1)
    network_ll = network.gather(-1, y.expand(num, -1).unsqueeze(-1)).squeeze(-1).double()
    assert float((network_ll - exported).abs().max()) > 1e-2
    # pred_type="nn" exports the network, as pb.predict then predicts
    guide.pred_type = "nn"
    idata_nn = to_datatree(model, guide, data, num_samples=num, seed=0)
    assert idata_nn.log_likelihood.attrs["predictive"] == "nn"
    torch.testing.assert_close(
        torch.as_tensor(idata_nn.log_likelihood["obs"].values[0]), network_ll, rtol=0, atol=1e-6
    )
    # probit has no per-draw form: the GLM's draws, with a warning naming it
    guide.pred_type = "probit"
    with pytest.warns(
        UserWarning, match=r"pred_type='probit'.*az\.loo / az\.waic describe the GLM"
    ):
        idata_probit = to_datatree(model, guide, data, num_samples=num, seed=0)
    assert idata_probit.log_likelihood.attrs["predictive"] == "glm"
    np.testing.assert_array_equal(
        idata_probit.log_likelihood["obs"].values, idata.log_likelihood["obs"].values
    )


def test_a_laplace_regression_export_is_the_linearised_networks_draws():
    model, guide, data, x, y = _fitted_laplace("gaussian")
    idata = to_datatree(model, guide, data, num_samples=30, seed=2)
    assert idata.posterior_predictive.attrs["predictive"] == "glm"
    loc, draws = _linearized_reference(model, guide, x, 30, seed=2)  # (S, N, 3)
    expected = torch.distributions.Normal(loc, 0.5).log_prob(y).sum(-1).double()
    exported = torch.as_tensor(idata.log_likelihood["obs"].values[0])
    torch.testing.assert_close(exported, expected, rtol=0, atol=1e-5)
    prior = torch.distributions.Normal(0.0, 1.0)
    log_prior = sum(prior.log_prob(v).reshape(30, -1).sum(-1) for v in draws.values())
    np.testing.assert_allclose(
        idata.sample_stats["log_joint"].values[0],
        (expected.sum(-1) + log_prior.double()).numpy(),
        rtol=1e-6,
    )
    # calibrated: pb.predict's tempered GLM predictive N(f, T² (J Σ Jᵀ + σ²)) is, per draw,
    # N(f + T J(θ_s − θ̂), T² σ²); log_joint stays the model's own
    t = pb.calibrate(model, guide, data)
    assert abs(t - 1.0) > 1e-2
    tempered = to_datatree(model, guide, data, num_samples=30, seed=2)
    assert tempered.log_likelihood.attrs["temperature_applied"] == 1
    mean = model.output(x, guide.linearization_point()).detach()
    shifted = torch.distributions.Normal(mean + t * (loc - mean), 0.5 * t)
    torch.testing.assert_close(
        torch.as_tensor(tempered.log_likelihood["obs"].values[0]),
        shifted.log_prob(y).sum(-1).double(),
        rtol=0,
        atol=1e-5,
    )
    np.testing.assert_array_equal(
        tempered.sample_stats["log_joint"].values, idata.sample_stats["log_joint"].values
    )
