r"""The marginal likelihood of a prior precision τ with the fitted point taken as the
likelihood's mode: the evidence ``Laplace(evidence="likelihood_mode")`` maximises.

laplace-torch's post-hoc evidence (Immer et al. 2021; :mod:`pyrobayes.infer.laplace`) treats the
fitted point ``θ̂`` as the mode of the posterior under the prior ``N(0, τ⁻¹ I)`` it scores,

.. math:: \log p(D\mid τ) ≈ \log p(D\mid θ̂) - \tfrac τ2 \|θ̂\|^2
          - \tfrac12 \log\det(I + H/τ),

so every coordinate of ``θ̂`` is charged ``τ θ̂_i²``, also those the data do not determine. An
adapter trained by Adam under a weak prior is not such a mode: Adam moves every coordinate by
about its step size whatever the size of its gradient, so coordinates without curvature drift
from their (random, for LoRA's ``A``) initialisation and ``‖θ̂‖²`` counts the drift. The
maximiser ``τ = γ/‖θ̂‖²`` (MacKay 1992, ``γ`` the effective number of parameters) is then
too small and the posterior too wide in exactly the directions the data do not see.

Taking ``θ̂`` instead as the mode of the log-likelihood, approximated by its quadratic
``\log p(D\mid θ̂) - \tfrac12 (θ - θ̂)^\top H (θ - θ̂)``, the prior integrates exactly (the
linear-Gaussian evidence; MacKay 1992, Bishop 2006, eq. 3.86). In the eigenbasis of ``H``
(eigenvalues ``λ_i``, coordinates ``θ̂_i``; a Kronecker site rotates by both factors'
eigenvectors):

.. math:: \log p(D\mid τ) = \log p(D\mid θ̂)
          - \tfrac12 \sum_i \Big[ θ̂_i^2 \frac{λ_i τ}{λ_i + τ} + \log\big(1 + λ_i/τ\big) \Big].

A coordinate with ``λ_i ≪ τ`` costs ``λ_i θ̂_i²`` instead of ``τ θ̂_i²``: what the data cannot see
does not move τ. The stationary point is ``τ = γ / Σ_i w_i² θ̂_i²`` with ``w_i = λ_i/(λ_i+τ)``
and ``γ = Σ_i w_i``: MacKay's update with ``θ̂`` replaced by the posterior mean ``w ⊙ θ̂`` that
the prior would give. Both forms agree when every ``λ_i ≫ τ``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "eigen_coordinates",
    "likelihood_mode_log_evidence",
    "posterior_mode_log_evidence",
    "effective_parameters",
]


def eigen_coordinates(guide: Any, sites: Sequence[str] | None = None) -> tuple[Tensor, Tensor]:
    """``(λ, θ̂)``: the curvature's eigenvalues and the point in its eigenbasis, over every
    latent site of a fitted :class:`~pyrobayes.guides.LaplaceGuide` (or those of ``sites``),
    flattened (float64).

    ``structure="diag"``: ``λ`` is the diagonal GGN and ``θ̂`` the point as it is. ``"kron"``:
    ``λ = γ aᵀ`` (the factors' eigenvalue products) and ``θ̂ = Q_Gᵀ Θ Q_A`` (a bias: ``Q_Gᵀ θ``).
    """
    lams: list[Tensor] = []
    coords: list[Tensor] = []
    for site in guide.sites:
        if not guide.is_latent(site) or (sites is not None and site not in sites):
            continue
        lam = guide.curvature(site).detach().double()
        theta = guide.loc(site).detach().double()
        if guide.structure == "kron":
            q_out, q_in = (q.detach().double() for q in guide.eigvecs(site))
            theta = q_out.T @ theta @ q_in if lam.dim() == 2 else q_out.T @ theta
        lams.append(lam.reshape(-1))
        coords.append(theta.reshape(-1))
    if not lams:
        raise ValueError("eigen_coordinates: the guide has no latent sites with a curvature.")
    return torch.cat(lams), torch.cat(coords)


def likelihood_mode_log_evidence(
    curvature: Tensor, coords: Tensor, prior_precision: float
) -> float:
    r"""``log p(D | τ) − log p(D | θ̂)`` with ``θ̂`` the mode of the quadratic log-likelihood
    (the module docstring's formula), from :func:`eigen_coordinates`' ``(λ, θ̂)``."""
    tau = float(prior_precision)
    lam = curvature.clamp_min(0.0)
    data_fit = coords.pow(2) * lam * tau / (lam + tau)
    return float(-0.5 * (data_fit + torch.log1p(lam / tau)).sum())


def posterior_mode_log_evidence(curvature: Tensor, coords: Tensor, prior_precision: float) -> float:
    r"""laplace-torch's ``log p(D | τ) − log p(D | θ̂)`` with ``θ̂`` the posterior's mode,
    ``−τ‖θ̂‖²/2 − Σ_i log(1 + λ_i/τ)/2``, from :func:`eigen_coordinates`' ``(λ, θ̂)`` (for
    comparing the two at a stored curvature; the fit itself calls laplace-torch)."""
    tau = float(prior_precision)
    lam = curvature.clamp_min(0.0)
    return float(-0.5 * (tau * coords.pow(2) + torch.log1p(lam / tau)).sum())


def effective_parameters(curvature: Tensor, prior_precision: float) -> float:
    """``γ = Σ_i λ_i / (λ_i + τ)``: how many directions the data determine at τ (MacKay 1992)."""
    lam = curvature.clamp_min(0.0)
    return float((lam / (lam + float(prior_precision))).sum())
