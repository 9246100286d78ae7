"""Round 4 of silent cases in the metrics and the diagnostics.

* ``diagnose`` of wholly unlabelled data (batches ``x``, ``(x,)``, ``(x, None)`` or dicts
  without the label key) evaluated every draw over every batch, then said only "diagnose needs
  targets in the data (the log joint needs y)". It is refused before any draw, naming
  ``data``, why labels are needed, the batch forms that carry them, and
  ``pyrobayes.predict`` for unlabelled inputs.
* Regression means holding ±inf gave an infinite RMSE and, silently, a finite NLL (the
  Gaussian mixture left the draw at inf out); means of no examples gave ``{"rmse": nan}``.
  Both are refused, naming the examples.
* Class labels given as floats, booleans, one-hot rows or ``(N, 1)`` were refused without
  saying how to pass them; ``auroc``'s "scores contain NaN" and "labels must be 0 or 1" named
  neither the function, the examples nor the fix (nor, through ``ood_auroc``, which set).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

import pyrobayes as pb
from pyrobayes import metrics
from pyrobayes.diagnostics import khat
from pyrobayes.testing import tiny_problem


def _fitted() -> tuple[Any, Any, list[Any]]:
    """The conformance kit's tiny classifier (3 batches of 8), fitted for one epoch."""
    model, data = tiny_problem(seed=0)
    guide = pb.posterior(model, "meanfield")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny problem's fit notes are not the point
        pb.fit(model, guide, data, epochs=1, seed=0, progress=False)
    return model, guide, data


# --------------------------------------------------------------- diagnose of unlabelled data


@pytest.mark.parametrize("form", ["tensor", "tuple", "none", "dict"])
def test_diagnose_of_unlabelled_data_says_it_needs_labels_before_any_draw(
    form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, guide, data = _fitted()
    unlabelled = [
        {"tensor": x, "tuple": (x,), "none": (x, None), "dict": {"input": x}}[form] for x, _ in data
    ]

    def no_draws(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the draws were evaluated on data diagnose must refuse")

    monkeypatch.setattr(khat, "evaluate_draws", no_draws)
    with pytest.raises(ValueError) as info:
        pb.diagnose(model, guide, unlabelled, num_samples=20, seed=0)
    message = str(info.value)
    for words in ("diagnose: `data` carries no targets", "needs labels", "(x, y)", "'labels'"):
        assert words in message, message
    assert "pyrobayes.predict(model, guide, data)" in message, message


def test_diagnose_of_a_one_shot_iterator_of_labelled_batches_still_runs() -> None:
    """The first batch is read to check for targets; a generator is kept whole for the draws."""
    model, guide, data = _fitted()
    result = pb.diagnose(model, guide, (b for b in data), num_samples=20, seed=0)
    assert result.num_examples == sum(len(x) for x, _ in data)
    assert math.isfinite(result.elbo)


# ------------------------------------------------------------------ regression means not finite


@pytest.mark.parametrize("value", [math.inf, -math.inf])
def test_regression_means_at_inf_are_refused_naming_the_examples(value: float) -> None:
    means = torch.zeros(4, 6)
    means[1, 3] = value  # one draw of example 3 diverged
    targets = torch.zeros(6)
    for call in (
        lambda: metrics.gaussian_nll(means, targets, 1.0),  # was finite (the draw left out)
        lambda: metrics.gaussian_rmse(means, targets),  # was inf
        lambda: metrics.regression_report(means[..., None], targets, 1.0),
    ):
        with pytest.raises(ValueError, match=r"means holds inf at examples \[3\] \(of 6\)"):
            call()


def test_regression_metrics_of_no_examples_are_refused_not_nan() -> None:
    for call in (
        lambda: metrics.regression_report(torch.zeros(4, 0), torch.zeros(0)),  # was rmse nan
        lambda: metrics.gaussian_rmse(torch.zeros(4, 0), torch.zeros(0)),
    ):
        with pytest.raises(ValueError, match=r"regression metric .* needs at least one example"):
            call()


# --------------------------------------------------------------- class labels in another form


PROBS = torch.tensor([[0.7, 0.3], [0.2, 0.8], [0.4, 0.6]])
LABELS = torch.tensor([0, 1, 1])


@pytest.mark.parametrize(
    ("labels", "error", "fix"),
    [
        (LABELS.float(), TypeError, "labels.long()"),
        (torch.nn.functional.one_hot(LABELS, 2), ValueError, "labels.argmax(-1)"),
        (torch.nn.functional.one_hot(LABELS, 2).float(), ValueError, "labels.argmax(-1)"),
        (LABELS[:, None], ValueError, "labels.squeeze(-1)"),
    ],
    ids=["float", "one-hot", "soft", "column"],
)
def test_labels_in_another_form_are_refused_saying_how_to_pass_them(
    labels: torch.Tensor, error: type, fix: str
) -> None:
    for call in (metrics.nll, metrics.accuracy, metrics.ece, metrics.brier_score, metrics.report):
        with pytest.raises(error) as info:
            call(PROBS, labels)
        assert fix in str(info.value), str(info.value)


def test_integer_labels_of_any_width_are_still_taken() -> None:
    expected = metrics.nll(PROBS, LABELS)
    for dtype in (torch.int32, torch.uint8, torch.int16):
        assert metrics.nll(PROBS, LABELS.to(dtype)) == pytest.approx(expected)


def test_boolean_labels_are_classes_0_and_1_as_the_fit_takes_them() -> None:
    """A fit takes bool labels as classes 0 and 1 (the categorical likelihood), and
    ``pred.targets`` keeps their dtype: ``report(pred, pred.targets)`` refused them."""
    for call in (metrics.nll, metrics.accuracy, metrics.ece, metrics.brier_score):
        assert call(PROBS, LABELS.bool()) == pytest.approx(call(PROBS, LABELS))


# ------------------------------------------------------------------------ auroc's refusals


def test_auroc_names_the_examples_with_nan_scores_and_ood_auroc_names_the_set() -> None:
    scores = torch.tensor([0.1, math.nan, 0.3, 0.4])
    with pytest.raises(ValueError, match=r"auroc: scores hold NaN at examples \[1\] \(of 4\)"):
        metrics.auroc(scores, torch.tensor([0, 1, 0, 1]))
    with pytest.raises(ValueError, match=r"ood_auroc: ood_scores hold NaN at examples \[0\]"):
        metrics.ood_auroc(torch.tensor([0.1, 0.2]), torch.tensor([math.nan, 0.3]))
    with pytest.raises(ValueError, match=r"ood_auroc: id_scores hold NaN at examples \[1\]"):
        metrics.ood_auroc(torch.tensor([0.1, math.nan]), torch.tensor([0.2, 0.3]))


def test_auroc_names_labels_that_are_not_0_or_1_and_a_single_class() -> None:
    scores = torch.tensor([0.1, 0.2, 0.3, 0.4])
    with pytest.raises(ValueError, match=r"auroc: labels must be 0 .* got the values \[1, 2\]"):
        metrics.auroc(scores, torch.tensor([1, 2, 1, 2]))
    with pytest.raises(ValueError, match=r"auroc: the labels hold only negatives \(0\)"):
        metrics.auroc(scores, torch.zeros(4, dtype=torch.long))
    # 0/1 as floats or booleans are labels still
    assert metrics.auroc(scores, torch.tensor([0.0, 1.0, 0.0, 1.0])) == pytest.approx(0.75)
    assert metrics.auroc(scores, torch.tensor([False, True, False, True])) == pytest.approx(0.75)
