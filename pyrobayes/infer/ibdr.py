r"""IBDR: interacting particles fitted with a distributionally robust two-pass step.

Pham et al., 2025, "Promoting Ensemble Diversity with Interactive Bayesian Distributional
Robustness for Fine-tuning Foundation Models" (ICML), Theorem 4.1 and Algorithm 1. The K particles
``θ_k = μ_k + σ ε_k`` of a :class:`~pyrobayes.contract.Mixture` posterior minimise

.. math::

    \min_{μ}\min_{λ\ge0}\ λρ + \max_{θ'}\big[L_B(θ') - λ\,c(θ, θ')\big]
        - \frac1K\sum_k \log p(μ_k),

    L_B(θ) = \frac{N}{B}\sum_{b}\Big[\frac1K\sum_k -\log p(y_b\mid x_b,θ_k)
             + α\,\ell_{div}(θ_{1:K}; x_b, y_b)\Big]

(dataset-sum convention; ``ℓ_div`` of :mod:`pyrobayes.infer.diversity`). The prior is the
``K·KL(Q‖P) = Σ_k KL(Q_k‖P)`` term of the bound, an L2 penalty ``β Σ_k ‖μ_k‖²``, with the
weight of the particles' likelihood: every particle's term is its own MAP objective
``(1/K)[−(N/B) Σ_b log p(y_b|x_b, θ_k) − log p(μ_k)]``, so α = 0 without the robust step is a
deep ensemble of K MAP fits (β = 1/(2K s_p²) in the paper's notation). One step
(:class:`IBDRFitter`):

1. ``g = ∇_θ L_B(θ)`` (all particles in one sample-batched forward; the data term only, since
   the prior term lies outside the inner maximisation of Theorem 4.1), clipped to
   ``‖g‖ ≤ c_max``;
2. ascent to the worst case of the first-order inner problem, ``θ' = θ + g / (2λ)``;
3. ``g' = ∇ L_B(θ')``; restore θ; the base optimizer steps μ with ``g'`` plus the prior's
   gradient at μ;
4. dual step ``λ ← clip(λ − η_λ (ρ − c), λ_min, λ_max)`` with the transport cost c:
   ``"param"`` ``(1/K) Σ_k ‖θ'_k − θ_k‖²``, or ``"function"`` (the released code)
   ``c = exp(max(0, r − ρ)/τ)·r``, ``r = mean_b ‖softmax(f̄_{θ'}(x_b)) − softmax(f̄_θ(x_b))‖``
   with ``f̄`` the particle-averaged logits and τ = 0.01.

ρ = 0 is a zero Wasserstein radius, θ' = θ: the step is then exactly the plain particle step
(one pass, the gradient of the objective at θ), and λ stays at λ₀.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from ..batch import batch_size
from ..contract import Mixture, implements
from ..models.adapters import check_real
from ..user_frame import user_stacklevel
from .distributed import all_reduce_grads_, all_reduce_mean_, world
from .diversity import diversity_loss
from .fitter import Fitter, register_fitter
from .objectives import split_training_batch
from .rank_errors import nan_grads_, nan_share, run_shared, shared_copy

logger = logging.getLogger(__name__)

__all__ = ["IBDR", "IBDRLoss", "IBDRFitter", "FUNCTION_COST_TEMPERATURE"]

#: τ of the released code's function-space cost ``exp(max(0, r − ρ)/τ)·r``.
FUNCTION_COST_TEMPERATURE = 0.01

#: Consecutive steps with λ at ``lam_min`` or ``lam_max`` after which the fit warns that the
#: dual controller does not act (at the defaults λ settles inside the interval, at λ* = 1).
PINNED_PATIENCE = 20


@dataclass(frozen=True)
class IBDR:
    r"""IBDR's fit settings: the objective's diversity term and the robust step's dual variable
    (Pham et al., 2025, Eq. 6 and Algorithm 1); the fitter's, not the posterior's.

    Pass it as the fit's optimizer, ``pb.fit(model, guide, data, ...,
    optim=pb.Optimization(optimizer=pb.infer.IBDR(alpha=0.02, rho=0.01)))`` or
    ``make_fitter(model, guide, optimizer=pb.infer.IBDR(...))``. Saved in the fitter's
    checkpoint (a resume under other settings is refused), not with the posterior.

    Parameters
    ----------
    alpha : float, optional
        α, weight of the diversity term (0.02, as the released code). ``None`` (default): 0.02
        with a classification likelihood of at least K + 1 classes, 0 otherwise (the term is
        defined on class probabilities, and vanishes identically with fewer than K + 1 classes:
        a binary task at K = 4; logged); an explicit ``alpha > 0`` there is refused.
    rho : float
        ρ, the Wasserstein radius the dual variable λ targets (0.0025: a mean squared ascent step
        of 0.05² per particle; 0 switches the robust step off exactly).
    lam : float
        λ₀, the initial dual variable (3.0).
    lam_min, lam_max : float
        The projection interval of λ ([0.05, 50]).
    lam_lr : float, optional
        η_λ, the dual step size; ``None`` (default) ``0.25/ρ``, so that λ reaches its fixed point
        ``λ* = c_max / (2√(Kρ))`` in tens of steps (stable while λ* > η_λ ρ = 0.25). The
        released code's η_λ is the learning rate: pass it explicitly.
    max_grad_norm : float
        c_max, the gradient-norm clip before the ascent (0.2); the ascent step is then at most
        ``c_max / (2λ)`` long.
    cost : {"param", "function"}
        Transport cost: ``"param"`` (default) ``(1/K) Σ_k ‖θ'_k − θ_k‖²``; ``"function"`` the
        released code's distance between the averaged predictive probabilities.
    loss : {"mean", "logits"}
        ``"mean"`` (default): the mean per-particle negative log-likelihood (the paper's form);
        ``"logits"``: the cross-entropy of the particle-averaged logits (the released code).
    epsilon : float
        ε, the jitter in ``log det(Uᵀ U + ε I)`` (1e-7).
    optimizer : torch optimizer class or callable ``params -> Optimizer``, optional
        The base optimizer of the descent step (``None``: Adam at the fit's ``lr``; a class is
        built as ``cls(params, lr=lr)``). A checkpoint records it by name.
    """

    alpha: float | None = None
    rho: float = 0.0025
    lam: float = 3.0
    lam_min: float = 0.05
    lam_max: float = 50.0
    lam_lr: float | None = None
    max_grad_norm: float = 0.2
    cost: str = "param"
    loss: str = "mean"
    epsilon: float = 1e-7
    optimizer: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        owner = "IBDR(): "
        if self.alpha is not None:
            check_real("alpha", self.alpha, ge=0, owner=owner)
        check_real("rho", self.rho, ge=0, owner=owner)
        check_real("lam_min", self.lam_min, gt=0, owner=owner)
        check_real("lam_max", self.lam_max, gt=0, owner=owner)
        check_real("lam", self.lam, gt=0, owner=owner)
        if not self.lam_min <= self.lam <= self.lam_max:
            raise ValueError(
                f"{owner}expected lam_min <= lam <= lam_max but got {self.lam_min}, {self.lam}, "
                f"{self.lam_max}."
            )
        if self.lam_lr is not None:
            check_real("lam_lr", self.lam_lr, ge=0, owner=owner)
        check_real("max_grad_norm", self.max_grad_norm, gt=0, owner=owner)
        check_real("epsilon", self.epsilon, gt=0, owner=owner)
        if self.cost not in ("param", "function"):
            raise ValueError(f"{owner}expected cost 'param' or 'function' but got {self.cost!r}.")
        if self.loss not in ("mean", "logits"):
            raise ValueError(f"{owner}expected loss 'mean' or 'logits' but got {self.loss!r}.")
        if self.optimizer is not None and not callable(self.optimizer):
            raise TypeError(
                f"{owner}optimizer must be a torch optimizer class or a callable params -> "
                f"Optimizer; got {type(self.optimizer).__name__}."
            )


def _mixture(guide: Any, who: str) -> Mixture:
    if not implements(guide, Mixture):
        raise TypeError(
            f"{who} fits equal-weight particle mixtures (pyrobayes.contract.Mixture, e.g. "
            f"pb.guides.IBDRGuide); got {type(guide).__name__}."
        )
    return cast(Mixture, guide)


class IBDRLoss:
    r"""IBDR's interactive objective at K particles (dataset-sum convention; Pham et al., 2025,
    "Interactive Bayesian distributional robustness", with the ensemble-diversity term of Pang
    et al., 2019).

    .. math::

        L = \frac{N}{B}\sum_b\Big[\frac1K\sum_k -\log p(y_b\mid x_b,θ_k)
            + α\,\ell_{div}(θ_{1:K}; x_b, y_b)\Big] - \frac1K\sum_k \log p(μ_k)

    With ``loss="logits"`` the first term is ``−log p(y_b | mean_k f(x_b; θ_k))``, the
    cross-entropy of the particle-averaged logits (the released code). The K particles run in one
    sample-batched forward.

    Parameters
    ----------
    alpha : float
        α, the weight of the diversity term (0 switches it off).
    loss : {"mean", "logits"}
    epsilon : float
        ε of ``−log det(Uᵀ U + ε I)``.
    auto_alpha : bool
        ``alpha`` is the default rather than the user's: where the term is undefined, fewer
        than K + 1 classes (``det(Uᵀ U) ≡ 0``, :func:`~pyrobayes.infer.diversity.check_diversity_classes`),
        it is switched off (α = 0, logged once) instead of refused.
    """

    #: the data term weighs each minibatch by N/B with N the model's ``num_data``: a fit with
    #: ``num_data=None`` is refused (N would be each batch's size, the prior weighted N/B times
    #: too much), as for the ELBO and MAP (:class:`~pyrobayes.infer.fitter.Fitter`)
    weighs_batches_by_num_data = True

    def __init__(
        self,
        alpha: float = 0.02,
        loss: str = "mean",
        epsilon: float = 1e-7,
        *,
        auto_alpha: bool = False,
    ) -> None:
        if alpha < 0 or not math.isfinite(alpha):
            raise ValueError(f"IBDRLoss: expected a finite alpha >= 0 but got {alpha}.")
        if loss not in ("mean", "logits"):
            raise ValueError(f"IBDRLoss: expected loss 'mean' or 'logits' but got {loss!r}.")
        self.alpha = float(alpha)
        self.kind = loss
        self.epsilon = float(epsilon)
        self.auto_alpha = bool(auto_alpha)

    def data_term(
        self, model: Any, values: Mapping[str, Tensor], batch: Any
    ) -> tuple[Tensor, Tensor | None]:
        """``(L_B(θ), p̄)``: the data part of the objective at particles ``values[site]:
        (K, *shape)`` and, for a classification likelihood, the probabilities of the averaged
        logits ``(B, C)`` (a multi-label likelihood: each label's ``σ`` of the averaged logits
        ``(B, L)``; detached; the function-space cost uses them)."""
        inputs, targets = split_training_batch(model, batch)
        params = model.batched_output(inputs, values)  # (K, B, ...)
        size = batch_size(inputs)
        scale = (model.num_data or size) / size
        classification = bool(model.likelihood.is_classification)
        multi_label = bool(getattr(model.likelihood, "multi_label", False))
        if self.kind == "logits":
            averaged = params.mean(0, keepdim=True)
            nll = -model.log_likelihood(averaged, targets).sum()
        else:
            nll = -model.log_likelihood(params, targets).mean(0).sum()
        total = scale * nll
        # the normalised logits Categorical(logits=params).logits, without its argument check
        # (a non-finite forward then reaches the fitter's FloatingPointError, not a ValueError)
        # (none for a multi-label likelihood: its logits are per label, not over classes)
        logits = (
            params - params.logsumexp(-1, keepdim=True)
            if classification and not multi_label
            else None
        )
        # a ragged multiple-choice batch: the term is defined per question with at least K + 1
        # real choices (its padded choices add zero coordinates, which leave U's cosines as they
        # are); the others get none, whatever batch they fall in
        choices = inputs.get("choice_mask") if isinstance(inputs, Mapping) else None
        rows: Tensor | None = None  # the examples that get the term (None: all)
        if isinstance(choices, Tensor) and choices.dim() == 2 and logits is not None:
            rows = choices.sum(-1) - 1 >= logits.shape[0]
        elif self.alpha > 0 and self.auto_alpha and logits is not None:
            num_classes, num_particles = logits.shape[-1], logits.shape[0]
            if num_classes - 1 < num_particles:
                logger.info(
                    "IBDR: the diversity term needs at least K + 1 = %d classes, the task has "
                    "%d: alpha's default is 0 here (robust particles without the term; fewer "
                    "particles, num_particles <= %d, would keep it).",
                    num_particles + 1,
                    num_classes,
                    num_classes - 1,
                )
                self.alpha = 0.0
        if self.alpha > 0 and (rows is None or bool(rows.any())):
            if logits is None:
                raise ValueError(
                    f"IBDR's diversity term needs class probabilities (one class per example), "
                    f"but the likelihood is {model.likelihood.name!r}. Use alpha=0 for a "
                    "non-categorical likelihood."
                )
            labels = model.likelihood.check_targets(params, targets)
            taken = logits if rows is None else logits[:, rows]
            labels = labels if rows is None else labels[rows]
            div = diversity_loss(torch.softmax(taken, dim=-1), labels, self.epsilon)
            total = total + scale * self.alpha * div.sum()
        mean_probs = None
        if logits is not None:
            mean_probs = torch.softmax(logits.detach().mean(0), dim=-1)
        elif multi_label:  # each label's probability of a 1, (B, L)
            mean_probs = torch.sigmoid(params.detach().mean(0))
        return total, mean_probs

    @staticmethod
    def prior_term(model: Any, locs: Mapping[str, Tensor]) -> Tensor:
        """``−(1/K) Σ_k log p(μ_k)``: the ``K·KL(Q‖P)`` term at the particles' likelihood weight
        (an L2 penalty ``Σ_k ‖μ_k‖²/(2K s_p²)``; each particle's prior as in its MAP objective)."""
        return -model.log_prior(locs).mean()

    def loss(self, model: Any, guide: Any, batch: Any) -> Tensor:
        """The objective at ``θ_k = μ_k + σ ε_k`` (fresh noise), without the robust step."""
        mixture = _mixture(guide, "IBDRLoss")
        locs = mixture.component_locs()
        values = locs
        if mixture.component_scale > 0:
            values = {s: v + mixture.component_scale * torch.randn_like(v) for s, v in locs.items()}
        data, _ = self.data_term(model, values, batch)
        return data + self.prior_term(model, locs)


def _gradient_norm(grads: list[Tensor]) -> float:
    """``‖g‖`` over the particles' gradients (finite, checked), as a Python float.

    The squares of large finite gradients overflow their dtype (float32 beyond ~1.8e19, float16
    beyond 256), which would make the norm ``inf``, the clip 0, the radius ``0·inf = NaN`` and
    λ jump silently to ``lam_min``; that rare case is recomputed rescaled, in float64.
    """
    norm = float(
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    )
    if math.isfinite(norm) or not grads:
        return norm
    peak = max(float(g.detach().abs().max()) for g in grads if g.numel())
    if peak == 0.0 or not math.isfinite(peak):
        return norm
    parts = [torch.linalg.vector_norm(g.detach().to(torch.float64) / peak) for g in grads]
    return peak * float(torch.linalg.vector_norm(torch.stack(parts)))


class IBDRFitter(Fitter):
    r"""The two-pass distributionally robust step of IBDR, with the dual variable λ (Pham et
    al., 2025).

    Its settings, :class:`IBDR` (``optimizer=pb.infer.IBDR(...)``), set the step: ``alpha``,
    ``loss``, ``epsilon`` (the objective, :class:`IBDRLoss`), ``rho`` (ρ), ``lam`` (λ₀),
    ``lam_min`` / ``lam_max`` (the projection interval), ``lam_lr`` (η_λ; ``None``: ``0.25/ρ``),
    ``max_grad_norm`` (c_max) and ``cost`` (``"param"`` or ``"function"``). The base optimizer (the descent step) is any
    torch optimizer; the default is Adam, as for every pyrobayes fitter but the IVON ones: the objective is a
    dataset sum (N/B-scaled), to which Adam is scale-invariant. The released code's SGD with
    momentum 0.9 on the per-example mean loss at learning rate η is
    ``optimizer=pb.infer.IBDR(optimizer=lambda p: torch.optim.SGD(p, lr=η / N, momentum=0.9))``
    here (a torch optimizer passed directly as ``optimizer`` runs with the default settings).

    Every step evaluates all K particles in one sample-batched forward, twice (at θ and θ').
    :meth:`report` gives λ, the last transport cost and the effective radius
    ``‖clip(g)‖ / (2λ)`` (``pyrobayes.fit`` shows them on the progress bar and returns them in
    ``FitResult.state``); :meth:`state_dict` holds them with the optimizer, the state of the
    particle-noise generator and the settings, so a resumed fit continues exactly. Under
    ``torch.distributed`` the
    gradients and the cost are averaged over ranks, so λ is the same on every rank.
    """

    settings: IBDR  # the fit's settings record (Fitter.settings)

    def __init__(self, model: Any, guide: Any, *, optimizer: Any = None, **kwargs: Any) -> None:
        _mixture(guide, "IBDRFitter")
        #: the fit's settings: ``optimizer`` when it is an :class:`IBDR`, else those given to
        #: the guide's constructor (deprecated), else the defaults
        if isinstance(optimizer, IBDR):
            self.settings, optimizer = optimizer, optimizer.optimizer
        else:
            self.settings = IBDR(**getattr(guide, "fit_settings", {}))
        classification = bool(model.likelihood.is_classification)
        # the diversity term spreads the particles' class-probability vectors over the wrong
        # classes (one class per example): a multi-label likelihood has none, and gets α = 0
        categorical = classification and not getattr(model.likelihood, "multi_label", False)
        alpha = self.settings.alpha
        #: α in effect (``IBDR.alpha``; ``None``: 0.02 with class probabilities, else 0)
        self.alpha = (0.02 if categorical else 0.0) if alpha is None else float(alpha)
        super().__init__(model, guide, optimizer=optimizer, **kwargs)
        self._refuse_variational(
            "IBDR minimises its interactive objective with a two-pass robust step (IBDRLoss)."
        )
        settings = self.settings
        self.rho = float(settings.rho)
        self.lam = float(settings.lam)
        self.lam_min = float(settings.lam_min)
        self.lam_max = float(settings.lam_max)
        # None: η_λ = 0.25/ρ, a dual step that makes λ respond to the cost within tens of steps
        # (the fixed point c = ρ is stable for η_λ ρ < λ*; see docs/methods/ibdr.md)
        self.lam_lr: float | None = None if settings.lam_lr is None else float(settings.lam_lr)
        if self.lam_lr is None and self.rho > 0:
            self.lam_lr = 0.25 / self.rho
        self.max_grad_norm = float(settings.max_grad_norm)
        self.cost_kind = str(settings.cost)
        self.cost = 0.0
        self.radius = 0.0
        #: consecutive steps λ ended at lam_min or lam_max (the warning of _watch_bound)
        self.pinned = 0
        if isinstance(self.objective, IBDRLoss) and self.objective.alpha > 0:
            if not categorical:
                raise ValueError(
                    "IBDR's diversity term (alpha > 0) needs a one-class-per-example "
                    f"classification likelihood, not {model.likelihood.name!r}; pass "
                    "optimizer=pb.infer.IBDR(alpha=0)."
                )
        if self.cost_kind == "function" and not classification:
            raise ValueError(
                "cost='function' compares predictive probabilities and needs a classification "
                f"likelihood, not {model.likelihood.name!r}; use pb.infer.IBDR(cost='param')."
            )
        seed = int(torch.randint(0, 2**62, (1,)))
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        #: the parameters the robust step perturbs: the particles' locations (the guide's),
        #: not the model's point parameters
        particle_ids = {id(p) for p in guide.parameters()}
        self._particle_params = [p for p in self.params if id(p) in particle_ids]

    def default_objective(self) -> IBDRLoss:
        settings = self.settings
        return IBDRLoss(
            alpha=self.alpha,
            loss=settings.loss,
            epsilon=settings.epsilon,
            auto_alpha=settings.alpha is None,
        )

    # ------------------------------------------------------------------ the step
    def _values(self, locs: Mapping[str, Tensor], noise: Mapping[str, Tensor]) -> dict[str, Tensor]:
        if not noise:
            return dict(locs)
        scale = cast(Mixture, self.guide).component_scale
        return {s: v + scale * noise[s] for s, v in locs.items()}

    def _data_term(self, values: Mapping[str, Tensor], batch: Any) -> tuple[Tensor, Tensor | None]:
        objective = self.objective
        if isinstance(objective, IBDRLoss):
            return objective.data_term(self.model, values, batch)
        raise TypeError(  # pragma: no cover - refused in __init__ paths that reach here
            f"IBDRFitter needs an IBDRLoss objective, got {type(objective).__name__}."
        )

    def _update(self, batch: Any) -> float:
        if not isinstance(self.objective, IBDRLoss):
            return super()._update(batch)  # another objective: a plain step
        mixture = cast(Mixture, self.guide)
        model, params, optim = self.model, self.params, self.optimizer
        distributed = world()[0] > 1
        locs = mixture.component_locs()
        noise = self._noise(locs, mixture.component_scale)
        # pass 1: g = ∇L_B at θ = μ + σε (the data term only: the prior is outside the inner max)
        self._zero_grad()
        # one rank's error shares NaN through the step's all-reduces, then every rank stops
        data, probs = run_shared(
            lambda: self._data_term(self._values(locs, noise), batch),
            lambda: (nan_share(params[0].device), None),
        )
        prior = IBDRLoss.prior_term(model, locs)
        mean = shared_copy(data + prior) if distributed else (data + prior).detach().clone()
        if distributed:
            all_reduce_mean_([mean])
        value = float(mean)
        if not math.isfinite(value):
            return value
        if self.rho == 0.0:  # a zero radius: θ' = θ, the plain (non-robust) particle step
            run_shared((data + prior).backward, lambda: nan_grads_(params))
            if distributed:
                all_reduce_grads_(params)
            self._check_grads()
            self._optimizer_step()
            self.cost = 0.0
            self.radius = 0.0
            return value
        run_shared(data.backward, lambda: nan_grads_(params))
        if distributed:
            all_reduce_grads_(params)
        self._check_grads()
        # the ascent moves the particles θ_k only: a point parameter shared by every particle
        # (a trainable head) is not in the transport cost Σ_k ‖θ'_k − θ_k‖²
        ascent = self._particle_params
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ascent]
        norm = _gradient_norm(grads)
        clip = min(1.0, self.max_grad_norm / (norm + 1e-12))
        step = clip / (2.0 * self.lam)
        shift = step * norm  # ‖θ' − θ‖ over all particles (the same on every rank)
        limit = min(torch.finfo(p.dtype).max for p in ascent)  # the particles' dtype
        if not (math.isfinite(shift * shift) and step <= limit and shift <= limit):
            what = f"its length {shift:.3g} overflows the particles' dtype (max {limit:.3g})"
            raise FloatingPointError(self._ascent_message(shift, what))
        saved = [p.detach().clone() for p in ascent]
        with torch.no_grad():  # ascent: θ' = θ + clip(g) / (2λ)
            for p, g in zip(ascent, grads, strict=True):
                p.add_(g, alpha=step)
        # pass 2: g' at θ'; then restore θ and add the prior's gradient at μ
        self._zero_grad()  # the point parameters' pass-1 gradients too
        try:
            probs_adv = run_shared(
                lambda: self._adversarial_pass(locs, noise, batch), lambda: nan_grads_(params)
            )
        finally:
            with torch.no_grad():
                for p, s in zip(ascent, saved, strict=True):
                    p.copy_(s)
        IBDRLoss.prior_term(model, locs).backward()
        if distributed:
            all_reduce_grads_(params)
        try:
            self._check_grads()
        except FloatingPointError as error:  # at θ', not θ: say which setting sent it there
            raise FloatingPointError(self._ascent_message(shift, str(error))) from error
        # the transport cost and the dual step
        cost = self._transport_cost(probs, probs_adv, shift, distributed)
        lam_lr = self.lam_lr if self.lam_lr is not None else float(optim.param_groups[0]["lr"])
        lam = self._dual_step(cost, lam_lr)  # checked before the update: a refusal moves nothing
        self._optimizer_step()
        self.lam = lam
        self.cost = cost
        self.radius = shift
        self._watch_bound()
        return value

    def _noise(self, locs: Mapping[str, Tensor], component_scale: float) -> dict[str, Tensor]:
        """ε_k per site, the same in both passes (none when the components are points)."""
        noise: dict[str, Tensor] = {}
        if component_scale > 0:
            for site, loc in locs.items():
                eps = torch.randn(loc.shape, generator=self.generator, dtype=loc.dtype)
                noise[site] = eps.to(loc.device)
        return noise

    def _adversarial_pass(
        self, locs: Mapping[str, Tensor], noise: Mapping[str, Tensor], batch: Any
    ) -> Tensor | None:
        """The data term's gradient at θ' (accumulated in ``.grad``); returns its predictive
        probabilities (for the function-space transport cost)."""
        data_adv, probs_adv = self._data_term(self._values(locs, noise), batch)
        data_adv.backward()
        return probs_adv

    def _transport_cost(
        self, probs: Tensor | None, probs_adv: Tensor | None, shift: float, distributed: bool
    ) -> float:
        """The step's transport cost c: ``"function"`` from the averaged predictive
        probabilities at θ and θ', else ``‖θ' − θ‖² / K``."""
        if self.cost_kind == "function" and probs is not None and probs_adv is not None:
            distance = (probs_adv - probs).norm(dim=-1).mean().to(torch.float64).reshape(1)
            if distributed:  # the mean over the union batch, then the same cost on every rank
                all_reduce_mean_([distance])
            raw = float(distance)
            return math.exp(max(0.0, raw - self.rho) / FUNCTION_COST_TEMPERATURE) * raw
        return shift * shift / cast(Mixture, self.guide).num_components

    def _ascent_message(self, shift: float, what: str) -> str:
        """The refusal of a robust step whose ascent left the region where the loss is finite."""
        return (
            f"IBDR: the robust step's ascent θ' = θ + clip(g)/(2λ) (λ = {self.lam:g}, "
            f"lam_min = {self.lam_min:g}, max_grad_norm = {self.max_grad_norm:g}, radius "
            f"{shift:.3g}) failed at step {self.num_steps}: {what}. The particles and λ were "
            "left as they were and not updated; shorten the ascent (raise lam / lam_min, or "
            "lower max_grad_norm or rho)."
        )

    def _dual_step(self, cost: float, lam_lr: float) -> float:
        """``clip(λ − η_λ (ρ − c), λ_min, λ_max)``; a non-finite cost (or ``η_λ·0 = ∞·0``)
        is refused by name, not clipped to a bound (Python's ``max`` drops a NaN silently)."""
        moved = self.lam - lam_lr * (self.rho - cost)
        if not math.isfinite(cost) or math.isnan(moved):
            raise FloatingPointError(
                f"IBDR: the dual step λ ← λ − η_λ (ρ − c) is not a number at step "
                f"{self.num_steps} (transport cost c = {cost}, cost={self.cost_kind!r}, rho = "
                f"{self.rho:g}, lam_lr = {lam_lr:g}); the particles and λ = {self.lam:g} were "
                "not updated. Pass a finite lam_lr (rho=0 switches the robust step off)."
            )
        return min(self.lam_max, max(self.lam_min, moved))

    def _watch_bound(self) -> None:
        """Count the consecutive steps λ ended at a bound of its interval; warn once at
        :data:`PINNED_PATIENCE`: the transport cost then stays on one side of ρ whatever λ
        does, so the robust step's radius is set by the bound, not by ρ."""
        at_bound = self.rho > 0 and self.lam in (self.lam_min, self.lam_max)
        self.pinned = self.pinned + 1 if at_bound else 0
        if self.pinned != PINNED_PATIENCE or world()[1] != 0:  # λ is the same on every rank
            return
        if self.lam == self.lam_max:
            why = (
                f"the transport cost ({self.cost:.3g}) stayed above rho = {self.rho:g} even at "
                f"lam_max = {self.lam_max:g}, so the ascent is held at its shortest; raise rho "
                "or lam_max"
            )
        else:
            why = (
                f"the transport cost ({self.cost:.3g}) stayed below rho = {self.rho:g} even at "
                f"lam_min = {self.lam_min:g}: the ascent, clipped at max_grad_norm = "
                f"{self.max_grad_norm:g}, cannot reach that radius; lower rho or raise "
                "max_grad_norm"
            )
        warnings.warn(
            f"IBDR: λ sat at its bound {self.lam:g} for {self.pinned} consecutive steps: {why} "
            f"(cost={self.cost_kind!r}; the radius is now {self.radius:.3g}). The dual "
            "controller does not act; see docs/methods/ibdr.md, 'The dual controller at the defaults'.",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )

    # ------------------------------------------------------------------ reporting and state
    def report(self) -> dict[str, float]:
        """λ, the last transport cost and the last effective radius ``‖θ' − θ‖``."""
        return {"lam": self.lam, "cost": self.cost, "radius": self.radius}

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state, λ, the last cost and radius, the particle-noise generator and
        the settings it ran with (:class:`IBDR`)."""
        state = super().state_dict()
        state["ibdr"] = {
            "lam": self.lam,
            "cost": self.cost,
            "radius": self.radius,
            "pinned": self.pinned,
            "generator": self.generator.get_state(),
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; refuses a checkpoint written with other settings."""
        super().load_state_dict(state)
        ibdr = state.get("ibdr")
        if ibdr is not None:
            self.lam = float(ibdr["lam"])
            self.cost = float(ibdr["cost"])
            self.radius = float(ibdr["radius"])
            self.pinned = int(ibdr.get("pinned", 0))  # absent before it was recorded
            self.generator.set_state(ibdr["generator"])


register_fitter("ibdr", IBDRFitter)
