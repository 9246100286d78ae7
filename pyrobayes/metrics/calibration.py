"""Binned top-label calibration error of a classifier's predictive.

:class:`CalibrationError` and :func:`calibration_error` (ECE, MCE and the bins), :func:`ece`, and
:func:`ece_floor`, the ECE a calibrated predictor shows on as many examples.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..models.adapters import check_int
from ._inputs import _check_labels, refuse_no_examples
from .classification import mean_probs

__all__ = [
    "CalibrationError",
    "calibration_error",
    "ece",
    "ece_floor",
]


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
    labels = _check_labels(labels, *p_bar.shape)  # (refuses N = 0)
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
    seed = check_int("seed", seed, owner="ece_floor: ")  # a NumPy integer too
    p_bar = mean_probs(probs).double()
    refuse_no_examples(p_bar.shape[0], "ece_floor")
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
