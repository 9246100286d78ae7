r"""Permutation-invariant (symmetrized) posterior: ``q_G(θ) = (1/|G|) Σ_{g∈G} q(g⁻¹·θ)``.

Weight-space permutations (hidden units of an MLP, the rank axis of LoRA) leave the network's
function and an iid prior unchanged, so the posterior has ``|G|`` equivalent modes. A unimodal
``q`` cannot cover them and mode-seeking VI is pulled toward symmetric, under-used regions where
the copies overlap. The symmetrized family ``q_G`` (the law of ``g·θ₀``, ``θ₀ ~ q``,
``g ~ Unif(G)``) has (Gelberg et al., 2024, "Variational Inference Failures Under Model
Symmetries", Sec. 4)

.. math::

    \mathrm{ELBO}(q_G) = \mathrm{ELBO}(q) + I(g; θ),\qquad I(g;θ) = \mathrm{KL}(q\,\|\,q_G),

estimated by InfoNCE over K group elements (the identity and K − 1 uniform draws ``h_k``)

.. math::

    I_K = \mathbb E\Big[\log q(θ_0) - \log\tfrac1K\textstyle\sum_{k=1}^{K} q(h_k·θ_0)\Big]
    \le \min(I, \log K).

The predictive of ``q_G`` equals ``q``'s (``f(x; g·θ) = f(x; θ)``), so this guide samples,
predicts, reports ``log_prob`` and saves as its base ``q``; only the objective changes
(:class:`pyrobayes.infer.symmetrized.SymmetrizedELBO`).
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import Any, ClassVar

import pyro.distributions as dist
import torch
from torch import Tensor

from ..batch import batch_size, slice_examples, split_batch
from ..contract import AnalyticKL, implements
from ..models.adapters import check_int, check_real
from ..models.permutation import PermutationSpec
from ..registry import get_guide_class
from ._fit_options import warn_fit_settings
from .base import PosteriorGuide
from .meanfield import MeanFieldGuide

__all__ = ["SymmetrizedGuide", "INERT_LOG_RATIO"]

logger = logging.getLogger(__name__)

#: merges one process's ``{unit layer: (change, tolerance)}`` with the other processes'
#: (:meth:`SymmetrizedGuide.recording_calls`)
Agreement = Callable[[dict[str, tuple[float, float]]], dict[str, tuple[float, float]]]

#: the block of :meth:`SymmetrizedGuide.recording_calls` once the first forward was checked
_NO_CHECK = nullcontext()

#: rows of the first batch on which each unit layer's symmetry is measured (a few forwards of
#: them, once per fit): enough for a residual or a stray weight to move some output
CHECK_ROWS = 8

#: log(1e-8): a permuted copy of q below this log density ratio at θ₀ carries no usable gradient.
INERT_LOG_RATIO = math.log(1e-8)


class SymmetrizedGuide(PosteriorGuide):
    r"""A base posterior ``q`` symmetrized over the model's unit permutations.

    .. math:: q_G(θ) = \frac1{|G|}\sum_{g∈G} q(g^{-1}·θ),\qquad
              G = S_{n_1}×…×S_{n_H}\ \text{(hidden units, LoRA rank axes)}

    Fitted by :func:`pyrobayes.fit` with the batched objective
    :class:`~pyrobayes.infer.symmetrized.BatchedSymmetrizedELBO` (``"symmetrized-elbo"``;
    :class:`~pyrobayes.infer.symmetrized.SymmetrizedELBO` is the same loss for Pyro's ``SVI``):
    ``L_K = E_q log p(D|θ) − KL(q‖p) + I_K`` (the base's analytic KL when it has one; Gelberg
    et al. 2024, Sec. 4).

    Parameters
    ----------
    model : FineTuneModel
        With a permutation symmetry (:meth:`PermutationSpec.from_model`): LoRA factors or a
        latent MLP (``latent_modules=[...]``). LoRA-XS cores have none.
    base : str
        The family of ``q``: one fitted by the reparameterized ELBO whose ``log_prob`` is
        tractable (``"meanfield"``). Point masses (``"map"``), post-hoc families (``"swag"``,
        ``"laplace"``) and families with their own natural-gradient fitter (``"ivon"``,
        ``"kron-ivon"``: Gaussian ``log_prob``, but their update takes no extra loss term) are
        refused.
    num_permutations : int, optional
        Deprecated here: the objective's K is a setting of the fit, not of the posterior. Pass
        it to the fitter as ``pb.fit(..., optim=pb.Optimization(optimizer=pb.infer.Symmetrized(
        num_permutations=16)))`` (:class:`pyrobayes.infer.symmetrized.Symmetrized`, which
        documents it); given here it still reaches the fitter for one release, with a
        ``DeprecationWarning``, and is not saved with the posterior.
    **base_options
        The base family's options (e.g. ``init_scale=0.01``). A ``scale_lr`` here (the base's
        scale learning-rate factor) is deprecated as ``num_permutations`` is: it is the fit's
        (``pb.infer.Symmetrized(scale_lr=...)``).

    Attributes
    ----------
    num_permutations : int
        K of direct :meth:`infonce` calls that pass none (the deprecated keyword, else 16); a
        fit uses its settings' K.

    Examples
    --------
    >>> guide = pb.posterior(model, "symmetrized", base="meanfield", init_scale=1e-3)  # doctest: +SKIP
    >>> K = pb.Optimization(optimizer=pb.infer.Symmetrized(num_permutations=16))  # doctest: +SKIP
    >>> pb.fit(model, guide, loader, epochs=10, optim=K).state["terms"]  # doctest: +SKIP
    """

    family = "symmetrized"
    default_objective = "symmetrized-elbo"
    #: constructor options that are the fit's, not the posterior's: accepted for one release
    #: (``DeprecationWarning``), handed to the fitter, never saved with the posterior
    fit_options: ClassVar[tuple[str, ...]] = ("num_permutations", "scale_lr")
    #: the :mod:`pyrobayes.infer` settings class that takes ``fit_options`` now
    fit_settings_class: ClassVar[str] = "Symmetrized"

    def __init__(
        self,
        model: Any,
        *,
        base: str = "meanfield",
        num_permutations: int | None = None,
        **base_options: Any,
    ) -> None:
        owner = f"{type(self).__name__}: "
        given: dict[str, Any] = {}
        if num_permutations is not None:  # checked by name before the warning
            given["num_permutations"] = check_int(
                "num_permutations", num_permutations, ge=1, owner=owner
            )
        scale_lr = base_options.pop("scale_lr", None)
        if scale_lr is not None:
            given["scale_lr"] = check_real("scale_lr", scale_lr, gt=0, owner=owner)
        #: fit settings passed to the constructor (deprecated): the fitter's defaults
        self.fit_settings: dict[str, Any] = given
        warn_fit_settings(owner, given, self.fit_settings_class)
        if not isinstance(base, str):
            raise TypeError(f"{owner}base must be a family name such as 'meanfield'; got {base!r}.")
        base_cls = get_guide_class(base)
        _check_base(base_cls, base)
        super().__init__(model)
        try:  # the base's options first: a misspelt one is named before the spec is built
            base_guide = base_cls(model, **base_options)
        except TypeError as err:
            raise TypeError(
                f"{type(self).__name__}(base={base!r}): {err} {type(self).__name__}'s own "
                "options: base, num_permutations."
            ) from None
        self.base = base_guide
        self.base_family = str(getattr(base_cls, "family", base))
        self.num_permutations = int(given.get("num_permutations", 16))
        self.spec = PermutationSpec.from_model(model)
        _check_nontrivial(self.spec, self.base_family)
        self.sites = dict(base_guide.sites)
        missing = sorted(self.spec.sites - set(self.sites))
        if missing:
            raise RuntimeError(f"Permuted sites {missing[:3]} are not latent; please report.")

    def __getstate__(self) -> dict[str, Any]:
        """The base class's state without the scratch buffers of :meth:`_relative_log_prob`
        (a copy or pickle allocates its own when it evaluates ``I_K``)."""
        state = super().__getstate__()
        state.pop("_workspace", None)
        return state

    def _setup_sites(self, inits: Mapping[str, Tensor]) -> None:
        # the base allocates the parameters; the sites are copied from it in __init__
        pass

    def config(self) -> dict[str, Any]:
        """``{"base", **base.config()}``: rebuilds the wrapper and its base (the deprecated fit
        settings left out)."""
        options = {"base": self.base_family, **self.base.config()}
        return {k: v for k, v in options.items() if k not in self.fit_options}

    # ------------------------------------------------------------------ as the base
    def forward(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        return self.base(*args, **kwargs)

    def get_posterior(self, site: str) -> dist.TorchDistribution:
        """The base q's marginal over ``site`` (draws come from q; q_G predicts the same)."""
        return self.base.get_posterior(site)

    def rsample(self, num_samples: int = 1) -> dict[str, Tensor]:
        return self.base.rsample(num_samples)

    def sample_posterior(
        self, num_samples: int, *, generator: torch.Generator | None = None
    ) -> dict[str, Tensor]:
        return self.base.sample_posterior(num_samples, generator=generator)

    def log_prob(self, values: Mapping[str, Tensor]) -> Tensor:
        """``log q(θ_s)`` of the base, the density of this guide's draws (for importance
        weights); :meth:`symmetrized_log_prob` gives ``log q_G``."""
        return self.base.log_prob(values)

    def mean(self) -> dict[str, Tensor]:
        return self.base.mean()

    def median(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        return self.base.median(*args, **kwargs)

    def validation_values(self) -> dict[str, Tensor]:
        return self.base.validation_values()

    def loc(self, site: str) -> Tensor:
        return self.base.loc(site)

    def loc_param(self, site: str) -> Tensor:
        return self.base.loc_param(site)

    def num_posterior_parameters(self) -> int:
        return self.base.num_posterior_parameters()

    def optimizer_groups(self, params: list[Tensor], lr: float, scale_lr: float = 1.0) -> list[Any]:
        """The base's parameter groups for the default optimizer (mean-field: the scales at
        ``scale_lr · lr``, the fit's), so the symmetrized fit steps as its base's."""
        groups = getattr(self.base, "optimizer_groups", None)
        return groups(params, lr, scale_lr) if callable(groups) else [{"params": list(params)}]

    # ------------------------------------------------------------------ AnalyticKL (the base's)
    def kl_to_prior(self, model: Any) -> Tensor:
        """The base's ``KL(q ‖ p)`` (``NotImplementedError`` when it has no closed form)."""
        if not implements(self.base, AnalyticKL):
            raise NotImplementedError(f"{type(self.base).__name__} has no closed-form KL.")
        return self.base.kl_to_prior(model)

    def rsample_with_kl(self, num_samples: int, model: Any) -> tuple[dict[str, Tensor], Tensor]:
        """The base's ``(rsample(num_samples), kl_to_prior(model))``."""
        if not implements(self.base, AnalyticKL):
            raise NotImplementedError(f"{type(self.base).__name__} has no closed-form KL.")
        return self.base.rsample_with_kl(num_samples, model)

    # ------------------------------------------------------------------ the network's calls
    def recording_calls(
        self, model: Any = None, batch: Any = None, *, agree: Agreement | None = None
    ) -> AbstractContextManager[None]:
        """A block that checks, on the first network forward of a fit (run inside it), the
        symmetry of the hidden units the structure suggests, and leaves those that break it
        out of the group.

        Two things can break it where the structure cannot tell: a parent that calls a
        Sequential's children itself (a residual connection around part of it, or one child
        used elsewhere as well; :meth:`PermutationSpec.record_calls`), and a parent that uses
        their weights without calling them (``F.linear(h, self.seq[2].weight)``). With
        ``batch``, the output on its first :data:`CHECK_ROWS` rows at the posterior mean and
        at one draw of q is compared with the output after permuting each such unit layer's
        units (:meth:`PermutationSpec.layer_changes`), which settles both: a layer is kept iff
        the output agrees to round-off at both (a parent that runs the children in their own
        order keeps its units). Without ``batch``, the record of the calls alone decides.

        The objectives run the likelihood's forward inside this block; the check runs when it
        closes or, on the Pyro path, at the first :meth:`infonce` after the model trace. The
        units left out are named in a ``UserWarning`` (``ValueError`` when none are left).
        After the first completed block it is a shared no-op: no hooks, no cost per step.

        Parameters
        ----------
        model : FineTuneModel, optional
            The fit's model (its ``net``); default the guide's.
        batch : Any, optional
            The batch of that forward (the model's; its targets are not read).
        agree : callable, optional
            Merges this process's measurements ``{layer: (change, tolerance)}`` with the other
            processes' (each measures on its own first batch) into the ones every process
            decides by: the fit passes
            :func:`pyrobayes.infer.symmetrized.agree_across_ranks` (one all-reduce under
            ``torch.distributed``). Default: this process's own.
        """
        if self.__dict__.get("_calls_checked") or "_call_record" in self.__dict__:
            return _NO_CHECK
        model = self.model if getattr(model, "net", None) is None else model
        return _CallCheck(self, model, batch, agree)

    def _settle_calls(self) -> None:
        """Close an open :meth:`recording_calls` record, measure the symmetry on its batch and
        drop the unit layers that break it."""
        record = self.__dict__.pop("_call_record", None)
        if record is None:
            return
        stray = record.close()
        model, batch, agree = self.__dict__.pop("_call_batch", (self.model, None, None))
        self.__dict__["_calls_checked"] = True
        if batch is None:  # nothing to measure on: the record of the calls alone
            spec = self.spec.without_stray(stray)
        else:
            changes = self._first_batch_changes(model, batch)
            if agree is not None:  # every rank's measurements, the same on every rank
                changes = agree(changes)
            kept = sorted(n for n in stray if n in changes and changes[n][0] <= changes[n][1])
            if kept:
                logger.debug(
                    "symmetrized: %s run outside their Sequential but measure as a "
                    "symmetry (%s): kept",
                    kept,
                    {n: changes[n] for n in kept},
                )
            spec = self.spec.without_changed(changes, stray)
        if spec is not self.spec:
            self.spec = spec
            _check_nontrivial(self.spec, self.base_family)
            self.__dict__.pop("_permuted_cache", None)

    def _first_batch_changes(self, model: Any, batch: Any) -> dict[str, tuple[float, float]]:
        """:meth:`PermutationSpec.layer_changes` of the unit layers found in an
        ``nn.Sequential`` on the batch's first :data:`CHECK_ROWS` rows, the worse of two
        measurements (:meth:`PermutationSpec.worse_change`).

        The measurements are at the posterior mean and at one draw of q on the measured
        layers' sites (:meth:`_check_draw`): at the mean alone, a layer whose units are
        identical there (a zero-initialised head, constant rows) moves nothing when permuted,
        and a parent that breaks the symmetry (``F.linear(h, seq[2].weight)``) went unseen.
        A LoRA rank axis (or a hand-built layer) is not measured: its symmetry is the adapter's
        own algebra, ``B A = (B Pᵀ)(P A)``, which no parent module sees, and a network has one
        per adapted module (two forwards of a transformer per block)."""
        layers = [u for u in self.spec.layers if u.sequential is not None]
        if not layers:
            return {}
        names = [u.name for u in layers]
        inputs, _ = split_batch(batch, getattr(model, "label_key", "labels"))
        try:
            size = batch_size(inputs)
        except TypeError:  # no leading batch dim to slice: the inputs as they are
            size = 0
        if size > CHECK_ROWS:
            inputs = slice_examples(inputs, 0, CHECK_ROWS, size)
        if isinstance(self.base, MeanFieldGuide) and self.base._plain_normal():
            values = {s: self.base.loc(s).detach() for s in self.sites}  # no scales computed
        else:
            values = self.base.mean()
        drawn = {**values, **self._check_draw({s for u in layers for s, _ in u.members})}
        changes = [
            self.spec.layer_changes(  # the same cycles on every fit and for both values
                model, inputs, theta, names=names, generator=torch.Generator().manual_seed(0)
            )
            for theta in (values, drawn)
        ]
        return {n: self.spec.worse_change(c, changes[1][n]) for n, c in changes[0].items()}

    def _check_draw(self, sites: set[str]) -> dict[str, Tensor]:
        """One draw of q over ``sites`` from a private generator (a fixed seed), without
        gradients; the global random stream is not read, so the fit's draws stay as they were.

        A mean-field base draws ``μ + σ ε`` with ``ε`` from a CPU generator; another base's
        :meth:`~pyrobayes.guides.base.PosteriorGuide.sample_posterior` runs on a forked RNG."""
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            if not (isinstance(self.base, MeanFieldGuide) and self.base._plain_normal()):
                draw = self.base.sample_posterior(1, generator=generator)
                return {s: draw[s][0] for s in sorted(sites)}
            out = {}
            for site in sorted(sites):  # a fixed order: the same draw on every fit and rank
                loc, scale = self.base._loc_scale(site)
                noise = torch.randn(loc.shape, generator=generator, dtype=loc.dtype)
                out[site] = loc.detach() + scale.detach() * noise.to(loc.device)
        return out

    # ------------------------------------------------------------------ the symmetrization
    def permuted_log_prob(self, values: Mapping[str, Tensor], perms: list[Tensor]) -> Tensor:
        r"""``log q(h_k·θ_s)`` for draws ``values[site]: (S, *shape)`` → ``(S, K)``.

        One vectorised pass over the K group elements ``perms`` (per unit layer ``(K, n_l)``).
        For a mean-field base the parameters are permuted instead of the draws,
        ``log q(h·θ) = log N(θ; h⁻¹·μ, diag(h⁻¹·σ²))``, which sums the same terms in the same
        order for every k (bit-identical terms when q is invariant); otherwise the base's
        ``log_prob`` is evaluated at the S·K permuted draws.
        """
        num = int(perms[0].shape[0])
        if isinstance(self.base, MeanFieldGuide) and self.base._plain_normal():
            inverse = self.spec.inverse(perms)
            members = self._permuted_members()
            total = None
            for site in self.sites:
                loc, scale = self.base._loc_scale(site)
                v = values[site].unsqueeze(1)  # (S, 1, *shape)
                if site in members:  # (K, *shape) each
                    loc, scale = _gather_params((loc, scale), members[site], inverse, num)
                z = (v - loc) / scale
                lp = -0.5 * z.square() - scale.log() - 0.5 * math.log(2 * math.pi)
                lp = lp.flatten(2).sum(-1) if lp.dim() > 2 else lp
                lp = lp.expand(v.shape[0], num)
                total = lp if total is None else total + lp
            if total is None:
                raise ValueError(f"{type(self).__name__}: the model has no latent sites.")
            return total
        moved = self.spec.act(values, perms)  # (S, K, *shape)
        num_draws = next(iter(moved.values())).shape[0]
        flat = {s: v.reshape(num_draws * num, *v.shape[2:]) for s, v in moved.items()}
        return self.base.log_prob(flat).reshape(num_draws, num)

    def _relative_log_prob(
        self,
        values: Mapping[str, Tensor],
        perms: list[Tensor],
        inverse: list[Tensor] | None = None,
    ) -> Tensor:
        """``log q(h_k·θ_s)`` up to a term that is the same for every element of G ``(S, K)``.

        Mean-field: ``−½ Σ_p ((θ_p − (h⁻¹·μ)_p) (h⁻¹·σ⁻¹)_p)²`` over the permuted sites, μ and
        1/σ gathered per site by one index (:func:`_gather_params`; ``Σ log σ`` and the sites no
        unit layer acts on are the same for every h and cancel in ``I_K``). ``inverse``: the
        elements' inverses when the caller has them (default ``argsort`` of ``perms``). Other
        bases: the full :meth:`permuted_log_prob`.
        """
        if not (isinstance(self.base, MeanFieldGuide) and self.base._plain_normal()):
            return self.permuted_log_prob(values, perms)
        num = int(perms[0].shape[0])
        if inverse is None:
            inverse = self.spec.inverse(perms)
        work = None  # the CPU pass without a graph reuses its buffers
        if not torch.is_grad_enabled() and next(iter(values.values())).device.type == "cpu":
            work = self.__dict__.setdefault("_workspace", _Workspace())
        total = None
        for site, members in self._permuted_members().items():
            loc, scale = self.base._loc_scale(site)
            loc_k, inv_k = _gather_params((loc, scale.reciprocal()), members, inverse, num, work)
            sq = _squared_distances(values[site], loc_k, inv_k)  # (S, K)
            total = sq if total is None else total + sq
        if total is None:
            raise ValueError(
                f"{type(self).__name__}: no latent site is permuted by the model's symmetry."
            )
        return -0.5 * total

    def _permuted_members(self) -> dict[str, tuple[tuple[int, int], ...]]:
        """``{site: ((unit layer index, axis), ...)}`` of the sites the spec permutes, in the
        guide's site order (cached until the spec changes)."""
        cached = self.__dict__.get("_permuted_cache")
        if cached is None:
            cached = {
                site: tuple(
                    (index, axis)
                    for index, layer in enumerate(self.spec.layers)
                    for member, axis in layer.members
                    if member == site
                )
                for site in self.sites
                if site in self.spec.sites
            }
            self.__dict__["_permuted_cache"] = cached
        return cached

    def infonce(
        self,
        values: Mapping[str, Tensor],
        num_permutations: int | None = None,
        *,
        perms: list[Tensor] | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        r"""The InfoNCE estimate of ``I(g; θ)`` per draw ``(S,)``.

        .. math:: I_K(θ_0) = \log q(θ_0) - \log\tfrac1K\textstyle\sum_{k=1}^K q(h_k·θ_0),
                  \quad h_1 = \mathrm{id},\ h_{2..K} \sim \mathrm{Unif}(G)

        ``I_K(θ₀) ≤ log K`` for every draw; ``E[I_K] ≥ 0`` (Jensen: ``E[q(h·θ₀)/q(θ₀)] = 1``)
        and ``E[I_K] ≤ min(I, log K)``. Passing every element of G as ``perms`` (the identity
        first) gives the exact integrand of ``I = KL(q ‖ q_G)``.

        Parameters
        ----------
        values : dict
            Draws ``{site: (S, *shape)}`` of q (differentiable: the reparameterized ``θ₀``).
        num_permutations : int, optional
            K; default the guide's ``num_permutations`` (a fit passes its settings').
        perms : list of Tensor, optional
            The K group elements (per layer ``(K, n_l)``) instead of the identity and K − 1
            uniform draws.
        generator : torch.Generator, optional
            Source of the uniform draws. Default: a generator seeded from a hash of the global
            RNG state, which it does not advance, so the symmetrized objective consumes exactly
            the base ELBO's random numbers: with ``I_K`` saturated (zero gradient) the fit is the
            base's fit bit for bit, and a resumed fit (the global state is checkpointed) draws
            the same permutations.
        """
        if "_call_record" in self.__dict__:  # the first forward ran: its record first
            self._settle_calls()
        device = next(iter(values.values())).device
        inverse = None
        if perms is None:
            num = self.num_permutations if num_permutations is None else int(num_permutations)
            if num == 1:
                self.__dict__["last_saturation"] = (False, 0.0)
                first = values[next(iter(self.sites))]
                return first.new_zeros(first.shape[0])
            if generator is None:  # a stream of its own: the base's draws stay q's (see below)
                drawn = self.spec.sample(num - 1, generator=_side_generator(device))
                drawn = [d.to(device) for d in drawn]
            else:
                drawn = self.spec.sample(num - 1, device=device, generator=generator)
            perms = [
                torch.cat([i, d]) for i, d in zip(self.spec.identity(device), drawn, strict=True)
            ]
            inverse = _inverse_permutations(perms)  # drawn: permutations, no sort needed
        num = int(perms[0].shape[0])
        lq, inert = self._log_ratios(values, perms, inverse)  # (S, K); column 0 is θ₀ itself
        diff = lq - lq[:, :1]
        if inert and torch.is_grad_enabled():
            # inert (every permuted copy below 1e-8 of θ₀'s weight, or underflowing to 0): I_K
            # is log K to (K − 1)·1e-8 and its gradient is dropped, so no backward runs over
            # the K·D terms and the fit is the base's bit for bit (a sub-1e-8 gradient still
            # changes the rounding of every step, which a long fit amplifies)
            first = values[next(iter(self.sites))]
            anchor = first.reshape(first.shape[0], -1)[:, 0] * 0.0  # in the graph, grad 0
            return _infonce(diff.detach(), num) + anchor
        return _infonce(diff, num)

    def _log_ratios(
        self, values: Mapping[str, Tensor], perms: list[Tensor], inverse: list[Tensor] | None
    ) -> tuple[Tensor, bool]:
        """:meth:`_relative_log_prob` of ``perms`` and whether ``I_K`` is inert there
        (:meth:`_note_saturation`), computing the K·D terms once in the common case.

        With gradients on, the graph over the K·D terms is needed only when ``I_K`` is active.
        Whether it is changes rarely from one step to the next, so the last evaluation's state
        picks the pass: after an inert one, a pass without the graph (enough when inert; an
        active ``I_K`` then takes a second, differentiable pass), after an active one the
        differentiable pass at once (dropped when inert). The same values either way.
        """
        ids = _identities(perms)
        if not torch.is_grad_enabled():
            lq = self._relative_log_prob(values, perms, inverse)
            return lq, self._note_saturation(lq - lq[:, :1], ids)
        if self.__dict__.get("last_saturation", (True, 0.0))[0]:
            with torch.no_grad():
                lq = self._relative_log_prob(values, perms, inverse)
            if self._note_saturation(lq - lq[:, :1], ids):
                return lq, True
            return self._relative_log_prob(values, perms, inverse), False
        lq = self._relative_log_prob(values, perms, inverse)
        return lq, self._note_saturation(lq - lq[:, :1], ids)

    def _note_saturation(self, diff: Tensor, identity: Tensor) -> bool:
        """Record whether ``I_K`` is inert at these log-ratios ``(S, K)`` (the return value):
        the nearest permuted copy's log density ratio at the draws is below
        :data:`INERT_LOG_RATIO`, or every copy's weight ``exp(diff_k − max)`` underflows to 0
        but θ₀'s. ``I_K`` is then within ``(K − 1)·1e-8`` of log K and its gradient as small, so
        the caller drops it. :attr:`last_saturation` holds ``(inert, max_k≥2 diff_k)``.
        Copies whose group element is the identity (``identity``, ``(K,)``; a uniform draw
        from a small group can be) are θ₀ itself: their ratio is 0 and their gradient exactly
        0, so they are left out."""
        detached = diff.detach()
        others = detached[:, 1:].masked_fill(identity[1:].to(diff.device), -math.inf)
        if others.numel():
            weights = (others - detached.max(dim=1, keepdim=True).values).exp()
            # one read to the host per step (a device sync), not one per number
            flags = torch.stack([weights.any().to(others.dtype), others.max()]).tolist()
            underflow, nearest = not flags[0], float(flags[1])
        else:
            underflow, nearest = True, 0.0
        # inert: every copy weighs < e^-18.4 = 1e-8 against θ₀, so log K − I_K and I_K's
        # gradient are below (K − 1)·1e-8 relative to the data term's
        inert = underflow or nearest < INERT_LOG_RATIO
        self.__dict__["last_saturation"] = (inert, nearest)
        return inert

    def symmetrized_log_prob(self, values: Mapping[str, Tensor]) -> Tensor:
        r"""``log q_G(θ_s) = logsumexp_g log q(g·θ_s) − log|G|`` by enumerating G (tiny groups)."""
        device = next(iter(values.values())).device
        lq = self.permuted_log_prob(values, self.spec.enumerate(device))
        return torch.logsumexp(lq, dim=1) - self.spec.log_order


class _CallCheck:
    """The block of :meth:`SymmetrizedGuide.recording_calls` on the first forward: opens the
    spec's call record on entry; on exit settles it (the check on ``batch``), or closes it
    unsettled when the forward raised (the next forward is checked instead). A class, not a
    generator, so that a warning it gives points at the user's line."""

    def __init__(
        self, guide: SymmetrizedGuide, model: Any, batch: Any, agree: Agreement | None
    ) -> None:
        self.guide, self.model, self.batch, self.agree = guide, model, batch, agree

    def __enter__(self) -> None:
        self.guide.__dict__["_call_record"] = self.guide.spec.record_calls(self.model.net)
        self.guide.__dict__["_call_batch"] = (self.model, self.batch, self.agree)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if kind is None:
            self.guide._settle_calls()
            return
        self.guide.__dict__.pop("_call_batch", None)
        record = self.guide.__dict__.pop("_call_record", None)
        if record is not None:
            record.close()


def _identities(perms: list[Tensor]) -> Tensor:
    """``(K,)``: whether group element k is the identity in every layer (``perms[l]`` is
    ``(K, n_l)``)."""
    return torch.stack(
        [(p == torch.arange(p.shape[1], device=p.device)).all(dim=1) for p in perms]
    ).all(dim=0)


def _inverse_permutations(perms: list[Tensor]) -> list[Tensor]:
    """The inverse elements of ``perms`` (per layer ``(K, n_l)``, each row a permutation) by one
    scatter per layer: what ``argsort`` gives, without the sort."""
    out = []
    for perm in perms:
        positions = torch.arange(perm.shape[1], device=perm.device).expand_as(perm)
        out.append(torch.empty_like(perm).scatter_(1, perm, positions))
    return out


class _Workspace:
    """Flat buffers reused from one evaluation to the next by the pass without a graph on a
    CPU (:meth:`SymmetrizedGuide._relative_log_prob`), one per role, grown to the largest
    site's K·D: a fresh K·D-sized tensor per site and step costs its page faults each time
    (glibc returns large blocks to the system when they are freed), more than the arithmetic
    on it. Not on a GPU, whose caching allocator already reuses the memory."""

    def __init__(self) -> None:
        self.buffers: dict[str, Tensor] = {}

    def take(self, role: str, numel: int, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """A flat ``(numel,)`` buffer of ``role`` with ``like``'s device and ``dtype`` (default
        ``like``'s), its old content undefined."""
        dtype = like.dtype if dtype is None else dtype
        buf = self.buffers.get(role)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != like.device:
            buf = torch.empty(numel, dtype=dtype, device=like.device)
            self.buffers[role] = buf
        return buf[:numel]


def _gather_params(
    params: tuple[Tensor, ...],
    members: tuple[tuple[int, int], ...],
    inverse: list[Tensor],
    num: int,
    work: _Workspace | None = None,
) -> tuple[Tensor, ...]:
    """``h_k⁻¹·p`` for each per-site tensor ``p`` of ``params`` (one site's, no sample axis) →
    ``(K, *shape)`` each.

    ``members``: the ``(unit layer, axis)`` pairs acting on the site; ``inverse``: per layer the
    inverse elements ``(K, n_l)``. One axis: one ``index_select`` of the K·n slices along it.
    Several (the middle weight of an MLP: rows and columns): one flat index of the K·D entries,
    built by broadcasting and shared by every tensor of ``params``, then one ``index_select``
    of the flattened tensor each (no per-k copies or transposes). With ``work`` (no graph),
    the results and the index are written into its buffers.
    """
    shape = params[0].shape
    size = num * params[0].numel()
    if len(members) == 1:
        layer, axis = members[0]
        index = inverse[layer].reshape(-1)
        split = (*shape[:axis], num, shape[axis], *shape[axis + 1 :])
        merged = (*shape[:axis], num * shape[axis], *shape[axis + 1 :])
        out = [
            p.index_select(axis, index)
            if work is None
            else torch.index_select(
                p, axis, index, out=work.take(f"param{i}", size, p).view(merged)
            )
            for i, p in enumerate(params)
        ]
        return tuple(o.view(split).movedim(axis, 0) for o in out)
    flat = _flat_index(shape, members, inverse, num, work)
    return tuple(
        (
            p.reshape(-1).index_select(0, flat)
            if work is None
            else torch.index_select(p.reshape(-1), 0, flat, out=work.take(f"param{i}", size, p))
        ).view(num, *shape)
        for i, p in enumerate(params)
    )


def _squared_distances(v: Tensor, loc_k: Tensor, inv_k: Tensor) -> Tensor:
    """``Σ_p ((θ_s − μ'_k) / σ'_k)²_p`` per draw and element ``(S, K)`` for draws ``v``
    ``(S, *shape)`` and gathered ``loc_k``, ``inv_k`` ``(K, *shape)`` (fresh tensors or
    workspace buffers of :func:`_gather_params`, free to overwrite).

    Without a graph to build (no gradients, or none asked of these tensors) the K·D terms are
    computed in place in ``loc_k``'s storage (one draw): the same operations on the same
    values, so the same bits, without the three further K·D-sized temporaries of the
    differentiable form."""
    needs_graph = torch.is_grad_enabled() and (
        v.requires_grad or loc_k.requires_grad or inv_k.requires_grad
    )
    if needs_graph:
        return ((v.unsqueeze(1) - loc_k) * inv_k).square().flatten(2).sum(-1)
    if v.shape[0] == 1:  # θ − μ' into μ''s storage: (K, *shape), then a leading draw axis
        z = torch.sub(v, loc_k, out=loc_k).unsqueeze(0)
    else:
        z = v.unsqueeze(1) - loc_k
    return z.mul_(inv_k).square_().flatten(2).sum(-1)


def _flat_index(
    shape: torch.Size,
    members: tuple[tuple[int, int], ...],
    inverse: list[Tensor],
    num: int,
    work: _Workspace | None = None,
) -> Tensor:
    """``(K·D,)``: the flat position in a contiguous tensor of ``shape`` of entry ``[k, *i]`` of
    ``h_k⁻¹·p``: per axis the unit layer's inverse element ``inverse[l][k, i_a]`` when one acts
    on it, else ``i_a``, times the axis's stride (the last, full-sized sum into ``work``)."""
    acting = {axis: layer for layer, axis in members}
    device = inverse[0].device
    parts = []
    stride = 1
    for axis in reversed(range(len(shape))):
        size = int(shape[axis])
        view = [1] * (len(shape) + 1)
        view[axis + 1] = size
        if axis in acting:
            view[0] = num
            parts.append((inverse[acting[axis]] * stride).view(view))
        else:
            parts.append((torch.arange(size, device=device) * stride).view(view))
        stride *= size
    last = parts.pop()  # the leading axis: the other parts first, at their smaller size
    rest = parts[0]
    for part in parts[1:]:
        rest = rest + part
    full = (num, *shape)
    if work is None:
        return (rest + last).expand(full).reshape(-1)
    out = work.take("index", num * stride, last, torch.long)
    torch.add(rest.expand(full), last.expand(full), out=out.view(full))
    return out


def _side_generator(device: torch.device) -> torch.Generator:
    """A CPU generator seeded from a hash of the global RNG state (CPU, and ``device``'s when it
    is a CUDA device), without advancing it: a deterministic stream beside the global one."""
    digest = hashlib.blake2b(torch.random.get_rng_state().numpy().tobytes(), digest_size=8)
    if device.type == "cuda":
        digest.update(torch.cuda.get_rng_state(device).numpy().tobytes())
    seed = int.from_bytes(digest.digest(), "little") >> 1
    return torch.Generator().manual_seed(seed)


def _infonce(diff: Tensor, num: int) -> Tensor:
    """``−log mean_k exp(diff_k)`` per row; exactly 0 when every ``diff_k`` is 0."""
    top = diff.max(dim=1, keepdim=True).values.detach().clamp_min(0)
    return -(top.squeeze(1) + (diff - top).exp().sum(1).div(num).log())


def _check_nontrivial(spec: PermutationSpec, base: str) -> None:
    """Refuse a group of one element: ``q_G = q`` and ``I_K = 0``, so nothing is symmetrized.

    Raises
    ------
    ValueError
        When every unit layer of ``spec`` has a single unit (LoRA of rank 1, hidden layers
        one unit wide), naming them.
    """
    if spec.order > 1:
        return
    names = [u.name for u in spec.layers]
    raise ValueError(
        f"SymmetrizedGuide: every unit layer of the model has a single unit ({names[:3]}"
        f"{'...' if len(names) > 3 else ''}: LoRA of rank 1 or hidden layers one unit wide), "
        "so its permutation group holds only the identity: q_G would be the base q and I_K = 0 "
        f"at every step, a plain {base!r} fit under another name. Use LoRA(rank=r) with r >= 2 "
        f"(or wider latent hidden layers), or fit pb.posterior(model, {base!r}) directly."
    )


def _check_base(base_cls: type, name: str) -> None:
    """Refuse a base whose fitting or density does not fit the symmetrized ELBO."""
    if base_cls is SymmetrizedGuide:
        raise ValueError(
            "SymmetrizedGuide(base='symmetrized'): a base cannot itself be symmetrized."
        )
    why = None
    fitter = getattr(base_cls, "default_fitter", "svi")
    objective = getattr(base_cls, "default_objective", "elbo")
    if getattr(base_cls, "is_deterministic", False):
        why = "a point mass has no density to symmetrize"
    elif fitter != "svi":
        why = (
            f"it is fitted by its own {fitter!r} fitter, whose update takes no "
            "extra loss term (its log_prob is tractable, but I_K could not be trained)"
        )
    elif objective != "elbo":
        why = f"it is fitted with the {objective!r} objective, not an ELBO"
    if why is not None:
        raise ValueError(
            f"SymmetrizedGuide(base={name!r}): {base_cls.__name__} cannot be a base: {why}. Use a "
            "family fitted by the reparameterized ELBO with a tractable log_prob, e.g. "
            "base='meanfield'."
        )
