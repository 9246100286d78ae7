r"""The marginal likelihood of a prior precision τ under the second-order expansion of the
log-likelihood at the fitted point: the evidence ``Laplace(evidence="quadratic")`` maximises.

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

Here the log-likelihood is replaced by its expansion at ``θ̂`` — value, gradient
``g = ∇ log p(D|θ̂)`` and the GGN ``H`` — and the Gaussian prior is integrated against it exactly,
with no assumption on where ``θ̂`` is (a mode of the posterior, of the likelihood, or an
early-stopped iterate). In the eigenbasis of ``H`` (eigenvalues ``λ_i``; ``θ̂_i``, ``g_i`` the
rotated point and gradient; a Kronecker site rotates by both factors' eigenvectors):

.. math:: \log p(D\mid τ) ≈ \log p(D\mid θ̂) + \tfrac12 \sum_i \Big[
          \frac{(g_i - τθ̂_i)^2}{λ_i + τ} - τθ̂_i^2 - \log\big(1 + λ_i/τ\big) \Big].

For a linear-Gaussian model this is the exact evidence at any ``θ̂`` (Bishop 2006, eq. 3.86,
rewritten around ``θ̂``). At a stationary point of the likelihood (``g = 0``) a coordinate costs
``θ̂_i² λ_iτ/(λ_i+τ)``, which is ``λ_i θ̂_i²`` and not ``τ θ̂_i²`` where ``λ_i ≪ τ``: what the data
cannot see does not move τ. With the exact GGN a coordinate without curvature also has no
gradient (``g_i² ≤ λ_i · Σ_n r_nᵀ Λ_n⁻¹ r_n``, ``r_n`` the output residuals), so its term
vanishes whatever its value.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["eigen_coordinates", "quadratic_log_evidence", "effective_parameters"]


def eigen_coordinates(
    guide: Any, gradient: dict[str, Tensor] | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(λ, θ̂, g)``: the curvature's eigenvalues, and the point and ``gradient`` (per site, the
    site's shape; zeros when ``None``) in its eigenbasis, over every latent site of a fitted
    :class:`~pyrobayes.guides.LaplaceGuide`, flattened (float64).

    ``structure="diag"``: ``λ`` is the diagonal GGN and the vectors are as they are. ``"kron"``:
    ``λ = γ aᵀ`` (the factors' eigenvalue products) and ``Θ ↦ Q_Gᵀ Θ Q_A`` (a bias: ``Q_Gᵀ θ``).
    """
    lams: list[Tensor] = []
    coords: list[Tensor] = []
    grads: list[Tensor] = []
    for site in guide.sites:
        if not guide.is_latent(site):
            continue
        lam = guide.curvature(site).detach().double()
        theta = guide.loc(site).detach().double()
        grad = (
            torch.zeros_like(theta) if gradient is None else gradient[site].detach().double()
        ).to(theta.device)
        if guide.structure == "kron":
            q_out, q_in = (q.detach().double() for q in guide.eigvecs(site))
            if lam.dim() == 2:
                theta, grad = q_out.T @ theta @ q_in, q_out.T @ grad @ q_in
            else:
                theta, grad = q_out.T @ theta, q_out.T @ grad
        lams.append(lam.reshape(-1))
        coords.append(theta.reshape(-1))
        grads.append(grad.reshape(-1))
    if not lams:
        raise ValueError("eigen_coordinates: the guide has no latent sites with a curvature.")
    return torch.cat(lams), torch.cat(coords), torch.cat(grads)


def quadratic_log_evidence(
    curvature: Tensor, coords: Tensor, gradient: Tensor, prior_precision: float
) -> float:
    r"""``log p(D | τ) − log p(D | θ̂)`` under the log-likelihood's second-order expansion at
    ``θ̂`` (the module docstring's formula), from :func:`eigen_coordinates`' ``(λ, θ̂, g)``."""
    tau = float(prior_precision)
    lam = curvature.clamp_min(0.0)
    fit = (gradient - tau * coords).pow(2) / (lam + tau) - tau * coords.pow(2)
    return float(0.5 * (fit - torch.log1p(lam / tau)).sum())


def effective_parameters(curvature: Tensor, prior_precision: float) -> float:
    """``γ = Σ_i λ_i / (λ_i + τ)``: how many directions the data determine at τ (MacKay 1992)."""
    lam = curvature.clamp_min(0.0)
    return float((lam / (lam + float(prior_precision))).sum())
