"""A guide predicts with the head it was fitted with, or says it does not.

Guides share their model's point-estimated parameters (the head). The post-hoc recipe fits SWAG
from a MAP on the same model, which trains the head; ``pb.load`` writes a file's head into the
model. The other guides on that model then pair their posterior with another head: predict,
save and export warn (:class:`~pyrobayes.fitted_head.HeadChangedWarning`).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import pyrobayes as pb
from pyrobayes.fitted_head import HeadChangedWarning, NeverFittedWarning, changed_heads


def _data() -> tuple[DataLoader, list]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(160, 4, generator=g)
    y = (x @ torch.randn(4, 3, generator=g)).argmax(-1)
    train = DataLoader(TensorDataset(x[:120], y[:120]), batch_size=40, shuffle=True)
    return train, list(DataLoader(TensorDataset(x[120:], y[120:]), batch_size=40))


def _model(seed: int = 0) -> pb.models.FineTuneModel:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    return pb.models.FineTuneModel(
        net,
        adapter=pb.models.LoRAXS(rank=2, target_modules=["0"]),
        likelihood="categorical",
        num_data=120,
        trainable_modules=["2"],
    )


def _fitted_map() -> tuple[pb.models.FineTuneModel, object, DataLoader, list]:
    train, test = _data()
    model = _model()
    guide = pb.posterior(model, "map")
    pb.fit(model, guide, train, epochs=2, lr=1e-2, seed=0)
    return model, guide, train, test


def test_a_head_trained_by_another_fit_is_told_on_predict_and_save(tmp_path) -> None:
    model, map_guide, train, test = _fitted_map()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the guide's own head: silent
        before = pb.predict(model, map_guide, test)
        pb.save(map_guide, tmp_path / "map.safetensors")
    swag = pb.posterior(model, "swag", init=map_guide, rank=2)
    pb.fit(model, swag, train, epochs=2, lr=1e-3, seed=0)  # trains the shared head
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pb.predict(model, swag, test, num_samples=4)  # SWAG's own head: silent
    with pytest.warns(HeadChangedWarning, match=r"predict: .*\['2.bias', '2.weight'\].*DeltaGuide"):
        after = pb.predict(model, map_guide, test)
    assert not torch.equal(after.log_probs, before.log_probs)  # what the warning is about
    with pytest.warns(HeadChangedWarning, match="pb.save"):
        pb.save(map_guide, tmp_path / "map_after.safetensors")
    # the remedy: load the MAP back, which restores its head (and then SWAG's is the stale one)
    restored = pb.load(tmp_path / "map.safetensors", model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = pb.predict(model, restored, test)
    torch.testing.assert_close(again.log_probs, before.log_probs, rtol=0, atol=0)
    assert changed_heads(swag, model) == ["2.bias", "2.weight"]


def test_a_load_of_another_posterior_into_the_model_is_told(tmp_path) -> None:
    model, map_guide, train, test = _fitted_map()
    other = _model(seed=1)
    other_guide = pb.posterior(other, "map")
    pb.fit(other, other_guide, train, epochs=1, lr=1e-2, seed=1)
    pb.save(other_guide, tmp_path / "other.safetensors")
    loaded = pb.load(tmp_path / "other.safetensors", model, check_base=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pb.predict(model, loaded, test)  # the loaded guide sits with the head it brought
    with pytest.warns(HeadChangedWarning, match="pb.load of another posterior"):
        pb.predict(model, map_guide, test)


def test_casts_moves_and_refits_are_not_changes(tmp_path) -> None:
    model, guide, train, test = _fitted_map()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.to(torch.float32)  # a cast (the suite runs in float64): same values to bf16
        model.to(torch.float64)
        with torch.no_grad():  # written in place with the same values
            model.net[2].weight.copy_(model.net[2].weight.clone())
        assert changed_heads(guide, model) == []
        pb.predict(model, guide, test)
        # a refit of the guide itself trains the head: its checkpoints and its result are its own
        pb.fit(
            model,
            guide,
            train,
            epochs=1,
            lr=1e-2,
            seed=0,
            checkpoint=pb.Checkpointing(tmp_path / "ck"),
        )
        pb.predict(model, guide, test)
    with torch.no_grad():
        model.net[2].bias.add_(0.1)  # a hand edit is a change
    assert changed_heads(guide, model) == ["2.bias"]


def test_a_guide_never_fitted_nor_loaded_is_told_on_predict(tmp_path) -> None:
    train, test = _data()
    model = _model()
    guide = pb.posterior(model, "meanfield")  # built, never fitted
    with pytest.warns(NeverFittedWarning, match=r"predict: this .* was never fitted"):
        pb.predict(model, guide, test, num_samples=4)
    with pytest.warns(NeverFittedWarning):  # calibrate predicts: told there too
        pb.calibrate(model, pb.posterior(model, "map"), test)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # the initial values on purpose (a zero-shot baseline): silent; one parameter set is
        # one draw
        one_set = pb.predict(model, guide, test, values=model.init_values())
        one_draw = {s: v[None] for s, v in model.init_values().items()}
        assert torch.equal(
            one_set.log_probs, pb.predict(model, guide, test, values=one_draw).log_probs
        )
        pb.fit(model, guide, train, epochs=1, lr=1e-2, seed=0)
        pb.predict(model, guide, test, num_samples=4)
        pb.save(guide, tmp_path / "mf.safetensors")
        loaded = pb.load(tmp_path / "mf.safetensors", _model())
        pb.predict(loaded.model, loaded, test, num_samples=4)


@pytest.mark.parametrize("family", ["ibdr", "signorm"])
def test_a_mixture_never_fitted_is_told_though_its_members_start_apart(family) -> None:
    # IBDR's particles and σN's members start perturbed away from the model's values, so the
    # "point still at the model's initial values" test missed them: they predicted unfitted in
    # silence. They are compared with the values they were built with instead.
    train, test = _data()
    model = _model()
    with warnings.catch_warnings():  # σN on a model without member norm layers (logged)
        warnings.simplefilter("ignore")
        guide = pb.posterior(model, family)
    with pytest.warns(NeverFittedWarning, match=r"was never fitted .* its initialisation"):
        pb.predict(model, guide, test)
    guide.to(torch.float64).to(torch.float32)  # casts are not a fit: still told
    with pytest.warns(NeverFittedWarning):
        pb.predict(model, guide, test)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # a Pyro SVI step of the user's own moves the particles: not told (no false alarm)
        with torch.no_grad():
            next(guide.parameters()).add_(0.1)
        pb.predict(model, guide, test)


def test_a_fit_of_no_step_says_so_and_leaves_the_guide_unfitted() -> None:
    # epochs=0 (or num_steps=0) on a trained family took no step, said nothing, and marked the
    # guide fitted: predict's never-fitted warning went quiet on a posterior at its start
    train, test = _data()
    model = _model()
    guide = pb.posterior(model, "meanfield")
    with pytest.warns(UserWarning, match=r"no optimizer step was taken \(epochs=0"):
        pb.fit(model, guide, train, epochs=0)
    with pytest.warns(NeverFittedWarning):
        pb.predict(model, guide, test, num_samples=4)
    with pytest.warns(UserWarning, match=r"num_steps=0"):
        pb.fit(model, guide, train, epochs=3, optim=pb.Optimization(num_steps=0))
    # a post-hoc Laplace at a MAP fits at epochs=0: silent, and fitted
    model, map_guide, train, test = _fitted_map()
    laplace = pb.posterior(model, "laplace", init=map_guide)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pb.fit(model, laplace, train, epochs=0)
        pb.predict(model, laplace, test, num_samples=4)
