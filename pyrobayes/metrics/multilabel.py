r"""Metrics of a multi-label classifier (a :class:`~pyrobayes.models.Bernoulli` likelihood).

Each example has ``L`` binary labels. The metrics take per-sample probabilities of a 1,
``probs`` of shape ``(S, N, L)`` (or ``(N, L)`` for a point model), and 0/1 ``targets``
``(N, L)``; every metric is computed from the posterior predictive
:math:`\bar p_{nl} = \frac1S \sum_s p_{s,nl}` (the labels independent given ``θ``, the joint
NLL from the per-sample joint). The usual multi-label scores (Tsoumakas & Katakis 2007;
Zhang & Zhou 2014): label-wise (Hamming) accuracy, exact-match (subset) accuracy, the NLL of
an example's whole label vector, the Brier score per label, the calibration error of the
``N·L`` binary predictions, and the mean binary entropy per example as an uncertainty (OOD)
score.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import Tensor

from ..models.likelihoods import check_binary_targets
from ._inputs import _check_no_nan, _pooled, refuse_no_examples
from .calibration import CalibrationError, calibration_error
from .ranking import ood_auroc

__all__ = [
    "multilabel_nll",
    "hamming_accuracy",
    "subset_accuracy",
    "multilabel_brier",
    "multilabel_calibration_error",
    "mean_binary_entropy",
    "multilabel_mutual_information",
    "multilabel_report",
]

logger = logging.getLogger(__name__)


def _label_probs(probs: Tensor, name: str = "probs") -> Tensor:
    """``probs`` as ``(S, N, L)`` in float32 at least, refused unless every entry is a
    probability in ``[0, 1]`` (NaN named by example)."""
    if not isinstance(probs, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(probs).__name__}")
    if probs.dim() == 2:
        probs = probs.unsqueeze(0)
    if probs.dim() != 3 or probs.shape[0] == 0 or probs.shape[2] == 0:
        raise ValueError(
            f"{name} must hold each label's probability of a 1, shape (S, N, L) or (N, L) with "
            f"S >= 1 draws and L >= 1 labels, got {tuple(probs.shape)}"
        )
    if not probs.is_floating_point():
        probs = probs.to(torch.get_default_dtype())
    _check_no_nan(probs, name, example_dim=1)
    if probs.numel() and (float(probs.amin()) < 0 or float(probs.amax()) > 1):
        raise ValueError(
            f"{name} must hold probabilities in [0, 1] (each label's probability of a 1), but "
            f"ranges over [{float(probs.amin()):.4g}, {float(probs.amax()):.4g}]. Pass "
            "torch.sigmoid(logits), not the logits."
        )
    return probs.float() if probs.dtype in (torch.float16, torch.bfloat16) else probs


def _targets(targets: Tensor, probs: Tensor, owner: str) -> Tensor:
    """0/1 ``targets`` ``(N, L)`` checked against ``probs`` ``(S, N, L)``, in its dtype."""
    refuse_no_examples(int(probs.shape[1]), owner)
    checked = check_binary_targets(targets, probs.shape[1:], what=f"{owner}: targets")
    return checked.to(device=probs.device, dtype=probs.dtype)


def multilabel_nll(
    probs: Tensor | None, targets: Tensor, *, log_probs: Tensor | None = None
) -> float:
    r"""NLL of each example's whole label vector under the posterior predictive (mean over
    examples): :math:`-\frac1N \sum_n \log \frac1S \sum_s \prod_l p_s(y_{nl})`.

    Parameters
    ----------
    probs : Tensor or None
        ``(S, N, L)`` or ``(N, L)``, each label's probability of a 1; may be ``None`` when
        ``log_probs`` is given.
    targets : Tensor
        ``(N, L)`` of 0/1.
    log_probs : Tensor, optional
        ``(S, N, L, 2)``, per label ``log (1 − p, p)`` (a multi-label
        :class:`~pyrobayes.predictive.Prediction`'s ``log_probs``): used instead of
        ``log p`` and ``log1p(−p)``, which round for ``p`` near 0 or 1.
    """
    if log_probs is None:
        if probs is None:
            raise ValueError("multilabel_nll: give probs or log_probs")
        p = _label_probs(probs)
        log_probs = torch.stack((torch.log1p(-p), p.log()), -1)
    elif not isinstance(log_probs, Tensor) or log_probs.dim() != 4 or log_probs.shape[-1] != 2:
        got = tuple(log_probs.shape) if isinstance(log_probs, Tensor) else type(log_probs)
        raise ValueError(f"multilabel_nll: log_probs must be (S, N, L, 2), got {got}")
    y = _targets(targets, log_probs[..., 1], "multilabel_nll").long()
    index = y.unsqueeze(-1).expand(log_probs.shape[0], *y.shape, 1)
    joint = log_probs.gather(-1, index).squeeze(-1).sum(-1)  # (S, N)
    return -(torch.logsumexp(joint, 0) - math.log(joint.shape[0])).mean().item()


def hamming_accuracy(probs: Tensor, targets: Tensor) -> float:
    r"""Label-wise accuracy (1 − Hamming loss): the share of (example, label) pairs whose
    predictive mode, :math:`\bar p_{nl} > 1/2`, is the target."""
    p_bar = _label_probs(probs).mean(0)
    y = _targets(targets, p_bar.unsqueeze(0), "hamming_accuracy")
    return ((p_bar > 0.5).to(y.dtype) == y).double().mean().item()


def subset_accuracy(probs: Tensor, targets: Tensor) -> float:
    r"""Exact-match (subset) accuracy: the share of examples whose every label's predictive
    mode is right."""
    p_bar = _label_probs(probs).mean(0)
    y = _targets(targets, p_bar.unsqueeze(0), "subset_accuracy")
    return ((p_bar > 0.5).to(y.dtype) == y).all(-1).double().mean().item()


def multilabel_brier(probs: Tensor, targets: Tensor) -> float:
    r"""Brier score per label, :math:`\frac1{NL} \sum_{n,l} (\bar p_{nl} - y_{nl})^2 \in
    [0, 1]` (the binary Brier score of each label, averaged over the labels and examples)."""
    p_bar = _label_probs(probs).mean(0)
    y = _targets(targets, p_bar.unsqueeze(0), "multilabel_brier")
    return (p_bar - y).pow(2).mean().item()


def multilabel_calibration_error(
    probs: Tensor, targets: Tensor, *, num_bins: int = 15
) -> CalibrationError:
    """The calibration error of the ``N·L`` binary predictions: each (example, label) pair a
    two-class prediction ``(1 − p̄, p̄)``, binned by its confidence ``max(p̄, 1 − p̄)``
    (:func:`~pyrobayes.metrics.calibration_error`)."""
    p = _label_probs(probs)
    y = _targets(targets, p, "multilabel_calibration_error")
    rows = torch.stack((1 - p, p), -1).reshape(p.shape[0], -1, 2)
    return calibration_error(rows, y.reshape(-1).long(), num_bins=num_bins)


def _binary_entropy(p: Tensor) -> Tensor:
    return -(torch.special.xlogy(p, p) + torch.special.xlogy(1 - p, 1 - p))


def mean_binary_entropy(probs: Tensor) -> Tensor:
    r"""Per example, the entropy of the predictive averaged over the labels,
    :math:`\frac1L \sum_l \mathcal H[\bar p_{nl}]` in nats, ``(N,)``: the total uncertainty
    score, e.g. for out-of-distribution detection."""
    return _binary_entropy(_label_probs(probs).mean(0)).mean(-1)


def multilabel_mutual_information(probs: Tensor) -> Tensor:
    r"""Per example, the mutual information between each label and the parameters averaged
    over the labels, :math:`\frac1L \sum_l (\mathcal H[\bar p_{nl}] - \frac1S \sum_s
    \mathcal H[p_{s,nl}])`, ``(N,)`` (0 for one draw)."""
    p = _label_probs(probs)
    gap = _binary_entropy(p.mean(0)) - _binary_entropy(p).mean(0)
    return gap.clamp_min(0).mean(-1)


def multilabel_report(
    probs_or_prediction: Any,
    targets: Tensor,
    *,
    ood_probs: Any = None,
    num_bins: int | None = None,
) -> dict[str, float]:
    """Every multi-label metric in one dictionary.

    Parameters
    ----------
    probs_or_prediction : Tensor or Prediction
        ``(S, N, L)`` probabilities of a 1, or a multi-label
        :class:`~pyrobayes.predictive.Prediction` (``log_probs`` ``(S, N, L, 2)``).
    targets : Tensor
        ``(N, L)`` of 0/1.
    ood_probs : Tensor or Prediction, optional
        The prediction on out-of-distribution inputs: adds ``auroc_entropy`` (the mean binary
        entropy) and ``auroc_mi`` (NaN when either side is one draw).
    num_bins : int, optional
        Calibration bins (default 15).

    Returns
    -------
    dict of str to float
        ``accuracy`` (label-wise, = ``hamming_accuracy``), ``hamming_accuracy``,
        ``subset_accuracy``, ``nll`` (per example, of the whole label vector), ``ece``,
        ``ece_bins``, ``brier`` (per label), ``entropy`` (mean binary entropy) and
        ``mutual_information`` (NaN for a pooled one-row prediction: a pooled temperature, the
        probit predictive), and with ``ood_probs`` ``auroc_entropy`` and ``auroc_mi``.
    """
    probs, log_probs = _unpack_multilabel(probs_or_prediction, "probs_or_prediction")
    probs = _label_probs(probs)
    calibration = multilabel_calibration_error(probs, targets, num_bins=num_bins or 15)
    hamming = hamming_accuracy(probs, targets)
    pooled = _pooled(probs_or_prediction)  # one row without the draws' spread: MI is NaN
    result: dict[str, float] = {
        "accuracy": hamming,
        "hamming_accuracy": hamming,
        "subset_accuracy": subset_accuracy(probs, targets),
        "nll": multilabel_nll(probs, targets, log_probs=log_probs),
        "ece": calibration.ece,
        "ece_bins": float(calibration.num_bins),
        "brier": multilabel_brier(probs, targets),
        "entropy": mean_binary_entropy(probs).mean().item(),
        "mutual_information": math.nan
        if pooled
        else multilabel_mutual_information(probs).mean().item(),
    }
    if ood_probs is not None:
        ood = _label_probs(_unpack_multilabel(ood_probs, "ood_probs")[0], "ood_probs")
        if ood.shape[2] != probs.shape[2]:
            raise ValueError(
                f"multilabel_report: ood_probs has {ood.shape[2]} labels, probs "
                f"{probs.shape[2]}; both must come from the same classifier."
            )
        result["auroc_entropy"] = ood_auroc(mean_binary_entropy(probs), mean_binary_entropy(ood))
        draws = probs.shape[0] > 1 and ood.shape[0] > 1 and not (pooled or _pooled(ood_probs))
        result["auroc_mi"] = (
            ood_auroc(multilabel_mutual_information(probs), multilabel_mutual_information(ood))
            if draws
            else math.nan
        )
    logger.debug("multi-label metrics report: %s", result)
    return result


def _unpack_multilabel(prediction: Any, name: str) -> tuple[Tensor, Tensor | None]:
    """``(probs of a 1 (S, N, L), log_probs (S, N, L, 2) or None)`` of a tensor or a
    multi-label prediction object."""
    if isinstance(prediction, Tensor):
        return (prediction[..., 1], None) if prediction.dim() == 4 else (prediction, None)
    log_probs = getattr(prediction, "log_probs", None)
    if isinstance(log_probs, Tensor) and log_probs.dim() == 4 and log_probs.shape[-1] == 2:
        return log_probs[..., 1].exp(), log_probs
    raise TypeError(
        f"multilabel_report: {name} must be a (S, N, L) tensor of probabilities of a 1 or a "
        "multi-label prediction (pyrobayes.predict with likelihood='bernoulli': log_probs "
        f"(S, N, L, 2)), got {type(prediction).__name__}."
    )
