r"""IVON posterior (Shen et al., ICML 2024): ``q(θ) = N(m, diag(1/(λ(h + δ))))`` per site.

The mean ``m`` is the optimised tensor (a Pyro param); the Hessian estimate ``h`` is a buffer that
only :class:`~pyrobayes.infer.ivon.IVONOptimizer` writes. The guide is a proper Normal, so
``pyro.infer.Predictive(model, guide=guide, num_samples=S)`` works unchanged.

Objective (SPECS 5(a)): ``E_q[lbar(θ)] + (1/λ) KL(q ‖ N(0, (λδ)⁻¹ I))``; the fitter only ever
evaluates the **per-example mean** data NLL at sampled θ (:class:`IVONLoss`), the prior and the
entropy enter through ``δ`` and the Newton-like update.
"""

from __future__ import annotations

import math
from operator import attrgetter
from typing import Any

import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.infer.autoguide.utils import deep_setattr
from pyro.nn import PyroModule, PyroParam
from torch import Tensor

from ..batch import batch_size
from ..infer.ivon import IVONOptimizer, state_dtype_for
from ..infer.objectives import split_training_batch
from .base import PosteriorGuide

__all__ = ["IVONGuide", "IVONLoss"]


class IVONLoss:
    r"""IVON's training objective: the per-example mean data NLL at ``S`` sampled θ.

    .. math:: \hat\ell = \frac{1}{S}\sum_{s=1}^S \frac1B \sum_{b=1}^B -\log p(y_b\mid x_b, θ_s),
              \qquad θ_s = m + σ ε_s

    No prior and no entropy term (SPECS 5(e): they enter through ``weight_decay`` δ and the
    update; adding them here would count the prior twice). Per-example **mean**, not the
    dataset sum of Pyro's ELBOs (SPECS §7 rule 4): ``pyrobayes.fit(...).losses`` then holds
    mean NLLs. All ``S`` samples run in one batched forward.

    Parameters
    ----------
    mc_samples : int, optional
        ``S``; defaults to the guide's ``mc_samples``.
    """

    def __init__(self, mc_samples: int | None = None) -> None:
        if mc_samples is not None and mc_samples < 1:
            raise ValueError(f"Expected mc_samples >= 1 but got {mc_samples}.")
        self.mc_samples = mc_samples

    def loss(self, model: Any, guide: Any, batch: Any) -> Tensor:
        num = self.mc_samples or getattr(guide, "mc_samples", 1)
        sampler = getattr(guide, "training_sample", None)
        values = sampler(num) if sampler is not None else guide.rsample(num)
        inputs, targets = split_training_batch(model, batch)
        observe = getattr(guide, "_observe_inputs", None)  # Kronecker IVON: the token mask
        if observe is not None:
            observe(inputs)
        params = model.batched_output(inputs, values)  # (S, B, ...)
        nll = _per_example_nll(model, params, targets, num, batch_size(inputs))
        extra = getattr(guide, "_curvature_passes", None)
        if extra is not None:
            extra(model, params, targets)
        return nll.mean()


def _per_example_nll(model: Any, params: Tensor, targets: Tensor, num: int, size: int) -> Tensor:
    """``−log p(y_b | θ_s)`` summed over any per-example trailing dims → ``(S, B)``."""
    log_lik = model.log_likelihood(params, targets)
    if log_lik.shape != (num, size):
        log_lik = log_lik.reshape(num, size, -1).sum(-1)
    return -log_lik


class IVONGuide(PosteriorGuide):
    r"""Diagonal Gaussian fitted by IVON (improved variational online Newton).

    .. math:: q(θ) = \mathcal N\big(m,\ \operatorname{diag}(1/(λ(h+δ)))\big)

    per site, with ``λ = ess`` and ``δ = weight_decay``. Fitted by :func:`pyrobayes.fit`: the
    default objective is :class:`IVONLoss` (per-example mean data NLL at sampled θ) and the
    default optimizer is :class:`~pyrobayes.infer.ivon.IVONOptimizer`, which samples
    ``θ = m + σ ε`` in the closure, estimates ``ĥ`` with the Price (reparameterization)
    estimator and applies Algorithm 1 of Shen et al. (2024) to ``(m, h)``.

    Parameters
    ----------
    model : FineTuneModel
    ess : float, optional
        λ, the effective sample size; default ``model.num_data`` (the Bayesian posterior).
    hess_init : float
        h0, the initial ``h`` (initial σ = 1/sqrt(λ(h0 + δ))). Default 1.0.
    beta1 : float
        Gradient momentum (0.9).
    beta2 : float
        Hessian EMA (0.99999).
    weight_decay : float, optional
        δ, the prior precision per unit ess. Default ``1/(ess · prior_scale²)``, i.e. the model's
        own prior ``N(0, prior_scale²)`` (ivon-opt's package default is 1e-4).
    point_weight_decay : float, optional
        δ for the model's point-estimated parameters that the IVON optimizer updates alongside
        the sites (``trainable_modules``, e.g. a classifier head); default ``weight_decay`` (as
        ivon-opt, one δ for everything). It enters their σ, ``ĥ``, ``h`` and step exactly as δ
        does for the sites, as an ivon-opt parameter group of its own. ``δ m`` pulls them
        towards 0, which suits a new head; for a *pretrained* head see ``point_prior_loc``.
    point_prior_loc : {"zero", "init"}
        μ0 of those point parameters' prior ``N(μ0, 1/(λδ))``: 0 (default, as ivon-opt) or
        their values when fitting starts (L2-SP, Li et al. 2018), so that ``δ (m − μ0)`` pulls a
        *pretrained* head towards where it started rather than towards 0. The sites' prior mean
        is 0 either way.
    mc_samples : int
        S, samples per step (1), evaluated in one batched forward.
    hess_approx : {"price", "gradsq"}
        Hessian estimator: ``ĝ (θ−m)/σ²`` (default) or ``λ ĝ²``.
    clip_radius : float, optional
        Elementwise clip of the preconditioned step (None: no clip).
    debias : bool
        Momentum bias correction (True).
    rescale_lr : bool
        Use ``α (h0 + δ)`` as the step size (True, as ivon-opt).
    lr : float, optional
        α; overrides the ``lr`` given to :func:`pyrobayes.fit` when set.
    init_loc : {"model", "zero"}
        Start ``m`` at the model's current values or at 0.

    Notes
    -----
    Weights in half precision / bfloat16 keep ``m``, ``h`` and the momentum in float32; samples
    are cast to the weight dtype. Under ``torch.distributed`` the gradient and Hessian
    statistics are averaged across processes every step.

    Examples
    --------
    >>> guide = IVONGuide(model, hess_init=0.5, mc_samples=2)          # doctest: +SKIP
    >>> pyrobayes.fit(model, guide, loader, epochs=3, lr=0.1)          # doctest: +SKIP
    """

    family = "ivon"
    is_deterministic = False

    def __init__(
        self,
        model: Any,
        *,
        ess: float | None = None,
        hess_init: float = 1.0,
        beta1: float = 0.9,
        beta2: float = 0.99999,
        weight_decay: float | None = None,
        point_weight_decay: float | None = None,
        point_prior_loc: str = "zero",
        mc_samples: int = 1,
        hess_approx: str = "price",
        clip_radius: float | None = None,
        debias: bool = True,
        rescale_lr: bool = True,
        lr: float | None = None,
        init_loc: str = "model",
        **extra: Any,
    ) -> None:
        if ess is None:
            ess = getattr(model, "num_data", None)
            if ess is None:
                raise ValueError(
                    f"{type(self).__name__} needs ess=... (usually N) or a model with num_data."
                )
        if ess <= 0:
            raise ValueError(f"Expected ess > 0 but got {ess}.")
        if weight_decay is None:
            prior_scale = getattr(model, "prior_scale", None)
            weight_decay = 1.0 / (ess * prior_scale**2) if prior_scale else 1e-4
        if point_weight_decay is None:
            point_weight_decay = weight_decay
        checks = {
            "hess_init": hess_init > 0,
            "weight_decay": weight_decay >= 0,
            "point_weight_decay": point_weight_decay >= 0,
            "mc_samples": mc_samples >= 1,
            "beta1": 0.0 <= beta1 <= 1.0,
            "beta2": 0.0 <= beta2 <= 1.0,
            "clip_radius": clip_radius is None or clip_radius > 0,
            "lr": lr is None or lr >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"Invalid {name}: {locals()[name]!r}.")
        if hess_approx not in ("price", "gradsq"):
            raise ValueError(f"Expected hess_approx 'price' or 'gradsq' but got {hess_approx!r}.")
        if point_prior_loc not in ("zero", "init"):
            raise ValueError(
                f"Expected point_prior_loc 'zero' or 'init' but got {point_prior_loc!r}."
            )
        if init_loc not in ("model", "zero"):
            raise ValueError(f"Expected init_loc 'model' or 'zero' but got {init_loc!r}.")
        self.ess = float(ess)
        self.weight_decay = float(weight_decay)
        self.mc_samples = int(mc_samples)
        self.lr = lr
        self.hyper: dict[str, Any] = {
            "ess": self.ess,
            "hess_init": float(hess_init),
            "beta1": float(beta1),
            "beta2": float(beta2),
            "weight_decay": self.weight_decay,
            "point_weight_decay": float(point_weight_decay),
            "point_prior_loc": point_prior_loc,
            "hess_approx": hess_approx,
            "clip_radius": math.inf if clip_radius is None else float(clip_radius),
            "debias": bool(debias),
            "rescale_lr": bool(rescale_lr),
        }
        self._init_loc = init_loc
        self._index: dict[str, int] = {}
        self._param_dtype: dict[str, torch.dtype] = {}
        self._noise: Tensor | None = None  # the (S, T) leaf of the last training_sample
        self._layout_cache: _Layout | None = None
        self._num_samples_drawn = 0
        self.state_dtype = torch.get_default_dtype()
        config = dict(
            ess=ess,
            hess_init=hess_init,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            point_weight_decay=point_weight_decay,
            point_prior_loc=point_prior_loc,
            mc_samples=mc_samples,
            hess_approx=hess_approx,
            clip_radius=clip_radius,
            debias=debias,
            rescale_lr=rescale_lr,
            lr=lr,
            init_loc=init_loc,
            **extra,
        )
        super().__init__(model, **config)

    # ------------------------------------------------------------------ set-up
    def _setup_site(self, site: str, init: Tensor) -> None:
        if not hasattr(self, "locs"):
            self.locs = PyroModule()
        i = len(self._index)
        self._index[site] = i
        self._param_dtype[site] = init.dtype
        self.state_dtype = state_dtype_for(init.dtype)
        loc = init.detach().clone() if self._init_loc == "model" else torch.zeros_like(init)
        loc = loc.to(self.state_dtype)
        deep_setattr(self.locs, site, PyroParam(loc, constraints.real, event_dim=loc.dim()))
        self._setup_curvature(site, i, loc)

    def _setup_curvature(self, site: str, i: int, loc: Tensor) -> None:
        self.register_buffer(f"hess_{i}", torch.full_like(loc, self.hyper["hess_init"]))

    # ------------------------------------------------------------------ accessors
    def loc_param(self, site: str) -> Tensor:
        """The optimised tensor holding ``m`` for ``site`` (state dtype)."""
        parent, _, leaf = site.rpartition(".")
        holder = self.locs.get_submodule(parent) if parent else self.locs
        # direct dict read: what getattr returns for a plain Parameter, minus PyroModule.__getattr__
        return holder._parameters[leaf + "_unconstrained"]

    def loc(self, site: str) -> Tensor:
        return attrgetter(site)(self.locs)

    def hess(self, site: str) -> Tensor:
        """IVON's ``h`` for ``site`` (a buffer)."""
        return self._buffers[f"hess_{self._index[site]}"]  # getattr minus PyroModule overhead

    def scale(self, site: str) -> Tensor:
        """``σ = 1/sqrt(λ (h + δ))``."""
        return (self.ess * (self.hess(site) + self.weight_decay)).rsqrt()

    def get_posterior(self, site: str) -> dist.Distribution:
        dtype = self._param_dtype[site]
        loc = self.loc(site)
        return dist.Normal(loc.to(dtype), self.scale(site).to(dtype)).to_event(loc.dim())

    def set_site(self, site: str, *, loc: Tensor | None = None, hess: Tensor | None = None) -> None:
        """Overwrite ``m`` and/or ``h`` at ``site`` (tests, warm starts)."""
        with torch.no_grad():
            if loc is not None:
                self.loc_param(site).copy_(loc)
            if hess is not None:
                self.hess(site).copy_(hess)

    # ------------------------------------------------------------------ fitting
    @property
    def default_objective(self) -> IVONLoss:  # type: ignore[override]
        return IVONLoss()

    def default_optimizer(self, params: Any, lr: float) -> IVONOptimizer:
        """:class:`~pyrobayes.infer.ivon.IVONOptimizer` over ``params`` (guide ``lr`` wins)."""
        return IVONOptimizer(params, self, self.lr if self.lr is not None else lr)

    def diag_step_kwargs(self) -> dict[str, Any]:
        hp = self.hyper
        return {
            k: hp[k]
            for k in (
                "hess_init",
                "beta1",
                "beta2",
                "weight_decay",
                "clip_radius",
                "debias",
                "rescale_lr",
            )
        }

    def _perturbation(self, site: str, eps: Tensor) -> Tensor:
        """``θ − m`` for standard-normal ``eps`` of the site's shape, ``(S, *shape)``."""
        return eps / (self.ess * (self.hess(site) + self.weight_decay)).sqrt()

    def _layout(self) -> _Layout:
        """Flat layout of all sites (site order), built once after set-up."""
        lay = self._layout_cache
        if lay is None:
            self._require_setup()
            lay = self._layout_cache = _Layout(self)
        return lay

    def _is_diag(self, site: str) -> bool:
        return True

    def _diag_beta2(self) -> float:
        """β2 of the diagonal Hessian EMA (sites and the optimizer's extra parameters)."""
        return self.hyper["beta2"]

    def _flat_perturbation(self, eps: Tensor) -> Tensor:
        """``θ − m`` for standard-normal ``eps`` `(S, T)` over the flat layout (all diagonal).

        Inside an optimizer step, :class:`~pyrobayes.infer.ivon.IVONOptimizer` may hand over
        ``σ = (λ(h + δ))^{-1/2}`` over all ``T`` entries (``_step_sigma``, computed once from
        its flat ``h``); otherwise σ is computed here from the ``h`` buffers.
        """
        sigma = self.__dict__.get("_step_sigma")
        if sigma is not None and sigma.shape[-1] == eps.shape[-1]:
            return eps * sigma
        hess = _flat(self._layout().hess_tensors(self))
        return eps / (self.ess * (hess + self.weight_decay)).sqrt()

    def training_sample(self, num_samples: int = 1) -> dict[str, Tensor]:
        r"""Draw ``θ_s = m + σ ε_s`` for training and remember ``θ_s − m`` for the update.

        The perturbations of all sites form one flat leaf tensor `(S, T)` that requires grad, so
        after ``backward`` its ``.grad`` holds the per-sample gradients. RNG use: one ``randn``
        over all sites (concatenated in site order, state dtype) per sample, as ivon-opt does
        for one parameter group — the same seed gives the same noise.

        Returns
        -------
        dict
            ``{site: (num_samples, *shape)}`` in the weight dtype; differentiable in ``m``.
        """
        lay = self._layout()
        locs = lay.loc_tensors()
        device = locs[0].device
        dtype = self.state_dtype
        if num_samples == 1:
            eps = torch.randn(lay.total, dtype=dtype, device=device).unsqueeze(0)
        else:
            eps = torch.stack(
                [torch.randn(lay.total, dtype=dtype, device=device) for _ in range(num_samples)]
            )
        with torch.no_grad():
            noise = self._flat_perturbation(eps)
        noise.requires_grad_(True)
        self.__dict__["_noise"] = noise
        values: dict[str, Tensor] = {}
        for site, loc, (a, b), shape, pdtype in zip(
            lay.sites, locs, lay.bounds, lay.shapes, lay.param_dtypes, strict=True
        ):
            value = loc.unsqueeze(0) + noise[:, a:b].view(num_samples, *shape)
            values[site] = value if pdtype == value.dtype else value.to(pdtype)
        self.__dict__["_num_samples_drawn"] = num_samples
        return values

    def _begin_step(self) -> None:
        self.__dict__["_noise"] = None

    def _end_step(self) -> None:
        pass

    def _flat_grads(self) -> tuple[Tensor, Tensor]:
        """Per-sample gradients ``ĝ_s`` `(S, T)` and perturbations ``θ_s − m`` of the closure."""
        noise = self._noise
        if noise is None:
            raise RuntimeError(
                f"{type(self).__name__}: the closure drew no training sample; fit it with its "
                "default objective (IVONLoss), which calls training_sample()."
            )
        num = noise.shape[0]
        if noise.grad is None:
            grads = torch.zeros_like(noise)
        else:  # the loss averages the S samples: undo the 1/S (exact, so skipped for S = 1)
            grads = noise.grad if num == 1 else noise.grad * num
        return grads.detach(), noise.detach()

    def _site_grads(self, site: str) -> tuple[Tensor, Tensor]:
        """Per-sample gradients ``ĝ_s`` and perturbations ``θ_s − m`` for one site."""
        grads, noise = self._flat_grads()
        lay = self._layout()
        j = lay.position[site]
        a, b = lay.bounds[j]
        shape = (noise.shape[0], *lay.shapes[j])
        return grads[:, a:b].view(shape), noise[:, a:b].view(shape)

    def diag_tensors(self) -> tuple[list[Tensor], list[Tensor]]:
        """The diagonal sites' mean tensors and ``h`` buffers (site order), updated in place."""
        lay = self._layout()
        return lay.diag_locs(), lay.hess_tensors(self)

    def diag_grads(self) -> tuple[Tensor, Tensor]:
        """Per-sample gradients ``ĝ_s`` and perturbations ``θ_s − m`` `(S, T_diag)` of the
        closure over the diagonal sites (flat, site order)."""
        lay = self._layout()
        grads, noise = self._flat_grads()
        if lay.diag_slice is not None:
            a, b = lay.diag_slice
            if (a, b) != (0, lay.total):
                grads, noise = grads[:, a:b], noise[:, a:b]
        elif lay.diag:
            grads = torch.cat([grads[:, a:b] for a, b in lay.diag_bounds], 1)
            noise = torch.cat([noise[:, a:b] for a, b in lay.diag_bounds], 1)
        else:
            grads, noise = grads[:, :0], noise[:, :0]
        return grads, noise

    def diag_statistics(self) -> tuple[list[Tensor], list[Tensor], Tensor, Tensor, Tensor]:
        r"""Flat closure statistics of the diagonal sites for one IVON step (site order).

        Returns ``(means, hess, h, ĝ_s, θ_s − m)``: the mean tensors and ``h`` buffers to update
        in place, ``h`` concatenated `(T,)`, and the per-sample gradients and perturbations
        `(S, T)` over the diagonal sites. Empty when there are none.
        """
        grads, noise = self.diag_grads()
        locs, hess_list = self.diag_tensors()
        if not hess_list:
            return [], [], noise.new_zeros(0), grads, noise.new_zeros(0)
        return locs, hess_list, _flat(hess_list), grads, noise

    @torch.no_grad()
    def ivon_update(self, optimizer: Any, lr: float) -> None:
        """Finish the step after :meth:`IVONOptimizer` applied the flat diagonal update.

        Every site of this guide is diagonal, so nothing is left to do but forget the noise.
        """
        self.__dict__["_noise"] = None


def _flat(tensors: list[Tensor]) -> Tensor:
    """``cat`` of the flattened tensors (a view when there is only one)."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


class _Layout:
    """Where each site lives in the flat vector, plus direct handles on its tensors.

    Handles are dictionaries and keys (``holder._parameters``, ``guide._buffers``), read at use
    time, so a replaced parameter or buffer (``load_state_dict``, ``.to``) is always seen.
    """

    def __init__(self, guide: IVONGuide) -> None:
        self.sites = list(guide.sites)
        self.position = {s: j for j, s in enumerate(self.sites)}
        self.shapes = [torch.Size(guide.sites[s]) for s in self.sites]
        self.param_dtypes = [guide._param_dtype[s] for s in self.sites]
        self.bounds: list[tuple[int, int]] = []
        offset = 0
        for shape in self.shapes:
            self.bounds.append((offset, offset + shape.numel()))
            offset += shape.numel()
        self.total = offset
        self._loc_refs = []
        for site in self.sites:
            parent, _, leaf = site.rpartition(".")
            holder = guide.locs.get_submodule(parent) if parent else guide.locs
            self._loc_refs.append((holder._parameters, leaf + "_unconstrained"))
        diag = [j for j, s in enumerate(self.sites) if guide._is_diag(s)]
        self.diag = diag
        self._diag_loc_refs = [self._loc_refs[j] for j in diag]
        self._hess_keys = [f"hess_{guide._index[self.sites[j]]}" for j in diag]
        self.diag_bounds = [self.bounds[j] for j in diag]
        contiguous = diag == list(range(diag[0], diag[-1] + 1)) if diag else False
        self.diag_slice = (self.diag_bounds[0][0], self.diag_bounds[-1][1]) if contiguous else None

    def loc_tensors(self) -> list[Tensor]:
        return [d[k] for d, k in self._loc_refs]

    def diag_locs(self) -> list[Tensor]:
        return [d[k] for d, k in self._diag_loc_refs]

    def hess_tensors(self, guide: IVONGuide) -> list[Tensor]:
        buffers = guide._buffers
        return [buffers[k] for k in self._hess_keys]
