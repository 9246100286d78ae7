r"""Equal-weight mixtures of K particles: ``q(θ) = (1/K) Σ_k N(θ; μ_k, σ² I)`` with σ fixed.

:class:`ParticleGuide` is the posterior of the particle families (interacting particles, deep
ensembles, σN ensembles): K locations per latent site stored with a leading particle axis
(one parameter ``locs.<site>`` of shape ``(K, *site_shape)``) and one fixed component scale σ
(σ = 0: point particles, the mixture of K point masses). How the particles are fitted is not
part of the posterior: :class:`IBDRGuide` names the interacting, distributionally robust fitter
of Pham et al. (2025) (:mod:`pyrobayes.infer.ibdr`), whose settings are its own
(:class:`pyrobayes.infer.IBDR`).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Mapping
from operator import attrgetter
from typing import Any, ClassVar

import pyro
import pyro.distributions as dist
import torch
from torch import Tensor

from ..batch import compute_dtype
from ..fitted_head import record_initial_state
from ..models.adapters import check_int, check_real
from ..models.finetune import NOISE_PARAM
from ..user_frame import user_stacklevel
from ._fit_options import warn_fit_settings
from .base import PosteriorGuide

logger = logging.getLogger(__name__)

__all__ = ["ParticleGuide", "IBDRGuide"]

#: Name of the auxiliary Pyro site that picks the mixture component in ``forward``.
COMPONENT_SITE = "_particle"


class ParticleGuide(PosteriorGuide):
    r"""An equal-weight mixture of K particles over every latent site.

    .. math:: q(θ) = \frac1K \sum_{k=1}^K \mathcal N(θ;\ μ_k,\ σ^2 I),\qquad σ \text{ fixed}

    With ``scale=0`` the components are point masses ``δ(θ − μ_k)`` (a deep ensemble, SVGD's
    particles, the released IBDR code). Under Pyro (``forward``) a draw first picks the component
    ``k ~ Categorical(1/K, …, 1/K)`` at the auxiliary site ``"_particle"`` and then every site
    from particle k, so ``pyro.infer.Predictive`` and ``SVI`` see a proper joint draw.

    Parameters
    ----------
    model : FineTuneModel or Pyro model
    num_particles : int
        K, the number of mixture components (default 4).
    scale : float
        σ, the fixed standard deviation of every component (default 0: point particles).
    init_scale : float
        Standard deviation of the independent jitter added to the model's initial value for every
        particle (default 1e-2). It makes the particles distinct at initialisation, which
        interacting objectives need: LoRA's ``B = 0`` (or zero LoRA-XS cores) makes every
        particle's adapter output identical, so their predictions coincide and a diversity
        determinant over them is exactly 0. ``init_scale=0`` starts every particle at the
        model's value.
    average : {"probs", "logits"}
        How :func:`pyrobayes.predict` combines the draws of a classifier: ``"probs"`` (default)
        the mixture's predictive ``(1/S) Σ_s softmax(f(x; θ_s))``; ``"logits"`` the released IBDR
        code's ``softmax((1/S) Σ_s f(x; θ_s))`` (one combined prediction, ``S = 1``).

    Notes
    -----
    ``sample_posterior(S)`` is stratified: every block of K consecutive draws visits each particle
    once (in a random order), so with S a multiple of K the predictive average
    ``(1/S) Σ_s p(y | x, θ_s)`` weighs the particles exactly equally. :func:`pyrobayes.predict`
    rounds its ``num_samples`` up to a multiple of K for that reason (``num_samples=K`` is the
    exact predictive of point particles).

    ``log_prob`` is the log density of the mixture for σ > 0. For σ = 0 the mixture has no
    density; as :class:`~pyrobayes.guides.DeltaGuide` does for its point mass, it is the log
    probability with respect to the counting measure on the particles: ``log(n(θ)/K)`` with
    ``n(θ)`` the number of particles equal to θ (``−inf`` at any other point).

    Point-estimated parameters of the model (a head in ``trainable_modules``) are shared by all
    particles; for per-particle heads make the head latent
    (``FineTuneModel(..., latent_modules=["classifier"])``).
    """

    is_deterministic = False

    def __init__(
        self,
        model: Any,
        *,
        num_particles: int = 4,
        scale: float = 0.0,
        init_scale: float = 1e-2,
        average: str = "probs",
    ) -> None:
        owner = f"{type(self).__name__}: "
        if average not in ("probs", "logits"):
            raise ValueError(f"{owner}expected average 'probs' or 'logits' but got {average!r}.")
        self.average = average
        self.num_components = check_int("num_particles", num_particles, ge=1, owner=owner)
        self.component_scale = check_real("scale", scale, ge=0, owner=owner)
        self._init_scale = check_real("init_scale", init_scale, ge=0, owner=owner)
        super().__init__(model)
        shared = [n for n in getattr(model, "point_params", {}) if n != NOISE_PARAM]
        if shared and self.num_components > 1:
            logger.info(
                "%s: the point-estimated parameters %s are shared by all %d particles; make them "
                "latent (FineTuneModel(..., latent_modules=[...])) for per-particle heads.",
                type(self).__name__,
                shared,
                self.num_components,
            )

    @property
    def num_particles(self) -> int:
        """K (the same as ``num_components``)."""
        return self.num_components

    # ------------------------------------------------------------------ set-up
    def _setup_sites(self, inits: Mapping[str, Tensor]) -> None:
        super()._setup_sites(inits)
        # the particles start away from the model's values: record them as built, so that a
        # guide predicted without a fit is told (pyrobayes.fitted_head.warn_if_never_fitted)
        record_initial_state(self)
        self._warn_if_identical()

    def _jitter_remedy(self) -> str | None:
        """How to make the particles start distinct, or ``None`` when the options ask for no
        jitter at all (that case is the subclass's own warning, at construction)."""
        if self._init_scale == 0:
            return None
        return f"raise init_scale (now {self._init_scale:g}) above the sites' rounding"

    def _warn_if_identical(self) -> None:
        """Warn when K > 1 particles start identical at every site although the options asked
        for a jitter: it rounded away (a value whose dtype cannot resolve it, e.g. ``1.0 + 1e-3``
        in bfloat16), or it applies to no site. Identical particles get identical gradients,
        so the mixture silently stays one network. Checked once, at set-up."""
        remedy = self._jitter_remedy()
        if self.num_components < 2 or remedy is None or not self.sites:
            return
        with torch.no_grad():
            if not all(bool((v == v[:1]).all()) for v in self.validation_values().values()):
                return
        dtypes = sorted({str(self.loc(s).dtype) for s in self.sites})
        warnings.warn(
            f"{type(self).__name__}: all {self.num_components} particles start identical at "
            f"every site (dtypes {dtypes}) although the options ask for distinct starts: the "
            "jitter rounded away or applies to no site. Identical particles get identical "
            f"gradients and stay one network; {remedy}.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )

    def _setup_site(self, site: str, init: Tensor) -> None:
        init = init.detach().to(compute_dtype(init.dtype))  # (float32 on a half-precision site)
        locs = init.unsqueeze(0).repeat(self.num_components, *([1] * init.dim()))
        if self._init_scale > 0:
            locs = locs + self._init_scale * torch.randn_like(locs)
        self._add_param("locs", site, locs)

    def loc(self, site: str) -> Tensor:
        """The particles' locations at ``site``: ``(K, *site_shape)``."""
        return attrgetter(site)(self.locs)

    def component_locs(self) -> dict[str, Tensor]:
        """``{site: (K, *shape)}``: the trainable particle locations (differentiable)."""
        self.require_setup()
        return {s: self.loc_param(s) for s in self.sites}

    # ------------------------------------------------------------------ distributions
    def _component(self, loc: Tensor, event_dim: int) -> dist.TorchDistribution:
        if self.component_scale == 0:
            return dist.Delta(loc, event_dim=event_dim)
        return dist.Normal(loc, self.component_scale).to_event(event_dim)

    def get_posterior(self, site: str) -> dist.TorchDistribution:
        """The marginal at ``site``: the mixture of the K particles' components."""
        locs = self.loc(site)
        event_dim = locs.dim() - 1
        # point particles: Delta components, so log_prob is log(n(θ)/K) (counting measure)
        mixing = dist.Categorical(logits=locs.new_zeros(self.num_components))
        return dist.MixtureSameFamily(mixing, self._component(locs, event_dim))

    def _pyro_sample_sites(self) -> dict[str, Tensor]:
        ref = self.loc(next(iter(self.sites)))
        k = pyro.sample(
            COMPONENT_SITE,
            dist.Categorical(logits=ref.new_zeros(self.num_components)),
            infer={"is_auxiliary": True},
        )
        out = {}
        for site in self.sites:
            loc = self.loc(site)[k]
            out[site] = pyro.sample(site, self._component(loc, len(self.sites[site])))
        return out

    # ------------------------------------------------------------------ batched queries
    def _components_of(self, num_samples: int, device: torch.device) -> Tensor:
        """Component of each of S draws: blocks of K are random permutations (stratified)."""
        blocks = -(-num_samples // self.num_components)
        keys = torch.rand(blocks, self.num_components, device=device)
        return keys.argsort(-1).reshape(-1)[:num_samples]

    def rsample(self, num_samples: int = 1) -> dict[str, Tensor]:
        """Differentiable draws ``{site: (S, *shape)}``; each block of K visits every particle."""
        self.require_setup()
        ks = self._components_of(num_samples, self.device)
        out = {}
        for site in self.sites:
            value = self.loc(site)[ks]
            if self.component_scale > 0:
                value = value + self.component_scale * torch.randn_like(value)
            out[site] = value
        return out

    def sample_components(
        self, num_per_component: int, *, generator: torch.Generator | None = None
    ) -> dict[str, Tensor]:
        """Draws grouped by component, without gradients: ``{site: (K, n, *shape)}``.

        Particle k's ``n`` draws are ``μ_k + σ ε`` (``μ_k`` repeated when σ = 0); the same
        ``generator`` state gives the same values.
        """
        self.require_setup()
        if num_per_component < 1:
            raise ValueError(f"Expected num_per_component >= 1 but got {num_per_component}.")
        out = {}
        with torch.no_grad():
            for site in self.sites:
                loc = self.loc(site).detach()
                value = loc.unsqueeze(1).expand(loc.shape[0], num_per_component, *loc.shape[1:])
                if self.component_scale > 0:
                    noise = torch.randn(value.shape, generator=generator, dtype=value.dtype)
                    value = value + self.component_scale * noise.to(value.device)
                out[site] = value.clone()
        return out

    def log_prob(self, values: Mapping[str, Tensor]) -> Tensor:
        """``log q(θ_s)`` per draw ``(S,)`` (counting measure on the particles when σ = 0)."""
        self.require_setup()
        per = None  # (S, K)
        for site in self.sites:
            locs = self.loc(site)
            v = values[site]
            event = len(self.sites[site])
            diff = (v.unsqueeze(1) - locs.unsqueeze(0)).flatten(2)  # (S, K, numel)
            if self.component_scale == 0:
                term = (diff == 0).all(-1).to(locs.dtype).log()
            else:
                scale = self.component_scale
                numel = math.prod(self.sites[site]) if event else 1
                term = -0.5 * (diff / scale).pow(2).sum(-1) - numel * (
                    math.log(scale) + 0.5 * math.log(2 * math.pi)
                )
            per = term if per is None else per + term
        if per is None:
            raise RuntimeError(f"{type(self).__name__}.log_prob: the guide has no sites.")
        return torch.logsumexp(per, dim=-1) - math.log(self.num_components)

    def mean(self) -> dict[str, Tensor]:
        """The mixture mean ``(1/K) Σ_k μ_k`` per site."""
        self.require_setup()
        with torch.no_grad():
            return {s: self.loc(s).detach().mean(0) for s in self.sites}

    def median(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        """The mixture mean (a mixture of separated particles has no useful joint median)."""
        return self.mean()

    def validation_values(self) -> dict[str, Tensor]:
        """The K particle locations ``{site: (K, *shape)}``; their average is the predictive."""
        self.require_setup()
        with torch.no_grad():
            return {s: self.loc(s).detach().clone() for s in self.sites}


def _check_ibdr_settings(owner: str, given: dict[str, Any]) -> None:
    """Refuse a bad deprecated IBDR setting by name (before the warning)."""
    for name in ("alpha", "rho", "lam_lr"):
        if name in given:
            check_real(name, given[name], ge=0, owner=owner)
    for name in ("lam", "lam_min", "lam_max", "max_grad_norm", "epsilon"):
        if name in given:
            check_real(name, given[name], gt=0, owner=owner)
    lam_min, lam, lam_max = (given.get(k) for k in ("lam_min", "lam", "lam_max"))
    low, high = (0.05 if lam_min is None else lam_min), (50.0 if lam_max is None else lam_max)
    if lam is not None and not low <= lam <= high:
        raise ValueError(f"{owner}expected lam_min <= lam <= lam_max but got {low}, {lam}, {high}.")
    if given.get("cost", "param") not in ("param", "function"):
        raise ValueError(f"{owner}expected cost 'param' or 'function' but got {given['cost']!r}.")
    if given.get("loss", "mean") not in ("mean", "logits"):
        raise ValueError(f"{owner}expected loss 'mean' or 'logits' but got {given['loss']!r}.")


class IBDRGuide(ParticleGuide):
    r"""Interacting particles with a diversity term and a distributionally robust step (IBDR).

    The posterior is the particle mixture of :class:`ParticleGuide`,
    ``q(θ) = (1/K) Σ_k N(θ; μ_k, σ² I)``; the locations are fitted by
    :class:`pyrobayes.infer.ibdr.IBDRFitter` (Pham et al., 2025, "Promoting Ensemble Diversity
    with Interactive Bayesian Distributional Robustness", ICML, Eq. 6 and Algorithm 1) on

    .. math::

        \min_{μ}\ \min_{λ \ge 0}\ λρ + \max_{θ'}\Big[\frac{N}{B}\sum_b\Big(\frac1K\sum_k
        \mathrm{CE}(f(x_b;θ'_k), y_b) + α\,\ell_{div}(θ'_{1:K}; x_b, y_b)\Big)
        - λ\,c(θ, θ')\Big] - \frac1K\sum_k \log p(μ_k)

    with the diversity term of Pang et al. (2019),
    ``ℓ_div = −log det(Uᵀ U + ε I_K)``, ``U``'s columns the normalised non-target probability
    vectors of the K particles. α, ρ, λ's controller, the clip, the cost and the loss's form are
    the fit's settings, :class:`pyrobayes.infer.IBDR`, passed as
    ``pb.fit(..., optim=pb.Optimization(optimizer=pb.infer.IBDR(alpha=..., rho=...)))``.

    Parameters
    ----------
    model : FineTuneModel
    num_particles, scale, init_scale
        As :class:`ParticleGuide` (K = 4, σ = 0, jitter 1e-2).
    average : {"probs", "logits"}
        As :class:`ParticleGuide`: the predictive averages probabilities (default) or, as the
        released code, logits.
    alpha, rho, lam, lam_min, lam_max, lam_lr, max_grad_norm, cost, loss, epsilon : optional
        Deprecated here: settings of the fit, not of the posterior. Pass them to the fitter as
        ``pb.fit(..., optim=pb.Optimization(optimizer=pb.infer.IBDR(alpha=..., rho=...)))``
        (:class:`pyrobayes.infer.IBDR`, which documents them); given here they still reach the
        fitter for one release, with a ``DeprecationWarning``, and are not saved with the
        posterior.

    Warns
    -----
    UserWarning
        When K > 1 particles would start identical (``init_scale=0`` and ``scale=0``): identical
        particles get identical gradients, so they would stay one network.
    """

    family = "ibdr"
    default_fitter = "ibdr"
    default_objective = "ibdr"
    #: constructor options that are the fit's, not the posterior's: accepted for one release
    #: (``DeprecationWarning``), handed to the fitter, never saved with the posterior
    fit_options: ClassVar[tuple[str, ...]] = (
        "alpha",
        "rho",
        "lam",
        "lam_min",
        "lam_max",
        "lam_lr",
        "max_grad_norm",
        "cost",
        "loss",
        "epsilon",
    )
    #: the :mod:`pyrobayes.infer` settings class that takes ``fit_options`` now
    fit_settings_class: ClassVar[str] = "IBDR"

    def __init__(
        self,
        model: Any,
        *,
        num_particles: int = 4,
        scale: float = 0.0,
        init_scale: float = 1e-2,
        average: str = "probs",
        alpha: float | None = None,
        rho: float | None = None,
        lam: float | None = None,
        lam_min: float | None = None,
        lam_max: float | None = None,
        lam_lr: float | None = None,
        max_grad_norm: float | None = None,
        cost: str | None = None,
        loss: str | None = None,
        epsilon: float | None = None,
    ) -> None:
        owner = f"{type(self).__name__}: "
        given = {
            "alpha": alpha,
            "rho": rho,
            "lam": lam,
            "lam_min": lam_min,
            "lam_max": lam_max,
            "lam_lr": lam_lr,
            "max_grad_norm": max_grad_norm,
            "cost": cost,
            "loss": loss,
            "epsilon": epsilon,
        }
        given = {k: v for k, v in given.items() if v is not None}
        _check_ibdr_settings(owner, given)
        #: fit settings passed to the constructor (deprecated): the fitter's defaults
        self.fit_settings: dict[str, Any] = given
        warn_fit_settings(owner, given, self.fit_settings_class)
        super().__init__(
            model,
            num_particles=num_particles,
            scale=scale,
            init_scale=init_scale,
            average=average,
        )
        if self.num_components > 1 and self._init_scale == 0 and self.component_scale == 0:
            warnings.warn(
                f"{owner}init_scale=0 and scale=0 start all {self.num_components} particles "
                "identical (at the model's value): a stationary point of the fit (every particle "
                "gets the same gradient, and the diversity term's is 0 there), so they stay one "
                "network. Give init_scale > 0 (default 1e-2) so the particles start distinct.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )

    def config(self) -> dict[str, Any]:
        """The posterior's constructor options (the deprecated fit settings left out)."""
        return {k: v for k, v in super().config().items() if k not in self.fit_options}
