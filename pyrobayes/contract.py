r"""The guide contract, written down: what every posterior offers and the optional capabilities.

Every pyrobayes posterior is a Pyro guide (an :class:`~pyro.infer.autoguide.AutoGuide`) that also
satisfies :class:`Posterior`. Prediction, metrics, export, I/O and the objectives use only these
names, so they never branch on the family. A third-party family joins by satisfying
:class:`Posterior` (inheriting :class:`~pyrobayes.guides.PosteriorGuide` is the easy way) and
registering with :func:`pyrobayes.register_guide`.

Optional capabilities are separate protocols, checked with ``isinstance`` where they are used:

=========================  =====================================================================
:class:`AnalyticKL`        closed-form ``KL(q ‖ p)``; the ELBO uses it instead of a Monte Carlo KL
:class:`PostHoc`           fitted after (Laplace) or along (SWAG) a MAP run over its point ``loc``
:class:`OnlineNewton`      a Gaussian whose mean and curvature a variational online Newton fitter
                           (IVON, Kronecker IVON) updates in a closure-driven step
:class:`Symmetrized`       q symmetrized over a permutation group of the model; offers the
                           InfoNCE term ``I_K`` its objective adds to the ELBO
:class:`Mixture`           an equal-weight mixture of K components (particles, ensembles): export
                           maps the components to ArviZ chains, particle fitters read them
`LinearizedPredictive`     a Gaussian whose predictive is the network linearised at its point
                           (Laplace's GLM predictive); ``pyrobayes.predict`` evaluates it
=========================  =====================================================================

How a family is *fitted* is not part of the posterior: the guide names its fitter
(``default_fitter``, a key of :data:`pyrobayes.infer.FITTERS`) and :mod:`pyrobayes.infer` holds
the statistics, hooks and optimizer state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

import pyro.distributions as dist
import torch
from torch import Tensor

__all__ = [
    "POSTERIOR_METHODS",
    "Posterior",
    "AnalyticKL",
    "PostHoc",
    "OnlineNewton",
    "Mixture",
    "LinearizedPredictive",
    "Symmetrized",
    "implements",
    "bound_model",
]


@runtime_checkable
class Posterior(Protocol):
    r"""What every posterior offers: ``q(θ)`` over the latent sites of a model.

    Attributes
    ----------
    family : str
        The registry name (``"meanfield"``, ``"kron-ivon"``, ...).
    default_fitter : str
        The key of :data:`pyrobayes.infer.FITTERS` that fits this family by default.
    default_objective : str
        The objective the ``"svi"`` fitter uses (``"elbo"`` or ``"map"``).
    is_deterministic : bool
        True for point masses: one draw is the whole posterior.
    sites : dict
        ``{site: shape}`` of the latent sites q covers (empty until set up).
    """

    family: ClassVar[str]
    default_fitter: ClassVar[str]
    default_objective: ClassVar[str]
    is_deterministic: ClassVar[bool]
    sites: dict[str, torch.Size]

    def get_posterior(self, site: str) -> dist.TorchDistribution:
        """q's marginal over ``site`` (event shape = the site's shape)."""
        ...

    def rsample(self, num_samples: int = 1) -> dict[str, Tensor]:
        """Differentiable joint draws ``{site: (num_samples, *shape)}``."""
        ...

    def sample_posterior(
        self, num_samples: int, *, generator: torch.Generator | None = None
    ) -> dict[str, Tensor]:
        """Joint draws without gradients; the same ``generator`` state gives the same values."""
        ...

    def log_prob(self, values: Mapping[str, Tensor]) -> Tensor:
        """Joint ``log q(θ_s)`` of draws ``values[site]: (S, *shape)`` → ``(S,)``."""
        ...

    def mean(self) -> dict[str, Tensor]:
        """Posterior mean per site."""
        ...

    def median(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        """Posterior median per site."""
        ...

    def validation_values(self) -> dict[str, Tensor]:
        """Parameter values ``{site: (S, *shape)}`` to validate on mid-fit."""
        ...

    def config(self) -> dict[str, Any]:
        """JSON-able constructor options: ``type(guide)(model, **guide.config())`` rebuilds it."""
        ...

    def num_posterior_parameters(self) -> int:
        """Numbers stored to describe q (what a saved posterior holds, less bookkeeping)."""
        ...


#: The methods of :class:`Posterior`, which :func:`pyrobayes.register_guide` requires of a class
#: (its attributes ``family``, ``sites``, ... may be set by the constructor, so are not checked).
POSTERIOR_METHODS: tuple[str, ...] = (
    "get_posterior",
    "rsample",
    "sample_posterior",
    "log_prob",
    "mean",
    "median",
    "validation_values",
    "config",
    "num_posterior_parameters",
)


@runtime_checkable
class AnalyticKL(Protocol):
    r"""A posterior with a closed-form ``KL(q ‖ p)`` to the model's prior.

    ``kl_to_prior`` may still raise ``NotImplementedError`` for a prior it has no formula for;
    the ELBO then falls back to the Monte Carlo estimate ``E_q[log q − log p]``.
    """

    def kl_to_prior(self, model: Any) -> Tensor:
        """``Σ_sites KL(q ‖ p)``."""
        ...

    def rsample_with_kl(self, num_samples: int, model: Any) -> tuple[dict[str, Tensor], Tensor]:
        """``(rsample(num_samples), kl_to_prior(model))`` in one pass (the ELBO's hot path)."""
        ...


@runtime_checkable
class PostHoc(Protocol):
    r"""A posterior built from a MAP run over its point ``loc`` (SWAG, Laplace).

    While it is being fitted the MAP objective trains ``loc``; the posterior itself is available
    once ``is_fitted`` (before that, sampling raises a clear error).
    """

    @property
    def is_fitted(self) -> bool:
        """Whether the posterior has been fitted (or loaded)."""
        ...

    def loc(self, site: str) -> Tensor:
        """The point (a trainable parameter) at ``site``."""
        ...

    def reset(self) -> None:
        """Forget the fitted state: the guide is unfitted until its fitter finishes again."""
        ...


@runtime_checkable
class OnlineNewton(Protocol):
    r"""A Gaussian ``N(m, [λ(H + δ)]^{-1})`` whose mean ``m`` and curvature ``H`` a variational
    online Newton fitter updates (IVON, Shen et al., 2024; Kronecker IVON with ``H = A ⊗ G`` per
    weight, as Noisy K-FAC, Zhang et al., 2018).

    The guide owns ``m`` (trainable parameters), the curvature (buffers: the diagonal ``h``, or
    the Kronecker factors and their eigendecompositions) and the map from standard-normal noise
    to ``θ − m``; the fitter (:mod:`pyrobayes.infer.ivon`, :mod:`pyrobayes.infer.kron`) owns the
    gradient and curvature statistics, the momentum and the update, and writes ``m`` and the
    curvature in place.

    Attributes
    ----------
    ess : float
        λ, the effective sample size.
    weight_decay : float
        δ, the prior precision per unit ``ess``.
    hyper : dict
        The posterior's constants the update reads (``ess``, ``hess_init``, ``weight_decay``,
        ``point_weight_decay``, ``point_prior_loc``); the optimizer's settings (``lr``, the β's,
        the clip radius, the draws per step, ...) are the fitter's (:class:`pyrobayes.infer.IVON`).
    state_dtype : torch.dtype
        The dtype of ``m`` and the curvature (float32 for half-precision weights).
    param_dtype : dict
        The weight dtype per site (draws are cast to it).
    """

    ess: float
    weight_decay: float
    hyper: dict[str, Any]
    state_dtype: torch.dtype
    param_dtype: dict[str, torch.dtype]

    def loc_param(self, site: str) -> Tensor:
        """The trainable tensor holding ``m`` at ``site``."""
        ...

    def hess(self, site: str) -> Tensor:
        """The diagonal curvature ``h`` at a diagonal ``site`` (a buffer, updated in place)."""
        ...

    def is_kron(self, site: str) -> bool:
        """Whether ``site``'s curvature is Kronecker-factored (else diagonal)."""
        ...

    def tensors(self) -> tuple[list[Tensor], list[Tensor | None]]:
        """``m`` and ``h`` (``None`` at a Kronecker site) of every site, in site order."""
        ...

    def perturbation(self, eps: Tensor) -> Tensor:
        """``θ − m`` for standard-normal ``eps`` `(S, T)` over all sites laid flat."""
        ...


@runtime_checkable
class LinearizedPredictive(Protocol):
    r"""A Gaussian posterior ``N(θ̂, Σ)`` whose predictive is that of the linearised network
    (the GLM predictive; MacKay 1992, Immer et al. 2021, eq. 5):

    .. math:: f_{\rm lin}(x; θ) = f(x; θ̂) + J(x)\,(θ - θ̂),\qquad J(x) = ∂f(x; θ)/∂θ\,|_{θ̂}.

    :func:`pyrobayes.predict` evaluates it (:mod:`pyrobayes.linearized`) unless
    ``pred_type == "nn"`` (then it samples the network at draws of q, as for every family).

    Attributes
    ----------
    pred_type : {"glm", "probit", "nn"}
        ``"glm"``: classification by Monte Carlo over ``softmax(f_lin(x; θ_s))``, ``θ_s ~ q``;
        regression by the exact Gaussian ``N(f(x; θ̂), J Σ Jᵀ + σ²)``. ``"probit"``:
        classification by the probit approximation ``softmax(f / sqrt(1 + π/8 diag(JΣJᵀ)))``
        (regression as ``"glm"``). ``"nn"``: sample the network.
    link_samples : int or None
        Draws ``θ_s`` of the ``"glm"`` classification Monte Carlo, independent of the network
        draws S of :func:`pyrobayes.predict` (each costs one ``J (θ_s − θ̂)`` product once ``J``
        is formed; laplace-torch draws 100); ``None``: predict's ``num_samples``.
    """

    pred_type: str
    link_samples: int | None

    def linearization_point(self) -> dict[str, Tensor]:
        """``θ̂`` per site (detached): where the network is linearised."""
        ...

    def functional_covariance(self, jacobians: Mapping[str, Tensor]) -> Tensor:
        """``J Σ Jᵀ`` `(B, K, K)` from per-site Jacobians ``{site: (B, K, *site_shape)}``."""
        ...


@runtime_checkable
class Mixture(Protocol):
    r"""An equal-weight mixture ``q(θ) = (1/K) Σ_k q_k(θ)`` with ``q_k = N(μ_k, σ² I)`` (σ fixed,
    0 for point particles).

    Its ``sample_posterior(S)`` is stratified (each block of K consecutive draws visits every
    component once), so a predictive average over S = a multiple of K draws weighs the components
    exactly equally.

    Attributes
    ----------
    num_components : int
        K.
    component_scale : float
        σ, the standard deviation of every component (0: point masses).
    average : {"probs", "logits"}
        How :func:`pyrobayes.predict` combines a classifier's draws: the mixture predictive
        (probabilities averaged), or ``softmax`` of the averaged logits (one prediction, S = 1).
    """

    num_components: int
    component_scale: float
    average: str

    def component_locs(self) -> dict[str, Tensor]:
        """``{site: (K, *shape)}``: the components' locations, the trainable tensors themselves."""
        ...

    def sample_components(
        self, num_per_component: int, *, generator: torch.Generator | None = None
    ) -> dict[str, Tensor]:
        """Draws grouped by component, ``{site: (K, n, *shape)}``, without gradients."""
        ...


@runtime_checkable
class Symmetrized(Protocol):
    r"""A posterior ``q`` over a model with a permutation symmetry group ``G``, standing for its
    symmetrization ``q_G(θ) = (1/|G|) Σ_g q(g⁻¹·θ)`` (Gelberg et al., 2024).

    Draws, predictions and ``log_prob`` are q's (the predictive of ``q_G`` equals q's); the
    objective adds the InfoNCE estimate of ``I(g; θ) = KL(q ‖ q_G)`` to q's ELBO.

    Attributes
    ----------
    num_permutations : int
        K, the group elements per draw (the identity and K − 1 uniform ones).
    """

    num_permutations: int

    def infonce(self, values: Mapping[str, Tensor], num_permutations: int | None = None) -> Tensor:
        """``I_K`` per draw ``(S,)``: ``log q(θ_s) − logsumexp_k log q(h_k·θ_s) + log K``."""
        ...


_IMPLEMENTS: dict[tuple[type, type], bool] = {}


def implements(obj: Any, protocol: type) -> bool:
    """``isinstance(obj, protocol)``, decided once per class (the hot paths ask every step).

    A protocol check inspects every member of the protocol (microseconds); the families'
    capabilities are their classes' methods, so the first instance's answer holds for its class.
    """
    key = (type(obj), protocol)
    hit = _IMPLEMENTS.get(key)
    if hit is None:
        hit = _IMPLEMENTS[key] = isinstance(obj, protocol)
    return hit


def bound_model(guide: Any) -> Any:
    """The model ``guide`` was built on (``guide.model``), or ``None``: a guide without one, or
    an AutoGuide whose model reference was dropped (pickling), whose ``.model`` raises."""
    try:
        return getattr(guide, "model", None)
    except TypeError:
        return None
