r"""SWAG posterior (B-LoRA-XS): a low-rank-plus-diagonal Gaussian over the concatenated sites.

.. math::

    q(θ) = \mathcal N\big(\bar θ,\ s\,Σ_{\rm diag} + \tfrac{s}{K-1}\hat D \hat D^\top\big),
    \qquad Σ_{\rm diag} = \max(M_2/n, 10^{-30})

over ``θ = concat_l vec(R_l)`` (every site the guide covers), i.e. Pyro's
``LowRankMultivariateNormal(loc=θ̄, cov_factor=sqrt(s/(K−1))·D̂, cov_diag=s·Σ_diag)``. The moments
come from the SGD/Adam iterates of the MAP objective (collected by
:class:`pyrobayes.infer.swag.SWAGFitter`); ``M_2 = Σ_i (θ_i − θ̄)²`` is kept by Welford's (1962)
running update.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, ClassVar, NamedTuple

import pyro.distributions as dist
import torch
from torch import Tensor

from ..batch import compute_dtype
from ..models.adapters import check_int, check_real
from ..user_frame import user_stacklevel
from ._fit_options import warn_fit_settings
from .joint import JointGaussianGuide

logger = logging.getLogger(__name__)

__all__ = ["SWAGGuide", "SwagState", "swag_posterior", "VAR_FLOOR", "DegenerateSWAGWarning"]

#: floor of the diagonal variance (Maddox et al., 2019)
VAR_FLOOR = 1e-30


class SwagState(NamedTuple):
    """SWAG moments of ``d`` coordinates with room for ``K`` deviations.

    - **num_collected** - ``Tensor ()`` long: n, iterates collected so far.
    - **mean** - ``Tensor (d,)``: θ̄.
    - **m2** - ``Tensor (d,)``: ``M_2 = Σ_i (θ_i − θ̄)²``, the sum of squared deviations from
      the mean, kept by Welford's (1962) update (:func:`pyrobayes.infer.swag.swag_step`).
    - **deviations** - ``Tensor (K, d)``: the last ``min(n, K)`` deviations in the *last* rows,
      oldest first (unfilled rows are zero).

    The raw second moment ``θ²̄ = M_2/n + θ̄²`` is the derived :attr:`sq_mean`.
    """

    num_collected: Tensor
    mean: Tensor
    m2: Tensor
    deviations: Tensor

    @property
    def rank(self) -> int:
        """K, the capacity of the deviation buffer."""
        return int(self.deviations.shape[0])

    @property
    def num_deviations(self) -> int:
        """Number of stored deviations ``min(n, K)``."""
        return min(int(self.num_collected), self.rank)

    @property
    def diag_variance(self) -> Tensor:
        """``Σ_diag = max(M_2/n, 1e-30)`` `(d,)` (``= max(θ²̄ − θ̄², 1e-30)`` in exact arithmetic)."""
        n = self.num_collected.clamp_min(1).to(self.m2.dtype)
        return (self.m2 / n).clamp_min(VAR_FLOOR)

    @property
    def sq_mean(self) -> Tensor:
        """``θ²̄ = M_2/n + θ̄²`` `(d,)`, the raw second moment (zero before any collection)."""
        n = self.num_collected.clamp_min(1).to(self.m2.dtype)
        return self.m2 / n + self.mean.square()

    @property
    def deviation_matrix(self) -> Tensor:
        """``D̂`` `(d, k)` with the ``k = min(n, K)`` stored deviations as columns (oldest first)."""
        k = self.num_deviations
        return self.deviations[self.rank - k :].T


class DegenerateSWAGWarning(UserWarning):
    """A SWAG posterior built from fewer than two collected iterates: it has no spread."""


def swag_posterior(state: SwagState, scale: float = 0.5) -> dist.LowRankMultivariateNormal:
    r"""``N(θ̄, s Σ_diag + s D̂ D̂ᵀ/(K−1))`` as a ``LowRankMultivariateNormal`` over ``d``.

    ``K`` is the number of stored deviations (``K − 1`` is floored at 1).

    Warns
    -----
    DegenerateSWAGWarning
        Fewer than two collected iterates: the covariance is (floored) zero, so every draw is
        the mean, a point estimate reported as a posterior.
    """
    n = int(state.num_collected)
    if n < 2:
        warnings.warn(
            f"SWAG posterior from {n} collected iterate(s) has no spread (its covariance is "
            "zero: every draw is the mean, a point estimate). Train for more epochs after "
            "start_epoch, or collect earlier or more often: a smaller start_epoch, "
            "collect_every or collect_every_steps in pb.infer.SWAG(...) (pb.fit(..., "
            "optim=pb.Optimization(optimizer=pb.infer.SWAG(start_epoch=...)))).",
            DegenerateSWAGWarning,
            stacklevel=user_stacklevel(),
        )
    k = state.num_deviations
    factor = state.deviation_matrix * (scale / max(k - 1, 1)) ** 0.5
    if k == 0:
        factor = state.mean.new_zeros(state.mean.shape[0], 1)
    return dist.LowRankMultivariateNormal(state.mean, factor, scale * state.diag_variance)


def _checked_fit_settings(owner: str, given: dict[str, Any]) -> dict[str, Any]:
    """The deprecated fit settings given to :class:`SWAGGuide` (``None`` left out), each
    checked so that a bad value is refused by name."""
    given = {k: v for k, v in given.items() if v is not None}
    for name, low in (("start_epoch", 0), ("collect_every", 1), ("collect_every_steps", 1)):
        if name in given:
            given[name] = check_int(name, given[name], ge=low, owner=owner)
    if "anneal_epochs" in given:
        given["anneal_epochs"] = check_int(
            "anneal_epochs", given["anneal_epochs"], ge=0, owner=owner
        )
    if "swa_lr" in given:
        given["swa_lr"] = check_real("swa_lr", given["swa_lr"], ge=0, owner=owner)
    if given.get("anneal_strategy", "linear") not in ("cos", "linear"):
        raise ValueError(
            f"{owner}anneal_strategy must be 'cos' or 'linear'; got {given['anneal_strategy']!r}."
        )
    if given.get("optimizer", "adam") not in ("adam", "sgd"):
        raise ValueError(f"Expected optimizer 'adam' or 'sgd' but got {given['optimizer']!r}.")
    return given


class SWAGGuide(JointGaussianGuide):
    r"""SWAG (Maddox et al., 2019) over the latent sites (B-LoRA-XS when the sites are cores).

    .. math::

        q(θ) = \mathcal N\big(\bar θ,\ s\,Σ_{\rm diag} + s\,\hat D\hat D^\top/(K-1)\big),
        \quad Σ_{\rm diag} = \max(M_2/n, 10^{-30}),\quad M_2 = \textstyle\sum_i (θ_i - \bar θ)^2

    Fitted by :class:`~pyrobayes.infer.swag.SWAGFitter` (what ``pyrobayes.fit`` uses): it
    optimises the MAP objective ``−(N/B) Σ_b log p(y_b|θ) − log p(θ)`` over the guide's iterate
    ``θ`` (and the head) and collects ``θ`` into the moments. When to collect (``start_epoch``,
    ``collect_every``, ``collect_every_steps``), the optimizer (Adam or SGD) and SWALR's
    annealing are the fit's settings, :class:`pyrobayes.infer.SWAG`.

    Parameters
    ----------
    model : FineTuneModel or Pyro model
    rank : int
        K, the number of stored deviations (covariance rank); 5–10 in the papers, 2 is enough.
    scale : float
        s, the sampling scale (0.5 is Maddox's ½; the B-LoRA-XS config uses 2.0).
    start_epoch, collect_every, collect_every_steps, swa_lr, anneal_epochs, anneal_strategy, \
optimizer : optional
        Deprecated here: settings of the fit, not of the posterior. Pass them to the fitter as
        ``pb.fit(..., optim=pb.Optimization(optimizer=pb.infer.SWAG(start_epoch=..., ...)))``
        (:class:`pyrobayes.infer.SWAG`: the collection schedule, SWALR's target and schedule,
        Adam or SGD); given here they still reach the fitter for one release, with a
        ``DeprecationWarning``, and are not saved with the posterior.

    Notes
    -----
    ``state_dict`` keys (besides the iterate ``locs.*``): ``swag_num_collected`` (n, long),
    ``swag_mean`` (θ̄ `(d,)`), ``swag_m2`` (``M_2`` `(d,)`, Welford's sum of squared deviations),
    ``swag_deviations`` (``D̂ᵀ`` `(K, d)`, oldest first) and ``swag_fitted`` (bool). Files saved
    before ``swag_m2`` hold the raw second moment ``swag_sq_mean`` (θ²̄) instead; loading converts
    it to ``M_2 = n·max(θ²̄ − θ̄², 0)``, which reproduces the old ``Σ_diag`` (with the old
    rounding: the cancellation already happened when that file was written).

    Examples
    --------
    >>> guide = SWAGGuide(model, rank=5)                          # doctest: +SKIP
    >>> swag = pyrobayes.infer.SWAG(start_epoch=10)               # doctest: +SKIP
    >>> pyrobayes.fit(model, guide, loader, epochs=20, lr=1e-3,
    ...               optim=pyrobayes.Optimization(optimizer=swag))  # doctest: +SKIP
    >>> pred = pyrobayes.predict(model, guide, test_loader, num_samples=15)  # doctest: +SKIP
    """

    family = "swag"
    default_fitter = "swag"
    default_objective = "map"
    #: constructor options that are the fit's, not the posterior's: accepted for one release
    #: (``DeprecationWarning``), handed to the fitter, never saved with the posterior
    fit_options: ClassVar[tuple[str, ...]] = (
        "start_epoch",
        "collect_every",
        "collect_every_steps",
        "optimizer",
        "swa_lr",
        "anneal_epochs",
        "anneal_strategy",
    )
    #: the :mod:`pyrobayes.infer` settings class that takes ``fit_options`` now
    fit_settings_class: ClassVar[str] = "SWAG"

    def __init__(
        self,
        model: Any,
        *,
        rank: int = 10,
        scale: float = 0.5,
        start_epoch: int | None = None,
        collect_every: int | None = None,
        collect_every_steps: int | None = None,
        swa_lr: float | None = None,
        anneal_epochs: int | None = None,
        anneal_strategy: str | None = None,
        optimizer: str | None = None,
    ) -> None:
        owner = f"{type(self).__name__}: "
        rank = check_int("rank", rank, ge=1, owner=owner)
        scale = check_real("scale", scale, gt=0, owner=owner)
        given = {
            "start_epoch": start_epoch,
            "collect_every": collect_every,
            "collect_every_steps": collect_every_steps,
            "optimizer": optimizer,
            "swa_lr": swa_lr,
            "anneal_epochs": anneal_epochs,
            "anneal_strategy": anneal_strategy,
        }
        #: fit settings passed to the constructor (deprecated): the fitter's defaults
        self.fit_settings: dict[str, Any] = _checked_fit_settings(owner, given)
        warn_fit_settings(owner, self.fit_settings, self.fit_settings_class)
        self.rank = int(rank)
        self.scale = float(scale)
        super().__init__(model)

    def config(self) -> dict[str, Any]:
        """The posterior's constructor options (the deprecated fit settings left out), with
        ``scale`` as it is now (it may be set after fitting)."""
        options = {k: v for k, v in super().config().items() if k not in self.fit_options}
        return {**options, "scale": self.scale}

    # ------------------------------------------------------------------ set-up
    def _setup_site(self, site: str, init: Tensor) -> None:
        # (float32 on a half-precision site, as MAP's: its SGD iterates would round away)
        self._add_param("locs", site, init.detach().to(compute_dtype(init.dtype)).clone())

    @property
    def scale(self) -> float:
        """s, the covariance scale of the predictive (may be set after fitting: checked)."""
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        self._scale = check_real("scale", value, gt=0, owner=f"{type(self).__name__}: ")

    def _setup_joint(self, flat_init: Tensor) -> None:
        dim, dtype, device = int(flat_init.numel()), flat_init.dtype, flat_init.device
        # moments of half-precision sites in float32: Welford's sums need the mantissa, and the
        # posterior's Cholesky (LowRankMultivariateNormal) has no half kernel; draws are cast
        # back to the sites' dtype (SitePacking.unpack)
        dtype = compute_dtype(dtype)
        self.register_buffer("swag_num_collected", torch.zeros((), dtype=torch.long))
        self.register_buffer("swag_mean", torch.zeros(dim, dtype=dtype, device=device))
        self.register_buffer("swag_m2", torch.zeros(dim, dtype=dtype, device=device))
        self.register_buffer(
            "swag_deviations", torch.zeros(self.rank, dim, dtype=dtype, device=device)
        )
        self.register_buffer("swag_fitted", torch.zeros((), dtype=torch.bool))

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> SwagState:
        """The collected moments as a :class:`SwagState`."""
        return SwagState(
            self.swag_num_collected, self.swag_mean, self.swag_m2, self.swag_deviations
        )

    def set_state(self, state: SwagState) -> None:
        """Overwrite the moments (the fitter's collection writes here)."""
        with torch.no_grad():
            self.swag_num_collected.copy_(state.num_collected)
            self.swag_mean.copy_(state.mean)
            self.swag_m2.copy_(state.m2)
            self.swag_deviations.copy_(state.deviations)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # files written before Welford's update hold the raw second moment θ²̄: M_2 = n (θ²̄ − θ̄²)
        old, new = prefix + "swag_sq_mean", prefix + "swag_m2"
        if old in state_dict and new not in state_dict:
            mean = state_dict.get(prefix + "swag_mean")
            count = state_dict.get(prefix + "swag_num_collected")
            if mean is not None and count is not None:  # else the strict check reports them
                sq_mean = state_dict.pop(old)
                n = torch.as_tensor(count).to(sq_mean.dtype)
                state_dict[new] = n * (sq_mean - mean.to(sq_mean).square()).clamp_min(0.0)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    @property
    def is_fitted(self) -> bool:
        return bool(self.sites) and bool(self.swag_fitted)

    def mark_fitted(self, fitted: bool = True) -> None:
        """Declare the moments final (the fitter does this at the end of a fit)."""
        self.swag_fitted.fill_(fitted)

    def iterate(self) -> Tensor:
        """The concatenated current iterate ``θ`` `(d,)` (the point ``loc`` of every site)."""
        return self.pack({s: self.loc(s).detach() for s in self.sites})

    def reset(self) -> None:
        """Forget the collected moments (the guide becomes unfitted)."""
        with torch.no_grad():
            for buf in (self.swag_mean, self.swag_m2, self.swag_deviations):
                buf.zero_()
            self.swag_num_collected.zero_()
            self.swag_fitted.fill_(False)

    def posterior(self) -> dist.LowRankMultivariateNormal:
        """The joint ``LowRankMultivariateNormal`` over the concatenated vec of all sites."""
        self.require_fitted()
        return swag_posterior(self.state, self.scale)

    def require_fitted(self) -> None:
        self.require_setup()
        if not self.is_fitted:
            raise RuntimeError(
                "SWAGGuide is not fitted; run pyrobayes.fit(model, guide, data, epochs=...) so it "
                "can collect SGD iterates (at least 2), or load a fitted posterior."
            )

    # ------------------------------------------------------------------ guide contract
    def joint_posterior(self) -> dist.LowRankMultivariateNormal:
        """:meth:`posterior`: the rest of the guide contract comes from
        :class:`~pyrobayes.guides.joint.JointGaussianGuide`."""
        return self.posterior()

    def mean(self) -> dict[str, Tensor]:
        self.require_fitted()
        return {s: v.detach().clone() for s, v in self.unpack(self.swag_mean).items()}

    def num_posterior_parameters(self) -> int:
        """Numbers that describe q: ``d`` (mean) + ``d`` (diagonal) + ``K d`` (deviations)."""
        self.require_setup()
        d = int(self.swag_mean.numel())
        return d * (2 + self.rank)
