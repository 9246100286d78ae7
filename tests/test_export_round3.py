"""Silent cases, round 3, in the ArviZ export and in ``diagnose``'s messages.

* Data that mixed batches with targets and batches without (an unlabelled batch ``(x,)``,
  ``(x, None)`` or a dict without the label key among labelled ones) was exported without its
  ``log_likelihood`` and ``observed_data`` groups, silently: the pointwise log-likelihood must
  cover every example or none, so such data is refused, naming the first batch without
  targets. Data wholly without targets is still exported without those groups, and an INFO
  log says so (as the sites the export summarises by their norm).
* ``diagnose`` named its refusals and warnings ``to_inference_data`` (a never-fitted guide's
  ``NeverFittedWarning``, a guide passed with another model than its own): ``evaluate_draws``
  hard-coded the name. They name ``diagnose``.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import pytest

import pyrobayes as pb
from pyrobayes.fitted_head import NeverFittedWarning
from pyrobayes.testing import tiny_problem

EXPORT_LOGGER = "pyrobayes.diagnostics.export"


def _fitted(seed: int = 0) -> tuple[Any, Any, list[Any]]:
    """The conformance kit's tiny classifier (3 batches of 8), fitted for two epochs."""
    model, data = tiny_problem(seed=seed)
    guide = pb.posterior(model, "meanfield")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny problem's fit notes are not the point
        pb.fit(model, guide, data, epochs=2, seed=0, progress=False)
    return model, guide, data


def _unlabelled(batch: tuple[Any, Any], form: str) -> Any:
    """``batch`` without its targets, in the form named."""
    x, _ = batch
    return {"tuple": (x,), "none": (x, None), "tensor": x}[form]


# ------------------------------------------------- data mixing labelled and unlabelled batches


@pytest.mark.parametrize("form", ["tuple", "none", "tensor"])
def test_an_unlabelled_batch_among_labelled_ones_is_refused_by_the_export(form: str) -> None:
    model, guide, data = _fitted()
    mixed = [data[0], _unlabelled(data[1], form), data[2]]
    with pytest.raises(
        ValueError,
        match=r"to_inference_data: batch 1 of data carries no targets but batch 0 does; .*"
        r"every example or none.*Give every batch its targets",
    ):
        pb.to_inference_data(model, guide, mixed, num_samples=4, seed=0)


def test_labelled_batches_after_an_unlabelled_first_one_name_batch_0() -> None:
    model, guide, data = _fitted()
    mixed = [_unlabelled(data[0], "tuple"), _unlabelled(data[1], "tuple"), data[2]]
    with pytest.raises(ValueError, match=r"batch 0 of data carries no targets but batch 2 does"):
        pb.to_inference_data(model, guide, mixed, num_samples=4, seed=0)


def test_a_dict_batch_without_the_label_key_among_labelled_ones_is_refused() -> None:
    model, guide, data = _fitted()
    # nn.Sequential.forward(input): a dict batch's inputs are passed by name
    labelled = [{"input": x, "labels": y} for x, y in data]
    mixed = [labelled[0], labelled[1], {"input": data[2][0]}]
    pb.to_inference_data(model, guide, labelled, num_samples=4, seed=0)  # every batch labelled
    with pytest.raises(ValueError, match=r"batch 2 of data carries no targets.*'labels'"):
        pb.to_inference_data(model, guide, mixed, num_samples=4, seed=0)


def test_diagnose_names_the_unlabelled_batch_of_mixed_data() -> None:
    model, guide, data = _fitted()
    mixed = [data[0], _unlabelled(data[1], "tuple"), data[2]]
    with pytest.raises(ValueError, match=r"diagnose: batch 1 of data carries no targets"):
        pb.diagnose(model, guide, mixed, num_samples=30, seed=0)


def test_wholly_unlabelled_data_is_exported_without_the_likelihood_groups_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, guide, data = _fitted()
    unlabelled = [_unlabelled(b, "tuple") for b in data]
    with caplog.at_level(logging.INFO, logger=EXPORT_LOGGER):
        idata = pb.to_inference_data(model, guide, unlabelled, num_samples=4, seed=0)
    assert set(idata.groups()) == {"posterior", "posterior_predictive", "sample_stats"}
    assert idata.posterior_predictive["obs"].shape == (1, 4, sum(len(b[0]) for b in data))
    said = [r for r in caplog.records if r.name == EXPORT_LOGGER]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    text = said[0].getMessage()
    assert "to_inference_data: data carries no targets" in text
    assert "log_likelihood" in text and "observed_data" in text and "'labels'" in text
    # labelled data: both groups, and nothing said
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=EXPORT_LOGGER):
        idata = pb.to_inference_data(model, guide, data, num_samples=4, seed=0)
    assert {"log_likelihood", "observed_data"} <= set(idata.groups())
    assert not [r for r in caplog.records if r.name == EXPORT_LOGGER]


# ------------------------------------------------------ diagnose names itself in its messages


def test_diagnose_names_itself_when_the_guide_was_never_fitted() -> None:
    model, data = tiny_problem()
    guide = pb.posterior(model, "meanfield")  # never fitted
    with pytest.warns(NeverFittedWarning) as record:
        pb.diagnose(model, guide, data, num_samples=30, seed=0)
    messages = [str(w.message) for w in record if issubclass(w.category, NeverFittedWarning)]
    assert messages and all(m.startswith("diagnose: ") for m in messages), messages
    # the export keeps its own name
    with pytest.warns(NeverFittedWarning, match=r"^to_inference_data: "):
        pb.to_inference_data(model, guide, data, num_samples=4, seed=0)


def test_diagnose_names_itself_when_the_guide_was_fitted_with_another_model() -> None:
    _, guide, data = _fitted()
    other, _ = tiny_problem()  # rebuilt: its head is untrained, the guide's was trained
    with pytest.raises(ValueError, match=r"^diagnose: the MeanFieldGuide was fitted with another"):
        pb.diagnose(other, guide, data, num_samples=30, seed=0)
    with pytest.raises(ValueError, match=r"^to_inference_data: the MeanFieldGuide was fitted"):
        pb.to_inference_data(other, guide, data, num_samples=4, seed=0)
