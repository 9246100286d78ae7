r"""Mean-field Gaussian posterior: ``q(θ) = Π_i N(θ_i; μ_i, σ_i²)``."""

from __future__ import annotations

import math
from operator import attrgetter
from typing import Any, ClassVar

import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from torch import Tensor
from torch.distributions import transform_to

from ..batch import compute_dtype
from ..models.adapters import check_real
from ._fit_options import warn_fit_settings
from .base import SitewiseKL

__all__ = ["MeanFieldGuide"]

#: the ``prior`` options: the model's own, or chosen by the ELBO per site or for all sites
_PRIORS = ("model", "empirical", "empirical-shared")


class MeanFieldGuide(SitewiseKL):
    r"""Fully factorised Gaussian over every latent site.

    .. math:: q(θ) = \prod_i \mathcal N(θ_i;\ μ_i,\ σ_i^2),\qquad σ_i = \mathrm{softplus}(ρ_i)

    Fitted by default with the reparameterized ELBO (dataset-sum convention, analytic KL to the
    Gaussian prior): ``L = −(N/B) Σ_b E_q log p(y_b|θ) + KL(q‖p)``.

    Parameters
    ----------
    model : FineTuneModel or Pyro model
    init_scale : float
        Initial σ of every coordinate (default 1e-2).
    init_loc : {"model", "zero"}
        Start μ at the model's current values (LoRA-XS cores ≈ 0, LoRA's A at its init) or at 0.
    prior : {"model", "empirical", "empirical-shared"}
        The prior the KL is taken to. ``"model"`` (default): the model's own ``N(m, s_p²)``.
        ``"empirical"``: empirical Bayes, one prior scale per site chosen by the ELBO itself
        (type-II maximum likelihood inside VI, as Wu et al., 2019, *Deterministic Variational
        Inference for Robust Bayesian Neural Networks*, do per layer): the KL is its
        minimum over ``s``, reached at ``ŝ² = (Σσ² + Σ(μ−m)²)/n`` (n, the site's size),

        .. math:: \mathrm{KL}_{\mathrm{EB}} = \tfrac n2 \log ŝ^2 − \textstyle\sum_i \log σ_i,

        so the prior follows each site's own magnitude. ``"empirical-shared"``: one such scale
        for all sites together (n, Σ over every site). :meth:`empirical_prior_scale` reports
        ŝ. For identified parameters (LoRA-XS cores, heads); on LoRA factor pairs it shrinks
        the random ``A`` (no data gradient while ``B = 0``) and the adapter with it.
    scale_lr : float, optional
        Deprecated here: the scales' learning-rate factor is a setting of the fit, not of the
        posterior. Pass it to the fitter as ``pb.fit(..., optim=pb.Optimization(
        optimizer=pb.infer.MeanField(scale_lr=10.0)))``
        (:class:`pyrobayes.infer.meanfield.MeanField`, which documents it); given here it still
        reaches the fitter for one release, with a ``DeprecationWarning``, and is not saved
        with the posterior.

    Examples
    --------
    >>> guide = MeanFieldGuide(model, init_scale=0.01)              # doctest: +SKIP
    >>> result = pyrobayes.fit(model, guide, loader, epochs=3)      # doctest: +SKIP
    """

    family = "meanfield"
    default_objective = "elbo"
    scale_constraint = constraints.softplus_positive
    #: constructor options that are the fit's, not the posterior's: accepted for one release
    #: (``DeprecationWarning``), handed to the fitter, never saved with the posterior
    fit_options: ClassVar[tuple[str, ...]] = ("scale_lr",)
    #: the :mod:`pyrobayes.infer` settings class that takes ``fit_options`` now
    fit_settings_class: ClassVar[str] = "MeanField"

    def __init__(
        self,
        model: Any,
        *,
        init_scale: float = 1e-2,
        init_loc: str = "model",
        prior: str = "model",
        scale_lr: float | None = None,
    ) -> None:
        owner = f"{type(self).__name__}: "
        init_scale = check_real("init_scale", init_scale, gt=0, owner=owner)
        given: dict[str, Any] = {}
        if scale_lr is not None:  # checked by name before the warning
            given["scale_lr"] = check_real("scale_lr", scale_lr, gt=0, owner=owner)
        #: fit settings passed to the constructor (deprecated): the fitter's defaults
        self.fit_settings: dict[str, Any] = given
        warn_fit_settings(owner, given, self.fit_settings_class)
        if init_loc not in ("model", "zero"):
            raise ValueError(f"Expected init_loc 'model' or 'zero' but got {init_loc!r}.")
        if prior not in _PRIORS:
            raise ValueError(
                f"{owner}expected prior 'model' (the model's own prior), 'empirical' (one prior "
                "scale per site chosen by the ELBO) or 'empirical-shared' (one for all sites) "
                f"but got {prior!r}."
            )
        if prior != "model" and type(self).get_posterior is not MeanFieldGuide.get_posterior:
            raise ValueError(
                f"{owner}prior={prior!r} has its KL in closed form for the plain Normal q only; "
                "this subclass overrides get_posterior, so use prior='model'."
            )
        self._prior = prior
        self._init_scale = float(init_scale)
        self._init_loc = init_loc
        super().__init__(model)

    @property
    def prior(self) -> str:
        """The prior of the KL: ``"model"``, ``"empirical"`` or ``"empirical-shared"``."""
        return self._prior

    def _setup_site(self, site: str, init: Tensor) -> None:
        # a half-precision site keeps q's parameters in float32 (the network runs the draws in
        # its dtype): Adam moves softplus⁻¹(σ) ≈ −4.6 by about lr a step, below bfloat16's
        # spacing of 0.031 there, so σ would never move
        init = init.detach().to(compute_dtype(init.dtype))
        tiny = torch.finfo(init.dtype).tiny
        if self._init_scale < tiny:  # σ = 0 or subnormal: the KL's gradient −1/σ overflows
            raise ValueError(
                f"{type(self).__name__}: init_scale={self._init_scale:g} is below the smallest "
                f"normal {str(init.dtype).removeprefix('torch.')} number ({tiny:.3g}) that site {site!r}'s scales are kept "
                "in, so σ starts at 0 or subnormal and the KL's gradient −1/σ is infinite at "
                f"the first step; pass init_scale >= {tiny:.3g} (1e-2 is the default)."
            )
        loc = init.clone() if self._init_loc == "model" else init.new_zeros(init.shape)
        self._add_param("locs", site, loc)
        scale = init.new_full(init.shape, self._init_scale)
        self._add_param("scales", site, scale, self.scale_constraint)

    def config(self) -> dict[str, Any]:
        """The posterior's constructor options (the deprecated fit settings left out)."""
        return {k: v for k, v in super().config().items() if k not in self.fit_options}

    def set_site(
        self, site: str, *, loc: Tensor | None = None, scale: Tensor | None = None
    ) -> None:
        """Overwrite q's parameters at ``site`` (post-hoc fitters and tests).

        Raises
        ------
        ValueError
            When a value is not of the site's shape (or a scalar), is not finite, or a scale
            is not > 0 where it is kept (the guide is left as it was).
        """
        owner = f"{type(self).__name__}.set_site"
        with torch.no_grad():
            target = self.loc_param(site)
            if loc is not None:
                loc = check_site_value(owner, site, "loc", loc, target)
            if scale is not None:
                scale = check_site_value(owner, site, "scale", scale, target)
                raw = transform_to(self.scale_constraint).inv(scale)
                if not bool(self._scale_transform()(raw.to(target.dtype)).gt(0).all()):
                    raise ValueError(
                        f"{owner}: scale at site {site!r} must be > 0 (and not underflow to 0 "
                        f"in {target.dtype}); got a minimum of {float(scale.min()):g}."
                    )
                self._raw_param("scales", site).copy_(raw)
            if loc is not None:
                target.copy_(loc)

    def scale(self, site: str) -> Tensor:
        return attrgetter(site)(self.scales)

    def optimizer_groups(
        self, params: list[Tensor], lr: float, scale_lr: float = 1.0
    ) -> list[dict[str, Any]]:
        """Parameter groups for the fitter's default optimizer: the scales at ``scale_lr · lr``
        (``scale_lr``: the fit's, :class:`pyrobayes.infer.meanfield.MeanField`), every other
        parameter (locations, point-estimated weights) at ``lr``."""
        if scale_lr == 1.0:  # one group: plain Adam (and its state layout)
            return [{"params": list(params)}]
        scale_ids = {id(self._raw_param("scales", site)) for site in self.sites}
        scales = [p for p in params if id(p) in scale_ids]
        rest = [p for p in params if id(p) not in scale_ids]
        groups: list[dict[str, Any]] = [{"params": rest}] if rest else []
        if scales:
            groups.append({"params": scales, "lr": lr * scale_lr})
        return groups

    def _raw_params(self) -> dict[str, tuple[Tensor, Tensor]]:
        """``{site: (loc, unconstrained scale)}``, the module's own tensors (no Pyro lookups)."""
        cache = self.__dict__.get("_raw_cache")
        if cache is None:
            cache = {
                site: (self.loc_param(site), self._raw_param("scales", site)) for site in self.sites
            }
            self.__dict__["_raw_cache"] = cache
        return cache

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self.__dict__["_raw_cache"] = None  # .to(device) may replace the parameter objects
        return super()._apply(fn, *args, **kwargs)

    def _loc_scale(self, site: str) -> tuple[Tensor, Tensor]:
        # what loc(site) / scale(site) return outside a Pyro context, minus PyroModule.__getattr__
        loc, raw_scale = self._raw_params()[site]
        return loc, self._scale_transform()(raw_scale)

    def _scale_transform(self) -> Any:
        transform = self.__dict__.get("_scale_transform_cache")
        if transform is None:
            transform = transform_to(self.scale_constraint)
            self.__dict__["_scale_transform_cache"] = transform
        return transform

    def get_posterior(self, site: str) -> dist.TorchDistribution:
        loc = self.loc(site)
        return dist.Normal(loc, self.scale(site)).to_event(loc.dim())

    # Hot path of the ELBO: the same tensors and RNG draws as going through ``get_posterior`` /
    # ``kl_divergence`` (bit-identical), without building distributions each step.
    def _plain_normal(self) -> bool:
        return type(self).get_posterior is MeanFieldGuide.get_posterior

    def rsample(self, num_samples: int = 1) -> dict[str, Tensor]:
        """``θ_s = μ + σ ε_s``, ``ε_s ~ N(0, I)``: what ``Normal(μ, σ).rsample((S,))`` draws."""
        if not self._plain_normal():
            return super().rsample(num_samples)
        self.require_setup()
        out = {}
        for site in self.sites:
            loc, scale = self._loc_scale(site)
            out[site] = _draw(loc, scale, num_samples)
        return out

    def kl_to_prior(self, model: Any) -> Tensor:
        r"""``Σ ½(σ²/s² + (μ−m)²/s² − 1 − log σ²/s²)`` against a Normal prior ``N(m, s²)``.

        The prior's ``(m, s)`` come from ``model.prior_loc_scale(site)`` when the model offers it
        (no distribution objects on the hot path); other priors (or an overridden
        ``get_posterior``) go through ``kl_divergence``.
        """
        if self._generic_kl(model):
            return super().kl_to_prior(model)
        self.require_setup()
        return self._closed_form(model, None)[1]

    def rsample_with_kl(self, num_samples: int, model: Any) -> tuple[dict[str, Tensor], Tensor]:
        """``(rsample(num_samples), kl_to_prior(model))`` sharing one scale transform per site.

        The same draws and values as the two calls (the ELBO's hot path on small networks).
        """
        if self._generic_kl(model):
            kl = self.kl_to_prior(model)  # first: it may raise NotImplementedError
            return self.rsample(num_samples), kl
        self.require_setup()
        draws, kl = self._closed_form(model, num_samples)
        if draws is None:  # pragma: no cover - _closed_form draws whenever num_samples is given
            raise RuntimeError(f"{type(self).__name__}: no draws were made; please report.")
        return draws, kl

    def _generic_kl(self, model: Any) -> bool:
        """Whether the KL goes through ``kl_divergence`` against ``model.site_prior`` (the
        model's prior, and a subclass's q or a prior without ``prior_loc_scale``) rather than
        the closed form (always, for an empirical prior)."""
        return self._prior == "model" and (
            not self._plain_normal() or getattr(model, "prior_loc_scale", None) is None
        )

    def empirical_prior_scale(self, site: str | None = None, model: Any = None) -> Tensor:
        r"""``ŝ = sqrt((Σσ² + Σ(μ−m)²)/n)``, the prior scale that minimises the KL: over ``site``,
        or over every site together when ``site`` is None (``prior="empirical-shared"``'s);
        ``m`` is ``model``'s prior location, else 0."""
        self.require_setup()
        quad, count = None, 0
        for name in self.sites if site is None else [site]:
            loc, scale = self._loc_scale(name)
            q = _second_moment(loc, scale, _prior_loc(model, name))
            quad, count = (q if quad is None else quad + q), count + loc.numel()
        if quad is None:
            raise ValueError(f"{type(self).__name__}: the guide has no sites.")
        return (quad / count).sqrt().detach()

    def _closed_form(
        self, model: Any, num_samples: int | None
    ) -> tuple[dict[str, Tensor] | None, Tensor]:
        # per site: (Σσ² + Σ(μ−m)²)/(2s²) − Σ log σ + n (log s − ½); sums first, scalars last.
        # prior="empirical": s² = (Σσ² + Σ(μ−m)²)/n, its minimiser: n/2 log s² − Σ log σ;
        # "empirical-shared": the same with the sums and n over all sites.
        draws: dict[str, Tensor] | None = None if num_samples is None else {}
        total, const = None, 0.0
        shared_quad, shared_count = None, 0
        for site in self.sites:
            loc, scale = self._loc_scale(site)
            if draws is not None and num_samples is not None:
                draws[site] = _draw(loc, scale, num_samples)
            if self._prior == "model":
                prior_loc, prior_scale = model.prior_loc_scale(site)
                quad = _second_moment(loc, scale, prior_loc)
                kl = quad * (0.5 / prior_scale**2) - scale.log().sum()
                const += loc.numel() * (math.log(prior_scale) - 0.5)
            else:
                quad = _second_moment(loc, scale, _prior_loc(model, site))
                kl = -scale.log().sum()
                if self._prior == "empirical":
                    kl = kl + (quad / loc.numel()).log() * (0.5 * loc.numel())
                else:
                    shared_quad = quad if shared_quad is None else shared_quad + quad
                    shared_count += loc.numel()
            total = kl if total is None else total + kl
        if total is None:
            raise ValueError(
                f"{type(self).__name__}: the model has no latent sites, so KL(q||p) is empty; "
                "build FineTuneModel with an adapter or latent_modules."
            )
        if shared_quad is not None:
            total = total + (shared_quad / shared_count).log() * (0.5 * shared_count)
        return draws, total + const


def check_site_value(owner: str, site: str, name: str, value: Any, like: Tensor) -> Tensor:
    """``value`` as a finite tensor of ``like``'s shape (a scalar is broadcast), for a setter.

    Parameters
    ----------
    owner : str
        The method, e.g. ``"MeanFieldGuide.set_site"``, that messages start with.
    site, name : str
        The site and the argument (``"loc"``, ``"scale"``, ``"hess"``), named in the messages.
    value : Tensor or number
        What the caller passed.
    like : Tensor
        The site's tensor it will be copied into.

    Raises
    ------
    ValueError
        When ``value`` has another shape (``copy_`` would broadcast a row or column over the
        site silently) or a non-finite entry.
    """
    tensor = torch.as_tensor(value, device=like.device)
    if tensor.dim() and tuple(tensor.shape) != tuple(like.shape):
        raise ValueError(
            f"{owner}: {name} at site {site!r} must have the site's shape {tuple(like.shape)} "
            f"(or be a scalar); got {tuple(tensor.shape)}, which would be broadcast over it."
        )
    if not bool(tensor.isfinite().all()):
        raise ValueError(f"{owner}: {name} at site {site!r} has non-finite entries.")
    return tensor.to(like.dtype).expand(like.shape)


def _second_moment(loc: Tensor, scale: Tensor, prior_loc: float) -> Tensor:
    """``Σσ² + Σ(μ−m)²`` of one site."""
    diff = loc if prior_loc == 0 else loc - prior_loc
    return scale.square().sum() + diff.square().sum()


def _prior_loc(model: Any, site: str) -> float:
    """The prior's location at ``site``: ``model.prior_loc_scale(site)[0]``, else 0."""
    get = getattr(model, "prior_loc_scale", None)
    return 0.0 if get is None else float(get(site)[0])


def _draw(loc: Tensor, scale: Tensor, num_samples: int) -> Tensor:
    """``μ + σ ε``, ``ε ~ N(0, I)`` of shape ``(S, *loc.shape)``: the draws of ``Normal.rsample``."""
    eps = torch.empty((num_samples, *loc.shape), dtype=loc.dtype, device=loc.device)
    return loc + eps.normal_() * scale
