r"""Predictive metrics for Bayesian and ensemble classifiers and regressors.

Classification metrics take per-sample predictive probabilities ``probs`` of shape ``(S, N, C)``
(``S`` posterior samples, particles or ensemble members; ``S = 1`` for a point model, for which a
2-D ``(N, C)`` tensor is also accepted), and integer ``labels`` of shape ``(N,)``. Wherever it
matters for precision, log-probabilities ``log_probs`` of the same shape can be given instead.
The posterior predictive is the sample average

.. math:: \bar p_{nc} = \frac1S \sum_s p_{s,nc},

and every metric is computed from it (never from averaged logits). :func:`report` also accepts any
object with a ``probs`` attribute (and optionally ``log_probs``), such as a prediction container,
and a regression prediction (``loc`` and ``scale``, as :func:`pyrobayes.predict` returns for a
Gaussian likelihood), for which it reports :func:`regression_report`.

Tensors go in; per-example quantities come back as tensors of shape ``(N,)`` and aggregate
metrics as Python floats.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .batch import compute_dtype, flagged_examples
from .models.adapters import check_int
from .models.likelihoods import check_gaussian_targets

__all__ = [
    "CalibrationError",
    "accuracy",
    "auroc",
    "brier_score",
    "calibration_error",
    "disagreement",
    "ece",
    "ece_floor",
    "expected_entropy",
    "gaussian_nll",
    "gaussian_rmse",
    "max_prob_score",
    "mean_probs",
    "mutual_information",
    "nll",
    "ood_auroc",
    "pairwise_kl",
    "predictive_entropy",
    "predictive_log_probs",
    "regression_report",
    "report",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# input handling
# --------------------------------------------------------------------------------------------


def _as_3d(values: Tensor, name: str, *, probabilities: bool = False) -> Tensor:
    """Return ``values`` as ``(S, N, C)``, promoting a 2-D ``(N, C)`` point prediction to S = 1;
    with ``probabilities``, refuse rows that are not probability vectors
    (:func:`_check_probabilities`)."""
    if not isinstance(values, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
    if values.dim() == 2:
        values = values.unsqueeze(0)
    if values.dim() != 3:
        raise ValueError(f"{name} must have shape (S, N, C) or (N, C), got {tuple(values.shape)}")
    if not values.is_floating_point():
        values = values.to(torch.get_default_dtype())
    if probabilities:
        _check_probabilities(values, name)
    else:
        _check_no_nan(values, name, example_dim=1)
    # half precision in float32 (checked at its own precision above): bf16 running sums stop
    # at 256 counts, so bin accuracies and ECE came out wrong, and logs of tiny half values
    # underflow
    return values.to(compute_dtype(values.dtype))


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
    raise ValueError(
        f"{what} must hold probabilities (entries in [0, 1], each row summing to 1); it has "
        f"{problem} at examples {flagged_examples(bad)} (of "
        f"{probs.shape[1]}). Pass softmax outputs (torch.softmax(logits, -1)), not logits or "
        "unnormalised scores, with the classes on the last dimension; renormalise rounded "
        "probabilities (p / p.sum(-1, keepdim=True))."
    )


def _check_no_nan(values: Tensor, name: str, *, example_dim: int) -> None:
    """Raise ``ValueError`` naming the examples where ``values`` holds NaN: the NLL, ECE and
    Brier score would be NaN beside a finite accuracy (an ``argmax`` skips NaN)."""
    nan = values.isnan()
    if not bool(nan.any()):
        return
    raise ValueError(
        f"{name} holds NaN at examples {flagged_examples(nan, example_dim)} (of "
        f"{values.shape[example_dim]}): the NLL, ECE and Brier score would be NaN. Those "
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
        log_probs = probs.log() if log_probs is None else _as_3d(log_probs, "log_probs")
    if probs.shape != log_probs.shape:
        raise ValueError(
            f"probs {tuple(probs.shape)} and log_probs {tuple(log_probs.shape)} differ in shape"
        )
    return probs, log_probs


def _check_labels(labels: Tensor, num_examples: int, num_classes: int) -> Tensor:
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dim() != 1 or labels.shape[0] != num_examples:
        raise ValueError(f"labels must have shape ({num_examples},), got {tuple(labels.shape)}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    labels = labels.long()
    if num_examples and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(
            f"labels must lie in [0, {num_classes}), got range "
            f"[{int(labels.min())}, {int(labels.max())}]"
        )
    return labels


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


# --------------------------------------------------------------------------------------------
# predictive distribution
# --------------------------------------------------------------------------------------------


def mean_probs(probs: Tensor) -> Tensor:
    r"""Posterior predictive probabilities :math:`\bar p_{nc} = \frac1S\sum_s p_{s,nc}`.

    Parameters
    ----------
    probs : Tensor
        Shape ``(S, N, C)`` (or ``(N, C)``).

    Returns
    -------
    Tensor
        Shape ``(N, C)``.
    """
    return _as_3d(probs, "probs", probabilities=True).mean(dim=0)


def predictive_log_probs(log_probs: Tensor) -> Tensor:
    r"""Log posterior predictive in log space.

    .. math:: \log \bar p_{nc} = \operatorname{logsumexp}_s \log p_{s,nc} - \log S

    Parameters
    ----------
    log_probs : Tensor
        Shape ``(S, N, C)`` (or ``(N, C)``), per-sample log-probabilities.

    Returns
    -------
    Tensor
        Shape ``(N, C)``.
    """
    log_probs = _as_3d(log_probs, "log_probs")
    return torch.logsumexp(log_probs, dim=0) - math.log(log_probs.shape[0])


# --------------------------------------------------------------------------------------------
# proper scores and accuracy
# --------------------------------------------------------------------------------------------


def accuracy(probs: Tensor, labels: Tensor) -> float:
    r"""Accuracy of the posterior predictive mode.

    .. math:: \mathrm{acc} = \frac1N \sum_n 1[\arg\max_c \bar p_{nc} = y_n]

    Parameters
    ----------
    probs : Tensor
        Shape ``(S, N, C)`` (or ``(N, C)``).
    labels : Tensor
        Shape ``(N,)``, integer class labels.

    Returns
    -------
    float
    """
    p_bar = mean_probs(probs)
    labels = _check_labels(labels, *p_bar.shape)
    return (p_bar.argmax(dim=-1) == labels).double().mean().item()


def nll(probs: Tensor | None, labels: Tensor, *, log_probs: Tensor | None = None) -> float:
    r"""Negative log-likelihood of the posterior predictive (mean over examples).

    Computed in log space from per-sample log-probabilities,

    .. math:: \mathrm{NLL} = -\frac1N \sum_n \Big[\operatorname{logsumexp}_s
        \log p_s(y_n \mid x_n) - \log S\Big] = -\frac1N\sum_n \log \bar p_{n, y_n},

    which is *not* the mean of per-sample log-likelihoods (that would be larger, by Jensen).

    Parameters
    ----------
    probs : Tensor or None
        Shape ``(S, N, C)`` (or ``(N, C)``); may be ``None`` if ``log_probs`` is given.
    labels : Tensor
        Shape ``(N,)``, integer class labels.
    log_probs : Tensor, optional
        Per-sample log-probabilities of the same shape; used instead of ``probs.log()`` when
        given, which is more precise for tiny probabilities.

    Returns
    -------
    float
    """
    _, log_p = _resolve(probs, log_probs)
    labels = _check_labels(labels, log_p.shape[1], log_p.shape[2])
    index = labels.view(1, -1, 1).expand(log_p.shape[0], -1, 1)
    log_lik = log_p.gather(-1, index).squeeze(-1)  # (S, N)
    log_pred = torch.logsumexp(log_lik, dim=0) - math.log(log_p.shape[0])
    return (-log_pred.mean()).item()


def brier_score(probs: Tensor, labels: Tensor) -> float:
    r"""Multi-class Brier score of the posterior predictive.

    .. math:: \mathrm{BS} = \frac1N \sum_n \sum_c (\bar p_{nc} - 1[y_n = c])^2 \in [0, 2]

    For two classes this is twice the customary binary Brier score
    :math:`\frac1N\sum_n(\bar p_{n1} - y_n)^2`.

    Parameters
    ----------
    probs : Tensor
        Shape ``(S, N, C)`` (or ``(N, C)``).
    labels : Tensor
        Shape ``(N,)``, integer class labels.

    Returns
    -------
    float
    """
    p_bar = mean_probs(probs)
    labels = _check_labels(labels, *p_bar.shape)
    one_hot = torch.nn.functional.one_hot(labels, p_bar.shape[-1]).to(p_bar.dtype)
    return (p_bar - one_hot).pow(2).sum(dim=-1).mean().item()


# --------------------------------------------------------------------------------------------
# calibration
# --------------------------------------------------------------------------------------------


class CalibrationError(NamedTuple):
    r"""Binned top-label calibration error and its bins.

    Attributes
    ----------
    ece : float
        Expected calibration error :math:`\sum_b \frac{|B_b|}{N}|\mathrm{acc}_b-\mathrm{conf}_b|`.
    mce : float
        Maximum calibration error :math:`\max_{b: |B_b| > 0} |\mathrm{acc}_b - \mathrm{conf}_b|`.
    num_bins : int
        Number of equal-width confidence bins :math:`B`.
    bin_counts : Tensor
        Shape ``(B,)``, number of examples per bin (long).
    bin_accuracy : Tensor
        Shape ``(B,)``, accuracy per bin (0 for empty bins).
    bin_confidence : Tensor
        Shape ``(B,)``, mean confidence per bin (0 for empty bins).
    """

    ece: float
    mce: float
    num_bins: int
    bin_counts: Tensor
    bin_accuracy: Tensor
    bin_confidence: Tensor


def calibration_error(probs: Tensor, labels: Tensor, *, num_bins: int = 15) -> CalibrationError:
    r"""Expected and maximum top-label calibration error with equal-width bins.

    With confidence :math:`\mathrm{conf}_n = \max_c \bar p_{nc}` and prediction
    :math:`\hat y_n = \arg\max_c \bar p_{nc}`, example :math:`n` falls in bin
    :math:`b \in \{1..B\}` with :math:`\mathrm{conf}_n \in ((b-1)/B,\, b/B]` (confidence 0 in
    bin 1). Per bin, :math:`\mathrm{acc}_b = \frac{1}{|B_b|}\sum_{n \in B_b} 1[\hat y_n = y_n]`
    and :math:`\mathrm{conf}_b = \frac{1}{|B_b|}\sum_{n\in B_b}\mathrm{conf}_n`;

    .. math:: \mathrm{ECE} = \sum_b \frac{|B_b|}{N}\,|\mathrm{acc}_b - \mathrm{conf}_b|,
        \qquad \mathrm{MCE} = \max_{b: |B_b|>0} |\mathrm{acc}_b - \mathrm{conf}_b|.

    Empty bins contribute 0.

    Parameters
    ----------
    probs : Tensor
        Shape ``(S, N, C)`` (or ``(N, C)``).
    labels : Tensor
        Shape ``(N,)``, integer class labels.
    num_bins : int, default 15
        Number of bins :math:`B`.

    Returns
    -------
    CalibrationError
    """
    num_bins = check_int("num_bins", num_bins, ge=1)
    p_bar = mean_probs(probs)
    labels = _check_labels(labels, *p_bar.shape)
    if p_bar.shape[0] == 0:
        raise ValueError("calibration error needs at least one example")
    confidence, prediction = p_bar.max(dim=-1)
    correct = (prediction == labels).to(p_bar.dtype)
    boundaries = torch.linspace(0.0, 1.0, num_bins + 1, dtype=p_bar.dtype, device=p_bar.device)
    # bucketize(right=False) gives i with boundaries[i-1] < conf <= boundaries[i]: bin i - 1.
    bins = (torch.bucketize(confidence, boundaries, right=False) - 1).clamp(0, num_bins - 1)
    counts = torch.bincount(bins, minlength=num_bins)
    sum_correct = torch.zeros(num_bins, dtype=p_bar.dtype, device=p_bar.device)
    sum_conf = torch.zeros_like(sum_correct)
    sum_correct.index_add_(0, bins, correct)
    sum_conf.index_add_(0, bins, confidence)
    nonempty = counts > 0
    safe_counts = counts.clamp(min=1).to(p_bar.dtype)
    bin_accuracy = torch.where(nonempty, sum_correct / safe_counts, torch.zeros_like(sum_conf))
    bin_confidence = torch.where(nonempty, sum_conf / safe_counts, torch.zeros_like(sum_conf))
    gap = (bin_accuracy - bin_confidence).abs()
    ece_value = (counts.to(p_bar.dtype) / p_bar.shape[0] * gap).sum().item()
    mce_value = gap[nonempty].max().item()
    return CalibrationError(
        ece=ece_value,
        mce=mce_value,
        num_bins=num_bins,
        bin_counts=counts,
        bin_accuracy=bin_accuracy,
        bin_confidence=bin_confidence,
    )


def ece(probs: Tensor, labels: Tensor, *, num_bins: int = 15) -> float:
    """Expected calibration error; see :func:`calibration_error` for the definition.

    Parameters
    ----------
    probs : Tensor
        Shape ``(S, N, C)`` (or ``(N, C)``).
    labels : Tensor
        Shape ``(N,)``, integer class labels.
    num_bins : int, default 15
        Number of equal-width confidence bins.

    Returns
    -------
    float
    """
    return calibration_error(probs, labels, num_bins=num_bins).ece


def ece_floor(
    probs: Tensor, *, num_bins: int = 15, num_draws: int = 1000, seed: int = 0
) -> tuple[float, float]:
    r"""The ECE a perfectly calibrated predictor shows on this many examples: its sampling floor.

    The binned ECE is biased upward on small test sets (Roelofs, Cain, Shlens & Mozer 2022,
    *Mitigating bias in calibration error estimation*, AISTATS): even labels drawn from the
    predictive itself, :math:`y_n \sim \mathrm{Cat}(\bar p_n)`, give a positive ECE. With the
    example's confidence :math:`c_n = \max_k \bar p_{nk}` and its top label correct with
    probability :math:`c_n`, the floor is

    .. math:: \mathbb{E}\Big[\sum_b \tfrac{1}{N}\Big|\sum_{n \in B_b}(z_n - c_n)\Big|\Big],
        \qquad z_n \sim \mathrm{Bernoulli}(c_n),

    estimated from ``num_draws`` draws (bins as in :func:`calibration_error`). An observed ECE
    within a standard deviation or two of this mean is indistinguishable from calibrated.

    Parameters
    ----------
    probs : Tensor
        Shape ``(S, N, C)`` (or ``(N, C)``): the predictive whose confidences are used.
    num_bins : int, default 15
        Number of equal-width confidence bins.
    num_draws : int, default 1000
        Monte-Carlo draws of the labels.
    seed : int, default 0
        Seed of the draws (the result is deterministic).

    Returns
    -------
    (float, float)
        The mean and the standard deviation of the ECE over the draws.
    """
    num_bins = check_int("num_bins", num_bins, ge=1, owner="ece_floor: ")
    num_draws = check_int("num_draws", num_draws, ge=2, owner="ece_floor: ")
    p_bar = mean_probs(probs).double()
    if p_bar.shape[0] == 0:
        raise ValueError("ece_floor needs at least one example")
    confidence = p_bar.max(dim=-1).values.cpu()  # the draws come from a CPU generator
    boundaries = torch.linspace(0.0, 1.0, num_bins + 1, dtype=confidence.dtype)
    bins = (torch.bucketize(confidence, boundaries, right=False) - 1).clamp(0, num_bins - 1)
    generator = torch.Generator().manual_seed(seed)
    draws = torch.rand(num_draws, confidence.shape[0], generator=generator, dtype=torch.float64)
    gap = (draws < confidence).double() - confidence  # (D, N): z_n - c_n
    per_bin = torch.zeros(num_draws, num_bins, dtype=torch.float64)
    per_bin.index_add_(1, bins, gap)
    values = per_bin.abs().sum(dim=1) / confidence.shape[0]
    return float(values.mean()), float(values.std())


# --------------------------------------------------------------------------------------------
# uncertainty scores
# --------------------------------------------------------------------------------------------


def _entropy(p: Tensor, dim: int = -1) -> Tensor:
    r""":math:`-\sum_c p_c \log p_c` with :math:`0 \log 0 = 0`."""
    return -torch.special.xlogy(p, p).sum(dim=dim)


def predictive_entropy(probs: Tensor) -> Tensor:
    r"""Entropy of the posterior predictive, per example.

    .. math:: \mathcal H[\bar p_n] = -\sum_c \bar p_{nc} \log \bar p_{nc}

    Parameters
    ----------
    probs : Tensor
        Shape ``(S, N, C)`` (or ``(N, C)``).

    Returns
    -------
    Tensor
        Shape ``(N,)``, in nats.
    """
    return _entropy(mean_probs(probs))


def expected_entropy(probs: Tensor) -> Tensor:
    r"""Expected per-sample entropy (aleatoric part), per example.

    .. math:: \frac1S \sum_s \mathcal H[p_{s,n}]

    Parameters
    ----------
    probs : Tensor
        Shape ``(S, N, C)`` (or ``(N, C)``).

    Returns
    -------
    Tensor
        Shape ``(N,)``, in nats.
    """
    return _entropy(_as_3d(probs, "probs", probabilities=True)).mean(dim=0)


def mutual_information(probs: Tensor) -> Tensor:
    r"""Mutual information between label and parameters (epistemic part, BALD), per example.

    .. math:: \mathrm{MI}_n = \mathcal H[\bar p_n] - \frac1S\sum_s \mathcal H[p_{s,n}] \ge 0

    It is 0 for :math:`S = 1`; round-off below 0 is clamped to 0. So it is 0, too, for a
    prediction under a pooled temperature (:func:`pyrobayes.calibrate`'s default: one row, the
    draws averaged away), where it says nothing about the posterior; :func:`report` gives NaN
    for such a prediction.

    Parameters
    ----------
    probs : Tensor
        Shape ``(S, N, C)`` (or ``(N, C)``).

    Returns
    -------
    Tensor
        Shape ``(N,)``, in nats.
    """
    return (predictive_entropy(probs) - expected_entropy(probs)).clamp(min=0.0)


def max_prob_score(probs: Tensor) -> Tensor:
    r"""Maximum-probability uncertainty score, per example (higher = more uncertain).

    .. math:: 1 - \max_c \bar p_{nc}

    Parameters
    ----------
    probs : Tensor
        Shape ``(S, N, C)`` (or ``(N, C)``).

    Returns
    -------
    Tensor
        Shape ``(N,)``.
    """
    return 1.0 - mean_probs(probs).max(dim=-1).values


# --------------------------------------------------------------------------------------------
# OOD detection
# --------------------------------------------------------------------------------------------


def auroc(scores: Tensor, labels: Tensor) -> float:
    r"""Area under the ROC curve (scikit-learn's ``roc_auc_score``; ties count one half).

    Scores are higher for the positive class (label 1, e.g. out-of-distribution). It equals the
    Mann-Whitney statistic (Hanley & McNeil, 1982, Radiology 143(1), Eq. 2): with average ranks
    :math:`R_i` of all :math:`n_0 + n_1` scores,

    .. math:: \mathrm{AUROC} = \frac{\sum_{i: y_i = 1} R_i - n_1(n_1 + 1)/2}{n_0\, n_1}
        = \frac{1}{n_0 n_1}\sum_{i: y_i=1}\sum_{j: y_j=0}
        \big(1[s_i > s_j] + \tfrac12 1[s_i = s_j]\big).

    Parameters
    ----------
    scores : Tensor
        Shape ``(N,)``, higher = more likely positive (OOD).
    labels : Tensor
        Shape ``(N,)``, 0 (negative / in-distribution) or 1 (positive / OOD).

    Returns
    -------
    float
    """
    if scores.dim() != 1 or labels.shape != scores.shape:
        raise ValueError(
            f"scores and labels must be 1-D of equal length, got {tuple(scores.shape)} "
            f"and {tuple(labels.shape)}"
        )
    if torch.isnan(scores.double()).any():
        raise ValueError("scores contain NaN")
    positive = labels.bool()
    if not torch.equal(positive.long(), labels.long()):
        raise ValueError("labels must be 0 or 1")
    n_pos = int(positive.sum())
    n_neg = scores.shape[0] - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUROC needs at least one positive and one negative example")
    from sklearn.metrics import roc_auc_score  # imported here: only AUROC needs scikit-learn

    # AUROC depends on the scores' order only: their dense ranks (ties kept) let +-inf through,
    # which scikit-learn's input check refuses
    _, dense_ranks = torch.unique(scores.detach().double(), return_inverse=True)
    return float(roc_auc_score(positive.cpu().numpy(), dense_ranks.cpu().numpy()))


def ood_auroc(id_scores: Tensor, ood_scores: Tensor) -> float:
    """AUROC for separating in-distribution (label 0) from OOD (label 1) scores.

    See :func:`auroc`; higher scores must mean "more OOD".

    Parameters
    ----------
    id_scores : Tensor
        Shape ``(N,)``, scores of in-distribution examples (1-D; other shapes are refused).
    ood_scores : Tensor
        Shape ``(M,)``, scores of out-of-distribution examples.

    Returns
    -------
    float

    Raises
    ------
    ValueError
        When either set of scores is not 1-D: a 2-D tensor (a per-draw ``(S, N)`` score, or
        ``(N, 1)``) is refused rather than flattened into ``S·N`` "examples".
    """
    for name, scores in (("id_scores", id_scores), ("ood_scores", ood_scores)):
        if not isinstance(scores, Tensor):
            raise TypeError(
                f"ood_auroc: {name} must be a torch.Tensor, got {type(scores).__name__}"
            )
        if scores.dim() != 1:
            raise ValueError(
                f"ood_auroc: {name} must be 1-D, one score per example (N,), got shape "
                f"{tuple(scores.shape)}. Per-example scores such as predictive_entropy(probs) "
                "are (N,); reduce a per-draw score over the draws first, or squeeze an (N, 1)."
            )
        if scores.numel() == 0:
            raise ValueError(f"ood_auroc: {name} is empty; the AUROC needs examples of both kinds.")
    scores = torch.cat([id_scores, ood_scores.to(id_scores.dtype)])
    labels = torch.cat(
        [
            torch.zeros(id_scores.numel(), dtype=torch.long, device=scores.device),
            torch.ones(ood_scores.numel(), dtype=torch.long, device=scores.device),
        ]
    )
    return auroc(scores, labels)


# --------------------------------------------------------------------------------------------
# ensemble diversity
# --------------------------------------------------------------------------------------------


def disagreement(probs: Tensor) -> float:
    r"""Mean pairwise disagreement of the members' predicted classes.

    .. math:: \frac{1}{S(S-1)} \sum_{s \ne s'} \frac1N \sum_n
        1[\arg\max_c p_{s,nc} \ne \arg\max_c p_{s',nc}]

    computed from the per-example class vote counts :math:`v_{nc}` as
    :math:`1 - \frac1N\sum_n \sum_c v_{nc}(v_{nc}-1) / (S(S-1))`. Zero for :math:`S = 1`.

    Parameters
    ----------
    probs : Tensor
        Shape ``(S, N, C)``.

    Returns
    -------
    float
    """
    probs = _as_3d(probs, "probs", probabilities=True)
    num_samples, _, num_classes = probs.shape
    if num_samples < 2:
        return 0.0
    votes = torch.nn.functional.one_hot(probs.argmax(dim=-1), num_classes).sum(dim=0)  # (N, C)
    votes = votes.to(torch.float64)
    agree = (votes * (votes - 1.0)).sum(dim=-1) / (num_samples * (num_samples - 1))
    return (1.0 - agree).mean().item()


def pairwise_kl(probs: Tensor | None, *, log_probs: Tensor | None = None) -> float:
    r"""Mean pairwise Kullback-Leibler divergence between members.

    .. math:: \frac{1}{S(S-1)} \sum_{s \ne s'} \frac1N \sum_n
        \mathrm{KL}(p_{s,n} \,\|\, p_{s',n}), \quad
        \mathrm{KL}(p\|q) = \sum_c p_c (\log p_c - \log q_c),

    evaluated in :math:`O(SNC)` as
    :math:`\sum_{s,s'} \mathrm{KL}(p_s\|p_{s'}) = S\sum_s\sum_c p_{s,c}\log p_{s,c}
    - \sum_c (\sum_s p_{s,c})(\sum_{s'} \log p_{s',c})` (terms with :math:`\sum_s p_{s,c} = 0`
    are 0). Zero for :math:`S = 1`; infinite if some member gives zero probability to a class
    another member supports.

    Parameters
    ----------
    probs : Tensor or None
        Shape ``(S, N, C)``; may be ``None`` if ``log_probs`` is given.
    log_probs : Tensor, optional
        Per-sample log-probabilities, used instead of ``probs.log()`` when given.

    Returns
    -------
    float
    """
    probs, log_probs = _resolve(probs, log_probs)
    num_samples, num_examples, _ = probs.shape
    if num_samples < 2:
        return 0.0
    self_term = num_samples * torch.where(probs > 0, probs * log_probs, 0.0).sum(dim=(0, 2))
    prob_sum = probs.sum(dim=0)  # (N, C)
    log_sum = log_probs.sum(dim=0)
    cross = torch.where(prob_sum > 0, prob_sum * log_sum, 0.0).sum(dim=-1)
    total = (self_term - cross) / (num_samples * (num_samples - 1))
    return total.mean().clamp(min=0.0).item() if num_examples else 0.0


# --------------------------------------------------------------------------------------------
# regression
# --------------------------------------------------------------------------------------------


def _as_2d_means(means: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """``(means (S, N), targets (N,))``; targets ``(N, 1)`` are taken as ``(N,)``."""
    if means.dim() == 1:
        means = means.unsqueeze(0)
    if means.dim() != 2:
        raise ValueError(f"means must be (S, N) or (N,), got {tuple(means.shape)}")
    _check_no_nan(means, "means", example_dim=1)
    targets = check_gaussian_targets(targets, means.shape[1:], what="predictive mean")
    dtype = compute_dtype(means.dtype)  # a half network's means in float32, targets alike
    if targets.is_floating_point():
        dtype = torch.promote_types(dtype, compute_dtype(targets.dtype))
    return means.to(dtype), targets.to(dtype)


def gaussian_rmse(means: Tensor, targets: Tensor) -> float:
    r"""Root-mean-square error of the predictive mean.

    .. math:: \mathrm{RMSE} = \sqrt{\frac1N \sum_n (\bar\mu_n - y_n)^2},
        \quad \bar\mu_n = \frac1S\sum_s \mu_{s,n}

    Parameters
    ----------
    means : Tensor
        Shape ``(S, N)`` (or ``(N,)``), per-sample predictive means.
    targets : Tensor
        Shape ``(N,)`` or ``(N, 1)``.

    Returns
    -------
    float
    """
    means, targets = _as_2d_means(means, targets)
    return (means.mean(dim=0) - targets).pow(2).mean().sqrt().item()


def gaussian_nll(means: Tensor, targets: Tensor, noise_scale: Tensor | float) -> float:
    r"""Negative log-likelihood of the Gaussian-mixture posterior predictive (mean over examples).

    .. math:: \mathrm{NLL} = -\frac1N \sum_n \Big[\operatorname{logsumexp}_s
        \log \mathcal N(y_n \mid \mu_{s,n}, \sigma_{s,n}^2) - \log S\Big]

    Parameters
    ----------
    means : Tensor
        Shape ``(S, N)`` (or ``(N,)``), per-sample predictive means.
    targets : Tensor
        Shape ``(N,)`` or ``(N, 1)``.
    noise_scale : Tensor or float
        Observation noise standard deviation :math:`\sigma` (finite, > 0), broadcastable to
        ``(S, N)``: a scalar, per-sample ``(S, 1)``, per-example ``(N,)`` or full ``(S, N)``. A
        1-D per-sample ``(S,)`` (with ``S != N``) is taken as ``(S, 1)``; with ``S == N > 1`` a
        1-D scale is ambiguous and refused (pass ``(S, 1)`` or ``(1, N)``).

    Returns
    -------
    float

    Raises
    ------
    ValueError
        When ``noise_scale`` holds a value that is not finite and > 0 (NaN included), or has a
        shape that does not broadcast to ``(S, N)`` as above.
    """
    means, targets = _as_2d_means(means, targets)
    scale = _noise_scale(noise_scale, means)
    log_lik = torch.distributions.Normal(means, scale).log_prob(targets)
    log_pred = torch.logsumexp(log_lik, dim=0) - math.log(means.shape[0])
    return (-log_pred.mean()).item()


def _noise_scale(noise_scale: Tensor | float, means: Tensor) -> Tensor:
    """``noise_scale`` as a tensor broadcast to ``means``' ``(S, N)`` (see :func:`gaussian_nll`)."""
    scale = torch.as_tensor(noise_scale, dtype=means.dtype, device=means.device)
    # NaN fails every comparison, so "not (finite and > 0)" rather than "<= 0"
    if not bool((scale.isfinite() & (scale > 0)).all()):
        bad = scale[~(scale.isfinite() & (scale > 0))].flatten()[:4].tolist()
        raise ValueError(
            f"gaussian_nll: noise_scale must be finite and > 0 everywhere; got {bad} (a NaN "
            "scale comes from a diverged fit of a learned noise, a 0 or inf one from a wrong "
            "obs_scale)."
        )
    num_samples, num_examples = means.shape
    if scale.dim() == 1 and scale.shape[0] == num_samples != num_examples:
        scale = scale.unsqueeze(-1)  # per-sample (S,): unambiguous, the documented (S, 1)
    elif scale.dim() == 1 and scale.shape[0] == num_samples == num_examples > 1:
        raise ValueError(
            f"gaussian_nll: a 1-D noise_scale of length {num_samples} is ambiguous for means of "
            f"shape ({num_samples}, {num_examples}) (S = N): pass it as ({num_samples}, 1) for "
            f"one σ per sample or (1, {num_examples}) for one σ per example."
        )
    try:
        return torch.broadcast_to(scale, means.shape)
    except RuntimeError:
        raise ValueError(
            f"gaussian_nll: noise_scale of shape {tuple(scale.shape)} does not broadcast to the "
            f"means' (S, N) = {tuple(means.shape)}; pass a scalar, (S, 1) per sample, (N,) per "
            "example, or (S, N)."
        ) from None


def regression_report(
    means: Tensor, targets: Tensor, noise_scale: Tensor | float | None = None
) -> dict[str, float]:
    """RMSE and (with a noise scale) NLL of a Gaussian predictive, per target entry.

    Parameters
    ----------
    means : Tensor
        Shape ``(S, N, *event)``, per-sample predictive means (``Prediction.loc``).
    targets : Tensor
        Shape ``(N, *event)``; for a scalar output ``(N,)`` or ``(N, 1)``. Any other shape raises
        a ``ValueError`` naming both shapes.
    noise_scale : Tensor or float, optional
        Predictive σ around each mean (``Prediction.scale``): a float, a tensor broadcastable to
        ``(S, N·prod(event))``, or one shaped like ``means``; without it only the RMSE is
        reported.

    Returns
    -------
    dict of str to float
        ``rmse`` (:func:`gaussian_rmse`) and ``nll`` (:func:`gaussian_nll`) over the
        ``N · prod(event)`` target entries.
    """
    if not isinstance(means, Tensor) or means.dim() < 2:
        raise ValueError(f"means must be (S, N, *event), got {tuple(getattr(means, 'shape', ()))}")
    targets = check_gaussian_targets(
        targets, means.shape[1:], means.dim() - 2, what="predictive mean"
    )
    flat_means, flat_targets = means.reshape(means.shape[0], -1), targets.reshape(-1)
    result = {"rmse": gaussian_rmse(flat_means, flat_targets)}
    if noise_scale is not None:
        if isinstance(noise_scale, Tensor) and noise_scale.shape == means.shape:
            noise_scale = noise_scale.reshape(flat_means.shape)  # per-sample, per-entry σ
        result["nll"] = gaussian_nll(flat_means, flat_targets, noise_scale)
    return result


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


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
        ``ood_probs`` also ``auroc_entropy``, ``auroc_maxprob``, ``auroc_mi``. Regression:
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
    (``pred_type="probit"``; ``"glm"`` keeps Monte Carlo draws) and a mixture's logit average
    (``average="logits"``; ``"probs"`` keeps the draws).
    """
    if labels is None:  # pb.predict over batches without targets: pred.targets is None
        raise ValueError(
            "report: labels is None (a prediction's targets are None when its batches carried "
            "none). Predict on labelled batches, (x, y) or a dict with the model's label_key, "
            "or pass the labels explicitly: report(pred, y)."
        )
    if _is_regression(probs_or_prediction):
        return _regression_report(probs_or_prediction, labels, ood_probs, num_bins)
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
                stacklevel=2,
            )
            result["auroc_mi"] = math.nan
        else:
            result["auroc_mi"] = ood_auroc(mutual_information(probs), mutual_information(ood))
    logger.debug("metrics report: %s", result)
    return result


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
            stacklevel=3,
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
    _check_no_nan(ood_loc, "ood_probs.loc", example_dim=1)
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
            stacklevel=3,
        )
        result["auroc_variance"] = math.nan
    logger.debug("metrics report: %s", result)
    return result
