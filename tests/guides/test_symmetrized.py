"""SymmetrizedGuide: the InfoNCE term I_K against exact enumeration, its bounds and limits, and
the guide as its base (sampling, config, save/load, option errors)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pyro
import pytest
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.contract import AnalyticKL, Posterior, Symmetrized
from pyrobayes.models import FineTuneModel, LoRA, LoRAXS

SIGMA = 0.4


def _one_four_one(bias: bool = False, width: int = 4) -> FineTuneModel:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, width, bias=bias), nn.Tanh(), nn.Linear(width, 1, bias=bias))
    return FineTuneModel(
        net,
        None,
        latent_modules=["0", "2"],
        likelihood="gaussian",
        num_data=8,
        trainable_modules=[],
    ).double()


def _guide(model, loc: dict, scale: float, num_permutations: int = 16):
    guide = pb.posterior(model, "symmetrized")
    guide.num_permutations = num_permutations  # K of infonce calls that pass none
    for site, value in loc.items():
        guide.base.set_site(site, loc=value, scale=torch.full_like(value, scale))
    return guide


def _enumerated_integrand(theta: np.ndarray, mu: np.ndarray, sigma: float) -> np.ndarray:
    """log q(θ) − log((1/|G|) Σ_g q(g·θ)) by looping over S_4 in NumPy (an independent code path).

    ``theta`` (N, 4, 2): unit j's (W1[j, 0], W2[0, j]); ``mu`` (4, 2). Unit j of g·θ is unit
    g(j) of θ, so log q(g·θ) = Σ_j log N(θ_{g(j)}; μ_j, σ²).
    """

    def log_q(values: np.ndarray) -> np.ndarray:
        z = (values - mu) / sigma
        return (-0.5 * z**2 - math.log(sigma) - 0.5 * math.log(2 * math.pi)).sum(axis=(1, 2))

    terms = np.stack([log_q(theta[:, list(g)]) for g in itertools.permutations(range(4))], 1)
    top = terms.max(1, keepdims=True)
    log_mean = (top[:, 0] + np.log(np.exp(terms - top).sum(1))) - math.log(24)
    return log_q(theta) - log_mean


def _units(values: dict) -> np.ndarray:
    """(N, 4, 2) units of draws ``{"0.weight": (N, 4, 1), "2.weight": (N, 1, 4)}``."""
    return torch.stack([values["0.weight"][:, :, 0], values["2.weight"][:, 0, :]], -1).numpy()


def _fixed_q(model, seed: int = 0):
    """q with μ ~ N(0, 0.5²) per entry (one draw, fixed), σ = 0.4: the 1-4-1 check."""
    g = torch.Generator().manual_seed(seed)
    loc = {
        s: 0.5 * torch.randn(tuple(spec.shape), generator=g, dtype=torch.float64)
        for s, spec in model.latent_sites.items()
    }
    return loc


def test_all_permutation_estimator_equals_the_enumerated_kl():
    """1-4-1 MLP, |G| = 24. With all 24 elements (the identity as the θ₀ term) I_K(θ₀) is
    exactly the integrand of I = KL(q ‖ q_G) = E_q[log q − log q_G]: per draw it equals the
    NumPy enumeration to 1e-10 (float64), so its mean is unbiased for I. The mean over N = 4000
    draws then agrees with an independent NumPy estimate of I on 200 000 draws within
    4·sqrt(SE₁² + SE₂²) (a 4σ two-sample bound)."""
    model = _one_four_one()
    loc = _fixed_q(model)
    guide = _guide(model, loc, SIGMA)
    torch.manual_seed(1)
    with torch.no_grad():
        values = guide.rsample(4000)
        estimate = guide.infonce(values, perms=guide.spec.enumerate())
    mu = np.stack([loc["0.weight"][:, 0].numpy(), loc["2.weight"][0].numpy()], -1)
    reference = _enumerated_integrand(_units(values), mu, SIGMA)
    np.testing.assert_allclose(estimate.numpy(), reference, rtol=0, atol=1e-10)
    rng = np.random.default_rng(2)
    big = mu + SIGMA * rng.standard_normal((200_000, 4, 2))
    exact = _enumerated_integrand(big, mu, SIGMA)
    i_exact, se_exact = exact.mean(), exact.std() / math.sqrt(len(exact))
    se = float(estimate.std()) / math.sqrt(4000)
    assert abs(float(estimate.mean()) - i_exact) <= 4 * math.hypot(se, se_exact)
    assert 0 < i_exact < math.log(24)
    # log q_G by enumeration is the same integrand's second term
    log_q_g = guide.symmetrized_log_prob(values)
    np.testing.assert_allclose(
        (guide.log_prob(values) - log_q_g).detach().numpy(), reference, rtol=0, atol=1e-10
    )


def test_sampled_negatives_stay_below_min_of_i_and_log_k():
    """K = 6 < |G| = 24 uniform negatives: mean I_6 ≤ min(I, log 6) within 3 SE (InfoNCE bound).
    I from 200 000 enumerated draws (SE ≈ 0.003)."""
    model = _one_four_one()
    loc = _fixed_q(model)
    guide = _guide(model, loc, SIGMA, num_permutations=6)
    torch.manual_seed(3)
    with torch.no_grad():
        values = guide.rsample(4000)
        i_6 = guide.infonce(values)
        i_all = guide.infonce(values, perms=guide.spec.enumerate())
    mean, se = float(i_6.mean()), float(i_6.std()) / math.sqrt(4000)
    se_all = float(i_all.std()) / math.sqrt(4000)
    assert mean <= math.log(6) + 3 * se
    assert mean <= float(i_all.mean()) + 3 * math.hypot(se, se_all)
    assert mean >= -3 * se  # E[I_K] ≥ 0
    # for this q, I ≈ 1.9 > log 6: the bound binds at log K and I_6 is well below both
    assert float(i_all.mean()) - mean > 10 * math.hypot(se, se_all)


def test_per_draw_upper_bound_and_nonnegative_mean():
    """I_K(θ₀) ≤ log K for every draw (the θ₀ term alone gives mean_k ≥ q(θ₀)/K); E[I_K] ≥ 0
    by Jensen (E[q(h·θ₀)/q(θ₀)] = 1), checked as mean ≥ −3 SE, for random q and several K."""
    torch.manual_seed(4)
    model = _one_four_one(bias=True, width=5)
    for num in (2, 5, 16, 64):
        loc = {
            s: torch.randn(tuple(spec.shape), dtype=torch.float64)
            for s, spec in model.latent_sites.items()
        }
        guide = _guide(model, loc, 0.3, num_permutations=num)
        with torch.no_grad():
            i_k = guide.infonce(guide.rsample(2000))
        assert float(i_k.max()) <= math.log(num) + 1e-12
        assert float(i_k.mean()) >= -3 * float(i_k.std()) / math.sqrt(2000)


def test_an_invariant_q_gives_exactly_zero():
    """All units share μ and σ: every permuted log q equals log q(θ₀) bit for bit, I_K = 0."""
    model = _one_four_one(bias=True)
    loc = {
        "0.weight": torch.full((4, 1), 0.3, dtype=torch.float64),
        "0.bias": torch.full((4,), -0.2, dtype=torch.float64),
        "2.weight": torch.full((1, 4), 0.7, dtype=torch.float64),
        "2.bias": torch.full((1,), 0.1, dtype=torch.float64),
    }
    guide = _guide(model, loc, SIGMA, num_permutations=16)
    torch.manual_seed(5)
    values = guide.rsample(64)
    assert torch.equal(guide.infonce(values), torch.zeros(64, dtype=torch.float64))
    assert torch.equal(
        guide.infonce(values, perms=guide.spec.enumerate()), torch.zeros(64, dtype=torch.float64)
    )


def test_well_separated_units_in_a_large_group_reach_log_k():
    """Width 16 (|G| = 16! ≈ 2·10¹³: a negative is the identity with probability ~1e-13),
    unit means 1 apart and σ = 1e-3: every negative has log q ≈ −10⁵ lower, I_K = log K."""
    model = _one_four_one(width=16)
    loc = {
        "0.weight": torch.arange(16, dtype=torch.float64).unsqueeze(1),
        "2.weight": torch.arange(16, dtype=torch.float64).unsqueeze(0),
    }
    guide = _guide(model, loc, 1e-3, num_permutations=32)
    torch.manual_seed(6)
    with torch.no_grad():
        i_k = guide.infonce(guide.rsample(200))
    assert torch.allclose(i_k, torch.full_like(i_k, math.log(32)), atol=1e-3, rtol=0)


def test_k_equal_one_is_zero_and_paths_agree():
    """K = 1: I_K = 0 exactly. The mean-field fast path (permuting μ, σ) equals the generic one
    (the base's log_prob at the permuted draws) to float64 round-off."""
    model = _one_four_one(bias=True, width=5)
    loc = _fixed_q(model)
    guide = _guide(model, loc, SIGMA, num_permutations=1)
    values = guide.rsample(8)
    assert torch.equal(guide.infonce(values), torch.zeros(8, dtype=torch.float64))
    perms = guide.spec.sample(7)
    fast = guide.permuted_log_prob(values, perms)
    moved = guide.spec.act(values, perms)
    generic = guide.base.log_prob({s: v.reshape(56, *v.shape[2:]) for s, v in moved.items()})
    assert torch.allclose(fast, generic.reshape(8, 7), atol=1e-10, rtol=0)


def test_the_guide_is_its_base_for_sampling_and_the_contract():
    model = _one_four_one(bias=True)
    guide = pb.posterior(model, "symmetrized", base="meanfield", init_scale=0.05)
    assert isinstance(guide, Posterior) and isinstance(guide, Symmetrized)
    assert isinstance(guide, AnalyticKL)
    assert guide.config() == {
        "base": "meanfield",
        "init_scale": 0.05,
        "init_loc": "model",
        "prior": "model",
    }
    a = guide.sample_posterior(3, generator=torch.Generator().manual_seed(0))
    b = guide.base.sample_posterior(3, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(a[s], b[s]) for s in a)
    assert torch.equal(guide.log_prob(a), guide.base.log_prob(a))
    assert torch.equal(guide.kl_to_prior(model), guide.base.kl_to_prior(model))
    assert guide.num_posterior_parameters() == guide.base.num_posterior_parameters()
    rebuilt = type(guide)(model, **guide.config())
    rebuilt.load_state_dict(guide.state_dict())
    assert all(torch.equal(rebuilt.mean()[s], guide.mean()[s]) for s in guide.sites)


def test_save_and_load_rebuild_the_base(tmp_path):
    pyro.clear_param_store()
    model = _one_four_one(bias=True)
    guide = pb.posterior(model, "symmetrized", init_scale=0.02)
    with torch.no_grad():
        for p in guide.parameters():
            p.add_(0.1)
    pb.save(guide, tmp_path / "q.safetensors")
    loaded = pb.load(tmp_path / "q.safetensors", _one_four_one(bias=True))
    assert type(loaded) is type(guide) and loaded.config() == guide.config()
    assert "num_permutations" not in pb.io.read_header(tmp_path / "q.safetensors")["config"]
    for key, value in guide.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_pyro_guide_forward_emits_the_base_sites():
    model = _one_four_one(bias=True)
    guide = pb.posterior(model, "symmetrized")
    x, y = torch.randn(4, 1, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    trace = pyro.poutine.trace(guide).get_trace((x, y))
    assert {n for n, s in trace.nodes.items() if s["type"] == "sample"} == set(guide.sites)


def test_bad_bases_and_options():
    model = _one_four_one()
    for base in ("map", "ivon", "swag"):
        with pytest.raises(ValueError, match=f"base='{base}'.*cannot be a base"):
            pb.posterior(model, "symmetrized", base=base)
    with pytest.raises(ValueError, match="num_permutations"):
        pb.posterior(model, "symmetrized", num_permutations=0)
    with pytest.raises(TypeError, match="'typo'.*Its options"):
        pb.posterior(model, "symmetrized", typo=1)
    torch.manual_seed(0)
    xs = FineTuneModel(
        nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)),
        LoRAXS(rank=2, target_modules=["0"]),
        num_data=8,
    )
    with pytest.raises(TypeError, match="'typo'"):  # the option is named before the symmetry
        pb.posterior(xs, "symmetrized", typo=1)
    with pytest.raises(ValueError, match="LoRA-XS cores"):
        pb.posterior(xs, "symmetrized")
    lora = FineTuneModel(
        nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)),
        LoRA(rank=2, target_modules=["0"]),
        num_data=8,
    )
    assert pb.posterior(lora, "symmetrized").spec.sizes == (2,)


def test_the_flat_fast_path_keeps_the_differences_of_log_q():
    """I_K uses log q(h_k·θ) up to a G-invariant term (Σ log σ and unpermuted sites): its
    differences to k = 0 equal those of the full per-site log q (float64 round-off)."""
    model = _one_four_one(bias=True, width=5)
    loc = _fixed_q(model)
    guide = _guide(model, loc, SIGMA)
    with torch.no_grad():
        for site in guide.sites:  # per-coordinate scales: Σ log σ is then a genuine sum
            guide.base.set_site(
                site, scale=0.2 + torch.rand(guide.sites[site], dtype=torch.float64)
            )
    values = guide.rsample(6)
    perms = [
        torch.cat([i, d]) for i, d in zip(guide.spec.identity(), guide.spec.sample(9), strict=True)
    ]
    full = guide.permuted_log_prob(values, perms)
    relative = guide._relative_log_prob(values, perms)
    assert torch.allclose(full - full[:, :1], relative - relative[:, :1], atol=1e-10, rtol=0)


def test_two_hidden_layers_fast_path_equals_the_generic_path():
    """A site permuted on two axes (the middle weight: rows by layer 2, columns by layer 1): the
    per-site gathers of μ and 1/σ give the differences of the base's log_prob at h·θ."""
    torch.manual_seed(7)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    model = FineTuneModel(
        net, None, latent_modules=["0", "2", "4"], num_data=8, trainable_modules=[]
    ).double()
    guide = pb.posterior(model, "symmetrized")
    assert ("2.weight", 1) in guide.spec.layers[0].members
    assert ("2.weight", 0) in guide.spec.layers[1].members
    with torch.no_grad():
        for site, shape in guide.sites.items():
            guide.base.set_site(
                site,
                loc=torch.randn(shape, dtype=torch.float64),
                scale=0.2 + torch.rand(shape, dtype=torch.float64),
            )
    values = guide.rsample(5)
    perms = [
        torch.cat([i, d]) for i, d in zip(guide.spec.identity(), guide.spec.sample(7), strict=True)
    ]
    moved = guide.spec.act(values, perms)
    generic = guide.base.log_prob({s: v.reshape(40, *v.shape[2:]) for s, v in moved.items()})
    generic = generic.reshape(5, 8)
    relative = guide._relative_log_prob(values, perms)
    full = guide.permuted_log_prob(values, perms)
    assert torch.allclose(full, generic, atol=1e-10, rtol=0)
    assert torch.allclose(relative - relative[:, :1], generic - generic[:, :1], atol=1e-10, rtol=0)


def test_gradients_of_i_k_saturated_and_not():
    """Saturated (separated units): the value is log K and every gradient exactly 0 (the graph
    over the K·D terms is skipped). Overlapping copies: the gradient equals autograd through the
    full per-site log q (float64)."""
    model = _one_four_one(width=16)
    loc = {
        "0.weight": torch.arange(16, dtype=torch.float64).unsqueeze(1),
        "2.weight": torch.arange(16, dtype=torch.float64).unsqueeze(0),
    }
    guide = _guide(model, loc, 1e-3, num_permutations=8)
    values = guide.rsample(3)
    value = guide.infonce(values)
    params = [p for p in guide.parameters() if p.requires_grad]
    grads = torch.autograd.grad(value.sum(), params, allow_unused=True)
    assert torch.allclose(value, torch.full_like(value, math.log(8)), atol=1e-12, rtol=0)
    assert all(g is None or not g.any() for g in grads)
    model = _one_four_one(bias=True)
    guide = _guide(model, _fixed_q(model), SIGMA, num_permutations=8)
    values = guide.rsample(3)
    perms = [
        torch.cat([i, d]) for i, d in zip(guide.spec.identity(), guide.spec.sample(7), strict=True)
    ]
    params = [p for p in guide.parameters() if p.requires_grad]
    full = guide.permuted_log_prob(values, perms)
    reference = -(torch.logsumexp(full - full[:, :1], dim=1) - math.log(8))
    expected = torch.autograd.grad(reference.sum(), params, retain_graph=True)
    got = torch.autograd.grad(
        guide.infonce(values, perms=perms).sum(), params, allow_unused=True
    )  # the output bias is acted on by no unit layer: it cancels from I_K
    assert any(g is not None and g.abs().max() > 1e-3 for g in got)
    for a, b in zip(got, expected, strict=True):
        assert torch.allclose(torch.zeros_like(b) if a is None else a, b, atol=1e-10, rtol=1e-8)
