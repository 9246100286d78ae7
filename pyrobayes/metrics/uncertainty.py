"""Per-example uncertainty scores of a classifier's predictive.

:func:`predictive_entropy` (total), :func:`expected_entropy` (aleatoric),
:func:`mutual_information` (epistemic) and :func:`max_prob_score`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._inputs import _as_3d
from .classification import mean_probs

__all__ = [
    "predictive_entropy",
    "expected_entropy",
    "mutual_information",
    "max_prob_score",
]


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
