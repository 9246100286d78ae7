r"""The members of a σN-ensemble as a posterior: M point particles over the member sites.

A σN-ensemble (Lopez-Gonzalez et al., 2025) is a point-estimated multi-task model, not a
posterior over weights: member ``t`` is a point ``θ_t`` (its pre-sigmoid norm scales ``γ_t``,
shifts ``β_t``, head, and adapter values), and the predictive is the equal-weight mixture

.. math:: q(θ) = \frac1M \sum_{t=1}^{M} δ(θ − θ_t),\qquad
          p(y \mid x) = \frac1M \sum_t p(y \mid x, θ_t).

The guide is a :class:`~pyrobayes.guides.particles.ParticleGuide` with ``num_particles = M`` and
``scale = 0``; the diversity term (τ, λ, the regularized layers) is its fit's
(:class:`pyrobayes.infer.signorm.SigmaNormDiversity`, read by the ``"signorm"`` objective of
:mod:`pyrobayes.infer.signorm`). It initialises the members as the σN conversion prescribes: ``γ_t = γ_0 + ε_t``, ``ε_t ~ N(0, s_init²)`` (identical members are a
stationary point), ``β_t = b``, heads re-initialised per member (or copied), every member
starting from the pretrained BatchNorm statistics (each then keeps its own).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..batch import compute_dtype
from ..models.adapters import check_real
from ..models.signorm import SCALE_KIND, STATS_KIND, scale_sites
from ..user_frame import user_stacklevel
from ._fit_options import warn_fit_settings
from .particles import ParticleGuide

__all__ = ["SigmaNormGuide"]

logger = logging.getLogger(__name__)


class SigmaNormGuide(ParticleGuide):
    r"""The M members of a σN-ensemble: point particles fitted with the mean member
    log-likelihood and the softmax-temperature diversity term.

    The objective (``"signorm"``), in the dataset-sum convention,

    .. math::

        L = -\frac{N}{B}\sum_b \frac1M\sum_{t=1}^{M} \log p(y_b \mid x_b, θ_t)
            + N λ \sum_{ℓ∈R}\sum_i\sum_{m=1}^{M}
              \log \operatorname{softmax}_τ\big(σ(γ_{1,ℓ,i}),…,σ(γ_{M,ℓ,i})\big)_m

    (Lopez-Gonzalez et al., 2025, Eq. 3; the first term is the mean member loss, never the
    mixture's marginal likelihood, which lets one member take over). No prior enters: the
    model's ``prior_scale`` is used only by other objectives (Pyro's ELBOs) on this guide.

    Parameters
    ----------
    model : FineTuneModel
        Usually a :class:`~pyrobayes.models.SigmaNormEnsemble`; any model works (without member
        norm layers the diversity term is 0 and this is a deep ensemble of the latent sites).
    num_particles : int, optional
        M, the number of members; default the ``num_members`` the model was converted with
        (:class:`~pyrobayes.models.SigmaNorm`), 4 for another model.
    scale : float
        σ of every member's component (default 0: point members, the σN-ensemble).
    init_scale : float
        Jitter of the members' initial adapter values and shifts around the model's (default 0:
        the members differ through ``γ`` and their heads).
    average : {"probs", "logits"}
        How :func:`pyrobayes.predict` combines the members (default: the average of their
        probabilities, the σN-ensemble's predictive).
    tau, strength, regularized : optional
        Deprecated here: the diversity term's τ, λ and R are settings of the fit, not of the
        posterior. Pass them to the fitter as ``pb.fit(..., optim=pb.Optimization(
        optimizer=pb.infer.SigmaNormDiversity(tau=..., strength=...)))``
        (:class:`pyrobayes.infer.signorm.SigmaNormDiversity`, which documents them); given here
        they still reach the fitter for one release, with a ``DeprecationWarning``, and are not
        saved with the posterior.
    init_noise : float
        s_init, the standard deviation of the members' initial ``γ`` around ``γ_0``.
    head_init : {"reinit", "copy"}
        Member heads (sites of kind ``weight`` / ``bias``): independently re-initialised as
        ``nn.Linear`` does (U(−1/√fan_in, 1/√fan_in)), or copies of the model's head.
    """

    family = "signorm"
    default_fitter = "signorm"
    default_objective = "signorm"
    is_deterministic = False
    #: constructor options that are the fit's, not the posterior's: accepted for one release
    #: (``DeprecationWarning``), handed to the fitter, never saved with the posterior
    fit_options: ClassVar[tuple[str, ...]] = ("tau", "strength", "regularized")
    #: the :mod:`pyrobayes.infer` settings class that takes ``fit_options`` now
    fit_settings_class: ClassVar[str] = "SigmaNormDiversity"

    def __init__(
        self,
        model: Any,
        *,
        num_particles: int | None = None,
        scale: float = 0.0,
        init_scale: float = 0.0,
        average: str = "probs",
        tau: float | None = None,
        strength: float | None = None,
        regularized: Sequence[str] | str | None = None,
        init_noise: float = 0.1,
        head_init: str = "reinit",
    ) -> None:
        owner = f"{type(self).__name__}: "
        given: dict[str, Any] = {"tau": tau, "strength": strength, "regularized": regularized}
        given = {k: v for k, v in given.items() if v is not None}
        if "tau" in given:  # checked by name before the warning
            check_real("tau", given["tau"], gt=0, owner=owner)
        if "strength" in given:
            check_real("strength", given["strength"], ge=0, owner=owner)
        if "regularized" in given:
            scale_sites(model, given["regularized"])  # a name that matches no layer: refused
            if not isinstance(given["regularized"], str):
                given["regularized"] = list(given["regularized"])
        #: fit settings passed to the constructor (deprecated): the fitter's defaults
        self.fit_settings: dict[str, Any] = given
        warn_fit_settings(owner, given, self.fit_settings_class)
        self.init_noise = check_real("init_noise", init_noise, ge=0, owner=owner)
        if head_init not in ("reinit", "copy"):
            raise ValueError(f"{owner}head_init must be 'reinit' or 'copy'; got {head_init!r}.")
        self.head_init = head_init
        built = getattr(getattr(model, "adapter", None), "num_members", None)
        if num_particles is None:
            num_particles = int(built) if built is not None else 4
        latent = getattr(model, "latent_sites", {})
        self._kinds = {site: spec.kind for site, spec in latent.items()}
        super().__init__(
            model,
            num_particles=num_particles,
            scale=scale,
            init_scale=init_scale,
            average=average,
        )
        if self.num_members > 1 and not (init_noise or init_scale) and head_init == "copy":
            warnings.warn(
                f"{owner}init_noise=0, init_scale=0 and head_init='copy' start all "
                f"{self.num_members} members identical: a stationary point of the fit (every "
                "member gets the same gradient, and the diversity term's is 0 there), so they "
                "stay one network. Give init_noise > 0 (default 0.1) or head_init='reinit'.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        if not any(kind == SCALE_KIND for kind in self._kinds.values()) and self.num_members > 1:
            logger.warning(
                "%s: the model has no member norm layers (build it with "
                "pb.models.SigmaNormEnsemble or adapter=pb.models.SigmaNorm(...)): the %d members "
                "differ only by their heads and init_scale=%g.",
                type(self).__name__,
                self.num_members,
                init_scale,
            )

    def config(self) -> dict[str, Any]:
        """The posterior's constructor options (the deprecated fit settings left out)."""
        return {k: v for k, v in super().config().items() if k not in self.fit_options}

    @property
    def num_members(self) -> int:
        """M."""
        return self.num_components

    def _setup_site(self, site: str, init: Tensor) -> None:
        init = init.detach().to(compute_dtype(init.dtype))  # (float32 on a half-precision site)
        members = self.num_components
        locs = init.unsqueeze(0).repeat(members, *([1] * init.dim()))
        kind = self._kinds.get(site)
        if kind == SCALE_KIND and self.init_noise > 0:
            locs = locs + self.init_noise * torch.randn_like(locs)
        elif kind in ("weight", "bias") and self.head_init == "reinit":
            fan_in = self._fan_in(site, init)
            bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
            locs = torch.empty_like(locs).uniform_(-bound, bound)
        elif kind != STATS_KIND and self._init_scale > 0:  # shifts and adapter sites
            locs = locs + self._init_scale * torch.randn_like(locs)
        self._add_param("locs", site, locs)

    def _jitter_remedy(self) -> str | None:
        """How to make the members start distinct (``None``: the options ask for identical
        starts, warned of at construction)."""
        if not (self.init_noise or self._init_scale) and self.head_init == "copy":
            return None
        return (
            f"give init_noise > 0 (now {self.init_noise:g}) on member norm layers, member heads "
            f"(heads=[...], head_init='reinit'; now {self.head_init!r}) or init_scale > 0 "
            f"(now {self._init_scale:g})"
        )

    def _fan_in(self, site: str, init: Tensor) -> int:
        if init.dim() == 2:
            return int(init.shape[1])
        weight = site.rsplit(".", 1)[0] + ".weight"  # a bias: its layer's weight's fan-in
        shape = self.sites.get(weight)
        return int(shape[1]) if shape is not None and len(shape) == 2 else int(init.numel())
