r"""IVON, improved variational online Newton (Shen et al., 2024), as a :class:`Fitter`.

Shen et al., 2024, "Variational Learning is Effective for Large Deep Networks" (ICML),
Algorithm 1: with ``θ_s = m + σ ε_s``, ``σ = (λ(h+δ))^{-1/2}`` and ``ℓ̄`` the **per-example
mean** minibatch NLL (the prior enters through δ only, never through the loss)

.. math::
    ĝ = \tfrac1S Σ_s ∇ℓ̄(θ_s),\quad ĥ = \tfrac1S Σ_s ∇ℓ̄(θ_s) ⊙ (θ_s − m)\, λ(h+δ),\quad
    g ← β_1 g + (1−β_1) ĝ,\quad h ← β_2 h + (1−β_2) ĥ + \tfrac12 (1−β_2)^2 \tfrac{(h−ĥ)^2}{h+δ},

    m ← m − α (h_0+δ)\, \operatorname{clip}\Big(\frac{g/(1−β_1^t) + δ (m − μ_0)}{h+δ},\ ±r\Big)

(``hess_approx="gradsq"``: ``ĥ = λ mean_s ∇ℓ̄(θ_s)²``). :class:`IVONOptimizer` keeps ``m``,
``h`` and ``g`` as single flat vectors over the guide's sites and the model's point parameters
(ivon-opt style) and applies the update in place (:func:`ivon_step_`); :class:`IVONFitter` is
the ``"ivon"`` fitter. The Kronecker sites of a
:class:`~pyrobayes.guides.KroneckerIVONGuide` are :mod:`pyrobayes.infer.kron`'s.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..batch import batch_size
from ..models.adapters import check_int, check_real
from ..user_frame import user_stacklevel
from .distributed import all_reduce_mean_, world
from .fitter import Fitter, register_fitter
from .objectives import _float_leaves, split_training_batch
from .rank_errors import nan_share, run_shared, shared_copy

__all__ = [
    "IVON",
    "IVONLoss",
    "IVONOptimizer",
    "IVONFitter",
    "ivon_step_",
    "mean_step_",
    "per_example_nll",
    "warn_if_shapeless",
]


#: IVON's default Hessian EMA β2 (``IVON(beta2=None)``): 0.999, so that ``h`` learns within the
#: ~10³ steps of a fine-tuning run (docs/methods/ivon.md, "Default β2"); ivon-opt's 0.99999
#: is for the paper's 10⁵-step runs.
DEFAULT_BETA2 = 0.999

#: :func:`warn_if_shapeless`: ``h``'s data part below this fraction of its ``h0`` part at
#: :data:`SHAPELESS_QUANTILE` of the diagonal sites' coordinates means q's shape is the
#: initialisation's. Measured (docs/methods/ivon.md): plain LoRA factors at the defaults, 600
#: steps, the 90 % quantile .008 (digits) and .016 (mnist); LoRA-XS cores .85 and 3.1
SHAPELESS_FRACTION = 0.05
SHAPELESS_QUANTILE = 0.9
#: ... judged once the EMA has forgotten at least this much of ``h0`` (``1 − β2^t``): after
#: fewer steps ``h`` is still mostly ``h0`` whatever the data say
SHAPELESS_MIN_FORGOTTEN = 0.4


@dataclass(frozen=True)
class IVON:
    r"""IVON's optimizer settings: how the posterior is fitted (the fitter's, not the guide's).

    Pass it as the fit's optimizer, ``pb.fit(model, guide, data, ...,
    optim=pb.Optimization(optimizer=pb.infer.IVON(beta2=0.9999)))`` or
    ``make_fitter(model, guide, optimizer=pb.infer.IVON(...))``; the IVON fitters build their
    :class:`IVONOptimizer` from it. It is saved in the fitter's checkpoint, not with the
    posterior. Notation of Shen et al. (2024), Algorithm 1.

    Parameters
    ----------
    lr : float, optional
        α; overrides the ``lr`` given to :func:`pyrobayes.fit` when set.
    beta1 : float
        Gradient momentum β1 (0.9).
    beta2 : float, optional
        Hessian EMA β2 ∈ [0, 1) (at 1 ``h`` would never move from ``h0``): ``DEFAULT_BETA2`` =
        0.999 for IVON (Shen et al. (2024) use 0.99999 on
        runs of 10⁵+ steps; ``h`` forgets ``h0`` only after about ``1/(1−β2)`` steps, so on a
        fine-tuning run of hundreds to thousands of steps 0.99999 leaves ``h`` at ``h0`` and σ
        at its initial value); for Kronecker IVON the EMA of the Kronecker factors (0.99:
        factors are far less noisy than the Price estimate).
    diag_beta2 : float, optional
        Kronecker IVON's β2 ∈ [0, 1) of its diagonal sites (0.99999); IVON uses ``beta2``.
    hess_approx : {"price", "gradsq"}
        Hessian estimator: ``ĝ (θ−m)/σ²`` (default) or ``λ ĝ²``.
    clip_radius : float, optional
        Elementwise clip of the preconditioned step (None: no clip).
    debias : bool
        Momentum bias correction (True).
    rescale_lr : bool
        Use ``α (h0 + δ)`` as the step size (True, as ivon-opt).
    mc_samples : int
        S, the draws ``θ_s = m + σ ε_s`` per step (1), evaluated in one batched forward.
    """

    lr: float | None = None
    beta1: float = 0.9
    beta2: float | None = None
    diag_beta2: float | None = None
    hess_approx: str = "price"
    clip_radius: float | None = None
    debias: bool = True
    rescale_lr: bool = True
    mc_samples: int = 1

    def __post_init__(self) -> None:
        owner = f"{type(self).__name__}(): "
        if self.lr is not None:
            check_real("lr", self.lr, ge=0, owner=owner)
        check_real("beta1", self.beta1, ge=0, lt=1, owner=owner)
        for name in ("beta2", "diag_beta2"):
            value = getattr(self, name)
            if value is not None:
                check_real(name, value, ge=0, lt=1, owner=owner)
        if self.clip_radius is not None:
            check_real("clip_radius", self.clip_radius, gt=0, owner=owner)
        if self.hess_approx not in ("price", "gradsq"):
            raise ValueError(
                f"{owner}hess_approx must be 'price' or 'gradsq'; got {self.hess_approx!r}."
            )
        for name in ("debias", "rescale_lr"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{owner}{name} must be True or False.")
        check_int("mc_samples", self.mc_samples, ge=1, owner=owner)

    def hyper(self, beta2: float, diag_beta2: float | None = None) -> dict[str, Any]:
        """The optimizer's hyperparameters, with the family's default ``beta2``/``diag_beta2``."""
        b2 = beta2 if self.beta2 is None else float(self.beta2)
        if self.diag_beta2 is not None:
            diag = float(self.diag_beta2)
        else:
            diag = b2 if diag_beta2 is None else diag_beta2
        return {
            "beta1": float(self.beta1),
            "beta2": b2,
            "diag_beta2": diag,
            "hess_approx": self.hess_approx,
            "clip_radius": math.inf if self.clip_radius is None else float(self.clip_radius),
            "debias": self.debias,
            "rescale_lr": self.rescale_lr,
        }


def _field_names(settings: Any) -> set[str]:
    """The fields of a settings dataclass (an instance or the class)."""
    return {f.name for f in dataclasses.fields(settings)}


class IVONLoss:
    r"""IVON's training objective: the per-example mean data NLL at ``S`` sampled θ.

    .. math:: \hat\ell = \frac{1}{S}\sum_{s=1}^S \frac1B \sum_{b=1}^B -\log p(y_b\mid x_b, θ_s),
              \qquad θ_s = m + σ ε_s

    No prior and no entropy term: they enter through ``weight_decay`` δ and the update (adding
    them here would count the prior twice). Per-example **mean**, not the dataset sum of Pyro's
    ELBOs, so ``pyrobayes.fit(...).losses`` holds mean NLLs. All ``S`` samples run in one
    batched forward. Inside an :class:`IVONFitter` the fitter draws θ (``sampler``); elsewhere
    the guide's ``rsample`` does.

    Parameters
    ----------
    mc_samples : int, optional
        ``S``; defaults to the fitter's (:class:`IVON`'s ``mc_samples``; 1 outside a fitter).
    """

    def __init__(self, mc_samples: int | None = None) -> None:
        if mc_samples is not None and mc_samples < 1:
            raise ValueError(f"Expected mc_samples >= 1 but got {mc_samples}.")
        self.mc_samples = mc_samples
        self.sampler: IVONOptimizer | None = None
        self._last_nll: Tensor | None = None

    def loss(self, model: Any, guide: Any, batch: Any) -> Tensor:
        # S: this objective's own, else the fitter's settings (IVONFitter sets it), else 1
        num = self.mc_samples or 1
        inputs, targets = split_training_batch(model, batch)
        sampler = self.sampler
        values = guide.rsample(num) if sampler is None else sampler.training_sample(num, inputs)
        params = model.batched_output(inputs, values)  # (S, B, ...)
        nll = per_example_nll(model, params, targets, num, batch_size(inputs))
        if sampler is not None and sampler.curvature is not None:
            sampler.curvature.passes(model, params, targets)
        loss = nll.mean()
        self._last_nll = loss.detach()
        return loss

    def terms(self) -> dict[str, Tensor]:
        """``{"nll"}``: the loss itself, the data term per example (IVON's prior and entropy
        enter through δ and the update, not through a term of the loss)."""
        return {} if self._last_nll is None else {"nll": self._last_nll}


def per_example_nll(model: Any, params: Tensor, targets: Tensor, num: int, size: int) -> Tensor:
    """``−log p(y_b | θ_s)`` summed over any per-example trailing dims → ``(S, B)``."""
    log_lik = model.log_likelihood(params, targets)
    if log_lik.shape != (num, size):
        log_lik = log_lik.reshape(num, size, -1).sum(-1)
    return -log_lik


def mean_step_(
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
    r"""In place: ``g ← β1 g + (1−β1) ĝ``, then
    ``m ← m − α(h0+δ) clip(P(g/(1−β1ᵗ) + δ(m − μ0)), ±r)`` with ``t = step + 1``.

    ``P`` is linear (``1/(h+δ)`` for IVON, the damped Kronecker inverse for Kronecker IVON) and
    may work in place on its argument; the debiasing is folded into the step size and the clip
    radius. ``weight_decay`` may be a tensor (one δ per entry); ``prior_loc`` μ0 defaults to 0.
    """
    momentum.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    bias = 1.0 - math.pow(beta1, step + 1) if debias else 1.0
    centred = m if prior_loc is None else torch.sub(m, prior_loc)
    if isinstance(weight_decay, Tensor):
        direction = precondition_(torch.addcmul(momentum, centred, weight_decay, value=bias))
    else:
        direction = precondition_(torch.add(momentum, centred, alpha=weight_decay * bias))
    if math.isfinite(clip_radius):  # clip(d/bias, ±r) = clip(d, ±r·bias)/bias
        direction.clamp_(-clip_radius * bias, clip_radius * bias)
    if not rescale_lr:
        m.sub_(direction, alpha=lr / bias)
    elif isinstance(weight_decay, Tensor):
        m.sub_(direction.mul_((weight_decay + hess_init).mul_(lr / bias)))
    else:
        m.sub_(direction, alpha=lr * (hess_init + weight_decay) / bias)


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
    r"""One step of Algorithm 1 in place on same-dtype ``m``, ``momentum`` and ``hess``.

    ``h ← β2 h + (1−β2) ĥ + ½(1−β2)² (h−ĥ)²/(h+δ)`` (which keeps ``h + δ > 0``), then
    :func:`mean_step_` with ``P = 1/(h+δ)`` at the new ``h``. ``grad`` is ``ĝ`` (the sample
    mean), ``step`` the number of steps taken before this one.
    """
    correction = (hess - hess_hat).square_().div_(hess + weight_decay)
    hess.mul_(beta2).add_(hess_hat, alpha=1.0 - beta2)
    hess.add_(correction, alpha=0.5 * (1.0 - beta2) ** 2)
    mean_step_(
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


class IVONOptimizer(torch.optim.Optimizer):
    r"""IVON over one flat state, closure-driven (``needs_closure = True``).

    The flat vectors ``m``, ``h`` and the momentum are laid out as ``[point parameters |
    diagonal sites | Kronecker sites]`` (``h`` over the first two). Each :meth:`step` perturbs
    the point parameters in place (ivon-opt style; one ``randn`` per tensor), runs the closure,
    whose :class:`IVONLoss` draws the sites' ``θ_s = m + σ ε_s`` from :meth:`training_sample`
    (one ``randn`` over all sites in site order per sample, as ivon-opt does for a parameter
    group), restores the point parameters and applies :func:`ivon_step_` to the diagonal
    entries; ``curvature`` (:class:`~pyrobayes.infer.kron.KronCurvature`) updates the Kronecker
    block. The guide's means and ``h`` buffers stay the source of truth: ``m`` and ``h`` are
    re-read whenever someone else wrote them (loading a checkpoint, ``set_site``) and written
    back after every step. A non-finite loss leaves everything untouched.

    Parameters
    ----------
    params : iterable of Parameter
        The guide's means and the model's point parameters (e.g. a head), which get diagonal
        IVON with ``point_weight_decay`` and ``point_prior_loc``, their ``h`` kept here.
    guide : IVONGuide
    lr : float
        α (nominal; multiplied by ``h0 + δ`` when ``rescale_lr``).
    curvature : KronCurvature, optional
        The Kronecker statistics and update (required when the guide has Kronecker sites).
    settings : IVON, optional
        The optimizer's settings (default ``IVON()``, with IVON's ``beta2 = DEFAULT_BETA2``).
    """

    needs_closure = True

    def __init__(
        self,
        params: Iterable[Tensor],
        guide: Any,
        lr: float,
        curvature: Any = None,
        settings: IVON | None = None,
    ) -> None:
        if lr < 0:
            raise ValueError(f"Expected lr >= 0 but got {lr}.")
        super().__init__(params, {"lr": float(lr)})
        self.guide, self.curvature = guide, curvature
        fit = (settings or IVON()).hyper(DEFAULT_BETA2)
        #: the posterior's constants and the fit's settings, as the update reads them
        self.hyper: dict[str, Any] = {**guide.hyper, **fit}
        locs, hess = guide.tensors()
        ids = {id(p) for p in locs}
        self.extras = [p for g in self.param_groups for p in g["params"] if id(p) not in ids]
        sites = list(guide.sites)
        order = [j for j, h in enumerate(hess) if h is not None]
        self._num_diag = len(order)
        order += [j for j, h in enumerate(hess) if h is None]
        if (len(order) > self._num_diag) != (curvature is not None):
            raise ValueError(
                "IVONOptimizer needs a curvature exactly when there are Kronecker sites."
            )
        self._order = order
        self._sites = [sites[j] for j in order]
        self._shapes = [guide.sites[s] for s in self._sites]
        self._dtypes = [guide.param_dtype[s] for s in self._sites]
        self._numels = [shape.numel() for shape in self._shapes]
        self._extra_numels = [p.numel() for p in self.extras]
        self._n_extra = sum(self._extra_numels)
        self._n_diag = sum(self._numels[: self._num_diag])
        starts = [0]
        for shape in guide.sites.values():
            starts.append(starts[-1] + shape.numel())
        # where the flat order [diagonal | Kronecker sites] reads the site-order draw
        perm = [i for j in order for i in range(starts[j], starts[j + 1])]
        self._perm = None if order == sorted(order) else torch.tensor(perm)
        self._flat: dict[str, Any] | None = None
        self._sigma: Tensor | None = None  # σ of the sites during a step
        self._leaf: Tensor | None = None  # θ_s − m of the closure's draw, (S, T_sites)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; the ``set_to_none`` path skips its overhead."""
        if not set_to_none:
            return super().zero_grad(set_to_none=False)
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    # ------------------------------------------------------------------ the flat state
    def _sync(self) -> dict[str, Any]:
        """The flat ``m`` and ``h`` (and their per-tensor views), re-read if anyone else wrote
        the guide's tensors or the point parameters since the last step."""
        locs, hess = self.guide.tensors()
        targets = [*self.extras, *(locs[j] for j in self._order)]
        targets += [hess[j] for j in self._order[: self._num_diag]]
        state = self.state["ivon"]  # type: ignore[index]  # one entry for the flat state
        flat = self._flat
        if (
            flat is not None
            and flat["state"] is state
            and all(
                t is u and t._version == v for t, (u, v) in zip(targets, flat["seen"], strict=True)
            )
        ):
            return flat
        hp, P, D = self.hyper, self._n_extra, self._n_extra + self._n_diag
        dtype, n_m = self.guide.state_dtype, len(targets) - self._num_diag
        m = torch.cat([t.detach().reshape(-1).to(dtype) for t in targets[:n_m]])
        if not state:  # a fresh state: g = 0, h = h0 for the point parameters, μ0 = their start
            state.update(
                step=0, momentum=torch.zeros_like(m), hess=m.new_full((D,), hp["hess_init"])
            )
            if hp["point_prior_loc"] == "init" and P:
                state["prior_loc"] = torch.cat([m[:P], m.new_zeros(D - P)])
        elif hp["point_prior_loc"] == "init" and P and "prior_loc" not in state:
            raise RuntimeError(
                "IVONOptimizer: point_prior_loc='init' but the saved optimizer state has no "
                "prior_loc (it was started with point_prior_loc='zero'); start a new fit or "
                "keep the guide's point_prior_loc as it was."
            )
        h = state["hess"]
        if self._num_diag:
            h[P:] = torch.cat([t.reshape(-1) for t in targets[n_m:]])
        sizes = self._extra_numels + self._numels
        views = [v.view_as(t) for v, t in zip(m.split(sizes), targets[:n_m], strict=True)]
        h_parts = h[P:].split(self._numels[: self._num_diag])
        views += [v.view_as(t) for v, t in zip(h_parts, targets[n_m:], strict=True)]
        delta, point = hp["weight_decay"], hp["point_weight_decay"]
        if P and D > P and point != delta:  # one δ per entry: the point parameters' and the sites'
            delta = torch.cat([m.new_full((P,), point), m.new_full((D - P,), delta)])
        elif P and D == P:
            delta = point
        use_prior = hp["point_prior_loc"] == "init" and P
        noise_e = m.new_empty(P)
        noise_views = [
            v.view_as(p)
            for v, p in zip(noise_e.split(self._extra_numels), self.extras, strict=True)
        ]
        flat = self._flat = {
            "state": state,
            "m": m,
            "targets": targets,
            "views": views,
            "delta": delta,
            "prior_loc": state["prior_loc"] if use_prior else None,
            "noise_e": noise_e,
            "noise_views": noise_views,
        }
        self._record(flat)
        return flat

    @staticmethod
    def _record(flat: dict[str, Any]) -> None:
        flat["seen"] = [(t, t._version) for t in flat["targets"]]

    # ------------------------------------------------------------------ sampling
    def training_sample(self, num: int, inputs: Any = None) -> dict[str, Tensor]:
        r"""Draw ``θ_s = m + σ ε_s`` at every site for the closure of :meth:`step`.

        One ``randn`` over all sites (site order, state dtype) per sample; the perturbations
        ``θ_s − m`` form one leaf `(S, T)` whose ``.grad`` after the backward holds the
        per-sample gradients. ``inputs`` (the batch) gives the Kronecker statistics their token
        mask. Returns ``{site: (num, *shape)}`` in the weight dtype.
        """
        sigma, flat = self._sigma, self._flat
        if sigma is None or flat is None:
            raise RuntimeError("training_sample() is called by IVONLoss inside IVONOptimizer.step.")
        T, dtype, device = sum(self._numels), sigma.dtype, sigma.device
        with torch.no_grad():
            if num == 1:
                eps = torch.randn(T, dtype=dtype, device=device).unsqueeze(0)
            else:
                eps = torch.stack([torch.randn(T, dtype=dtype, device=device) for _ in range(num)])
            if self._perm is not None:
                self._perm = self._perm.to(sigma.device)
                eps = eps[:, self._perm]
            curvature, Dn = self.curvature, self._n_diag
            if curvature is None:
                noise = eps.mul_(sigma)
            else:
                curvature.observe(inputs)
                noise = torch.cat([eps[:, :Dn] * sigma, curvature.perturbation(eps[:, Dn:])], 1)
        self._leaf = noise.requires_grad_(True)
        theta = flat["m"][self._n_extra :] + noise
        values = {}
        parts = theta.split(self._numels, 1)
        for site, part, shape, dtype in zip(
            self._sites, parts, self._shapes, self._dtypes, strict=True
        ):
            value = part.view(num, *shape)
            values[site] = value if dtype == value.dtype else value.to(dtype)
        return values

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor:  # type: ignore[override]
        if closure is None:
            raise RuntimeError(
                "IVONOptimizer.step needs a closure that evaluates the loss and calls backward "
                "(pyrobayes.fit passes one)."
            )
        flat = self._sync()
        prec = self._perturb_points(flat)
        loss = self._run_closure(closure, flat["state"]["step"])
        if not math.isfinite(float(loss)):
            self._refuse()
            return loss
        try:  # (a failing all-reduce, a closure that drew no sample)
            grad, hhat = self._statistics(flat, prec)
        except BaseException:
            self._refuse()  # the point parameters back at their means, the records dropped
            raise
        if not bool(grad.isfinite().all()):  # refused before anything is updated
            self._refuse()
            raise FloatingPointError(
                f"Non-finite gradient at step {flat['state']['step']} in "
                f"{', '.join(self._non_finite(grad))}; parameters were not updated."
            )
        self._update(flat, grad, hhat)
        return loss

    def _perturb_points(self, flat: dict[str, Any]) -> Tensor:
        """``λ(h + δ)`` over ``[point parameters | diagonal sites]``; the point parameters are
        perturbed in place (one ``randn`` per tensor, in order) and the sites' σ is kept for
        :meth:`training_sample`."""
        P, D = self._n_extra, self._n_extra + self._n_diag
        prec = (flat["state"]["hess"] + flat["delta"]).mul_(self.hyper["ess"])  # λ(h + δ)
        sigma = prec.rsqrt()
        if P:
            for view in flat["noise_views"]:
                torch.randn(view.shape, out=view)
            flat["noise_e"].mul_(sigma[:P])
            torch._foreach_add_(self.extras, flat["noise_views"])
        self._sigma, self._leaf = sigma[P:D], None
        return prec

    def _run_closure(self, closure: Callable[[], Tensor], step: int) -> Tensor:
        """The closure's loss (the mean over ranks); the point parameters are restored if it
        raises (and the Kronecker statistics it recorded dropped: their layer outputs would
        keep the forward's graph alive), and the Kronecker statistics record during it."""
        curvature = self.curvature
        if curvature is not None:
            curvature.start(step)
        try:
            with torch.enable_grad():  # one rank's error: a NaN share, then every rank stops
                loss = run_shared(closure, nan_share)
        except BaseException:
            self._refuse()
            raise
        finally:
            self._sigma = None
            if curvature is not None:
                curvature.stop()
        loss = loss.detach().reshape(())
        if world()[0] > 1:  # every rank sees the same value, so all stop on a NaN together
            loss = shared_copy(loss)
            try:
                all_reduce_mean_([loss])
            except BaseException:
                self._refuse()
                raise
        return loss

    def _refuse(self) -> None:
        """Leave everything as before the step: the point parameters at their means, no grads,
        the curvature's factors as they were and its recorded statistics dropped."""
        self._restore()
        for p in self.extras:
            p.grad = None
        if self.curvature is not None:
            self.curvature.undo()

    def _statistics(self, flat: dict[str, Any], prec: Tensor) -> tuple[Tensor, Tensor]:
        """``(ĝ, ĥ)`` over ``[point | diagonal | Kronecker]`` (ĥ over the first two) from the
        closure's draw, averaged over ranks."""
        hp, P, D = self.hyper, self._n_extra, self._n_extra + self._n_diag
        leaf, self._leaf = self._leaf, None
        if leaf is None:
            self._restore()
            raise RuntimeError(
                "IVONOptimizer: the closure drew no training sample; fit with the default "
                "objective (IVONLoss), which calls training_sample()."
            )
        grads = torch.zeros_like(leaf) if leaf.grad is None else leaf.grad
        noise, num = leaf.detach(), leaf.shape[0]
        # ĝ over all entries; Σ_s because the loss averages the S samples (∂/∂θ_s carries 1/S)
        grad = grads[0] if num == 1 else grads.sum(0)
        price = hp["hess_approx"] == "price"
        gd = grads[:, : D - P]
        hhat = gd * (noise[:, : D - P] if price else gd)
        hhat = hhat[0] if num == 1 else hhat.sum(0) if price else hhat.sum(0).mul_(num)
        if P:
            parts = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.extras]
            g_e = torch.cat([g.reshape(-1) for g in parts]).to(flat["m"].dtype)
            grad = torch.cat([g_e, grad])
            hhat = torch.cat([g_e * (flat["noise_e"] if price else g_e), hhat])
        hhat = hhat.mul_(prec) if price else hhat.mul_(hp["ess"])
        all_reduce_mean_([grad, hhat])
        return grad, hhat

    def _update(self, flat: dict[str, Any], grad: Tensor, hhat: Tensor) -> None:
        """Algorithm 1's update of ``m``, ``h`` and the momentum (the Kronecker block's by its
        curvature), written back to the guide's tensors and the point parameters.

        A step that leaves ``m`` or ``h`` unusable, or whose Kronecker factor estimates ``Â``,
        ``Ĝ`` are not finite, is undone: ``m``, ``h``, the momentum and the
        curvature's factors and decompositions stay as before it (the factors' EMA is applied
        only once the step is kept, :meth:`KronCurvature.commit
        <pyrobayes.infer.kron.KronCurvature.commit>`). An exception raised during the update
        (e.g. the re-decomposition's ``eigh`` failing, ``torch.linalg.LinAlgError``) undoes it
        the same way before it propagates, so the state is never half a step."""
        hp, state, m, D = self.hyper, flat["state"], flat["m"], self._n_extra + self._n_diag
        t, lr, momentum = state["step"], self.param_groups[0]["lr"], state["momentum"]
        before = (m.clone(), momentum.clone(), state["hess"].clone())  # undone if it goes bad
        try:  # free unless it raises (Python 3.11's zero-cost exceptions)
            ivon_step_(
                m[:D],
                momentum[:D],
                state["hess"],
                grad[:D],
                hhat,
                t,
                lr=lr,
                hess_init=hp["hess_init"],
                beta1=hp["beta1"],
                beta2=hp["diag_beta2"],
                weight_decay=flat["delta"],
                clip_radius=hp["clip_radius"],
                debias=hp["debias"],
                rescale_lr=hp["rescale_lr"],
                prior_loc=flat["prior_loc"],
            )
            if self.curvature is not None:  # its eigh may raise (LinAlgError) on some backends
                self.curvature.step_(m[D:], momentum[D:], grad[D:], t, lr)
            bad, factors = self._unusable_state(flat)
        except BaseException:  # half a step: undone as a refused one, then re-raised
            self._undo(flat, before)
            raise
        if bad or factors:  # undone: the guide and the optimizer's state stay as before the step
            self._undo(flat, before)
            raise FloatingPointError(self._refusal(t, bad, factors))
        if self.curvature is not None:
            self.curvature.commit()
        state["step"] = t + 1
        torch._foreach_copy_(flat["targets"], flat["views"])
        self._record(flat)

    def _undo(self, flat: dict[str, Any], before: tuple[Tensor, Tensor, Tensor]) -> None:
        """Put ``m``, the momentum and ``h`` back to ``before`` (their copies from before the
        update), then :meth:`_refuse` (the point parameters at those means, the curvature's
        factors and decompositions as they were)."""
        state = flat["state"]
        for now, then in zip((flat["m"], state["momentum"], state["hess"]), before, strict=True):
            now.copy_(then)
        self._refuse()

    def _unusable_state(self, flat: dict[str, Any]) -> tuple[list[str], list[str]]:
        """The sites and point parameters whose updated ``m`` is not finite or whose ``h`` is
        not finite or has ``h + δ <= 0`` (σ = (λ(h + δ))^{-1/2} would be NaN, 0 or inf), and
        the Kronecker factor estimates of the step that are not finite
        (:meth:`KronCurvature.estimates_unusable
        <pyrobayes.infer.kron.KronCurvature.estimates_unusable>`, folded into the same flag);
        one device sync when all are usable."""
        m, hess, D = flat["m"], flat["state"]["hess"], self._n_extra + self._n_diag
        bad_h = ~((hess + flat["delta"]) > 0) | hess.isinf()
        bad_m = ~m.isfinite()
        flag = bad_h.any() | bad_m.any()
        factors = None if self.curvature is None else self.curvature.estimates_unusable()
        if factors is not None:
            flag = flag.logical_or(factors.to(flag.device))
        if not bool(flag):
            return [], []
        bad = bad_m.clone()
        bad[:D] |= bad_h
        names = self._names_where(bad)
        return names, [] if factors is None else self.curvature.non_finite_estimates()

    def _refusal(self, step: int, bad: list[str], factors: list[str]) -> str:
        """The message of a refused update: ``bad`` sites' ``m`` or ``h`` were unusable,
        ``factors`` names the Kronecker factor estimates that were not finite."""
        undone = "the step was undone, so the guide keeps its values from before it."
        parts = []
        if factors:
            dtype = self.guide.state_dtype
            parts.append(
                f"Kronecker IVON's factor estimates at step {step} are not finite: "
                f"{', '.join(factors)} (kept, they would surface only at the factors' next "
                f"re-decomposition, as NaN means); {undone}"
            )
            if any("input factor" in f for f in factors):
                limit = torch.finfo(dtype).max
                parts.append(
                    "A is the mean of a aᵀ over the rows a of the layer's input, summed in "
                    f"{str(dtype).removeprefix('torch.')}, which overflows once Σ a² passes "
                    f"{limit:.2g} (inputs of about {math.sqrt(limit):.2g}): check the inputs "
                    "(standardize the features; look for inf/NaN or huge values in the batch)."
                )
            if any("output-gradient factor" in f for f in factors):
                parts.append(
                    "G is built from the loss's gradients at the layer's outputs, which blow up "
                    "when the fit diverges: lower the learning rate, or pass clip_radius to "
                    "pb.infer.KronIVON to bound the steps."
                )
        if bad:
            parts.append(
                f"IVON's update at step {step} left the Hessian estimate h non-finite or "
                f"h + δ <= 0, or the mean m non-finite, in {', '.join(bad)}; {undone} Lower "
                f"hess_init (now {self.hyper['hess_init']:g}) or the learning rate (a "
                "non-finite m: pass clip_radius to pb.infer.IVON)."
            )
        return " ".join(parts)

    def _names_where(self, flags: Tensor) -> list[str]:
        """The sites and point parameters with a set entry in the flat ``flags``."""
        names = [f"point parameter {i} {tuple(p.shape)}" for i, p in enumerate(self.extras)]
        names += [f"site {site}" for site in self._sites]
        parts = flags.split(self._extra_numels + self._numels)
        return [n for n, f in zip(names, parts, strict=True) if bool(f.any())]

    def _non_finite(self, grad: Tensor) -> list[str]:
        """The sites and point parameters whose part of the flat ``grad`` is not finite."""
        names = [f"point parameter {i} {tuple(p.shape)}" for i, p in enumerate(self.extras)]
        names += [f"site {site}" for site in self._sites]
        parts = grad.split(self._extra_numels + self._numels)
        return [n for n, g in zip(names, parts, strict=True) if not bool(g.isfinite().all())]

    def _restore(self) -> None:
        """Put the point parameters back at their means (after the closure's perturbation)."""
        flat = self._flat
        if self.extras and flat is not None:
            n = len(self.extras)
            torch._foreach_copy_(flat["targets"][:n], flat["views"][:n])


class IVONFitter(Fitter):
    r"""Fits an :class:`~pyrobayes.guides.IVONGuide` by IVON (Shen et al., 2024, Algorithm 1).

    .. math::
        m ← m − α (h_0+δ)\, \operatorname{clip}\Big(\frac{g/(1−β_1^t) + δ (m − μ_0)}{h+δ},
        \ ±r\Big),\quad g ← β_1 g + (1−β_1) ĝ,\quad
        h ← β_2 h + (1−β_2) ĥ + \tfrac12 (1−β_2)^2 \tfrac{(h−ĥ)^2}{h+δ}

    with ``ĝ``, ``ĥ`` the sample means of ``∇ℓ̄(θ_s)`` and ``∇ℓ̄(θ_s) ⊙ (θ_s − m) λ(h+δ)`` at
    ``θ_s = m + σ ε_s`` (:class:`IVONLoss`, the per-example mean NLL, drawn by
    :class:`IVONOptimizer`). The sites and the model's point parameters are updated alike
    (the latter with ``point_weight_decay`` and ``point_prior_loc``). ``optimizer`` may be an
    :class:`IVON` (the settings; its ``lr``, when set, overrides the ``lr`` given here; its
    ``mc_samples`` is the default objective's S). :meth:`state_dict` holds the momentum, the
    point parameters' ``h`` and μ0, the step count (debiasing; Kronecker IVON's ``T_stats`` /
    ``T_inv``) and the settings, so a checkpoint resumes exactly.
    """

    settings: IVON  # the fit's settings record (Fitter.settings)

    #: IVON's step ``α(h0+δ)/(h+δ)·g`` grows as ``h`` falls from ``h0`` to the data's curvature,
    #: which falls as the fit grows confident (``p(1−p)`` of the cross-entropy), so a rate
    #: stable at the start overshoots at the end: Shen et al. (2024) anneal it by a cosine in
    #: their experiments. Measured on the suite's MLP tasks at the examples'
    #: α = 0.1, 60 epochs (calibration splits, 3 seeds): a constant rate ended at training loss
    #: 1.6 after 0.69 on an MNIST seed (accuracy .81, the cosine's .89); the cosine lowered the
    #: NLL on 15 of 18 task × family × seed fits (docs/methods/ivon.md).
    default_scheduler: str | None = "cosine"
    #: ... after a linear warm-up over the first 10% of the run: at the start ``h`` is still
    #: ``h0``, so the first steps are plain momentum steps of size ``α``, which on a network
    #: with adapters on five stacked layers threw the cores 5-20x past MAP's (accuracy .40-.74
    #: against MAP's .89-.93; with the warm-up .84-.89, and level or lower NLL on two and three
    #: layers; ``benchmarks/ivon_depth.py``, docs/methods/ivon.md).
    default_warmup: float = 0.1
    #: α when the caller gives no ``lr``: the examples' and the suite's MLP setting. At Adam's
    #: 1e-2 IVON's step (``α·ĝ`` while ``h`` is near ``h0``, a plain momentum step on the
    #: per-example mean loss) barely moves in a short fit: on the README's quick start (3
    #: epochs, 2 seeds) accuracy .24-.50 against MAP's .94; at 0.1 .81-.86, and .95-.96 after
    #: 10 epochs (0.3 was faster there, but 0.1 is the rate the suite's tasks are stable at).
    default_lr: float = 0.1

    #: the family's ``(beta2, diag_beta2)`` when :class:`IVON` leaves them unset
    default_betas: tuple[float, float | None] = (DEFAULT_BETA2, None)
    #: the settings class this fitter takes (a base class' record is widened to it)
    settings_class: type[IVON] = IVON

    def __init__(self, model: Any, guide: Any, *, optimizer: Any = None, **kwargs: Any) -> None:
        #: the fit's settings: ``optimizer`` when it is one, else those given to the guide's
        #: constructor (deprecated), else the defaults
        self.settings = self._resolve_settings(optimizer, guide)
        if optimizer is not None and not isinstance(optimizer, IVON):
            raise TypeError(
                f"{type(self).__name__}: optimizer={getattr(optimizer, '__name__', optimizer)!r} "
                f"is not IVON's: {type(guide).__name__}'s posterior (its curvature h and so "
                "its scales) is fitted by IVON's own update, which a torch optimizer never runs "
                f"(sigma would stay at its initial value). Pass pb.infer.{self.settings_class.__name__}"
                "(...) for its settings, or fit another family."
            )
        if isinstance(optimizer, IVON):
            optimizer = None
        #: the fit's hyperparameters (``IVON.hyper`` with the family's defaults)
        self.hyper = self.settings.hyper(*self.default_betas)
        super().__init__(model, guide, optimizer=optimizer, **kwargs)
        self._refuse_variational(
            "IVON's update needs the per-example mean NLL at its own draws θ = m + σε "
            "(IVONLoss); the prior and the entropy enter through δ and the update, not the loss."
        )
        if isinstance(self.objective, IVONLoss):
            self.objective = copy.copy(self.objective)  # bound to this fitter's draws and S
            if self.objective.mc_samples is None:
                self.objective.mc_samples = self.settings.mc_samples
            if isinstance(self.optimizer, IVONOptimizer):
                self.objective.sampler = self.optimizer

    def _resolve_settings(self, optimizer: Any, guide: Any) -> IVON:
        """The settings record of this fit (see ``__init__``)."""
        cls = self.settings_class
        if not isinstance(optimizer, IVON):
            return cls(**getattr(guide, "fit_settings", {}))
        extra = _field_names(optimizer) - _field_names(cls)  # e.g. Kronecker IVON's, for IVON
        if isinstance(optimizer, cls) and not extra:
            return optimizer
        if issubclass(cls, type(optimizer)):  # a base record (IVON for Kronecker IVON): widened
            return cls(**dataclasses.asdict(optimizer))
        raise TypeError(
            f"{type(self).__name__}: optimizer={type(optimizer).__name__}(...) holds another "
            f"family's settings; pass pb.infer.{cls.__name__}(...) (the settings of "
            f"{type(guide).__name__})."
        )

    def default_objective(self) -> IVONLoss:
        return IVONLoss()

    def check_input_scale(self, inputs: Any) -> None:
        """The first batch: warn when floating-point inputs are far from unit scale.

        ``h0`` (``hess_init``) and the step ``α·(h0 + δ)`` presume curvature of order one,
        i.e. features of order one: on raw features in the hundreds IVON diverged and
        Kronecker IVON interpolated the training set (docs/methods/ivon.md).
        """
        spreads = [
            float(t.detach().double().std())
            for t in _float_leaves(inputs)
            if t.numel() > 1 and t.dim() >= 1
        ]
        spread = max((v for v in spreads if math.isfinite(v)), default=0.0)
        if spread <= 30.0:
            return
        warnings.warn(
            f"{type(self.guide).__name__}: the first batch's floating-point inputs have a "
            f"standard deviation of {spread:.3g}. IVON's Hessian initialisation (hess_init = "
            f"{self.guide.hyper['hess_init']:g}) and step size presume features of order one; "
            "on raw features in the hundreds it diverges or over-fits. Standardize the inputs "
            "(per feature: (x − mean) / sd over the training set).",
            UserWarning,
            stacklevel=user_stacklevel(),
        )

    def end(self, data: Iterable[Any] | None = None) -> None:
        """After the last step: warn when ``h`` never left ``h0`` (:func:`warn_if_shapeless`)."""
        super().end(data)
        if isinstance(self.optimizer, IVONOptimizer):
            warn_if_shapeless(self.optimizer)

    def default_optimizer(self, params: list[torch.nn.Parameter], lr: float) -> IVONOptimizer:
        if self.settings.lr is not None:
            rate = float(self.settings.lr)
            name = type(self.settings).__name__
            lr = self._take_rate(
                rate,
                f"{name}(lr={rate:g}) sets the fit's rate. Give the rate in one place: "
                "pyrobayes.fit(..., lr=...) or the record's lr.",
            )
        optimizer = IVONOptimizer(params, self.guide, lr, self._curvature(), self.settings)
        optimizer.hyper.update(self.hyper)
        return optimizer

    def _curvature(self) -> Any:
        """The Kronecker statistics (:class:`~pyrobayes.infer.kron.KronIVONFitter`); none here."""
        return None


def warn_if_shapeless(optimizer: IVONOptimizer) -> bool:
    r"""Warn (once, on rank 0) when the diagonal sites' ``h`` is still ``h0``'s remainder.

    ``h_t = β2^t h0 + (data)``: the data part is the EMA of the curvature estimates ``ĥ`` plus
    the update's non-negative correction. When it stays below :data:`SHAPELESS_FRACTION` of
    ``β2^t h0`` at :data:`SHAPELESS_QUANTILE` of the coordinates after the EMA has forgotten at
    least :data:`SHAPELESS_MIN_FORGOTTEN` of ``h0``, the estimates were far below ``h0``: nearly
    every posterior sd ``1/sqrt(λ(h+δ))`` is the same and q's shape is its initialisation's,
    not the data's (the fit is momentum SGD with isotropic noise). Seen on plain LoRA factors at
    the defaults (docs/methods/ivon.md).

    Returns
    -------
    bool
        Whether it warned.
    """
    state = optimizer.state.get("ivon")  # type: ignore[call-overload]
    _, hess = optimizer.guide.tensors()
    parts = [h.detach().reshape(-1) for h in hess if h is not None]
    if not state or not parts or world()[1] != 0:
        return False
    steps, hp = int(state["step"]), optimizer.hyper
    h0, decay = float(hp["hess_init"]), float(hp["diag_beta2"]) ** steps
    h = torch.cat(parts).double()
    if 1.0 - decay < SHAPELESS_MIN_FORGOTTEN or h.numel() < 2:
        return False
    data = (h - decay * h0).abs()  # the data's part of h (the correction term included)
    stride = data.numel() // 2**24 + 1  # torch.quantile takes at most 2^24 values: a strided sample
    level = float(data[::stride].quantile(SHAPELESS_QUANTILE))
    if not level < SHAPELESS_FRACTION * decay * h0:
        return False
    ess, delta = float(hp["ess"]), float(hp["weight_decay"])
    sd = 1.0 / math.sqrt(ess * (float(h.median()) + delta))
    warnings.warn(
        f"IVON: after {steps} steps h, the Hessian estimate of the latent sites, is still "
        f"h0·β2^t = {decay * h0:.3g} give or take {level:.2g} at "
        f"{SHAPELESS_QUANTILE:.0%} of the coordinates: the data's curvature estimates (there "
        f"at most {level / (1.0 - decay):.2g} on average) are far below hess_init = {h0:g}, so "
        f"nearly every posterior sd is the same ({sd:.3g}) and q's shape is its "
        "initialisation's, not the data's (the fit is SGD with momentum and isotropic noise). "
        "To let the data shape q, lower hess_init below their curvature and raise ess to keep "
        "the sd, with a clip radius for the larger steps (IVON-LoRA's regime for a "
        "transformer's LoRA factors, docs/methods/ivon.md); keep it if an isotropic posterior "
        "is what you want.",
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )
    return True


register_fitter("ivon", IVONFitter)
