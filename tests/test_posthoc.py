"""Post-hoc posteriors from a fitted MAP: ``pb.posterior(model, family, init=map_guide)``."""

from __future__ import annotations

import pytest
import torch

import pyrobayes as pb
from pyrobayes.models import LoRAXS
from tests.common import mlp_problem, tensor_loader

pytest.importorskip("laplace")


def _problem(likelihood: str = "categorical"):
    prob = mlp_problem(
        (5, 8, 8, 3 if likelihood == "categorical" else 1),
        LoRAXS(rank=3, target_modules=["0", "2"]),
        num_data=60,
        seed=3,
        data_seed=4,
        likelihood=likelihood,
        trainable_modules=["4"],
    )
    model = prob.model.double()
    x = prob.x.double()
    y = prob.y if likelihood == "categorical" else prob.y.double()
    return model, tensor_loader(x, y, 20)


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_posthoc_laplace_equals_load_state_dict_route(structure: str) -> None:
    model, loader = _problem()
    map_guide = pb.posterior(model, "map")
    pb.fit(model, map_guide, loader, epochs=5, lr=0.05, seed=0)
    head = {k: p.detach().clone() for k, p in model.point_params.items()}

    # today's route: copy the MAP's state, then fit with no MAP step
    old = pb.posterior(model, "laplace", structure=structure)
    old.load_state_dict(map_guide.state_dict(), strict=False)
    pb.fit(model, old, loader, epochs=0)

    new = pb.posterior(model, "laplace", init=map_guide, structure=structure)
    assert not new.is_fitted
    result = pb.fit(model, new, loader, epochs=0)
    assert result.state["step"] == 0 and new.is_fitted
    for k, p in model.point_params.items():  # no MAP step: the head did not move
        assert torch.equal(p, head[k])
    for s in map_guide.sites:
        assert torch.equal(new.loc(s), map_guide.loc(s))
        torch.testing.assert_close(
            new.posterior_precision(s), old.posterior_precision(s), rtol=0, atol=1e-10
        )
    assert abs(new.prior_precision - old.prior_precision) <= 1e-10 * old.prior_precision
    p_new = pb.predict(model, new, loader, num_samples=4).mean_probs
    p_old = pb.predict(model, old, loader, num_samples=4).mean_probs
    torch.testing.assert_close(p_new, p_old, rtol=0, atol=1e-10)


def test_posthoc_swag_starts_at_the_map() -> None:
    model, loader = _problem()
    map_guide = pb.posterior(model, "map")
    pb.fit(model, map_guide, loader, epochs=5, lr=0.05, seed=0)
    point = {s: v.clone() for s, v in map_guide.mean().items()}
    head = {k: p.detach().clone() for k, p in model.point_params.items()}

    swag = pb.posterior(model, "swag", init=map_guide, rank=2)
    for s in point:  # before any step: exactly the MAP
        assert torch.equal(swag.loc(s), point[s])
    # the same SWAG run from the load_state_dict route, from the same head: identical moments
    ref = pb.posterior(model, "swag", rank=2)
    ref.load_state_dict(map_guide.state_dict(), strict=False)
    pb.fit(model, swag, loader, epochs=3, lr=1e-3, seed=1)
    with torch.no_grad():
        for k, p in model.point_params.items():
            p.copy_(head[k])
    pb.fit(model, ref, loader, epochs=3, lr=1e-3, seed=1)
    assert swag.is_fitted
    torch.testing.assert_close(swag.swag_mean, ref.swag_mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(swag.swag_m2, ref.swag_m2, rtol=0, atol=1e-12)


def test_init_errors() -> None:
    model, loader = _problem()
    map_guide = pb.posterior(model, "map")
    with pytest.raises(TypeError, match="no point to start from"):
        pb.posterior(model, "meanfield", init=map_guide)
    with pytest.raises(TypeError, match="expects a fitted pyrobayes posterior"):
        pb.posterior(model, "laplace", init={"a": 1})
    other = mlp_problem(
        (5, 8, 8, 3), LoRAXS(rank=2, target_modules=["0", "2"]), num_data=60, seed=3
    ).model  # the same site names, cores of another rank
    with pytest.raises(ValueError, match="covers other sites"):
        pb.posterior(other, "laplace", init=map_guide)


def test_deepcopy_leaves_the_original_guide_working() -> None:
    """Pyro's AutoGuide.__getstate__ clears the model on the guide itself: a deep copy used to
    leave the original without its model. The original keeps it; a copy carries its own (the
    copied model when both are copied together)."""
    import copy

    prob = mlp_problem(
        (5, 8, 3), LoRAXS(rank=2, target_modules=["0"]), num_data=40, trainable_modules=["2"]
    )
    model = prob.model
    guide = pb.posterior(model, "meanfield")
    pb.fit(model, guide, tensor_loader(prob.x, prob.y, 20), epochs=1, progress=False)
    alone = copy.deepcopy(guide)
    assert guide.model is model and alone.model is not model
    model2, guide2 = copy.deepcopy((model, guide))
    assert guide.model is model and guide2.model is model2
    for m, g in ((model, guide), (model2, guide2), (alone.model, alone)):
        pb.fit(m, g, tensor_loader(prob.x, prob.y, 20), epochs=1, progress=False)
        assert pb.predict(m, g, [(prob.x, prob.y)], num_samples=2).log_probs.shape == (2, 40, 3)
