"""Metrics of a Gaussian regression predictive.

:func:`gaussian_rmse`, :func:`gaussian_nll` (of the Gaussian-mixture posterior predictive) and
:func:`regression_report`, both for ``(S, N, *event)`` means.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..batch import compute_dtype, flagged_examples
from ..models.likelihoods import check_gaussian_targets
from ._inputs import refuse_no_examples

__all__ = [
    "gaussian_rmse",
    "gaussian_nll",
    "regression_report",
]


def _as_2d_means(means: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """``(means (S, N), targets (N,))``; targets ``(N, 1)`` are taken as ``(N,)``."""
    if means.dim() == 1:
        means = means.unsqueeze(0)
    if means.dim() != 2:
        raise ValueError(f"means must be (S, N) or (N,), got {tuple(means.shape)}")
    _check_means(means)
    targets = check_gaussian_targets(targets, means.shape[1:], what="predictive mean")
    dtype = compute_dtype(means.dtype)  # a half network's means in float32, targets alike
    if targets.is_floating_point():
        dtype = torch.promote_types(dtype, compute_dtype(targets.dtype))
    return means.to(dtype), targets.to(dtype)


def _check_means(means: Tensor) -> None:
    """Raise ``ValueError`` for means of no examples (the RMSE was NaN), and naming the examples
    (dim 1 of the ``(S, N, *event)`` means) where ``means`` holds NaN (the RMSE and NLL would
    be NaN) or ±inf (the RMSE inf, and the NLL silently finite: the mixture drops the draw)."""
    refuse_no_examples(means.shape[1], "a regression metric (RMSE, NLL)")
    finite = means.isfinite()
    if bool(finite.all()):
        return
    nan = means.isnan()
    if bool(nan.any()):
        raise ValueError(
            f"means holds NaN at examples {flagged_examples(nan, 1)} (of {means.shape[1]}): the "
            "RMSE and NLL would be NaN. Those examples' inputs are probably not finite (or the "
            "fit diverged); clean or drop them and predict again."
        )
    raise ValueError(
        f"means holds inf at examples {flagged_examples(~finite, 1)} (of {means.shape[1]}): the "
        "RMSE would be inf, and the NLL of the mixture would leave out the draws at inf "
        "without a sign. Those examples' inputs are probably not finite or out of the "
        "network's range (or the fit diverged); clean or drop them and predict again."
    )


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

    Raises
    ------
    ValueError
        When ``means`` holds NaN (the examples, along dim 1, are named), or the targets do not
        match the means.
    """
    if not isinstance(means, Tensor) or means.dim() < 2:
        raise ValueError(f"means must be (S, N, *event), got {tuple(getattr(means, 'shape', ()))}")
    _check_means(means)  # before the event dims are laid flat: the examples are named
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
