r"""Pareto-smoothed importance sampling (PSIS) and the Pareto :math:`\hat k` diagnostic.

An in-house implementation of Vehtari, Simpson, Gelman, Yao & Gabry (2024), *Pareto smoothed
importance sampling*, JMLR 25(72), with the generalized Pareto fit of Zhang & Stephens (2009),
*A new and efficient estimation method for the generalized Pareto distribution*, Technometrics
51(3). It is used to check how far an approximate posterior ``q`` can be trusted as an importance
proposal for the target ``p``: given draws :math:`\theta_s \sim q` and log-ratios
:math:`r_s = \log p(\theta_s) - \log q(\theta_s)` (up to a constant), :math:`\hat k < 0.5` is
excellent, :math:`0.5 \le \hat k < 0.7` usable, :math:`\hat k \ge 0.7` unreliable.

The numerics follow the classic algorithm (as in ArviZ 0.x ``psislw`` and R ``loo`` 2.x), so the
results agree with ``arviz.psislw(log_ratios, r_eff)`` to round-off. One deliberate difference:
when all finite log-ratios are equal (``q`` equals ``p`` up to a constant) the weights are exactly
uniform and :math:`\hat k = -\infty` is returned here, whereas ArviZ finds an empty tail and
reports :math:`+\infty`.

Everything is computed with NumPy in float64; torch tensors are accepted and returned.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from torch import Tensor

__all__ = ["importance_ess", "pareto_khat", "psis_smooth", "psis_tail_length"]

logger = logging.getLogger(__name__)

_MIN_TAIL = 5  # fewer tail draws than this: no GPD fit, k-hat = inf
_PRIOR_K_STRENGTH = 10.0  # weakly informative prior on k: n_0 = 10 pseudo-draws at k = 0.5
_PRIOR_K_MEAN = 0.5
_PRIOR_BS = 3.0  # Zhang-Stephens prior scale for b


def _as_numpy_1d(values: Tensor | np.ndarray, name: str) -> np.ndarray:
    """Copy ``values`` to a 1-D float64 NumPy array, rejecting NaN and ``+inf``."""
    if isinstance(values, Tensor):
        array = values.detach().to("cpu", torch.float64).numpy().copy()
    else:
        array = np.array(values, dtype=np.float64, copy=True)
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
    """
    if num_draws < 1:
        raise ValueError(f"num_draws must be positive, got {num_draws}")
    if not r_eff > 0:
        raise ValueError(f"r_eff must be positive, got {r_eff}")
    return int(math.ceil(min(num_draws / 5.0, 3.0 * math.sqrt(num_draws / r_eff))))


def _gpd_fit(exceedances: np.ndarray) -> tuple[float, float]:
    r"""Zhang-Stephens empirical-Bayes fit of a generalized Pareto distribution.

    For ascending exceedances :math:`x_1 \le \dots \le x_n` (all :math:`> 0`), with
    :math:`m = 30 + \lfloor\sqrt n\rfloor` and, for :math:`j = 1..m`,

    .. math::

        b_j = \frac{1}{x_n} + \frac{1 - \sqrt{m / (j - 1/2)}}{3\, x_{\lfloor n/4 + 1/2\rfloor}},
        \quad k_j = \frac1n \sum_i \log(1 - b_j x_i),
        \quad L_j = n\,(\log(-b_j / k_j) - k_j - 1),

    the weights :math:`w_j = 1 / \sum_i \exp(L_i - L_j)` give :math:`\hat b = \sum_j w_j b_j`,
    :math:`\hat k = \frac1n\sum_i \log(1 - \hat b x_i)` and :math:`\hat\sigma = -\hat k/\hat b`,
    after which :math:`\hat k` is shrunk towards 0.5:
    :math:`\hat k \leftarrow (n\hat k + 5)/(n+10)`.
    (Here :math:`k` is the shape in the convention where :math:`k > 0` is a heavy tail.)
    Weights below :math:`10\,\epsilon` are dropped and the rest renormalised, as ArviZ and
    ``loo`` do; this only changes :math:`\hat b` at round-off level.

    Parameters
    ----------
    exceedances : numpy.ndarray
        Ascending positive exceedances over the threshold, length :math:`n \ge 5`.

    Returns
    -------
    tuple of float
        ``(k_hat, sigma_hat)``; ``k_hat`` is ``inf`` when the fit is degenerate.
    """
    n = exceedances.size
    m = 30 + int(math.floor(math.sqrt(n)))
    j = np.arange(1, m + 1, dtype=np.float64)
    quartile = exceedances[int(math.floor(n / 4.0 + 0.5)) - 1]
    b = 1.0 / exceedances[-1] + (1.0 - np.sqrt(m / (j - 0.5))) / (_PRIOR_BS * quartile)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        k = np.log1p(-b[:, None] * exceedances[None, :]).mean(axis=1)
        profile = n * (np.log(-b / k) - k - 1.0)
        weights = 1.0 / np.exp(profile[None, :] - profile[:, None]).sum(axis=1)
    keep = weights >= 10.0 * np.finfo(np.float64).eps
    if not keep.any() or not np.isfinite(weights[keep]).all():
        return math.inf, math.nan
    weights = weights[keep] / weights[keep].sum()
    b_hat = float(np.sum(b[keep] * weights))
    k_hat = float(np.log1p(-b_hat * exceedances).mean())
    if not (math.isfinite(k_hat) and b_hat != 0.0):
        return math.inf, math.nan
    sigma_hat = -k_hat / b_hat
    k_hat = (n * k_hat + _PRIOR_K_STRENGTH * _PRIOR_K_MEAN) / (n + _PRIOR_K_STRENGTH)
    return k_hat, sigma_hat


def _gpd_quantile(probs: np.ndarray, k: float, sigma: float) -> np.ndarray:
    r"""Generalized Pareto quantile function for ``0 < probs < 1``.

    .. math:: F^{-1}(p) = \sigma\, \frac{(1 - p)^{-k} - 1}{k}
        \quad (\;= -\sigma \log(1 - p) \text{ for } k = 0)
    """
    if abs(k) < np.finfo(np.float64).eps:
        return -sigma * np.log1p(-probs)
    return sigma * np.expm1(-k * np.log1p(-probs)) / k


def _psis(log_ratios: np.ndarray, r_eff: float) -> tuple[np.ndarray, float]:
    """PSIS on a float64 1-D array; returns normalised smoothed log-weights and k-hat."""
    num_draws = log_ratios.size
    tail_length = psis_tail_length(num_draws, r_eff)
    shifted = log_ratios - log_ratios.max()  # max is finite: inputs were validated
    finite = shifted[np.isfinite(shifted)]
    if finite.min() == finite.max():
        # All non-zero weights are equal: importance sampling is exact, tail is a point mass.
        k_hat = -math.inf
    else:
        order = np.argsort(shifted, kind="stable")
        # Threshold: the (S - M)-th smallest value (floored at log of the smallest normal
        # double, as ArviZ does); the tail is every draw strictly above it, normally the M largest.
        cut_index = max(num_draws - tail_length - 1, 0)
        log_threshold = max(float(shifted[order[cut_index]]), math.log(np.finfo(np.float64).tiny))
        tail_idx = order[shifted[order] > log_threshold]  # ascending
        if tail_idx.size < _MIN_TAIL:
            k_hat = math.inf
        else:
            threshold = math.exp(log_threshold)
            exceedances = np.exp(shifted[tail_idx]) - threshold
            k_hat, sigma_hat = _gpd_fit(exceedances)
            if math.isfinite(k_hat):
                size = tail_idx.size
                probs = (np.arange(1, size + 1, dtype=np.float64) - 0.5) / size
                smoothed = np.log(_gpd_quantile(probs, k_hat, sigma_hat) + threshold)
                shifted[tail_idx] = np.minimum(smoothed, 0.0)  # truncate at the largest raw weight
    finite_max = shifted.max()
    log_norm = finite_max + math.log(np.exp(shifted - finite_max).sum())
    return shifted - log_norm, k_hat


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
