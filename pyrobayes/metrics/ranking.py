"""Ranking metrics for OOD detection: :func:`auroc` and :func:`ood_auroc`."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "auroc",
    "ood_auroc",
]


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

    Raises
    ------
    TypeError
        When ``scores`` or ``labels`` is not a tensor (a NumPy array or a list: convert it with
        ``torch.as_tensor``).
    ValueError
        When they are not 1-D of one length, ``scores`` hold NaN, ``labels`` are not 0 or 1, or
        only one class is present.
    """
    for name, values in (("scores", scores), ("labels", labels)):
        if not isinstance(values, Tensor):  # (a NumPy array failed on .dim(), an AttributeError)
            raise TypeError(
                f"auroc: {name} must be a torch.Tensor, got {type(values).__name__}; convert it "
                f"with torch.as_tensor({name})."
            )
    if scores.dim() != 1 or labels.shape != scores.shape:
        raise ValueError(
            f"scores and labels must be 1-D of equal length, got {tuple(scores.shape)} "
            f"and {tuple(labels.shape)}"
        )
    _check_no_nan_scores(scores, "auroc: scores")
    if labels.is_complex() or not bool(((labels == 0) | (labels == 1)).all()):
        values = torch.unique(labels.detach().cpu())[:6].tolist()
        raise ValueError(
            f"auroc: labels must be 0 (negative, e.g. in-distribution) or 1 (positive, e.g. "
            f"OOD), got the values {values}. Map them to 0/1, e.g. (labels == positive_class)."
            "long()."
        )
    positive = labels.bool()
    n_pos = int(positive.sum())
    n_neg = scores.shape[0] - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError(
            f"auroc: the labels hold only {'negatives (0)' if n_pos == 0 else 'positives (1)'} "
            f"({scores.shape[0]} examples); the AUROC needs at least one positive and one "
            "negative example."
        )
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
        _check_no_nan_scores(scores, f"ood_auroc: {name}")
    # the common type of the two (integer ID scores truncated float OOD scores before)
    dtype = torch.promote_types(id_scores.dtype, ood_scores.dtype)
    scores = torch.cat([id_scores.to(dtype), ood_scores.to(dtype)])
    labels = torch.cat(
        [
            torch.zeros(id_scores.numel(), dtype=torch.long, device=scores.device),
            torch.ones(ood_scores.numel(), dtype=torch.long, device=scores.device),
        ]
    )
    return auroc(scores, labels)


def _check_no_nan_scores(scores: Tensor, what: str) -> None:
    """Raise ``ValueError`` naming the examples where the 1-D ``scores`` hold NaN (an AUROC
    ranks the scores, and NaN has no rank)."""
    nan = torch.isnan(scores.double())
    if bool(nan.any()):
        where = nan.nonzero().flatten()
        shown = where[:10].tolist()
        raise ValueError(
            f"{what} hold NaN at examples {shown}{' ...' if where.numel() > 10 else ''} (of "
            f"{scores.shape[0]}), which has no rank. Those examples' predictions are probably "
            "not finite (non-finite inputs, or a diverged fit); clean or drop them and score "
            "again."
        )
