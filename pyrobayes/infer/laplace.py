r"""Post-hoc Laplace over the latent sites (cores): the fitter, the settings and the prior precision.

At the MAP ``θ*`` (the guide's point) laplace-torch computes the GGN of the summed negative
log-likelihood over the sites, diagonal or K-FAC (:mod:`pyrobayes.infer.curvature`); the
posterior is ``N(θ*, (H + τ I)^{-1})`` and its predictive the linearised (GLM) one
(:mod:`pyrobayes.linearized`; dense-Jacobian reference in :mod:`pyrobayes.infer.glm`).

Prior precision. ``τ`` maximises a log marginal likelihood over ``log τ ∈ [lo, hi]`` (natural
log, default ``[−5, 10]``; a grid, then golden-section search) with ``θ*`` and ``H`` held at the
trained MAP. By default the one with ``θ*`` taken as the likelihood's mode and the prior
integrated exactly against the log-likelihood's quadratic there (``λ_i``, ``θ*_i`` in the
curvature's eigenbasis; :mod:`pyrobayes.infer.evidence`, MacKay 1992),

.. math:: \log p(D\mid τ) ≈ \log p(D\mid θ^*)
          - \tfrac12 \sum_i \Big[θ^{*2}_i \frac{λ_i τ}{λ_i+τ} + \log\big(1 + λ_i/τ\big)\Big],

or (``Laplace(evidence="posterior_mode")``) laplace-torch's post-hoc marginal likelihood with
``θ*`` taken as the posterior's mode (Immer et al. 2021),

.. math:: \log p(D\mid τ) ≈ \log p(D\mid θ^*) - \tfrac τ2 \|θ^*\|^2
          - \tfrac12 \log\det(H + τ I) + \tfrac d2 \log τ,

which MacKay's (1992) iteration, alternating with MAP refits, maximises (:class:`LaplaceFitter`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..batch import batch_size, split_batch, to_device
from ..calibration import drop_temperature
from ..guides.laplace import _ALTERNATE_LAYERWISE
from ..models.adapters import check_int, check_real
from .curvature import (
    _ROWS,
    LaplaceNet,
    _import_laplace,
    _laplace_likelihood,
    _Loader,
    per_example_ggn_backend,
)
from .distributed import all_reduce_sum_, world
from .evidence import (
    effective_parameters,
    eigen_coordinates,
    likelihood_mode_log_evidence,
    posterior_mode_log_evidence,
)
from .fitter import Fitter
from .glm import glm_moments, glm_predict
from .rank_errors import PASS_REMEDY, raise_kept, run_shared

logger = logging.getLogger(__name__)

__all__ = [
    "LaplaceFitter",
    "Laplace",
    "fit_laplace",
    "tune_prior_precision",
    "glm_moments",
    "glm_predict",
    "LaplaceNet",
    "per_example_ggn_backend",
]


#: the marginal likelihoods :class:`Laplace` can maximise (its ``evidence``)
EVIDENCE = ("likelihood_mode", "posterior_mode")


@dataclass(frozen=True)
class Laplace:
    r"""The Laplace fit's settings: how ``prior_precision="marglik"`` searches τ (the fitter's,
    not the posterior's; the posterior's ``prior_precision``, ``temperature``, ``structure``,
    ``subset`` and predictive stay the guide's).

    Pass it as the fit's optimizer, ``pb.fit(model, guide, data, ...,
    optim=pb.Optimization(optimizer=pb.infer.Laplace(prior_optimization="alternate")))``,
    ``make_fitter(model, guide, optimizer=pb.infer.Laplace(...))`` or
    ``fit_laplace(model, guide, data, settings=pb.infer.Laplace(...))``. Saved in the fitter's
    checkpoint (a resume under other settings is refused), not with the posterior.

    Parameters
    ----------
    prior_optimization : {"evidence", "alternate", "validation"}
        How ``"marglik"`` tunes τ: post hoc at the fixed MAP (the marginal likelihood
        ``evidence`` names), or MacKay's (1992) evidence iteration alternating with
        MAP refits (:class:`LaplaceFitter`). ``"alternate"`` needs the guide's
        ``prior_precision="marglik"`` and a model with a ``prior_scale`` (a ``FineTuneModel``).
        ``"validation"``: the guide's τ (the evidence's for ``"marglik"``), then the multiple of
        it of least NLL on the fit's held-out data, ``pb.fit(..., validation=pb.Validation(
        data))`` (:func:`~pyrobayes.infer.prior_precision.select_prior_precision`, laplace-torch's
        grid search).
    evidence : {"likelihood_mode", "posterior_mode"}, optional
        Which marginal likelihood ``"evidence"`` and ``"validation"`` maximise.
        ``"likelihood_mode"`` (their default): the fitted point taken as the log-likelihood's
        mode and the prior integrated exactly against its quadratic, ``log p(D|θ̂) − Σ_i
        [θ̂_i² λ_i τ/(λ_i+τ) + log(1 + λ_i/τ)]/2`` in the curvature's eigenbasis (MacKay, 1992;
        :mod:`pyrobayes.infer.evidence`): coordinates the data do not determine (``λ_i ≪ τ``),
        such as those Adam moved from a random initialisation, do not pull τ down.
        ``"posterior_mode"``: laplace-torch's, the point taken as the posterior's mode under the
        prior it scores, ``log p(D|θ̂) − τ‖θ̂‖²/2 − log det(I + H/τ)/2`` (Immer et al., 2021),
        the default and only choice of ``"alternate"``, whose refits make the point that mode.
    log_prior_bounds : (float, float)
        Natural-log bounds of the τ search (default ``(-5, 10)``).
    alternate_tol : float
        Stop alternating when ``|log τ_new − log τ| <`` this (natural log; 1e-3).
    alternate_max_iter : int
        At most this many MAP refits (20).
    alternate_epochs : int
        At most this many epochs over the training data per MAP refit (100; warm-started at the
        previous MAP); a refit stops earlier once the MAP is stationary.
    alternate_map_tol : float
        A refit's MAP is stationary when the whole-data gradient of its objective is below this
        fraction of its prior term's gradient ``‖τ θ‖`` (1e-2;
        :meth:`LaplaceFitter.map_residual`).
    alternate_lr : float, optional
        Learning rate of the refits; ``None``: the one the fitter started with (not the value a
        schedule decayed it to).
    optimizer : torch optimizer class or callable ``params -> Optimizer``, optional
        The MAP's torch optimizer (``None``: Adam at the fit's ``lr``). A checkpoint records it
        by name.
    """

    prior_optimization: str = "evidence"
    evidence: str | None = None
    log_prior_bounds: Sequence[float] = (-5.0, 10.0)
    alternate_tol: float = 1e-3
    alternate_max_iter: int = 20
    alternate_epochs: int = 100
    alternate_map_tol: float = 1e-2
    alternate_lr: float | None = None
    optimizer: Callable[..., Any] | None = None

    @property
    def needs_validation(self) -> bool:
        """Whether the fit must be given held-out data (``prior_optimization="validation"``):
        a training loop that otherwise validates only fits with epochs passes it to this one."""
        return self.prior_optimization == "validation"

    def __post_init__(self) -> None:
        owner = "Laplace(): "
        if self.prior_optimization not in ("evidence", "alternate", "validation"):
            raise ValueError(
                f"{owner}expected prior_optimization 'evidence', 'alternate' or 'validation' "
                f"but got {self.prior_optimization!r}."
            )
        if self.evidence is None:  # the default of the prior optimisation
            default = "posterior_mode" if self.prior_optimization == "alternate" else EVIDENCE[0]
            object.__setattr__(self, "evidence", default)
        if self.evidence not in EVIDENCE:
            raise ValueError(
                f"{owner}expected evidence {' or '.join(map(repr, EVIDENCE))} but got "
                f"{self.evidence!r}."
            )
        if self.prior_optimization == "alternate" and self.evidence != "posterior_mode":
            raise ValueError(
                f"{owner}prior_optimization='alternate' refits the MAP at each τ, so its point "
                "is the posterior's mode: use evidence='posterior_mode' with it, or "
                "prior_optimization='evidence' with evidence='likelihood_mode'."
            )
        bounds = self.log_prior_bounds
        if isinstance(bounds, str) or len(bounds) != 2:
            raise ValueError(f"{owner}log_prior_bounds must be (lo, hi); got {bounds!r}.")
        lo = check_real("log_prior_bounds[0]", bounds[0], owner=owner)
        hi = check_real("log_prior_bounds[1]", bounds[1], owner=owner)
        if not lo < hi:
            raise ValueError(
                f"{owner}expected log_prior_bounds (lo, hi) with lo < hi, got {(lo, hi)}."
            )
        object.__setattr__(self, "log_prior_bounds", [float(lo), float(hi)])
        check_real("alternate_tol", self.alternate_tol, gt=0, owner=owner)
        check_int("alternate_max_iter", self.alternate_max_iter, ge=1, owner=owner)
        check_int("alternate_epochs", self.alternate_epochs, ge=1, owner=owner)
        check_real("alternate_map_tol", self.alternate_map_tol, gt=0, owner=owner)
        if self.alternate_lr is not None:
            check_real("alternate_lr", self.alternate_lr, gt=0, owner=owner)
        if self.optimizer is not None and not callable(self.optimizer):
            raise TypeError(
                f"{owner}optimizer must be a torch optimizer class or a callable params -> "
                f"Optimizer; got {type(self.optimizer).__name__}."
            )


def _settings_of(guide: Any) -> Laplace:
    """The settings given to the guide's constructor (deprecated), else the defaults."""
    return Laplace(**getattr(guide, "fit_settings", {}))


class LaplaceFitter(Fitter):
    r"""Fits a :class:`~pyrobayes.guides.LaplaceGuide`: MAP training of its point, then the
    curvature and τ at the end (:func:`fit_laplace` over the training data).

    The objective is the MAP objective at the guide's point; the optimizer is Adam.

    ``optimizer`` may be a :class:`Laplace` (the settings of the τ search and the MAP's torch
    optimizer); else they are those given to the guide (deprecated) or the defaults.
    :meth:`state_dict` holds them; a checkpoint written under others is refused.

    With ``Laplace(prior_optimization="alternate")``, :meth:`end` runs MacKay's (1992)
    evidence iteration instead of one post-hoc τ: starting from ``τ₀ = 1/s_p²`` (the prior the
    MAP was trained under) it repeats

    1. fit ``H`` at the current MAP ``θ*_τ`` and ``τ' = argmax_τ log p(D | τ)`` (the Laplace
       marginal likelihood of :func:`fit_laplace`, ``θ*`` and ``H`` held);
    2. stop if ``|log τ' − log τ| < alternate_tol``; else ``τ ← τ'`` and refit the MAP under
       the prior ``N(0, τ^{-1} I)``, warm-started at the previous MAP: epochs of this fitter's
       optimizer over the data until the MAP is stationary (:meth:`map_residual` below
       ``alternate_map_tol``), at most ``alternate_epochs``. The refits run at
       ``alternate_lr``, by default the learning rate the fitter started with (a schedule's
       ``initial_lr``): a schedule that decayed the rate to 0 would otherwise refit nothing.

    If the iteration stops at ``alternate_max_iter`` refits, or the last MAP is not stationary,
    a warning names the gap (``|log τ' − log τ|`` and the MAP's relative gradient).
    The refit sets the model's ``prior_scale`` to ``τ^{-1/2}`` for its duration (restored
    afterwards), so the fitter's own objective is the MAP objective under τ. The guide keeps the
    last τ its MAP was refitted under (and ``H`` at that MAP), so mean and covariance share one
    prior. At a fixed point ``∂/∂τ`` of the Laplace evidence vanishes with ``θ*`` stationary in
    ``θ``; in a linear-Gaussian model that is a stationary point of the exact evidence.
    :attr:`prior_precisions` lists the τ of every MAP (``τ₀`` first) and the last ``τ'``;
    :attr:`map_residuals` the relative gradient at the end of each refit.
    """

    settings: Laplace  # the fit's settings record (Fitter.settings)
    reads_data_at_end = True  # the curvature pass over the training data

    prior_precisions: list[float]
    map_residuals: list[float]

    def __init__(self, model: Any, guide: Any, *, optimizer: Any = None, **kwargs: Any) -> None:
        #: the fit's settings: ``optimizer`` when it is a :class:`Laplace`, else those given to
        #: the guide's constructor (deprecated), else the defaults
        if isinstance(optimizer, Laplace):
            self.settings, optimizer = optimizer, optimizer.optimizer
        else:
            self.settings = _settings_of(guide)
        spec = getattr(guide, "prior_precision_spec", "marglik")
        if self.settings.prior_optimization == "alternate" and spec != "marglik":
            raise ValueError(
                "Laplace(prior_optimization='alternate') tunes τ by the marginal likelihood; it "
                f"needs the guide's prior_precision='marglik', not {spec!r}."
            )
        if (
            self.settings.prior_optimization == "alternate"
            and getattr(guide, "prior_structure", "scalar") == "layerwise"
        ):
            raise ValueError(_ALTERNATE_LAYERWISE)
        super().__init__(model, guide, optimizer=optimizer, **kwargs)
        self._refuse_variational(
            "the Laplace posterior is built at the MAP of its point, not fitted by an ELBO (its "
            "q does not exist until the curvature is fitted)."
        )
        self.prior_precisions = []
        self.map_residuals = []

    def default_objective(self) -> str:
        return "map"

    def report(self) -> dict[str, float]:
        """After the fit, the guide's prior precision τ (``prior_precision``) and, when it was
        chosen on held-out data or by the evidence iteration, the fit's first τ
        (``prior_precision_start``: the evidence's at the MAP, or the MAP's own); in
        ``FitResult.state``. Nothing while the MAP stage trains."""
        if not self.guide.is_fitted:
            return {}
        out = {"prior_precision": float(self.guide.prior_precision)}
        if len(self.prior_precisions) > 1:
            out["prior_precision_start"] = float(self.prior_precisions[0])
        return out

    def check_begin(self) -> None:
        """Refuse an alternation without the model's prior scale, or a held-out choice of τ
        without held-out data (before training, not after it)."""
        if self._alternating:
            self._model_prior_precision()
        if self.settings.prior_optimization == "validation":
            self._require_validation()

    def begin(self, data: Iterable[Any] | None = None) -> None:
        self.check_begin()  # before the reset: a refused fit leaves a fitted posterior as it was
        self.guide.reset()
        self.ended = None
        self.prior_precisions = []
        self.map_residuals = []

    @property
    def _alternating(self) -> bool:
        guide = self.guide
        alternate = self.settings.prior_optimization == "alternate"
        return guide.prior_precision_spec == "marglik" and alternate

    def _model_prior_precision(self) -> float:
        scale = getattr(self.model, "prior_scale", None)
        if not isinstance(scale, (int, float)) or scale <= 0:
            raise TypeError(
                "Laplace(prior_optimization='alternate') refits the MAP under a new prior "
                "precision through model.prior_scale; this model has none (use a FineTuneModel)."
            )
        return 1.0 / float(scale) ** 2

    def end(self, data: Iterable[Any] | None = None) -> None:
        if data is None:
            raise ValueError("LaplaceFitter.end(data) needs the training data for the curvature.")
        self.prior_precisions = []
        if self._alternating:
            self._alternate(data)
        else:
            fit_laplace(self.model, self.guide, data, settings=self.settings)
        if self.settings.prior_optimization == "validation":
            self._select_on_validation()
        self.ended = (
            "the Laplace posterior's curvature was computed at the current parameters, and a "
            "step would move its mean away from them (the covariance would belong to another "
            "point). Start a new fit with fitter.begin(data), or predict with this posterior."
        )

    def _require_validation(self) -> Iterable[Any]:
        """The fit's held-out data, or an error that says how to pass it."""
        if self.validation_data is None:
            raise ValueError(
                "Laplace(prior_optimization='validation') chooses τ on held-out data; pass it "
                "to the fit: pyrobayes.fit(model, guide, data, ..., "
                "validation=pyrobayes.Validation(val_loader))."
            )
        return self.validation_data

    def _select_on_validation(self) -> None:
        """τ of least held-out NLL around the fitted one (``prior_optimization="validation"``)."""
        from .prior_precision import select_prior_precision

        held_out = self._require_validation()
        fitted = self.guide.prior_precision
        chosen = select_prior_precision(self.model, self.guide, held_out)
        self.prior_precisions = [fitted, chosen]

    def _alternate(self, data: Iterable[Any]) -> None:
        """MacKay's evidence iteration: MAP at τ, H at the MAP, τ by the evidence, until stable."""
        guide, settings = self.guide, self.settings
        tau_map = self._model_prior_precision()  # the prior the trained MAP belongs to
        fit_laplace(self.model, guide, data, settings=settings)
        tau = guide.prior_precision
        self.prior_precisions = [tau_map, tau]
        self.map_residuals = []
        refits = 0
        while abs(math.log(tau) - math.log(tau_map)) >= settings.alternate_tol:
            if refits == settings.alternate_max_iter:
                break
            tau_map = tau
            self.map_residuals.append(self._refit_map(data, tau_map))
            fit_laplace(self.model, guide, data, settings=settings)
            tau = guide.prior_precision
            self.prior_precisions.append(tau)
            refits += 1
        guide.set_prior_precision(tau_map)  # H and the mean were fitted under this τ
        gap = abs(math.log(tau) - math.log(tau_map))
        residual = self.map_residuals[-1] if self.map_residuals else 0.0
        if gap >= settings.alternate_tol or residual >= settings.alternate_map_tol:
            logger.warning(
                "Laplace (alternate): not at the fixed point after %d MAP refits: the evidence "
                "optimum at the last MAP is τ = %.4g, the guide keeps τ = %.4g (|Δ log τ| = "
                "%.2g, alternate_tol %.2g), and the last MAP's relative gradient is %.2g "
                "(alternate_map_tol %.2g). Raise alternate_max_iter or alternate_epochs, or set "
                "alternate_lr.",
                refits,
                tau,
                tau_map,
                gap,
                settings.alternate_tol,
                residual,
                settings.alternate_map_tol,
            )
        logger.info("Laplace (alternate): τ = %.4g after %d MAP refits", tau_map, refits)

    def _refit_lrs(self) -> list[float]:
        """The refits' learning rate per parameter group: ``alternate_lr``, else the rate the
        fitter started with (a schedule's ``initial_lr``, not its decayed current value)."""
        fixed = self.settings.alternate_lr
        lrs = [
            float(fixed if fixed is not None else group.get("initial_lr", group["lr"]))
            for group in self.optimizer.param_groups
        ]
        if not any(lr > 0 for lr in lrs):
            raise ValueError(
                "Laplace(prior_optimization='alternate'): the MAP refits would run at "
                "learning rate 0 (the fitter's lr is 0); pass alternate_lr > 0."
            )
        return lrs

    def _refit_map(self, data: Iterable[Any], tau: float) -> float:
        """The MAP under the prior ``N(0, τ^{-1} I)``: epochs of this fitter's optimizer at the
        refit learning rate until the relative gradient of the whole-data MAP objective
        (:meth:`map_residual`) is below ``alternate_map_tol``, at most ``alternate_epochs``.
        The rate is halved after an epoch that did not lower the residual (minibatch noise
        then dominates the remaining gradient). Returns the last residual."""
        model, optim, settings = self.model, self.optimizer, self.settings
        saved, was_training = model.prior_scale, model.training
        saved_lrs = [group["lr"] for group in optim.param_groups]
        model.prior_scale = tau**-0.5
        model.train(True)
        residual = math.inf
        try:
            lrs = self._refit_lrs()
            for group, lr in zip(optim.param_groups, lrs, strict=True):
                group["lr"] = lr
            for _ in range(settings.alternate_epochs):
                for batch in data:
                    self.step(to_device(batch, model.device))
                last, residual = residual, self.map_residual(data)
                if residual < settings.alternate_map_tol:
                    break
                if residual >= last:  # minibatch noise dominates: halve the rate
                    for group in optim.param_groups:
                        group["lr"] *= 0.5
        finally:
            for group, lr in zip(optim.param_groups, saved_lrs, strict=True):
                group["lr"] = lr
            model.prior_scale = saved
            model.train(was_training)
        return residual

    def map_residual(self, data: Iterable[Any]) -> float:
        r"""Relative stationarity of the MAP: ``‖∇_θ U‖ / ‖τ θ‖`` over the sites, with ``U`` the
        whole-data MAP objective ``−Σ_i log p(y_i|θ) − log p(θ)`` (the batches' objectives
        weighted by ``B/N``) and ``τ θ`` its prior term's gradient (0 at the MAP, where the data
        term's gradient equals ``−τ θ``). The point parameters' gradients count in the numerator.

        Under ``torch.distributed`` the ranks' weighted gradients are summed (one all-reduce), so
        ``∇U`` is that of the union of the shards and every rank gets the same residual: the
        refits' stopping test and rate halving (:meth:`_refit_map`) take the same decision on
        every rank, which keeps their steps' all-reduces in step. A rank whose pass fails shares
        NaN there, and every rank stops with its error.
        """
        model = self.model
        device = self.params[0].device if self.params else model.device
        size = sum(p.numel() for p in self.params)
        grad = run_shared(
            lambda: self._local_objective_grad(data),
            lambda: torch.full((size,), math.nan, dtype=torch.float64, device=device),
        )
        if world()[0] > 1:
            all_reduce_sum_([grad])
            if not bool(grad.isfinite().all()):  # the same sum on every rank: all stop together
                raise_kept("Laplace (alternate)'s check of the refitted MAP", remedy=PASS_REMEDY)
        tau = float(model.prior_scale) ** -2
        prior = math.sqrt(
            sum(float((tau * self.guide.loc(s).detach()).square().sum()) for s in self.guide.sites)
        )
        total = float(grad.square().sum().sqrt())
        return total / max(prior, torch.finfo(torch.float64).tiny)

    def _local_objective_grad(self, data: Iterable[Any]) -> Tensor:
        """This rank's ``Σ_batches (B/N) ∇ loss`` over ``data`` (:meth:`map_residual`), flat in
        float64 on the first parameter's device."""
        model = self.model
        num_data = float(model.num_data)
        grads = [torch.zeros_like(p) for p in self.params]
        for batch in data:
            batch = to_device(batch, model.device)
            weight = batch_size(split_batch(batch, model.label_key)[0]) / num_data
            loss = self.objective.loss(model, self.guide, batch)
            parts = torch.autograd.grad(loss, self.params, allow_unused=True)
            for g, part in zip(grads, parts, strict=True):
                if part is not None:
                    g.add_(part, alpha=weight)
        device = grads[0].device if grads else model.device
        flat = [g.reshape(-1).to(device, torch.float64) for g in grads]
        return torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64, device=device)


def tune_prior_precision(
    log_marglik: Any,
    bounds: tuple[float, float] = (-5.0, 10.0),
    grid: int = 61,
    iters: int = 40,
    *,
    warn: bool = True,
) -> float:
    """``argmax_τ log_marglik(τ)`` over ``log τ ∈ bounds``: a grid then golden-section search
    (``warn``: log a warning when the maximum is at a bound)."""
    lo, hi = bounds

    def value(log_tau: float) -> float:  # NaN or ±inf: never the maximum
        v = float(log_marglik(math.exp(log_tau)))
        return v if math.isfinite(v) else -math.inf

    xs = torch.linspace(lo, hi, grid, dtype=torch.float64)
    finite = [value(float(x)) for x in xs]
    if not any(math.isfinite(v) for v in finite):  # every τ: the search would pick one silently
        raise FloatingPointError(
            f"Laplace: the log marginal likelihood is NaN or inf at every τ of the search over "
            f"log τ in [{lo:g}, {hi:g}], so no prior precision can be chosen by it (the "
            "curvature or the MAP holds NaN or inf, or a regression's noise σ is 0 or NaN). "
            "Check the fit, or give a fixed prior precision (prior_precision=<float>)."
        )
    best = max(range(grid), key=lambda i: finite[i])
    a = float(xs[max(best - 1, 0)])
    b = float(xs[min(best + 1, grid - 1)])
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = value(c), value(d)
    for _ in range(iters):
        if fc >= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = value(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = value(d)
    x_best, f_best = (c, fc) if fc >= fd else (d, fd)
    if finite[best] > f_best:
        x_best = float(xs[best])
    if warn and (x_best <= lo + 1e-6 or x_best >= hi - 1e-6):
        logger.warning("Laplace prior precision hit the search bound: log τ = %.3g", x_best)
    return math.exp(x_best)


def fit_laplace(
    model: Any,
    guide: Any,
    data: Iterable[Any],
    *,
    backend: Any = None,
    settings: Laplace | None = None,
) -> Any:
    """Fit ``guide`` (a :class:`~pyrobayes.guides.LaplaceGuide`) at its MAP over ``data``.

    Copies the guide's point into the network, makes only the sites' tensors require grad, runs
    laplace-torch (``hessian_structure=guide.structure``), stores the curvature in the guide, picks
    τ, and restores the network. Returns the laplace-torch object (at the chosen τ).

    ``backend`` is laplace-torch's curvature backend; the default,
    :func:`per_example_ggn_backend`, is laplace-torch's own (curvlinops GGN) with the diagonal
    from per-example Jacobians (the same diagonal GGN, without a Jacobian of the whole batch).
    ``settings`` (:class:`Laplace`): the τ search's bounds (default: those given to the guide,
    deprecated, else :class:`Laplace`'s). Under ``torch.distributed`` an error on one rank
    before laplace-torch reads a batch (its ``_init_H`` out of memory) stops every rank in the
    pass's first all-reduce (:meth:`~pyrobayes.infer.curvature._Loader.stop_unread`).
    """
    _import_laplace()
    if backend is not None and world()[0] > 1:
        raise ValueError(
            f"fit_laplace(backend={getattr(backend, '__name__', backend)!r}): under "
            "torch.distributed the curvature of each rank's shard must be summed over the "
            "ranks, which only the default backend (per_example_ggn_backend) does: with "
            "another, each rank would fit the posterior of its own shard. Leave backend unset, "
            "or fit in one process."
        )
    guide.require_setup()
    drop_temperature(guide, owner="fit_laplace: ")  # fitted for the posterior this replaces
    net = model.net
    specs = model.latent_sites
    flags = {name: p.requires_grad for name, p in net.named_parameters()}
    saved: dict[str, Tensor] = {}
    was_training = model.training
    model.train(False)
    try:
        for p in net.parameters():
            p.requires_grad_(False)
        # first: under torch.distributed the curvature data's one gather (every rank checks its
        # batches), so that what fails on one rank after it, before laplace-torch reads a batch
        # (its _init_H out of memory), stops every rank in the pass's first all-reduce
        loader = _Loader(model, data, model.device)
        try:
            saved.update(
                {s: net.get_parameter(specs[s].param_name).detach().clone() for s in guide.sites}
            )
            la, order = _fitted_curvature(model, guide, loader, backend)
        except Exception as error:
            loader.stop_unread(error, _curvature_params(model, guide), guide.structure)
            raise
        if guide.structure == "diag":
            _store_diag(guide, la, order)
        else:
            _store_kron(guide, la, order)
        chosen = settings or _settings_of(guide)
        bounds, evidence = chosen.log_prior_bounds, str(chosen.evidence)
        if getattr(guide, "prior_structure", "scalar") == "layerwise":
            taus = _choose_site_prior_precisions(model, guide, bounds, evidence=evidence)
            guide.set_site_prior_precisions(taus)
            la.prior_precision = torch.tensor(
                [taus[s] for s in order], dtype=la._dtype, device=la._device
            )
            tau = guide.prior_precision
        else:
            tau = _choose_prior_precision(model, guide, la, bounds, evidence=evidence)
            la.prior_precision = torch.tensor(tau, dtype=la._dtype, device=la._device)
            guide.set_prior_precision(tau)
        guide.mark_fitted(True)
        logger.info("Laplace (%s): τ = %.4g over %d sites", guide.structure, tau, len(order))
        return la
    finally:
        with torch.no_grad():
            for s, v in saved.items():
                net.get_parameter(specs[s].param_name).copy_(v)
        for name, p in net.named_parameters():
            p.requires_grad_(flags[name])
        model.train(was_training)


def _fitted_curvature(
    model: Any, guide: Any, loader: _Loader, backend: Any
) -> tuple[Any, list[str]]:
    """laplace-torch's Laplace of ``guide``'s structure fitted over ``loader`` at the guide's
    point (:func:`_load_point`), and the site of each of its parameters, in order
    (:func:`fit_laplace`'s, which restores the network)."""
    from laplace import Laplace as LaplaceTorch

    site_of = _load_point(model, guide)
    wrapper = LaplaceNet(model)
    order = [site_of[id(p)] for p in wrapper.parameters() if p.requires_grad]
    kind, sigma = _laplace_likelihood(model)
    la = LaplaceTorch(
        wrapper,
        kind,
        subset_of_weights="all",
        hessian_structure=guide.structure,
        sigma_noise=sigma,
        prior_precision=1.0,
        temperature=guide.temperature,
        dict_key_x=_ROWS,
        dict_key_y=model.label_key,
        backend=per_example_ggn_backend() if backend is None else backend,
    )
    loader.laplace = la  # (its observation counts: every rank's at the end of a shared pass)
    # laplace-torch annotates a DataLoader; it iterates the loader and reads len(.dataset)
    with _no_exit("fitting the curvature"):
        la.fit(loader)  # type: ignore[arg-type]
    return la, order


def _curvature_params(model: Any, guide: Any) -> list[Tensor]:
    """The tensors laplace-torch takes the curvature of (its ``params``, whatever the network's
    ``requires_grad`` flags are now): the latent sites' (those :func:`_load_point` makes
    require grad), in the network's parameter order."""
    net, specs = model.net, model.latent_sites
    ids = {id(net.get_parameter(specs[s].param_name)) for s in guide.sites if guide.is_latent(s)}
    return [p for p in net.parameters() if id(p) in ids]


def _load_point(model: Any, guide: Any) -> dict[int, str]:
    """Copy the guide's point into the network; the latent sites' tensors require grad.

    Returns the site name of each tensor that requires grad, by ``id``.
    """
    net, specs = model.net, model.latent_sites
    site_of: dict[int, str] = {}
    with torch.no_grad():
        for s in guide.sites:
            p = net.get_parameter(specs[s].param_name)
            if p.dim() != len(guide.sites[s]):
                raise RuntimeError(f"Site {s!r} is not stored as a plain parameter.")
            value = guide.loc(s).detach()
            if not bool(torch.isfinite(value).all()):
                raise ValueError(
                    f"Laplace: the point of site {s!r} holds non-finite values (NaN or inf); "
                    "the curvature needs a finite MAP. Refit the MAP (a smaller lr) or check "
                    "the init= guide."
                )
            p.copy_(value)
            if guide.is_latent(s):  # sites outside subset= stay at their MAP, no curvature
                p.requires_grad_(True)
                site_of[id(p)] = s
    return site_of


def _store_diag(guide: Any, la: Any, order: list[str]) -> None:
    """The diagonal GGN of laplace-torch's ``DiagLaplace``, split into the sites (in ``order``)."""
    from laplace import DiagLaplace

    if not isinstance(la, DiagLaplace):  # subset "all" + structure "diag"
        raise RuntimeError(_unexpected("DiagLaplace", la))
    h = la.H.detach() * float(la._H_factor)
    _check_finite_curvature(h, order)
    start = 0
    for s in order:
        n = int(torch.Size(guide.sites[s]).numel())
        guide.set_curvature(s, h[start : start + n].reshape(guide.sites[s]))
        start += n


def _store_kron(guide: Any, la: Any, order: list[str]) -> None:
    """The eigendecomposed Kronecker factors of laplace-torch's ``KronLaplace``, per site.

    A weight gets ``G ⊗ A`` (two factors), a bias laplace-torch's one dense factor ``G``.
    """
    from laplace import KronLaplace
    from laplace.utils import KronDecomposed

    if not isinstance(la, KronLaplace):  # subset "all" + structure "kron"
        raise RuntimeError(_unexpected("KronLaplace", la))
    decomposed = la.H
    if not isinstance(decomposed, KronDecomposed):  # what KronLaplace.fit leaves
        raise RuntimeError(_unexpected("KronDecomposed", decomposed))
    factor = float(la._H_factor)
    for s, site_vecs, site_vals in zip(
        order, decomposed.eigenvectors, decomposed.eigenvalues, strict=True
    ):
        shape = guide.sites[s]
        vecs: list[Tensor] = list(site_vecs)
        vals: list[Tensor] = list(site_vals)
        if len(vals) == 1 and tuple(shape) == (1, 1):  # laplace-torch keeps a 1×1 weight's G·A
            vecs.append(vecs[0].new_ones(1, 1))  # whole: A = 1 makes it the two-factor case
            vals.append(vals[0].new_ones(1))
        if len(vals) != len(shape):
            raise RuntimeError(
                f"Laplace: expected {len(shape)} Kronecker factor(s) for site {s!r} of "
                f"shape {tuple(shape)}, laplace-torch gave {len(vals)}; please report this."
            )
        if len(vals) == 1:  # a bias: laplace-torch's one dense factor G (m×m)
            (q_out,), (l_out,) = vecs, vals
            q_in = q_out.new_ones(1, 1)
            curv = factor * l_out.clamp_min(0.0)
        else:
            q_out, q_in = vecs
            l_out, l_in = (v.clamp_min(0.0) for v in vals)
            curv = factor * l_out[:, None] * l_in[None, :]
        # the factors, and their product scaled by 1/(σ² T) (which may overflow), in one check
        _check_finite_curvature(torch.cat([v.reshape(-1) for v in (*vals, *vecs, curv)]), [s])
        guide.set_curvature(s, curv.detach(), q_out.detach(), q_in.detach())


def _choose_prior_precision(
    model: Any,
    guide: Any,
    la: Any,
    bounds: Sequence[float] = (-5.0, 10.0),
    *,
    evidence: str = EVIDENCE[0],
) -> float:
    """τ by the guide's ``prior_precision`` option: the evidence maximum (``evidence``: see
    :class:`Laplace`), the model's, or given."""
    spec = guide.prior_precision_spec
    if spec == "model":
        return 1.0 / model.prior_scale**2
    if spec != "marglik":
        return float(spec)
    lo, hi = float(bounds[0]), float(bounds[1])
    if evidence == "likelihood_mode":
        curvature, coords = eigen_coordinates(guide)
        tau = tune_prior_precision(
            lambda t: likelihood_mode_log_evidence(curvature, coords, t), (lo, hi)
        )
        logger.info(
            "Laplace: evidence at the likelihood's mode: τ = %.4g, %.1f of %d directions "
            "determined by the data",
            tau,
            effective_parameters(curvature, tau),
            curvature.numel(),
        )
        if math.log(tau) >= hi - 1e-6:
            logger.warning(
                "Laplace: the data do not determine the point beyond its posterior sd (λ θ² "
                "below 1 across the curvature's directions), so the evidence at the likelihood's "
                "mode prefers no spread: τ is at its bound and the predictive is the MAP's. "
                "Train longer, or "
                "use pb.infer.Laplace(evidence='posterior_mode') (laplace-torch's evidence) or "
                "select τ on held-out data (prior_optimization='validation')."
            )
        return tau

    def log_marglik(tau: float) -> float:
        with torch.no_grad():
            value = la.log_marginal_likelihood(
                prior_precision=torch.tensor(tau, dtype=la._dtype, device=la._device)
            )
        return float(value)

    with _no_exit("maximising the marginal likelihood"):
        return tune_prior_precision(log_marglik, (lo, hi))


def _choose_site_prior_precisions(
    model: Any,
    guide: Any,
    bounds: Sequence[float] = (-5.0, 10.0),
    *,
    evidence: str = EVIDENCE[0],
) -> dict[str, float]:
    r"""``τ_l`` per latent site (``prior_structure="layerwise"``): with ``H`` block-diagonal over
    sites both evidences are sums of per-site terms (:mod:`pyrobayes.infer.evidence`; for
    ``"posterior_mode"``, laplace-torch's ``−½[τ_l‖θ_l‖² + log det(I + H_l/τ_l)]``), so
    each ``τ_l`` maximises its own term. ``"model"`` or a fixed τ: the same value for every site."""
    sites = guide.latent_subset
    if guide.prior_precision_spec != "marglik":  # the model's τ or a given one: no search
        return dict.fromkeys(sites, _choose_prior_precision(model, guide, None, bounds))
    term = (
        likelihood_mode_log_evidence
        if evidence == "likelihood_mode"
        else posterior_mode_log_evidence
    )
    lo, hi = float(bounds[0]), float(bounds[1])
    taus: dict[str, float] = {}
    upper: list[str] = []
    lower: list[str] = []
    for site in sites:
        curvature, coords = eigen_coordinates(guide, sites=[site])
        taus[site] = tune_prior_precision(
            lambda t, c=curvature, x=coords: term(c, x, t), (lo, hi), warn=False
        )
        if math.log(taus[site]) >= hi - 1e-6:
            upper.append(site)
        elif math.log(taus[site]) <= lo + 1e-6:
            lower.append(site)
    logger.info(
        "Laplace: per-site τ by the evidence (%s): %s",
        evidence,
        ", ".join(f"{s} {t:.4g}" for s, t in taus.items()),
    )
    if upper:  # the evidence's own answer: the data do not determine the site (no spread)
        (logger.warning if len(upper) == len(sites) else logger.info)(
            "Laplace (layerwise): %d of %d sites at the upper bound of τ (log τ = %g): the data "
            "do not determine them beyond their posterior sd, so they keep (almost) no "
            "spread%s: %s",
            len(upper),
            len(sites),
            hi,
            " and the predictive is the MAP's" if len(upper) == len(sites) else "",
            ", ".join(upper[:6]),
        )
    if lower:
        logger.warning(
            "Laplace (layerwise): τ of %d of %d sites is at the lower search bound log τ = %g "
            "(%s): nothing in the evidence limits their spread. Widen "
            "pb.infer.Laplace(log_prior_bounds=...) or use prior_structure='scalar'.",
            len(lower),
            len(sites),
            lo,
            ", ".join(lower[:6]),
        )
    return taus


@contextlib.contextmanager
def _no_exit(what: str) -> Iterator[None]:
    """Turn a ``SystemExit`` from inside laplace-torch into an exception the caller sees.

    laplace-torch's ``symeig`` calls ``exit()`` when an eigendecomposition fails (a non-finite
    Kronecker factor), which would end the user's process with status 0 and no message.
    """
    try:
        yield
    except SystemExit as err:
        raise FloatingPointError(
            f"Laplace: laplace-torch stopped while {what} (it called exit({err.code!r}) after a "
            "failed eigendecomposition: the curvature holds NaN or inf). Check the training "
            "data for non-finite inputs and the MAP for non-finite values (a diverged fit)."
        ) from err


def _check_finite_curvature(values: Tensor, sites: list[str]) -> None:
    if not bool(torch.isfinite(values).all()):
        raise FloatingPointError(
            f"Laplace: the curvature of site(s) {sites[:5]} holds NaN or inf. Check the training "
            "data for non-finite inputs and the MAP for non-finite values (a diverged fit); for "
            "a regression, a noise σ near 0 (the curvature is scaled by 1/σ²)."
        )


def _unexpected(expected: str, got: Any) -> str:
    return (
        f"Laplace: laplace-torch returned a {type(got).__name__} where pyrobayes expects a "
        f"{expected}; this laplace-torch version is not supported (please report it)."
    )
