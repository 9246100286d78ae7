r"""SWAG posterior (B-LoRA-XS): a low-rank-plus-diagonal Gaussian over the concatenated sites.

.. math::

    q(θ) = \mathcal N\big(\bar θ,\ s\,Σ_{\rm diag} + \tfrac{s}{K-1}\hat D \hat D^\top\big)

over ``θ = concat_l vec(R_l)`` (every site the guide covers), i.e. Pyro's
``LowRankMultivariateNormal(loc=θ̄, cov_factor=sqrt(s/(K−1))·D̂, cov_diag=s·Σ_diag)``. The moments
come from the SGD/Adam iterates of the MAP objective (see :mod:`pyrobayes.infer.swag`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from operator import attrgetter
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.infer.autoguide.utils import deep_setattr
from pyro.nn import PyroModule, PyroParam
from torch import Tensor
from torch.distributions.transforms import ReshapeTransform

from ..infer.swag import SwagState, swag_posterior, swag_step
from .base import PosteriorGuide

logger = logging.getLogger(__name__)

__all__ = ["SWAGGuide"]


class SWAGGuide(PosteriorGuide):
    r"""SWAG (Maddox et al., 2019) over the latent sites (B-LoRA-XS when the sites are cores).

    .. math::

        q(θ) = \mathcal N\big(\bar θ,\ s\,Σ_{\rm diag} + s\,\hat D\hat D^\top/(K-1)\big),
        \quad Σ_{\rm diag} = \max(\overline{θ^2} - \bar θ^2, 10^{-30})

    ``pyrobayes.fit(model, guide, data, epochs=E)`` optimises the MAP objective
    ``−(N/B) Σ_b log p(y_b|θ) − log p(θ)`` over the guide's iterate ``θ`` (and the head), and
    collects ``θ`` after every ``collect_every``-th epoch once ``start_epoch`` epochs are done (or
    every ``collect_every_steps`` optimizer steps). With ``swa_lr`` set, the learning rate of the
    guide's default optimizer is annealed to it by ``torch.optim.swa_utils.SWALR`` over
    ``anneal_epochs`` epochs from ``start_epoch`` on. ``fit_end`` finalises the posterior.

    Parameters
    ----------
    model : FineTuneModel or Pyro model
    rank : int
        K, the number of stored deviations (covariance rank); 5–10 in the papers, 2 is enough.
    scale : float
        s, the sampling scale (0.5 is Maddox's ½; the B-LoRA-XS config uses 2.0).
    start_epoch : int
        Epochs of plain training before collection starts.
    collect_every : int
        Collect after every ``collect_every``-th epoch from ``start_epoch`` on.
    collect_every_steps : int, optional
        Collect every this many optimizer steps instead (needs the guide's default optimizer).
    swa_lr : float, optional
        Target of SWALR's annealing (``None``: keep the learning rate).
    anneal_epochs : int
        SWALR annealing length.
    anneal_strategy : {"linear", "cos"}
    optimizer : {"adam", "sgd"}
        The default optimizer :func:`pyrobayes.fit` uses (another one can be passed to ``fit``;
        then neither SWALR nor step-wise collection is available).

    Examples
    --------
    >>> guide = SWAGGuide(model, rank=5, start_epoch=10)          # doctest: +SKIP
    >>> pyrobayes.fit(model, guide, loader, epochs=20, lr=1e-3)   # doctest: +SKIP
    >>> pred = pyrobayes.predict(model, guide, test_loader, num_samples=15)  # doctest: +SKIP
    """

    family = "swag"
    default_objective = "map"

    def __init__(
        self,
        model: Any,
        *,
        rank: int = 10,
        scale: float = 0.5,
        start_epoch: int = 0,
        collect_every: int = 1,
        collect_every_steps: int | None = None,
        swa_lr: float | None = None,
        anneal_epochs: int = 5,
        anneal_strategy: str = "linear",
        optimizer: str = "adam",
    ) -> None:
        if rank < 1:
            raise ValueError(f"Expected rank >= 1 but got {rank}.")
        if scale <= 0:
            raise ValueError(f"Expected scale > 0 but got {scale}.")
        if start_epoch < 0 or collect_every < 1:
            raise ValueError("Expected start_epoch >= 0 and collect_every >= 1.")
        if collect_every_steps is not None and collect_every_steps < 1:
            raise ValueError(f"Expected collect_every_steps >= 1 but got {collect_every_steps}.")
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"Expected optimizer 'adam' or 'sgd' but got {optimizer!r}.")
        self.rank = int(rank)
        self.scale = float(scale)
        self.start_epoch = int(start_epoch)
        self.collect_every = int(collect_every)
        self.collect_every_steps = collect_every_steps
        self.swa_lr = swa_lr
        self.anneal_epochs = int(anneal_epochs)
        self.anneal_strategy = anneal_strategy
        self.optimizer_name = optimizer
        self._fitting = False
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: Any = None
        self._epochs_done = 0
        self._steps = 0
        super().__init__(
            model,
            rank=rank,
            scale=scale,
            start_epoch=start_epoch,
            collect_every=collect_every,
            collect_every_steps=collect_every_steps,
            swa_lr=swa_lr,
            anneal_epochs=anneal_epochs,
            anneal_strategy=anneal_strategy,
            optimizer=optimizer,
        )

    # ------------------------------------------------------------------ set-up
    def _setup_site(self, site: str, init: Tensor) -> None:
        if not hasattr(self, "locs"):
            self.locs = PyroModule()
        deep_setattr(
            self.locs,
            site,
            PyroParam(init.detach().clone(), constraints.real, event_dim=len(init.shape)),
        )

    def _setup_sites(self, inits: Mapping[str, Tensor]) -> None:
        super()._setup_sites(inits)
        ref = next(iter(inits.values()))
        dim = sum(int(v.numel()) for v in inits.values())
        kw = {"dtype": ref.dtype, "device": ref.device}
        self.register_buffer("swag_num_collected", torch.zeros((), dtype=torch.long))
        self.register_buffer("swag_mean", torch.zeros(dim, **kw))
        self.register_buffer("swag_sq_mean", torch.zeros(dim, **kw))
        self.register_buffer("swag_deviations", torch.zeros(self.rank, dim, **kw))
        self.register_buffer("swag_fitted", torch.zeros((), dtype=torch.bool))
        self._offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for site, value in inits.items():
            self._offsets[site] = (start, start + int(value.numel()))
            start += int(value.numel())

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> SwagState:
        """The collected moments as a :class:`~pyrobayes.infer.swag.SwagState`."""
        return SwagState(
            self.swag_num_collected, self.swag_mean, self.swag_sq_mean, self.swag_deviations
        )

    @property
    def is_fitted(self) -> bool:
        return bool(self.sites) and bool(self.swag_fitted)

    def loc(self, site: str) -> Tensor:
        """The current iterate (the SGD/Adam point) at ``site``."""
        return attrgetter(site)(self.locs)

    def iterate(self) -> Tensor:
        """The concatenated current iterate ``θ`` `(d,)`."""
        return torch.cat([self.loc(s).detach().reshape(-1) for s in self.sites])

    def collect(self) -> None:
        """Add the current iterate to the SWAG moments."""
        new = swag_step(self.state, self.iterate())
        with torch.no_grad():
            self.swag_num_collected.copy_(new.num_collected)
            self.swag_mean.copy_(new.mean)
            self.swag_sq_mean.copy_(new.sq_mean)
            self.swag_deviations.copy_(new.deviations)

    def reset(self) -> None:
        """Forget the collected moments (the guide becomes unfitted)."""
        with torch.no_grad():
            for buf in (self.swag_mean, self.swag_sq_mean, self.swag_deviations):
                buf.zero_()
            self.swag_num_collected.zero_()
            self.swag_fitted.fill_(False)

    def posterior(self) -> dist.LowRankMultivariateNormal:
        """The joint ``LowRankMultivariateNormal`` over the concatenated vec of all sites."""
        self._require_fitted()
        return swag_posterior(self.state, self.scale)

    def _require_fitted(self) -> None:
        self._require_setup()
        if not self.is_fitted:
            raise RuntimeError(
                "SWAGGuide is not fitted; run pyrobayes.fit(model, guide, data, epochs=...) so it "
                "can collect SGD iterates (at least 2), or load a fitted posterior."
            )

    def _split(self, flat: Tensor) -> dict[str, Tensor]:
        lead = flat.shape[:-1]
        return {
            s: flat[..., a:b].reshape(*lead, *self.sites[s]) for s, (a, b) in self._offsets.items()
        }

    def _flatten(self, values: Mapping[str, Tensor]) -> Tensor:
        parts = []
        for s, shape in self.sites.items():
            v = values[s]
            parts.append(v.reshape(*v.shape[: v.dim() - len(shape)], -1))
        return torch.cat(parts, -1)

    # ------------------------------------------------------------------ guide contract
    def get_posterior(self, site: str) -> dist.Distribution:
        shape = self.sites[site]
        if self._fitting:
            loc = self.loc(site)
            return dist.Delta(loc, event_dim=loc.dim())
        full = self.posterior()
        a, b = self._offsets[site]
        marginal = dist.LowRankMultivariateNormal(
            full.loc[a:b], full.cov_factor[a:b], full.cov_diag[a:b]
        )
        return dist.TransformedDistribution(
            marginal, [ReshapeTransform(torch.Size([b - a]), torch.Size(shape))]
        )

    def _pyro_sample_sites(self) -> dict[str, Tensor]:
        if self._fitting:
            return super()._pyro_sample_sites()
        flat = pyro.sample(
            f"_{self._pyro_name}_latent", self.posterior(), infer={"is_auxiliary": True}
        )
        return {
            s: pyro.sample(s, dist.Delta(v, event_dim=len(self.sites[s])))
            for s, v in self._split(flat).items()
        }

    def rsample(self, num_samples: int = 1) -> dict[str, Tensor]:
        self._require_setup()
        if self._fitting:
            return {s: self.loc(s).expand(num_samples, *self.sites[s]) for s in self.sites}
        return self._split(self.posterior().rsample((num_samples,)))

    def log_prob(self, values: Mapping[str, Tensor]) -> Tensor:
        return self.posterior().log_prob(self._flatten(values))

    def mean(self) -> dict[str, Tensor]:
        self._require_fitted()
        return {s: v.detach().clone() for s, v in self._split(self.swag_mean).items()}

    def kl_to_prior(self, model: Any) -> Tensor:
        raise NotImplementedError("SWAG is fitted from SGD moments, not by an ELBO.")

    def posterior_storage(self) -> int:
        """Numbers that describe q: ``d`` (mean) + ``d`` (diagonal) + ``K d`` (deviations)."""
        self._require_setup()
        d = int(self.swag_mean.numel())
        return d * (2 + self.rank)

    # ------------------------------------------------------------------ fitting hooks
    def default_optimizer(
        self, params: list[torch.nn.Parameter], lr: float
    ) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            optim: torch.optim.Optimizer = torch.optim.SGD(params, lr=lr)
        else:
            optim = torch.optim.Adam(params, lr=lr)
        self._optimizer = optim
        if self.collect_every_steps is not None:
            optim.register_step_post_hook(self._after_step)
        return optim

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._steps += 1
        if (
            self._epochs_done >= self.start_epoch
            and self.collect_every_steps is not None
            and self._steps % self.collect_every_steps == 0
        ):
            self.collect()

    def _maybe_start_annealing(self) -> None:
        if self.swa_lr is None or self._scheduler is not None:
            return
        if self._optimizer is None:
            logger.warning("SWAGGuide: swa_lr needs the guide's default optimizer; not annealing.")
            return
        from torch.optim.swa_utils import SWALR

        self._scheduler = SWALR(
            self._optimizer,
            swa_lr=self.swa_lr,
            anneal_epochs=max(self.anneal_epochs, 1),
            anneal_strategy=self.anneal_strategy,
        )

    def fit_begin(self, model: Any, data: Any) -> None:
        self.reset()
        self._fitting = True
        self._optimizer, self._scheduler = None, None
        self._epochs_done, self._steps = 0, 0

    def epoch_end(self, model: Any, epoch: int) -> None:
        self._epochs_done = epoch + 1
        since = self._epochs_done - self.start_epoch
        if since == 0:
            self._maybe_start_annealing()
        if since <= 0:
            return
        if self.collect_every_steps is None and since % self.collect_every == 0:
            self.collect()
        self._maybe_start_annealing()
        if self._scheduler is not None:
            self._scheduler.step()

    def fit_end(self, model: Any, data: Any) -> None:
        self._fitting = False
        self._optimizer, self._scheduler = None, None
        if int(self.swag_num_collected) == 0 and self.sites:
            self.collect()  # a short run (num_steps < one epoch): keep at least the last iterate
        n = int(self.swag_num_collected)
        if n < 2:
            logger.warning(
                "SWAGGuide collected %d iterate(s); train for more epochs after start_epoch=%d.",
                n,
                self.start_epoch,
            )
        self.swag_fitted.fill_(n >= 1)
        logger.info("SWAG: %d iterates collected, rank %d, scale %g", n, self.rank, self.scale)
