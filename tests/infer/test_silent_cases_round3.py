"""Silent cases, round 3: a Laplace fit refused by its own settings keeps a calibrated
temperature (and the fitted head's record); a Laplace posterior whose precision H + τ I is not
finite is refused by site, with the remedy, instead of torch's dump of the tensor; a resume from
a checkpoint written for another adapter rank or guide shape is refused before the fitter's
``begin`` resets the guide."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import pyrobayes as pb
from pyrobayes.calibration import temperature
from pyrobayes.fitted_head import _ATTRIBUTE
from pyrobayes.infer.glm import glm_moments
from pyrobayes.io import PosteriorMismatchError
from pyrobayes.models import LoRAXS
from pyrobayes.testing import tiny_problem
from tests.infer.lifecycle import Kill, quiet_fit, same_state, state


def _calibrate(model: Any, guide: Any) -> float:
    """Calibrate ``guide`` on held-out data (a temperature at its bound warns: not the point)."""
    g = torch.Generator().manual_seed(3)
    held_out = [(torch.randn(40, 4, generator=g), torch.randint(0, 3, (40,), generator=g))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pb.calibrate(model, guide, held_out)
    return temperature(guide)


# ---------------------------------------------------------------- 1. a refused Laplace begin
def test_a_laplace_fit_refused_by_its_settings_keeps_the_calibrated_temperature():
    """LaplaceFitter.begin refuses prior_optimization="validation" without validation data
    (before its reset), but the loop had dropped the held temperature (with its warning) and
    forgotten the fitted head's record just before begin: the refused fit lost both."""
    model, data = tiny_problem()
    guide = pb.posterior(model, "laplace")
    quiet_fit(model, guide, data, epochs=2, seed=0)
    t_before = _calibrate(model, guide)
    before, head = state(guide), getattr(guide, _ATTRIBUTE)
    assert t_before != 1.0 and guide.is_fitted and head is not None
    settings = pb.infer.Laplace(prior_optimization="validation")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="held-out data"):
            pb.fit(model, guide, data, epochs=1, optim=pb.Optimization(optimizer=settings))
    assert not any("temperature is removed" in str(w.message) for w in record)
    assert temperature(guide) == t_before
    assert guide.is_fitted and same_state(guide, before)
    assert getattr(guide, _ATTRIBUTE) is head


# ---------------------------------------------------------------- 2. a non-finite H + τ I
def _fitted_laplace(structure: str) -> tuple[Any, Any, list[Any]]:
    model, data = tiny_problem()
    guide = pb.posterior(model, "laplace", structure=structure)
    quiet_fit(model, guide, data, epochs=0)
    return model, guide, data


@pytest.mark.parametrize("pred_type", ["glm", "probit"])
@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_a_non_finite_curvature_is_refused_by_site_under_the_linearised_predictive(
    structure, pred_type
):
    """A NaN in a fitted curvature: "glm" raised torch's "Expected parameter precision_eig ...
    but found invalid values: tensor([[nan, ...]])", "probit" blamed the MAP ("a diverged fit
    ... guide.mean()"), whose values are fine."""
    model, guide, data = _fitted_laplace(structure)
    guide.pred_type = pred_type
    with torch.no_grad():
        guide.curvature("2.core").view(-1)[1] = float("nan")
    with pytest.raises(FloatingPointError) as caught:
        pb.predict(model, guide, data)
    message = str(caught.value)
    assert "site '2.core': its curvature holds 1 of 4 values NaN or inf" in message
    assert "pyrobayes.fit(model, guide, data, epochs=0)" in message
    assert "prior_precision=" in message and "tensor(" not in message
    assert "'0.core'" not in message  # the finite site is not blamed


def test_a_non_finite_prior_precision_is_named_by_glm_moments_and_predict():
    model, guide, data = _fitted_laplace("kron")
    with torch.no_grad():
        guide.lap_prior_precision.fill_(float("inf"))
    named = r"site '0\.core': its prior precision τ is inf, not a finite number > 0"
    with pytest.raises(FloatingPointError, match=named) as caught:
        pb.predict(model, guide, data)
    assert "tensor(" not in str(caught.value)
    with pytest.raises(FloatingPointError, match="glm_moments: .*" + named):
        glm_moments(model, guide, data[0][0])


# ---------------------------------------------------------------- 3. an incompatible resume
def _interrupted(folder: Path, family: str, **options: Any) -> None:
    """A checkpointed fit killed after step 4, its model built with a rank-3 adapter
    (``options`` empty) or its guide with ``options``."""

    def killer(step: int, loss: float) -> None:
        if step == 4:
            raise Kill

    rank3 = None if options else (lambda _: LoRAXS(rank=3, target_modules=["0", "2"]))
    model, data = tiny_problem(adapter=rank3)
    guide = pb.posterior(model, family, **options)
    with pytest.raises(Kill):
        quiet_fit(
            model,
            guide,
            data,
            epochs=3,
            seed=0,
            checkpoint=pb.Checkpointing(folder, every=1),
            progress=pb.Progress(bar=False, callback=killer),
        )


def _resume(model: Any, guide: Any, data: Any, folder: Path) -> None:
    """``pb.fit`` resuming from the checkpoints in ``folder``."""
    pb.fit(
        model,
        guide,
        data,
        epochs=3,
        seed=0,
        checkpoint=pb.Checkpointing(folder, resume=True),
        progress=False,
    )


@pytest.mark.parametrize(
    "family,options,named",
    [
        ("swag", {}, r"site '0\.core' has shape \[3, 3\] in the file but \[2, 2\]"),
        ("laplace", {}, r"site '0\.core' has shape \[3, 3\] in the file but \[2, 2\]"),
        ("laplace", {"structure": "diag"}, "structure='diag' in the file but structure='kron'"),
    ],
)
def test_a_resume_from_another_adapter_rank_or_guide_shape_leaves_the_fitted_guide(
    tmp_path, family, options, named
):
    """The checkpoint's posterior was checked by io.load_state only after the fitter's begin
    had reset the guide (SWAG's moments, Laplace's fitted flag) and the temperature was
    dropped: the refused resume left the fitted guide unfitted."""
    _interrupted(tmp_path, family, **options)
    model, data = tiny_problem()
    guide = pb.posterior(model, family)
    quiet_fit(model, guide, data, epochs=4, seed=0)
    t_before = _calibrate(model, guide)
    before = state(guide)
    assert guide.is_fitted and t_before != 1.0
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(PosteriorMismatchError, match=named):
            _resume(model, guide, data, tmp_path)
    assert guide.is_fitted and same_state(guide, before)
    assert temperature(guide) == t_before
    assert not any("temperature is removed" in str(w.message) for w in record)


def test_a_resume_onto_another_base_network_is_refused_before_the_guide_changes(tmp_path):
    """The base-weight fingerprint is compared before the fitter's begin (check_posterior),
    and only there: the resume's load skips the second pass over the frozen weights."""

    def killer(step: int, loss: float) -> None:
        if step == 4:
            raise Kill

    def shifted(net: torch.nn.Module) -> torch.nn.Module:
        with torch.no_grad():
            net[2].weight.add_(0.01)  # the same shapes, another frozen base under "2"
        return net

    model, data = tiny_problem(net=shifted)
    with pytest.raises(Kill):
        quiet_fit(
            model,
            pb.posterior(model, "swag"),
            data,
            epochs=3,
            seed=0,
            checkpoint=pb.Checkpointing(tmp_path, every=1),
            progress=pb.Progress(bar=False, callback=killer),
        )
    model, data = tiny_problem()
    guide = pb.posterior(model, "swag")
    quiet_fit(model, guide, data, epochs=4, seed=0)
    before = state(guide)
    with pytest.raises(PosteriorMismatchError, match="fitted on another base model"):
        _resume(model, guide, data, tmp_path)
    assert guide.is_fitted and same_state(guide, before)
