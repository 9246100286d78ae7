r"""SWAG moment collection (Maddox et al., 2019) as an explicit ``init`` / ``step`` state.

The moments are kept by Welford's (1962) running update: after each collection ``n ← n + 1`` and

.. math::

    δ = θ - \bar θ_{\rm old},\qquad
    \bar θ \leftarrow \bar θ_{\rm old} + δ/n,\qquad
    M_2 \leftarrow M_2 + δ\,(θ - \bar θ),\qquad
    \hat D \leftarrow [\hat D,\ θ - \bar θ]_{\text{last } K}

so ``M_2 = Σ_i (θ_i − θ̄_n)²`` is the sum of squared deviations from the current mean. Unlike the
raw second moment ``θ²̄`` (the variance as ``θ²̄ − θ̄²``), it does not cancel when ``|θ̄| ≫ sd``: in
float32 at ``|θ̄|/sd = 1000`` the raw-moment variance is wrong by order one, Welford's by ~1e-4.
In exact arithmetic both give the same ``M_2/n = θ²̄ − θ̄²``.

The deviation is taken against the running mean *at collection time* (as in Maddox's code), not
the final mean. The posterior built from the state
(:func:`pyrobayes.guides.lowrank.swag_posterior`) is ``N(θ̄, s·(Σ_diag + D̂ D̂ᵀ/(K−1)))`` with
``Σ_diag = max(M_2/n, 1e-30)`` and ``K`` the number of stored deviations; ``s = 0.5`` is
Maddox's ½.

:class:`SWAGFitter` trains the guide's iterate with the MAP objective and collects it on the
schedule of its settings, :class:`SWAG`.

References
----------
B. P. Welford, "Note on a method for calculating corrected sums of squares and products",
Technometrics 4(3), 1962.
W. J. Maddox et al., "A simple baseline for Bayesian uncertainty in deep learning", NeurIPS 2019.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pyro.distributions as dist
import torch
from torch import Tensor

from ..guides.lowrank import VAR_FLOOR, SwagState, swag_posterior
from ..models.adapters import check_int, check_real
from ..user_frame import user_stacklevel
from .fitter import Fitter

logger = logging.getLogger(__name__)

__all__ = [
    "SWAG",
    "SwagState",
    "swag_init",
    "swag_step",
    "swag_posterior",
    "SwagCollector",
    "SWAGFitter",
    "VAR_FLOOR",
]


@dataclass(frozen=True)
class SWAG:
    """SWAG's settings: when the iterates are collected and how they are produced (the fitter's,
    not the guide's).

    Pass it as the fit's optimizer, ``pb.fit(model, guide, data, ...,
    optim=pb.Optimization(optimizer=pb.infer.SWAG(start_epoch=5, swa_lr=0.01)))`` or
    ``make_fitter(model, guide, optimizer=pb.infer.SWAG(...))``. Saved in the fitter's checkpoint,
    not with the posterior.

    Parameters
    ----------
    start_epoch : int
        Epochs of plain training before collection starts (0; 8–25 in Maddox et al., 2019).
    collect_every : int
        Collect the iterate after every ``collect_every``-th epoch from ``start_epoch`` on (1).
    collect_every_steps : int, optional
        Collect every this many optimizer steps instead (once ``start_epoch`` epochs are done).
    optimizer : {"adam", "sgd"}, torch optimizer class or callable ``params -> Optimizer``
        The torch optimizer of the MAP trajectory (learning rate: the fit's ``lr``; a class is
        built as ``cls(params, lr=lr)``). A checkpoint records a class or callable by its name.
    swa_lr : float, optional
        Target of ``torch.optim.swa_utils.SWALR``'s annealing from ``start_epoch`` on
        (Izmailov et al., 2018), > 0; ``None`` keeps the learning rate.
    anneal_epochs : int
        SWALR's annealing length.
    anneal_strategy : {"linear", "cos"}
    """

    optimizer: str | Callable[..., Any] = "adam"
    swa_lr: float | None = None
    anneal_epochs: int = 5
    anneal_strategy: str = "linear"
    start_epoch: int = 0
    collect_every: int = 1
    collect_every_steps: int | None = None

    def __post_init__(self) -> None:
        owner = "SWAG(): "
        if isinstance(self.optimizer, str) and self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"{owner}optimizer must be 'adam' or 'sgd'; got {self.optimizer!r}.")
        if not isinstance(self.optimizer, str) and not callable(self.optimizer):
            raise TypeError(
                f"{owner}optimizer must be 'adam', 'sgd', a torch optimizer class or a callable "
                f"params -> Optimizer; got {type(self.optimizer).__name__}."
            )
        if self.swa_lr is not None:
            # > 0: at 0 the collected iterates are one point (a posterior of zero spread)
            check_real("swa_lr", self.swa_lr, gt=0, owner=owner)
        check_int("anneal_epochs", self.anneal_epochs, ge=0, owner=owner)
        if self.anneal_strategy not in ("cos", "linear"):
            raise ValueError(
                f"{owner}anneal_strategy must be 'cos' or 'linear'; got {self.anneal_strategy!r}."
            )
        check_int("start_epoch", self.start_epoch, ge=0, owner=owner)
        check_int("collect_every", self.collect_every, ge=1, owner=owner)
        if self.collect_every_steps is not None:
            check_int("collect_every_steps", self.collect_every_steps, ge=1, owner=owner)


def swag_init(
    dim: int, rank: int, *, dtype: torch.dtype | None = None, device: torch.device | None = None
) -> SwagState:
    """Empty SWAG state over ``dim`` coordinates keeping ``rank`` deviations."""
    if rank < 1:
        raise ValueError(f"Expected rank >= 1 but got {rank}.")
    dtype = dtype or torch.get_default_dtype()
    return SwagState(
        torch.zeros((), dtype=torch.long, device=device),
        torch.zeros(dim, dtype=dtype, device=device),
        torch.zeros(dim, dtype=dtype, device=device),
        torch.zeros(rank, dim, dtype=dtype, device=device),
    )


def swag_step(state: SwagState, theta: Tensor) -> SwagState:
    r"""Collect one iterate ``theta`` `(d,)`; returns the new state (the old one is unchanged).

    Welford's update: ``δ = θ − θ̄``, ``θ̄ ← θ̄ + δ/n``, ``M_2 ← M_2 + δ (θ − θ̄)`` (new ``θ̄``), and
    the deviation ``θ − θ̄`` (new ``θ̄``) enters ``D̂``.

    Raises
    ------
    FloatingPointError
        When ``theta`` holds NaN or inf (one synchronisation per iterate).
    """
    theta = theta.detach().reshape(-1).to(state.mean)
    if theta.shape != state.mean.shape:
        raise ValueError(f"Expected an iterate of shape {tuple(state.mean.shape)}.")
    bad = ~torch.isfinite(theta)
    if bool(bad.any()):  # one NaN iterate makes the mean and M_2 NaN for good
        raise FloatingPointError(
            f"swag_step: the iterate holds {int(bad.sum())} of {theta.numel()} values NaN or "
            f"inf (first at coordinate {int(bad.nonzero()[0])}); collecting it would make the "
            "SWAG mean and variances NaN from now on (the posterior then fails in a Cholesky "
            "factorisation). The state is unchanged: collect finite iterates (a diverged "
            "training run: a smaller lr or swa_lr)."
        )
    n = state.num_collected + 1
    w = 1.0 / n.to(state.mean.dtype)
    delta = theta - state.mean
    mean = state.mean + delta * w
    deviation = theta - mean
    m2 = state.m2 + delta * deviation
    deviations = torch.cat([state.deviations[1:], deviation.unsqueeze(0)], 0)
    return SwagState(n, mean, m2, deviations)


class SwagCollector:
    """Stateful convenience wrapper: ``c = SwagCollector(d, K); c.step(θ); c.posterior(s)``."""

    def __init__(
        self,
        dim: int,
        rank: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.state = swag_init(dim, rank, dtype=dtype, device=device)

    def step(self, theta: Tensor) -> SwagState:
        self.state = swag_step(self.state, theta)
        return self.state

    def posterior(self, scale: float = 0.5) -> dist.LowRankMultivariateNormal:
        return swag_posterior(self.state, scale)


class SWAGFitter(Fitter):
    r"""Fits a :class:`~pyrobayes.guides.SWAGGuide`: MAP training of its iterate plus collection.

    The objective is the MAP objective at the guide's iterate; the optimizer is Adam or SGD
    (``optimizer=pb.infer.SWAG(optimizer=...)``, :class:`SWAG`). The iterate is collected
    after every ``collect_every``-th epoch from ``start_epoch`` on, or every
    ``collect_every_steps`` optimizer steps; with ``swa_lr`` the learning rate is annealed by
    ``torch.optim.swa_utils.SWALR`` (then :func:`pyrobayes.fit` refuses a scheduler of its own).
    :meth:`end` keeps at least the last iterate and marks the posterior fitted. With a torch
    optimizer of one's own instead of a :class:`SWAG`, the schedule is the one given to the
    guide (deprecated) or :class:`SWAG`'s default, collected per epoch: pass the optimizer in
    the record instead, ``SWAG(optimizer=torch.optim.AdamW, start_epoch=5)``.
    """

    settings: SWAG  # the fit's settings record (Fitter.settings)

    collects_trajectory = True  # its moments are the iterates' (Fitter.collects_trajectory)

    def __init__(self, model: Any, guide: Any, *, optimizer: Any = None, **kwargs: Any) -> None:
        #: the fit's settings: ``optimizer`` when it is a :class:`SWAG`, else those given to the
        #: guide's constructor (deprecated), else the defaults
        if isinstance(optimizer, SWAG):
            self.settings, optimizer = optimizer, None
        else:
            self.settings = SWAG(**getattr(guide, "fit_settings", {}))
        super().__init__(model, guide, optimizer=optimizer, **kwargs)
        self._refuse_variational(
            "SWAG's posterior is built from the MAP trajectory of its point, not fitted by an "
            "ELBO (its q does not exist until the moments are collected)."
        )
        self._default_optim = optimizer is None
        self._swalr: Any = None
        self.epochs_done = 0
        #: iterates the guide held when :meth:`begin` reset it (warned about, then 0)
        self._discarded = 0

    @property
    def manages_lr(self) -> bool:
        return self.settings.swa_lr is not None

    def default_objective(self) -> str:
        return "map"

    def default_optimizer(self, params: list[torch.nn.Parameter], lr: float) -> Any:
        spec = self.settings.optimizer
        if spec == "sgd":
            return torch.optim.SGD(params, lr=lr)
        if spec == "adam":
            return torch.optim.Adam(params, lr=lr)
        return self._build_optimizer(spec, lr)  # a class or factory of one's own

    def begin(self, data: Iterable[Any] | None = None) -> None:
        """Start a new collection: the guide's moments are reset.

        Moments the guide already holds (a fitted guide fitted again, even with ``epochs=0``)
        are discarded with a warning at the fit's first step or its end, unless the fit resumes
        from a checkpoint (:meth:`load_state_dict` in between: the checkpoint restores them).
        """
        self._discarded = int(self.guide.swag_num_collected)
        self.guide.reset()
        self.ended = None
        self._swalr, self.epochs_done = None, 0
        if self.settings.start_epoch == 0:  # anneal from the first step (after epoch 0 the
            self._anneal()  # scheduler would be stepped before any step of its own: torch warns)
        if not self._default_optim and (
            self.settings.collect_every_steps is not None or self.settings.swa_lr is not None
        ):
            logger.warning(
                "SWAGFitter: collect_every_steps and swa_lr need SWAG's own optimizer (none, or "
                "pb.infer.SWAG(...)); collecting per epoch without annealing."
            )

    def _warn_discarded(self) -> None:
        """Warn once that :meth:`begin` discarded the iterates the guide had collected (not on
        a resume, whose checkpoint restored them)."""
        discarded, self._discarded = self._discarded, 0
        if not discarded:
            return
        message = (
            f"SWAGFitter: the SWAGGuide held {discarded} collected iterate(s) when this fit "
            "began, and a fit starts a new collection: they are discarded. To keep them, do not "
            "fit the guide again (it is fitted: pyrobayes.predict uses it as it is), save it "
            "first (pyrobayes.save), or continue the earlier fit from its checkpoint "
            "(pyrobayes.fit(..., checkpoint=pyrobayes.Checkpointing(dir, resume=True)))."
        )
        logger.warning(message)
        warnings.warn(message, UserWarning, stacklevel=user_stacklevel())

    def _collect(self) -> None:
        self.guide.set_state(swag_step(self.guide.state, self.guide.iterate()))

    def _after_step(self) -> None:
        self._warn_discarded()
        every = self.settings.collect_every_steps
        if (
            every is not None
            and self._default_optim
            and self.epochs_done >= self.settings.start_epoch
            and self.num_steps % every == 0
        ):
            self._collect()

    def _anneal(self) -> None:
        settings = self.settings
        if settings.swa_lr is None or self._swalr is not None or not self._default_optim:
            return
        from torch.optim.swa_utils import SWALR

        self._swalr = SWALR(
            self.optimizer,
            swa_lr=settings.swa_lr,
            anneal_epochs=max(settings.anneal_epochs, 1),
            anneal_strategy=settings.anneal_strategy,  # type: ignore[arg-type]
        )

    def epoch_end(self, epoch: int) -> None:
        self._warn_discarded()
        settings = self.settings
        self.epochs_done = epoch + 1
        since = self.epochs_done - settings.start_epoch
        if since == 0:
            self._anneal()
        if since <= 0:
            return
        by_epoch = settings.collect_every_steps is None or not self._default_optim
        if by_epoch and since % settings.collect_every == 0:
            self._collect()
        self._anneal()
        if self._swalr is not None:
            self._swalr.step()

    def end(self, data: Iterable[Any] | None = None) -> None:
        self._warn_discarded()
        guide = self.guide
        if int(guide.swag_num_collected) == 0:
            self._collect()  # a short run (num_steps < one epoch): keep at least the last iterate
        n = int(guide.swag_num_collected)
        if n < 2:
            logger.warning(
                "SWAGGuide collected %d iterate(s); train for more epochs after start_epoch=%d.",
                n,
                self.settings.start_epoch,
            )
        guide.mark_fitted(n >= 1)
        self.ended = (
            "the SWAG moments are final, and a step would train the model's point parameters "
            "(its head) away from the iterates they were collected with. Start a new "
            "collection with fitter.begin(data), or predict with this posterior."
        )
        logger.info("SWAG: %d iterates collected, rank %d, scale %g", n, guide.rank, guide.scale)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["epochs_done"] = self.epochs_done
        if self._swalr is not None:
            state["swalr"] = self._swalr.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)  # refuses other settings first
        self._discarded = 0  # a resume: the checkpoint's guide state holds the moments
        self.epochs_done = int(state.get("epochs_done", 0))
        if "swalr" in state:
            self._anneal()
            if self._swalr is not None:
                self._swalr.load_state_dict(state["swalr"])
