r"""IVON's posterior: a diagonal Gaussian per site (Shen et al., 2024).

Shen et al., 2024, "Variational Learning is Effective for Large Deep Networks" (ICML) fit

.. math:: q(θ) = \mathcal N\big(m,\ \operatorname{diag}(1/(λ(h + δ)))\big)
          \ \text{ to }\ \min_q\ \mathbb E_q[\bar\ell(θ)] + \tfrac1λ \mathrm{KL}\big(q \,\|\, \mathcal N(0, (λδ)^{-1} I)\big)

with ``ℓ̄`` the per-example mean data NLL, ``λ = ess`` and ``δ = weight_decay``. This module holds
the posterior only: the means ``m`` (Pyro params), the curvature ``h`` (buffers) and the options that define q.
:class:`pyrobayes.infer.ivon.IVONFitter` fits them (``default_fitter = "ivon"``). The guide is a
proper Normal, so ``pyro.infer.Predictive(model, guide=guide, num_samples=S)`` works unchanged.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pyro.distributions as dist
import torch
from torch import Tensor

from ..batch import compute_dtype
from ..models.adapters import check_int, check_real
from ._fit_options import warn_fit_settings
from .base import SitewiseKL
from .joint import SitePacking
from .meanfield import check_site_value

__all__ = ["IVONGuide", "state_dtype_for"]


#: statistics dtype for weights of a dtype: float32 for half/bfloat16, else that dtype
state_dtype_for = compute_dtype


class IVONGuide(SitePacking, SitewiseKL):
    r"""Diagonal Gaussian fitted by IVON (improved variational online Newton).

    .. math:: q(θ) = \mathcal N\big(m,\ \operatorname{diag}(1/(λ(h+δ)))\big)

    per site, with ``λ = ess`` and ``δ = weight_decay``. :func:`pyrobayes.fit` fits it with
    :class:`~pyrobayes.infer.ivon.IVONFitter`: each step samples ``θ = m + σ ε``, estimates the
    gradient ``ĝ`` and the Hessian diagonal ``ĥ`` (Price / reparameterization estimator) and
    applies Algorithm 1 of Shen et al. (2024) to ``(m, h)``.

    Parameters
    ----------
    model : FineTuneModel
    ess : float, optional
        λ, the effective sample size; default ``model.num_data`` (the Bayesian posterior).
    hess_init : float
        h0, the initial ``h`` (initial σ = 1/sqrt(λ(h0 + δ))). Default 1.0.
    weight_decay : float, optional
        δ, the prior precision per unit ess. Default ``1/(ess · prior_scale²)``, i.e. the model's
        own prior ``N(0, prior_scale²)`` (ivon-opt's package default is 1e-4).
    point_weight_decay : float, optional
        δ for the model's point-estimated parameters that the fitter updates alongside the
        sites (``trainable_modules``, e.g. a classifier head); default ``weight_decay`` (as
        ivon-opt, one δ for everything). It enters their σ, ``ĥ``, ``h`` and step exactly as δ
        does for the sites, as an ivon-opt parameter group of its own. ``δ m`` pulls them
        towards 0, which suits a new head; for a *pretrained* head see ``point_prior_loc``.
    point_prior_loc : {"zero", "init"}
        μ0 of those point parameters' prior ``N(μ0, 1/(λδ))``: 0 (default, as ivon-opt) or
        their values when fitting starts (L2-SP, Li et al. 2018), so that ``δ (m − μ0)`` pulls a
        *pretrained* head towards where it started rather than towards 0. The sites' prior mean
        is 0 either way.
    lr, beta1, beta2, hess_approx, clip_radius, debias, rescale_lr, mc_samples : optional
        Deprecated here: settings of the fit, not of the posterior. Pass them to the fitter as
        ``pb.fit(..., optim=pb.Optimization(optimizer=pb.infer.IVON(lr=..., mc_samples=...)))``
        (:class:`pyrobayes.infer.IVON`); given here they still reach the fitter for one
        release, with a ``DeprecationWarning``, and are not saved with the posterior.
    init_loc : {"model", "zero"}
        Start ``m`` at the model's current values or at 0.

    Notes
    -----
    Weights in half precision / bfloat16 keep ``m``, ``h`` and the momentum in float32; samples
    are cast to the weight dtype. Under ``torch.distributed`` the gradient and Hessian
    statistics are averaged across processes every step.

    Examples
    --------
    >>> guide = IVONGuide(model, hess_init=0.5)                         # doctest: +SKIP
    >>> pyrobayes.fit(model, guide, loader, epochs=3, lr=0.1)          # doctest: +SKIP
    >>> ivon = pyrobayes.infer.IVON(beta2=0.9999, mc_samples=2)        # doctest: +SKIP
    >>> pyrobayes.fit(model, guide, loader, epochs=3, lr=0.1,
    ...               optim=pyrobayes.Optimization(optimizer=ivon))   # doctest: +SKIP
    """

    family = "ivon"
    default_fitter = "ivon"
    is_deterministic = False
    #: constructor options that are the fit's, not the posterior's: accepted for one release
    #: (``DeprecationWarning``), handed to the fitter, never saved with the posterior
    fit_options: ClassVar[tuple[str, ...]] = (
        "lr",
        "beta1",
        "beta2",
        "hess_approx",
        "clip_radius",
        "debias",
        "rescale_lr",
        "mc_samples",
    )
    #: the :mod:`pyrobayes.infer` settings class that takes ``fit_options`` now
    fit_settings_class: ClassVar[str] = "IVON"

    def __init__(
        self,
        model: Any,
        *,
        ess: float | None = None,
        hess_init: float = 1.0,
        beta1: float | None = None,
        beta2: float | None = None,
        weight_decay: float | None = None,
        point_weight_decay: float | None = None,
        point_prior_loc: str = "zero",
        mc_samples: int | None = None,
        hess_approx: str | None = None,
        clip_radius: float | None = None,
        debias: bool | None = None,
        rescale_lr: bool | None = None,
        lr: float | None = None,
        init_loc: str = "model",
    ) -> None:
        owner = f"{type(self).__name__}: "
        if ess is None:
            ess = getattr(model, "num_data", None)
            if ess is None:
                raise ValueError(
                    f"{owner}pass ess=... (the effective sample size, usually N, the training-set "
                    "size) or build the model with FineTuneModel(num_data=N)."
                )
        ess = check_real("ess", ess, gt=0, owner=owner)
        if weight_decay is None:
            prior_scale = getattr(model, "prior_scale", None)
            weight_decay = 1.0 / (ess * prior_scale**2) if prior_scale else 1e-4
        weight_decay = check_real("weight_decay", weight_decay, ge=0, owner=owner)
        if point_weight_decay is None:
            point_weight_decay = weight_decay
        point_weight_decay = check_real("point_weight_decay", point_weight_decay, ge=0, owner=owner)
        hess_init = check_real("hess_init", hess_init, gt=0, owner=owner)
        if point_prior_loc not in ("zero", "init"):
            raise ValueError(
                f"Expected point_prior_loc 'zero' or 'init' but got {point_prior_loc!r}."
            )
        if init_loc not in ("model", "zero"):
            raise ValueError(f"Expected init_loc 'model' or 'zero' but got {init_loc!r}.")
        given = {
            "lr": lr,
            "beta1": beta1,
            "beta2": beta2,
            "hess_approx": hess_approx,
            "clip_radius": clip_radius,
            "debias": debias,
            "rescale_lr": rescale_lr,
            "mc_samples": mc_samples,
        }
        self._legacy_fit_options(owner, given)
        self.ess = float(ess)
        self.weight_decay = float(weight_decay)
        #: the posterior's constants (the fitter adds its own settings to them)
        self.hyper: dict[str, Any] = {
            "ess": self.ess,
            "hess_init": float(hess_init),
            "weight_decay": self.weight_decay,
            "point_weight_decay": float(point_weight_decay),
            "point_prior_loc": point_prior_loc,
        }
        self._init_loc = init_loc
        self._index: dict[str, int] = {}
        #: the weight dtype per site (samples are cast to it; m, h stay in ``state_dtype``)
        self.param_dtype: dict[str, torch.dtype] = {}
        self.state_dtype = torch.get_default_dtype()
        super().__init__(model)

    def _legacy_fit_options(self, owner: str, given: dict[str, Any]) -> None:
        """Keep the fit settings passed to the constructor (deprecated) for the fitter, checked
        here so that a bad value is refused by name before the warning."""
        given = {k: v for k, v in given.items() if v is not None}
        given.update(self.__dict__.pop("_more_fit_settings", {}))  # a subclass' own
        if "beta1" in given:
            check_real("beta1", given["beta1"], ge=0, lt=1, owner=owner)
        if "beta2" in given:
            check_real("beta2", given["beta2"], ge=0, lt=1, owner=owner)
        if "clip_radius" in given:
            check_real("clip_radius", given["clip_radius"], gt=0, owner=owner)
        if "lr" in given:
            check_real("lr", given["lr"], ge=0, owner=owner)
        if "mc_samples" in given:
            given["mc_samples"] = check_int("mc_samples", given["mc_samples"], ge=1, owner=owner)
        if given.get("hess_approx", "price") not in ("price", "gradsq"):
            raise ValueError(
                f"Expected hess_approx 'price' or 'gradsq' but got {given['hess_approx']!r}."
            )
        #: fit settings passed to the constructor (deprecated): the fitter's defaults
        self.fit_settings: dict[str, Any] = given
        warn_fit_settings(owner, given, self.fit_settings_class)

    def config(self) -> dict[str, Any]:
        """The posterior's constructor options (the deprecated fit settings left out)."""
        return {k: v for k, v in super().config().items() if k not in self.fit_options}

    # ------------------------------------------------------------------ set-up
    def _setup_site(self, site: str, init: Tensor) -> None:
        self._index[site] = len(self._index)
        self.param_dtype[site] = init.dtype
        self.state_dtype = state_dtype_for(init.dtype)
        loc = init.detach().clone() if self._init_loc == "model" else torch.zeros_like(init)
        loc = loc.to(self.state_dtype)
        self._add_param("locs", site, loc)
        self._setup_curvature(site, loc)

    def _setup_curvature(self, site: str, loc: Tensor) -> None:
        self.register_buffer(
            f"hess_{self._index[site]}", torch.full_like(loc, self.hyper["hess_init"])
        )

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self.__dict__["_handles"] = None  # .to(device) may replace the tensors
        return super()._apply(fn, *args, **kwargs)

    # ------------------------------------------------------------------ the posterior
    def hess(self, site: str) -> Tensor:
        """IVON's ``h`` at a diagonal ``site`` (a buffer the fitter updates in place)."""
        return self._buffers[f"hess_{self._index[site]}"]  # type: ignore[return-value]

    def scale(self, site: str) -> Tensor:
        """``σ = 1/sqrt(λ (h + δ))``."""
        return (self.ess * (self.hess(site) + self.weight_decay)).rsqrt()

    def get_posterior(self, site: str) -> dist.TorchDistribution:
        dtype = self.param_dtype[site]
        loc = self.loc(site)
        return dist.Normal(loc.to(dtype), self.scale(site).to(dtype)).to_event(loc.dim())

    def set_site(self, site: str, *, loc: Tensor | None = None, hess: Tensor | None = None) -> None:
        """Overwrite ``m`` and/or ``h`` at ``site`` (tests, warm starts).

        Raises
        ------
        ValueError
            When a value is not of the site's shape (or a scalar), is not finite, or ``h``
            has ``h + δ <= 0`` (σ = (λ(h + δ))^{-1/2} undefined); the guide is left as it was.
        """
        owner = f"{type(self).__name__}.set_site"
        with torch.no_grad():
            if loc is not None:
                loc = check_site_value(owner, site, "loc", loc, self.loc_param(site))
            if hess is not None:
                hess = check_site_value(owner, site, "hess", hess, self.hess(site))
                if not bool((hess + self.weight_decay).gt(0).all()):
                    raise ValueError(
                        f"{owner}: hess at site {site!r} must have h + weight_decay > 0 "
                        f"(weight_decay = {self.weight_decay:g}), so that σ = "
                        f"(ess·(h + weight_decay))^(-1/2) is finite; got a minimum h of "
                        f"{float(hess.min()):g}."
                    )
                self.hess(site).copy_(hess)
            if loc is not None:
                self.loc_param(site).copy_(loc)

    def is_kron(self, site: str) -> bool:
        """Whether ``site`` has a Kronecker-factored curvature (never, here)."""
        return False

    def tensors(self) -> tuple[list[Tensor], list[Tensor | None]]:
        """The means ``m`` and the ``h`` buffers (``None`` at a Kronecker site) in site order.

        Read through cached handles (the fitter reads them every step and updates them in place).
        """
        handles = self.__dict__.get("_handles")
        if handles is None:
            self.require_setup()
            handles = self.__dict__["_handles"] = (
                [self.loc_param(s) for s in self.sites],
                [None if self.is_kron(s) else self.hess(s) for s in self.sites],
            )
        return handles

    def perturbation(self, eps: Tensor) -> Tensor:
        r"""``θ − m`` for standard-normal ``eps`` `(S, T)` over all sites laid flat in site order.

        ``σ ⊙ ε`` with ``σ = (λ(h + δ))^{-1/2}``; a draw of ``q`` is ``m + perturbation(ε)``.
        """
        return eps * self.pack({s: self.scale(s) for s in self.sites})
