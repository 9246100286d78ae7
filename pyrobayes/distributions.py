"""Matrix-variate Gaussian distributions for Kronecker-factored posteriors.

Two Pyro distributions over matrices (event shape ``(m, n)``, event_dim 2):

* :class:`MatrixNormal` — the matrix normal ``MN(M, U, V)``, parameterised by Cholesky factors of
  the among-row covariance ``U`` and the among-column covariance ``V``.
* :class:`KronEigenNormal` — a Gaussian whose precision is diagonal in a Kronecker eigenbasis
  ``Q_A ⊗ Q_G`` (the exact-damping posterior of Kron-IVON / Laplace-KRON; Zhang et al., 2018;
  Martens & Grosse, 2015).

Vectorisation conventions
-------------------------
``vec(X)`` stacks the *columns* of ``X``. PyTorch's row-major ``X.reshape(-1)`` stacks the rows,
i.e. ``X.reshape(-1) == vec(Xᵀ)``. For ``X ∈ R^{m×n}``, ``(A ⊗ G) vec(X) = vec(G X Aᵀ)``, and
``(G ⊗ A) X.reshape(-1) = (G X Aᵀ).reshape(-1)``. Dense matrices returned by
``to_dense_covariance`` / ``to_dense_precision`` use the column-stacking ``vec`` by default and the
row-major ``reshape(-1)`` order with ``row_major=True``.

Analytic KL divergences are registered with :func:`torch.distributions.kl.register_kl` between
every pair of the two classes, and from either class to a diagonal Gaussian
``Normal(loc, scale).expand([m, n]).to_event(2)`` (e.g. an isotropic weight prior), so Pyro's
``TraceMeanField_ELBO`` uses closed forms.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pyro.distributions import TorchDistribution
from torch.distributions import Independent, Normal, constraints
from torch.distributions.kl import register_kl

__all__ = ["MatrixNormal", "KronEigenNormal"]

_LOG_2PI = math.log(2.0 * math.pi)


def _solve_lower(L: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``L⁻¹ B`` for lower-triangular ``L`` (batched, broadcasting)."""
    return torch.linalg.solve_triangular(L, B, upper=False)


def _whiten(L_row: torch.Tensor, L_col: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """``L_row⁻¹ D L_col⁻ᵀ`` via two triangular solves (broadcasting batch dims)."""
    Y = torch.linalg.solve_triangular(L_row, D, upper=False)
    return torch.linalg.solve_triangular(L_col.mT, Y, upper=True, left=False)


def _half_logdet_tril(L: torch.Tensor) -> torch.Tensor:
    """``½ log|L Lᵀ| = Σ log diag(L)``."""
    return L.diagonal(dim1=-2, dim2=-1).log().sum(-1)


def _as_tensor(x: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(x, dtype=like.dtype, device=like.device)


def _checked_nonnegative(
    x: torch.Tensor | float, like: torch.Tensor, name: str, owner: str, *, positive: bool
) -> torch.Tensor:
    """``x`` as a tensor like ``like``, every entry finite and > 0 (``positive``) or >= 0.

    Raises
    ------
    ValueError
        Naming ``owner``'s argument ``name`` and its offending values: a negative scale
        squared silently to a positive one, and 0 or NaN gave a NaN divergence.
    """
    value = _as_tensor(x, like)
    detached = value.detach()
    bad = ~torch.isfinite(detached) | ((detached <= 0) if positive else (detached < 0))
    if bool(bad.any()):
        what = "> 0" if positive else ">= 0"
        raise ValueError(
            f"{owner}: {name} must be finite and {what}; got {detached[bad].flatten()[:4].tolist()}"
            f"{' ...' if int(bad.sum()) > 4 else ''}."
        )
    return value


def _check_symmetric(F: torch.Tensor, name: str, size: int) -> None:
    """Refuse a factor that is not a finite symmetric ``size × size`` matrix: ``eigh`` reads
    its lower triangle only, so an asymmetric (e.g. upper-triangular) factor gave another
    posterior."""
    if F.dim() < 2 or F.shape[-2:] != (size, size):
        raise ValueError(
            f"KronEigenNormal.from_factors: {name} must end in ({size}, {size}) for loc's "
            f"(m, n) = its last two dims; got shape {tuple(F.shape)}."
        )
    if not bool(torch.isfinite(F.detach()).all()):
        raise ValueError(f"KronEigenNormal.from_factors: {name} holds NaN or inf values.")
    scale = F.detach().abs().amax().clamp_min(torch.finfo(F.dtype).tiny)
    gap = (F.detach() - F.detach().mT).abs().amax()
    if not bool(gap <= 1e-4 * scale):
        raise ValueError(
            f"KronEigenNormal.from_factors: {name} must be symmetric (a K-FAC factor such as "
            f"aᵀa / N), but |{name} - {name}ᵀ| reaches {float(gap):.3g} of its largest entry "
            f"{float(scale):.3g}; torch.linalg.eigh would read its lower triangle only. Pass "
            f"the symmetric factor (({name} + {name}.mT) / 2 if the asymmetry is round-off)."
        )


class MatrixNormal(TorchDistribution):
    r"""Matrix normal distribution ``X ~ MN(M, U, V)`` over ``m × n`` matrices.

    ``U = L_U L_Uᵀ`` (``m × m``) is the among-row covariance and ``V = L_V L_Vᵀ`` (``n × n``) the
    among-column covariance: ``Cov(X_ij, X_kl) = U_ik V_jl``. Equivalently
    ``vec(X) ~ N(vec(M), V ⊗ U)`` with column-stacking ``vec``, and, in PyTorch's row-major order,
    ``X.reshape(-1) ~ N(M.reshape(-1), U ⊗ V)``. Samples are ``X = M + L_U E L_Vᵀ`` with
    ``E_ij ~ N(0, 1)``. The density is

    .. math::

        \log p(X) = -\tfrac12 \operatorname{tr}[V^{-1}(X-M)^\top U^{-1}(X-M)]
                    - \tfrac{mn}{2}\log 2\pi - \tfrac{n}{2}\log|U| - \tfrac{m}{2}\log|V|.

    Parameters
    ----------
    loc : torch.Tensor
        Mean ``M``, shape ``(..., m, n)``.
    row_scale_tril : torch.Tensor
        Lower-triangular ``L_U`` with positive diagonal, shape ``(..., m, m)``.
    col_scale_tril : torch.Tensor
        Lower-triangular ``L_V`` with positive diagonal, shape ``(..., n, n)``.
    validate_args : bool, optional
        Passed to :class:`torch.distributions.Distribution`.

    Notes
    -----
    Batch dimensions of the three parameters broadcast. ``(c U, V / c)`` defines the same
    distribution for any ``c > 0``.
    """

    arg_constraints = {
        "loc": constraints.independent(constraints.real, 2),
        "row_scale_tril": constraints.lower_cholesky,
        "col_scale_tril": constraints.lower_cholesky,
    }
    support = constraints.independent(constraints.real, 2)
    has_rsample = True

    def __init__(
        self,
        loc: torch.Tensor,
        row_scale_tril: torch.Tensor,
        col_scale_tril: torch.Tensor,
        validate_args: bool | None = None,
    ) -> None:
        if loc.dim() < 2:
            raise ValueError("loc must be at least 2-dimensional (..., m, n)")
        m, n = loc.shape[-2:]
        if row_scale_tril.shape[-2:] != (m, m):
            raise ValueError(f"row_scale_tril must end in ({m}, {m}), got {row_scale_tril.shape}")
        if col_scale_tril.shape[-2:] != (n, n):
            raise ValueError(f"col_scale_tril must end in ({n}, {n}), got {col_scale_tril.shape}")
        batch_shape = torch.broadcast_shapes(
            loc.shape[:-2], row_scale_tril.shape[:-2], col_scale_tril.shape[:-2]
        )
        self.loc = loc.expand(batch_shape + (m, n))
        self.row_scale_tril = row_scale_tril.expand(batch_shape + (m, m))
        self.col_scale_tril = col_scale_tril.expand(batch_shape + (n, n))
        super().__init__(batch_shape, torch.Size((m, n)), validate_args=validate_args)

    def expand(self, batch_shape, _instance=None) -> MatrixNormal:
        new = self._get_checked_instance(MatrixNormal, _instance)
        batch_shape = torch.Size(batch_shape)
        m, n = self.event_shape
        new.loc = self.loc.expand(batch_shape + (m, n))
        new.row_scale_tril = self.row_scale_tril.expand(batch_shape + (m, m))
        new.col_scale_tril = self.col_scale_tril.expand(batch_shape + (n, n))
        super(MatrixNormal, new).__init__(batch_shape, self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    # ----------------------------------------------------------------- moments
    @property
    def mean(self) -> torch.Tensor:
        return self.loc

    @property
    def mode(self) -> torch.Tensor:
        return self.loc

    @property
    def row_covariance(self) -> torch.Tensor:
        """``U = L_U L_Uᵀ``, shape ``(..., m, m)``."""
        return self.row_scale_tril @ self.row_scale_tril.mT

    @property
    def col_covariance(self) -> torch.Tensor:
        """``V = L_V L_Vᵀ``, shape ``(..., n, n)``."""
        return self.col_scale_tril @ self.col_scale_tril.mT

    @property
    def variance(self) -> torch.Tensor:
        """Elementwise variance ``Var(X_ij) = U_ii V_jj``, shape ``(..., m, n)``."""
        du = self.row_scale_tril.pow(2).sum(-1)
        dv = self.col_scale_tril.pow(2).sum(-1)
        return du.unsqueeze(-1) * dv.unsqueeze(-2)

    # ----------------------------------------------------------------- sampling / density
    def rsample(self, sample_shape: torch.Size | list[int] | tuple[int, ...] = ()) -> torch.Tensor:
        """Reparameterised sample ``M + L_U E L_Vᵀ``, shape ``sample_shape + batch + (m, n)``."""
        shape = self._extended_shape(torch.Size(sample_shape))
        eps = torch.randn(shape, dtype=self.loc.dtype, device=self.loc.device)
        return self.loc + self.row_scale_tril @ eps @ self.col_scale_tril.mT

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """Log-density (see class docstring), shape ``sample + batch``."""
        if self._validate_args:
            self._validate_sample(value)
        m, n = self.event_shape
        Z = _whiten(self.row_scale_tril, self.col_scale_tril, value - self.loc)
        maha = Z.pow(2).sum((-2, -1))
        return (
            -0.5 * maha
            - 0.5 * m * n * _LOG_2PI
            - n * _half_logdet_tril(self.row_scale_tril)
            - m * _half_logdet_tril(self.col_scale_tril)
        )

    def log_det_covariance(self) -> torch.Tensor:
        """``log|V ⊗ U| = m log|V| + n log|U|``, shape ``batch``."""
        m, n = self.event_shape
        return 2.0 * (
            n * _half_logdet_tril(self.row_scale_tril) + m * _half_logdet_tril(self.col_scale_tril)
        )

    def entropy(self) -> torch.Tensor:
        """``(mn/2)(1 + log 2π) + (n/2) log|U| + (m/2) log|V|``, shape ``batch``."""
        m, n = self.event_shape
        return 0.5 * m * n * (1.0 + _LOG_2PI) + 0.5 * self.log_det_covariance()

    def kl_to_isotropic(self, prior_scale: torch.Tensor | float) -> torch.Tensor:
        """``KL(q ‖ N(0, s² I_{mn}))``.

        ``½ [tr U tr V / s² + ‖M‖_F² / s² − mn + mn log s² − n log|U| − m log|V|]``.

        Parameters
        ----------
        prior_scale : torch.Tensor or float
            Prior standard deviation ``s`` (scalar or broadcastable to ``batch_shape``).
        """
        m, n = self.event_shape
        owner = f"{type(self).__name__}.kl_to_isotropic"
        s2 = _checked_nonnegative(prior_scale, self.loc, "prior_scale", owner, positive=True).pow(2)
        tr = self.row_scale_tril.pow(2).sum((-2, -1)) * self.col_scale_tril.pow(2).sum((-2, -1))
        mm = self.loc.pow(2).sum((-2, -1))
        return 0.5 * ((tr + mm) / s2 - m * n + m * n * s2.log() - self.log_det_covariance())

    def to_dense_covariance(self, row_major: bool = False) -> torch.Tensor:
        """Dense ``V ⊗ U`` (column-stacking vec) or ``U ⊗ V`` (``row_major=True``)."""
        U, V = self.row_covariance, self.col_covariance
        return _bkron(U, V) if row_major else _bkron(V, U)

    def to_dense_precision(self, row_major: bool = False) -> torch.Tensor:
        """Inverse of :meth:`to_dense_covariance` in the same ordering."""
        Ui = torch.cholesky_inverse(self.row_scale_tril)
        Vi = torch.cholesky_inverse(self.col_scale_tril)
        return _bkron(Ui, Vi) if row_major else _bkron(Vi, Ui)


def _bkron(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Batched Kronecker product over the last two dims."""
    batch = torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
    a1, a2 = A.shape[-2:]
    b1, b2 = B.shape[-2:]
    out = A[..., :, None, :, None] * B[..., None, :, None, :]
    return out.expand(batch + (a1, b1, a2, b2)).reshape(batch + (a1 * b1, a2 * b2))


class KronEigenNormal(TorchDistribution):
    r"""Gaussian over ``m × n`` matrices with precision diagonal in a Kronecker eigenbasis.

    For a weight ``W ∈ R^{m×n}`` (``m = d_out``, ``n = d_in``), the precision of ``vec(W)``
    (column stacking) is

    .. math::

        \Lambda = (Q_A \otimes Q_G)\,\operatorname{diag}(\operatorname{vec} P)\,
                  (Q_A \otimes Q_G)^\top ,

    i.e. ``P_ij > 0`` is the precision along the eigen-direction ``vec(q_{G,i} q_{A,j}ᵀ)``. In
    PyTorch row-major order, ``W.reshape(-1)`` has precision
    ``(Q_G ⊗ Q_A) diag(P.reshape(-1)) (Q_G ⊗ Q_A)ᵀ``. With ``Y = Q_Gᵀ (W − M) Q_A`` the density is

    .. math::

        \log p(W) = -\tfrac12 \sum_{ij} P_{ij} Y_{ij}^2 - \tfrac{mn}{2}\log 2\pi
                    + \tfrac12 \sum_{ij} \log P_{ij},

    and samples are ``W = M + Q_G (E ⊘ sqrt(P)) Q_Aᵀ`` with ``E_ij ~ N(0, 1)``. For exact damping
    (eigenbasis damping of Noisy K-FAC, Zhang et al., 2018) ``P = λ (γ aᵀ + δ)``; see :meth:`from_factors`. If ``P`` is a rank-one outer
    product this is a matrix normal, otherwise it is not.

    Parameters
    ----------
    loc : torch.Tensor
        Mean ``M``, shape ``(..., m, n)``.
    eigvecs_in : torch.Tensor
        Orthogonal ``Q_A`` (columns are eigenvectors of the input factor), shape ``(..., n, n)``.
    eigvecs_out : torch.Tensor
        Orthogonal ``Q_G`` (columns are eigenvectors of the output factor), shape ``(..., m, m)``.
    precision_eig : torch.Tensor
        Positive eigenvalues ``P`` of the precision, shape ``(..., m, n)``.
    validate_args : bool, optional
        Passed to :class:`torch.distributions.Distribution`. Orthogonality is not checked.
    """

    arg_constraints = {
        "loc": constraints.independent(constraints.real, 2),
        "eigvecs_in": constraints.independent(constraints.real, 2),
        "eigvecs_out": constraints.independent(constraints.real, 2),
        "precision_eig": constraints.independent(constraints.positive, 2),
    }
    support = constraints.independent(constraints.real, 2)
    has_rsample = True

    def __init__(
        self,
        loc: torch.Tensor,
        eigvecs_in: torch.Tensor,
        eigvecs_out: torch.Tensor,
        precision_eig: torch.Tensor,
        validate_args: bool | None = None,
    ) -> None:
        if loc.dim() < 2:
            raise ValueError("loc must be at least 2-dimensional (..., m, n)")
        m, n = loc.shape[-2:]
        if eigvecs_in.shape[-2:] != (n, n):
            raise ValueError(f"eigvecs_in must end in ({n}, {n}), got {eigvecs_in.shape}")
        if eigvecs_out.shape[-2:] != (m, m):
            raise ValueError(f"eigvecs_out must end in ({m}, {m}), got {eigvecs_out.shape}")
        if precision_eig.shape[-2:] != (m, n):
            raise ValueError(f"precision_eig must end in ({m}, {n}), got {precision_eig.shape}")
        batch_shape = torch.broadcast_shapes(
            loc.shape[:-2], eigvecs_in.shape[:-2], eigvecs_out.shape[:-2], precision_eig.shape[:-2]
        )
        self.loc = loc.expand(batch_shape + (m, n))
        self.eigvecs_in = eigvecs_in.expand(batch_shape + (n, n))
        self.eigvecs_out = eigvecs_out.expand(batch_shape + (m, m))
        self.precision_eig = precision_eig.expand(batch_shape + (m, n))
        super().__init__(batch_shape, torch.Size((m, n)), validate_args=validate_args)

    def expand(self, batch_shape, _instance=None) -> KronEigenNormal:
        new = self._get_checked_instance(KronEigenNormal, _instance)
        batch_shape = torch.Size(batch_shape)
        m, n = self.event_shape
        new.loc = self.loc.expand(batch_shape + (m, n))
        new.eigvecs_in = self.eigvecs_in.expand(batch_shape + (n, n))
        new.eigvecs_out = self.eigvecs_out.expand(batch_shape + (m, m))
        new.precision_eig = self.precision_eig.expand(batch_shape + (m, n))
        super(KronEigenNormal, new).__init__(batch_shape, self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_factors(
        cls,
        loc: torch.Tensor,
        A: torch.Tensor,
        G: torch.Tensor,
        num_data: float,
        prior_precision: float | torch.Tensor,
        damping: Literal["exact", "factored"] = "exact",
        validate_args: bool | None = None,
    ) -> KronEigenNormal:
        r"""Build the Kron-IVON / Laplace-KRON posterior from K-FAC factors (Martens & Grosse, 2015).

        With ``λ = num_data`` and ``δ = prior_precision / num_data`` (so ``λδ`` is the absolute
        prior precision of every weight), and eigendecompositions ``A = Q_A diag(a) Q_Aᵀ``,
        ``G = Q_G diag(γ) Q_Gᵀ`` (eigenvalues clamped at 0):

        * ``damping="exact"``: ``Λ = λ (A ⊗ G + δ I) = N (A ⊗ G) + prior_precision · I``, i.e.
          ``P = λ (γ aᵀ + δ)``.
        * ``damping="factored"`` (Noisy K-FAC π-damping, a true matrix normal):
          ``U = λ⁻¹ (G + π⁻¹ √δ I)⁻¹``, ``V = (A + π √δ I)⁻¹`` with
          ``π = sqrt((tr A / n) / (tr G / m))``; ``Λ = V⁻¹ ⊗ U⁻¹``, i.e.
          ``P = λ (γ + √δ/π)(a + π √δ)ᵀ``.

        Parameters
        ----------
        loc : torch.Tensor
            Mean ``M``, shape ``(..., m, n)``.
        A : torch.Tensor
            Symmetric PSD input factor, shape ``(..., n, n)``.
        G : torch.Tensor
            Symmetric PSD output factor, shape ``(..., m, m)``.
        num_data : float
            ``λ`` (effective sample size ``N``).
        prior_precision : float or torch.Tensor
            Absolute prior precision ``λδ`` (scalar or broadcastable to the batch shape).
        damping : {"exact", "factored"}
            Damping scheme.

        Raises
        ------
        ValueError
            ``A`` or ``G`` not a finite symmetric matrix of loc's ``n`` or ``m`` (``eigh``
            would read one triangle), ``num_data`` not
            finite and > 0 (0 allowed for ``"exact"``), ``prior_precision`` negative or not
            finite, or an unknown ``damping``.
        """
        owner = "KronEigenNormal.from_factors"
        if damping not in ("exact", "factored"):
            raise ValueError(f"damping must be 'exact' or 'factored', got {damping!r}")
        lam = float(num_data)
        if not (math.isfinite(lam) and (lam > 0 or (lam == 0 and damping == "exact"))):
            raise ValueError(
                f"{owner}: num_data must be a finite number > 0 (>= 0 for damping='exact'), "
                f"the effective sample size λ; got {num_data!r}."
            )
        pp = _checked_nonnegative(prior_precision, loc, "prior_precision", owner, positive=False)
        if loc.dim() < 2:
            raise ValueError("loc must be at least 2-dimensional (..., m, n)")
        _check_symmetric(A, "A", loc.shape[-1])
        _check_symmetric(G, "G", loc.shape[-2])
        a, Q_A = torch.linalg.eigh(A)
        g, Q_G = torch.linalg.eigh(G)
        a, g = a.clamp_min(0.0), g.clamp_min(0.0)
        if damping == "exact":
            P = lam * g.unsqueeze(-1) * a.unsqueeze(-2) + pp[..., None, None]
        else:  # "factored"
            m, n = loc.shape[-2:]
            delta = pp / lam
            tiny = torch.finfo(a.dtype).tiny
            pi = ((a.sum(-1) / n).clamp_min(tiny) / (g.sum(-1) / m).clamp_min(tiny)).sqrt()
            sd = delta.sqrt()
            g_d = g + (sd / pi)[..., None]
            a_d = a + (pi * sd)[..., None]
            P = lam * g_d.unsqueeze(-1) * a_d.unsqueeze(-2)
        return cls(loc, Q_A, Q_G, P, validate_args=validate_args)

    # ----------------------------------------------------------------- helpers
    def _to_eig(self, X: torch.Tensor) -> torch.Tensor:
        """``Q_Gᵀ X Q_A``."""
        return self.eigvecs_out.mT @ X @ self.eigvecs_in

    def _from_eig(self, Y: torch.Tensor) -> torch.Tensor:
        """``Q_G Y Q_Aᵀ``."""
        return self.eigvecs_out @ Y @ self.eigvecs_in.mT

    # ----------------------------------------------------------------- moments
    @property
    def mean(self) -> torch.Tensor:
        return self.loc

    @property
    def mode(self) -> torch.Tensor:
        return self.loc

    @property
    def variance(self) -> torch.Tensor:
        """``Var(W_kl) = Σ_ij Q_G[k,i]² P_ij⁻¹ Q_A[l,j]²``, shape ``(..., m, n)``."""
        return self.eigvecs_out.pow(2) @ self.precision_eig.reciprocal() @ self.eigvecs_in.pow(2).mT

    # ----------------------------------------------------------------- sampling / density
    def rsample(self, sample_shape: torch.Size | list[int] | tuple[int, ...] = ()) -> torch.Tensor:
        """Reparameterised sample ``M + Q_G (E ⊘ sqrt(P)) Q_Aᵀ``."""
        shape = self._extended_shape(torch.Size(sample_shape))
        eps = torch.randn(shape, dtype=self.loc.dtype, device=self.loc.device)
        return self.loc + self._from_eig(eps * self.precision_eig.rsqrt())

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """Log-density (see class docstring), shape ``sample + batch``."""
        if self._validate_args:
            self._validate_sample(value)
        m, n = self.event_shape
        Y = self._to_eig(value - self.loc)
        maha = (self.precision_eig * Y.pow(2)).sum((-2, -1))
        return -0.5 * maha - 0.5 * m * n * _LOG_2PI - 0.5 * self.log_det_covariance()

    def log_det_covariance(self) -> torch.Tensor:
        """``log|Σ| = −Σ_ij log P_ij``, shape ``batch``."""
        return -self.precision_eig.log().sum((-2, -1))

    def entropy(self) -> torch.Tensor:
        """``(mn/2)(1 + log 2π) − ½ Σ_ij log P_ij``, shape ``batch``."""
        m, n = self.event_shape
        return 0.5 * m * n * (1.0 + _LOG_2PI) + 0.5 * self.log_det_covariance()

    def kl_to_isotropic(self, prior_scale: torch.Tensor | float) -> torch.Tensor:
        """``KL(q ‖ N(0, s² I_{mn})) = ½ [Σ P⁻¹/s² + ‖M‖_F²/s² − mn + mn log s² + Σ log P]``.

        Parameters
        ----------
        prior_scale : torch.Tensor or float
            Prior standard deviation ``s`` (scalar or broadcastable to ``batch_shape``).
        """
        m, n = self.event_shape
        owner = f"{type(self).__name__}.kl_to_isotropic"
        s2 = _checked_nonnegative(prior_scale, self.loc, "prior_scale", owner, positive=True).pow(2)
        tr = self.precision_eig.reciprocal().sum((-2, -1))
        mm = self.loc.pow(2).sum((-2, -1))
        return 0.5 * ((tr + mm) / s2 - m * n + m * n * s2.log() - self.log_det_covariance())

    def precondition(self, grad: torch.Tensor) -> torch.Tensor:
        """``Λ⁻¹ g`` in matrix form: ``Q_G [(Q_Gᵀ g Q_A) ⊘ P] Q_Aᵀ`` (shape of ``grad``).

        With ``P = λ(γ aᵀ + δ)`` this is ``λ⁻¹ (A ⊗ G + δ I)⁻¹ vec(g)``; multiply by ``λ`` to get
        the Kronecker IVON mean-step preconditioner.
        """
        return self._from_eig(self._to_eig(grad) / self.precision_eig)

    def _dense(self, diag: torch.Tensor, row_major: bool) -> torch.Tensor:
        if row_major:
            Q = _bkron(self.eigvecs_out, self.eigvecs_in)
            d = diag.reshape(diag.shape[:-2] + (-1,))
        else:
            Q = _bkron(self.eigvecs_in, self.eigvecs_out)
            d = diag.mT.reshape(diag.shape[:-2] + (-1,))
        return (Q * d.unsqueeze(-2)) @ Q.mT

    def to_dense_precision(self, row_major: bool = False) -> torch.Tensor:
        """``(Q_A ⊗ Q_G) diag(vec P) (Q_A ⊗ Q_G)ᵀ`` (or the row-major ordering)."""
        return self._dense(self.precision_eig, row_major)

    def to_dense_covariance(self, row_major: bool = False) -> torch.Tensor:
        """Inverse of :meth:`to_dense_precision` in the same ordering."""
        return self._dense(self.precision_eig.reciprocal(), row_major)


# --------------------------------------------------------------------------- KL divergences
def _gauss_kl(
    m: int,
    n: int,
    trace: torch.Tensor,
    maha: torch.Tensor,
    logdet_p: torch.Tensor,
    logdet_q: torch.Tensor,
) -> torch.Tensor:
    """``½ [tr(Σp⁻¹Σq) + Δᵀ Σp⁻¹ Δ − mn + log|Σp| − log|Σq|]``."""
    return 0.5 * (trace + maha - m * n + logdet_p - logdet_q)


@register_kl(MatrixNormal, MatrixNormal)
def _kl_mn_mn(q: MatrixNormal, p: MatrixNormal) -> torch.Tensor:
    if q.event_shape != p.event_shape:
        raise ValueError("KL between matrix normals of different event shapes")
    m, n = q.event_shape
    tr_u = _solve_lower(p.row_scale_tril, q.row_scale_tril).pow(2).sum((-2, -1))
    tr_v = _solve_lower(p.col_scale_tril, q.col_scale_tril).pow(2).sum((-2, -1))
    Z = _whiten(p.row_scale_tril, p.col_scale_tril, q.loc - p.loc)
    return _gauss_kl(
        m, n, tr_u * tr_v, Z.pow(2).sum((-2, -1)), p.log_det_covariance(), q.log_det_covariance()
    )


@register_kl(KronEigenNormal, KronEigenNormal)
def _kl_ke_ke(q: KronEigenNormal, p: KronEigenNormal) -> torch.Tensor:
    if q.event_shape != p.event_shape:
        raise ValueError("KL between distributions of different event shapes")
    m, n = q.event_shape
    # tr(Σp⁻¹ Σq) = Σ_ij Pp_ij Σ_kl (Q_Gpᵀ Q_Gq)_ik² Pq_kl⁻¹ (Q_Apᵀ Q_Aq)_jl²
    RG = (p.eigvecs_out.mT @ q.eigvecs_out).pow(2)
    RA = (p.eigvecs_in.mT @ q.eigvecs_in).pow(2)
    trace = (p.precision_eig * (RG @ q.precision_eig.reciprocal() @ RA.mT)).sum((-2, -1))
    Y = p._to_eig(q.loc - p.loc)
    maha = (p.precision_eig * Y.pow(2)).sum((-2, -1))
    return _gauss_kl(m, n, trace, maha, p.log_det_covariance(), q.log_det_covariance())


@register_kl(MatrixNormal, KronEigenNormal)
def _kl_mn_ke(q: MatrixNormal, p: KronEigenNormal) -> torch.Tensor:
    if q.event_shape != p.event_shape:
        raise ValueError("KL between distributions of different event shapes")
    m, n = q.event_shape
    # tr(Σp⁻¹ (V⊗U)) = Σ_ij P_ij (q_Gᵢᵀ U q_Gᵢ)(q_Aⱼᵀ V q_Aⱼ)
    du = (q.row_scale_tril.mT @ p.eigvecs_out).pow(2).sum(-2)
    dv = (q.col_scale_tril.mT @ p.eigvecs_in).pow(2).sum(-2)
    trace = (p.precision_eig * du.unsqueeze(-1) * dv.unsqueeze(-2)).sum((-2, -1))
    Y = p._to_eig(q.loc - p.loc)
    maha = (p.precision_eig * Y.pow(2)).sum((-2, -1))
    return _gauss_kl(m, n, trace, maha, p.log_det_covariance(), q.log_det_covariance())


@register_kl(KronEigenNormal, MatrixNormal)
def _kl_ke_mn(q: KronEigenNormal, p: MatrixNormal) -> torch.Tensor:
    if q.event_shape != p.event_shape:
        raise ValueError("KL between distributions of different event shapes")
    m, n = q.event_shape
    # tr((V⁻¹⊗U⁻¹) Σq) = Σ_kl Pq_kl⁻¹ ‖L_U⁻¹ q_Gₖ‖² ‖L_V⁻¹ q_Aₗ‖²
    du = _solve_lower(p.row_scale_tril, q.eigvecs_out).pow(2).sum(-2)
    dv = _solve_lower(p.col_scale_tril, q.eigvecs_in).pow(2).sum(-2)
    trace = (q.precision_eig.reciprocal() * du.unsqueeze(-1) * dv.unsqueeze(-2)).sum((-2, -1))
    Z = _whiten(p.row_scale_tril, p.col_scale_tril, q.loc - p.loc)
    return _gauss_kl(
        m, n, trace, Z.pow(2).sum((-2, -1)), p.log_det_covariance(), q.log_det_covariance()
    )


def _diag_normal_params(p: Independent, event_shape: torch.Size) -> tuple[torch.Tensor, ...]:
    """Unwrap ``Independent(…Normal…)`` with two event dims into ``(loc, scale)``."""
    base, ndims = p, 0
    while isinstance(base, Independent):
        ndims += base.reinterpreted_batch_ndims
        base = base.base_dist
    if not isinstance(base, Normal) or ndims != 2 or p.event_shape != event_shape:
        raise NotImplementedError(
            "KL to Independent is implemented only for Normal(...).to_event(2) with a matching "
            "event shape"
        )
    return base.loc, base.scale


def _kl_to_diag_normal(q: MatrixNormal | KronEigenNormal, p: Independent) -> torch.Tensor:
    loc_p, scale_p = _diag_normal_params(p, q.event_shape)
    m, n = q.event_shape
    var_p = scale_p.pow(2)
    trace = (q.variance / var_p).sum((-2, -1))
    maha = ((q.loc - loc_p).pow(2) / var_p).sum((-2, -1))
    logdet_p = (2.0 * scale_p.log()).expand(torch.broadcast_shapes(scale_p.shape, q.loc.shape))
    return _gauss_kl(m, n, trace, maha, logdet_p.sum((-2, -1)), q.log_det_covariance())


@register_kl(MatrixNormal, Independent)
def _kl_mn_indep(q: MatrixNormal, p: Independent) -> torch.Tensor:
    return _kl_to_diag_normal(q, p)


@register_kl(KronEigenNormal, Independent)
def _kl_ke_indep(q: KronEigenNormal, p: Independent) -> torch.Tensor:
    return _kl_to_diag_normal(q, p)
