"""Diversity of an ensemble's members: :func:`disagreement` and :func:`pairwise_kl`."""

from __future__ import annotations

import torch
from torch import Tensor

from ._inputs import _as_3d, _resolve, refuse_no_examples

__all__ = [
    "disagreement",
    "pairwise_kl",
]


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
    num_samples, num_examples, num_classes = probs.shape
    refuse_no_examples(num_examples, "disagreement")
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
    refuse_no_examples(num_examples, "pairwise_kl")
    if num_samples < 2:
        return 0.0
    self_term = num_samples * torch.where(probs > 0, probs * log_probs, 0.0).sum(dim=(0, 2))
    prob_sum = probs.sum(dim=0)  # (N, C)
    log_sum = log_probs.sum(dim=0)
    cross = torch.where(prob_sum > 0, prob_sum * log_sum, 0.0).sum(dim=-1)
    total = (self_term - cross) / (num_samples * (num_samples - 1))
    return total.mean().clamp(min=0.0).item() if num_examples else 0.0
