r"""Post-hoc Laplace posterior over the latent sites (L-LoRA-XS when the sites are cores).

.. math:: q(θ) = \mathcal N\big(θ_{\rm MAP},\ (H_{\rm GGN} + τ I)^{-1}\big)

``H_GGN`` is the generalized Gauss–Newton of the summed negative log-likelihood with respect to
the sites of ``subset`` only (point parameters such as a point head, and the other sites, fixed at
their MAP values), diagonal (``DIAG``) or Kronecker-factored per site (``KRON``: for a LoRA-XS core
``R`` the factors are ``r×r``; a latent ``Linear`` weight gets ``G ⊗ A`` and its bias the dense
``G``, as laplace-torch's default backend, Martens & Grosse 2015). It is computed by laplace-torch;
``τ`` is a prior precision chosen by the Laplace marginal likelihood over a bounded range, one
scalar or one per site (``prior_structure="layerwise"``), either post hoc at the trained MAP
(``prior_optimization="evidence"``) or alternating with refits of the MAP (``"alternate"``,
MacKay 1992).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import pyro.distributions as dist
import torch
from torch import Tensor

from ..batch import compute_dtype
from ..calibration import drop_temperature
from ..distributions import KronEigenNormal
from ..models.adapters import check_int, check_real
from ._fit_options import warn_fit_settings
from .base import PosteriorGuide
from .joint import SitePacking

logger = logging.getLogger(__name__)

__all__ = ["LaplaceGuide", "PRED_TYPES", "PRIOR_STRUCTURES"]

#: The predictives of a Laplace posterior: linearised (Monte Carlo / exact Gaussian), probit, network.
PRED_TYPES = ("glm", "probit", "nn")
#: One prior precision for every latent site, or one per site (laplace-torch's names).
PRIOR_STRUCTURES = ("scalar", "layerwise")

_ALTERNATE_LAYERWISE = (
    "LaplaceGuide: prior_structure='layerwise' chooses one τ per site post hoc; the alternating "
    "evidence iteration (prior_optimization='alternate') refits the MAP under one τ. Use "
    "prior_optimization='evidence' with it, or prior_structure='scalar'."
)


def _check_fit_settings(owner: str, given: dict[str, Any], prior_precision: Any) -> None:
    """Refuse a bad deprecated fit setting of :class:`LaplaceGuide` by name (before the
    warning); a list keeps ``log_prior_bounds`` JSON-able."""
    if "log_prior_bounds" in given:
        bounds = given["log_prior_bounds"]
        if isinstance(bounds, str) or len(bounds) != 2:
            raise ValueError(f"{owner}log_prior_bounds must be (lo, hi); got {bounds!r}.")
        lo = check_real("log_prior_bounds[0]", bounds[0], owner=owner)
        hi = check_real("log_prior_bounds[1]", bounds[1], owner=owner)
        if not lo < hi:
            raise ValueError(f"Expected log_prior_bounds (lo, hi) with lo < hi, got {(lo, hi)}.")
        given["log_prior_bounds"] = [lo, hi]
    mode = given.get("prior_optimization", "evidence")
    if mode not in ("evidence", "alternate"):
        raise ValueError(f"Expected prior_optimization 'evidence' or 'alternate' but got {mode!r}.")
    if mode == "alternate" and prior_precision != "marglik":
        raise ValueError(
            "prior_optimization='alternate' tunes τ by the marginal likelihood; it needs "
            f"prior_precision='marglik', not {prior_precision!r}."
        )
    for name in ("alternate_tol", "alternate_map_tol", "alternate_lr"):
        if name in given:
            given[name] = check_real(name, given[name], gt=0, owner=owner)
    for name in ("alternate_max_iter", "alternate_epochs"):
        if name in given:
            given[name] = check_int(name, given[name], ge=1, owner=owner)


class LaplaceGuide(SitePacking, PosteriorGuide):
    r"""Laplace approximation at the MAP (L-LoRA-XS over LoRA-XS cores).

    .. math::

        q(θ) = \prod_{\text{sites } l} \mathcal N\big(θ_{l,\rm MAP},\ (H_l + τ_l I)^{-1}\big),\qquad
        H_l \approx \sum_i J_{il}^\top Λ_i J_{il}

    (block-diagonal across sites; ``τ_l = τ`` for every site unless ``prior_structure=
    "layerwise"``). Fitted by :class:`~pyrobayes.infer.laplace.LaplaceFitter`
    (what ``pyrobayes.fit(model, guide, data, epochs=E)`` uses): it first optimises the MAP
    objective ``−(N/B) Σ_b log p(y_b|θ) − log p(θ)`` over the guide's point ``θ`` (and the head),
    with the model's prior ``N(0, s_p² I)``, i.e. ``τ₀ = 1/s_p²``, then fits ``H`` over ``data``
    and picks ``τ`` (:func:`pyrobayes.infer.laplace.fit_laplace`). ``structure="diag"`` gives
    ``Normal(θ_MAP, (h + τ)^{-1/2})``; ``"kron"`` gives a
    :class:`~pyrobayes.distributions.KronEigenNormal` per site with precision
    ``(Q_G ⊗ Q_A) diag(γ aᵀ + τ) (Q_G ⊗ Q_A)ᵀ``.

    Predictive (``pred_type``, what :func:`pyrobayes.predict` returns; laplace-torch's default,
    Immer et al. 2021): the network linearised at the MAP,
    ``f_lin(x; θ) = f(x; θ_MAP) + J(x)(θ − θ_MAP)`` (:mod:`pyrobayes.linearized`). ``"glm"``
    (default): classification by Monte Carlo over ``softmax(f_lin(x; θ_s))`` with ``θ_s ~ q``;
    regression by the exact Gaussian ``N(f(x; θ_MAP), J Σ Jᵀ + σ²)``. The Monte Carlo uses
    ``link_samples`` draws (default 100, laplace-torch's ``n_samples``), not the network draws S
    of :func:`pyrobayes.predict`: once ``J`` is formed a draw costs one ``J (θ_s − θ_MAP)``
    product, and few draws bias the NLL upwards (``−log p̄`` of an S-draw average overestimates
    ``−log E p`` by about ``Var(p)/(2 S p̄²)``; on a MiniLM LoRA task S = 6 gave NLL .534
    against .485 with 100 draws and .484 with probit, MAP .498). ``"probit"``:
    classification by ``softmax(f / sqrt(1 + π/8 · diag(J Σ Jᵀ)))`` (MacKay 1992). ``"nn"``:
    the network sampled at draws of q (overdispersed on regression, see Immer et al. 2021).

    With ``prior_precision="marglik"``, ``τ`` maximises a Laplace log marginal likelihood
    (MacKay 1992), by default with the MAP ``θ*`` read as the log-likelihood's mode and the
    prior integrated exactly against its quadratic (``λ_i``, ``θ*_i`` in the curvature's
    eigenbasis; ``pb.infer.Laplace(evidence="likelihood_mode")``)

    .. math::

        \log p(D\mid τ) \approx \log p(D\mid θ^*)
        - \tfrac12 \sum_i \Big[θ^{*2}_i \frac{λ_i τ}{λ_i+τ} + \log\big(1 + λ_i/τ\big)\Big],

    or (``evidence="posterior_mode"``) laplace-torch's, ``θ*`` read as the posterior's mode
    (Immer et al. 2021), ``log p(D|θ*) − τ/2 ‖θ*‖² − ½ log det(H + τ I) + d/2 log τ``. It is
    searched in one of three ways (the fit's ``prior_optimization``,
    :class:`pyrobayes.infer.Laplace`, which documents each):

    - ``"evidence"`` (default): post hoc at the MAP; ``θ*`` and ``H`` stay at the MAP trained
      under the model's prior ``τ₀ = 1/s_p²`` and only ``τ`` moves (when ``τ ≠ τ₀`` the mean is
      not the MAP under the prior the covariance uses).
    - ``"alternate"`` (MacKay's evidence iteration, with ``evidence="posterior_mode"``): refit
      the MAP at the current τ, refit ``H`` at it, re-maximise τ, until ``log τ`` moves less than
      ``alternate_tol``; mean and covariance then belong to one prior. Costs up to
      ``alternate_max_iter × alternate_epochs`` more epochs, and the refits move the MAP away
      from a best epoch that ``pyrobayes.fit(validation=pb.Validation(...))`` selected.
    - ``"validation"``: the evidence's τ, then the multiple of it of least NLL on the fit's
      held-out data (laplace-torch's grid search,
      :func:`pyrobayes.infer.select_prior_precision`).

    Parameters
    ----------
    model : FineTuneModel
    structure : {"kron", "diag"}
    prior_precision : "marglik", "model" or float
        τ: tuned by the Laplace marginal likelihood (searched as the fit's settings say,
        :class:`pyrobayes.infer.Laplace`), the model's ``1/s_p²``, or fixed.
    prior_optimization, log_prior_bounds, alternate_tol, alternate_max_iter, alternate_epochs, \
alternate_map_tol, alternate_lr : optional
        Deprecated here: how τ is searched is a setting of the fit, not of the posterior. Pass
        them to the fitter as ``pb.fit(..., optim=pb.Optimization(optimizer=pb.infer.Laplace(
        prior_optimization="alternate", ...)))`` (:class:`pyrobayes.infer.Laplace`, which
        documents them); given here they still reach the fitter for one release, with a
        ``DeprecationWarning``, and are not saved with the posterior.
    temperature : float
        T in ``H/T`` (1: the Bayesian posterior).
    pred_type : {"glm", "probit", "nn"}
        The predictive :func:`pyrobayes.predict` evaluates (see above); may be changed after
        fitting (``guide.pred_type = "nn"``). Changing it on a calibrated guide removes the
        temperature, which was fitted for the old predictive, with a warning: call
        :func:`pyrobayes.calibrate` again.
    prior_structure : {"scalar", "layerwise"}
        One ``τ`` for every latent site (default), or one ``τ_l`` per site (laplace-torch's
        ``prior_structure="layerwise"``; each weight and bias its own), each maximising its
        site's term of the evidence, which is a sum over sites for a block-diagonal ``H``.
        Use it when sites of different kinds are latent together (adapter cores and a head made
        latent): one τ is then set by the many adapter coordinates and leaves the head with
        too little spread (measured on MiniLM tasks: τ ≈ 30–70 jointly against 5–10 for the
        head alone). Only ``prior_precision="marglik"`` chooses per-site values; ``"model"``
        or a float give every site the same τ. ``guide.prior_precision`` is then the
        geometric mean of the ``τ_l`` and :meth:`site_prior_precision` gives each.
    link_samples : int or None
        Draws ``θ_s ~ q`` of the ``"glm"`` classification Monte Carlo (default 100); ``None``
        uses the ``num_samples`` passed to :func:`pyrobayes.predict`. Memory: ``link_samples ×
        d`` numbers for the draws and ``link_samples × N × K`` log-probabilities. May be changed
        after fitting.
    subset : {"all", "adapter", "last_layer"} or list of str
        The sites with a Gaussian posterior (laplace-torch's ``subset_of_weights``); the others
        are held at their MAP (a point mass) by every predictive. ``"all"`` (default): every
        latent site; ``"adapter"``: the adapter's (LoRA-XS cores, LoRA factors); ``"last_layer"``:
        the weight and bias of the last whole layer made latent by ``FineTuneModel(...,
        latent_modules=[head])`` (laplace-torch's last-layer Laplace when the head is that layer);
        or the site names. Make the head latent with ``latent_modules=["<head>"]`` and
        ``trainable_modules=[]``: its weight and bias are then sites (trained as part of the MAP
        and, in ``"kron"``, a Kronecker block ``G ⊗ A`` for the weight and the dense factor ``G``
        for the bias, as laplace-torch's default backend).

    Examples
    --------
    >>> guide = LaplaceGuide(model, structure="kron")                  # doctest: +SKIP
    >>> pyrobayes.fit(model, guide, loader, epochs=20, lr=1e-2)        # doctest: +SKIP
    >>> pred = pyrobayes.predict(model, guide, test_loader)  # GLM      # doctest: +SKIP
    """

    family = "laplace"
    default_fitter = "laplace"
    default_objective = "map"
    #: constructor options that are the fit's, not the posterior's: accepted for one release
    #: (``DeprecationWarning``), handed to the fitter, never saved with the posterior
    fit_options: ClassVar[tuple[str, ...]] = (
        "prior_optimization",
        "log_prior_bounds",
        "alternate_tol",
        "alternate_max_iter",
        "alternate_epochs",
        "alternate_map_tol",
        "alternate_lr",
    )
    #: the :mod:`pyrobayes.infer` settings class that takes ``fit_options`` now
    fit_settings_class: ClassVar[str] = "Laplace"

    def __init__(
        self,
        model: Any,
        *,
        structure: str = "kron",
        prior_precision: str | float = "marglik",
        log_prior_bounds: tuple[float, float] | list[float] | None = None,
        temperature: float = 1.0,
        prior_optimization: str | None = None,
        alternate_tol: float | None = None,
        alternate_max_iter: int | None = None,
        alternate_epochs: int | None = None,
        alternate_map_tol: float | None = None,
        alternate_lr: float | None = None,
        pred_type: str = "glm",
        link_samples: int | None = 100,
        subset: str | Sequence[str] = "all",
        prior_structure: str = "scalar",
    ) -> None:
        owner = f"{type(self).__name__}: "
        if structure not in ("kron", "diag"):
            raise ValueError(f"Expected structure 'kron' or 'diag' but got {structure!r}.")
        if isinstance(prior_precision, str):
            if prior_precision not in ("marglik", "model"):
                raise ValueError(
                    "Expected prior_precision 'marglik', 'model' or a positive float but got "
                    f"{prior_precision!r}."
                )
        else:
            prior_precision = check_real("prior_precision", prior_precision, gt=0, owner=owner)
        temperature = check_real("temperature", temperature, gt=0, owner=owner)
        given: dict[str, Any] = {
            "prior_optimization": prior_optimization,
            "log_prior_bounds": log_prior_bounds,
            "alternate_tol": alternate_tol,
            "alternate_max_iter": alternate_max_iter,
            "alternate_epochs": alternate_epochs,
            "alternate_map_tol": alternate_map_tol,
            "alternate_lr": alternate_lr,
        }
        given = {k: v for k, v in given.items() if v is not None}
        _check_fit_settings(owner, given, prior_precision)
        #: fit settings passed to the constructor (deprecated): the fitter's defaults
        self.fit_settings: dict[str, Any] = given
        warn_fit_settings(owner, given, self.fit_settings_class)
        self.link_samples = link_samples  # checked by its setter
        if prior_structure not in PRIOR_STRUCTURES:
            raise ValueError(
                f"{owner}prior_structure must be one of {list(PRIOR_STRUCTURES)} (one τ for every "
                f"latent site, or one per site); got {prior_structure!r}."
            )
        if prior_structure == "layerwise" and given.get("prior_optimization") == "alternate":
            raise ValueError(_ALTERNATE_LAYERWISE)
        self.prior_structure = prior_structure
        self.subset = _resolve_subset(model, subset, owner)
        self.pred_type = pred_type
        self.structure = structure
        self.prior_precision_spec = prior_precision
        self._temperature = float(temperature)
        self._index: dict[str, int] = {}
        super().__init__(model)

    # ------------------------------------------------------------------ set-up
    def _setup_site(self, site: str, init: Tensor) -> None:
        # the curvature, its eigenbases and τ in float32 on a half-precision network (computed
        # there; a bfloat16 buffer rounded them, and τ above 65504 is inf in float16)
        dtype = compute_dtype(init.dtype)
        if not self._index:
            self.register_buffer("lap_prior_precision", init.new_ones((), dtype=dtype))
            self.register_buffer("lap_fitted", torch.zeros((), dtype=torch.bool))
        self._add_param("locs", site, init.detach().to(dtype).clone())  # (as MAP's: float32)
        i = len(self._index)
        self._index[site] = i
        shape = init.shape
        if self.prior_structure == "layerwise":  # τ_l = τ · factor_l (1 until the evidence's)
            self.register_buffer(f"prior_factor_{i}", init.new_ones((), dtype=dtype))
        # curvature: diag GGN (same shape as the site) or the Kronecker eigenvalue products γ aᵀ
        self.register_buffer(f"curv_{i}", init.new_zeros(shape, dtype=dtype))
        if self.structure == "kron" and self.is_latent(site):
            if len(shape) not in (1, 2):
                raise ValueError(
                    f"structure='kron' needs matrix sites (a core or a Linear weight) or vector "
                    f"sites (a Linear bias: one dense factor); site {site!r} has shape "
                    f"{tuple(shape)}. Use structure='diag', or leave the site out of subset=."
                )
            # a bias (m,) is laplace-torch's one-factor block: Q_G (m×m), Q_A = [[1]]
            m, n = (shape[0], shape[1]) if len(shape) == 2 else (shape[0], 1)
            self.register_buffer(f"eigvecs_out_{i}", torch.eye(m, dtype=dtype))
            self.register_buffer(f"eigvecs_in_{i}", torch.eye(n, dtype=dtype))

    @property
    def pred_type(self) -> str:
        """The predictive :func:`pyrobayes.predict` returns (may be set after fitting: checked;
        another value drops a :func:`pyrobayes.calibrate` temperature, with a warning)."""
        return self._pred_type

    @pred_type.setter
    def pred_type(self, value: str) -> None:
        if value not in PRED_TYPES:
            raise ValueError(
                f"{type(self).__name__}: pred_type must be one of {list(PRED_TYPES)} (the "
                "linearised predictive, its probit approximation, or network sampling); got "
                f"{value!r}."
            )
        previous = self.__dict__.get("_pred_type")  # (None while the constructor sets it)
        if previous is not None and value != previous:  # a temperature calibrates one predictive
            drop_temperature(
                self,
                f"{type(self).__name__}.pred_type: ",
                reason=f"its pred_type={previous!r} predictive; pred_type={value!r} is another "
                "predictive, which that temperature does not calibrate",
                then="to calibrate this one",
            )
        self._pred_type = value

    @property
    def temperature(self) -> float:
        """T in ``H/T``: a setting of the fit (the curvature and τ are computed under it)."""
        return self._temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        value = check_real("temperature", value, gt=0, owner=f"{type(self).__name__}: ")
        if value != self._temperature and self._index and self.is_fitted:
            raise ValueError(
                f"{type(self).__name__}.temperature: the curvature and the prior precision were "
                f"fitted at T = {self._temperature:g}, and changing T changes both. Build the "
                f'posterior with it (pb.posterior(model, "laplace", temperature={value:g})) and '
                "fit it again; to soften or sharpen the predictive instead, use "
                "pyrobayes.calibrate (a predictive temperature)."
            )
        self._temperature = float(value)

    @property
    def link_samples(self) -> int | None:
        """Draws of the ``"glm"`` classification Monte Carlo (``None``: the ``num_samples`` of
        :func:`pyrobayes.predict`); may be set after fitting (checked)."""
        return self._link_samples

    @link_samples.setter
    def link_samples(self, value: int | None) -> None:
        if value is not None:
            value = check_int("link_samples", value, ge=1, owner=f"{type(self).__name__}: ")
        self._link_samples = value

    def config(self) -> dict[str, Any]:
        """The constructor options, with ``pred_type``, ``link_samples`` and ``temperature`` as
        they are now (the first two may be set after fitting, the third before it)."""
        options = {k: v for k, v in super().config().items() if k not in self.fit_options}
        return {
            **options,
            "pred_type": self.pred_type,
            "link_samples": self.link_samples,
            "temperature": self.temperature,
        }

    # ------------------------------------------------------------------ accessors
    def is_latent(self, site: str) -> bool:
        """Whether ``site`` has a Gaussian posterior (in ``subset``) or is held at its MAP."""
        return self.subset is None or site in self.subset

    @property
    def latent_subset(self) -> list[str]:
        """The sites with a Gaussian posterior, in site order (all of them by default)."""
        self.require_setup()
        return [s for s in self.sites if self.is_latent(s)]

    def fixed_point(self) -> dict[str, Tensor]:
        """The sites outside ``subset`` at their point (detached): held there by every predictive."""
        self.require_setup()
        return {s: self.loc(s).detach() for s in self.sites if not self.is_latent(s)}

    @property
    def is_fitted(self) -> bool:
        return bool(self.sites) and bool(self.lap_fitted)

    @property
    def prior_precision(self) -> float:
        """τ (``prior_structure="layerwise"``: the geometric mean of the sites' ``τ_l``)."""
        return float(self.lap_prior_precision)

    def site_prior_precision(self, site: str) -> Tensor:
        """``τ_l``, the prior precision of ``site`` (a 0-d tensor): ``τ`` unless
        ``prior_structure="layerwise"``."""
        if self.prior_structure != "layerwise":
            return self.lap_prior_precision
        return self.lap_prior_precision * getattr(self, f"prior_factor_{self._index[site]}")

    def site_prior_precisions(self) -> dict[str, float]:
        """``{site: τ_l}`` over the latent sites."""
        return {s: float(self.site_prior_precision(s)) for s in self.latent_subset}

    def curvature(self, site: str) -> Tensor:
        """Diagonal GGN or the Kronecker eigenvalue products ``γ aᵀ`` (scaled by ``1/T``)."""
        return getattr(self, f"curv_{self._index[site]}")

    def eigvecs(self, site: str) -> tuple[Tensor, Tensor]:
        """``(Q_G, Q_A)``: eigenvectors of the output and input Kronecker factors."""
        i = self._index[site]
        return getattr(self, f"eigvecs_out_{i}"), getattr(self, f"eigvecs_in_{i}")

    def set_curvature(
        self,
        site: str,
        curvature: Tensor,
        eigvecs_out: Tensor | None = None,
        eigvecs_in: Tensor | None = None,
    ) -> None:
        """Store a site's curvature (used by :func:`~pyrobayes.infer.laplace.fit_laplace`)."""
        i = self._index[site]
        with torch.no_grad():
            getattr(self, f"curv_{i}").copy_(curvature)
            if self.structure == "kron":
                if eigvecs_out is None or eigvecs_in is None:
                    raise ValueError(
                        f"LaplaceGuide.set_curvature: structure='kron' needs the eigenvectors "
                        f"eigvecs_out and eigvecs_in of site {site!r}'s Kronecker factors."
                    )
                getattr(self, f"eigvecs_out_{i}").copy_(eigvecs_out)
                getattr(self, f"eigvecs_in_{i}").copy_(eigvecs_in)

    def set_prior_precision(self, value: float) -> None:
        """Set τ (a finite number > 0; not log τ); with ``prior_structure="layerwise"`` every
        ``τ_l`` is scaled by the same factor (their ratios are kept). A temperature fitted to
        the guide's predictive under the old τ is removed, with a warning."""
        tau = check_real("τ", value, gt=0, owner="LaplaceGuide.set_prior_precision: ")
        if tau != float(self.lap_prior_precision):
            drop_temperature(
                self,
                "LaplaceGuide.set_prior_precision: ",
                reason=f"its predictive under τ = {float(self.lap_prior_precision):.4g}; "
                f"τ = {tau:.4g} gives another posterior",
                then="under the new τ",
            )
        with torch.no_grad():
            self.lap_prior_precision.fill_(tau)

    def set_site_prior_precisions(self, values: Mapping[str, float]) -> None:
        """Set ``τ_l`` per latent site (``prior_structure="layerwise"``); τ becomes their
        geometric mean."""
        self.require_setup()
        if self.prior_structure != "layerwise":
            raise ValueError(
                "LaplaceGuide.set_site_prior_precisions needs prior_structure='layerwise'; this "
                "guide has one τ for every site (set_prior_precision)."
            )
        latent = self.latent_subset
        missing = [s for s in latent if s not in values]
        extra = [s for s in values if s not in latent]
        if missing or extra:
            raise ValueError(
                f"LaplaceGuide.set_site_prior_precisions: expected one τ per latent site "
                f"{latent[:8]}; missing {missing[:5]}, not latent {extra[:5]}."
            )
        logs = {s: math.log(check_real(f"τ of {s!r}", values[s], gt=0)) for s in latent}
        log_tau = sum(logs.values()) / len(logs)
        with torch.no_grad():
            self.lap_prior_precision.fill_(math.exp(log_tau))
            for s, log_value in logs.items():
                getattr(self, f"prior_factor_{self._index[s]}").fill_(math.exp(log_value - log_tau))

    def mark_fitted(self, fitted: bool = True) -> None:
        """Declare the curvature and τ final (or not)."""
        self.lap_fitted.fill_(fitted)

    def reset(self) -> None:
        """Forget the fit: the guide is unfitted until its curvature is fitted again."""
        self.mark_fitted(False)

    def require_fitted(self) -> None:
        self.require_setup()
        if not self.is_fitted:
            raise RuntimeError(
                "LaplaceGuide is not fitted; run pyrobayes.fit(model, guide, data, epochs=...) (or "
                "pyrobayes.infer.laplace.fit_laplace(model, guide, data) at a trained MAP), or "
                "load a fitted posterior."
            )

    def posterior_precision(self, site: str) -> Tensor:
        """Dense ``H + τ I`` over ``site.reshape(-1)`` (row-major), ``(numel, numel)``."""
        self.require_fitted()
        if not self.is_latent(site):
            raise ValueError(
                f"LaplaceGuide.posterior_precision: site {site!r} is outside subset "
                f"{sorted(self.subset or [])} (held at its MAP: no precision)."
            )
        prec = self.curvature(site) + self.site_prior_precision(site)
        if self.structure == "diag":
            return torch.diag(prec.reshape(-1))
        q_out, q_in = self.eigvecs(site)
        if prec.dim() == 1:  # a bias: Q_G diag(λ + τ) Q_Gᵀ
            return (q_out * prec) @ q_out.T
        return KronEigenNormal(self.loc(site), q_in, q_out, prec).to_dense_precision(row_major=True)

    def check_finite(self, owner: str = "predict: ") -> None:
        """Refuse a posterior whose precision ``H_l + τ_l I`` is not a finite, positive one at
        some latent site (a curvature, τ or Kronecker eigenbasis holding NaN or inf, set or
        loaded by hand or overflowed): its covariance, and every predictive, would be NaN.

        One device synchronisation for all the sites; the error path counts the values.

        Parameters
        ----------
        owner : str
            The caller, named first in the message (``"predict: "``).

        Raises
        ------
        FloatingPointError
            Naming each site, what is not finite there, and what to do.
        """
        self.require_fitted()
        latent = self.latent_subset
        checks = []
        for site in latent:
            curv, tau = self.curvature(site), self.site_prior_precision(site)
            vecs_ok = curv.new_ones((), dtype=torch.bool)  # (DIAG: no eigenbasis)
            if self.structure == "kron":
                vecs_ok = torch.isfinite(torch.cat([q.reshape(-1) for q in self.eigvecs(site)]))
            checks += [torch.isfinite(curv).all(), torch.isfinite(tau) & (tau > 0)]
            checks += [vecs_ok.all(), ((curv + tau) > 0).all()]
        flags = torch.stack(checks).reshape(len(latent), 4).tolist() if latent else []
        problems = [_precision_problem(self, s, f) for s, f in zip(latent, flags, strict=True)]
        found = [p for p in problems if p is not None]
        if not found:
            return
        raise FloatingPointError(
            f"{owner}the LaplaceGuide's posterior precision H + τ I is not usable at "
            f"{len(found)} site(s) ({'; '.join(found[:5])}): its covariance (H + τ I)⁻¹, and so "
            "the predictive, would be NaN. Refit the posterior at the MAP (pyrobayes.fit(model, "
            "guide, data, epochs=0)) after checking the training data for non-finite or huge "
            "inputs (a float16 network: use bfloat16 or float32); for τ, give a finite, larger "
            "prior precision (guide.set_prior_precision(tau), or pb.posterior(model, "
            "'laplace', prior_precision=...)); a posterior edited by hand: load the saved file "
            "again."
        )

    # ------------------------------------------------------------------ guide contract
    def get_posterior(self, site: str) -> dist.TorchDistribution:
        # the fitted posterior is fixed: its draws carry no gradient to the point, whose
        # curvature it is (Pyro's SVI on a fitted guide would move the mean away from it)
        loc = self.loc(site).detach()
        self.require_fitted()
        if not self.is_latent(site):
            return dist.Delta(loc, event_dim=loc.dim())
        try:
            return self._site_posterior(site, loc)
        except (ValueError, RuntimeError):  # torch's check of the parameters prints them:
            self.check_finite(f"{type(self).__name__}.get_posterior({site!r}): ")  # say why
            raise

    def _site_posterior(self, site: str, loc: Tensor) -> dist.TorchDistribution:
        """``q`` of the latent ``site`` around ``loc``: diagonal, a bias's dense Gaussian or the
        Kronecker eigenbasis Gaussian (torch checks its parameters)."""
        prec = self.curvature(site) + self.site_prior_precision(site)
        if self.structure == "diag":
            return dist.Normal(loc, prec.rsqrt()).to_event(loc.dim())
        q_out, q_in = self.eigvecs(site)
        if prec.dim() == 1:  # a bias: N(loc, Q_G diag(1/(λ + τ)) Q_Gᵀ)
            cov = (q_out / prec) @ q_out.T
            return dist.MultivariateNormal(
                loc, scale_tril=torch.linalg.cholesky(0.5 * (cov + cov.T))
            )
        return KronEigenNormal(loc, q_in, q_out, prec)

    def mean(self) -> dict[str, Tensor]:
        self.require_setup()
        return {s: self.loc(s).detach().clone() for s in self.sites}

    def sample_posterior(
        self, num_samples: int, *, generator: torch.Generator | None = None
    ) -> dict[str, Tensor]:
        """Joint draws ``{site: (num_samples, *shape)}`` (:meth:`PosteriorGuide.sample_posterior`),
        after :meth:`check_finite` (one device synchronisation per call): a ``+inf`` Kronecker
        curvature or τ passes torch's check of the parameters (``inf > 0``) and would give draws
        with no spread there, and an inf eigenvector NaN draws, a wrong ``pred_type="nn"``
        predictive with no word of the cause.

        Raises
        ------
        FloatingPointError
            When ``H + τ I`` is not finite and positive at some latent site (named).
        """
        self.check_finite(f"{type(self).__name__}.sample_posterior: ")
        return super().sample_posterior(num_samples, generator=generator)

    # ------------------------------------------------------------------ linearised predictive
    def linearization_point(self) -> dict[str, Tensor]:
        """``θ_MAP`` per site (detached): where the GLM predictive linearises the network."""
        self.require_fitted()
        return {s: self.loc(s).detach() for s in self.sites if self.is_latent(s)}

    def functional_covariance(self, jacobians: Mapping[str, Tensor]) -> Tensor:
        r"""``J Σ Jᵀ`` `(B, K, K)` from per-site Jacobians ``{site: (B, K, *site_shape)}``.

        Σ is block-diagonal over sites: ``Σ_l = (H_l + τ_l I)^{-1}``. DIAG:
        ``Σ_l J_lᵀ = J_lᵀ / (h_l + τ)``; KRON: with ``H_l + τ I = (Q_G ⊗ Q_A) diag(λ)
        (Q_G ⊗ Q_A)ᵀ`` (row-major vec), ``J_l Σ_l J_lᵀ = Σ_{ij} Y_{ij} Y'_{ij} / λ_{ij}`` for
        ``Y = Q_Gᵀ J_l Q_A`` (the Jacobian rotated into the eigenbasis).
        """
        self.require_fitted()
        total: Tensor | None = None
        for site, jac in jacobians.items():
            prec = self.curvature(site) + self.site_prior_precision(site)
            if self.structure == "diag":
                flat = jac.reshape(*jac.shape[:2], -1)
                cov = torch.einsum("bcd,bed->bce", flat, flat / prec.reshape(-1))
            elif prec.dim() == 1:  # a bias: (J Q_G) diag(1/(λ + τ)) (J Q_G)ᵀ
                rotated = jac @ self.eigvecs(site)[0]  # (B, K, m)
                cov = torch.einsum("bci,bei->bce", rotated, rotated / prec)
            else:
                q_out, q_in = self.eigvecs(site)
                rotated = q_out.T @ jac @ q_in  # (B, K, m, n) in the eigenbasis
                cov = torch.einsum("bcij,beij->bce", rotated, rotated / prec)
            total = cov if total is None else total + cov
        if total is None:
            raise ValueError("functional_covariance needs the Jacobian of at least one site.")
        return total

    def num_posterior_parameters(self) -> int:
        """Numbers that describe q: the MAP, the curvature, the eigenbases (KRON) and τ (per
        latent site with ``prior_structure="layerwise"``)."""
        self.require_setup()
        total = 1
        if self.prior_structure == "layerwise":
            total += sum(1 for s in self.sites if self.is_latent(s))
        for site, shape in self.sites.items():
            numel = int(torch.Size(shape).numel())
            if not self.is_latent(site):
                total += numel
                continue
            total += 2 * numel
            if self.structure == "kron":
                total += sum(n**2 for n in shape)
        return total


def _precision_problem(guide: LaplaceGuide, site: str, flags: list[bool]) -> str | None:
    """What is wrong with ``site``'s precision (``flags``: its curvature finite, τ finite and
    > 0, its eigenvectors finite, the precision positive), in words, or ``None``."""
    curv_ok, tau_ok, vecs_ok, positive = flags
    if curv_ok and tau_ok and vecs_ok and positive:
        return None
    curv, tau = guide.curvature(site), float(guide.site_prior_precision(site))
    parts = []
    if not curv_ok:
        bad = int((~torch.isfinite(curv)).sum())
        parts.append(f"its curvature holds {bad} of {curv.numel()} values NaN or inf")
    if not tau_ok:
        parts.append(f"its prior precision τ is {tau:.4g}, not a finite number > 0")
    if not vecs_ok:
        parts.append("its Kronecker eigenvectors hold NaN or inf")
    if curv_ok and tau_ok and vecs_ok:
        parts.append(f"H + τ I is not positive (a negative curvature, τ = {tau:.4g})")
    return f"site {site!r}: {', '.join(parts)}"


def _resolve_subset(model: Any, subset: str | Sequence[str], owner: str) -> frozenset[str] | None:
    """The sites ``subset`` names (``None``: all of them)."""
    specs = dict(getattr(model, "latent_sites", None) or {})
    if isinstance(subset, str):
        if subset == "all":
            return None
        if subset == "adapter":
            names = [s for s, spec in specs.items() if spec.kind not in ("weight", "bias")]
            if not names:
                raise ValueError(
                    f"{owner}subset='adapter' but the model has no adapter sites; build it with "
                    "adapter=LoRAXS(...) or LoRA(...), or use subset='all'."
                )
            return frozenset(names)
        if subset == "last_layer":
            layers = {
                spec.module_path for spec in specs.values() if spec.kind in ("weight", "bias")
            }
            order = [path for path, _ in model.net.named_modules() if path in layers]
            if not order:
                raise ValueError(
                    f"{owner}subset='last_layer' needs a whole layer made latent (laplace-torch's "
                    "last-layer Laplace): build the model with FineTuneModel(..., latent_modules="
                    "['<head>'], trainable_modules=[]) so the head's weight and bias are latent "
                    "sites."
                )
            return frozenset(s for s, spec in specs.items() if spec.module_path == order[-1])
        raise ValueError(
            f"{owner}subset must be 'all', 'adapter', 'last_layer' or a list of site names; got "
            f"{subset!r}."
        )
    names = list(subset)
    unknown = [n for n in names if n not in specs]
    if not names or unknown:
        raise ValueError(
            f"{owner}subset names no site or unknown sites {unknown[:5]}; the model's sites are "
            f"{list(specs)[:8]}."
        )
    return frozenset(names)
