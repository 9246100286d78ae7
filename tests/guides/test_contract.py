"""The guide contract, checked for every registered family (new families join automatically)."""

from __future__ import annotations

from typing import cast

import pyro
import pytest
import torch

import pyrobayes as pb
from pyrobayes.contract import LinearizedPredictive, Mixture, implements
from pyrobayes.models import FineTuneModel, LoRAXS
from pyrobayes.registry import _REGISTRY
from tests import families
from tests.common import mlp, mlp_problem, split_batches

FAMILIES = sorted({cls.family for cls in _REGISTRY.values()})


def _problem(family: str, seed: int = 0):
    prob = mlp_problem(
        (5, 12, 12, 3),
        LoRAXS(rank=3, target_modules=["0", "2"]),
        num_data=48,
        trainable_modules=["4"],
        seed=seed,
        data_seed=seed,
        family=family,
    )
    return prob.model, split_batches(prob.x, prob.y, 16)


def _fitted(family: str, seed: int = 0):
    model, data = _problem(family, seed)
    guide = families.posterior(model, family)
    pb.fit(model, guide, data, epochs=4, lr=1e-2, seed=seed)
    return model, guide, data


@pytest.fixture(scope="module", params=FAMILIES)
def fitted(request):
    pyro.clear_param_store()
    return (request.param, *_fitted(request.param))


def test_registry_names_resolve(fitted):
    family, model, guide, _ = fitted
    assert type(guide) is pb.registry.get_guide_class(family)
    assert pb.registry.family_of(guide) == family
    assert family in pb.available_guides()


def test_sample_shapes_and_sites(fitted):
    _, model, guide, _ = fitted
    draws = guide.sample_posterior(7, generator=torch.Generator().manual_seed(0))
    assert set(draws) == set(model.latent_sites) == set(guide.sites)
    for site, spec in model.latent_sites.items():
        assert draws[site].shape == (7, *spec.shape)
        assert torch.isfinite(draws[site]).all()


def test_same_generator_same_draws(fitted):
    _, _, guide, _ = fitted
    a = guide.sample_posterior(5, generator=torch.Generator().manual_seed(3))
    b = guide.sample_posterior(5, generator=torch.Generator().manual_seed(3))
    c = guide.sample_posterior(5, generator=torch.Generator().manual_seed(4))
    assert all(torch.equal(a[s], b[s]) for s in a)
    if not guide.is_deterministic:
        assert not all(torch.equal(a[s], c[s]) for s in a)


def test_log_prob_and_mean(fitted):
    _, _, guide, _ = fitted
    draws = guide.sample_posterior(4, generator=torch.Generator().manual_seed(0))
    log_q = guide.log_prob(draws)
    assert log_q.shape == (4,) and torch.isfinite(log_q).all()
    mean = guide.mean()
    assert set(mean) == set(guide.sites)


def test_save_load_round_trip(fitted, tmp_path):
    family, model, guide, data = fitted
    path = pb.save(guide, tmp_path / "posterior.safetensors")
    header = pb.io.read_header(path)
    assert header["family"] == family and set(header["sites"]) == set(guide.sites)
    # the same pretrained network, with its head moved: loading restores the fitted head too
    fresh_model, _ = _problem(family, seed=0)
    with torch.no_grad():
        for p in fresh_model.point_params.values():
            p.add_(1.0)
    loaded = pb.load(path, fresh_model)
    assert type(loaded) is type(guide)
    for name, p in model.point_params.items():
        assert torch.equal(fresh_model.point_params[name], p)
    a = guide.sample_posterior(6, generator=torch.Generator().manual_seed(11))
    b = loaded.sample_posterior(6, generator=torch.Generator().manual_seed(11))
    for s in a:
        torch.testing.assert_close(a[s], b[s], rtol=0, atol=0)
    pa = pb.predict(model, guide, data, num_samples=4, seed=2)
    pb_ = pb.predict(fresh_model, loaded, data, num_samples=4, seed=2)
    torch.testing.assert_close(pa.log_probs, pb_.log_probs, rtol=0, atol=0)


def test_pyro_predictive_runs_with_guide(fitted):
    _, model, guide, data = fitted
    x, _ = data[0]
    samples = pyro.infer.Predictive(model, guide=guide, num_samples=3)((x, None))
    assert samples["obs"].shape == (3, 16)
    for site, spec in model.latent_sites.items():
        assert samples[site].reshape(3, *spec.shape).shape == (3, *spec.shape)


def test_predict_shapes_and_probabilities(fitted):
    _, model, guide, data = fitted
    pred = pb.predict(model, guide, data, num_samples=5)
    expected_s = 1 if guide.is_deterministic else 5
    if implements(guide, Mixture):  # rounded up to a multiple of K: equal component weights
        k = cast(Mixture, guide).num_components
        expected_s = -(-5 // k) * k
    if implements(guide, LinearizedPredictive):  # the GLM Monte Carlo draws its own number
        linearized = cast(LinearizedPredictive, guide)
        if linearized.pred_type == "glm" and linearized.link_samples is not None:
            expected_s = linearized.link_samples
    assert pred.log_probs.shape == (expected_s, 48, 3)
    torch.testing.assert_close(pred.probs.sum(-1), torch.ones(expected_s, 48))
    assert pred.targets.shape == (48,)


def test_load_rejects_other_sites(fitted, tmp_path):
    _, _, guide, _ = fitted
    path = pb.save(guide, tmp_path / "p.safetensors")
    other = FineTuneModel(mlp(5, 12, 3), LoRAXS(rank=3, target_modules=["0"]), num_data=10)
    with pytest.raises(RuntimeError, match="different sites"):
        pb.load(path, other)
