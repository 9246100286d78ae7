r"""Pareto-smoothed importance sampling (PSIS) and the Pareto :math:`\hat k` diagnostic.

PSIS of Vehtari, Simpson, Gelman, Yao & Gabry (2024), *Pareto smoothed importance sampling*, JMLR
25(72), with the generalized Pareto fit of Zhang & Stephens (2009), *A new and efficient estimation
method for the generalized Pareto distribution*, Technometrics 51(3), computed by ArviZ
(``arviz.psislw``). It is used to check how far an approximate posterior ``q`` can be trusted as an
importance proposal for the target ``p``: given draws :math:`\theta_s \sim q` and log-ratios
:math:`r_s = \log p(\theta_s) - \log q(\theta_s)` (up to a constant), :math:`\hat k < 0.5` is
excellent, :math:`0.5 \le \hat k < 0.7` usable, :math:`\hat k \ge 0.7` unreliable.

This module adds input checks, torch tensors in and out, and one deliberate difference from
ArviZ: when all finite log-ratios are equal (``q`` equals ``p`` up to a constant) the weights are
exactly uniform and :math:`\hat k = -\infty` is returned, whereas ArviZ finds an empty tail and
reports :math:`+\infty`. A degenerate fit (ArviZ's NaN) is reported as :math:`+\infty`.
"""

from __future__ import annotations

import logging
import math
import numbers

import numpy as np
import torch
from torch import Tensor

__all__ = ["importance_ess", "pareto_khat", "psis_smooth", "psis_tail_length"]

logger = logging.getLogger(__name__)


def _as_numpy_1d(values: Tensor | np.ndarray, name: str) -> np.ndarray:
    """Copy ``values`` to a 1-D float64 NumPy array, rejecting complex values, NaN and
    ``+inf``."""
    if isinstance(values, Tensor):
        if values.is_complex():  # (a cast to float drops the imaginary part with a warning)
            raise TypeError(f"{name} must be real, got a {values.dtype} tensor")
        array = values.detach().to("cpu", torch.float64).numpy().copy()
    else:
        raw = np.asarray(values)
        if np.iscomplexobj(raw):
            raise TypeError(f"{name} must be real, got complex values ({raw.dtype})")
        array = np.array(raw, dtype=np.float64, copy=True)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one entry per draw), got shape {array.shape}")
    if array.size == 0:
        raise ValueError(f"{name} is empty")
    if np.isnan(array).any() or np.isposinf(array).any():
        raise ValueError(f"{name} contains NaN or +inf")
    if np.isneginf(array).all():
        raise ValueError(f"{name} is -inf everywhere: all importance weights are zero")
    return array


def psis_tail_length(num_draws: int, r_eff: float = 1.0) -> int:
    r"""Number of largest draws used for the Pareto fit.

    .. math:: M = \lceil \min(0.2\,S,\; 3\sqrt{S / r_{\mathrm{eff}}}) \rceil

    Parameters
    ----------
    num_draws : int
        Number of draws :math:`S`.
    r_eff : float, default 1.0
        Relative efficiency of the draws (effective sample size / S); 1 for independent draws.

    Returns
    -------
    int
        The tail length :math:`M`.

    Raises
    ------
    TypeError
        ``num_draws`` is not an integer, or ``r_eff`` not a real number.
    ValueError
        ``num_draws < 1``, or ``r_eff`` is not finite and > 0.
    """
    if not isinstance(num_draws, numbers.Integral) or isinstance(num_draws, bool):
        raise TypeError(
            f"num_draws must be an integer, the number of draws; got {num_draws!r} "
            f"({type(num_draws).__name__})"
        )
    if num_draws < 1:
        raise ValueError(f"num_draws must be positive, got {num_draws}")
    r_eff = _checked_r_eff(r_eff)
    return int(math.ceil(min(num_draws / 5.0, 3.0 * math.sqrt(num_draws / r_eff))))


def _checked_r_eff(r_eff: object) -> float:
    """``r_eff`` as a float: a finite real number > 0 (an infinite one gave a tail of no draws,
    so a k-hat of ``inf`` that read as an unreliable proposal)."""
    value = None
    if not isinstance(r_eff, (bool, str, bytes)):
        try:
            value = float(r_eff)  # type: ignore[arg-type]  # (NumPy scalars, 1-element tensors)
        except (TypeError, ValueError, RuntimeError):
            value = None
    if value is None:
        raise TypeError(
            f"r_eff must be a finite number > 0 (effective sample size / S; 1 for independent "
            f"draws), got {r_eff!r} ({type(r_eff).__name__})"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"r_eff must be a finite number > 0 (effective sample size / S; 1 for independent "
            f"draws), got {r_eff!r}"
        )
    return value


def _psis(log_ratios: np.ndarray, r_eff: float) -> tuple[np.ndarray, float]:
    """PSIS on a validated float64 1-D array: normalised smoothed log-weights and k-hat."""
    r_eff = _checked_r_eff(r_eff)
    finite = log_ratios[np.isfinite(log_ratios)]
    if log_ratios.size == 1:  # one draw: no tail to fit (arviz.psislw indexes past it)
        return log_ratios - log_ratios, math.inf
    if finite.size == log_ratios.size and finite.min() == finite.max():
        # All weights are equal: importance sampling is exact, the tail is a point mass. (Not
        # when some draws have zero weight: one finite ratio among -inf ones is one draw
        # carrying all the weight, the worst case, which the Pareto fit reports as inf.)
        shifted = log_ratios - finite.max()
        return shifted - math.log(finite.size), -math.inf
    try:
        from arviz import psislw
    except ImportError as err:  # ArviZ 1.x moved it; pyproject.toml asks for arviz>=0.17
        raise ImportError(
            "pyrobayes.diagnostics.psis needs arviz.psislw (ArviZ 0.17 to 0.x): "
            "pip install 'arviz>=0.17,<1'"
        ) from err
    # the GPD fit takes logs of non-positive numbers for some of its grid points (their weights
    # vanish); ArviZ leaves NumPy's warnings on, so they are silenced here
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        log_weights, k_hat = psislw(log_ratios, r_eff)
    k = float(k_hat)
    return np.asarray(log_weights, dtype=np.float64), (math.inf if math.isnan(k) else k)


def psis_smooth(
    log_ratios: Tensor | np.ndarray, r_eff: float = 1.0
) -> tuple[Tensor | np.ndarray, float]:
    r"""Pareto-smooth importance log-ratios and return normalised log-weights and :math:`\hat k`.

    With :math:`S` draws, tail length :math:`M` (see :func:`psis_tail_length`) and
    :math:`\tilde w_s = \exp(r_s - \max_t r_t)`, a generalized Pareto distribution is fitted
    (Zhang-Stephens, see :func:`pareto_khat`) to the exceedances of the :math:`M` largest
    :math:`\tilde w` over :math:`u = \tilde w_{(S-M)}`, the :math:`(S-M)`-th smallest. The
    :math:`z`-th smallest tail weight is then replaced by

    .. math:: \min\big(u + F^{-1}_{\hat k, \hat\sigma}((z - 1/2)/M),\; 1\big), \quad z = 1..M,

    i.e. the expected order statistics of the fit, truncated at the largest raw weight, and the
    log-weights are normalised to :math:`\operatorname{logsumexp}_s \log w_s = 0`. If the fit is
    impossible (fewer than 5 tail draws) or degenerate, :math:`\hat k = \infty` and the raw
    weights are only normalised. If all finite log-ratios are equal, :math:`\hat k = -\infty`.

    Parameters
    ----------
    log_ratios : torch.Tensor or numpy.ndarray
        Shape ``(S,)``: :math:`\log p(\theta_s) - \log q(\theta_s)` for :math:`\theta_s \sim q`,
        up to an additive constant. ``-inf`` (zero weight) is allowed; NaN and ``+inf`` are not.
    r_eff : float, default 1.0
        Relative efficiency (effective sample size / S) of the draws, 1 for independent draws.

    Returns
    -------
    log_weights : torch.Tensor or numpy.ndarray
        Shape ``(S,)``, smoothed normalised log-weights, of the input's type (a tensor keeps the
        input's dtype and device).
    k_hat : float
        Estimated Pareto shape :math:`\hat k`.

    Raises
    ------
    TypeError
        Complex ``log_ratios``, or an ``r_eff`` that is not a real number.
    ValueError
        ``log_ratios`` not 1-D, empty, with NaN or ``+inf``, or ``-inf`` everywhere; ``r_eff``
        not finite and > 0 (an infinite one leaves no tail to fit).
    """
    array = _as_numpy_1d(log_ratios, "log_ratios")
    log_weights, k_hat = _psis(array, r_eff)
    if k_hat >= 0.7:
        logger.debug("PSIS k-hat = %.3f >= 0.7: importance sampling is unreliable", k_hat)
    if isinstance(log_ratios, Tensor):
        dtype = log_ratios.dtype if log_ratios.is_floating_point() else torch.get_default_dtype()
        return torch.as_tensor(log_weights, dtype=dtype, device=log_ratios.device), k_hat
    return log_weights, k_hat


def pareto_khat(log_ratios: Tensor | np.ndarray, r_eff: float = 1.0) -> float:
    r"""Pareto :math:`\hat k` diagnostic of importance log-ratios.

    The shape of a generalized Pareto distribution fitted by the Zhang-Stephens (2009) estimator
    to the :math:`M = \lceil\min(0.2 S, 3\sqrt{S/r_{\mathrm{eff}}})\rceil` largest importance
    ratios (their exceedances over the :math:`(S-M)`-th smallest ratio), shrunk towards 0.5 as
    :math:`\hat k \leftarrow (M \hat k + 5)/(M + 10)`. The weight distribution has finite
    variance for :math:`k < 1/2`; PSIS estimates are reliable for :math:`\hat k < 0.7`.

    Parameters
    ----------
    log_ratios : torch.Tensor or numpy.ndarray
        Shape ``(S,)``, log importance ratios :math:`\log p(\theta_s) - \log q(\theta_s)`.
    r_eff : float, default 1.0
        Relative efficiency of the draws.

    Returns
    -------
    float
        :math:`\hat k`; ``inf`` if fewer than 5 tail draws or the fit is degenerate, ``-inf`` if
        all finite log-ratios are equal.
    """
    return _psis(_as_numpy_1d(log_ratios, "log_ratios"), r_eff)[1]


def importance_ess(log_weights: Tensor | np.ndarray) -> float:
    r"""Effective sample size of importance weights.

    .. math:: \mathrm{ESS} = \frac{1}{\sum_s \bar w_s^2}, \qquad
        \bar w_s = \frac{\exp(\log w_s)}{\sum_t \exp(\log w_t)}

    Parameters
    ----------
    log_weights : torch.Tensor or numpy.ndarray
        Shape ``(S,)``, log importance weights, normalised or not.

    Returns
    -------
    float
        ESS in :math:`[1, S]`; equal weights give :math:`S`.
    """
    array = _as_numpy_1d(log_weights, "log_weights")
    shifted = array - array.max()
    weights = np.exp(shifted)
    weights /= weights.sum()
    return float(1.0 / np.sum(weights**2))
