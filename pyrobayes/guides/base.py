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
wrapper symmetrizes ``log_prob``. The contract is written as protocols in
:mod:`pyrobayes.contract`. A guide is only the posterior: how it is fitted lives in
:mod:`pyrobayes.infer`, and the guide names its fitter with ``default_fitter``.

The base class also owns the per-site parameter boilerplate (:meth:`PosteriorGuide._add_param`,
``loc(site)``, ``loc_param(site)``) and records its constructor's options for :meth:`config`.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import itertools
import logging
from collections.abc import Mapping
from operator import attrgetter
from typing import Any, ClassVar

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.infer.autoguide import AutoGuide
from pyro.infer.autoguide.utils import deep_setattr
from pyro.nn import PyroModule, PyroParam
from torch import Tensor
from torch.distributions import kl_divergence

from ..rng import seed_forked

logger = logging.getLogger(__name__)

__all__ = ["PosteriorGuide", "SitewiseKL", "unique_pyro_name", "forget_pyro_params"]

_INSTANCES = itertools.count()


def _bad_options_message(cls: type, err: TypeError, given: Mapping[str, Any]) -> str:
    """``err`` of a constructor call, with the family, the nearest valid option and the list."""
    options: set[str] = set()
    for klass in cls.__mro__:  # the families' own constructors (recording ones)
        init = klass.__dict__.get("__init__")
        if init is None or not getattr(init, "_records_config", False):
            continue
        with contextlib.suppress(TypeError, ValueError):
            for name, param in list(inspect.signature(init).parameters.items())[2:]:
                if param.kind in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD):
                    options.add(name)
    unknown = [k for k in given if k not in options]
    hints = []
    for key in unknown:
        near = difflib.get_close_matches(key, sorted(options), n=1)
        if near:
            hints.append(f"{key!r}: did you mean {near[0]!r}?")
    return (
        f"{cls.__name__}: {str(err).split('() ', 1)[-1]}. "
        + (" ".join(hints) + " " if hints else "")
        + f"Its options: {', '.join(sorted(options)) or 'none'}."
    )


def unique_pyro_name(prefix: str) -> str:
    """``"<prefix>_<n>"``, unique within the process: the param-store name of one instance."""
    return f"{prefix}_{next(_INSTANCES)}"


def forget_pyro_params(name: str) -> None:
    """Drop the param store's entries under ``name.`` (the store re-adopts the module's tensors
    on the next Pyro call)."""
    store = pyro.get_param_store()
    for key in [k for k in store.keys() if k.startswith(name + ".")]:
        del store[key]


def _plain_option(value: Any) -> Any:
    """``value`` with NumPy scalars and 0-d tensors as Python numbers, inside lists too.

    A guide's options are written to its files' JSON header (:meth:`PosteriorGuide.config`):
    ``rank=np.int64(3)`` or ``init_scale=torch.tensor(0.02)`` pass the constructor's checks, and
    are recorded as the ``int`` / ``float`` / ``bool`` they hold. Other values are returned as
    they are.

    Parameters
    ----------
    value : Any
        One constructor option as given.

    Returns
    -------
    Any
        ``value.item()`` for a NumPy scalar or a 0-d tensor; a tuple, list or dict with its
        items converted; ``value`` otherwise.
    """
    if isinstance(value, Tensor):
        return value.item() if value.dim() == 0 else value
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return value.item()  # np.int64, np.float32, np.bool_, 0-d arrays
    if isinstance(value, list):
        return [_plain_option(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain_option(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain_option(v) for k, v in value.items()}
    return value


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
    #: the fitter that fits this family by default (a key of ``pyrobayes.infer.FITTERS``)
    default_fitter: ClassVar[str] = "svi"
    #: the objective of the ``"svi"`` fitter: ``"elbo"`` or ``"map"``
    default_objective: ClassVar[str] = "elbo"
    #: True for point-mass guides: one draw is the whole posterior
    is_deterministic: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # record the options of the outermost constructor call for config(): a family's
        # __init__ never re-passes its keyword arguments to the base
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None or getattr(init, "_records_config", False):
            return
        signature = inspect.signature(init)

        @functools.wraps(init)
        def recording_init(self: Any, *args: Any, **kw: Any) -> None:
            # every level of the constructor chain adds its options (defaults included); the
            # outermost call's values win
            try:
                bound = signature.bind(self, *args, **kw)
            except TypeError as err:  # an unknown or misspelt option: name it and its neighbours
                raise TypeError(_bad_options_message(type(self), err, kw)) from None
            bound.apply_defaults()
            options = self.__dict__.setdefault("_config", {})
            for name, value in list(bound.arguments.items())[2:]:  # past self and model
                kind = signature.parameters[name].kind
                if kind is inspect.Parameter.VAR_KEYWORD:
                    for key, item in value.items():
                        options.setdefault(key, _plain_option(item))
                elif kind is not inspect.Parameter.VAR_POSITIONAL:
                    options.setdefault(name, _plain_option(value))
            init(self, *args, **kw)

        recording_init._records_config = True  # type: ignore[attr-defined]
        cls.__init__ = recording_init  # type: ignore[method-assign]

    def __getstate__(self) -> dict[str, Any]:
        """The state a copy or pickle takes, the model with it; the guide itself untouched.

        Pyro's ``AutoGuide.__getstate__`` clears the model reference (and the master weakref)
        on the guide itself, so ``copy.deepcopy(guide)`` used to leave the *original* without its
        model (its next fit or predict raised ``'NoneType' object is not subscriptable``) and the
        copy without one too. Here the original keeps both; the copy carries its model: a deep
        copy of the model, or the copied model when both are copied together
        (``copy.deepcopy((model, guide))``), as ``copy.deepcopy`` promises.
        """
        model, master = self._model, self.master
        state = dict(super().__getstate__())
        self._model, self.master = model, master
        state["_model"] = model
        return state

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        # a name of its own: Pyro's param store keys this guide's parameters by it, so another
        # guide (of any family, on any model) can never swap its tensors into this one
        self._pyro_name = unique_pyro_name(type(self).__name__)
        self.__dict__.setdefault("_config", {})
        self.sites: dict[str, torch.Size] = {}
        latent_sites = getattr(model, "latent_sites", None)
        if latent_sites:
            self._setup_sites({s: model.site_value(s) for s in latent_sites})

    # ------------------------------------------------------------------ set-up
    def _setup_prototype(self, *args: Any, **kwargs: Any) -> None:
        super()._setup_prototype(*args, **kwargs)
        if self.prototype_trace is None:  # set by AutoGuide._setup_prototype
            raise RuntimeError(f"{type(self).__name__}: tracing the model gave no sites.")
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

    def require_setup(self) -> None:
        """Raise a clear error when the guide has no sites yet."""
        if not self.sites:
            raise RuntimeError(
                f"{type(self).__name__} has no sites yet: build it from a FineTuneModel, or call "
                "it once on a batch (guide(batch)) so it can trace the model."
            )

    def config(self) -> dict[str, Any]:
        """JSON-able constructor options; ``type(guide)(model, **guide.config())`` rebuilds it."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self._config.items()}

    # ------------------------------------------------------------------ per-site parameters
    def _add_param(
        self,
        holder: str,
        site: str,
        value: Tensor,
        constraint: constraints.Constraint = constraints.real,
    ) -> None:
        """Register ``value`` as the Pyro parameter ``<holder>.<site>`` (e.g. ``locs.<site>``)."""
        if holder not in self._modules:
            setattr(self, holder, PyroModule())
        deep_setattr(
            getattr(self, holder), site, PyroParam(value, constraint, event_dim=value.dim())
        )

    def _raw_param(self, holder: str, site: str) -> Tensor:
        """The unconstrained tensor behind ``<holder>.<site>`` (no Pyro lookup)."""
        parent, _, leaf = site.rpartition(".")
        module = self._modules.get(holder)
        holder_module = module.get_submodule(parent) if module is not None and parent else module
        param = (
            None
            if holder_module is None
            else holder_module._parameters.get(leaf + "_unconstrained")
        )
        if param is None:  # PyroParam stores <leaf>_unconstrained as a Parameter
            raise KeyError(f"{type(self).__name__} has no parameter {holder}.{site}.")
        return param

    def loc(self, site: str) -> Tensor:
        """The location parameter at ``site`` (families with a per-site ``locs`` holder)."""
        return attrgetter(site)(self.locs)

    def loc_param(self, site: str) -> Tensor:
        """The trainable tensor behind :meth:`loc` (what an optimizer updates)."""
        return self._raw_param("locs", site)

    # ------------------------------------------------------------------ Pyro contract
    def forward(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        if not self.sites:
            self._setup_prototype(*args, **kwargs)
        return self._pyro_sample_sites()

    def _pyro_sample_sites(self) -> dict[str, Tensor]:
        """Emit one ``pyro.sample`` per site; joint families override this."""
        return {site: pyro.sample(site, self.get_posterior(site)) for site in self.sites}

    def get_posterior(self, site: str) -> dist.TorchDistribution:
        """q's marginal over ``site``, with event shape equal to the site's shape."""
        raise NotImplementedError

    # ------------------------------------------------------------------ batched queries
    def rsample(self, num_samples: int = 1) -> dict[str, Tensor]:
        """Differentiable joint draws ``{site: (num_samples, *shape)}``."""
        self.require_setup()
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
            device = self.device
            devices = [device] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                seed_forked(seed, device)  # the forked generators only (not every GPU's)
                return self.rsample(num_samples)

    def log_prob(self, values: Mapping[str, Tensor]) -> Tensor:
        """Joint ``log q(θ_s)`` for draws ``values[site]: (S, *shape)`` → ``(S,)``."""
        self.require_setup()
        total = None
        for site in self.sites:
            lp = self.get_posterior(site).log_prob(values[site])
            total = lp if total is None else total + lp
        if total is None:
            raise RuntimeError(f"{type(self).__name__}.log_prob: the guide has no sites.")
        return total

    def mean(self) -> dict[str, Tensor]:
        """Posterior mean per site."""
        self.require_setup()
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
        self.require_setup()
        with torch.no_grad():
            if "locs" in self._modules:
                return {s: self.loc(s).detach().unsqueeze(0) for s in self.sites}
            return {s: v.unsqueeze(0) for s, v in self.mean().items()}

    def num_posterior_parameters(self) -> int:
        """Numbers stored to describe the posterior (the guide's state)."""
        return sum(int(t.numel()) for t in self.state_dict().values())

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # .to(device) / .double() replace the parameter objects: forget the param store's
        # entries of this guide, so the next Pyro call adopts the new tensors instead of
        # swapping the old ones back in
        result = super()._apply(fn, *args, **kwargs)
        forget_pyro_params(self._pyro_name)
        return result

    @property
    def device(self) -> torch.device:
        """Where the guide's state lives (CPU when it has none yet)."""
        for t in self.state_dict().values():
            return t.device
        return torch.device("cpu")


class SitewiseKL(PosteriorGuide):
    r"""A posterior that factorises over sites, with ``KL(q ‖ p) = Σ_sites KL(q_site ‖ p_site)``.

    Gives a family the :class:`~pyrobayes.contract.AnalyticKL` capability through
    ``torch.distributions.kl_divergence`` of each site's marginal against the model's prior
    (``NotImplementedError`` when no formula is registered for the pair).
    """

    def kl_to_prior(self, model: Any) -> Tensor:
        """``Σ_sites KL(q_site ‖ p_site)``."""
        self.require_setup()
        total = None
        for site in self.sites:
            kl = kl_divergence(self.get_posterior(site), model.site_prior(site))
            total = kl if total is None else total + kl
        if total is None:
            raise RuntimeError(f"{type(self).__name__}.kl_to_prior: the guide has no sites.")
        return total

    def rsample_with_kl(self, num_samples: int, model: Any) -> tuple[dict[str, Tensor], Tensor]:
        """``(rsample(num_samples), kl_to_prior(model))``; the KL first (it may raise)."""
        kl = self.kl_to_prior(model)
        return self.rsample(num_samples), kl
