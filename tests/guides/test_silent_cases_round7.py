"""Silent failure cases of IBDR and σN during a fit (round 7): each test fails without its fix."""

from __future__ import annotations

import logging
import math

import pyro
import pytest
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.infer.ibdr import IBDR, IBDRLoss
from pyrobayes.models.signorm import SigmaNormEnsemble
from pyrobayes.testing import tiny_problem


@pytest.fixture
def float32():
    """The problem in float32 (the suite runs in float64), where these overflows happen."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _ibdr(settings: IBDR, num_data: int | None = None, net=None):
    pyro.clear_param_store()
    torch.manual_seed(0)
    model, data = tiny_problem(net=net)
    if num_data is not None:
        model.num_data = num_data
    guide = pb.posterior(model, "ibdr", num_particles=2)
    fitter = pb.infer.make_fitter(model, guide, lr=1e-3, optimizer=settings)
    return model, guide, fitter, data


# ---------------------------------------------------------------------------------------------
# IBDR: the robust step
# ---------------------------------------------------------------------------------------------


def test_a_gradient_norm_that_overflows_float32_does_not_send_lambda_silently_to_lam_min(
    float32,
):
    """Finite float32 gradients of a dataset sum over a huge N: their squared norm overflows.
    The clip was then 0, the radius 0·inf = NaN and λ fell to lam_min without a word."""
    _, _, fitter, data = _ibdr(IBDR(alpha=0.0), num_data=10**36)
    fitter.step(data[0])
    assert math.isfinite(fitter.radius) and math.isfinite(fitter.cost)
    # the clip binds: the ascent is c_max / (2 λ₀) long, and λ moved by the dual step only
    assert fitter.radius == pytest.approx(0.2 / (2 * 3.0), rel=1e-4)
    expected = 3.0 - (0.25 / 0.0025) * (0.0025 - fitter.radius**2 / 2)
    assert fitter.lam == pytest.approx(expected, rel=1e-6)
    assert fitter.lam != fitter.lam_min


def _no_tanh(seq: nn.Sequential) -> nn.Sequential:
    return nn.Sequential(*[nn.Identity() if isinstance(m, nn.Tanh) else m for m in seq])


@pytest.mark.parametrize(
    ("lam", "net"),
    [
        (1e-300, None),  # the ascent overflows float32: refused before θ' (tanh hid it: θ' = inf)
        (1e-320, None),  # 1/(2λ) = inf in Python
        (1e-37, _no_tanh),  # θ' finite, the loss there is not
    ],
)
def test_an_ascent_to_non_finite_particles_is_refused_by_its_setting_and_changes_nothing(
    lam, net, float32
):
    """λ so small that θ' = θ + clip(g)/(2λ) overflows: the error names the robust step and its
    settings (not just 'a non-finite gradient', or nothing at all when saturating units hid the
    infinite particles), and particles, λ and the optimizer are as before."""
    _, guide, fitter, data = _ibdr(IBDR(alpha=0.0, lam=lam, lam_min=lam), net=net)
    assert guide.loc(next(iter(guide.sites))).dtype == torch.float32
    before = {k: v.clone() for k, v in guide.state_dict().items()}
    with pytest.raises(FloatingPointError, match=r"ascent.*lam_min"):
        fitter.step(data[0])
    for k, v in guide.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert fitter.lam == lam and fitter.num_steps == 0
    assert not fitter.optimizer.state  # no optimizer step was taken


def test_a_nan_transport_cost_is_refused_not_clipped_to_a_bound(monkeypatch):
    """A NaN cost (here the function-space cost over NaN probabilities at θ') went through
    ``max(lam_min, nan)``, which is lam_min: λ jumped to its bound and the step went on."""
    _, guide, fitter, data = _ibdr(IBDR(alpha=0.0, cost="function"))
    calls = []
    original = IBDRLoss.data_term

    def data_term(self, model, values, batch):
        total, probs = original(self, model, values, batch)
        calls.append(1)
        if len(calls) % 2 == 0 and probs is not None:  # pass 2: θ'
            probs = torch.full_like(probs, float("nan"))
        return total, probs

    monkeypatch.setattr(IBDRLoss, "data_term", data_term)
    before = {k: v.clone() for k, v in guide.state_dict().items()}
    with pytest.raises(FloatingPointError, match=r"dual step.*cost"):
        fitter.step(data[0])
    assert fitter.lam == 3.0
    assert not fitter.optimizer.state
    for k, v in guide.state_dict().items():
        assert torch.equal(v, before[k]), k


# ---------------------------------------------------------------------------------------------
# σN: members that cannot differ, and norm layers left out without a word
# ---------------------------------------------------------------------------------------------


def _ln_net(extra: nn.Module | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 8), nn.LayerNorm(8)]
    layers += [extra] if extra is not None else []
    return nn.Sequential(*layers, nn.Tanh(), nn.Linear(8, 3))


def test_signorm_members_that_start_identical_without_heads_are_warned_of():
    """init_noise=0 with the default head_init='reinit' but no member heads: every member starts
    (and stays) the same network; only head_init='copy' was warned of."""
    pyro.clear_param_store()
    model = SigmaNormEnsemble(_ln_net(), num_members=3, heads=[], num_data=10)
    with pytest.warns(UserWarning, match="identical.*init_noise"):
        guide = pb.posterior(model, "signorm", init_noise=0.0)
    locs = guide.validation_values()
    assert all(bool((v == v[:1]).all()) for v in locs.values())  # what the warning says


def test_signorm_members_with_distinct_starts_are_not_warned_of():
    pyro.clear_param_store()
    model = SigmaNormEnsemble(_ln_net(), num_members=3, heads=[], num_data=10)
    guide = pb.posterior(model, "signorm")  # init_noise 0.1: distinct γ, no warning
    assert guide.num_members == 3


@pytest.mark.parametrize(
    "options",
    [
        {"norm_modules": ["1", "4_typo"]},
        {"norm_modules": ["1"], "heads": ["6", "head_typo"]},
    ],
)
def test_a_selection_entry_that_matches_nothing_is_warned_not_dropped(options):
    with pytest.warns(UserWarning, match="typo.*match no candidate"):
        SigmaNormEnsemble(_ln_net(), num_members=2, num_data=10, **options)


def test_a_regularized_entry_that_matches_nothing_is_warned_not_dropped():
    pyro.clear_param_store()
    model = SigmaNormEnsemble(_ln_net(), num_members=2, heads=["6"], num_data=10)
    guide = pb.posterior(model, "signorm")
    settings = pb.infer.SigmaNormDiversity(regularized=["1", "nope"])
    with pytest.warns(UserWarning, match="nope.*match no candidate"):
        pb.infer.make_fitter(model, guide, optimizer=settings)


def test_norm_layers_that_all_leaves_unconverted_are_named(caplog):
    with caplog.at_level(logging.WARNING, logger="pyrobayes.models.signorm"):
        model = SigmaNormEnsemble(
            _ln_net(nn.GroupNorm(2, 8)), num_members=2, heads=["7"], num_data=10
        )
    assert "5 (GroupNorm)" in caplog.text and "shared by every member" in caplog.text
    assert len(model.latent_sites) > 0
