"""Frozen projections ``(A, B)`` for LoRA-XS adapters.

Row-vector convention throughout: ``W0`` in ``R^{d_in x d_out}`` is the *transpose* of a
``torch.nn.Linear`` weight (stored ``(out, in)``), and a LoRA-XS layer computes

.. math::

    y = x W_0 + \\frac{\\alpha}{r} x A R B,

with ``A in R^{d_in x r}`` and ``B in R^{r x d_out}`` frozen and the ``r x r`` core ``R`` trainable
(initialised near zero). Every projection here returns ``(A, B)`` with the method's initial core
``R0`` already absorbed into ``A``, so that ``W0 ~= A B`` (exactly so at full rank).

Methods (see :data:`PROJECTIONS` and :func:`project`):

``"svd"``
    Truncated SVD, optimal in Frobenius norm (Eckart-Young).
``"wsvd"``
    Whitened SVD, optimal for the activation error ``E_x ||x W0 - x W_hat||^2`` under a given input
    covariance; the covariance is collected with :class:`InputMoments` /
    :func:`collect_input_moments`.
``"dct"``
    Fixed 2-D DCT-II basis on a norm-sorted weight, keeping the most energetic frequencies.
``"random"``
    Haar-random orthonormal bases (the data-independent baseline).

All computations run in float64; the returned factors have the dtype and device of the input.
"""

from __future__ import annotations

import logging
import math
import operator
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from ..user_frame import user_stacklevel

__all__ = [
    "PROJECTIONS",
    "MOMENTS",
    "InputMoments",
    "collect_input_moments",
    "dct_ii_matrix",
    "dct_projection",
    "haar_stiefel",
    "project",
    "random_projection",
    "svd_projection",
    "wsvd_projection",
]

logger = logging.getLogger(__name__)

PROJECTIONS: tuple[str, ...] = ("svd", "wsvd", "dct", "random")
"""Valid ``method`` names for :func:`project`."""

MOMENTS: tuple[str, ...] = ("centered", "second")
"""Valid ``moment`` names for :meth:`InputMoments.covariance` and :func:`wsvd_projection`."""

_EIG_FLOOR = 1e-10  # floor on the eigenvalues of Sigma_xx before taking (inverse) square roots
_NORM_FLOOR = 1e-8  # floor on the column norms s_j of V_raw in W-SVD


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def _as_float64(weight_in_out: Tensor) -> Tensor:
    if not isinstance(weight_in_out, Tensor):
        raise TypeError(f"weight_in_out must be a torch.Tensor, got {type(weight_in_out).__name__}")
    if weight_in_out.dim() != 2:
        raise ValueError(
            "weight_in_out must be a 2-D (d_in, d_out) matrix (the transpose of an nn.Linear "
            f"weight), got shape {tuple(weight_in_out.shape)}"
        )
    if not weight_in_out.is_floating_point():
        raise TypeError(f"weight_in_out must be floating point, got {weight_in_out.dtype}")
    w = weight_in_out.detach().to(torch.float64)
    if not bool(torch.isfinite(w).all()):
        bad = int((~torch.isfinite(w)).sum())
        raise ValueError(
            f"weight_in_out (the base layer's weight W0, shape {tuple(w.shape)}, "
            f"{weight_in_out.dtype}) holds {bad} non-finite (NaN or inf) entries, so no "
            "projection of it is defined (the SVD fails, the DCT and random factors are NaN). "
            "The pretrained weights are corrupt, e.g. overflowed in a cast to float16: load "
            "them again (in float32 or bfloat16), or leave this layer out of target_modules."
        )
    return w


def _check_generator(generator: object) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator or None, got {type(generator).__name__}; "
            "for a seed, pass generator=torch.Generator().manual_seed(seed)."
        )


def _check_rank(rank: int, upper: int, name: str = "rank", what: str = "min(d_in, d_out)") -> int:
    if isinstance(rank, bool):
        raise TypeError(f"{name} must be an integer, got a bool")
    try:
        rank = operator.index(rank)
    except TypeError as err:
        raise TypeError(f"{name} must be an integer, got {type(rank).__name__}") from err
    if not 1 <= rank <= upper:
        raise ValueError(f"{name} must satisfy 1 <= {name} <= {what} = {upper}, got {name}={rank}")
    return rank


def _fix_svd_signs(u: Tensor, vh: Tensor) -> tuple[Tensor, Tensor]:
    """Flip singular-vector pairs so the largest-magnitude entry of each row of ``vh`` is positive.

    ``u[:, j] s_j vh[j, :]`` is unchanged by flipping both signs, so this only removes the
    backend-dependent sign ambiguity of the SVD and makes the frozen factors reproducible.
    """
    idx = vh.abs().argmax(dim=1, keepdim=True)
    sign = torch.sign(torch.gather(vh, 1, idx)).squeeze(1)
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)
    return u * sign, vh * sign[:, None]


def _sym_sqrt_pair(covariance: Tensor) -> tuple[Tensor, Tensor, int]:
    """``(Sigma^{1/2}, Sigma^{-1/2}, n_clamped)`` from ``Sigma = Q diag(L) Q^T``, ``L >= 1e-10``."""
    sym = 0.5 * (covariance + covariance.T)
    eigvals, eigvecs = torch.linalg.eigh(sym)
    n_clamped = int((eigvals < _EIG_FLOOR).sum())
    root = eigvals.clamp_min(_EIG_FLOOR).sqrt()
    sqrt_cov = (eigvecs * root) @ eigvecs.T
    inv_sqrt_cov = (eigvecs / root) @ eigvecs.T
    return sqrt_cov, inv_sqrt_cov, n_clamped


def _check_covariance(cov: Tensor, given: torch.dtype) -> None:
    """Refuse a float64 ``cov`` that is not a covariance: asymmetric, or with a negative
    eigenvalue, beyond the rounding of its ``given`` dtype (``sqrt(eps)`` relative)."""
    tol = math.sqrt(torch.finfo(given).eps)
    scale = float(cov.abs().max())
    asym = float((cov - cov.T).abs().max())
    if asym > tol * scale:
        raise ValueError(
            f"covariance is not symmetric (largest |C - C^T| = {asym:.3g} against entries up to "
            f"{scale:.3g}): pass the input covariance Sigma_xx (or InputMoments), e.g. "
            "collect_input_moments(net, [name], batches, forward)[name]"
        )
    eigvals = torch.linalg.eigvalsh(0.5 * (cov + cov.T))
    lowest, top = float(eigvals[0]), float(eigvals.abs().max())
    if lowest < -tol * top:
        raise ValueError(
            f"covariance is not positive semi-definite (smallest eigenvalue {lowest:.3g}, "
            f"largest |eigenvalue| {top:.3g}): a covariance has no negative eigenvalues. Pass "
            "the input covariance Sigma_xx (not, e.g., a precision or a difference of "
            "matrices), or InputMoments from collect_input_moments"
        )


def _check_moment(moment: str) -> str:
    if moment not in MOMENTS:
        raise ValueError(f"moment must be one of {MOMENTS}, got {moment!r}")
    return moment


# --------------------------------------------------------------------------------------------------
# input statistics for W-SVD
# --------------------------------------------------------------------------------------------------


class InputMoments:
    """Streaming first and second moments of layer inputs, in float64.

    Keeps the count ``n``, the mean ``mu`` and the centred sum of squares
    ``M2 = sum_i (x_i - mu)(x_i - mu)^T`` and merges batches with Chan et al.'s parallel update:

    .. math::

        n = n_a + n_b,\\quad
        \\delta = \\mu_b - \\mu_a,\\quad
        \\mu = \\mu_a + \\delta\\, n_b / n,\\quad
        M_2 = M_{2,a} + M_{2,b} + \\delta \\delta^T n_a n_b / n.

    Parameters
    ----------
    dim : int or None
        Feature dimension ``d_in``; inferred from the first :meth:`update` when ``None``.

    Attributes
    ----------
    n : int
        Number of (unmasked) rows seen.
    mean : Tensor or None
        ``(d_in,)`` running mean ``mu`` (``None`` before any data).
    m2 : Tensor or None
        ``(d_in, d_in)`` centred sum of squares ``M2``.
    """

    def __init__(self, dim: int | None = None) -> None:
        self.dim: int | None = dim
        self.n: int = 0
        self.mean: Tensor | None = None
        self.m2: Tensor | None = None

    def __repr__(self) -> str:
        return f"InputMoments(dim={self.dim}, n={self.n})"

    def _merge_stats(self, n_b: int, mean_b: Tensor, m2_b: Tensor) -> None:
        if n_b == 0:
            return
        if self.mean is None or self.m2 is None or self.n == 0:
            self.n, self.mean, self.m2 = n_b, mean_b.clone(), m2_b.clone()
            return
        mean_b = mean_b.to(self.mean.device)
        m2_b = m2_b.to(self.m2.device)
        n_a = self.n
        n = n_a + n_b
        delta = mean_b - self.mean
        self.mean = self.mean + delta * (n_b / n)
        self.m2 = self.m2 + m2_b + torch.outer(delta, delta) * (n_a * n_b / n)
        self.n = n

    def update(self, x: Tensor, mask: Tensor | None = None) -> InputMoments:
        """Add a batch of activations.

        Parameters
        ----------
        x : Tensor
            Activations of shape ``(..., d_in)``.
        mask : Tensor or None
            Boolean mask of shape ``x.shape[:-1]``; rows where it is ``False`` (e.g. padding tokens)
            are ignored. ``None`` keeps every row.

        Returns
        -------
        InputMoments
            ``self``, for chaining.
        """
        if x.dim() < 1:
            raise ValueError("x must have shape (..., d_in), got a scalar")
        d_in = x.shape[-1]
        if self.dim is None:
            self.dim = d_in
        elif d_in != self.dim:
            raise ValueError(f"x has last dimension {d_in}, but these moments have d_in={self.dim}")
        x = x.detach()
        if mask is not None:
            if tuple(mask.shape) != tuple(x.shape[:-1]):
                raise ValueError(
                    f"mask must have the leading shape of x, {tuple(x.shape[:-1])}, "
                    f"got {tuple(mask.shape)}"
                )
            rows = x[mask.to(device=x.device, dtype=torch.bool)]
        else:
            rows = x.reshape(-1, d_in)
        rows = rows.to(torch.float64)
        n_b = rows.shape[0]
        if n_b == 0:
            return self
        mean_b = rows.mean(dim=0)
        centred = rows - mean_b
        self._merge_stats(n_b, mean_b, centred.T @ centred)
        return self

    def merge(self, other: InputMoments) -> InputMoments:
        """Fold another accumulator into this one (Chan's parallel update); returns ``self``."""
        if other.n == 0 or other.mean is None or other.m2 is None:
            return self
        if self.dim is not None and other.dim != self.dim:
            raise ValueError(f"cannot merge moments of d_in={other.dim} into d_in={self.dim}")
        self.dim = other.dim
        self._merge_stats(other.n, other.mean, other.m2)
        return self

    def covariance(self, moment: str = "centered") -> Tensor:
        """Input covariance ``Sigma_xx`` for W-SVD.

        Parameters
        ----------
        moment : {"centered", "second"}
            ``"centered"``: unbiased covariance ``M2 / (n - 1)``.
            ``"second"``: raw second moment ``E[x x^T] = M2 / n + mu mu^T``.

        Returns
        -------
        Tensor
            ``(d_in, d_in)`` float64 matrix.
        """
        _check_moment(moment)
        if self.mean is None or self.m2 is None or self.n == 0:
            raise ValueError("no activations recorded yet; call update() with calibration data")
        if moment == "centered":
            if self.n < 2:
                raise ValueError("the centered covariance needs at least 2 unmasked rows")
            return self.m2 / (self.n - 1)
        return self.m2 / self.n + torch.outer(self.mean, self.mean)


def collect_input_moments(
    net: nn.Module,
    module_names: list[str] | str,
    batches: Iterable[Any],
    forward: Callable[[nn.Module, Any], object],
    mask_fn: Callable[[Any], Tensor | None] | None = None,
    max_batches: int | None = None,
    *,
    eval_mode: bool = True,
) -> dict[str, InputMoments]:
    """Accumulate :class:`InputMoments` of the inputs of named modules over calibration batches.

    A forward pre-hook on each module in ``module_names`` feeds its first positional input
    ``x`` (shape ``(..., d_in)``) to :meth:`InputMoments.update` with the batch's mask. Runs under
    ``torch.no_grad()``; the hooks are removed (and the training flags restored) even if
    ``forward`` raises.

    Parameters
    ----------
    net : nn.Module
        Network containing the modules.
    module_names : list of str or str
        Names as in ``net.named_modules()``; a single string is one name (never split into
        its characters).
    batches : Iterable
        Calibration batches.
    forward : Callable[[nn.Module, batch], object]
        Runs ``net`` on one batch, e.g. ``lambda m, b: m(**b)``.
    mask_fn : Callable[[batch], Tensor or None] or None
        Returns a boolean mask with the batch's leading shape (e.g. ``attention_mask`` of shape
        ``(B, T)`` for activations ``(B, T, d_in)``, or ``(B,)`` for ``(B, d_in)``), ``False``
        marking padding rows to ignore; ``None`` keeps every row. A module whose activations do
        not have the mask's leading shape (a pooled layer) is collected unmasked.
    max_batches : int or None
        Stop after this many batches.
    eval_mode : bool
        Put ``net`` in eval mode while collecting (so dropout does not perturb the statistics).

    Returns
    -------
    dict of str to InputMoments
        One accumulator per module name.
    """
    if isinstance(module_names, str):  # one path, not a sequence of one-letter paths
        module_names = [module_names]
    named = dict(net.named_modules())
    missing = [name for name in module_names if name not in named]
    if missing:
        raise ValueError(
            f"collect_input_moments: module_names {missing} not found in "
            f"{type(net).__name__}; name modules by their full path, as in net.named_modules()."
        )
    if max_batches is not None and max_batches < 0:
        raise ValueError(f"max_batches must be >= 0 or None, got {max_batches}")

    moments = {name: InputMoments() for name in module_names}
    current_mask: list[Tensor | None] = [None]

    def make_hook(name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not args or not isinstance(args[0], Tensor):
                raise TypeError(f"module {name!r} was not called with a tensor first argument")
            x, mask = args[0], current_mask[0]
            if mask is not None and tuple(mask.shape) != tuple(x.shape[:-1]):
                # a pooled layer (e.g. BERT's pooler sees (B, d)): token padding does not apply
                mask = None
            moments[name].update(x, mask)

        return hook

    training = {mod: mod.training for mod in net.modules()}
    handles = [named[name].register_forward_pre_hook(make_hook(name)) for name in module_names]
    n_batches = 0
    try:
        if eval_mode:
            net.eval()
        with torch.no_grad():
            for batch in batches:
                if max_batches is not None and n_batches >= max_batches:
                    break
                current_mask[0] = mask_fn(batch) if mask_fn is not None else None
                forward(net, batch)
                n_batches += 1
    finally:
        for handle in handles:
            handle.remove()
        for mod, flag in training.items():
            mod.training = flag
    _check_finite_moments(moments, n_batches)
    logger.debug(
        "collected input moments over %d batches: %s",
        n_batches,
        {name: m.n for name, m in moments.items()},
    )
    return moments


def _check_finite_moments(moments: dict[str, InputMoments], n_batches: int) -> None:
    """Refuse moments whose inputs held NaN or inf, naming the modules (one check each)."""
    bad = [
        name
        for name, m in moments.items()
        if m.mean is not None
        and m.m2 is not None
        and not (bool(torch.isfinite(m.mean).all()) and bool(torch.isfinite(m.m2).all()))
    ]
    if bad:
        raise ValueError(
            f"collect_input_moments: the inputs of module(s) {bad} held NaN or inf in the "
            f"{n_batches} calibration batches, so their input covariance is undefined. Check "
            "the calibration data (and the layers below these modules, e.g. a float16 overflow)."
        )


# --------------------------------------------------------------------------------------------------
# projections
# --------------------------------------------------------------------------------------------------


def svd_projection(weight_in_out: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """Truncated-SVD projection.

    .. math::

        W_0 \\approx U_r \\Sigma_r V_r^T,\\qquad A = U_r \\Sigma_r,\\quad B = V_r^T,

    the best rank-``r`` approximation in Frobenius norm:
    ``||W0 - A B||_F^2 = sum_{j>r} sigma_j^2``.

    Parameters
    ----------
    weight_in_out : Tensor
        ``W0`` of shape ``(d_in, d_out)``.
    rank : int
        ``r``, with ``1 <= r <= min(d_in, d_out)``.

    Returns
    -------
    tuple of Tensor
        ``A`` of shape ``(d_in, r)`` and ``B`` of shape ``(r, d_out)``, in the input dtype.
    """
    w = _as_float64(weight_in_out)
    rank = _check_rank(rank, min(w.shape))
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    u, vh = _fix_svd_signs(u[:, :rank], vh[:rank])
    a = u * s[:rank]
    return a.to(weight_in_out.dtype), vh.to(weight_in_out.dtype)


def wsvd_projection(
    weight_in_out: Tensor,
    rank: int,
    covariance: Tensor | InputMoments,
    *,
    moment: str = "centered",
) -> tuple[Tensor, Tensor]:
    """Whitened-SVD projection, minimising the activation error ``E_x ||x W0 - x W_hat||^2``.

    With ``Sigma_xx = Q diag(L) Q^T`` (``L`` clamped at ``1e-10``):

    .. math::

        \\tilde W = W_0^T \\Sigma_{xx}^{1/2} = \\tilde U \\tilde S \\tilde V^T,\\quad
        V_{raw} = \\Sigma_{xx}^{-1/2} \\tilde V_{:, :r},\\quad s_j = \\|V_{raw, :, j}\\|_2,

        A' = V_{raw} \\operatorname{diag}(1/s),\\quad
        R_0 = \\operatorname{diag}(\\tilde S_j s_j),\\quad
        A = A' R_0,\\quad B = \\tilde U_{:, :r}^T.

    Then ``A B = Sigma^{-1/2} (Sigma^{1/2} W0)_r`` is the best rank-``r`` approximation in the
    ``Sigma_xx``-weighted norm, ``tr((W0 - A B)^T Sigma_xx (W0 - A B)) = sum_{j>r} S~_j^2``.

    Parameters
    ----------
    weight_in_out : Tensor
        ``W0`` of shape ``(d_in, d_out)``.
    rank : int
        ``r``, with ``1 <= r <= min(d_in, d_out)``.
    covariance : Tensor or InputMoments
        ``Sigma_xx`` of shape ``(d_in, d_in)``, used as given, or accumulated input statistics.
    moment : {"centered", "second"}
        With :class:`InputMoments`: use the centred covariance (the error that a bias cannot
        absorb) or the raw second moment ``E[x x^T]`` (the full error of a bias-free layer).
        Ignored (beyond validation) when ``covariance`` is a tensor.

    Returns
    -------
    tuple of Tensor
        ``A`` of shape ``(d_in, r)`` and ``B`` of shape ``(r, d_out)``, in the input dtype.
    """
    _check_moment(moment)
    w = _as_float64(weight_in_out)
    d_in, d_out = w.shape
    rank = _check_rank(rank, min(d_in, d_out))
    if isinstance(covariance, InputMoments):
        cov = covariance.covariance(moment)
    elif isinstance(covariance, Tensor):
        cov = covariance.detach()
    else:
        raise TypeError(
            f"covariance must be a Tensor or InputMoments, got {type(covariance).__name__}"
        )
    if tuple(cov.shape) != (d_in, d_in):
        raise ValueError(
            f"covariance must have shape (d_in, d_in) = ({d_in}, {d_in}), got {tuple(cov.shape)}"
        )
    given = cov.dtype if cov.is_floating_point() else torch.float64
    cov = cov.to(device=w.device, dtype=torch.float64)
    if not torch.isfinite(cov).all():
        raise ValueError(
            "covariance contains non-finite values (NaN or inf): the calibration inputs of "
            "this layer hold NaN or inf; check the calibration data (and the layers below)"
        )
    _check_covariance(cov, given)

    sqrt_cov, inv_sqrt_cov, n_clamped = _sym_sqrt_pair(cov)
    if n_clamped == d_in:
        warnings.warn(
            f"wsvd_projection: the input covariance of this layer is zero (all {d_in} "
            "eigenvalues below 1e-10): its calibration inputs do not vary, so W-SVD has no "
            "input statistics to weight by and returns the plain SVD projection. Pass "
            "calibration data whose examples differ (or moment='second' for inputs with a "
            "constant offset), or use projection='svd'.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    elif n_clamped:
        logger.debug("W-SVD: clamped %d of %d eigenvalues of Sigma_xx", n_clamped, d_in)
    w_tilde = w.T @ sqrt_cov  # (d_out, d_in)
    u_t, s_t, vh_t = torch.linalg.svd(w_tilde, full_matrices=False)
    # (V~_r, U~_r^T), sign pairs keyed on the rows of B = U~_r^T
    v_r, b = _fix_svd_signs(vh_t[:rank].T, u_t[:, :rank].T)
    v_raw = inv_sqrt_cov @ v_r  # (d_in, r)
    s = v_raw.norm(dim=0).clamp_min(_NORM_FLOOR)
    a_prime = v_raw / s
    r0_diag = s_t[:rank] * s
    a = a_prime * r0_diag  # A' R0 with R0 = diag(r0_diag); b is (r, d_out)
    return a.to(weight_in_out.dtype), b.to(weight_in_out.dtype)


def dct_ii_matrix(
    n: int, *, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None
) -> Tensor:
    """Orthonormal DCT-II matrix ``D_N``.

    .. math::

        D_N[k, n] = \\sqrt{2/N} \\cos\\bigl(\\pi k (2n + 1) / (2N)\\bigr),\\qquad
        D_N[0, n] = \\sqrt{1/N},

    so ``D_N x`` is ``scipy.fft.dct(x, norm="ortho")`` and ``D_N D_N^T = I``.
    """
    if isinstance(n, bool) or operator.index(n) < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    n = operator.index(n)
    k = torch.arange(n, dtype=torch.float64, device=device)[:, None]
    j = torch.arange(n, dtype=torch.float64, device=device)[None, :]
    d = math.sqrt(2.0 / n) * torch.cos(math.pi * k * (2.0 * j + 1.0) / (2.0 * n))
    d[0] = math.sqrt(1.0 / n)
    return d.to(dtype)


def _top_sorted(energy: Tensor, count: int) -> Tensor:
    # stable argsort: deterministic tie-breaking towards lower frequencies
    order = torch.argsort(-energy, stable=True)
    return torch.sort(order[:count]).values


def dct_projection(
    weight_in_out: Tensor, rank: int, *, n_row_freq: int | None = None
) -> tuple[Tensor, Tensor]:
    """DCT projection on a norm-sorted weight.

    Rows and columns of ``W0`` are permuted (``P_row``, ``P_col``) so their L1 norms ascend, then

    .. math::

        C = D_m W_{perm} D_n^T,\\quad R_0 = C[\\text{rows}, \\text{cols}],\\quad
        A = D_m^T[:, \\text{rows}] R_0,\\quad B = D_n[\\text{cols}, :],

    where ``rows`` / ``cols`` are the (sorted) frequencies with the largest energies
    ``sum_j C[k, j]^2`` / ``sum_i C[i, k]^2``, and the inverse permutations are folded back:
    ``A <- A[P_row^{-1}]``, ``B <- B[:, P_col^{-1}]``. With all frequencies this is exact.

    Parameters
    ----------
    weight_in_out : Tensor
        ``W0`` of shape ``(d_in, d_out)`` (``m = d_in``, ``n = d_out``).
    rank : int
        Number of column (output) frequencies kept, the inner dimension of ``A B``;
        ``1 <= rank <= d_out``.
    n_row_freq : int or None
        Number of row (input) frequencies kept, ``1 <= n_row_freq <= d_in``; defaults to
        ``rank`` (the square ``r x r`` core of LoRA-XS).

    Returns
    -------
    tuple of Tensor
        ``A`` of shape ``(d_in, rank)`` and ``B`` of shape ``(rank, d_out)``, in the input dtype.
    """
    w = _as_float64(weight_in_out)
    m, n = w.shape
    rank = _check_rank(rank, n, what="d_out")
    n_row_freq = _check_rank(rank if n_row_freq is None else n_row_freq, m, "n_row_freq", "d_in")

    p_row = torch.argsort(w.abs().sum(dim=1), stable=True)
    p_col = torch.argsort(w.abs().sum(dim=0), stable=True)
    w_perm = w[p_row][:, p_col]
    d_m = dct_ii_matrix(m, device=w.device)
    d_n = dct_ii_matrix(n, device=w.device)
    c = d_m @ w_perm @ d_n.T
    energy = c.square()
    rows = _top_sorted(energy.sum(dim=1), n_row_freq)
    cols = _top_sorted(energy.sum(dim=0), rank)
    r0 = c[rows][:, cols]
    a_perm = d_m.T[:, rows] @ r0
    b_perm = d_n[cols, :]
    inv_row = torch.argsort(p_row)
    inv_col = torch.argsort(p_col)
    a = a_perm[inv_row, :]
    b = b_perm[:, inv_col]
    if logger.isEnabledFor(logging.DEBUG):
        kept = float(r0.square().sum() / energy.sum().clamp_min(1e-300))
        logger.debug("DCT: kept %.4f of the coefficient energy", kept)
    return a.to(weight_in_out.dtype), b.to(weight_in_out.dtype)


def haar_stiefel(
    n: int,
    r: int,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Haar-distributed ``n x r`` matrix with orthonormal columns (``Q^T Q = I_r``).

    ``G ~ N(0, 1)^{n x r}``, ``G = Q R`` (reduced QR), ``Q <- Q diag(sign(diag(R)))`` so the
    triangular factor has a positive diagonal, which makes ``Q`` exactly Haar (Mezzadri, 2007).

    Parameters
    ----------
    n, r : int
        Shape, ``1 <= r <= n``.
    generator : torch.Generator or None
        Source of randomness (its device is used for sampling); the global RNG when ``None``.
    device : torch.device, str or None
        Device of the result; defaults to the generator's device (CPU without one).

    Returns
    -------
    Tensor
        Float64 ``(n, r)`` matrix.
    """
    r = _check_rank(r, n, name="r", what="n")
    _check_generator(generator)
    sample_device = generator.device if generator is not None else device
    g = torch.randn(n, r, generator=generator, dtype=torch.float64, device=sample_device)
    q, r_qr = torch.linalg.qr(g, mode="reduced")
    sign = torch.sign(torch.diagonal(r_qr))
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)
    q = q * sign
    return q if device is None else q.to(device)


def random_projection(
    weight_in_out: Tensor, rank: int, *, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Haar-random projection.

    .. math::

        R_0 = Q_1^T W_0 Q_2,\\quad A = Q_1 R_0,\\quad B = Q_2^T,

    with ``Q1`` (``d_in x r``) then ``Q2`` (``d_out x r``) drawn by :func:`haar_stiefel`, so
    ``A B = Q1 Q1^T W0 Q2 Q2^T`` (exact for a square ``W0`` at full rank).

    Parameters
    ----------
    weight_in_out : Tensor
        ``W0`` of shape ``(d_in, d_out)``.
    rank : int
        ``r``, with ``1 <= r <= min(d_in, d_out)``.
    generator : torch.Generator or None
        Source of randomness; the global RNG when ``None``.

    Returns
    -------
    tuple of Tensor
        ``A`` of shape ``(d_in, r)`` and ``B`` of shape ``(r, d_out)``, in the input dtype.
    """
    w = _as_float64(weight_in_out)
    d_in, d_out = w.shape
    rank = _check_rank(rank, min(d_in, d_out))
    q1 = haar_stiefel(d_in, rank, generator=generator, device=w.device)
    q2 = haar_stiefel(d_out, rank, generator=generator, device=w.device)
    r0 = q1.T @ w @ q2
    a = q1 @ r0
    return a.to(weight_in_out.dtype), q2.T.contiguous().to(weight_in_out.dtype)


def project(
    weight_in_out: Tensor,
    rank: int,
    method: str,
    *,
    covariance: Tensor | InputMoments | None = None,
    generator: torch.Generator | None = None,
    moment: str = "centered",
) -> tuple[Tensor, Tensor]:
    """Frozen LoRA-XS factors ``(A, B)`` with ``W0 ~= A B``.

    Parameters
    ----------
    weight_in_out : Tensor
        ``W0`` of shape ``(d_in, d_out)``: the transpose of an ``nn.Linear`` weight.
    rank : int
        ``r``, with ``1 <= r <= min(d_in, d_out)``.
    method : {"svd", "wsvd", "dct", "random"}
        See :data:`PROJECTIONS` and :func:`svd_projection`, :func:`wsvd_projection`,
        :func:`dct_projection`, :func:`random_projection`.
    covariance : Tensor, InputMoments or None
        Input covariance ``Sigma_xx`` (``(d_in, d_in)``) or statistics from
        :func:`collect_input_moments`; required by ``"wsvd"``, ignored otherwise.
    generator : torch.Generator or None
        Randomness for ``"random"``; ignored otherwise.
    moment : {"centered", "second"}
        Which moment of :class:`InputMoments` W-SVD whitens with.

    Returns
    -------
    tuple of Tensor
        ``A`` of shape ``(d_in, r)`` and ``B`` of shape ``(r, d_out)``, with the dtype and device
        of ``weight_in_out`` (computed in float64).

    Raises
    ------
    ValueError
        Unknown ``method``, ``rank`` out of range, or ``"wsvd"`` without ``covariance``.
    """
    if method not in PROJECTIONS:
        raise ValueError(f"unknown projection method {method!r}; valid methods are {PROJECTIONS}")
    w = _as_float64(weight_in_out)
    _check_rank(rank, min(w.shape))
    _check_generator(generator)
    if method == "svd":
        out = svd_projection(weight_in_out, rank)
    elif method == "wsvd":
        if covariance is None:
            raise ValueError(
                "method 'wsvd' needs the input covariance of this layer: pass calibration data, "
                "e.g. covariance=collect_input_moments(net, [name], batches, forward)[name]"
            )
        out = wsvd_projection(weight_in_out, rank, covariance, moment=moment)
    elif method == "dct":
        out = dct_projection(weight_in_out, rank)
    else:
        out = random_projection(weight_in_out, rank, generator=generator)
    if logger.isEnabledFor(logging.DEBUG):
        a, b = out
        rel = float((w - a.double() @ b.double()).norm() / w.norm().clamp_min(1e-300))
        logger.debug("project(%s, rank=%d): relative Frobenius error %.3e", method, rank, rel)
    return out
