r"""Post-hoc Laplace over the latent sites (cores) through laplace-torch, and the GLM predictive.

Curvature. At the MAP ``θ*`` (the guide's point), with the head fixed, laplace-torch computes the
GGN of the summed negative log-likelihood over the sites only,

.. math:: H = \sum_i J_i^\top Λ_i J_i,\qquad J_i = ∂f(x_i; θ)/∂θ\,|_{θ^*},

as its diagonal (``DIAG``) or K-FAC blocks (``KRON``; a LoRA-XS core is an ordinary
``nn.Linear(r, r)``, so both factors are ``r×r``). The diagonal is accumulated from per-example
Jacobian rows (:func:`pyrobayes.linearized.output_jacobian_rows`: one forward and ``K − 1``
backward passes per batch for ``K`` classes, ``K`` for ``K`` regression outputs, a few rows at a
time, so memory stays a few ``B·d`` numbers, never the ``B·K·d`` Jacobian), with softmax's
``Λ_i = diag(p_i) − p_i p_iᵀ``

.. math:: \operatorname{diag} H = \sum_i \sum_k p_{ik} \big(J_{ik} - \textstyle\sum_j p_{ij} J_{ij}\big)^{2},

(``J_{ik}`` the k-th row of ``J_i``, squared elementwise) and ``Σ_i Σ_k J_{ik}²`` for a Gaussian
likelihood (laplace-torch's ``1/σ²`` applied as its ``_H_factor``). laplace-torch's default
backend forms the same diagonal from the Jacobian of the whole batch output with respect to the
parameters, ``B·K`` backward passes of the whole batch each (quadratic in the batch size).

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

GLM predictive. ``f(x) ~ N(f(x; θ*), J(x) Σ J(x)ᵀ)``; class probabilities by the probit
approximation ``softmax(f / sqrt(1 + π/8 · diag(JΣJᵀ)))`` or Monte Carlo over the logits.
:func:`pyrobayes.predict` evaluates it by default (:mod:`pyrobayes.linearized`: Jacobians of the
K read outputs only, chunked); :func:`glm_predict` here forms dense Jacobians of the whole
batch output and is kept for comparison.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..batch import batch_size, compute_dtype, split_batch, to_device, token_mask
from ..calibration import drop_temperature
from ..guides.laplace import _ALTERNATE_LAYERWISE
from ..linearized import output_jacobian_rows, output_jacobians
from ..models.adapters import check_int, check_real
from ..models.likelihoods import check_gaussian_targets
from ..predictive import Prediction
from .distributed import all_reduce_sum_
from .evidence import (
    effective_parameters,
    eigen_coordinates,
    likelihood_mode_log_evidence,
    posterior_mode_log_evidence,
)
from .fitter import Fitter

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

    def begin(self, data: Iterable[Any] | None = None) -> None:
        self.guide.reset()
        self.prior_precisions = []
        self.map_residuals = []
        if self._alternating:
            self._model_prior_precision()  # fail before training, not after
        if self.settings.prior_optimization == "validation":
            self._require_validation()  # fail before training, not after

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
        """
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
        tau = float(model.prior_scale) ** -2
        prior = math.sqrt(
            sum(float((tau * self.guide.loc(s).detach()).square().sum()) for s in self.guide.sites)
        )
        total = math.sqrt(sum(float(g.square().sum()) for g in grads))
        return total / max(prior, torch.finfo(torch.float64).tiny)


class LaplaceNet(nn.Module):
    """The network as laplace-torch sees it: a batch (dict or tensor) → likelihood parameters.

    The sites' current values live in the network's own parameters (``fit_laplace`` copies the
    MAP in); a Gaussian likelihood returns ``(B, 1)`` so laplace-torch's regression code applies.
    """

    def __init__(self, model: Any) -> None:
        super().__init__()
        dtype = compute_dtype(model.dtype)
        if dtype != model.dtype:
            # laplace-torch keeps its curvature sum, τ and evidence in the dtype of the model's
            # first parameter: a frozen, empty float32 one first makes that float32 (a bfloat16
            # sum of 30,000 examples' diagonal GGN came out half the float32 one)
            self.dtype_anchor = nn.Parameter(torch.zeros(0, dtype=dtype), requires_grad=False)
        self.net = model.net
        self._model = [model]  # not a submodule: its point params must not be seen twice

    @property
    def pyro_model(self) -> Any:
        """The :class:`~pyrobayes.models.FineTuneModel` whose network this is."""
        return self._model[0]

    def forward(self, x: Any) -> Tensor:
        model = self._model[0]
        inputs = _network_inputs(x, model.label_key)
        prediction = model.network_prediction(model._call_net(self.net, inputs))
        if (
            not torch.is_grad_enabled()
            and prediction.dim() == 1
            and prediction.shape[0] != 1
            and batch_size(inputs) == 1
        ):
            # laplace-torch's probe of the output width (its fit runs X[:1] under no_grad): a
            # forward that squeezes a batch of one is refused where rows are read (the
            # curvature's passes, the predictive), not on a probe the user's data never made
            prediction = prediction.unsqueeze(0)
        out = model.likelihood.params(prediction, inputs)
        if not model.likelihood.is_classification and out.dim() == 1:
            out = out.unsqueeze(-1)
        return out


#: keys of the dict batches :class:`_Loader` hands laplace-torch for inputs that are not one
#: tensor: the network's inputs as the user's batch holds them, and a ``(B, 0)`` tensor whose
#: leading size laplace-torch reads as the batch size (its ``dict_key_x``)
_INPUTS, _ROWS = "__pyrobayes_inputs__", "__pyrobayes_rows__"


def _network_inputs(x: Any, label_key: str) -> Any:
    """The network's inputs in a batch laplace-torch passes back (see :class:`_Loader`)."""
    if isinstance(x, Mapping):
        return x[_INPUTS] if _INPUTS in x else split_batch(x, label_key)[0]
    return x


class _Loader:
    """Re-iterable ``(X, y)`` / dict batches with ``.dataset`` of length N, as laplace-torch wants.

    A batch whose inputs are one tensor goes as ``(X, y)``; any other inputs (a dict of tensors
    such as ``pixel_values`` or ``input_ids``, a tuple of tensors) go as the dict
    ``{_INPUTS: inputs, _ROWS: (B, 0) tensor, label_key: y}``, laplace-torch's dict form with
    ``dict_key_x=_ROWS`` (it reads only the batch size from there; :class:`LaplaceNet` runs
    the network on ``_INPUTS``). Class labels become ``(B,)`` int64 (``(B, 1)`` and any integer
    dtype are accepted, as every other family accepts them).

    Regression targets are checked against the network output (``check_gaussian_targets``: a
    scalar output takes ``(B,)`` or ``(B, 1)``, a ``(B, D)`` output ``(B, D)``, anything else
    raises) and passed as laplace-torch wants them, ``(B, 1)`` or ``(B, D)``.
    """

    def __init__(self, model: Any, data: Iterable[Any], device: torch.device) -> None:
        self.model, self.data, self.device = model, data, device
        self._event_shape: tuple[int, ...] | None = None  # of one example's output, once probed
        dataset: Any = getattr(data, "dataset", None)
        try:
            n = len(dataset)  # None or an unsized dataset: TypeError
        except TypeError:  # counted: this rank's share, summed over ranks (a sampler's
            # dataset is the whole set already)
            count = torch.tensor(sum(batch_size(split_batch(b, model.label_key)[0]) for b in data))
            all_reduce_sum_([count])
            n = int(count)
        self.dataset = range(n)

    def __iter__(self) -> Iterator[Any]:
        regression = not self.model.likelihood.is_classification
        key = self.model.label_key
        for index, batch in enumerate(self.data):
            batch = to_device(batch, self.device)
            inputs, y = split_batch(batch, key)
            _check_finite_batch(inputs, y, index)
            if regression and y is not None:
                y = self._regression_targets(inputs, y)
            elif y is not None:
                y = _class_targets(y, index)
            if isinstance(inputs, Tensor):
                yield inputs, y
            else:
                rows = torch.empty(batch_size(inputs), 0, device=self.device)
                yield {_INPUTS: inputs, _ROWS: rows, key: y}

    def _regression_targets(self, inputs: Any, y: Tensor) -> Tensor:
        """``y`` checked against the output of ``inputs``: ``(B, 1)`` (scalar) or ``(B, *event)``."""
        model = self.model
        if self._event_shape is None:  # one probe forward for the output's per-example shape
            with torch.no_grad():
                out = model.likelihood.params(
                    model.network_prediction(model._call_net(model.net, inputs)), inputs
                )
            self._event_shape = tuple(int(n) for n in out.shape[1:])
        y = check_gaussian_targets(y, (batch_size(inputs), *self._event_shape))
        return y if self._event_shape else y.unsqueeze(-1)


def _class_targets(y: Tensor, index: int) -> Tensor:
    """Class labels as laplace-torch's cross-entropy wants them: ``(B,)`` int64."""
    if y.is_floating_point() or y.is_complex():
        raise ValueError(
            f"Laplace: batch {index} has class labels of dtype {y.dtype}; the categorical "
            "likelihood takes integer class indices of shape (B,) or (B, 1). Pass y.long() "
            "if they are whole numbers (multi-label 0/1 targets are not supported)."
        )
    if y.dim() == 2 and y.shape[-1] == 1:
        y = y.squeeze(-1)
    return y.long()


def _check_finite_batch(inputs: Any, y: Any, index: int) -> None:
    """Refuse a batch whose floating-point inputs or targets hold NaN or inf (they would reach the
    curvature, where laplace-torch's eigendecomposition fails)."""
    named = dict(inputs) if isinstance(inputs, Mapping) else {"inputs": inputs}
    named["targets"] = y
    for name, value in named.items():
        if isinstance(value, Tensor) and value.is_floating_point():
            bad = ~torch.isfinite(value)
            if bool(bad.any()):
                rows: list[int] = (
                    bad.reshape(bad.shape[0], -1).any(-1).nonzero().flatten().tolist()
                    if value.dim()
                    else []
                )
                raise ValueError(
                    f"Laplace: batch {index} of the curvature data has non-finite {name} (NaN or "
                    f"inf) in rows {rows[:5]}; drop or impute those examples."
                )


@functools.cache
def _import_laplace() -> None:
    """Import laplace-torch once, without the FutureWarning its dependency asdl raises on import
    (it decorates helpers with the deprecated ``torch.jit.script``): nothing the user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="`torch.jit.script` is deprecated", category=FutureWarning
        )
        import laplace  # noqa: F401
        import laplace.curvature  # noqa: F401


@functools.cache
def per_example_ggn_backend() -> type:
    """laplace-torch's default backend (curvlinops GGN) with an exact, per-example diagonal.

    ``kron`` and ``full`` are curvlinops'. ``diag`` returns the same ``(loss, diag GGN)`` as
    laplace-torch's ``GGNInterface.diag`` but from per-example Jacobians of the sites
    (:func:`pyrobayes.linearized.output_jacobian_rows` on the sample-batched forward): one
    forward and ``K − 1`` (classification) or ``K`` (regression) backward passes per batch
    instead of ``B·K`` backward passes of the whole batch, the rows reduced four at a time as
    they are formed (memory ``O(B·d)``, not the ``B·K·d`` Jacobian; a multiple-choice likelihood
    with ``rows_per_output``, whose copies are ``B·K·d`` anyway, uses
    :func:`pyrobayes.linearized.output_jacobians`). It applies to a :class:`LaplaceNet` whose
    gradient-requiring parameters are latent sites and to a deterministic GGN; anything else
    (``stochastic=True``, last-layer or subnetwork Laplace, another network) goes to
    laplace-torch's own ``diag``.

    Returns
    -------
    type
        A subclass of ``laplace.curvature.CurvlinopsGGN`` (built on first use: laplace-torch is
        imported only when a Laplace posterior is fitted).
    """
    _import_laplace()
    from laplace.curvature import CurvlinopsGGN

    class PerExampleGGN(CurvlinopsGGN):
        def kron(self, x: Any, y: Tensor, N: int, **kwargs: Any) -> tuple[Tensor, Any]:
            # token batches: the K-FAC input factors over the real tokens only (padding and a
            # ragged batch's padded choice rows are not data; laplace-torch's KFAC counts them)
            with _real_token_kfac(self.model, x, sys.modules[CurvlinopsGGN.__module__]):
                loss, kron = super().kron(x, y, N, **kwargs)
            # half-precision sites (a bf16 network): the factors go on in float32, since their
            # eigendecomposition (torch.linalg.eigh) has no half-precision kernel
            factors = [f for fs in kron.kfacs for f in fs]
            if any(f.dtype == torch.float16 and not bool(f.isfinite().all()) for f in factors):
                raise FloatingPointError(
                    "Laplace: the Kronecker (K-FAC) factors of this float16 network overflowed "
                    "(a sum of squared activations past float16's largest value, 65504), which "
                    "laplace-torch's eigendecomposition would turn into a zero curvature. Fit "
                    "the posterior on a bfloat16 or float32 copy of the network "
                    "(model.to(torch.bfloat16) before pb.fit), or use structure='diag'."
                )
            if any(compute_dtype(f.dtype) != f.dtype for f in factors):
                upcast: Any = [[f.float() for f in factors] for factors in kron.kfacs]
                kron = type(kron)(upcast)
                loss = loss.float()
            # under torch.distributed each rank holds its share of the batch: the factors are
            # summed over ranks as laplace-torch sums them over batches (H += H_batch), so every
            # rank holds the curvature of one process whose batches are the ranks' shares
            all_reduce_sum_([loss, *(f for factors in kron.kfacs for f in factors)])
            return loss, kron

        def diag(self, x: Any, y: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
            loss, diag = self._local_diag(x, y, **kwargs)
            all_reduce_sum_([loss, diag])  # a sum over examples: exact under any sharding
            return loss, diag

        def _local_diag(self, x: Any, y: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
            wrapper: Any = self.model
            sites = _site_names(wrapper, self.params)
            if (
                sites is None
                or self.stochastic
                or self.last_layer
                or self.subnetwork_indices is not None
            ):
                return super().diag(x, y, **kwargs)
            model = wrapper.pyro_model
            classification = model.likelihood.is_classification
            inputs = _network_inputs(x, model.label_key)
            point = {s: p.detach() for s, p in zip(sites, self.params, strict=True)}
            size = batch_size(inputs)
            rows: Iterator[tuple[int, dict[str, Tensor]]]
            if model.likelihood.rows_per_output(inputs) is not None:
                # one network row per output: one backward pass gives all K rows (the copies
                # alone are B·K·d, so nothing to stream); handed on as one chunk
                out, jac = output_jacobians(model, inputs, point)
                if classification:  # the contrasts J_k − J_K, k < K, that the sum expects
                    jac = {s: j[:, :-1] - j[:, -1:] for s, j in jac.items()}
                rows = iter([(0, {s: j.movedim(1, 0) for s, j in jac.items()})])
            else:
                # Σ_k J_k − J_K: softmax's Λ annihilates a shift common to the K rows
                out, rows = output_jacobian_rows(
                    model, inputs, point, contrast=classification, outputs_per_pass=4
                )
            if classification and out.dim() != 2:  # laplace-torch's cross-entropy: (B, K)
                return super().diag(x, y, **kwargs)
            diag = _streamed_diag_ggn(out, rows, point, sites, classification)
            if not classification:
                out = out.reshape(size, -1) if out.dim() == 1 else out  # LaplaceNet's (B, 1)
            loss = self.factor * self.lossfunc(out, y)
            return loss.detach(), diag.detach()

    return PerExampleGGN


@contextlib.contextmanager
def _real_token_kfac(wrapper: Any, x: Any, backend: Any) -> Iterator[None]:
    """Within the block, ``backend`` (laplace-torch's curvlinops module) builds K-FAC with
    :func:`_masked_kfac`'s operator over the real tokens of the batch ``x`` (nothing changes
    for a batch without padding or token axes)."""
    model = getattr(wrapper, "pyro_model", None)
    mask = None
    if model is not None and isinstance(x, Mapping):
        mask = token_mask(_network_inputs(x, model.label_key))
    if mask is None or bool(mask.bool().all()):
        yield
        return
    masked: Any = _masked_kfac()
    plain, backend.KFACLinearOperator, masked.token_mask = (
        backend.KFACLinearOperator,
        masked,
        mask.bool(),
    )
    try:
        yield
    finally:
        backend.KFACLinearOperator, masked.token_mask = plain, None


@functools.cache
def _masked_kfac() -> type:
    """curvlinops' ``KFACLinearOperator`` whose K-FAC-expand input factor of a token layer
    averages each row (sequence) over its own real tokens (``token_mask`` ``(rows, T)``, set
    around one call): ``A = (1/N) Σ_rows (1/L_row) Σ_{t real} a_t a_tᵀ``, K-FAC-expand's
    input factor ``(1/(N R)) Σ_n Σ_r a_{n,r} a_{n,r}ᵀ`` for ``R`` positions per sequence
    (Eschenhagen et al. 2023, Sec. 3) with each sequence's own length for ``R``. It is
    curvlinops' ``Σ a aᵀ / (N · T)`` for a batch without padding, and depends neither on how a batch is
    padded (left or right, copies of a choice in a ragged batch's padded rows, which get weight
    0) nor on how examples of different lengths are grouped into batches (a batch-wide mean
    length, ``Σ_real a aᵀ / (N · n_tok / n_rows)``, moved the curvature by 3-8 % with the
    grouping). The output-gradient factor needs nothing: padding gets no gradient."""
    from curvlinops import KFACLinearOperator  # type: ignore[import-untyped]

    class MaskedKFAC(KFACLinearOperator):
        token_mask: Tensor | None = None

        def _hook_accumulate_input_covariance(
            self, module: nn.Module, inputs: tuple[Tensor, ...], module_name: str
        ) -> None:
            mask, x = type(self).token_mask, inputs[0].data.detach() if inputs else None
            if (
                mask is None
                or x is None
                or len(inputs) != 1
                or x.dim() != 3
                or tuple(x.shape[:-1]) != tuple(mask.shape)
                or str(getattr(self._kfac_approx, "value", self._kfac_approx)) != "expand"
            ):  # a layer without the batch's token axis (a pooled head), or KFAC-reduce
                super()._hook_accumulate_input_covariance(module, inputs, module_name)
                return
            real = mask.to(x.device)
            a = x[real]  # (n_tok, d): the real tokens' inputs
            params = self._mapping[module_name]
            if "weight" in params and "bias" in params and not self._separate_weight_and_bias:
                a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
            # each real token weighted by 1 / its row's real length (rows without any: none)
            length = real.sum(-1, keepdim=True).clamp_min(1).to(a.dtype)
            weight = (1 / length).expand(real.shape)[real]  # (n_tok,)
            covariance = (a.T * weight) @ a
            covariance.div_(self._N_data)
            me: Any = self
            me._input_covariances = me._set_or_add_(me._input_covariances, module_name, covariance)

    return MaskedKFAC


def _streamed_diag_ggn(
    out: Tensor,
    rows: Iterator[tuple[int, dict[str, Tensor]]],
    point: Mapping[str, Tensor],
    sites: list[str],
    classification: bool,
) -> Tensor:
    r"""The diagonal GGN accumulated from Jacobian rows as they come (never all ``K`` at once).

    Regression: ``Σ_i Σ_k J_{ik}²``. Classification (``rows`` the contrasts ``J_{ik} − J_{iK}``
    for ``k < K``, the K-th zero): per example the ``p_i``-weighted sum of squared deviations
    ``Σ_k p_{ik} (J_{ik} − Σ_j p_{ij} J_{ij})²``, merged chunk by chunk with the pairwise update
    of Chan, Golub & LeVeque (1983, "Algorithms for computing the sample variance", eq. 2.1,
    weighted): a chunk of weight ``w``, mean ``m_c`` and centred sum ``M_c`` joins the running
    ``(W, m, M)`` as ``δ = m_c − m``, ``m ← m + δ w/(W + w)``, ``M ← M + M_c + δ² W w/(W + w)``,
    ``W ← W + w`` — the centred sum without the cancellation of ``Σ p J² − (Σ p J)²``. Memory:
    ``m`` and a few temporaries of the chunk's size, ``B·d`` numbers each per row.
    """
    diag = {s: point[s].new_zeros(point[s].shape) for s in sites}
    if not classification:
        for _, chunk in rows:
            for s in sites:
                diag[s] += chunk[s].square().sum((0, 1))
        return torch.cat([diag[s].reshape(-1) for s in sites])
    probs = torch.softmax(out, -1)  # (B, K)
    size = probs.shape[0]
    tiny = torch.finfo(probs.dtype).tiny
    total = probs[:, -1].clone()  # W: the K-th row (zero) enters first, m = 0 and M = 0 after it
    mean = {s: point[s].new_zeros(size, *point[s].shape) for s in sites}
    for k0, chunk in rows:
        count = next(iter(chunk.values())).shape[0]
        weight = probs[:, k0 : k0 + count].T  # (c, B)
        chunk_total = weight.sum(0)  # w
        merged = total + chunk_total
        # w/(W + w) and W w/(W + w): 0 where the weights are 0 (then so are the terms they scale)
        ratio = chunk_total / merged.clamp_min(tiny)
        cross = total * ratio
        for s in sites:
            g, m = chunk[s], mean[s]
            shape = (size,) + (1,) * (m.dim() - 1)
            chunk_mean = torch.einsum("cb,cb...->b...", weight, g) / chunk_total.clamp_min(
                tiny
            ).view(shape)
            deviation = (g - chunk_mean).square_()
            delta = chunk_mean.sub_(m)
            diag[s] += torch.einsum("cb,cb...->...", weight, deviation)
            del deviation
            diag[s] += torch.einsum("b,b...->...", cross, delta.square())
            m.add_(delta.mul_(ratio.view(shape)))
        total = merged
    return torch.cat([diag[s].reshape(-1) for s in sites])


def _site_names(wrapper: Any, params: Iterable[Tensor]) -> list[str] | None:
    """The latent site of each of ``params`` (in order), or ``None`` if one is not a site."""
    if not isinstance(wrapper, LaplaceNet):
        return None
    model = wrapper.pyro_model
    net = model.net
    by_id = {id(net.get_parameter(spec.param_name)): s for s, spec in model.latent_sites.items()}
    names = [by_id.get(id(p)) for p in params]
    return None if any(n is None for n in names) else [n for n in names if n is not None]


def _laplace_likelihood(model: Any) -> tuple[str, float]:
    """laplace-torch's ``likelihood`` and ``sigma_noise`` (a learned σ: its current value)."""
    if model.likelihood.is_classification:
        return "classification", 1.0
    return "regression", float(getattr(model.likelihood, "obs_scale", 1.0))


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
    xs = torch.linspace(lo, hi, grid, dtype=torch.float64)
    values = [float(log_marglik(math.exp(float(x)))) for x in xs]
    finite = [v if math.isfinite(v) else -math.inf for v in values]
    best = max(range(grid), key=lambda i: finite[i])
    a = float(xs[max(best - 1, 0)])
    b = float(xs[min(best + 1, grid - 1)])
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = float(log_marglik(math.exp(c))), float(log_marglik(math.exp(d)))
    for _ in range(iters):
        if fc >= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = float(log_marglik(math.exp(c)))
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = float(log_marglik(math.exp(d)))
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
    deprecated, else :class:`Laplace`'s).
    """
    _import_laplace()
    from laplace import Laplace as LaplaceTorch

    guide.require_setup()
    net = model.net
    specs = model.latent_sites
    flags = {name: p.requires_grad for name, p in net.named_parameters()}
    saved = {s: net.get_parameter(specs[s].param_name).detach().clone() for s in guide.sites}
    was_training = model.training
    model.train(False)
    try:
        for p in net.parameters():
            p.requires_grad_(False)
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
        # laplace-torch annotates a DataLoader; it iterates the loader and reads len(.dataset)
        with _no_exit("fitting the curvature"):
            la.fit(_Loader(model, data, model.device))  # type: ignore[arg-type]
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
        drop_temperature(guide, owner="fit_laplace: ")  # fitted for the posterior replaced
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
        _check_finite_curvature(torch.cat([v.reshape(-1) for v in (*vals, *vecs)]), [s])
        if len(vals) == 1:  # a bias: laplace-torch's one dense factor G (m×m)
            (q_out,), (l_out,) = vecs, vals
            q_in = q_out.new_ones(1, 1)
            curv = factor * l_out.clamp_min(0.0)
        else:
            q_out, q_in = vecs
            l_out, l_in = (v.clamp_min(0.0) for v in vals)
            curv = factor * l_out[:, None] * l_in[None, :]
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
            "data for non-finite inputs and the MAP for non-finite values (a diverged fit)."
        )


def _unexpected(expected: str, got: Any) -> str:
    return (
        f"Laplace: laplace-torch returned a {type(got).__name__} where pyrobayes expects a "
        f"{expected}; this laplace-torch version is not supported (please report it)."
    )


def _functional_variance(guide: Any, jac: Mapping[str, Tensor]) -> Tensor:
    """``J Σ Jᵀ`` `(B, C, C)` from per-site Jacobians ``(B, C, *site_shape)`` (the guide's)."""
    return guide.functional_covariance(jac)


def glm_moments(model: Any, guide: Any, inputs: Any) -> tuple[Tensor, Tensor]:
    """Mean ``f(x; θ*)`` `(B, C)` and covariance ``J Σ Jᵀ`` `(B, C, C)` of the linearized model."""
    guide.require_fitted()
    values = dict(guide.linearization_point())
    fixed = guide.fixed_point()  # sites outside subset=: held at their MAP, no Jacobian

    def f(vals: dict[str, Tensor]) -> Tensor:
        out = model.output(inputs, {**fixed, **vals})
        return out.unsqueeze(-1) if out.dim() == 1 else out

    with torch.no_grad():
        mean = f(values)
    # forward mode costs one JVP per site number, reverse mode one VJP per output (B·C): the
    # reverse-mode Jacobian of a batched function is O(B²C), so use forward mode when it needs fewer
    # passes and every op supports it (e.g. CPU flash attention does not)
    jac = None
    if sum(int(v.numel()) for v in values.values()) < mean.numel():
        try:
            jac = torch.func.jacfwd(f)(values)
        except NotImplementedError:
            logger.debug("forward-mode AD unavailable; using reverse mode for the GLM Jacobian")
    if jac is None:
        jac = torch.func.jacrev(f)(values)
    return mean.detach(), _functional_variance(guide, {s: j.detach() for s, j in jac.items()})


def glm_predict(
    model: Any,
    guide: Any,
    data: Iterable[Any],
    *,
    link: str = "probit",
    num_samples: int = 100,
    seed: int | None = 0,
    device: str | torch.device | None = None,
) -> Prediction:
    r"""Linearized (GLM) Laplace predictive on every batch of ``data``.

    ``f(x) ~ N(f(x; θ*), J Σ Jᵀ)``. Classification: ``link="probit"`` returns one "sample"
    ``log softmax(f / sqrt(1 + π/8 diag(JΣJᵀ)))``; ``link="mc"`` returns ``num_samples`` draws of
    ``log softmax(f)`` (average the probabilities, as every pyrobayes metric does). Regression:
    ``"probit"`` returns the mean (``loc (1, N)``), ``"mc"`` draws of the latent mean.

    Returns
    -------
    Prediction
    """
    if link not in ("probit", "mc"):
        raise ValueError(f"Expected link 'probit' or 'mc' but got {link!r}.")
    if device is not None:
        model.to(device)
        guide.to(device)
    model.train(False)
    dev = model.device
    generator = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
    classification = model.likelihood.is_classification
    outputs: list[Tensor] = []
    targets: list[Tensor] = []
    for batch in data:
        inputs, y = split_batch(to_device(batch, dev), model.label_key)
        mean, cov = glm_moments(model, guide, inputs)
        if link == "probit":
            if classification:
                kappa = torch.rsqrt(1.0 + math.pi / 8.0 * torch.diagonal(cov, dim1=-2, dim2=-1))
                out = torch.log_softmax(kappa * mean, -1).unsqueeze(0)
            else:
                out = mean.squeeze(-1).unsqueeze(0)
        else:
            c = cov.shape[-1]
            jitter = 1e-10 * torch.eye(c, dtype=cov.dtype, device=cov.device)
            chol = torch.linalg.cholesky(cov + jitter)
            eps = torch.randn((num_samples, *mean.shape), generator=generator, dtype=mean.dtype).to(
                dev
            )
            logits = mean + torch.einsum("bce,sbe->sbc", chol, eps)
            out = torch.log_softmax(logits, -1) if classification else logits.squeeze(-1)
        outputs.append(out.detach())
        if y is not None:
            targets.append(y)
    target = torch.cat(targets, 0) if targets else None
    return Prediction.from_outputs(torch.cat(outputs, 1), target, model.likelihood)
