"""Silent cases, round 4d (the variational families and their fitters): an IVON update that
leaves ``h`` or ``m`` unusable is undone, a mean-field ``init_scale`` that underflows its site's
dtype is refused by name, a symmetrized guide over a one-element group is refused, and the
``set_site`` setters refuse values that would be broadcast or give NaN scales."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import pyrobayes as pb
from pyrobayes.models import LoRA
from pyrobayes.testing import tiny_problem


def _float32_problem(**kwargs: Any) -> tuple[Any, list[Any]]:
    """:func:`tiny_problem` in float32 (the suite's default dtype is float64)."""
    model, data = tiny_problem(net=lambda net: net.float(), **kwargs)
    return model, [(x.float(), y) for x, y in data]


def _snapshot(model: Any, guide: Any) -> dict[str, torch.Tensor]:
    """Every floating tensor of the guide and of the model's trained parameters, cloned."""
    out = {f"guide.{k}": v.detach().clone() for k, v in guide.state_dict().items()}
    out.update(
        {f"model.{k}": p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
    )
    return {k: v for k, v in out.items() if v.is_floating_point()}


# ---------------------------------------------------------------- 1. IVON's update
@pytest.mark.parametrize("family", ["ivon", "kron-ivon"])
def test_an_ivon_update_that_overflows_h_is_undone_and_named(family):
    """hess_init=1e30: the update's correction ½(1−β2)²(h−ĥ)²/(h+δ) overflows float32, so h
    became inf, then NaN (σ = 0 times ĥ's inf), and the fit stopped two steps later with "Non-finite
    loss ... parameters were not updated" while the guide (m and h) and the model's head already
    held NaN. Now the step that spoils them is undone and named."""
    model, data = _float32_problem()
    guide = pb.posterior(model, family, hess_init=1e30)
    before = _snapshot(model, guide)
    with pytest.raises(FloatingPointError) as caught:
        pb.fit(model, guide, data, epochs=1, progress=False)
    message = str(caught.value)
    assert "IVON's update at step 0" in message and "hess_init" in message
    assert "the step was undone" in message
    after = _snapshot(model, guide)
    assert after.keys() == before.keys()
    # everything, the Kronecker factors and their decompositions included (their step's EMA
    # is applied only once the update is kept: infer/kron.py's KronCurvature.commit)
    assert any(k.startswith("guide.locs") for k in after) and any(
        k.startswith("model.") for k in after
    )
    for name in after:
        assert torch.equal(after[name], before[name]), name


def test_an_ivon_update_refused_mid_fit_names_the_site():
    """A fit whose h is spoiled later (ess tiny: σ huge) stops at that step, the guide finite."""
    model, data = _float32_problem()
    guide = pb.posterior(model, "ivon", ess=1e-30)
    with pytest.raises(FloatingPointError, match=r"site 0\.core") as caught:
        pb.fit(model, guide, data, epochs=1, progress=False)
    # its own advice (hess_init, the rate, clip_radius), not the loop's generic "Lower the
    # learning rate or the init_scale" (an IVON guide has no init_scale)
    assert "hess_init" in str(caught.value) and "init_scale" not in str(caught.value)
    for site in guide.sites:
        assert bool(guide.loc(site).isfinite().all()) and bool(guide.hess(site).gt(0).all())


# ---------------------------------------------------------------- 2. mean-field init_scale
def test_an_init_scale_below_the_dtypes_smallest_normal_is_refused_by_name():
    """init_scale=1e-45 passed the > 0 check but is subnormal in float32: σ started at ~0, and
    the first step failed with "Non-finite gradient ... Lower the learning rate or the
    init_scale", the opposite of the fix."""
    model, _ = _float32_problem()
    with pytest.raises(ValueError, match=r"init_scale=1e-45 .*float32.*site '0\.core'") as caught:
        pb.posterior(model, "meanfield", init_scale=1e-45)
    assert "pass init_scale >=" in str(caught.value)


def test_a_small_normal_init_scale_and_a_float64_site_still_pass():
    model, _ = _float32_problem()
    pb.posterior(model, "meanfield", init_scale=1e-30)
    model64, _ = tiny_problem(net=lambda net: net.double())
    guide = pb.posterior(model64, "meanfield", init_scale=1e-45)
    assert float(guide.scale("0.core").detach().min()) > 0


# ---------------------------------------------------------------- 3. a trivial group
def test_a_symmetrized_guide_over_a_one_element_group_is_refused():
    """LoRA of rank 1: the permutation group is the identity alone, so I_K was 0 at every step
    and the "symmetrized" fit was the base's, with no word."""
    model, _ = tiny_problem(adapter=lambda a: LoRA(rank=1, target_modules=["0", "2"]))
    with pytest.raises(ValueError, match=r"single unit .*'0\.rank'.*rank=r\) with r >= 2"):
        pb.posterior(model, "symmetrized")


def test_a_symmetrized_guide_over_rank_two_still_builds():
    model, _ = tiny_problem(adapter=lambda a: LoRA(rank=2, target_modules=["0", "2"]))
    assert pb.posterior(model, "symmetrized").spec.order == 4


# ---------------------------------------------------------------- 4. set_site
@pytest.mark.parametrize(
    ("family", "kwargs", "match"),
    [
        ("meanfield", {"loc": torch.ones(2)}, r"loc at site '0\.core' must have the site's shape"),
        ("meanfield", {"scale": torch.ones(2, 1)}, r"scale at site '0\.core' must have"),
        ("meanfield", {"scale": -1.0}, r"scale at site '0\.core' must be > 0"),
        ("meanfield", {"scale": 0.0}, r"scale at site '0\.core' must be > 0"),
        ("meanfield", {"loc": float("nan")}, r"loc at site '0\.core' has non-finite"),
        ("ivon", {"loc": torch.ones(1, 2)}, r"loc at site '0\.core' must have the site's shape"),
        ("ivon", {"hess": -5.0}, r"hess at site '0\.core' must have h \+ weight_decay > 0"),
        ("ivon", {"hess": float("inf")}, r"hess at site '0\.core' has non-finite"),
    ],
)
def test_set_site_refuses_a_broadcast_or_unusable_value(family, kwargs, match):
    """copy_ broadcast a (2,) loc over the rows of a (2, 2) site, and a scale <= 0 or an h with
    h + δ <= 0 gave NaN scales, all without a word; a refused call leaves the guide as it was."""
    model, _ = tiny_problem()
    guide = pb.posterior(model, family)
    before = _snapshot(model, guide)
    with pytest.raises(ValueError, match=match) as caught:
        guide.set_site("0.core", **kwargs)
    assert str(caught.value).startswith(f"{type(guide).__name__}.set_site: ")
    after = _snapshot(model, guide)
    for name, value in after.items():
        assert torch.equal(value, before[name]), name


def test_set_site_still_takes_scalars_and_full_tensors():
    model, _ = tiny_problem()
    guide = pb.posterior(model, "meanfield")
    guide.set_site("0.core", loc=torch.ones(2, 2), scale=0.5)
    assert torch.allclose(guide.scale("0.core"), torch.full((2, 2), 0.5))
    assert torch.equal(guide.loc("0.core"), torch.ones(2, 2))
    ivon = pb.posterior(model, "ivon")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ivon.set_site("0.core", loc=0.0, hess=torch.full((2, 2), 2.0))
    assert torch.equal(ivon.hess("0.core"), torch.full((2, 2), 2.0))
