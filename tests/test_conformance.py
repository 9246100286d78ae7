"""pyrobayes.testing.check_family: every registered family, an outside low-rank family built on the
packing base, and deliberately broken families that must fail it."""

from __future__ import annotations

import re
from typing import Any

import pyro.distributions as dist
import pytest
import torch
from pyro.distributions import constraints
from pyro.nn import PyroParam

import pyrobayes as pb
from pyrobayes.guides import MeanFieldGuide
from pyrobayes.guides.joint import JointGaussianGuide
from pyrobayes.registry import _REGISTRY
from pyrobayes.testing import CHECKS, ConformanceError, check_family
from tests import families

FAMILIES = sorted({cls.family for cls in _REGISTRY.values()})


def test_the_nine_families_are_enrolled():
    assert len(FAMILIES) >= 9


@pytest.mark.parametrize("family", FAMILIES)
def test_every_registered_family_conforms(family):
    report = check_family(pb.registry.get_guide_class(family), **families.conformance(family))
    assert report.passed and list(report.results) == list(CHECKS), str(report)


class LowRankGaussian(JointGaussianGuide):
    """``N(m, W Wᵀ + diag(v))`` over all sites laid flat: the whole family, on the packing base."""

    family = "test-lowrank"

    def __init__(self, model: Any, *, rank: int = 2, init_scale: float = 0.05) -> None:
        self.rank, self.init_scale = rank, init_scale
        super().__init__(model)

    def _setup_joint(self, flat_init: torch.Tensor) -> None:
        d = flat_init.numel()
        g = torch.Generator().manual_seed(0)
        self.flat_loc = PyroParam(flat_init.clone())
        factor = 0.1 * self.init_scale * torch.randn(d, self.rank, generator=g)
        self.flat_factor = PyroParam(factor.to(flat_init))
        diag = torch.full((d,), self.init_scale**2).to(flat_init)
        self.flat_diag = PyroParam(diag, constraint=constraints.positive)

    def joint_posterior(self) -> dist.LowRankMultivariateNormal:
        return dist.LowRankMultivariateNormal(self.flat_loc, self.flat_factor, self.flat_diag)


def test_an_outside_low_rank_family_conforms():
    # not registered: the kit registers it for its save/load and export checks only
    report = check_family(LowRankGaussian, options={"rank": 2})
    assert report.passed, str(report)
    assert LowRankGaussian.family not in _REGISTRY
    # its draws are the joint's, laid out by the packing base
    model, _ = pb.testing.tiny_problem()
    guide = LowRankGaussian(model)
    flat = guide.pack(guide.sample_posterior(3, generator=torch.Generator().manual_seed(0)))
    assert flat.shape == (3, guide.flat_dim) and guide.flat_dim == 8  # two 2x2 cores
    back = guide.unpack(flat)
    assert all(back[s].shape == (3, *guide.sites[s]) for s in guide.sites)
    assert torch.equal(guide.pack(back), flat)
    # the log density is the joint's at the packed draws
    joint = guide.joint_posterior()
    torch.testing.assert_close(guide.log_prob(back), joint.log_prob(flat), rtol=0, atol=0)


class ShiftedLogProb(MeanFieldGuide):
    """Broken on purpose: ``log_prob`` is off by 0.5 nats (an unnormalised density)."""

    def log_prob(self, values):
        return super().log_prob(values) + 0.5


class WiderLogProb(MeanFieldGuide):
    """Broken on purpose: ``log_prob`` is the density of a Gaussian 1.3 times wider than the one
    ``sample_posterior`` draws from (normalised, but not q's)."""

    def log_prob(self, values):
        total = 0.0
        for site in self.sites:
            q = self.get_posterior(site).base_dist
            wide = dist.Normal(q.loc, 1.3 * q.scale).to_event(q.loc.dim())
            total = total + wide.log_prob(values[site])
        return total


@pytest.mark.parametrize("broken", [ShiftedLogProb, WiderLogProb], ids=lambda c: c.__name__)
def test_a_wrong_log_prob_fails_the_kit_by_name(broken):
    checks = ("setup", "fit", "contract", "log_prob")
    with pytest.raises(ConformanceError, match=r"\[FAIL\] log_prob") as caught:
        check_family(broken, checks=checks)
    report = caught.value.report
    assert report.failures == ["log_prob"], str(report)
    assert "log_prob is not the density" in report.results["log_prob"][1]
    # without raising, the same report comes back
    assert check_family(broken, checks=checks, raise_on_failure=False).failures == ["log_prob"]


def test_unknown_checks_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown checks \\['speed'\\]"):
        check_family(MeanFieldGuide, checks=("speed",))


def test_a_check_list_that_runs_nothing_or_lacks_its_setup_is_refused():
    # checks=[] reported passed=True with nothing run; checks=["log_prob"] failed log_prob with
    # an AttributeError on the guide setup never built
    with pytest.raises(ValueError, match=r"checks is empty, so nothing would run"):
        check_family(MeanFieldGuide, checks=[])
    with pytest.raises(
        ValueError,
        match=r"need \['setup', 'fit'\].*checks=\('setup', 'fit', 'log_prob'\)",
    ):
        check_family(MeanFieldGuide, checks=["log_prob"])
    with pytest.raises(TypeError, match=r"got the string 'contract'"):
        check_family(MeanFieldGuide, checks="contract")


class MeanWrongShape(MeanFieldGuide):
    """Broken on purpose: ``mean()`` has a leading dimension of 1 (one draw, not the mean)."""

    def mean(self):
        return {s: v.unsqueeze(0) for s, v in super().mean().items()}


class MeanZeros(MeanFieldGuide):
    """Broken on purpose: ``mean()`` is 0, not the mean of what ``sample_posterior`` draws."""

    def mean(self):
        return {s: torch.zeros_like(v) for s, v in super().mean().items()}


class MeanShifted(MeanFieldGuide):
    """Broken on purpose: ``mean()`` is off by 0.3 posterior standard deviations."""

    def mean(self):
        return {
            s: v + 0.3 * self.get_posterior(s).base_dist.scale for s, v in super().mean().items()
        }


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (MeanWrongShape, r"mean\(\) has shape \(1, 2, 2\), expected the site's \(2, 2\)"),
        (MeanZeros, r"mean\(\) is 0 at flat index .* is not the mean of q's draws"),
        (MeanShifted, r"standard error .* is not the mean of q's draws"),
    ],
    ids=["wrong-shape", "zeros", "shifted"],
)
def test_a_wrong_mean_fails_the_contract_check(broken, message):
    # the contract check compared mean()'s site names only: all three passed the kit
    report = check_family(
        broken, checks=("setup", "fit", "contract", "log_prob"), raise_on_failure=False
    )
    assert report.failures == ["contract"], str(report)
    assert re.search(message, report.results["contract"][1]), report.results["contract"][1]


class RsampleOther(MeanFieldGuide):
    """Broken on purpose: the ELBO's draws (``rsample_with_kl``) come from a q 10 times wider
    than the one ``sample_posterior`` and ``log_prob`` describe (it fits one q, predicts with
    another)."""

    def rsample_with_kl(self, num_samples, model):
        draws, kl = super().rsample_with_kl(num_samples, model)
        mean = super().mean()
        return {s: mean[s] + 10 * (v - mean[s]) for s, v in draws.items()}, kl


class NoKL(MeanFieldGuide):
    """Broken on purpose: the closed-form KL is dropped (0), so the ELBO is a noisy likelihood."""

    def kl_to_prior(self, model):
        return 0.0 * super().kl_to_prior(model)

    def rsample_with_kl(self, num_samples, model):
        draws, kl = super().rsample_with_kl(num_samples, model)
        return draws, 0.0 * kl


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (
            RsampleOther,
            r"site '0\.core' at flat index \d+: rsample_with_kl's 4000 draws have mean "
            r"-?[\d.e-]+ and sd (?P<a>[\d.e-]+) but sample_posterior's have mean -?[\d.e-]+ and "
            r"sd (?P<b>[\d.e-]+) \(tolerances .*\): the fit's draws do not follow q",
        ),
        (
            NoKL,
            r"rsample_with_kl's KL is 0 but the Monte Carlo KL\(q‖p\) = E_q\[log q − log p\] "
            r"over 4000 draws of sample_posterior is (?P<b>[\d.]+) \(standard error .*\): the "
            r"ELBO's KL is not q's to the model's prior",
        ),
    ],
    ids=["rsample-10x-wider", "no-kl"],
)
def test_fitting_draws_or_a_kl_that_are_not_qs_fail_the_rsample_check(broken, message):
    # both passed every check: the fit's draws and KL were never compared with q's
    report = check_family(broken, checks=("setup", "fit", "rsample"), raise_on_failure=False)
    assert report.failures == ["rsample"], str(report)
    detail = report.results["rsample"][1]
    found = re.search(message, detail)
    assert found, detail
    if broken is RsampleOther:  # the two sds named are q's and ten times q's
        ratio = float(found["a"]) / float(found["b"])
        assert 9 < ratio < 11, detail
    else:
        assert float(found["b"]) > 1, detail
    # run with all checks, the failure is reported under its name, the others pass
    with pytest.raises(ConformanceError, match=r"\[FAIL\] rsample"):
        check_family(broken, checks=("setup", "fit", "contract", "log_prob", "rsample"))


def test_the_rsample_check_says_what_it_did_not_check():
    # a point mass has no KL to check, only its draws; a Gaussian with a closed form has both
    point = check_family(pb.guides.DeltaGuide, checks=("setup", "fit", "rsample"))
    assert "KL not checked: a point mass" in point.results["rsample"][1]
    gauss = check_family(MeanFieldGuide, checks=("setup", "fit", "rsample")).results["rsample"]
    assert "rsample_with_kl: means and sds" in gauss[1] and "~ Monte Carlo" in gauss[1]
    empirical = check_family(
        MeanFieldGuide, options={"prior": "empirical"}, checks=("setup", "fit", "rsample")
    )
    assert "KL not checked: prior='empirical'" in empirical.results["rsample"][1]


def test_a_factory_and_the_fits_optimizer_settings():
    # a factory model -> guide is a family too; the fit's optimizer settings reach every fit of
    # the kit and the resumed fitter's checkpoint (which refuses other settings)
    report = check_family(
        lambda model: pb.posterior(model, "ivon", hess_init=0.5),
        optimizer=pb.infer.IVON(beta2=0.999, clip_radius=0.1),
        checks=("setup", "fit", "resume"),
    )
    assert report.passed and list(report.results) == ["setup", "fit", "resume"], str(report)
