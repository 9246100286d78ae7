"""pyrobayes guides under Pyro's own machinery: the param store, SVI with Pyro ELBOs, Predictive.

The exact answers come from the linear-Gaussian LoRA-XS problem (``tests.common.conjugate_core``),
whose posterior over the core is a known diagonal Gaussian.
"""

from __future__ import annotations

import contextlib
import math

import pyro
import pyro.optim
import pytest
import torch

import pyrobayes as pb
from pyrobayes.contract import PostHoc
from pyrobayes.registry import _REGISTRY
from tests import families
from tests.common import conjugate_core, split_batches

FAMILIES = sorted({cls.family for cls in _REGISTRY.values()})


def _state(guide):
    return {k: v.detach().clone() for k, v in guide.state_dict().items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_notebook_order_each_guide_keeps_its_own_values(family, tmp_path):
    """Fit A, use it through Pyro, build and fit B of the same family on the same model: every
    Pyro call, state_dict, save/load and predict of A and of B shows its own fitted values."""
    pyro.clear_param_store()
    torch.manual_seed(0)
    prob = conjugate_core(family=family)
    data = split_batches(prob.x, prob.y, 16)
    x = prob.x[:8]
    a = families.posterior(prob.model, family)
    pb.fit(prob.model, a, data, epochs=3, lr=0.05, seed=1)
    pyro.infer.Predictive(prob.model, guide=a, num_samples=2)((x, None))  # A's names now stored
    state_a = _state(a)
    b = families.posterior(prob.model, family)
    pb.fit(prob.model, b, data, epochs=6, lr=0.02, seed=2)
    state_b = _state(b)
    assert any(not torch.equal(state_a[k], state_b[k]) for k in state_a)  # A and B differ
    for guide, state in ((a, state_a), (b, state_b)):
        # a Pyro call on the guide leaves its tensors as they are
        samples = pyro.infer.Predictive(prob.model, guide=guide, num_samples=3)((x, None))
        for key, value in _state(guide).items():
            assert torch.equal(value, state[key]), (family, key)
        if guide.is_deterministic:  # the Delta guide's draws are its point: exact
            loc = state["locs." + prob.site + "_unconstrained"]
            assert torch.equal(samples[prob.site].reshape(3, 3, 3)[0], loc)
        # pb.predict and pb.save / pb.load use the same values
        draws = guide.sample_posterior(4, generator=torch.Generator().manual_seed(0))
        path = pb.save(guide, tmp_path / f"{id(guide)}.safetensors")
        loaded = pb.load(path, prob.model)
        assert _state(loaded).keys() == state.keys()
        for key, value in _state(loaded).items():
            assert torch.equal(value, state[key]), (family, key)
        again = loaded.sample_posterior(4, generator=torch.Generator().manual_seed(0))
        for site in draws:
            assert torch.equal(draws[site], again[site])
    # and B still trains after all of that (a swapped-in tensor would not move)
    before = _state(b)
    # (a fitted SWAG guide fitted again starts a new collection: its iterates go, with a warning)
    refit = (
        pytest.warns(UserWarning, match=r"held 6 collected iterate\(s\)")
        if family == "swag"
        else contextlib.nullcontext()
    )
    with refit:
        pb.fit(prob.model, b, data, epochs=1, lr=0.02, seed=3)
    assert any(not torch.equal(before[k], v) for k, v in _state(b).items()), family


def _svi_fit(prob, guide, elbo, steps, lr):
    """SVI on the full batch; Polyak average of the last half of the iterates."""
    svi = pyro.infer.SVI(prob.model, guide, pyro.optim.Adam({"lr": lr}), elbo)
    locs, scales = [], []
    for step in range(steps):
        svi.step((prob.x, prob.y))
        if step >= steps // 2:
            locs.append(guide.loc(prob.site).detach().clone())
            if hasattr(guide, "scales"):
                scales.append(guide.scale(prob.site).detach().clone())
    return torch.stack(locs).mean(0), torch.stack(scales).mean(0) if scales else None


ELBOS = {
    "Trace_ELBO": lambda: pyro.infer.Trace_ELBO(num_particles=16, vectorize_particles=True),
    "TraceMeanField_ELBO": lambda: pyro.infer.TraceMeanField_ELBO(
        num_particles=16, vectorize_particles=True
    ),
}


@pytest.mark.parametrize("elbo", sorted(ELBOS))
@pytest.mark.parametrize(
    "family", [f for f in FAMILIES if f not in families.NOT_EXACT_UNDER_PYRO_SVI]
)
def test_pyro_svi_reaches_the_exact_optimum_of_the_family(family, elbo):
    """Pyro's SVI with Pyro's ELBOs on a pyrobayes guide reaches that family's exact optimum.

    The exact posterior N(μ, diag(s²)) is in the mean-field family, so mean-field's optimum is
    (μ, s). Every Gaussian family with a fixed covariance (IVON's h, the Kronecker factors) and
    the point mass have the ELBO-optimal mean μ: E_q[log p] is quadratic in θ. Post-hoc families
    (SWAG, Laplace) have no q before their fit, so SVI must refuse them clearly.
    """
    pyro.clear_param_store()
    torch.manual_seed(0)
    prob = conjugate_core(family=family)
    guide = families.posterior(prob.model, family)
    if isinstance(guide, PostHoc):
        with pytest.raises(RuntimeError, match="not fitted"):
            pyro.infer.SVI(prob.model, guide, pyro.optim.Adam({"lr": 0.01}), ELBOS[elbo]()).step(
                (prob.x, prob.y)
            )
        return
    pyro.set_rng_seed(0)
    loc, scale = _svi_fit(prob, guide, ELBOS[elbo](), steps=1200, lr=0.02)
    sd = prob.post_scale
    # Tolerance: posterior sds are 0.05-0.16; Adam at lr 0.02 with 16-particle gradients jitters
    # by ≲ lr around the optimum and the average of 600 correlated iterates by ≲ 0.2 lr = 4e-3,
    # i.e. ≤ 0.08 sd; we allow 0.15 sd for the mean and 10% for the scale.
    assert ((loc - prob.post_loc).abs() / sd).max() < 0.15, (family, loc, prob.post_loc)
    if scale is not None:
        assert ((scale - sd).abs() / sd).max() < 0.10, (family, scale, sd)


def test_renyi_reaches_its_mean_field_optimum():
    """With the exact posterior inside the mean-field family every α-divergence is minimised by
    it, so RenyiELBO(α = 0.5)'s closed-form optimum is (μ, s)."""
    pyro.clear_param_store()
    torch.manual_seed(0)
    prob = conjugate_core()
    guide = pb.posterior(prob.model, "meanfield", init_scale=0.1)
    pyro.set_rng_seed(0)
    elbo = pyro.infer.RenyiELBO(alpha=0.5, num_particles=16, vectorize_particles=True)
    loc, scale = _svi_fit(prob, guide, elbo, steps=1200, lr=0.02)
    sd = prob.post_scale
    # the same derivation as above; the Rényi gradient is a self-normalised importance-weighted
    # one (biased for finite particles by O(1/16) relative): 0.15 sd and 15% on the scale
    assert ((loc - prob.post_loc).abs() / sd).max() < 0.15
    assert ((scale - sd).abs() / sd).max() < 0.15


@pytest.mark.parametrize(
    "make",
    [
        pyro.infer.Trace_ELBO,
        pyro.infer.TraceMeanField_ELBO,
        pyro.infer.TraceGraph_ELBO,
        lambda: pyro.infer.RenyiELBO(alpha=0.5, num_particles=2),
        lambda: pyro.infer.Trace_ELBO(num_particles=3, vectorize_particles=True),
    ],
    ids=["Trace", "TraceMeanField", "TraceGraph", "Renyi", "Trace-vectorized"],
)
def test_pb_fit_takes_every_pyro_elbo(make):
    """pb.fit(loss=<a Pyro ELBO>) trains the guide; its loss is Pyro's (the dataset-sum ELBO)."""
    pyro.clear_param_store()
    torch.manual_seed(0)
    prob = conjugate_core()
    guide = pb.posterior(prob.model, "meanfield", init_scale=0.1)
    data = split_batches(prob.x, prob.y, 16)
    before = guide.loc(prob.site).detach().clone()
    result = pb.fit(
        prob.model, guide, data, epochs=40, lr=0.02, seed=0, optim=pb.Optimization(loss=make())
    )
    assert torch.isfinite(result.losses).all()
    moved = (guide.loc(prob.site).detach() - prob.post_loc).abs().mean()
    assert moved < 0.5 * (before - prob.post_loc).abs().mean()  # towards the exact mean
    # Pyro's value and ours estimate the same negative ELBO: a 4000-draw check at the end
    torch.manual_seed(1)
    with torch.no_grad():
        ours = float(pb.infer.ELBO(num_particles=4000).loss(prob.model, guide, data[0]))
    theirs = [pyro.infer.Trace_ELBO().loss(prob.model, guide, data[0]) for _ in range(200)]
    # sd of one Pyro draw is ≈ √(2 r²)·N/B ≈ 17 nats here, so 200 draws: ≈ 1.2; 5σ ≈ 6
    assert abs(sum(theirs) / len(theirs) - ours) < 6.0


def test_elbos_a_family_cannot_use_are_refused_by_name():
    pyro.clear_param_store()
    torch.manual_seed(0)
    prob = conjugate_core()
    data = split_batches(prob.x, prob.y, 16)
    with pytest.raises(TypeError, match="hess_int"):  # a typo in an option is not swallowed
        pb.posterior(prob.model, "ivon", hess_int=0.5)
    with pytest.raises(ValueError, match="TraceTailAdaptive_ELBO reports no loss"):
        pb.fit(
            prob.model,
            pb.posterior(prob.model, "meanfield"),
            data,
            epochs=1,
            optim=pb.Optimization(
                loss=pyro.infer.TraceTailAdaptive_ELBO(num_particles=2, vectorize_particles=True)
            ),
        )
    for family in ("swag", "laplace", "ivon", "kron-ivon"):
        with pytest.raises(ValueError, match="cannot fit .* with Trace_ELBO"):
            pb.fit(
                prob.model,
                pb.posterior(prob.model, family),
                data,
                epochs=1,
                optim=pb.Optimization(loss=pyro.infer.Trace_ELBO()),
            )


@pytest.mark.parametrize("parallel", [False, True])
def test_predictive_on_more_rows_than_num_data_matches_pb_predict(parallel):
    """Predictive works for any number of rows, and with parallel=True the samples stay apart
    from the data plate: its draws match pb.predict's moments within Monte Carlo error."""
    pyro.clear_param_store()
    torch.manual_seed(0)
    prob = conjugate_core()  # num_data = 64; the posterior is the exact one
    guide = pb.posterior(prob.model, "meanfield")
    guide.set_site(prob.site, loc=prob.post_loc, scale=prob.post_scale)
    x = torch.cat([prob.x, prob.x])[:80]  # 80 rows > num_data; 80 divisible by S
    num = 4000
    pyro.set_rng_seed(0)
    pred = pyro.infer.Predictive(
        prob.model, guide=guide, num_samples=num, parallel=parallel, return_sites=["obs", prob.site]
    )((x, None))
    obs = pred["obs"]
    assert obs.shape == (num, 80, 5)
    # each draw's residual against its own θ is the observation noise σ = 0.5
    theta = pred[prob.site].reshape(num, 3, 3)
    f = prob.model.batched_output(x, {prob.site: theta})
    resid_sd = float((obs - f).std())
    # sd of a sample sd over n = 4000·80·5 Gaussian draws: σ/√(2n) ≈ 3e-4; 5σ ≈ 1.6e-3
    assert abs(resid_sd - 0.5) < 1.6e-3, resid_sd
    # the predictive mean of y equals pb.predict's (same posterior, independent draws)
    ref = pb.predict(prob.model, guide, [(x, None)], num_samples=num, seed=0)
    loc = ref.loc.mean(0)
    spread = ref.loc.var(0)  # Var_θ f
    # per entry: Var(mean obs) = (Var_θ f + σ²)/S, Var(mean loc) = Var_θ f / S; 5σ per entry
    # (400 entries: a false alarm has probability < 400 · 6e-7)
    tol = 5 * ((2 * spread + 0.25) / num).sqrt()
    assert ((obs.mean(0) - loc).abs() <= tol).all()


def test_observed_rows_beyond_num_data_are_an_error():
    pyro.clear_param_store()
    torch.manual_seed(0)
    prob = conjugate_core()
    guide = pb.posterior(prob.model, "meanfield")
    x, y = torch.cat([prob.x, prob.x]), torch.cat([prob.y, prob.y])
    with pytest.raises(ValueError, match="128 observed rows but the model's num_data is 64"):
        pyro.infer.SVI(
            prob.model, guide, pyro.optim.Adam({"lr": 0.01}), pyro.infer.Trace_ELBO()
        ).step((x, y))


def test_vectorized_particles_estimate_the_same_elbo():
    """Trace_ELBO(vectorize_particles=True) runs the particles in one sample-batched forward and
    estimates the same loss as the sequential particles."""
    pyro.clear_param_store()
    torch.manual_seed(0)
    prob = conjugate_core()
    guide = pb.posterior(prob.model, "meanfield", init_scale=0.1)
    batch = (prob.x[:16], prob.y[:16])
    pyro.set_rng_seed(0)
    seq = torch.tensor(
        [pyro.infer.Trace_ELBO(num_particles=4).loss(prob.model, guide, batch) for _ in range(300)]
    )
    vec = torch.tensor(
        [
            pyro.infer.Trace_ELBO(num_particles=4, vectorize_particles=True).loss(
                prob.model, guide, batch
            )
            for _ in range(300)
        ]
    )
    # two independent means of 300 draws: 5 standard errors of their difference
    se = math.sqrt(float(seq.var() + vec.var()) / 300)
    assert abs(float(seq.mean() - vec.mean())) < 5 * se


def test_autoguidelist_composes_a_pyrobayes_guide_with_a_pyro_autoguide():
    """A user model with a site of its own: a pyrobayes guide over the adapter sites and Pyro's
    AutoNormal over the rest, in one AutoGuideList, trained by Pyro's SVI."""
    import pyro.distributions as dist
    from pyro import poutine
    from pyro.infer.autoguide import AutoGuideList, AutoNormal

    pyro.clear_param_store()
    torch.manual_seed(0)
    prob = conjugate_core()
    fm = prob.model

    def model(batch):
        x, y = batch
        shift = pyro.sample("shift", dist.Normal(0.0, 1.0))  # a global offset of the targets
        return fm((x, None if y is None else y - shift))

    guide = AutoGuideList(model)
    guide.append(pb.guides.MeanFieldGuide(poutine.block(model, expose=list(fm.latent_sites))))
    guide.append(AutoNormal(poutine.block(model, hide=list(fm.latent_sites))))
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), pyro.infer.Trace_ELBO())
    pyro.set_rng_seed(0)
    for _ in range(1500):
        svi.step((prob.x, prob.y + 0.7))
    draws = pyro.infer.Predictive(model, guide=guide, num_samples=400, return_sites=["shift"])(
        (prob.x, None)
    )
    # the shift's posterior sd is ≈ σ/√(N·D) = 0.5/√320 ≈ 0.028: its mean lies within 4.3 sd
    # (0.12) of the true 0.7, and the draws' spread is that sd within 30% (400 draws, plus the
    # optimizer's jitter)
    assert abs(float(draws["shift"].mean()) - 0.7) < 0.12
    assert 0.7 * 0.028 < float(draws["shift"].std()) < 1.3 * 0.028
    assert set(guide[0].sites) == set(fm.latent_sites)


def test_count_parameters_names_a_guide_whose_model_is_not_a_finetune_model():
    # a guide of an AutoGuideList over the user's own model function: its site specs are not
    # known, so a clear error, not the zeros it returned before
    from pyro import poutine

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    model = pb.models.FineTuneModel(
        net, pb.models.LoRAXS(rank=2, target_modules=["0"]), num_data=8, trainable_modules=["2"]
    )

    def my_model(batch):
        return model(batch)

    guide = pb.guides.MeanFieldGuide(poutine.block(my_model, expose=list(model.latent_sites)))
    with pytest.raises(TypeError, match="not a pyrobayes FineTuneModel"):
        pb.count_parameters(guide)
    assert pb.count_parameters(pb.posterior(model, "meanfield"))["latent"] == 4


def test_count_parameters_counts_the_guides_sites_and_the_point_lora_factors():
    # a guide built before make_latent counted the new latent head as "latent" though the guide
    # neither fits nor stores it; LoRA(latent="A")'s point B factors were counted as "head"
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))

    xs = pb.models.LoRAXS(rank=2, target_modules=["0"])
    model = pb.models.FineTuneModel(net(), xs, num_data=8, trainable_modules=["2"])
    guide = pb.posterior(model, "meanfield")
    assert pb.count_parameters(guide)["latent"] == 4 and pb.count_parameters(guide)["head"] == 21
    model.make_latent(["2"])
    counts = pb.count_parameters(guide)  # the guide covers the core only; the head is frozen
    assert counts["latent"] == 4 and counts["head"] == 0 and counts["trainable"] == 4
    assert counts["posterior_storage"] == 8
    assert pb.count_parameters(model)["latent"] == 4 + 21  # the model alone: all its sites
    assert pb.count_parameters(pb.posterior(model, "meanfield"))["latent"] == 4 + 21
    lora = pb.models.LoRA(rank=2, target_modules=["0"], latent="A")
    model = pb.models.FineTuneModel(net(), lora, num_data=8, trainable_modules=["2"])
    counts = pb.count_parameters(model)
    # A: 2x4 latent; B: 6x2 a point factor; head: 6x3 + 3
    assert counts["latent"] == 8 and counts["point_adapter"] == 12 and counts["head"] == 21
    assert counts["trainable"] == 8 + 12 + 21


@pytest.mark.parametrize("family", ["laplace", "swag", "meanfield"])
def test_pb_fit_leaves_no_gradients_and_a_fitted_post_hoc_guide_is_fixed_under_svi(family):
    # pb.fit left the last step's gradients on every trained tensor: Pyro's SVI on the fitted
    # Laplace guide then stepped them (its point moved by 1.3 at lr 0.5, away from the
    # covariance fitted there); its draws carried gradient to the point as well
    pyro.clear_param_store()
    torch.manual_seed(0)
    prob = conjugate_core(family=family)
    guide = families.posterior(prob.model, family)
    batch = (prob.x, prob.y)
    pb.fit(prob.model, guide, [batch], epochs=3, lr=0.05, seed=0)
    trained = pb.infer.trainable_parameters(prob.model, guide)
    assert all(p.grad is None for p in trained)
    before = {k: v.detach().clone() for k, v in guide.state_dict().items()}
    svi = pyro.infer.SVI(prob.model, guide, pyro.optim.Adam({"lr": 0.5}), pyro.infer.Trace_ELBO())
    for _ in range(3):
        svi.step(batch)
    moved = [k for k, v in guide.state_dict().items() if not torch.equal(v, before[k])]
    if isinstance(guide, PostHoc):  # fixed once fitted: SVI moves nothing
        assert not moved, moved
    else:  # a variational guide trains on under SVI
        assert moved
