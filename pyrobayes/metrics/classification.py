"""The posterior predictive of a classifier and its proper scores.

:func:`mean_probs` and :func:`predictive_log_probs` (the predictive itself), :func:`accuracy`,
:func:`nll` and :func:`brier_score`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._inputs import _as_3d, _check_labels, _resolve

__all__ = [
    "mean_probs",
    "predictive_log_probs",
    "accuracy",
    "nll",
    "brier_score",
]


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
    log_probs = _as_3d(log_probs, "log_probs", log_probabilities=True)
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
