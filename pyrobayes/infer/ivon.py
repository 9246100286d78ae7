r"""Variational online Newton updates: diagonal IVON and Kronecker IVON (SPECS 5, 5b).

The updates are written twice over:

* as **pure functions on explicit state** (``ivon_init`` / ``ivon_step`` for the diagonal family,
  ``kron_init`` / ``kron_factor_update`` / ``kron_step`` for the Kronecker family), which tests and
  other fitters can call directly, and
* as :class:`IVONOptimizer`, a ``torch.optim.Optimizer`` with ``needs_closure = True`` that
  :func:`pyrobayes.fit` drives. It asks the guide (an :class:`~pyrobayes.guides.IVONGuide` or
  :class:`~pyrobayes.guides.KroneckerIVONGuide`) for the noise it used to sample θ and for the
  curvature statistics its hooks recorded, then applies the updates.

Loss convention (SPECS §7 rule 4): every gradient here is the gradient of the **per-example
mean** minibatch data NLL ``lhat(θ) = (1/B) Σ_b −log p(y_b | x_b, θ)``, as in IVON. The prior
enters only through the weight decay ``δ`` (prior precision per unit ``ess``), never through
the loss: adding a prior term on top would count it twice.

Diagonal update (Algorithm 1 of Shen et al., 2024), with ``θ_s = m + σ ε_s``,
``σ = 1/sqrt(λ(h+δ))``::

    ĝ = mean_s ∇lhat(θ_s)
    ĥ = mean_s ∇lhat(θ_s) ⊙ (θ_s − m) ⊙ λ(h+δ)        ("price")   or  λ mean_s ∇lhat(θ_s)² ("gradsq")
    g ← β1 g + (1−β1) ĝ
    h ← β2 h + (1−β2) ĥ + ½(1−β2)² (h−ĥ)² / (h+δ)
    m ← m − α (h0+δ) clip((g/(1−β1^t) + δ m)/(h+δ), −r, r)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .distributed import all_reduce_mean_, world

__all__ = [
    "IVONState",
    "ivon_init",
    "price_hessian",
    "gradsq_hessian",
    "ivon_hess_update",
    "ivon_step",
    "ivon_step_",
    "KronState",
    "kron_init",
    "kron_factor_update",
    "eigh_factor",
    "kron_precondition",
    "kron_step",
    "kron_step_",
    "all_reduce_mean_",
    "state_dtype_for",
    "IVONOptimizer",
]


# --------------------------------------------------------------------------- helpers
def state_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Statistics dtype for weights of ``dtype``: float32 for half/bfloat16, else ``dtype``."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# --------------------------------------------------------------------------- diagonal IVON
class IVONState(NamedTuple):
    """Diagonal IVON state for one tensor: ``momentum`` g, Hessian estimate ``hess`` h, ``step`` t."""

    momentum: Tensor
    hess: Tensor
    step: int


def ivon_init(param: Tensor, hess_init: float = 1.0, dtype: torch.dtype | None = None) -> IVONState:
    """``g = 0``, ``h = h0``, ``t = 0`` in ``dtype`` (default: :func:`state_dtype_for` the param)."""
    if hess_init <= 0:
        raise ValueError(f"Expected hess_init > 0 but got {hess_init}.")
    dtype = dtype or state_dtype_for(param.dtype)
    zeros = torch.zeros(param.shape, dtype=dtype, device=param.device)
    return IVONState(zeros, torch.full_like(zeros, float(hess_init)), 0)


def price_hessian(
    grads: Tensor, noise: Tensor, hess: Tensor, ess: float, weight_decay: float | Tensor
) -> Tensor:
    r"""Reparameterization (Price / Stein) estimate ``ĥ = mean_s ĝ_s ⊙ (θ_s − m) ⊙ λ(h+δ)``.

    Parameters
    ----------
    grads : Tensor `(S, *shape)`
        Per-sample gradients ``ĝ_s = ∇lhat(θ_s)``.
    noise : Tensor `(S, *shape)`
        The perturbations ``θ_s − m = σ ε_s``.
    hess : Tensor `(*shape)`
        The current ``h`` (before this step's update).
    """
    return (grads * noise).mean(0) * (hess + weight_decay) * ess


def gradsq_hessian(grads: Tensor, ess: float) -> Tensor:
    r"""Squared-gradient estimate ``ĥ = λ mean_s ĝ_s²``; ``grads`` is `(S, *shape)`."""
    return grads.square().mean(0) * ess


def ivon_hess_update(
    hess: Tensor, hess_hat: Tensor, beta2: float, weight_decay: float | Tensor
) -> Tensor:
    r"""``h ← β2 h + (1−β2) ĥ + ½(1−β2)² (h−ĥ)²/(h+δ)`` (keeps ``h + δ > 0``)."""
    return (
        beta2 * hess
        + (1.0 - beta2) * hess_hat
        + 0.5 * (1.0 - beta2) ** 2 * (hess - hess_hat).square() / (hess + weight_decay)
    )


def _mean_step(
    m: Tensor,
    precondition: Callable[[Tensor], Tensor],
    momentum: Tensor,
    step: int,
    *,
    lr: float,
    hess_init: float,
    beta1: float,
    weight_decay: float | Tensor,
    clip_radius: float,
    debias: bool,
    rescale_lr: bool,
    prior_loc: Tensor | None = None,
) -> Tensor:
    debiased = momentum / (1.0 - math.pow(beta1, step)) if debias else momentum
    centred = m if prior_loc is None else m - prior_loc
    direction = precondition(debiased + weight_decay * centred)
    if math.isfinite(clip_radius):
        direction = direction.clamp(-clip_radius, clip_radius)
    scale = lr * (hess_init + weight_decay) if rescale_lr else lr
    return m - scale * direction


def ivon_step(
    m: Tensor,
    state: IVONState,
    grad: Tensor,
    hess_hat: Tensor,
    *,
    lr: float,
    hess_init: float = 1.0,
    beta1: float = 0.9,
    beta2: float = 0.99999,
    weight_decay: float | Tensor = 1e-4,
    clip_radius: float = math.inf,
    debias: bool = True,
    rescale_lr: bool = True,
    prior_loc: Tensor | None = None,
) -> tuple[Tensor, IVONState]:
    """One step of Algorithm 1 given ``ĝ`` (``grad``, the sample mean) and ``ĥ``.

    ``prior_loc`` (default 0) is the prior mean ``μ0`` the decay pulls towards: the step uses
    ``δ (m − μ0)`` in place of ``δ m`` (``h`` and ``σ`` do not depend on it).
    Returns the new mean (in the state's dtype) and the new state; nothing is modified in place.
    """
    dtype = state.hess.dtype
    m = m.to(dtype)
    t = state.step + 1
    momentum = beta1 * state.momentum + (1.0 - beta1) * grad.to(dtype)
    hess = ivon_hess_update(state.hess, hess_hat.to(dtype), beta2, weight_decay)
    new_m = _mean_step(
        m,
        lambda d: d / (hess + weight_decay),
        momentum,
        t,
        lr=lr,
        hess_init=hess_init,
        beta1=beta1,
        weight_decay=weight_decay,
        clip_radius=clip_radius,
        debias=debias,
        rescale_lr=rescale_lr,
        prior_loc=None if prior_loc is None else prior_loc.to(dtype),
    )
    return new_m, IVONState(momentum, hess, t)


def ivon_step_(
    m: Tensor,
    momentum: Tensor,
    hess: Tensor,
    grad: Tensor,
    hess_hat: Tensor,
    step: int,
    *,
    lr: float,
    hess_init: float = 1.0,
    beta1: float = 0.9,
    beta2: float = 0.99999,
    weight_decay: float | Tensor = 1e-4,
    clip_radius: float = math.inf,
    debias: bool = True,
    rescale_lr: bool = True,
    prior_loc: Tensor | None = None,
) -> None:
    """:func:`ivon_step` in place on same-dtype state tensors ``m``, ``momentum``, ``hess``.

    The optimizer's fast path over its persistent flat vectors: the same recurrence with a third
    of the temporaries (equal to :func:`ivon_step` up to rounding; tested).
    """
    correction = (hess - hess_hat).square_().div_(hess + weight_decay)
    hess.mul_(beta2).add_(hess_hat, alpha=1.0 - beta2).add_(
        correction, alpha=0.5 * (1.0 - beta2) ** 2
    )
    _mean_step_(
        m,
        momentum,
        grad,
        step,
        lambda d: d.div_(hess + weight_decay),
        lr=lr,
        hess_init=hess_init,
        beta1=beta1,
        weight_decay=weight_decay,
        clip_radius=clip_radius,
        debias=debias,
        rescale_lr=rescale_lr,
        prior_loc=prior_loc,
    )


def _mean_step_(
    m: Tensor,
    momentum: Tensor,
    grad: Tensor,
    step: int,
    precondition_: Callable[[Tensor], Tensor],
    *,
    lr: float,
    hess_init: float,
    beta1: float,
    weight_decay: float | Tensor,
    clip_radius: float,
    debias: bool,
    rescale_lr: bool,
    prior_loc: Tensor | None = None,
) -> None:
    """In place: momentum, then ``m ← m − α(h0+δ) clip(P(ḡ/(1−β1ᵗ) + δ(m−μ0)))``, ``P`` linear.

    ``P`` is applied to ``momentum + (1−β1ᵗ) δ (m − μ0)`` (it may work in place on that
    temporary) and the debiasing is folded into the step size and the clip radius. ``μ0`` is
    ``prior_loc`` (default 0).
    """
    momentum.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    bias = 1.0 - math.pow(beta1, step + 1) if debias else 1.0
    centred = m if prior_loc is None else torch.sub(m, prior_loc)
    if isinstance(weight_decay, Tensor):  # one δ per entry
        direction = precondition_(torch.addcmul(momentum, centred, weight_decay, value=bias))
    else:
        direction = precondition_(torch.add(momentum, centred, alpha=weight_decay * bias))
    if math.isfinite(clip_radius):  # clip(direction/bias) = clip(direction, c·bias)/bias
        direction.clamp_(-clip_radius * bias, clip_radius * bias)
    if rescale_lr and isinstance(weight_decay, Tensor):
        m.sub_(direction.mul_((weight_decay + hess_init).mul_(lr / bias)))
        return
    scale = lr * (hess_init + weight_decay) if rescale_lr else lr
    m.sub_(direction, alpha=scale / bias)


# --------------------------------------------------------------------------- Kronecker IVON
class KronState(NamedTuple):
    r"""Kronecker IVON state for one ``(d_out, d_in)`` weight.

    ``A`` `(d_in, d_in)` and ``G`` `(d_out, d_out)` are the factor EMAs; the curvature of the
    mean loss is approximated by ``A ⊗ G`` (column-stacking vec), i.e. ``G ⊗ A`` over
    ``W.reshape(-1)``.
    """

    momentum: Tensor
    A: Tensor
    G: Tensor
    step: int


def kron_init(
    shape: Sequence[int],
    hess_init: float = 1.0,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> KronState:
    """``A = G = sqrt(h0) I`` so that ``A ⊗ G = h0 I`` (SPECS 5b.2 defaults); momentum 0."""
    if hess_init <= 0:
        raise ValueError(f"Expected hess_init > 0 but got {hess_init}.")
    d_out, d_in = int(shape[0]), int(shape[1])
    root = math.sqrt(hess_init)
    eye = torch.eye
    return KronState(
        torch.zeros(d_out, d_in, dtype=dtype, device=device),
        root * eye(d_in, dtype=dtype, device=device),
        root * eye(d_out, dtype=dtype, device=device),
        0,
    )


def kron_factor_update(
    A: Tensor, G: Tensor, A_hat: Tensor, G_hat: Tensor, beta2: float
) -> tuple[Tensor, Tensor]:
    """``A ← β2 A + (1−β2) Â``, ``G ← β2 G + (1−β2) Ĝ`` (PSD-preserving, no correction term)."""
    return beta2 * A + (1.0 - beta2) * A_hat.to(A.dtype), beta2 * G + (1.0 - beta2) * G_hat.to(
        G.dtype
    )


def eigh_factor(F: Tensor, *, float64_max_dim: int = 2048) -> tuple[Tensor, Tensor]:
    """``(eigenvalues clamped ≥ 0, eigenvectors)`` of a symmetric factor, in ``F``'s dtype.

    Factors up to ``float64_max_dim`` wide are decomposed in float64.
    """
    work = F.double() if F.shape[-1] <= float64_max_dim else F.float()
    work = 0.5 * (work + work.mT)
    vals, vecs = torch.linalg.eigh(work)
    return vals.clamp_min(0.0).to(F.dtype), vecs.to(F.dtype)


def damped_eigenvalues(a: Tensor, g: Tensor, weight_decay: float, damping: str = "exact") -> Tensor:
    r"""Eigenvalues ``(d_out, d_in)`` of the damped curvature ``A ⊗ G + δ`` in the Kronecker basis.

    ``"exact"``: ``γ aᵀ + δ``. ``"factored"`` (Noisy K-FAC π-damping): ``(γ + √δ/π)(a + π√δ)ᵀ``
    with ``π = sqrt((tr A/d_in)/(tr G/d_out))``.
    """
    if damping == "exact":
        return g.unsqueeze(-1) * a.unsqueeze(-2) + weight_decay
    if damping == "factored":
        tiny = torch.finfo(a.dtype).tiny
        # (..., 1): one π per factor pair, also for stacked (K, d) eigenvalues
        pi = (
            a.mean(-1, keepdim=True).clamp_min(tiny) / g.mean(-1, keepdim=True).clamp_min(tiny)
        ).sqrt()
        root = math.sqrt(weight_decay)
        return (g + root / pi).unsqueeze(-1) * (a + pi * root).unsqueeze(-2)
    raise ValueError(f"Expected damping 'exact' or 'factored' but got {damping!r}.")


def kron_precondition(
    delta: Tensor, eig_in: tuple[Tensor, Tensor], eig_out: tuple[Tensor, Tensor], damped: Tensor
) -> Tensor:
    r"""``Q_G [(Q_Gᵀ Δ Q_A) ⊘ D] Q_Aᵀ`` — with ``D = γaᵀ + δ`` this is ``(A⊗G + δI)⁻¹ vec Δ``."""
    _, Q_A = eig_in
    _, Q_G = eig_out
    return Q_G @ ((Q_G.mT @ delta @ Q_A) / damped) @ Q_A.mT


def kron_step(
    M: Tensor,
    momentum: Tensor,
    step: int,
    grad: Tensor,
    eig_in: tuple[Tensor, Tensor],
    eig_out: tuple[Tensor, Tensor],
    *,
    lr: float,
    hess_init: float = 1.0,
    beta1: float = 0.9,
    weight_decay: float = 1e-4,
    clip_radius: float = math.inf,
    debias: bool = True,
    rescale_lr: bool = True,
    damping: str = "exact",
) -> tuple[Tensor, Tensor]:
    r"""Steps 4-5 of SPECS 5b.2: momentum, then ``M ← M − α(h0+δ) clip(P(ḡ + δM))``.

    ``eig_in = (a, Q_A)`` and ``eig_out = (γ, Q_G)`` are the (cached) eigendecompositions of the
    factors. Returns ``(new M, new momentum)`` in the momentum's dtype.
    """
    dtype = momentum.dtype
    M = M.to(dtype)
    momentum = beta1 * momentum + (1.0 - beta1) * grad.to(dtype)
    damped = damped_eigenvalues(eig_in[0], eig_out[0], weight_decay, damping)
    new_M = _mean_step(
        M,
        lambda d: kron_precondition(d, eig_in, eig_out, damped),
        momentum,
        step + 1,
        lr=lr,
        hess_init=hess_init,
        beta1=beta1,
        weight_decay=weight_decay,
        clip_radius=clip_radius,
        debias=debias,
        rescale_lr=rescale_lr,
    )
    return new_M, momentum


def kron_step_(
    M: Tensor,
    momentum: Tensor,
    step: int,
    grad: Tensor,
    Q_A: Tensor,
    Q_G: Tensor,
    damped: Tensor,
    *,
    lr: float,
    hess_init: float = 1.0,
    beta1: float = 0.9,
    weight_decay: float = 1e-4,
    clip_radius: float = math.inf,
    debias: bool = True,
    rescale_lr: bool = True,
) -> None:
    r""":func:`kron_step` in place on ``M`` and ``momentum`` (same dtype), given the eigenbases
    and the damped eigenvalues ``damped`` (:func:`damped_eigenvalues`, cached by the caller).

    The preconditioner is linear, so the debiasing ``1/(1−β1ᵗ)`` is applied after it.
    """
    _mean_step_(
        M,
        momentum,
        grad,
        step,
        lambda d: Q_G @ (Q_G.mT @ d @ Q_A).div_(damped) @ Q_A.mT,
        lr=lr,
        hess_init=hess_init,
        beta1=beta1,
        weight_decay=weight_decay,
        clip_radius=clip_radius,
        debias=debias,
        rescale_lr=rescale_lr,
    )


# --------------------------------------------------------------------------- optimizer
class IVONOptimizer(torch.optim.Optimizer):
    r"""IVON / Kronecker-IVON as a closure-driven ``torch.optim.Optimizer``.

    Built by ``guide.default_optimizer(params, lr)``; :func:`pyrobayes.fit` sees
    ``needs_closure = True`` and passes a closure that evaluates the guide's objective
    (:class:`~pyrobayes.guides.ivon.IVONLoss`) and back-propagates. Inside the closure the guide
    draws ``θ_s = m + σ ε_s`` and keeps the perturbations ``θ_s − m`` as leaf tensors, so after
    the backward their ``.grad`` holds the per-sample gradients the Price estimator needs; the
    Kronecker guide's hooks also record the factor statistics.

    Parameters other than the guide's means (model point parameters such as a classifier head)
    are updated by diagonal IVON too, ivon-opt style: perturbed in place with one draw per step
    and restored after the closure; their ``h`` lives in this optimizer's state (not in the
    guide), so their point estimate is the IVON mean.

    A non-finite loss skips the update (so :func:`pyrobayes.fit` stops with the parameters
    untouched).

    Parameters
    ----------
    params : iterable of Parameters
        The guide's means and any extra parameters.
    guide : IVONGuide or KroneckerIVONGuide
    lr : float
        α (nominal; multiplied by ``h0 + δ`` when ``rescale_lr``).
    """

    needs_closure = True

    def __init__(self, params: Any, guide: Any, lr: float) -> None:
        if lr < 0:
            raise ValueError(f"Expected lr >= 0 but got {lr}.")
        super().__init__(params, {"lr": float(lr)})
        self.guide = guide
        self._site_of = {id(guide.loc_param(s)): s for s in guide.sites}
        self._flat: _FlatCache | None = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; the ``set_to_none`` path skips its overhead."""
        if not set_to_none:
            super().zero_grad(set_to_none=False)
            return
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def _decay(self, n_site: int, n_extra: int, like: Tensor) -> float | Tensor:
        """δ over a flat vector of ``n_site`` site entries followed by ``n_extra`` extra entries.

        A float when they share one δ (``point_weight_decay`` equal to ``weight_decay``, or one
        of the two parts empty), else a cached vector in ``like``'s dtype and device.
        """
        hp = self.guide.hyper
        delta, point = hp["weight_decay"], hp["point_weight_decay"]
        if n_extra == 0 or point == delta:
            return delta
        if n_site == 0:
            return point

        def build() -> Tensor:
            vec = like.new_empty(n_site + n_extra)
            vec[:n_site] = delta
            vec[n_site:] = point
            return vec

        return self._cached("_decay_cache", (n_site, n_extra, point, delta), like, build)

    def _prior_loc(self, n_site: int, extras: list[Tensor], like: Tensor) -> Tensor | None:
        """μ0 over a flat vector of ``n_site`` site entries followed by the extras' entries.

        ``None`` (μ0 = 0 everywhere) unless ``point_prior_loc="init"``; then 0 for the sites and,
        for each extra, its value when this optimizer first stepped it (kept in its state, so
        checkpoints carry it), as a cached vector in ``like``'s dtype and device.
        """
        if not extras or self.guide.hyper["point_prior_loc"] == "zero":
            return None
        locs = [self.state[p].get("prior_loc") for p in extras]
        if any(t is None for t in locs):
            raise RuntimeError(
                "IVONOptimizer: point_prior_loc='init' but a point parameter's optimizer state has "
                "no prior_loc (it was started with point_prior_loc='zero'); start a new fit or "
                "keep the guide's point_prior_loc as it was."
            )

        def build() -> Tensor:
            vec = like.new_zeros(n_site + sum(t.numel() for t in locs))
            vec[n_site:] = _flat(locs).to(like.dtype)
            return vec

        key = (n_site, tuple((id(t), t._version) for t in locs))
        return self._cached("_prior_loc_cache", key, like, build)

    def _cached(self, slot: str, key: tuple, like: Tensor, build: Callable[[], Tensor]) -> Tensor:
        """``build()``'s vector, kept in ``slot`` until ``key`` or ``like``'s dtype/device change."""
        key = (*key, like.dtype, like.device)
        hit = self.__dict__.get(slot)
        if hit is None or hit[0] != key:
            hit = self.__dict__[slot] = (key, build())
        return hit[1]

    def _extras(self) -> list[Tensor]:
        return [
            p for group in self.param_groups for p in group["params"] if id(p) not in self._site_of
        ]

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor:  # type: ignore[override]
        if closure is None:
            raise RuntimeError(
                "IVONOptimizer.step needs a closure that evaluates the loss and calls backward "
                "(pyrobayes.fit passes one)."
            )
        guide = self.guide
        hp = guide.hyper
        lr = self.param_groups[0]["lr"]
        extras = self._extras()
        cache = self._valid_cache(extras)
        if cache is not None:
            return self._flat_step(closure, cache, extras, lr)
        # --- extras: one in-place perturbation per step (ivon-opt style), one randn per tensor
        noises: list[Tensor] = []
        means: list[Tensor] = []
        versions = [p._version for p in extras]  # to tell our own in-place writes from others'
        if extras:
            hess = []
            for p in extras:
                st = self.state[p]
                if "hess" not in st:
                    init = ivon_init(p, hp["hess_init"], guide.state_dtype)
                    st.update(momentum=init.momentum, hess=init.hess, step=torch.tensor(0))
                    if hp["point_prior_loc"] == "init":  # μ0: the value before any step
                        st["prior_loc"] = p.detach().to(init.hess.dtype, copy=True)
                hess.append(st["hess"])
            point = hp["point_weight_decay"]
            sigmas = torch._foreach_rsqrt(
                torch._foreach_mul(torch._foreach_add(hess, point), hp["ess"])
            )
            eps = [
                torch.randn(p.shape, dtype=h.dtype, device=p.device)
                for p, h in zip(extras, hess, strict=True)
            ]
            noises = torch._foreach_mul(eps, sigmas)
            means = [p.detach().clone() for p in extras]
            if all(p.dtype == n.dtype for p, n in zip(extras, noises, strict=True)):
                torch._foreach_add_(extras, noises)
            else:
                for p, n in zip(extras, noises, strict=True):
                    p.add_(n.to(p.dtype))
        guide._begin_step()
        try:
            with torch.enable_grad():
                loss = closure()
        finally:
            guide._end_step()
            if extras:
                torch._foreach_copy_(extras, means)
        loss = loss.detach().clone().reshape(())
        all_reduce_mean_([loss])  # every rank sees the same value, so all stop on a NaN together
        if not math.isfinite(float(loss)):
            for p in extras:
                p.grad = None
            return loss
        self._diag_update(extras, noises, lr, versions)
        guide.ivon_update(self, lr)
        return loss

    def _valid_cache(self, extras: list[Tensor]) -> _FlatCache | None:
        """The flat cache of the previous step if nobody has written the tensors since."""
        cache = self._flat
        if cache is None:
            return None
        locs, hess_list = self.guide.diag_tensors()
        state = self.state
        params = locs + extras
        hess_list = hess_list + [state[p].get("hess") for p in extras]
        states = [state[p] for p in params]
        if not cache.valid(params, hess_list, states, len(params), None):
            return None
        return cache

    def _flat_step(
        self, closure: Callable[[], Tensor], cache: _FlatCache, extras: list[Tensor], lr: float
    ) -> Tensor:
        """:meth:`step` on the persistent flat vectors of the previous step (same arithmetic).

        ``σ = (λ(h+δ))^{-1/2}`` is formed once over all diagonal entries (sites and extras) and
        handed to the guide's sampler; the extras' noise stays flat; their means are restored
        from the flat ``m``; ``ĝ`` and ``ĥ`` are formed on flat vectors with the flat ``h``.
        RNG use is the same as the general path (one ``randn`` per extra, in order, then the
        guide's draw), so both paths give the same trajectory.
        """
        guide = self.guide
        hp = guide.hyper
        n_site = cache.site_numel
        delta = self._decay(n_site, cache.h.numel() - n_site, cache.h)
        prec = (cache.h + delta).mul_(hp["ess"])  # λ(h + δ)
        sigma = prec.rsqrt()
        noise_e: Tensor | None = None
        if extras:
            # one randn per extra, in order, written straight into the flat noise buffer
            for view in cache.noise_views:
                torch.randn(view.shape, out=view)
            noise_e = cache.noise_e.mul_(sigma[n_site:])
            torch._foreach_add_(extras, cache.noise_views)
        guide._begin_step()
        guide.__dict__["_step_sigma"] = sigma[:n_site]
        try:
            with torch.enable_grad():
                loss = closure()
        finally:
            guide._end_step()
            guide.__dict__["_step_sigma"] = None
            if extras:
                torch._foreach_copy_(extras, cache.m_views[cache.n_sites :])
        loss = loss.detach().reshape(())
        if world()[0] > 1:  # every rank sees the same value, so all stop on a NaN together
            loss = loss.clone()
            all_reduce_mean_([loss])
        if not math.isfinite(float(loss)):
            for p in extras:
                p.grad = None
            return loss
        grads, noise = guide.diag_grads()  # (S, T_sites)
        num = grads.shape[0]
        price = hp["hess_approx"] == "price"
        if extras:
            grads_e = _flat([torch.zeros_like(p) if p.grad is None else p.grad for p in extras])
            if grads_e.dtype != cache.h.dtype:
                grads_e = grads_e.to(cache.h.dtype)
        if num == 1:
            grad = grads.reshape(-1)
            noise = noise.reshape(-1)
            if extras:
                grad = torch.cat([grad, grads_e])
                noise = torch.cat([noise, noise_e])
            hhat = torch.mul(grad, noise).mul_(prec) if price else grad.square().mul_(hp["ess"])
        else:  # S samples for the sites, one for the extras
            grad = grads.mean(0)
            hhat = (
                (grads * noise).mean(0) * prec[:n_site]
                if price
                else grads.square().mean(0) * hp["ess"]
            )
            if extras:
                hhat_e = (
                    grads_e * noise_e * prec[n_site:] if price else grads_e.square() * hp["ess"]
                )
                grad = torch.cat([grad, grads_e])
                hhat = torch.cat([hhat, hhat_e])
        all_reduce_mean_([grad, hhat])
        kwargs = guide.diag_step_kwargs()
        kwargs["beta2"] = guide._diag_beta2()
        kwargs["weight_decay"] = delta
        kwargs["prior_loc"] = self._prior_loc(n_site, extras, cache.h)
        cache.step_(grad, hhat, cache.step, lr, kwargs)
        guide.ivon_update(self, lr)
        return loss

    def _diag_update(
        self,
        extras: list[Tensor],
        noises: list[Tensor],
        lr: float,
        versions: list[int] | None = None,
    ) -> None:
        """One flat Algorithm-1 step over the guide's diagonal sites and the extra parameters.

        Everything is concatenated into single vectors (``m``, ``h``, momentum, ``ĝ``, ``ĥ``), so
        the cost is a fixed handful of kernels whatever the number of tensors.
        """
        guide = self.guide
        params, hess_list, hess, grads, noise = guide.diag_statistics()
        n_site = sum(p.numel() for p in params)
        n_extra = sum(p.numel() for p in extras)
        delta = self._decay(n_site, n_extra, hess)
        if extras:
            hess_e = [self.state[p]["hess"] for p in extras]
            dtype = hess_e[0].dtype
            grads_e = [
                torch.zeros_like(n) if p.grad is None else p.grad
                for p, n in zip(extras, noises, strict=True)
            ]
            if any(g.dtype != dtype for g in grads_e):
                grads_e = [g.to(dtype) for g in grads_e]
            if not params:
                grads, noise, hess = _flat(grads_e)[None], _flat(noises)[None], _flat(hess_e)
            elif grads.shape[0] == 1 and grads.dtype == dtype:  # one sample: one flat vector
                grads = torch.cat([grads.reshape(-1)] + [g.reshape(-1) for g in grads_e])[None]
                noise = torch.cat([noise.reshape(-1)] + [n.reshape(-1) for n in noises])[None]
                hess = torch.cat([hess] + [h.reshape(-1) for h in hess_e])
            else:  # S samples for the sites, one for the extras: the means differ
                g_e, n_e, h_e = _flat(grads_e), _flat(noises), _flat(hess_e)
                hp = guide.hyper
                point = hp["point_weight_decay"]
                grad_s, hhat_s = self._estimates(grads, noise, hess, hp["weight_decay"])
                grad_e, hhat_e = self._estimates(g_e[None], n_e[None], h_e, point)
                grad = torch.cat([grad_s.to(dtype), grad_e])
                hhat = torch.cat([hhat_s.to(dtype), hhat_e])
                hess = torch.cat([hess.to(dtype), h_e])
                grads = None
            params = list(params) + extras
            hess_list = list(hess_list) + hess_e
        if not params:
            return
        if grads is not None:
            grad, hhat = self._estimates(grads, noise, hess, delta)
        all_reduce_mean_([grad, hhat])
        states = []
        for p in params:
            st = self.state[p]
            if "momentum" not in st:
                st["momentum"] = torch.zeros(p.shape, dtype=hess.dtype, device=p.device)
                st["step"] = torch.tensor(0)
            states.append(st)
        steps = [int(st["step"]) for st in states]
        numels = [p.numel() for p in params]
        kwargs = guide.diag_step_kwargs()
        kwargs["beta2"] = guide._diag_beta2()
        if isinstance(delta, Tensor) and delta.dtype != hess.dtype:
            delta = delta.to(hess.dtype)
        kwargs["weight_decay"] = delta
        prior_loc = kwargs["prior_loc"] = self._prior_loc(n_site, extras, hess)
        if all(t == steps[0] for t in steps) and all(
            p.dtype == hess.dtype for p in params
        ):  # fast path: persistent flat m, h, momentum, updated in place
            n_sites = len(params) - len(extras)
            cache = self._flat
            if cache is None or not cache.valid(params, hess_list, states, n_sites, versions):
                cache = self._flat = _FlatCache(params, hess_list, states, n_sites)
            cache.step_(grad, hhat, steps[0], lr, kwargs)
            return
        m = torch.cat([p.detach().reshape(-1) for p in params])
        if m.dtype != hess.dtype:
            m = m.to(hess.dtype)
        momentum = _flat([st["momentum"] for st in states])
        self._flat = None
        if all(t == steps[0] for t in steps):
            new_m, state = ivon_step(
                m, IVONState(momentum, hess, steps[0]), grad, hhat, lr=lr, **kwargs
            )
            self._scatter(params, hess_list, states, numels, new_m, state, range(len(params)))
            return
        # tensors that joined late: one flat step per distinct step count
        offsets = [0]
        for n in numels:
            offsets.append(offsets[-1] + n)
        for t in sorted(set(steps)):
            idx = [i for i, u in enumerate(steps) if u == t]
            sel = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in idx]).to(m.device)
            part = dict(kwargs, weight_decay=delta[sel] if isinstance(delta, Tensor) else delta)
            part["prior_loc"] = None if prior_loc is None else prior_loc[sel]
            new_m, state = ivon_step(
                m[sel],
                IVONState(momentum[sel], hess[sel], t),
                grad[sel],
                hhat[sel],
                lr=lr,
                **part,
            )
            self._scatter(params, hess_list, states, numels, new_m, state, idx)

    def _estimates(
        self, grads: Tensor, noise: Tensor, hess: Tensor, weight_decay: float | Tensor
    ) -> tuple[Tensor, Tensor]:
        """``(ĝ, ĥ)`` from per-sample gradients and perturbations `(S, T)`."""
        hp = self.guide.hyper
        if hp["hess_approx"] == "price":
            hhat = price_hessian(grads, noise, hess, hp["ess"], weight_decay)
        else:
            hhat = gradsq_hessian(grads, hp["ess"])
        return grads.mean(0), hhat

    @staticmethod
    def _scatter(
        params: list[Tensor],
        hess_list: list[Tensor],
        states: list[dict[str, Any]],
        numels: list[int],
        new_m: Tensor,
        state: IVONState,
        idx: Sequence[int],
    ) -> None:
        sizes = [numels[i] for i in idx]
        shapes = [params[i].shape for i in idx]
        targets_m = [params[i] for i in idx]
        targets_h = [hess_list[i] for i in idx]
        torch._foreach_copy_(
            targets_m, [v.view(s) for v, s in zip(new_m.split(sizes), shapes, strict=True)]
        )
        torch._foreach_copy_(
            targets_h, [v.view(s) for v, s in zip(state.hess.split(sizes), shapes, strict=True)]
        )
        step = torch.tensor(state.step)
        for i, v, s in zip(idx, state.momentum.split(sizes), shapes, strict=True):
            st = states[i]
            st["momentum"] = v.view(s)
            st["step"] = step


class _FlatCache:
    """Flat ``m``, ``h`` and momentum over the diagonal tensors, updated in place.

    The per-tensor parameters and ``h`` buffers stay the source of truth (so ``state_dict``,
    saving and ``.to`` behave as before); the flat copies are reused while nobody else has
    written to those tensors (same objects, unchanged ``_version``), else rebuilt. The
    optimizer's per-parameter ``momentum`` entries are views of the flat momentum.
    """

    def __init__(
        self, params: list[Tensor], hess: list[Tensor], states: list[dict], n_sites: int
    ) -> None:
        dtype = hess[0].dtype
        self.params, self.hess, self.states = list(params), list(hess), states
        self.n_sites = n_sites  # the first n_sites tensors are the guide's, the rest extras
        self.site_numel = sum(p.numel() for p in params[:n_sites])
        self.step = int(states[0]["step"])  # all equal (the optimizer's fast-path condition)
        self.counter = torch.tensor(self.step)
        self.m = torch.cat([p.detach().reshape(-1).to(dtype) for p in params])
        self.h = torch.cat([h.reshape(-1) for h in hess])
        self.momentum = torch.cat([st["momentum"].reshape(-1).to(dtype) for st in states])
        sizes = [p.numel() for p in params]
        shapes = [p.shape for p in params]

        def views(flat: Tensor) -> list[Tensor]:
            return [v.view(s) for v, s in zip(flat.split(sizes), shapes, strict=True)]

        self.m_views, self.h_views, self.mom_views = (
            views(self.m),
            views(self.h),
            views(self.momentum),
        )
        # the extras' noise: a flat buffer and its per-tensor views, refilled every step
        self.noise_e = self.h.new_empty(sum(sizes[n_sites:]))
        self.noise_views = [
            v.view(s)
            for v, s in zip(self.noise_e.split(sizes[n_sites:]), shapes[n_sites:], strict=True)
        ]
        for st, v in zip(states, self.mom_views, strict=True):
            st["momentum"] = v
            st["step"] = self.counter
        self._record()

    def _record(self) -> None:
        self.versions = [p._version for p in self.params]
        self.hess_versions = [h._version for h in self.hess]

    def valid(
        self,
        params: list[Tensor],
        hess: list[Tensor],
        states: list[dict],
        n_sites: int,
        extra_versions: list[int] | None,
    ) -> bool:
        if len(params) != len(self.params):
            return False
        if not all(a is b for a, b in zip(params, self.params, strict=True)):
            return False
        if not all(a is b for a, b in zip(hess, self.hess, strict=True)):
            return False
        if not all(st["momentum"] is v for st, v in zip(states, self.mom_views, strict=True)):
            return False
        if not all(st.get("step") is self.counter for st in states):
            return False
        if [h._version for h in hess] != self.hess_versions:
            return False
        # the guide's means are untouched by the step itself; the extras were perturbed and
        # restored in place, so compare their versions from before the perturbation
        now = [p._version for p in params[:n_sites]] + list(extra_versions or [])
        return len(now) == len(self.versions) and now == self.versions

    def step_(self, grad: Tensor, hess_hat: Tensor, step: int, lr: float, kwargs: dict) -> None:
        """One :func:`ivon_step_` on the flat vectors, then write ``m`` and ``h`` back."""
        ivon_step_(self.m, self.momentum, self.h, grad, hess_hat, step, lr=lr, **kwargs)
        torch._foreach_copy_(self.params, self.m_views)
        torch._foreach_copy_(self.hess, self.h_views)
        self.step = step + 1
        self.counter = counter = torch.tensor(step + 1)
        for st in self.states:
            st["step"] = counter
        self._record()


def _flat(tensors: list[Tensor]) -> Tensor:
    """``cat`` of the flattened tensors (a view when there is only one)."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])
