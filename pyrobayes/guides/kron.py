r"""Kronecker IVON's posterior: a Kronecker-factored Gaussian per 2-D adapter weight.

For a weight ``W ∈ R^{d_out×d_in}`` fed by inputs ``a`` with pre-activations ``s = W a``:

.. math:: q(\operatorname{vec} W) = \mathcal N\big(\operatorname{vec} M,\ [λ(A ⊗ G + δ I)]^{-1}\big)

with ``A ≈ E[a aᵀ]`` and ``G ≈ E[∇_s l ∇_s lᵀ]`` the K-FAC factors (Martens & Grosse, 2015),
``λ = ess`` and ``δ = weight_decay``: the Noisy K-FAC posterior (Zhang et al., 2018, "Noisy
natural gradient as variational inference", ICML) with IVON's update (Shen et al., 2024). The
default ``damping="exact"`` damps in the Kronecker eigenbasis
(:class:`~pyrobayes.distributions.KronEigenNormal`); ``damping="factored"`` is Noisy K-FAC's
π-damping, a true :class:`~pyrobayes.distributions.MatrixNormal`.

Covered sites: LoRA-XS cores, LoRA factors ``A`` and ``B`` and whole latent ``nn.Linear``
weights; biases and every other site are diagonal IVON sites (:class:`~pyrobayes.guides.IVONGuide`).
This module holds the posterior only (factors, their eigendecompositions, the means, the damping);
the statistics, their schedule and the update are :mod:`pyrobayes.infer.kron`'s
(``default_fitter = "kron-ivon"``, settings :class:`pyrobayes.infer.KronIVON`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pyro.distributions as dist
import torch
from torch import Tensor

from ..distributions import KronEigenNormal, MatrixNormal
from ..models.adapters import check_int, check_real
from .ivon import IVONGuide

__all__ = ["KroneckerIVONGuide", "eigh_factor", "damped_eigenvalues"]

_KRON_KINDS = ("core", "lora_xs_core", "weight", "lora_A", "lora_B")


def eigh_factor(F: Tensor, *, float64_max_dim: int = 2048) -> tuple[Tensor, Tensor]:
    """``(eigenvalues clamped ≥ 0, eigenvectors)`` of symmetric factors ``(..., d, d)``.

    Factors up to ``float64_max_dim`` wide are decomposed in float64; results in ``F``'s dtype.
    """
    work = F.double() if F.shape[-1] <= float64_max_dim else F.float()
    vals, vecs = torch.linalg.eigh(0.5 * (work + work.mT))
    return vals.clamp_min(0.0).to(F.dtype), vecs.to(F.dtype)


def damped_eigenvalues(a: Tensor, g: Tensor, weight_decay: float, damping: str = "exact") -> Tensor:
    r"""Eigenvalues ``(..., d_out, d_in)`` of the damped curvature ``A ⊗ G + δ`` in its eigenbasis.

    ``"exact"``: ``γ aᵀ + δ``. ``"factored"`` (Noisy K-FAC π-damping, Zhang et al., 2018):
    ``(γ + √δ/π)(a + π√δ)ᵀ`` with ``π = sqrt((tr A/d_in)/(tr G/d_out))``, one π per factor pair
    (also for stacked eigenvalues ``(K, d)``).
    """
    if damping == "exact":
        return g.unsqueeze(-1) * a.unsqueeze(-2) + weight_decay
    if damping == "factored":
        tiny = torch.finfo(a.dtype).tiny
        pi = (
            a.mean(-1, keepdim=True).clamp_min(tiny) / g.mean(-1, keepdim=True).clamp_min(tiny)
        ).sqrt()
        root = math.sqrt(weight_decay)
        return (g + root / pi).unsqueeze(-1) * (a + pi * root).unsqueeze(-2)
    raise ValueError(f"Expected damping 'exact' or 'factored' but got {damping!r}.")


class KroneckerIVONGuide(IVONGuide):
    r"""Kronecker-factored Gaussian over 2-D adapter weights, fitted by Kronecker IVON (the
    Kronecker-factored natural-gradient VI of Zhang et al., 2018, "Noisy natural gradient as
    variational inference", with IVON's update of Shen et al., 2024).

    .. math:: q(\operatorname{vec} W) = \mathcal N\big(\operatorname{vec} M,\
              [λ(A ⊗ G + δ I)]^{-1}\big)

    Parameters
    ----------
    model : FineTuneModel
    damping : {"exact", "factored"}
        Damping in the eigenbasis (``λ(γ aᵀ + δ)``) or Noisy K-FAC π-damping (matrix normal).
    beta2, diag_beta2, fisher, T_stats, T_inv : optional
        Deprecated here: settings of the fit, not of the posterior (the factors' EMA, the
        diagonal sites' Hessian EMA, the Fisher estimator of ``G`` and the statistics /
        re-decomposition periods). Pass them to the fitter as ``pb.fit(...,
        optim=pb.Optimization(optimizer=pb.infer.KronIVON(T_inv=..., fisher=...)))``
        (:class:`pyrobayes.infer.KronIVON`); given here they still reach the fitter for one
        release, with a ``DeprecationWarning``, and are not saved with the posterior.
    **kwargs
        :class:`~pyrobayes.guides.IVONGuide`'s options (``ess``, ``hess_init``,
        ``weight_decay``, ``point_weight_decay``, ``point_prior_loc``, ``init_loc``; its
        deprecated fit settings). ``A`` and ``G`` start at ``sqrt(h0) I`` so ``A ⊗ G = h0 I``.

    Notes
    -----
    The fitter (:class:`~pyrobayes.infer.kron.KronIVONFitter`) estimates, per step with ``B``
    examples (``S·B`` rows after the sample expansion), ``Â = (1/R) Σ_rows ā āᵀ`` over the
    ``R`` real (non-padding) rows of the layer's input and ``Ĝ = (1/(S·B)) Σ ∇_s l ∇_s lᵀ``.
    """

    family = "kron-ivon"
    default_fitter = "kron-ivon"
    fit_options = (*IVONGuide.fit_options, "diag_beta2", "fisher", "T_stats", "T_inv")
    fit_settings_class = "KronIVON"

    def __init__(
        self,
        model: Any,
        *,
        beta2: float | None = None,
        diag_beta2: float | None = None,
        damping: str = "exact",
        fisher: str | None = None,
        T_stats: int | None = None,
        T_inv: int | None = None,
        **kwargs: Any,
    ) -> None:
        if damping not in ("exact", "factored"):
            raise ValueError(f"Expected damping 'exact' or 'factored' but got {damping!r}.")
        owner = f"{type(self).__name__}: "
        more: dict[str, Any] = {}  # deprecated fit settings: checked here, warned by the base
        if diag_beta2 is not None:
            more["diag_beta2"] = check_real("diag_beta2", diag_beta2, ge=0, lt=1, owner=owner)
        if fisher is not None:
            fisher = "ggn" if fisher == "ggn_last" else fisher
            if fisher not in ("empirical", "mc", "ggn"):
                raise ValueError(f"Expected fisher 'empirical', 'mc' or 'ggn' but got {fisher!r}.")
            more["fisher"] = fisher
        if T_stats is not None:
            more["T_stats"] = check_int("T_stats", T_stats, ge=1, owner=owner)
        if T_inv is not None:
            more["T_inv"] = check_int("T_inv", T_inv, ge=1, owner=owner)
        self.__dict__["_more_fit_settings"] = more
        self.damping = damping
        specs = getattr(model, "latent_sites", {}) or {}
        #: the Kronecker sites, in site order (the others are diagonal)
        self.kron_sites = [
            s for s, spec in specs.items() if spec.kind in _KRON_KINDS and len(spec.shape) == 2
        ]
        super().__init__(model, beta2=beta2, **kwargs)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any, **kw: Any) -> None:
        # posteriors saved before the step counter moved to the fitter carry "num_updates"
        state_dict.pop(prefix + "num_updates", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kw)

    def _setup_curvature(self, site: str, loc: Tensor) -> None:
        if site not in self.kron_sites:
            return super()._setup_curvature(site, loc)
        i, (d_out, d_in) = self._index[site], loc.shape
        root = self.hyper["hess_init"] ** 0.5
        eye_in = torch.eye(d_in, dtype=loc.dtype, device=loc.device)
        eye_out = torch.eye(d_out, dtype=loc.dtype, device=loc.device)
        self.register_buffer(f"A_{i}", root * eye_in)
        self.register_buffer(f"G_{i}", root * eye_out)
        self.register_buffer(f"eigval_in_{i}", root * eye_in.diagonal().clone())
        self.register_buffer(f"eigvec_in_{i}", eye_in)
        self.register_buffer(f"eigval_out_{i}", root * eye_out.diagonal().clone())
        self.register_buffer(f"eigvec_out_{i}", eye_out)

    # ------------------------------------------------------------------ the posterior
    def is_kron(self, site: str) -> bool:
        return site in self.kron_sites

    def factors(self, site: str) -> tuple[Tensor, Tensor]:
        """``(A, G)`` of a Kronecker site (buffers the fitter updates in place)."""
        i, b = self._index[site], self._buffers  # direct reads: no PyroModule.__getattr__
        return b[f"A_{i}"], b[f"G_{i}"]  # type: ignore[return-value]

    def eigen(self, site: str) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """``((a, Q_A), (γ, Q_G))``: the factors' eigendecompositions as of :meth:`refresh`."""
        i, b = self._index[site], self._buffers
        names = (f"eigval_in_{i}", f"eigvec_in_{i}", f"eigval_out_{i}", f"eigvec_out_{i}")
        a, qa, g, qg = (b[n] for n in names)
        return (a, qa), (g, qg)  # type: ignore[return-value]

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-decompose every factor; same-shape factors share one batched ``eigh``."""
        pairs = [
            (F_, e)
            for s in self.kron_sites
            for F_, e in zip(self.factors(s), self.eigen(s), strict=True)
        ]
        groups: dict[tuple[Any, ...], list[tuple[Tensor, tuple[Tensor, Tensor]]]] = {}
        for F_, e in pairs:
            groups.setdefault((F_.shape, F_.dtype, F_.device), []).append((F_, e))
        for group in groups.values():
            vals, vecs = eigh_factor(torch.stack([F_ for F_, _ in group]))
            torch._foreach_copy_(
                [t for _, e in group for t in e],
                [t for pair in zip(vals, vecs, strict=True) for t in pair],
            )

    def damped(self, site: str) -> Tensor:
        """Eigenvalues of ``A ⊗ G + δ`` (as damped) in the Kronecker basis, ``(d_out, d_in)``."""
        (a, _), (g, _) = self.eigen(site)
        return damped_eigenvalues(a, g, self.weight_decay, self.damping)

    def get_posterior(self, site: str) -> dist.TorchDistribution:
        if site not in self.kron_sites:
            return super().get_posterior(site)
        # q in the state's dtype (float32 on a half-precision network; the model runs each draw
        # in its site's dtype): λ(A ⊗ G + δ) of about 1e5 is inf in float16, and every draw
        # of a float16 q came out equal to its mean
        (a, Qa), (g, Qg) = self.eigen(site)
        loc = self.loc(site)
        if self.damping == "exact":
            P = self.ess * self.damped(site)
            return KronEigenNormal(loc.to(P.dtype), Qa, Qg, P)
        # factored: U = λ⁻¹ Q_G diag(1/(γ+√δ/π)) Q_Gᵀ, V = Q_A diag(1/(a+π√δ)) Q_Aᵀ
        tiny = torch.finfo(a.dtype).tiny
        pi = (a.mean().clamp_min(tiny) / g.mean().clamp_min(tiny)).sqrt()
        root = self.weight_decay**0.5
        U = (Qg / (self.ess * (g + root / pi))) @ Qg.mT
        V = (Qa / (a + pi * root)) @ Qa.mT
        L_U = torch.linalg.cholesky(0.5 * (U + U.mT))
        L_V = torch.linalg.cholesky(0.5 * (V + V.mT))
        return MatrixNormal(loc.to(L_U.dtype), L_U, L_V)

    def basis(self, sites: Sequence[str]) -> tuple[Tensor, Tensor, Tensor]:
        """``(Q_A, Q_G, D)`` of ``K`` same-shape Kronecker sites stacked on a leading axis:
        the eigenbases `(K, d, d)` and the damped eigenvalues `(K, d_out, d_in)`."""
        return self._basis(sites)[:3]

    def kron_perturbation(self, sites: Sequence[str], eps: Tensor) -> Tensor:
        r"""``θ − M = Q_G (ε ⊘ sqrt(λD)) Q_Aᵀ`` for standard-normal ``eps`` `(S, K, d_out, d_in)`
        over ``K`` same-shape Kronecker ``sites`` (one batched product)."""
        Qa, Qg, _, inv_root = self._basis(sites)
        return Qg @ (eps * inv_root) @ Qa.mT

    def _basis(self, sites: Sequence[str]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """:meth:`basis` and ``(λD)^{-1/2}``, cached until the eigendecompositions change."""
        eig = [t for s in sites for pair in self.eigen(s) for t in pair]
        cache = self.__dict__.setdefault("_basis_cache", {})
        hit = cache.get(tuple(sites))
        if hit is None or any(
            t is not u or t._version != v for t, (u, v) in zip(eig, hit[0], strict=True)
        ):
            a, qa, g, qg = (torch.stack(eig[j::4]) for j in range(4))
            D = damped_eigenvalues(a, g, self.weight_decay, self.damping)
            hit = cache[tuple(sites)] = (
                [(t, t._version) for t in eig],
                (qa, qg, D, (self.ess * D).rsqrt()),
            )
        return hit[1]

    def perturbation(self, eps: Tensor) -> Tensor:
        r"""``θ − m`` for standard-normal ``eps`` `(S, T)` over all sites laid flat in site order:
        ``σ ⊙ ε`` at diagonal sites, :meth:`kron_perturbation` at Kronecker ones."""
        parts = {}
        for site, e in self.unpack(eps).items():
            if site in self.kron_sites:
                parts[site] = self.kron_perturbation([site], e.unsqueeze(1))[:, 0]
            else:
                parts[site] = e * self.scale(site)
        return self.pack(parts)
