"""pb.fit at the edges of a guide's life: a refused fit leaves the guide (its fitted state and
its calibrated temperature) as it was, a resume refuses what it would silently not honour
(another objective, scheduler, validation set or a shorter budget) and names the right thing
first, and fit's arguments given as NumPy or tensor integers, an empty or file checkpoint
folder, a guide on the plain network and a one-shot validation iterator are handled up front."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyro
import pytest
import torch

import pyrobayes as pb
from pyrobayes.calibration import temperature
from pyrobayes.infer.checkpoint import latest
from pyrobayes.testing import tiny_problem
from tests.infer.lifecycle import Kill, killer, quiet_fit, same_state, state


def _interrupted(folder: Path, family: str = "map", *, epochs: int = 3, at: int = 4, **kw):
    """A checkpointed fit of ``family`` killed after step ``at`` (a checkpoint at every step)."""
    model, data = tiny_problem()
    guide = pb.posterior(model, family)
    progress = pb.Progress(bar=False, callback=killer(at))
    with pytest.raises(Kill), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pb.fit(
            model,
            guide,
            data,
            epochs=epochs,
            seed=0,
            checkpoint=pb.Checkpointing(folder, every=1),
            progress=progress,
            **kw,
        )
    return model, guide, data


def _resume(folder: Path, family: str = "map", *, epochs: int = 3, **kw) -> pb.FitResult:
    """A fresh guide of ``family`` resumed from ``folder``."""
    model, data = tiny_problem()
    guide = pb.posterior(model, family)
    checkpoint = pb.Checkpointing(folder, resume=True)
    kw.setdefault("progress", False)
    return pb.fit(model, guide, data, epochs=epochs, seed=0, checkpoint=checkpoint, **kw)


def _calibrate(model: Any, guide: Any) -> float:
    """Calibrate ``guide`` on held-out data (a temperature at its bound warns: not the point)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pb.calibrate(model, guide, _held_out())
    return temperature(guide)


def _held_out() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(40, 4, generator=g), torch.randint(0, 3, (40,), generator=g))]


# ---------------------------------------------------------------- 1. a refused fit changes nothing
def test_a_refused_fit_leaves_a_fitted_laplace_guide_and_its_temperature():
    """Laplace refuses a one-shot iterator (its curvature pass reads the data again), but only
    after the fitter had begun: the refused fit reset the fitted curvature and dropped the
    calibrated temperature."""
    model, data = tiny_problem()
    guide = pb.posterior(model, "laplace")
    quiet_fit(model, guide, data, epochs=2, seed=0)
    t_before = _calibrate(model, guide)
    before = state(guide)
    assert t_before != 1.0 and guide.is_fitted
    with pytest.raises(ValueError, match="one-shot iterator"):
        pb.fit(model, guide, iter(data), epochs=1)
    assert guide.is_fitted
    assert same_state(guide, before)
    assert temperature(guide) == t_before


def test_a_laplace_fit_refused_by_its_own_settings_leaves_the_fitted_curvature():
    """Laplace(prior_optimization="validation") without validation data is refused in the
    fitter's begin, which reset the guide before it checked."""
    model, data = tiny_problem()
    guide = pb.posterior(model, "laplace")
    quiet_fit(model, guide, data, epochs=2, seed=0)
    before = state(guide)
    assert guide.is_fitted
    settings = pb.infer.Laplace(prior_optimization="validation")
    with pytest.raises(ValueError, match="held-out data"):
        pb.fit(model, guide, data, epochs=1, optim=pb.Optimization(optimizer=settings))
    assert guide.is_fitted
    assert same_state(guide, before)


def test_a_refused_resume_leaves_a_fitted_swag_guide_and_its_temperature(tmp_path):
    """A resume refused for another rate ran after the fitter had begun (SWAG's moments reset)
    and after make_fitter had dropped the temperature."""
    _interrupted(tmp_path, "swag")
    model, data = tiny_problem()
    guide = pb.posterior(model, "swag")
    quiet_fit(model, guide, data, epochs=4, seed=0)
    t_before = _calibrate(model, guide)
    before = state(guide)
    collected = int(guide.swag_num_collected)
    assert collected > 0 and t_before != 1.0
    with pytest.raises(ValueError, match=r"lr=0\.01"):
        pb.fit(
            model,
            guide,
            data,
            epochs=3,
            lr=0.05,
            seed=0,
            checkpoint=pb.Checkpointing(tmp_path, resume=True),
        )
    assert int(guide.swag_num_collected) == collected and guide.is_fitted
    assert same_state(guide, before)
    assert temperature(guide) == t_before


def test_a_fit_of_no_step_keeps_the_temperature_as_its_warning_says():
    model, data = tiny_problem()
    guide = pb.posterior(model, "map")
    quiet_fit(model, guide, data, epochs=3, seed=0)
    t_before = _calibrate(model, guide)
    with pytest.warns(UserWarning, match="no optimizer step was taken") as record:
        pb.fit(model, guide, data, epochs=0)
    assert not any("temperature is removed" in str(w.message) for w in record)
    assert temperature(guide) == t_before
    with pytest.warns(UserWarning, match="temperature is removed"):  # a fit that steps drops it
        pb.fit(model, guide, data, epochs=1, progress=False)
    assert temperature(guide) == 1.0


# ---------------------------------------------------------------- 2. another objective
@pytest.mark.parametrize(
    "loss,named",
    [
        ("map", r"another objective \(\"pyrobayes\.infer\.objectives\.ELBO\" then, .*MAP\" now"),
        (pyro.infer.Trace_ELBO(num_particles=4), r"another objective .*Trace_ELBO\" now"),
        (pb.infer.ELBO(num_particles=8), r"objective setting 'num_particles' \(1 then, 8 now"),
        (pb.infer.ELBO(kl_weight=0.1), r"objective setting 'kl_weight' \(1\.0 then, 0\.1 now"),
    ],
)
def test_resume_refuses_another_objective_naming_both(tmp_path, loss, named):
    _interrupted(tmp_path, "meanfield")
    with pytest.raises(ValueError, match=named):
        _resume(tmp_path, "meanfield", optim=pb.Optimization(loss=loss))
    # the family's objective spelled out is the same objective: resumed
    result = _resume(tmp_path, "meanfield", optim=pb.Optimization(loss=pb.infer.ELBO()))
    assert result.state["step"] == 9


# ---------------------------------------------------------------- 3. other validation examples
def test_resume_refuses_other_validation_examples_with_the_same_targets(tmp_path):
    """The fingerprint hashed the sorted targets only: another split with the same class
    counts resumed, its scores compared with the history of the first split."""
    g = torch.Generator().manual_seed(7)
    xa, xb = torch.randn(30, 4, generator=g), torch.randn(30, 4, generator=g)
    ya = torch.arange(30) % 3
    yb = ya[torch.randperm(30, generator=g)]  # the same class counts, other examples
    val_a = [(xa[:15], ya[:15]), (xa[15:], ya[15:])]
    val_b = [(xb[:15], yb[:15]), (xb[15:], yb[15:])]
    _interrupted(tmp_path, epochs=4, at=7, validation=pb.Validation(val_a))
    with pytest.raises(ValueError, match="validation data differ .* examples sha256"):
        _resume(tmp_path, epochs=4, validation=pb.Validation(val_b))
    # the same examples batched and ordered otherwise are the same data
    perm = torch.randperm(30, generator=g)
    again = [(xa[perm[:10]], ya[perm[:10]]), (xa[perm[10:]], ya[perm[10:]])]
    result = _resume(tmp_path, epochs=4, validation=pb.Validation(again))
    assert [h["epoch"] for h in result.state["validation"]] == [0, 1, 2, 3]


def test_a_fingerprint_written_before_the_examples_hash_compares_what_it_has(tmp_path):
    g = torch.Generator().manual_seed(7)
    xa, xb = torch.randn(30, 4, generator=g), torch.randn(30, 4, generator=g)
    y = torch.arange(30) % 3
    _interrupted(tmp_path, epochs=4, at=7, validation=pb.Validation([(xa, y)]))
    state = latest(tmp_path) / "state.json"
    meta = json.loads(state.read_text())
    del meta["validation_data"]["examples_sha256"]  # as an earlier release wrote it
    state.write_text(json.dumps(meta))
    result = _resume(tmp_path, epochs=4, validation=pb.Validation([(xb, y)]))
    assert result.state["epoch"] == 4


# ---------------------------------------------------------------- 4. a shorter budget
@pytest.mark.parametrize(
    "budget,named",
    [
        ({"epochs": 2}, r"fit\(epochs=2\): .* at step 9 \(epoch 3, batch 0\) .*epochs=4\)"),
        (
            {"epochs": None, "optim": pb.Optimization(num_steps=5)},
            r"fit\(optim=Optimization\(num_steps=5\)\): .*its budget: epochs=4\)",
        ),
    ],
)
def test_resume_refuses_a_budget_below_the_checkpoint(tmp_path, budget, named):
    """A checkpoint at step 9 (3 batches an epoch) resumed with a budget of 6 (or 5) steps
    took no step and returned the 9-step state as the shorter run's."""
    _interrupted(tmp_path, epochs=4, at=10)
    with pytest.raises(ValueError, match=named):
        _resume(tmp_path, **budget)
    assert _resume(tmp_path, epochs=4).state["step"] == 12  # the run's own budget goes on
    assert _resume(tmp_path, epochs=4).state["step"] == 12  # and a finished run is returned


# ---------------------------------------------------------------- 5. another scheduler factory
def _scheduler(kind: type, **settings: Any):
    """A factory ``optimizer -> kind(optimizer, **settings)``: every one named alike."""
    return lambda opt: kind(opt, **settings)


def _step_lr(gamma: float):
    return _scheduler(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=gamma)


def _exp_lr(gamma: float):
    return _scheduler(torch.optim.lr_scheduler.ExponentialLR, gamma=gamma)


@pytest.mark.parametrize(
    "factory,named",
    [
        (_step_lr(0.1), r"learning-rate scheduler setting 'gamma' \(0\.5 then, 0\.1 now\)"),
        (_exp_lr(0.5), r"learning-rate scheduler \(\"torch\.optim\.lr_scheduler\.StepLR\" then"),
    ],
)
def test_resume_refuses_another_scheduler_factory(tmp_path, factory, named):
    """Both factories were recorded by name alone ('<lambda>'): the checkpoint's StepLR state
    then ran on under another gamma or class without a word."""
    _interrupted(tmp_path, optim=pb.Optimization(scheduler=_step_lr(0.5)))
    with pytest.raises(ValueError, match=named):
        _resume(tmp_path, optim=pb.Optimization(scheduler=factory))
    result = _resume(tmp_path, optim=pb.Optimization(scheduler=_step_lr(0.5)))
    assert result.state["step"] == 9


# ---------------------------------------------------------------- 6. NumPy and tensor integers
def test_numpy_and_tensor_integers_are_taken_as_the_ints_they_are(tmp_path):
    """check_int accepted them, but the originals went on: Pyro's seeding refused a NumPy
    seed, the checkpoint's JSON a NumPy epochs, the schedule's rounding a tensor."""

    def run(**kw: Any) -> torch.Tensor:
        model, data = tiny_problem()
        guide = pb.posterior(model, "ivon")
        return quiet_fit(model, guide, data, progress=False, **kw).losses

    expected = run(epochs=2, seed=3)
    assert torch.equal(run(epochs=2, seed=np.int64(3)), expected)
    assert torch.equal(
        run(epochs=np.int64(2), seed=3, checkpoint=pb.Checkpointing(tmp_path)), expected
    )
    assert torch.equal(run(epochs=torch.tensor(2), seed=3), expected)
    steps = run(epochs=None, seed=3, optim=pb.Optimization(num_steps=np.int64(4)))
    assert len(steps) == 4
    optim = pb.Optimization(num_steps=np.int64(4), warmup=np.int64(1))
    assert type(optim.num_steps) is int and type(optim.warmup) is int
    assert type(pb.Checkpointing(tmp_path, every=np.int64(2)).every) is int
    assert type(pb.Validation([], patience=np.int64(2)).patience) is int


# ---------------------------------------------------------------- 7. what a resume names first
def test_resume_with_a_guide_of_another_family_names_the_family_first(tmp_path):
    """The IVON guide's default rate and schedule differ from mean-field's: the resume named
    the rate, then the schedule, and the family only once both were matched."""
    _interrupted(tmp_path, "meanfield")
    with pytest.raises(pb.io.PosteriorMismatchError, match="holds a 'meanfield' posterior"):
        _resume(tmp_path, "ivon")


def test_resume_with_an_optimizer_factory_words_the_rate_for_the_optimizer(tmp_path):
    """The rate came from the factory, but the message said to resume with fit(lr=0.1): then
    unused beside the factory, and refused again with the same advice."""

    def sgd(lr: float):
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)

    _interrupted(tmp_path, optim=pb.Optimization(optimizer=sgd(0.1)))
    with pytest.raises(ValueError, match=r"build that optimizer with lr=0\.1") as info:
        _resume(tmp_path, optim=pb.Optimization(optimizer=sgd(0.5)))
    assert "Resume with lr=" not in str(info.value)
    assert _resume(tmp_path, optim=pb.Optimization(optimizer=sgd(0.1))).state["step"] == 9


# ---------------------------------------------------------------- 8. the checkpoint folder
def test_an_empty_checkpoint_folder_or_a_file_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"Checkpointing\(\): dir='' is empty"):
        pb.Checkpointing("")
    with pytest.raises(ValueError, match="is empty"):
        pb.Checkpointing(" ")
    assert not list(tmp_path.iterdir())
    file = tmp_path / "afile"
    file.write_text("x")
    model, data = tiny_problem()
    guide = pb.posterior(model, "map")
    for folder, where in ((file, "is a file"), (file / "run", f"lies below the file {file}")):
        with pytest.raises(NotADirectoryError, match=rf"Checkpointing\(dir=.*{where}"):
            pb.fit(model, guide, data, epochs=1, checkpoint=pb.Checkpointing(folder))
    assert file.read_text() == "x"


# ---------------------------------------------------------------- 9. the model and the data
def test_a_guide_built_on_the_plain_network_is_refused_clearly():
    """A guide class built on the network (a guide with no sites: pb.guides.MeanFieldGuide(net),
    or pb.posterior(net, ...) before it refused one) failed in its fit inside torch
    ("linear(): argument 'input' must be Tensor, not tuple")."""
    model, data = tiny_problem()
    guide = pb.guides.MeanFieldGuide(model.net)
    with pytest.raises(TypeError, match=r"plain torch network \(Sequential\).*FineTuneModel"):
        pb.fit(model.net, guide, data, epochs=1)
    with pytest.raises(ValueError, match="built on another model"):
        pb.fit(model, guide, data, epochs=1)


def test_a_one_shot_validation_iterator_is_refused_before_training():
    """It was refused only after two epochs had trained, as data that "yielded no batches"."""
    model, data = tiny_problem()
    guide = pb.posterior(model, "map")
    steps: list[int] = []
    progress = pb.Progress(bar=False, callback=lambda step, loss: steps.append(step))
    with pytest.raises(ValueError, match=r"validation data is a one-shot iterator.*3 epochs"):
        pb.fit(
            model,
            guide,
            data,
            epochs=3,
            validation=pb.Validation(iter(_held_out())),
            progress=progress,
        )
    assert steps == []
    # one epoch reads it once
    pb.fit(
        model, guide, data, epochs=1, validation=pb.Validation(iter(_held_out())), progress=False
    )
