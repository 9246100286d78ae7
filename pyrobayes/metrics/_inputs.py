"""Input handling shared by the metrics.

Shape, dtype and probability checks of ``probs`` / ``log_probs`` (:func:`_as_3d`,
:func:`_check_probabilities`, :func:`_resolve`) and of the labels, and duck-typed access to a
prediction object's ``probs`` and pooling (:func:`_unpack`, :func:`_pooled`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..batch import compute_dtype, flagged_examples


def _as_3d(
    values: Tensor, name: str, *, probabilities: bool = False, log_probabilities: bool = False
) -> Tensor:
    """Return ``values`` as ``(S, N, C)``, promoting a 2-D ``(N, C)`` point prediction to S = 1;
    with ``probabilities`` (``log_probabilities``), refuse rows that are not probability vectors
    (whose exponentials are not: :func:`_check_probabilities`), at the input's own precision."""
    if not isinstance(values, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
    if values.dim() == 2:
        values = values.unsqueeze(0)
    if values.dim() != 3:
        raise ValueError(f"{name} must have shape (S, N, C) or (N, C), got {tuple(values.shape)}")
    _refuse_no_draws_or_classes(values, name)
    if not values.is_floating_point():
        values = values.to(torch.get_default_dtype())
    if probabilities:
        _check_probabilities(values, name)
    elif log_probabilities:
        check_log_probabilities(values, name)
    else:
        _check_no_nan(values, name, example_dim=1)
    # half precision in float32 (checked at its own precision above): bf16 running sums stop
    # at 256 counts, so bin accuracies and ECE came out wrong, and logs of tiny half values
    # underflow
    return values.to(compute_dtype(values.dtype))


def _refuse_no_draws_or_classes(values: Tensor, name: str) -> None:
    """Raise ``ValueError`` for ``(S, N, C)`` ``values`` with no draws (``S = 0``: an empty
    stack of members) or no classes (``C = 0``): their mean over the draws is NaN, so the ECE
    and Brier score came out NaN and the NLL failed with "math domain error"."""
    num_draws, _, num_classes = values.shape
    if num_draws and num_classes:
        return
    what = "no draws (S = 0)" if not num_draws else "no classes (C = 0)"
    raise ValueError(
        f"{name} of shape {tuple(values.shape)} holds {what}: a predictive needs at least one "
        "draw (S, the first dimension of (S, N, C)) and one class (C, the last). Stack at least "
        "one member's or draw's probabilities (pyrobayes.predict with num_samples >= 1)."
    )


def _sum_tolerance(dtype: torch.dtype) -> float:
    """How far a row of probabilities in ``dtype`` may sum from 1 and still be accepted.

    An exactly normalised row stored in a format of unit round-off ``u`` sums to 1 within about
    ``u·(1 + log2 C)`` (each entry rounded relative to itself, then a cascade sum). Computing it
    adds more: ``exp(log_softmax(z))`` turns the absolute error ``u·|z|`` of a log-probability
    into a relative error of the probability, ~100u for logits up to |z| ≈ 100, and averaging
    S draws a few u. 1000u covers these with margin; it is floored at 1e-4 (float32's
    1000u = 6e-5, and float64 probabilities cast from float32 ones keep float32's error) and
    capped at 0.05 for the half formats (1000u is 0.5 to 4 there; a bf16 log-probability of
    |log p| ≤ 12 is exact to 12u ≈ 0.05 relative). So: 1e-4 for float32 and float64, 0.05 for
    float16 and bfloat16. Anything further off (1.4, 0.7: unnormalised scores, the wrong
    axis) is not a distribution, and its NLL, entropy and Brier score are meaningless.
    """
    unit_roundoff = torch.finfo(dtype).eps / 2
    return min(max(1e-4, 1000 * unit_roundoff), 0.05)


def _check_probabilities(probs: Tensor, name: str, *, what: str | None = None) -> None:
    """Raise ``ValueError`` unless every row of ``probs`` ``(S, N, C)`` is a probability vector:
    entries >= 0 whose sum over the classes is 1 within :func:`_sum_tolerance`.

    Two reductions over the data, one more than the NaN check alone: ``amin`` (NaN propagates
    into it, so it is also the NaN check; the examples are then located as before) and the row
    sums. An entry > 1 needs a negative one beside it or a row sum > 1, so these two catch it.
    """
    if probs.numel() == 0:
        return
    what = what or name
    low = float(probs.amin())
    if math.isnan(low):
        _check_no_nan(probs, name, example_dim=1)
    sums = probs.sum(dim=-1)  # (S, N)
    tol = _sum_tolerance(probs.dtype)
    off = (sums - 1).abs() > tol
    if low >= 0 and not bool(off.any()):
        return
    if low < 0:
        bad = (probs < 0).any(-1).any(0)
        problem = f"negative entries (the smallest is {low:.4g})"
    else:
        bad = off.any(0)
        high = float(probs.amax())
        worst = float(sums.flatten()[(sums - 1).abs().flatten().argmax()])
        problem = (
            "rows (over the last dimension, the classes) whose sums are off from 1 by more "
            f"than the {probs.dtype} tolerance {tol:.0e} (the furthest sums to {worst:.6g})"
            + (f", and entries above 1 (the largest is {high:.4g})" if high > 1 else "")
        )
    remedy = (
        "Pass log-softmax outputs (torch.log_softmax(logits, -1)) as log-probabilities, not "
        "logits, probabilities or unnormalised scores, with the classes on the last dimension."
        if what.startswith("exp(")
        else "Pass softmax outputs (torch.softmax(logits, -1)), not logits or unnormalised "
        "scores, with the classes on the last dimension; renormalise rounded probabilities "
        "(p / p.sum(-1, keepdim=True))."
    )
    raise ValueError(
        f"{what} must hold probabilities (entries in [0, 1], each row summing to 1); it has "
        f"{problem} at examples {flagged_examples(bad)} (of {probs.shape[1]}). {remedy}"
    )


def check_log_probabilities(log_probs: Tensor, name: str = "log_probs") -> None:
    """Raise ``ValueError`` unless ``exp(log_probs)`` ``(S, N, C)`` holds probability rows
    (:func:`_check_probabilities`): logits, probabilities or unnormalised scores passed as
    log-probabilities give a negative or meaningless NLL and a wrong temperature."""
    _check_probabilities(log_probs.exp(), name, what=f"exp({name})")


def _check_no_nan(
    values: Tensor,
    name: str,
    *,
    example_dim: int,
    scores: str = "the NLL, ECE and Brier score",
) -> None:
    """Raise ``ValueError`` naming the examples where ``values`` holds NaN: ``scores`` (a
    classification's NLL, ECE and Brier score, beside a finite accuracy: an ``argmax`` skips
    NaN) would be NaN."""
    nan = values.isnan()
    if not bool(nan.any()):
        return
    raise ValueError(
        f"{name} holds NaN at examples {flagged_examples(nan, example_dim)} (of "
        f"{values.shape[example_dim]}): {scores} would be NaN. Those "
        "examples' inputs are probably not finite; clean or drop them and predict again."
    )


def _resolve(probs: Tensor | None, log_probs: Tensor | None) -> tuple[Tensor, Tensor]:
    """Return ``(probs, log_probs)`` as (S, N, C), deriving whichever one is missing."""
    if probs is None:
        if log_probs is None:
            raise ValueError("give probs or log_probs")
        log_probs = _as_3d(log_probs, "log_probs")
        probs = log_probs.exp()
        _check_probabilities(probs, "log_probs", what="exp(log_probs)")
    else:
        probs = _as_3d(probs, "probs", probabilities=True)
        if log_probs is None:
            log_probs = probs.log()
        else:  # beside probs: checked as when alone (logits here gave a negative NLL)
            log_probs = _as_3d(log_probs, "log_probs", log_probabilities=True)
    if probs.shape != log_probs.shape:
        raise ValueError(
            f"probs {tuple(probs.shape)} and log_probs {tuple(log_probs.shape)} differ in shape"
        )
    return probs, log_probs


def _check_labels(labels: Tensor, num_examples: int, num_classes: int) -> Tensor:
    """``labels`` as ``(N,)`` int64 class indices, or an error that says how to pass them: a
    one-hot or probability ``(N, C)`` (``labels.argmax(-1)``), float or bool indices
    (``labels.long()``), a count other than the prediction's, an index outside ``[0, C)``."""
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dim() == 2 and labels.shape == (num_examples, num_classes) and num_classes > 1:
        raise ValueError(
            f"labels must be class indices of shape ({num_examples},), got shape "
            f"{tuple(labels.shape)}: one-hot (or soft) labels, one row per example and one "
            "column per class. Pass labels.argmax(-1), the index of each row's class."
        )
    if labels.dim() != 1 or labels.shape[0] != num_examples:
        raise ValueError(
            f"labels must have shape ({num_examples},), one class index per example of the "
            f"prediction, got {tuple(labels.shape)}"
            + (" (pass labels.squeeze(-1))" if labels.shape == (num_examples, 1) else "")
        )
    if labels.is_floating_point() or labels.is_complex():  # (bool: classes 0 and 1, as fit's)
        raise TypeError(
            f"labels must be an integer tensor of class indices, got {labels.dtype}. Pass "
            "labels.long() (class indices stored as floats); a regression "
            "prediction (a Gaussian likelihood) is scored with its `loc` (report(pred, y))."
        )
    labels = labels.long()
    refuse_no_examples(num_examples, "a metric against labels (accuracy, NLL, ECE, Brier)")
    if labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(
            f"labels must lie in [0, {num_classes}), got range "
            f"[{int(labels.min())}, {int(labels.max())}]"
        )
    return labels


def refuse_no_examples(num_examples: int, what: str) -> None:
    """Raise ``ValueError`` for a prediction of no examples: an average over none is NaN (or a
    sum 0), which would read as a result."""
    if num_examples == 0:
        raise ValueError(
            f"{what} needs at least one example; the prediction holds none (N = 0): an average "
            "over no examples is undefined. Check that the data (or the split) is not empty."
        )


def _pooled_draws(prediction: Any) -> int:
    """The number of posterior draws a pooled temperature averaged into ``prediction``'s one
    row (``Prediction.pooled_draws``), 0 when it keeps its draws (or is a plain tensor)."""
    draws = getattr(prediction, "pooled_draws", None)
    return int(draws) if isinstance(draws, int) and draws > 1 else 0


def _pooled(prediction: Any) -> str | None:
    """Why ``prediction`` (classification) is one row without per-draw spread, with the way
    to keep the draws, in words; ``None`` when its rows are the draws."""
    draws = _pooled_draws(prediction)
    if draws:
        return (
            "tempered by a pooled temperature (pyrobayes.calibrate's default), which averaged "
            f"{draws} posterior draws into one row before tempering; predict with the "
            "uncalibrated posterior (pyrobayes.calibration.set_temperature(guide, None)) or "
            "calibrate with pool=False to keep the draws"
        )
    how = getattr(prediction, "pooled_by", None)
    return how if isinstance(how, str) else None


def _unpack(prediction: Any) -> tuple[Tensor, Tensor | None]:
    """Duck-typed access to ``(probs, log_probs)`` of a tensor or a prediction object."""
    if isinstance(prediction, Tensor):
        return prediction, None
    if hasattr(prediction, "probs"):
        probs = prediction.probs
        log_probs = getattr(prediction, "log_probs", None)
        if not isinstance(probs, Tensor) or not (
            log_probs is None or isinstance(log_probs, Tensor)
        ):
            raise TypeError("prediction.probs (and log_probs, if set) must be torch.Tensor")
        return probs, log_probs
    raise TypeError(
        "expected a (S, N, C) probability tensor or an object with a `probs` attribute, got "
        f"{type(prediction).__name__}"
    )
