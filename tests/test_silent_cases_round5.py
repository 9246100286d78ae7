"""Silent failure cases, round 5: the guide registry, the conformance kit's own arguments and a
learning-rate scheduler that ``fit`` cannot step.

Each test failed before its fix: bad input gave a wrong result (letters registered as aliases,
options ignored, a correct family reported as failing) or a confusing error far from its cause.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest
import torch

import pyrobayes as pb
from pyrobayes.contract import POSTERIOR_METHODS, Posterior
from pyrobayes.guides import MeanFieldGuide
from pyrobayes.registry import _REGISTRY
from pyrobayes.testing import check_family, tiny_problem
from tests.common import conjugate_core, split_batches


class Round5Guide(MeanFieldGuide):
    """A valid guide class of its own (a subclass inheriting ``family = "meanfield"``)."""


@pytest.fixture
def clean_registry() -> Iterator[None]:
    """Remove whatever a test registered."""
    before = dict(_REGISTRY)
    yield
    _REGISTRY.clear()
    _REGISTRY.update(before)


# ------------------------------------------------------------------------------- the registry
def test_aliases_given_as_one_string_are_refused_not_split_into_letters(clean_registry):
    # aliases="abc" registered the names "a", "b" and "c" (a string is a sequence of letters)
    with pytest.raises(TypeError, match=r"aliases must be a tuple of names.*aliases=\('abc',\)"):
        pb.register_guide("round5", Round5Guide, aliases="abc")
    assert not any(cls is Round5Guide for cls in _REGISTRY.values())


def test_a_taken_alias_registers_none_of_the_names(clean_registry):
    # the name was registered before the alias's collision raised: a half-done registration
    with pytest.raises(KeyError, match="'meanfield' is already registered to MeanFieldGuide"):
        pb.register_guide("round5", Round5Guide, aliases=("meanfield",))
    assert "round5" not in _REGISTRY


def test_an_instance_or_a_class_without_the_contract_is_refused_by_method(clean_registry):
    model, _ = tiny_problem()
    # an instance was registered; pb.posterior(model, name) then called it on the model
    with pytest.raises(TypeError, match="must be the guide class, not an instance"):
        pb.register_guide("round5", MeanFieldGuide(model))

    class Partial:
        family = "round5-partial"

        def get_posterior(self, site): ...

        def rsample(self, num_samples=1): ...

    # registered silently; the first use failed on whichever method it needed first
    with pytest.raises(TypeError, match=r"lacks the guide contract's methods \['sample_posterior'"):
        pb.register_guide("round5-partial", Partial)
    assert "round5" not in _REGISTRY and "round5-partial" not in _REGISTRY


def test_a_name_that_is_not_a_string_is_named(clean_registry):
    # was re's "expected string or bytes-like object, got 'NoneType'"
    with pytest.raises(TypeError, match=r"register_guide: expected a lower-case guide name.*None"):
        pb.register_guide(None, Round5Guide)


def test_the_contract_methods_are_the_protocols():
    # what register_guide requires is what the Posterior protocol declares as methods
    declared = {
        name
        for name, value in vars(Posterior).items()
        if inspect.isfunction(value) and not name.startswith("_")
    }
    assert set(POSTERIOR_METHODS) == declared


# ---------------------------------------------------------------------- the conformance kit
_FAST = ("setup", "fit", "contract")


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"epochs": 0}, r"check_family: epochs must be an integer >= 1; got 0"),
        ({"num_draws": 2}, r"check_family: num_draws=2 is too few.*at least 1000"),
        ({"lr": -1.0}, r"check_family: lr must be a finite number > 0"),
    ],
    ids=["no-epochs", "two-draws", "negative-lr"],
)
def test_settings_under_which_a_correct_family_fails_are_refused(setting, message):
    # MeanFieldGuide was reported as failing: "fit: IndexError: list index out of range",
    # "mean() is not the mean of q's draws (standard error nan)", "Expected lr >= 0"
    with pytest.raises(ValueError, match=message):
        check_family(MeanFieldGuide, checks=_FAST, **setting)


@pytest.mark.parametrize(
    ("family", "message"),
    [
        ("meanfield", r"got the name 'meanfield'.*get_guide_class\('meanfield'\)"),
        (None, r"got a NoneType instance \(not callable\)"),
    ],
    ids=["name", "none"],
)
def test_a_family_that_is_not_a_class_or_factory_is_refused(family, message):
    # was a setup failure: "TypeError: 'str' object is not callable"
    with pytest.raises(TypeError, match=message):
        check_family(family, checks=_FAST)


def test_a_built_guide_is_refused_with_its_class_named():
    model, _ = tiny_problem()
    # a guide is an nn.Module, so callable: the kit called guide(model), a setup failure
    # "'dict' object has no attribute 'sites'"
    with pytest.raises(TypeError, match=r"MeanFieldGuide instance \(a built guide\)"):
        check_family(MeanFieldGuide(model), checks=_FAST)


def test_options_with_a_factory_are_refused_not_ignored():
    # the factory is called as family(model): the options were dropped and the kit passed
    with pytest.raises(ValueError, match=r"options=\{'init_scale': 0.5\} go with a guide class"):
        check_family(lambda model: MeanFieldGuide(model), options={"init_scale": 0.5}, checks=_FAST)


def test_a_subclass_inheriting_a_taken_family_name_passes_save_load():
    # the kit registered it under its inherited family "meanfield", MeanFieldGuide's: the
    # save_load and export checks failed with the registry's KeyError, not the family's fault
    report = check_family(Round5Guide, checks=("setup", "fit", "save_load"))
    assert report.passed and "save_load" in report.results, str(report)
    assert not any(cls is Round5Guide for cls in _REGISTRY.values())  # removed after


# ---------------------------------------------------------------------------- the schedule
def test_a_scheduler_stepped_by_a_metric_is_refused_before_the_first_step():
    prob = conjugate_core()
    guide = pb.posterior(prob.model, "map")
    steps: list[int] = []
    # was "ReduceLROnPlateau.step() missing 1 required positional argument: 'metrics'", raised
    # from inside the loop after the first optimizer step had moved the guide
    with pytest.raises(TypeError, match=r"ReduceLROnPlateau, whose step\(\) needs \['metrics'\]"):
        pb.fit(
            prob.model,
            guide,
            split_batches(prob.x, prob.y),
            epochs=1,
            lr=0.05,
            optim=pb.Optimization(
                scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
            ),
            progress=pb.Progress(bar=False, callback=lambda step, loss: steps.append(step)),
        )
    assert steps == []
