"""ParticleGuide: the equal-weight mixture of K particles as a posterior (contract, Pyro, export)."""

from __future__ import annotations

import math

import pyro
import pyro.optim
import pytest
import torch

import pyrobayes as pb
from pyrobayes.contract import Mixture, Posterior
from pyrobayes.guides import IBDRGuide, ParticleGuide
from pyrobayes.models import LoRA, LoRAXS
from tests.common import conjugate_core, mlp_problem, split_batches

# the predictive's arithmetic is checked on particles as built (never fitted: warned)
pytestmark = pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")


def _problem(num_classes: int = 6, adapter=None):
    prob = mlp_problem(
        (5, 12, num_classes),
        adapter or LoRAXS(rank=2, target_modules=["0"]),
        num_data=32,
        trainable_modules=["2"],
    )
    return prob.model, split_batches(prob.x, prob.y, 16)


def test_particles_are_stored_with_a_leading_axis_and_start_distinct():
    pyro.clear_param_store()
    torch.manual_seed(0)
    model, _ = _problem(adapter=LoRA(rank=2, target_modules=["0"]))  # B = 0 at init
    guide = ParticleGuide(model, num_particles=3)
    assert isinstance(guide, Posterior) and isinstance(guide, Mixture)
    locs = guide.component_locs()
    for site, spec in model.latent_sites.items():
        assert locs[site].shape == (3, *spec.shape)
        # independent jitter: no two particles coincide, although B = 0 for all at init
        for j in range(3):
            for k in range(j):
                assert not torch.equal(locs[site][j], locs[site][k]), site
    same = ParticleGuide(model, num_particles=3, init_scale=0.0)
    for site, value in same.component_locs().items():
        assert torch.equal(value, model.site_value(site).expand_as(value))
    assert {k: v.shape for k, v in guide.validation_values().items()} == {
        k: v.shape for k, v in locs.items()
    }


def test_stratified_draws_visit_every_particle_equally_often():
    pyro.clear_param_store()
    model, _ = _problem()
    guide = ParticleGuide(model, num_particles=4)
    site = next(iter(guide.sites))
    locs = guide.loc(site).detach()
    draws = guide.sample_posterior(12, generator=torch.Generator().manual_seed(0))[site]
    which = (draws.unsqueeze(1) == locs.unsqueeze(0)).flatten(2).all(-1).float().argmax(-1)
    assert torch.equal(torch.bincount(which, minlength=4), torch.full((4,), 3))
    for block in which.reshape(3, 4):  # every block of K is a permutation of the particles
        assert sorted(block.tolist()) == [0, 1, 2, 3]


def test_log_prob_of_point_particles_is_over_the_counting_measure():
    pyro.clear_param_store()
    model, _ = _problem()
    guide = ParticleGuide(model, num_particles=4)
    draws = guide.sample_posterior(4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(guide.log_prob(draws), torch.full((4,), -math.log(4)))
    moved = {s: v + 1e-3 for s, v in draws.items()}
    assert torch.isinf(guide.log_prob(moved)).all()
    for site in guide.sites:  # the marginal: the same counting-measure mixture per site
        marginal = guide.get_posterior(site)
        torch.testing.assert_close(marginal.log_prob(draws[site]), torch.full((4,), -math.log(4)))
        assert torch.isinf(marginal.log_prob(moved[site])).all()
        torch.testing.assert_close(marginal.mean, guide.loc(site).detach().mean(0))
    with torch.no_grad():  # two equal particles carry mass 2/K
        for site in guide.sites:
            guide.loc_param(site)[1].copy_(guide.loc_param(site)[0])
    at_first = {s: guide.loc(s)[:1].detach() for s in guide.sites}
    torch.testing.assert_close(guide.log_prob(at_first), torch.tensor([math.log(2 / 4)]))


def test_log_prob_is_the_mixture_density():
    """σ > 0: log q(θ) = log (1/K) Σ_k Π_sites N(θ; μ_k, σ² I), against torch's mixture."""
    pyro.clear_param_store()
    torch.manual_seed(1)
    model, _ = _problem()
    guide = ParticleGuide(model, num_particles=3, scale=0.05, init_scale=0.1)
    draws = guide.sample_posterior(6, generator=torch.Generator().manual_seed(0))
    flat_locs = torch.cat([guide.loc(s).detach().flatten(1) for s in guide.sites], 1)  # (K, D)
    flat = torch.cat([draws[s].flatten(1) for s in guide.sites], 1)  # (S, D)
    reference = torch.distributions.MixtureSameFamily(
        torch.distributions.Categorical(logits=torch.zeros(3)),
        torch.distributions.Independent(torch.distributions.Normal(flat_locs, 0.05), 1),
    ).log_prob(flat)
    torch.testing.assert_close(guide.log_prob(draws), reference)
    # the per-site marginal is the same mixture over that site alone
    site = next(iter(guide.sites))
    marginal = guide.get_posterior(site).log_prob(draws[site])
    ref_site = torch.distributions.MixtureSameFamily(
        torch.distributions.Categorical(logits=torch.zeros(3)),
        torch.distributions.Independent(
            torch.distributions.Normal(guide.loc(site).detach().flatten(1), 0.05), 1
        ),
    ).log_prob(draws[site].flatten(1))
    torch.testing.assert_close(marginal, ref_site)
    mean = guide.mean()
    for s in guide.sites:
        torch.testing.assert_close(mean[s], guide.loc(s).detach().mean(0))


def test_predict_over_k_draws_is_the_equal_weight_probability_average():
    pyro.clear_param_store()
    torch.manual_seed(2)
    model, data = _problem()
    guide = ParticleGuide(model, num_particles=3, init_scale=0.3)
    pred = pb.predict(model, guide, data, num_samples=6)
    x = torch.cat([b[0] for b in data])
    expected = torch.stack(
        [
            torch.softmax(model.output(x, {s: guide.loc(s)[k].detach() for s in guide.sites}), -1)
            for k in range(3)
        ]
    ).mean(0)
    torch.testing.assert_close(pred.mean_probs, expected, rtol=1e-5, atol=1e-6)


def test_average_logits_predicts_the_softmax_of_the_particles_mean_logits():
    """average="logits" (the released IBDR code): one prediction, softmax(mean_k f(x; μ_k))."""
    pyro.clear_param_store()
    torch.manual_seed(2)
    model, data = _problem()
    guide = ParticleGuide(model, num_particles=3, init_scale=0.3, average="logits")
    pred = pb.predict(model, guide, data, num_samples=6)
    x = torch.cat([b[0] for b in data])
    logits = torch.stack(
        [model.output(x, {s: guide.loc(s)[k].detach() for s in guide.sites}) for k in range(3)]
    )
    assert pred.log_probs.shape == (1, 32, 6)
    torch.testing.assert_close(pred.mean_probs, torch.softmax(logits.mean(0), -1))
    # and it differs from the probability average (the default) on these separated particles
    probs_avg = torch.softmax(logits, -1).mean(0)
    assert (pred.mean_probs - probs_avg).abs().max() > 1e-3


@pytest.mark.parametrize("parallel", [False, True])
def test_pyro_predictive_draws_the_component_then_its_particle(parallel):
    pyro.clear_param_store()
    model, data = _problem()
    guide = ParticleGuide(model, num_particles=3)
    x = data[0][0]
    samples = pyro.infer.Predictive(
        model, guide=guide, num_samples=5, parallel=parallel, return_sites=None
    )((x, None))
    assert samples["obs"].shape == (5, 16)
    locs = {s: guide.loc(s).detach() for s in guide.sites}
    for site, spec in model.latent_sites.items():
        values = samples[site].reshape(5, *spec.shape)
        match = (values.unsqueeze(1) == locs[site].unsqueeze(0)).flatten(2).all(-1)
        assert (match.sum(-1) == 1).all(), site  # every draw is one of the particles


@pytest.mark.parametrize("scale", [0.0, 0.05])
def test_pyro_svi_trace_elbo_moves_every_particle_to_the_exact_mean(scale):
    """Trace_ELBO with a fixed-σ mixture: E_q log p(θ, D) = (1/K) Σ_k E_{N(μ_k, σ²)} log p, each
    term quadratic in μ_k with its maximum at the exact posterior mean (the entropy of a mixture
    of far-apart particles does not depend on the μ_k). Tolerance as in test_pyro_native: Adam at
    lr 0.02 jitters by ≲ lr and the average of 600 iterates by ≲ 0.2 lr = 4e-3 ≤ 0.08 sd of the
    posterior (sds 0.05-0.16); each particle gets half the draws, so we allow 0.2 sd."""
    pyro.clear_param_store()
    torch.manual_seed(0)
    prob = conjugate_core()
    guide = ParticleGuide(prob.model, num_particles=2, scale=scale)
    pyro.set_rng_seed(0)
    elbo = pyro.infer.Trace_ELBO(num_particles=16, vectorize_particles=True)
    svi = pyro.infer.SVI(prob.model, guide, pyro.optim.Adam({"lr": 0.02}), elbo)
    locs = []
    for step in range(1200):
        svi.step((prob.x, prob.y))
        if step >= 600:
            locs.append(guide.loc(prob.site).detach().clone())
    loc = torch.stack(locs).mean(0)  # (K, r, r)
    err = ((loc - prob.post_loc).abs() / prob.post_scale).amax()
    assert err < 0.2, err


def test_export_maps_particles_to_chains():
    pyro.clear_param_store()
    model, data = _problem()
    guide = ParticleGuide(model, num_particles=3)
    idata = pb.to_inference_data(model, guide, data, num_samples=7, seed=0)
    site = next(iter(guide.sites))
    posterior = idata.posterior[site].values  # (chain, draw, ...)
    assert posterior.shape[:2] == (3, 3)  # S = 7 rounded up to 9 = 3 draws per particle
    for k in range(3):
        expected = guide.loc(site)[k].detach().double().numpy()
        for d in range(3):
            assert (posterior[k, d] == expected).all()
    assert idata.log_likelihood["obs"].values.shape[:2] == (3, 3)
    torch.testing.assert_close(
        torch.as_tensor(idata.sample_stats["log_q"].values),
        torch.full((3, 3), -math.log(3), dtype=torch.float64),
    )
    # one draw per particle (its only distinct value) is the natural export of a delta
    # mixture: ArviZ's "more chains than draws" guess at swapped axes is not raised for it
    # (warnings are errors in this suite)
    idata = pb.to_inference_data(model, guide, data, num_samples=3, seed=0)
    assert idata.posterior[site].values.shape[:2] == (3, 1)


def test_save_load_and_config_rebuild(tmp_path):
    pyro.clear_param_store()
    model, data = _problem()
    guide = pb.posterior(model, "ibdr", num_particles=3, scale=0.01)
    assert type(guide) is IBDRGuide and pb.registry.family_of(guide) == "ibdr"
    assert type(pb.posterior(model, "particles", num_particles=2)) is IBDRGuide
    optim = pb.Optimization(optimizer=pb.infer.IBDR(alpha=0.1))
    pb.fit(model, guide, data, epochs=1, lr=1e-3, seed=0, optim=optim)
    path = pb.save(guide, tmp_path / "p.safetensors")
    loaded = pb.load(path, model)
    assert loaded.config() == guide.config()
    assert loaded.config()["scale"] == 0.01 and loaded.num_components == 3
    assert "alpha" not in loaded.config()  # the fit's setting, not the posterior's
    for s in guide.sites:
        assert torch.equal(loaded.loc(s), guide.loc(s))
    assert loaded.num_posterior_parameters() == 3 * sum(math.prod(v) for v in guide.sites.values())


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"num_particles": 0}, "num_particles"),
        ({"num_particles": 2.5}, "num_particles"),
        ({"scale": -1.0}, "scale"),
        ({"init_scale": float("nan")}, "init_scale"),
        ({"average": "median"}, "average"),
    ],
)
def test_bad_options_are_named(kwargs, words):
    model, _ = _problem()
    with pytest.raises((ValueError, TypeError), match=words):
        ParticleGuide(model, **kwargs)
