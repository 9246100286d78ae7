"""One dictionary of metrics for a prediction: :func:`report`.

Classification (accuracy, NLL, ECE, Brier, entropy, mutual information, and OOD AUROCs) or, for a
regression prediction, :func:`~pyrobayes.metrics.regression.regression_report` and the AUROC of
the predictive variance.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import torch
from torch import Tensor

from ..user_frame import user_stacklevel
from ._inputs import _as_3d, _check_no_nan, _pooled, _unpack
from .calibration import calibration_error
from .classification import accuracy, brier_score, nll
from .multilabel import multilabel_report
from .ranking import ood_auroc
from .regression import _noise_scale, regression_report
from .uncertainty import max_prob_score, mutual_information, predictive_entropy

__all__ = [
    "report",
]

logger = logging.getLogger(__name__)


def report(
    probs_or_prediction: Any,
    labels: Tensor,
    *,
    ood_probs: Any = None,
    num_bins: int | None = None,
) -> dict[str, float]:
    """All standard classification metrics in one dictionary (or a regression report).

    Parameters
    ----------
    probs_or_prediction : Tensor or object
        A ``(S, N, C)`` probability tensor, or any object with attribute ``probs`` of that shape
        and optionally ``log_probs`` (used for the NLL when present and not ``None``). A
        regression prediction (attribute ``loc`` ``(S, N, ...)`` and ``scale``, or
        ``predictive_scale`` when present, no ``log_probs``) gives :func:`regression_report`
        instead.
    labels : Tensor
        Shape ``(N,)``, integer class labels (regression: targets of ``loc``'s shape per sample;
        ``(N,)`` or ``(N, 1)`` for a scalar output).
    ood_probs : Tensor or object, optional
        Predictions on out-of-distribution inputs, ``(S, M, C)`` or an object as above. When
        given, OOD-detection AUROCs (in-distribution = 0, OOD = 1) are added for three scores:
        predictive entropy, :func:`max_prob_score` and mutual information. For a regression
        prediction: the regression prediction on the OOD inputs (``loc`` ``(S', M, ...)`` with
        the same trailing shape, and ``scale``), scored per example by the variance of the
        posterior predictive (the mean over draws of the predictive σ² plus the variance over
        draws of ``loc``, averaged over the outputs); anything else is refused.
    num_bins : int, optional
        Number of calibration bins (default 15). Classification only: a regression report has
        no binned calibration, and a ``num_bins`` given for one warns that it is ignored.

    Returns
    -------
    dict of str to float
        Keys ``accuracy``, ``nll``, ``ece``, ``ece_bins`` (the number of bins), ``brier``,
        ``entropy`` (mean predictive entropy), ``mutual_information`` (mean), and with
        ``ood_probs`` also ``auroc_entropy``, ``auroc_maxprob``, ``auroc_mi`` (NaN when either
        prediction is one draw, whose mutual information is 0 by construction; with a
        ``UserWarning`` when only one of them is). A multi-label prediction (``log_probs``
        ``(S, N, L, 2)``, a Bernoulli likelihood): :func:`multilabel_report`. Regression:
        ``rmse`` and ``nll`` (:func:`regression_report`), and with ``ood_probs`` also
        ``auroc_variance``, the AUROC of the predictive variance (NaN, with a ``UserWarning``,
        when either prediction has no epistemic spread: one draw and no ``loc_var``, so every
        example's variance is the same ``σ²``).

    Notes
    -----
    A prediction under a pooled temperature (:func:`pyrobayes.calibrate`'s default form) is one
    row, ``softmax(log p̄ / T)``: the draws were averaged before tempering, so it has no
    per-draw spread and its mutual information is 0 by construction, not because the
    posterior is certain. Such a prediction carries ``pooled_draws`` (the draws it averaged,
    :class:`~pyrobayes.predictive.Prediction`); for it ``mutual_information`` and
    ``auroc_mi`` are NaN ("not available"), not 0 and 0.5, and with ``ood_probs`` a
    ``UserWarning`` says so. The other scores are those of the calibrated predictive. For
    epistemic scores, predict with the uncalibrated posterior
    (``pyrobayes.calibration.set_temperature(guide, None)``) or calibrate with ``pool=False``
    (a temperature per draw keeps the draws). The same holds for the other one-row predictives
    of a posterior with spread, which carry ``pooled_by``: Laplace's probit predictive
    (``pred_type="probit"``; ``"glm"`` keeps Monte Carlo draws), a mixture's logit average
    (``average="logits"``; ``"probs"`` keeps the draws) and one draw of a posterior with spread
    (``pyrobayes.predict(..., num_samples=1)``; a point posterior's one draw keeps its 0).
    """
    if labels is None:  # pb.predict over batches without targets: pred.targets is None
        raise ValueError(
            "report: labels is None (a prediction's targets are None when its batches carried "
            "none). Predict on labelled batches, (x, y) or a dict with the model's label_key, "
            "or pass the labels explicitly: report(pred, y)."
        )
    if _is_multi_label(probs_or_prediction):
        return multilabel_report(
            probs_or_prediction, labels, ood_probs=ood_probs, num_bins=num_bins
        )
    if _is_regression(probs_or_prediction):
        regression = _regression_report(probs_or_prediction, labels, ood_probs, num_bins)
        _warn_if_not_its_targets(probs_or_prediction, labels)  # once the labels are valid
        return regression
    num_bins = 15 if num_bins is None else num_bins
    probs, log_probs = _unpack(probs_or_prediction)
    probs = _as_3d(probs, "probs", probabilities=True)
    calibration = calibration_error(probs, labels, num_bins=num_bins)
    pooled = _pooled(probs_or_prediction)
    result: dict[str, float] = {
        "accuracy": accuracy(probs, labels),
        "nll": nll(probs, labels, log_probs=log_probs),
        "ece": calibration.ece,
        "ece_bins": float(calibration.num_bins),
        "brier": brier_score(probs, labels),
        "entropy": predictive_entropy(probs).mean().item(),
        "mutual_information": math.nan if pooled else mutual_information(probs).mean().item(),
    }
    if ood_probs is not None:
        ood, _ = _unpack(ood_probs)
        ood = _as_3d(ood, "ood_probs", probabilities=True)
        if ood.shape[2] != probs.shape[2]:
            raise ValueError(
                f"report: ood_probs has {ood.shape[2]} classes, probs has {probs.shape[2]}. "
                "Both must come from the same classifier. Multiple-choice predictions of "
                "different widths (at most K choices in one set, K' in the other) can be "
                "compared once the narrower is padded with probability 0 (log-probability "
                "-inf) to the wider width, as pyrobayes.predict pads a ragged batch; the "
                "entropy and max-probability scores then still depend on each question's "
                "number of choices."
            )
        result["auroc_entropy"] = ood_auroc(predictive_entropy(probs), predictive_entropy(ood))
        result["auroc_maxprob"] = ood_auroc(max_prob_score(probs), max_prob_score(ood))
        pooled = pooled or _pooled(ood_probs)
        if pooled:
            warnings.warn(
                f"report: the prediction (or ood_probs) is {pooled}. There is no per-draw "
                "spread left, so mutual information and the MI-based OOD AUROC are not "
                "available (auroc_mi and mutual_information are NaN, not 0 and 0.5).",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
            result["auroc_mi"] = math.nan
        else:
            result["auroc_mi"] = _auroc_mi(probs, ood)
    _warn_if_not_its_targets(probs_or_prediction, labels)  # once the labels are valid
    logger.debug("metrics report: %s", result)
    return result


def _auroc_mi(probs: Tensor, ood: Tensor) -> float:
    """The OOD AUROC of the mutual information; NaN when either side is one draw (S = 1, a
    point prediction), whose mutual information is 0 at every example by construction (the
    AUROC said only which side had draws: 0 or 1, or 0.5 for two point predictions). NaN
    quietly for two point predictions (a MAP has no epistemic part), with a ``UserWarning``
    when only one side is a point (the sets were predicted differently)."""
    if probs.shape[0] > 1 and ood.shape[0] > 1:
        return ood_auroc(mutual_information(probs), mutual_information(ood))
    if probs.shape[0] == 1 and ood.shape[0] == 1:
        return math.nan
    warnings.warn(
        f"report: the prediction has {probs.shape[0]} draw(s) and ood_probs {ood.shape[0]}: a "
        "one-draw (point) prediction has mutual information 0 at every example, so the "
        "MI-based OOD AUROC is not available (auroc_mi is NaN). Predict both sets with the "
        "posterior's draws (num_samples > 1) for auroc_mi; auroc_entropy and auroc_maxprob "
        "do not need them.",
        UserWarning,
        stacklevel=user_stacklevel(),
    )
    return math.nan


def _warn_if_not_its_targets(prediction: Any, labels: Any) -> None:
    """Warn when ``labels`` differ from the targets the prediction carries (``targets``, as
    :func:`pyrobayes.predict` records them in the loader's order): labels taken from the data
    set in another order (a shuffling loader) score every example against another's label."""
    targets = getattr(prediction, "targets", None)
    if not isinstance(targets, Tensor) or not isinstance(labels, Tensor) or labels is targets:
        return
    if _squeezed(targets).shape != _squeezed(labels).shape or targets.numel() == 0:
        return  # the shape checks that follow say what is wrong
    differ = targets.reshape(-1).to(labels.device) != labels.reshape(-1).to(targets.dtype)
    count = int(differ.sum())
    if count:
        warnings.warn(
            f"report: labels differ from the prediction's own targets at {count} of "
            f"{labels.numel()} examples. pyrobayes.predict records the targets in the order the "
            "loader gave the examples (a shuffling loader reorders them): score against "
            "pred.targets, or predict on a loader that does not shuffle.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def _squeezed(values: Tensor) -> Tensor:
    """``values`` without a trailing singleton dimension (``(N, 1)`` targets are ``(N,)``)."""
    return values.squeeze(-1) if values.dim() > 1 and values.shape[-1] == 1 else values


def _is_multi_label(prediction: Any) -> bool:
    """Whether ``prediction`` is a multi-label one: ``log_probs`` (or a probability tensor)
    ``(S, N, L, 2)``, a pair ``(1 − p, p)`` per label (a Bernoulli likelihood)."""
    values = (
        prediction if isinstance(prediction, Tensor) else getattr(prediction, "log_probs", None)
    )
    return isinstance(values, Tensor) and values.dim() == 4 and values.shape[-1] == 2


def _is_regression(prediction: Any) -> bool:
    """Whether ``prediction`` is a regression prediction: a ``loc`` tensor, no ``log_probs``."""
    loc = getattr(prediction, "loc", None)
    return isinstance(loc, Tensor) and getattr(prediction, "log_probs", None) is None


def _predictive_scale(prediction: Any) -> Tensor | float | None:
    """The predictive σ of a regression prediction: the likelihood's, or ``sqrt(loc_var + σ²)``
    for a closed-form predictive (``predictive_scale`` when the object has it)."""
    scale = getattr(prediction, "predictive_scale", None)
    return getattr(prediction, "scale", None) if scale is None else scale


def _predictive_variance(prediction: Any) -> tuple[Tensor, bool]:
    r"""Per example, the variance of the Gaussian-mixture predictive, averaged over the outputs.

    .. math:: v_n = \frac1D \sum_d \Big[\frac1S \sum_s \sigma_{s,nd}^2
        + \frac1S \sum_s (\mu_{s,nd} - \bar\mu_{nd})^2\Big]

    (the law of total variance of the equal-weight mixture of the S draws: the expected noise
    plus the spread of the means; ``σ`` the predictive scale, ``sqrt(loc_var + σ²)`` for a
    closed-form predictive). Returns ``(v (N,), spread)``, ``spread`` telling whether ``v``
    holds any epistemic part (more than one draw, or a ``loc_var``): without one every ``v_n``
    is the same ``σ²``.
    """
    loc = prediction.loc.detach()
    if loc.dim() < 2:
        raise ValueError(
            f"report: a regression prediction's loc must be (S, N, *event), got {tuple(loc.shape)}."
        )
    flat = loc.to(torch.float64).reshape(loc.shape[0], -1)  # (S, N·D), as regression_report
    variance = flat.var(dim=0, unbiased=False)  # (N·D,)
    scale = _predictive_scale(prediction)
    if scale is not None:
        if isinstance(scale, Tensor) and scale.shape == loc.shape:  # per-sample, per-entry σ
            scale = scale.detach().reshape(flat.shape)
        variance = variance + _noise_scale(scale, flat).pow(2).mean(0)
    spread = loc.shape[0] > 1 or getattr(prediction, "loc_var", None) is not None
    return variance.reshape(loc.shape[1], -1).mean(-1), spread


def _regression_report(
    prediction: Any, targets: Tensor, ood: Any, num_bins: int | None
) -> dict[str, float]:
    """:func:`report` of a regression prediction: :func:`regression_report`, and with ``ood``
    (the regression prediction on OOD inputs) ``auroc_variance``."""
    if num_bins is not None:
        warnings.warn(
            f"report: num_bins={num_bins!r} is ignored for a regression prediction: it sets the "
            "bins of the classification calibration error (ECE), and a regression report has "
            "none (rmse and nll). Leave num_bins out for regression.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    result = regression_report(prediction.loc, targets, _predictive_scale(prediction))
    if ood is None:
        logger.debug("metrics report: %s", result)
        return result
    if not _is_regression(ood):
        got = (
            f"a tensor of shape {tuple(ood.shape)}"
            if isinstance(ood, Tensor)
            else f"a classification prediction ({type(ood).__name__} with log_probs)"
            if getattr(ood, "log_probs", None) is not None
            else f"a {type(ood).__name__}"
        )
        raise TypeError(
            "report: for a regression prediction, ood_probs must be the regression prediction "
            "on the out-of-distribution inputs (pyrobayes.predict(model, guide, ood_data), with "
            f"loc and scale), got {got}."
        )
    loc, ood_loc = prediction.loc, ood.loc
    if ood_loc.dim() < 2 or ood_loc.shape[2:] != loc.shape[2:]:
        raise ValueError(
            f"report: ood_probs.loc of shape {tuple(ood_loc.shape)} does not match the "
            f"prediction's loc {tuple(loc.shape)}: both are (draws, examples, *event) with the "
            f"same event shape {tuple(loc.shape[2:])}; predict the OOD inputs with the same model."
        )
    _check_no_nan(ood_loc, "ood_probs.loc", example_dim=1, scores="the OOD variance AUROC")
    id_variance, id_spread = _predictive_variance(prediction)
    ood_variance, ood_spread = _predictive_variance(ood)
    if id_spread and ood_spread:
        result["auroc_variance"] = ood_auroc(id_variance, ood_variance.to(id_variance.device))
    else:
        warnings.warn(
            "report: the prediction (or ood_probs) has one posterior draw and no closed-form "
            "variance (loc_var): its predictive variance is the likelihood's σ² for every "
            "example, so it cannot tell OOD inputs apart and auroc_variance is NaN (not 0.5). "
            "Predict with a posterior's draws (num_samples > 1) or a linearised predictive.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
        result["auroc_variance"] = math.nan
    logger.debug("metrics report: %s", result)
    return result
