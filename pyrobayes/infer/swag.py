r"""SWAG moment collection (Maddox et al., 2019) as an explicit ``init`` / ``step`` state.

After each collection ``n ← n + 1`` and

.. math::

    \bar θ \leftarrow \bar θ + (θ - \bar θ)/n,\qquad
    \overline{θ^2} \leftarrow \overline{θ^2} + (θ^2 - \overline{θ^2})/n,\qquad
    \hat D \leftarrow [\hat D,\ θ - \bar θ]_{\text{last } K}

The deviation is taken against the running mean *at collection time* (as in Maddox's code), not
the final mean. The posterior built from the state is
``N(θ̄, s·(Σ_diag + D̂ D̂ᵀ/(K−1)))`` with ``Σ_diag = max(θ²̄ − θ̄², 1e-30)`` and ``K`` the number of
stored deviations; ``s = 0.5`` is Maddox's ½.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import pyro.distributions as dist
import torch
from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = ["SwagState", "swag_init", "swag_step", "swag_posterior", "SwagCollector", "VAR_FLOOR"]

#: floor of the diagonal variance (SPECS 2(a))
VAR_FLOOR = 1e-30


class SwagState(NamedTuple):
    """SWAG moments of ``d`` coordinates with room for ``K`` deviations.

    - **num_collected** - ``Tensor ()`` long: n, iterates collected so far.
    - **mean** - ``Tensor (d,)``: θ̄.
    - **sq_mean** - ``Tensor (d,)``: θ²̄.
    - **deviations** - ``Tensor (K, d)``: the last ``min(n, K)`` deviations in the *last* rows,
      oldest first (unfilled rows are zero).
    """

    num_collected: Tensor
    mean: Tensor
    sq_mean: Tensor
    deviations: Tensor

    @property
    def rank(self) -> int:
        """K, the capacity of the deviation buffer."""
        return int(self.deviations.shape[0])

    @property
    def num_deviations(self) -> int:
        """Number of stored deviations ``min(n, K)``."""
        return min(int(self.num_collected), self.rank)

    @property
    def diag_variance(self) -> Tensor:
        """``Σ_diag = max(θ²̄ − θ̄², 1e-30)`` `(d,)`."""
        return (self.sq_mean - self.mean.square()).clamp_min(VAR_FLOOR)

    @property
    def deviation_matrix(self) -> Tensor:
        """``D̂`` `(d, k)` with the ``k = min(n, K)`` stored deviations as columns (oldest first)."""
        k = self.num_deviations
        return self.deviations[self.rank - k :].T


def swag_init(
    dim: int, rank: int, *, dtype: torch.dtype | None = None, device: torch.device | None = None
) -> SwagState:
    """Empty SWAG state over ``dim`` coordinates keeping ``rank`` deviations."""
    if rank < 1:
        raise ValueError(f"Expected rank >= 1 but got {rank}.")
    kw = {"dtype": dtype or torch.get_default_dtype(), "device": device}
    return SwagState(
        torch.zeros((), dtype=torch.long, device=device),
        torch.zeros(dim, **kw),
        torch.zeros(dim, **kw),
        torch.zeros(rank, dim, **kw),
    )


def swag_step(state: SwagState, theta: Tensor) -> SwagState:
    """Collect one iterate ``theta`` `(d,)`; returns the new state (the old one is unchanged)."""
    theta = theta.detach().reshape(-1).to(state.mean)
    if theta.shape != state.mean.shape:
        raise ValueError(f"Expected an iterate of shape {tuple(state.mean.shape)}.")
    n = state.num_collected + 1
    w = 1.0 / n.to(state.mean.dtype)
    mean = state.mean + (theta - state.mean) * w
    sq_mean = state.sq_mean + (theta.square() - state.sq_mean) * w
    deviations = torch.cat([state.deviations[1:], (theta - mean).unsqueeze(0)], 0)
    return SwagState(n, mean, sq_mean, deviations)


def swag_posterior(state: SwagState, scale: float = 0.5) -> dist.LowRankMultivariateNormal:
    r"""``N(θ̄, s Σ_diag + s D̂ D̂ᵀ/(K−1))`` as a ``LowRankMultivariateNormal`` over ``d``.

    ``K`` is the number of stored deviations (``K − 1`` is floored at 1); with fewer than two
    collected iterates the covariance is degenerate (a warning is logged).
    """
    if int(state.num_collected) < 2:
        logger.warning("SWAG posterior from %d iterate(s) is degenerate.", int(state.num_collected))
    k = state.num_deviations
    factor = state.deviation_matrix * (scale / max(k - 1, 1)) ** 0.5
    if k == 0:
        factor = state.mean.new_zeros(state.mean.shape[0], 1)
    return dist.LowRankMultivariateNormal(state.mean, factor, scale * state.diag_variance)


class SwagCollector:
    """Stateful convenience wrapper: ``c = SwagCollector(d, K); c.step(θ); c.posterior(s)``."""

    def __init__(
        self,
        dim: int,
        rank: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.state = swag_init(dim, rank, dtype=dtype, device=device)

    def step(self, theta: Tensor) -> SwagState:
        self.state = swag_step(self.state, theta)
        return self.state

    def posterior(self, scale: float = 0.5) -> dist.LowRankMultivariateNormal:
        return swag_posterior(self.state, scale)
