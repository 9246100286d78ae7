r"""The guide contract shared by every posterior family.

A pyrobayes guide is a real Pyro guide (a :class:`pyro.infer.autoguide.AutoGuide`): ``SVI``,
``Predictive``, ``AutoGuideList`` and ``poutine.block`` work with it. On top of Pyro's contract it
offers the batched, RNG-explicit queries that prediction, objectives, export and I/O use, so those
never branch on the family:

=================================================  ==============================================
``forward(*args, **kwargs)``                       sample every latent site (Pyro contract)
``get_posterior(site)``                            q's marginal over one site (a Distribution)
``rsample(num_samples)``                           differentiable joint draws ``(S, *shape)``
``sample_posterior(num_samples, generator=None)``  joint draws without gradients, reproducible
``log_prob(values)``                               joint ``log q(θ_s)`` per draw ``(S,)``
``mean()`` / ``median()``                          point summaries per site
``validation_values()``                            draws ``(S, *shape)`` to validate on mid-fit
``config()``                                       JSON-able constructor options (for I/O)
=================================================  ==============================================

Joint structure lives in ``rsample`` / ``log_prob`` / ``_pyro_sample_sites``: a mixture of particles
or an ensemble draws a component once for all sites (an auxiliary Pyro site), and a permutation
wrapper symmetrizes ``log_prob``. A family that is fitted by its own procedure (SWAG, Laplace,
IVON) names it with ``default_objective`` and implements the hooks ``fit_begin`` /
``epoch_end`` / ``fit_end`` that :func:`pyrobayes.fit` calls.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, ClassVar

import pyro
import pyro.distributions as dist
import torch
from pyro.infer.autoguide import AutoGuide
from torch import Tensor
from torch.distributions import kl_divergence

logger = logging.getLogger(__name__)

__all__ = ["PosteriorGuide"]


class PosteriorGuide(AutoGuide):
    """Base class of all pyrobayes posteriors over the latent sites of a model.

    Parameters
    ----------
    model : callable
        Usually a :class:`~pyrobayes.models.FineTuneModel`, whose ``latent_sites`` let the guide
        set itself up at construction; any Pyro model works (set-up then happens on the first
        call, from a prototype trace, as in Pyro's autoguides).
    """

    #: registry name of the family
    family: ClassVar[str] = ""
    #: objective :func:`pyrobayes.fit` uses by default ("elbo", "map", or a family's own)
    default_objective: ClassVar[str] = "elbo"
    #: True for point-mass guides: one draw is the whole posterior
    is_deterministic: ClassVar[bool] = False

    def __init__(self, model: Any, **config: Any) -> None:
        super().__init__(model)
        self._config = dict(config)
        self.sites: dict[str, torch.Size] = {}
        latent_sites = getattr(model, "latent_sites", None)
        if latent_sites:
            self._setup_sites({s: model.site_value(s) for s in latent_sites})

    # ------------------------------------------------------------------ set-up
    def _setup_prototype(self, *args: Any, **kwargs: Any) -> None:
        super()._setup_prototype(*args, **kwargs)
        inits = {
            name: site["value"].detach()
            for name, site in self.prototype_trace.iter_stochastic_nodes()
        }
        self._setup_sites(inits)

    def _setup_sites(self, inits: Mapping[str, Tensor]) -> None:
        self.sites = {name: v.shape for name, v in inits.items()}
        for name, value in inits.items():
            self._setup_site(name, value)

    def _setup_site(self, site: str, init: Tensor) -> None:
        """Allocate the parameters of one site (called once per site, with its initial value)."""
        raise NotImplementedError

    def _require_setup(self) -> None:
        if not self.sites:
            raise RuntimeError(
                f"{type(self).__name__} has no sites yet: build it from a FineTuneModel, or call "
                "it once on a batch (guide(batch)) so it can trace the model."
            )

    def config(self) -> dict[str, Any]:
        """JSON-able constructor options; ``type(guide)(model, **guide.config())`` rebuilds it."""
        return dict(self._config)

    # ------------------------------------------------------------------ Pyro contract
    def forward(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        if not self.sites:
            self._setup_prototype(*args, **kwargs)
        return self._pyro_sample_sites()

    def _pyro_sample_sites(self) -> dict[str, Tensor]:
        """Emit one ``pyro.sample`` per site; joint families override this."""
        return {site: pyro.sample(site, self.get_posterior(site)) for site in self.sites}

    def get_posterior(self, site: str) -> dist.Distribution:
        """q's marginal over ``site``, with event shape equal to the site's shape."""
        raise NotImplementedError

    # ------------------------------------------------------------------ batched queries
    def rsample(self, num_samples: int = 1) -> dict[str, Tensor]:
        """Differentiable joint draws ``{site: (num_samples, *shape)}``."""
        self._require_setup()
        return {s: self.get_posterior(s).rsample((num_samples,)) for s in self.sites}

    def sample_posterior(
        self, num_samples: int, *, generator: torch.Generator | None = None
    ) -> dict[str, Tensor]:
        """Joint draws without gradients; the same ``generator`` state gives the same values.

        Parameters
        ----------
        num_samples : int
            S, the number of draws.
        generator : torch.Generator, optional
            Source of randomness; the global RNG when omitted.

        Returns
        -------
        dict
            ``{site: Tensor (num_samples, *site_shape)}``.
        """
        if num_samples < 1:
            raise ValueError(f"Expected num_samples >= 1 but got {num_samples}.")
        with torch.no_grad():
            if generator is None:
                return self.rsample(num_samples)
            # torch distributions do not take generators: run their sampler on a forked RNG
            seed = int(torch.randint(0, 2**62, (1,), generator=generator))
            devices = [self._device()] if self._device().type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                return self.rsample(num_samples)

    def log_prob(self, values: Mapping[str, Tensor]) -> Tensor:
        """Joint ``log q(θ_s)`` for draws ``values[site]: (S, *shape)`` → ``(S,)``."""
        self._require_setup()
        total = None
        for site in self.sites:
            lp = self.get_posterior(site).log_prob(values[site])
            total = lp if total is None else total + lp
        assert total is not None
        return total

    def kl_to_prior(self, model: Any) -> Tensor:
        """Analytic ``KL(q || p)`` summed over sites; ``NotImplementedError`` if unavailable."""
        total = None
        for site in self.sites:
            kl = kl_divergence(self.get_posterior(site), model.site_prior(site))
            total = kl if total is None else total + kl
        assert total is not None
        return total

    def mean(self) -> dict[str, Tensor]:
        """Posterior mean per site."""
        self._require_setup()
        with torch.no_grad():
            return {s: self.get_posterior(s).mean.detach() for s in self.sites}

    def median(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        """Posterior median per site (the mean for the symmetric families)."""
        return self.mean()

    def validation_values(self) -> dict[str, Tensor]:
        """Parameter values ``{site: (S, *shape)}`` that :func:`pyrobayes.fit` validates on.

        The point the optimizer is moving, ``loc`` (S = 1), so it is valid before a post-hoc
        family (SWAG, Laplace) is fitted; a mixture of particles or an ensemble returns its K
        members (S = K), whose average is its predictive.
        """
        self._require_setup()
        loc = getattr(self, "loc", None)
        with torch.no_grad():
            if callable(loc):
                return {s: loc(s).detach().unsqueeze(0) for s in self.sites}
            return {s: v.unsqueeze(0) for s, v in self.mean().items()}

    def num_posterior_parameters(self) -> int:
        """Numbers stored to describe the posterior (the guide's state)."""
        return sum(int(t.numel()) for t in self.state_dict().values())

    def _device(self) -> torch.device:
        for t in self.state_dict().values():
            return t.device
        return torch.device("cpu")

    # ------------------------------------------------------------------ fitting hooks
    def fit_begin(self, model: Any, data: Any) -> None:
        """Called by :func:`pyrobayes.fit` before the first step."""

    def epoch_end(self, model: Any, epoch: int) -> None:
        """Called by :func:`pyrobayes.fit` after each epoch (SWAG collects moments here)."""

    def fit_end(self, model: Any, data: Any) -> None:
        """Called by :func:`pyrobayes.fit` after training (Laplace fits its curvature here)."""
