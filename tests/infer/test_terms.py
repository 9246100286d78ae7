"""The data term and the KL / prior term that fit reports (FitResult.state["terms"], the
progress bar), per training example and without additive constants, so that they compare across
families: for every family they rebuild the optimised loss exactly, and the data term is the
per-example NLL."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import pyrobayes as pb
from pyrobayes.infer.objectives import ELBO, MAP
from pyrobayes.models import LoRAXS
from pyrobayes.registry import _REGISTRY
from tests import families
from tests.common import mlp_problem, tensor_loader


def _problem(family: str | None = None):
    prob = mlp_problem(
        (5, 8, 3),
        LoRAXS(rank=2, target_modules=["0"]),  # family= applies the family's adapter/net
        num_data=48,
        seed=0,
        data_seed=1,
        trainable_modules=["2"],
        prior_scale=0.5,
        family=family,
    )
    return prob.model.double(), prob.x.double(), prob.y


def _prior_constant(guide) -> float:
    """``C = d (log s_p + ½ log 2π)`` over the d latent numbers (prior scale s_p = 0.5)."""
    d = sum(v.numel() for v in guide.mean().values())
    return d * (math.log(0.5) + 0.5 * math.log(2 * math.pi))


#: how each family's reported terms rebuild its optimised loss (N = num_data, C the prior's
#: normalising constant); IVON's loss is the per-example mean NLL itself (its prior and entropy
#: enter through δ and the update), the symmetrized ELBO's the bound L_K.
REBUILD = {
    "map": ({"nll", "prior"}, lambda t, n, c: n * (t["nll"] + t["prior"]) + c),
    "swag": ({"nll", "prior"}, lambda t, n, c: n * (t["nll"] + t["prior"]) + c),
    "laplace": ({"nll", "prior"}, lambda t, n, c: n * (t["nll"] + t["prior"]) + c),
    "meanfield": ({"nll", "kl"}, lambda t, n, c: n * (t["nll"] + t["kl"])),
    "ivon": ({"nll"}, lambda t, n, c: t["nll"]),
    "kron-ivon": ({"nll"}, lambda t, n, c: t["nll"]),
    "signorm": ({"nll", "div"}, lambda t, n, c: n * (t["nll"] + t["div"])),
    "symmetrized": ({"L_K", "elbo", "I_K"}, lambda t, n, c: -t["L_K"]),
}


@pytest.mark.parametrize("family", sorted(REBUILD))
def test_every_familys_terms_rebuild_its_loss(family: str) -> None:
    model, x, y = _problem(family)
    guide = families.posterior(model, family)
    result = pb.fit(model, guide, tensor_loader(x, y, 16), epochs=2, lr=0.05, seed=0)
    keys, rebuild = REBUILD[family]
    terms = result.state["terms"]
    assert set(terms) == keys
    total = rebuild(terms, model.num_data, _prior_constant(guide))
    # float64 throughout: the sums agree to rounding (N·nll ~ 50 nats, C ~ -50: 1e-9 absolute)
    torch.testing.assert_close(total, result.losses.double(), rtol=1e-12, atol=1e-9)
    if "nll" in terms:  # per example: of the order of log 3 for 3 classes, not N log 3
        assert bool((terms["nll"] < 10).all())


def test_every_family_is_covered_or_reports_nothing() -> None:
    # IBDR reports its dual variable through Fitter.report, not loss terms
    assert {cls.family for cls in _REGISTRY.values()} - set(REBUILD) == {"ibdr"}


@pytest.mark.parametrize("family", ["map", "meanfield"])
def test_terms_reproduce_the_loss_and_the_data_term_is_the_nll(family: str) -> None:
    model, x, y = _problem()
    guide = pb.posterior(model, family)
    result = pb.fit(model, guide, tensor_loader(x, y, 16), epochs=2, lr=0.05, seed=0)
    terms = result.state["terms"]
    n = model.num_data
    const = _prior_constant(guide)  # d (log s_p + ½ log 2π)
    if family == "map":
        assert set(terms) == {"nll", "prior"}
        total = n * (terms["nll"] + terms["prior"]) + const
    else:
        assert set(terms) == {"nll", "kl"}
        total = n * (terms["nll"] + terms["kl"])
        assert bool((terms["kl"] > 0).all())
    # N·(nll + kl) (or N·(nll + prior) + C) is the loss of every step, to rounding
    torch.testing.assert_close(total, result.losses.double(), rtol=1e-12, atol=1e-9)

    # the data term against an independent cross-entropy on the same draw
    batch = (x[:16], y[:16])
    objective = MAP() if family == "map" else ELBO()
    torch.manual_seed(5)
    loss = objective.loss(model, guide, batch)
    reported = objective.terms()
    torch.manual_seed(5)
    if family == "map":
        values = {s: v.unsqueeze(0) for s, v in guide.mean().items()}
    else:
        values, _ = guide.rsample_with_kl(1, model)  # ELBO's first draw, same RNG state
    with torch.no_grad():
        logits = model.output(x[:16], {s: v[0] for s, v in values.items()})
    nll = F.cross_entropy(logits, y[:16])  # mean over the 16 examples
    torch.testing.assert_close(reported["nll"], nll.detach(), rtol=1e-12, atol=1e-12)
    if family == "map":  # prior without the constant, per example: ½ Σ (θ/s_p)² / N
        quad = sum(0.5 * (v / 0.5).square().sum() for v in guide.mean().values())
        torch.testing.assert_close(reported["prior"], quad / n, rtol=1e-12, atol=1e-12)
        assert objective.prior_constant == pytest.approx(const, rel=1e-12)
        rebuilt = n * (reported["nll"] + reported["prior"]) + const
    else:
        rebuilt = n * (reported["nll"] + reported["kl"])
    torch.testing.assert_close(rebuilt, loss.detach(), rtol=1e-12, atol=1e-9)


def test_progress_bar_shows_the_terms(capsys) -> None:
    model, x, y = _problem()
    guide = pb.posterior(model, "meanfield")
    pb.fit(model, guide, tensor_loader(x, y, 16), epochs=20, lr=0.05, progress=True)
    err = capsys.readouterr().err
    assert "nll=" in err and "kl=" in err


@pytest.mark.parametrize("family", ["ivon", "kron-ivon"])
def test_ivon_reports_its_data_term(family: str) -> None:
    """IVON's loss is the per-example NLL itself (its prior enters through δ): reported as nll."""
    model, x, y = _problem()
    guide = pb.posterior(model, family)
    result = pb.fit(model, guide, tensor_loader(x, y, 16), epochs=1, lr=0.05, seed=0)
    torch.testing.assert_close(
        result.state["terms"]["nll"], result.losses.double(), rtol=1e-6, atol=0
    )
