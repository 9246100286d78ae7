r"""Export a fitted posterior to ArviZ (``InferenceData`` on arviz 0.x, ``DataTree`` on 1.x).

Draws :math:`θ_s \sim q`, :math:`s = 1..S`, are taken once from the guide and evaluated on the
batched path (``model.batched_output``), giving per draw and per example

.. math::

    \log p(y_i \mid x_i, θ_s)\ \text{(log_likelihood)},\qquad
    \tilde y_{s,i} \sim p(\cdot \mid x_i, θ_s)\ \text{(posterior_predictive)},

    \log q(θ_s)\ \text{(sample_stats.log_q)},\qquad
    \log p(θ_s, D) = \sum_i \log p(y_i \mid x_i, θ_s) + \log p(θ_s)\ \text{(sample_stats.log_joint)}.

``log_joint − log_q`` are the PSIS log importance ratios of the guide (see
:mod:`pyrobayes.diagnostics.khat`, which evaluates the draws with :func:`evaluate_draws` too). ArviZ 1.x has no Pyro converter and arviz 0.x's ``from_pyro`` only
reads ``pyro.infer.MCMC``, so pyrobayes builds plain ``dict[group, dict[var, ndarray]]`` itself and
hands them to ``from_dict`` through one adapter, :func:`_to_arviz`.

Group layout (``chain`` has size 1, ``draw`` size S; for an equal-weight mixture of K components,
:class:`~pyrobayes.contract.Mixture` — particles, ensembles — ``chain`` has size K, one chain per
component, and ``draw`` size S/K, S rounded up to a multiple of K):

==========================  ================================================================
``posterior``               one variable per chosen site, dims ``(chain, draw, <site>_row,
                            <site>_col)`` for matrices, ``<site>_dim_k`` otherwise; omitted
                            (too large) sites appear as ``<site>_norm``, the Frobenius norm
``posterior_predictive``    ``obs``, dims ``(chain, draw, obs_dim_0, ...)``
``log_likelihood``          ``obs``, dims ``(chain, draw, obs_dim_0)``, one value per example
``observed_data``           ``obs``, dims ``(obs_dim_0, ...)``
``sample_stats``            ``log_q``, ``log_joint``, ``lp`` (= ``log_joint``, ArviZ's name)
``optimization``            ``loss`` over dim ``step`` (only with ``losses=``)
==========================  ================================================================

The attribute ``draws`` says how ArviZ's chains and draws are to be read: independent draws of
``q`` (one chain), a point mass (every draw equal: r-hat, ESS and PSIS-LOO are undefined) or a
mixture (a chain per component: r-hat measures the components' spread, not convergence).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from torch import Tensor

from .._version import __version__
from ..batch import batch_size, slice_examples, split_batch, to_device
from ..calibration import TEMPERATURE_BUFFER, pooled, temperature
from ..contract import LinearizedPredictive, Mixture, implements
from ..fitted_head import warn_if_never_fitted
from ..models.likelihoods import Gaussian
from ..models.sharing import reuse_within_batch
from ..predictive import (
    cat_examples,
    check_fitted_model,
    checked_targets,
    default_samples_per_forward,
)

__all__ = [
    "to_datatree",
    "to_inference_data",
    "select_sites",
    "evaluate_draws",
    "DrawEvaluation",
    "DEFAULT_MAX_SITE_NUMEL",
    "UncalibratedExportWarning",
]

logger = logging.getLogger(__name__)

#: Default cap on the number of posterior scalars per draw exported to the ``posterior`` group.
DEFAULT_MAX_SITE_NUMEL = 10_000
_SAMPLE_DIMS = ("chain", "draw")


class UncalibratedExportWarning(UserWarning):
    """A calibrated guide (:func:`pyrobayes.calibrate`) exported without its temperature: its
    ``T`` tempers the posterior-predictive average (the default, pooled form), which no single
    draw's log-likelihood or predictive draw can carry, so ``log_likelihood`` and
    ``posterior_predictive`` are those of the uncalibrated posterior (attribute
    ``temperature_applied = 0``). :func:`pyrobayes.predict` gives the calibrated predictive."""


# --------------------------------------------------------------------------------------------
# site selection
# --------------------------------------------------------------------------------------------


def _numel(shape: Sequence[int]) -> int:
    return int(torch.Size(shape).numel())


def _site_shapes(model: Any, guide: Any) -> dict[str, torch.Size]:
    guide.require_setup()
    shapes = dict(guide.sites)
    if not shapes:
        shapes = {s: torch.Size(spec.shape) for s, spec in model.latent_sites.items()}
    return {s: torch.Size(v) for s, v in shapes.items()}


def select_sites(
    shapes: dict[str, torch.Size],
    sites: Sequence[str] | None = None,
    max_site_numel: int = DEFAULT_MAX_SITE_NUMEL,
) -> tuple[list[str], list[str]]:
    """Split latent sites into exported (full values) and summarised (norm only) ones.

    With ``sites=None`` sites are taken in declaration order while their cumulative ``numel``
    stays within ``max_site_numel``; the rest are summarised. An explicit ``sites`` list is
    exported as asked (unknown names raise ``KeyError``).

    Parameters
    ----------
    shapes : dict
        ``{site: shape}`` of every latent site.
    sites : sequence of str, optional
    max_site_numel : int

    Returns
    -------
    chosen, omitted : list of str
    """
    if sites is not None:
        unknown = [s for s in sites if s not in shapes]
        if unknown:
            raise KeyError(f"Unknown sites {unknown}; the latent sites are {list(shapes)}.")
        chosen = list(dict.fromkeys(sites))
        return chosen, [s for s in shapes if s not in chosen]
    chosen, omitted, used = [], [], 0
    for site, shape in shapes.items():
        if used + _numel(shape) <= max_site_numel:
            chosen.append(site)
            used += _numel(shape)
        else:
            omitted.append(site)
    return chosen, omitted


# --------------------------------------------------------------------------------------------
# the batched evaluation shared by the export and the k-hat diagnostics (khat.diagnose)
# --------------------------------------------------------------------------------------------


@dataclass
class DrawEvaluation:
    r"""Everything computed from S guide draws on a data set (NumPy, float64 unless stated).

    The result of :func:`evaluate_draws`. Fields that were not asked for, or that need targets
    the data did not have, are ``None``.

    Attributes
    ----------
    num_samples : int
        S.
    chosen, omitted : list of str
        Sites kept in full (``site_values``) and sites summarised by their norm (``site_norms``),
        as :func:`select_sites` split them.
    site_values : dict of str to numpy.ndarray
        ``(S, *shape)`` draws of every chosen site.
    site_norms : dict of str to numpy.ndarray
        ``(S,)`` Frobenius norms of the draws of every omitted site.
    log_q, log_prior : numpy.ndarray or None
        ``(S,)`` :math:`\log q(θ_s)` (NaN when the guide has no ``log_prob``) and
        :math:`\log p(θ_s)`.
    log_lik_sum : numpy.ndarray or None
        ``(S,)`` :math:`\sum_i \log p(y_i \mid x_i, θ_s)` over the whole data set.
    pointwise : numpy.ndarray or None
        ``(S, N)`` per-example log-likelihoods (``pointwise=True``).
    predictive : numpy.ndarray or None
        ``(S, N, ...)`` posterior-predictive draws (``predictive=True``).
    observed : numpy.ndarray or None
        ``(N, ...)`` targets, in the shape the likelihood scores (its ``check_targets``: a
        scalar Gaussian output's ``(N, 1)`` targets are ``(N,)``, as the draws of
        ``predictive``).
    class_log_probs : Tensor or None
        ``(P, N, C)`` class log-probabilities of the first ``P = num_class_samples`` draws
        (classification likelihoods only).
    targets : Tensor or None
        ``(N, ...)`` targets as a tensor (as ``observed``).
    num_examples : int
        N (0 without targets).
    """

    num_samples: int
    chosen: list[str]
    omitted: list[str]
    site_values: dict[str, np.ndarray] = field(default_factory=dict)  # (S, *shape)
    site_norms: dict[str, np.ndarray] = field(default_factory=dict)  # (S,)
    log_q: np.ndarray | None = None  # (S,)
    log_prior: np.ndarray | None = None  # (S,)
    log_lik_sum: np.ndarray | None = None  # (S,)
    pointwise: np.ndarray | None = None  # (S, N)
    predictive: np.ndarray | None = None  # (S, N, ...)
    observed: np.ndarray | None = None  # (N, ...)
    class_log_probs: Tensor | None = None  # (P, N, C)
    targets: Tensor | None = None  # (N, ...)
    num_examples: int = 0

    @property
    def log_joint(self) -> np.ndarray | None:
        r"""``(S,)`` :math:`\log p(θ_s, D)` = ``log_lik_sum + log_prior`` (None without targets)."""
        if self.log_lik_sum is None or self.log_prior is None:
            return None
        return self.log_lik_sum + self.log_prior


def _np(t: Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.is_floating_point():
        t = t.to(torch.float64)
    return t.numpy()


def _num_components(guide: Any) -> int:
    """K for an equal-weight mixture (:class:`~pyrobayes.contract.Mixture`: one ArviZ chain per
    component), else 1."""
    return int(guide.num_components) if implements(guide, Mixture) else 1


def _draw_chunk(num_samples: int, total_numel: int, max_site_numel: int) -> int:
    """Draws per ``sample_posterior`` call: at most ``max(S·max_site_numel, total)`` scalars."""
    if total_numel <= max_site_numel:
        return num_samples
    return max(1, min(num_samples, (num_samples * max_site_numel) // max(total_numel, 1)))


def evaluate_draws(
    model: Any,
    guide: Any,
    data: Iterable[Any],
    *,
    num_samples: int,
    seed: int | None,
    sites: Sequence[str] | None = None,
    max_site_numel: int = DEFAULT_MAX_SITE_NUMEL,
    pointwise: bool = True,
    predictive: bool = True,
    summarise_omitted: bool = True,
    num_class_samples: int = 0,
    samples_per_forward: int | None = None,
    temperature: float | None = None,
    training_data: bool = True,
    linearized: bool = False,
) -> DrawEvaluation:
    """Draw S joint samples from ``guide`` and evaluate the model on every batch of ``data``.

    The one batched pass behind :func:`to_datatree` and :func:`pyrobayes.diagnostics.diagnose`.
    The draws are taken in chunks (one chunk when the whole posterior is within
    ``max_site_numel`` scalars, else about ``S · max_site_numel / numel(θ)`` draws at a time);
    every chunk is evaluated on all batches before the next is drawn, so ``data`` must be
    re-iterable when the posterior is large.

    Parameters
    ----------
    model : FineTuneModel
    guide : PosteriorGuide
    data : iterable of batches
    num_samples : int
        S (>= 1).
    seed : int or None
        Seed of the draws and of the posterior-predictive sampling.
    sites : sequence of str, optional
        Sites to keep in full (see :func:`select_sites`); ``[]`` keeps none.
    max_site_numel : int
        Budget of kept scalars per draw, and the chunking bound above.
    pointwise : bool
        Keep the ``(S, N)`` per-example log-likelihoods.
    predictive : bool
        Draw posterior-predictive samples.
    summarise_omitted : bool
        Keep the per-draw norms of the sites not kept in full.
    num_class_samples : int
        Keep the class log-probabilities of this many first draws (classification only).
    samples_per_forward : int, optional
        Draws per forward pass (default: ``pyrobayes.predictive.default_samples_per_forward``).
    temperature : float, optional
        Temper every draw's likelihood by ``T`` in ``pointwise`` and ``predictive`` as
        :func:`pyrobayes.predict` tempers a draw (classification: ``log_softmax(log p_s / T)``;
        Gaussian: ``σ → T σ``). ``log_lik_sum`` (so ``log_joint``) and the class
        log-probabilities stay the model's own. Default: none.
    training_data : bool
        ``data`` is the training set the posterior is conditioned on (the k-hat diagnostics):
        a ``model.num_data`` that differs from its size is logged. ``False`` for held-out data.
    linearized : bool
        Evaluate the guide's linearised network ``f(x; θ̂) + J(x)(θ_s − θ̂)`` at every draw
        instead of the network ``f(x; θ_s)`` (a :class:`~pyrobayes.contract.LinearizedPredictive`
        guide only: the per-draw form of its GLM predictive, what :func:`pyrobayes.predict`
        evaluates for ``pred_type="glm"``). Every result that the likelihood gives is then the
        linearised network's. Default: the network.

    Returns
    -------
    DrawEvaluation

    Raises
    ------
    ValueError
        ``linearized=True`` for a guide that has no linearised predictive.
    """
    if num_samples < 1:
        raise ValueError(f"Expected num_samples >= 1 but got {num_samples}.")
    if temperature is not None and not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"evaluate_draws: temperature must be finite and > 0, got {temperature}.")
    if linearized and not implements(guide, LinearizedPredictive):
        raise ValueError(
            f"evaluate_draws: linearized=True needs a guide with a linearised predictive "
            f"(Laplace); {type(guide).__name__} has none. Pass linearized=False."
        )
    check_fitted_model(model, guide, "to_inference_data", stacklevel=5)
    warn_if_never_fitted(guide, model, "to_inference_data", stacklevel=4)
    if iter(data) is data:  # a one-shot iterator: keep its batches for every chunk of draws
        data = list(data)
    model.train(False)
    plan = _DrawPlan.of(model, guide, num_samples, sites, max_site_numel, summarise_omitted)
    generator = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
    classification = bool(model.likelihood.is_classification)
    out = _Collected(plan)
    linearization = _Linearization.of(model, guide) if linearized else None
    for start in range(0, plan.num_samples, plan.chunk):
        n = min(plan.chunk, plan.num_samples - start)
        values = _draw(guide, n, plan.components, generator, model.device)
        out.add_draws(model, guide, values, n)
        pp_seed = int(torch.randint(0, 2**62, (1,), generator=generator)) if generator else None
        keep_class = max(0, min(n, num_class_samples - start)) if classification else 0
        wanted = _Wanted(
            pointwise, predictive, keep_class, samples_per_forward, temperature, linearization
        )
        out.add_chunk(_evaluate_chunk(model, data, values, n, wanted, pp_seed, start == 0))
        del values
    return out.result(model if training_data else None)


class _DrawPlan(NamedTuple):
    """How many draws, in chunks of how many, of how many mixture components; which sites."""

    num_samples: int
    chunk: int
    components: int
    chosen: list[str]
    omitted: list[str]

    @classmethod
    def of(
        cls,
        model: Any,
        guide: Any,
        num_samples: int,
        sites: Sequence[str] | None,
        max_site_numel: int,
        summarise_omitted: bool,
    ) -> _DrawPlan:
        shapes = _site_shapes(model, guide)
        chosen, omitted = select_sites(shapes, sites, max_site_numel)
        if not summarise_omitted:
            omitted = []
        if omitted:
            logger.info(
                "Posterior export keeps only the Frobenius norm of sites %s (%d scalars per "
                "draw; max_site_numel=%d). Pass sites=[...] to export them in full.",
                omitted,
                sum(_numel(shapes[s]) for s in omitted),
                max_site_numel,
            )
        total = sum(_numel(s) for s in shapes.values())
        chunk = _draw_chunk(num_samples, total, max_site_numel)
        components = _num_components(guide)
        if components > 1:  # whole rounds over the components: draw s is from component s mod K
            if num_samples % components:
                rounded = -(-num_samples // components) * components
                logger.info(
                    "%s is a mixture of %d components: exporting %d draws (a multiple of %d) "
                    "instead of %d, so every component is a chain of equal length.",
                    type(guide).__name__,
                    components,
                    rounded,
                    components,
                    num_samples,
                )
                num_samples = rounded
            chunk = max(components, chunk - chunk % components)
        return cls(num_samples, chunk, components, chosen, omitted)


def _draw(
    guide: Any, n: int, components: int, generator: torch.Generator | None, dev: torch.device
) -> dict[str, Tensor]:
    """``n`` joint draws on ``dev``; for a mixture, draw ``j·K + k`` from component ``k``."""
    if components > 1:  # (K, n/K, ...) -> (n, ...)
        grouped = guide.sample_components(n // components, generator=generator)
        values = {k: v.transpose(0, 1).reshape(n, *v.shape[2:]) for k, v in grouped.items()}
    else:
        values = guide.sample_posterior(n, generator=generator)
    return {k: v.detach().to(dev) for k, v in values.items()}


class _Wanted(NamedTuple):
    """What a chunk's pass over the data keeps besides the log-likelihood sums."""

    pointwise: bool
    predictive: bool
    keep_class: int  # class log-probabilities of this many first draws of the chunk
    samples_per_forward: int | None
    temperature: float | None = None  # tempers pointwise and predictive, per draw
    linearization: _Linearization | None = None  # the linearised network, else the network's


class _Linearization(NamedTuple):
    """A :class:`~pyrobayes.contract.LinearizedPredictive` guide's linearised network
    ``f_lin(x; θ) = f(x; θ̂) + J(x)(θ − θ̂)`` (:mod:`pyrobayes.linearized`), at the export's
    draws: the per-draw form of the GLM predictive that :func:`pyrobayes.predict` evaluates."""

    point: dict[str, Tensor]  # θ̂ of the sites with a Gaussian posterior, in the Jacobians' order
    fixed: dict[str, Tensor] | None  # sites held at their point (Laplace's subset=): no Jacobian

    @classmethod
    def of(cls, model: Any, guide: Any) -> _Linearization:
        dev = model.device
        point = {s: v.to(dev) for s, v in guide.linearization_point().items()}
        fixed_point = getattr(guide, "fixed_point", None)
        fixed = {s: v.to(dev) for s, v in fixed_point().items()} if callable(fixed_point) else None
        return cls(point, fixed)

    def at(self, model: Any, inputs: Any, values: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """``f(x; θ̂)`` `(B, *event)` and the draws' ``J(x)(θ_s − θ̂)`` `(n, B, *event)` on
        ``inputs``: the Jacobians of as many examples at a time as :func:`pyrobayes.predict`'s
        linearised predictive forms, each reduced against the draws at once."""
        # (linearized imports the predictive module, as this one)
        from ..linearized import default_examples_per_forward, linear_shifts, output_jacobians

        n = next(iter(values.values())).shape[0]
        deltas = torch.cat(
            [(values[s] - p).reshape(n, -1) for s, p in self.point.items()], -1
        )  # (n, d)
        size = batch_size(inputs)
        step = default_examples_per_forward(inputs, model.device)
        means, shifts = [], []
        for start in range(0, size, step):
            sub = slice_examples(inputs, start, min(size, start + step), size)
            with torch.enable_grad():  # (the export evaluates under no_grad)
                out, jac = output_jacobians(model, sub, self.point, fixed=self.fixed)
            # the Jacobians in the order of deltas' columns; float32 on a half-precision network
            mean, shift = linear_shifts(out, {s: jac[s] for s in self.point}, deltas)
            means.append(mean)
            shifts.append(shift)
        return torch.cat(means, 0), torch.cat(shifts, 1)


class _Chunk(NamedTuple):
    """One chunk of draws evaluated on all of the data."""

    ll_sum: Tensor  # (n,)
    pointwise: list[Tensor]  # per batch (n, B)
    predictive: list[Tensor]  # per batch (n, B, ...)
    class_log_probs: list[Tensor]  # per batch (P, B, C)
    observed: list[Tensor]  # per batch targets, first chunk only
    has_targets: bool


def _evaluate_chunk(
    model: Any,
    data: Iterable[Any],
    values: dict[str, Tensor],
    n: int,
    wanted: _Wanted,
    pp_seed: int | None,
    first: bool,
) -> _Chunk:
    """The model on every batch of ``data`` at the ``n`` draws ``values``."""
    dev = model.device
    chunk = _Chunk(torch.zeros(n, dtype=torch.float64), [], [], [], [], True)
    has_targets = True
    devices = [dev] if dev.type == "cuda" else []
    # reuse_within_batch: the layers below the first adapted one run once per batch for all its
    # chunks of draws, as in pyrobayes.predict
    # (the linearised network's Jacobians run their own forward passes, with autograd)
    reuse = contextlib.nullcontext() if wanted.linearization else reuse_within_batch()
    with torch.no_grad(), torch.random.fork_rng(devices=devices), reuse:
        if pp_seed is not None:
            torch.manual_seed(pp_seed)
        index = -1
        for index, batch in enumerate(data):
            inputs, y = split_batch(to_device(batch, dev), model.label_key)
            ll, pointwise, pp, lp, y = _evaluate_batch(model, inputs, y, values, n, wanted, index)
            if y is None:
                has_targets = False
            elif first:  # in the likelihood's shape, as log_likelihood and posterior_predictive
                chunk.observed.append(y.detach().cpu())
            if ll is not None:
                chunk.ll_sum.add_(ll.sum(1))
            if pointwise is not None:
                chunk.pointwise.append(pointwise)
            if pp is not None:
                chunk.predictive.append(pp)
            if lp is not None:
                chunk.class_log_probs.append(lp)
    if index < 0:
        raise ValueError(
            "to_inference_data / diagnose: data yielded no batches; pass a non-empty iterable of "
            "batches (the data set the posterior is evaluated on, e.g. the training loader)."
        )
    return chunk._replace(has_targets=has_targets)


def _evaluate_batch(
    model: Any,
    inputs: Any,
    y: Tensor | None,
    values: dict[str, Tensor],
    n: int,
    wanted: _Wanted,
    index: int,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """``(log-likelihoods (n, B), pointwise log-likelihoods (n, B), predictive draws, class
    log-probabilities, targets)`` on batch ``index``, ``samples_per_forward`` draws per forward
    pass; each ``None`` when not computed (no targets: ``y`` is ``None``). The pointwise values
    and the predictive draws are tempered by ``wanted.temperature`` (the log-likelihoods are the
    model's). The targets come back checked by the likelihood
    (:func:`~pyrobayes.predictive.checked_targets`), in the shape it scores."""
    parts_ll, parts_pw, parts_pp, parts_lp = [], [], [], []
    spf = wanted.samples_per_forward or default_samples_per_forward(n, model.device, inputs, model)
    linear = (
        None if wanted.linearization is None else wanted.linearization.at(model, inputs, values)
    )
    for s0 in range(0, n, spf):
        sub = {k: v[s0 : s0 + spf] for k, v in values.items()}
        params, at_temperature = _draw_params(model, inputs, sub, linear, s0, wanted.temperature)
        s_here = int(params.shape[0])
        if y is not None and s0 == 0:
            check = getattr(model.likelihood, "check_targets", None)
            y = checked_targets(check, params, y, f"batch {index} of the data")
        likelihood_dist = model.likelihood.dist(params)
        tempered = (
            likelihood_dist
            if wanted.temperature is None
            else _tempered(model.likelihood, at_temperature, likelihood_dist, wanted.temperature)
        )
        if y is not None:
            ll = model.log_likelihood(params, y)  # (s, B, [event...])
            parts_ll.append(ll.reshape(s_here, ll.shape[1], -1).sum(-1).double())
            if wanted.pointwise and tempered is likelihood_dist:
                parts_pw.append(parts_ll[-1])
            elif wanted.pointwise:
                tll = tempered.log_prob(y)
                parts_pw.append(tll.reshape(s_here, tll.shape[1], -1).sum(-1).double())
        if wanted.predictive:
            parts_pp.append(tempered.sample().cpu())
        if wanted.keep_class > s0:
            logits = likelihood_dist.logits[: wanted.keep_class - s0]
            parts_lp.append(torch.log_softmax(logits, dim=-1).cpu())
    return (
        torch.cat(parts_ll, 0).cpu() if parts_ll else None,  # (n, B)
        torch.cat(parts_pw, 0).cpu() if parts_pw else None,  # (n, B)
        torch.cat(parts_pp, 0) if parts_pp else None,
        torch.cat(parts_lp, 0) if parts_lp else None,
        y,
    )


def _draw_params(
    model: Any,
    inputs: Any,
    sub: dict[str, Tensor],
    linear: tuple[Tensor, Tensor] | None,
    s0: int,
    temperature: float | None,
) -> tuple[Tensor, Tensor]:
    """The likelihood's parameters `(s, B, ...)` at the draws ``sub`` (draws ``s0..`` of the
    chunk): the network's, or with ``linear`` (``f(x; θ̂)`` and every draw's ``J(x)(θ_s − θ̂)``)
    the linearised network's; and the parameters a Gaussian is tempered at. Tempering the
    linearised regression predictive multiplies its whole variance ``J Σ Jᵀ + σ²`` by ``T²``
    (:func:`pyrobayes.calibration.apply_temperature`): per draw, the shift by ``T`` and σ by
    ``T`` (:func:`_tempered`); the network's draws keep their means."""
    if linear is None:
        params = model.batched_output(inputs, sub)  # (s, B, ...)
        return params, params
    mean, shifts = linear
    shift = shifts[s0 : s0 + next(iter(sub.values())).shape[0]]
    params = mean.unsqueeze(0) + shift
    if temperature is None or model.likelihood.is_classification:
        return params, params
    return params, mean.unsqueeze(0) + temperature * shift


def _tempered(likelihood: Any, params: Tensor, untempered: Any, value: float) -> Any:
    """One draw's likelihood under ``pyrobayes.calibrate``'s ``T``, as ``pyrobayes.predict``
    tempers a draw: ``Categorical(log_softmax(log p / T))`` for a classifier, σ → T σ for a
    Gaussian (:func:`pyrobayes.calibration.apply_temperature`)."""
    if likelihood.is_classification:
        log_probs = torch.log_softmax(untempered.logits, dim=-1)
        return dist.Categorical(logits=torch.log_softmax(log_probs / value, dim=-1))
    normal = dist.Normal(params, likelihood.scale() * value)
    return normal.to_event(likelihood.event_dim) if likelihood.event_dim else normal


class _Collected:
    """The chunks' outputs, concatenated into a :class:`DrawEvaluation` at the end."""

    def __init__(self, plan: _DrawPlan) -> None:
        self.plan = plan
        self.values: dict[str, list[np.ndarray]] = {s: [] for s in plan.chosen}
        self.norms: dict[str, list[np.ndarray]] = {s: [] for s in plan.omitted}
        self.log_q: list[np.ndarray] = []
        self.log_prior: list[np.ndarray] = []
        self.ll_sum: list[np.ndarray] = []
        self.pointwise: list[np.ndarray] = []
        self.predictive: list[np.ndarray] = []
        self.class_lp: list[Tensor] = []
        self.observed: list[Tensor] = []
        self.has_targets = True

    def add_draws(self, model: Any, guide: Any, values: dict[str, Tensor], n: int) -> None:
        """The draws' kept sites, norms, ``log q`` and ``log p``."""
        for s in self.plan.chosen:
            self.values[s].append(_np(values[s]))
        for s in self.plan.omitted:
            self.norms[s].append(_np(values[s].reshape(n, -1).norm(dim=-1)))
        with torch.no_grad():
            try:
                self.log_q.append(_np(guide.log_prob(values)))
            except NotImplementedError:
                logger.info("%s has no log_prob; log_q is NaN.", type(guide).__name__)
                self.log_q.append(np.full(n, np.nan))
            self.log_prior.append(_np(model.log_prior(values)))

    def add_chunk(self, chunk: _Chunk) -> None:
        self.has_targets = self.has_targets and chunk.has_targets
        self.observed.extend(chunk.observed)
        if self.has_targets:
            self.ll_sum.append(chunk.ll_sum.numpy())
            if chunk.pointwise:
                self.pointwise.append(torch.cat(chunk.pointwise, 1).numpy())
        if chunk.predictive:
            self.predictive.append(_np(torch.cat(chunk.predictive, 1)))
        if chunk.class_log_probs:
            self.class_lp.append(cat_examples(chunk.class_log_probs, True))

    def result(self, model: Any) -> DrawEvaluation:
        """The draws' evaluation; a ``model`` (the data being its training set) whose
        ``num_data`` differs from the data's size is logged."""
        plan = self.plan
        result = DrawEvaluation(
            num_samples=plan.num_samples, chosen=plan.chosen, omitted=plan.omitted
        )
        result.site_values = {s: np.concatenate(v, 0) for s, v in self.values.items()}
        result.site_norms = {s: np.concatenate(v, 0) for s, v in self.norms.items()}
        result.log_q = np.concatenate(self.log_q)
        result.log_prior = np.concatenate(self.log_prior)
        if self.has_targets and self.observed:
            target = torch.cat(self.observed, 0)
            result.targets = target
            result.observed = _np(target)
            result.num_examples = int(target.shape[0])
            result.log_lik_sum = np.concatenate(self.ll_sum)
            if self.pointwise:
                result.pointwise = np.concatenate(self.pointwise, 0)
            num_data = getattr(model, "num_data", None)
            if num_data is not None and num_data != result.num_examples:
                logger.warning(
                    "model.num_data=%d but the data has %d examples: log_joint is the log "
                    "joint of THIS data set, not of the training posterior.",
                    num_data,
                    result.num_examples,
                )
        if self.predictive:
            result.predictive = np.concatenate(self.predictive, 0)
        if self.class_lp:
            result.class_log_probs = torch.cat(self.class_lp, 0)
        return result


# --------------------------------------------------------------------------------------------
# ArviZ adapter (the only place that knows the ArviZ API)
# --------------------------------------------------------------------------------------------


def _arviz_major() -> int:
    """Major version of the installed ``arviz`` (1 when only ``arviz-base`` is installed)."""
    try:
        return int(importlib.metadata.version("arviz").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        importlib.metadata.version("arviz-base")  # raises if neither is installed
        return 1


def _to_arviz(
    groups: dict[str, dict[str, np.ndarray]],
    *,
    dims: dict[str, list[str]],
    attrs: dict[str, Any],
    extra_groups: dict[str, Any] | None = None,
) -> Any:
    """Hand plain group dicts to ArviZ's ``from_dict``: InferenceData (0.x) or DataTree (1.x).

    ``groups`` hold sample-shaped arrays ``(chain, draw, ...)`` (``observed_data``: no sample
    dims); ``extra_groups`` are ready ``xarray.Dataset`` objects without sample dimensions (the
    ``optimization`` group) that are attached unchanged.
    """
    extra_groups = extra_groups or {}
    if _arviz_major() >= 1:
        # ArviZ >= 1 (arviz-base): UNTESTED here (this machine has arviz 0.23.4); written from
        # arviz_base.io_dict.from_dict(data, *, sample_dims, dims, attrs={group|"/": {...}}).
        import xarray as xr
        from arviz_base import from_dict

        tree = from_dict(
            groups,
            sample_dims=list(_SAMPLE_DIMS),
            dims=dims,
            attrs={"/": dict(attrs), **{g: dict(attrs) for g in groups}},
        )
        for name, dataset in extra_groups.items():
            tree[name] = xr.DataTree(dataset=dataset)
        return tree
    import arviz as az

    # `attrs` goes on the InferenceData itself (and observed_data); `<group>_attrs` on each group
    group_attrs = {f"{g}_attrs": dict(attrs) for g in groups if g != "observed_data"}
    arguments: dict[str, Any] = {**groups, **group_attrs}  # keyword arguments of from_dict
    with warnings.catch_warnings():
        # a mixture's chains are its K components (a delta particle has one distinct draw):
        # ArviZ's guess that chains > draws means swapped axes does not apply to this layout
        warnings.filterwarnings("ignore", "More chains .* than draws", UserWarning)
        idata = az.from_dict(dims=dims, attrs=dict(attrs), **arguments)
    if extra_groups:
        idata.add_groups(extra_groups)
    return idata


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def _versions() -> dict[str, str]:
    return {
        "inference_library": "pyro",
        "inference_library_version": str(pyro.__version__),
        "creation_library": "pyrobayes",
        "creation_library_version": str(__version__),
    }


def _site_dims(site: str, shape: torch.Size) -> list[str]:
    if len(shape) == 2:
        return [f"{site}_row", f"{site}_col"]
    return [f"{site}_dim_{k}" for k in range(len(shape))]


def _export_temperature(model: Any, guide: Any) -> tuple[float | None, dict[str, Any], str]:
    """The temperature of a calibrated ``guide`` that the export applies per draw (``None``:
    none, or one that is not defined per draw), the attributes that record it (none for an
    uncalibrated guide), and the warning to give when it is not applied (else ``""``)."""
    if TEMPERATURE_BUFFER not in getattr(guide, "_buffers", {}):
        return None, {}, ""
    value = temperature(guide)
    likelihood = model.likelihood
    classification = bool(likelihood.is_classification)
    pooled_form = classification and pooled(guide)
    if classification:
        # the pooled T tempers the average of the draws; with one distinct draw (a point mass)
        # that average is the draw, so per draw is exact
        per_draw = not pooled_form or bool(getattr(guide, "is_deterministic", False))
        why = (
            "it was fitted in the pooled form (pyrobayes.calibrate's default), which tempers "
            "the posterior-predictive average log (1/S) sum_s p(y | x, theta_s), not any one "
            "draw, so no per-draw log-likelihood or predictive draw carries it"
        )
    else:
        per_draw = isinstance(likelihood, Gaussian)
        why = f"the {likelihood.name!r} likelihood has no Gaussian scale to temper"
    attrs: dict[str, Any] = {
        "temperature": float(value),
        "temperature_pooled": int(pooled_form),
        "temperature_applied": int(per_draw),
    }
    if per_draw:  # (T = 1 is the fitted posterior bit for bit, as in pyrobayes.predict)
        return (None if value == 1.0 else value), attrs, ""
    return (
        None,
        attrs,
        f"to_inference_data: {type(guide).__name__} is calibrated (pyrobayes.calibrate, "
        f"T = {value:.4g}) but {why}: log_likelihood and posterior_predictive are exported "
        "UNCALIBRATED (T = 1; attributes temperature_applied = 0, temperature = T). "
        "pyrobayes.predict gives the calibrated predictive; pyrobayes.calibrate(..., "
        "pool=False) fits a per-draw temperature, which the export applies.",
    )


def _export_predictive(guide: Any) -> tuple[bool, str]:
    """Whether the export evaluates ``guide``'s linearised network (the predictive
    :func:`pyrobayes.predict` gives for a Laplace guide's ``pred_type="glm"``, its default)
    rather than the network at each draw, and the warning to give (else ``""``)."""
    if not implements(guide, LinearizedPredictive):
        return False, ""
    pred_type = str(guide.pred_type)
    if pred_type == "nn":
        return False, ""
    if pred_type == "glm":
        return True, ""
    return True, (
        f"to_inference_data: {type(guide).__name__} has pred_type={pred_type!r}, which "
        "pyrobayes.predict evaluates in closed form (the probit approximation of the "
        "linearised predictive) and which has no per-draw log-likelihood: log_likelihood, "
        "posterior_predictive and log_joint are those of the linearised network at each draw "
        "(pred_type='glm', attribute predictive = 'glm'), so az.loo / az.waic describe the GLM "
        "predictive that probit approximates. Set guide.pred_type = 'glm' (or 'nn', the "
        "network at each draw) before exporting to export the predictive you predict with."
    )


def _draws_attr(guide: Any) -> str:
    """The ``draws`` attribute of an export: what its chains and draws are."""
    if bool(getattr(guide, "is_deterministic", False)):
        return (
            "point mass: every draw is the same value, so r-hat, ESS and PSIS-LOO are undefined "
            "(ArviZ reports NaN or k-hat > 0.7); compare families by their log_likelihood instead"
        )
    if _num_components(guide) > 1:
        return (
            "equal-weight mixture: one chain per component, independent draws within it; r-hat "
            "across chains measures how far apart the components are, not convergence"
        )
    return "independent draws of q in one chain (not a Markov chain: r-hat ≈ 1, ESS ≈ S)"


def _export_attrs(
    model: Any,
    guide: Any,
    ev: DrawEvaluation,
    seed: int | None,
    linearized: bool,
    temperature_attrs: dict[str, Any],
) -> dict[str, Any]:
    """The attributes of every group of an export."""
    return {
        **_versions(),
        "guide_family": str(guide.family or type(guide).__name__),
        "guide_class": type(guide).__name__,
        "likelihood": str(model.likelihood.name),
        "num_data": int(model.num_data or ev.num_examples),
        "seed": -1 if seed is None else int(seed),
        "omitted_sites": ",".join(ev.omitted),
        # what ArviZ's chain and draw mean here, so that r-hat, ESS and PSIS-LOO read right: a
        # point mass repeats one draw (they are undefined), a mixture's chains are its components
        # (r-hat measures their spread, not convergence)
        "draws": _draws_attr(guide),
        # the predictive log_likelihood and posterior_predictive hold, per draw: the network's
        # ("nn") or the linearised network's ("glm", a Laplace guide's pyrobayes.predict)
        "predictive": "glm" if linearized else "nn",
        **temperature_attrs,
    }


def to_datatree(
    model: Any,
    guide: Any,
    data: Iterable[Any],
    *,
    num_samples: int = 100,
    seed: int | None = 0,
    sites: Sequence[str] | None = None,
    max_site_numel: int = DEFAULT_MAX_SITE_NUMEL,
    losses: Sequence[float] | Tensor | np.ndarray | None = None,
    samples_per_forward: int | None = None,
) -> Any:
    r"""Export S posterior draws and their predictions on ``data`` to ArviZ.

    For :math:`θ_s \sim q` (one chain of S draws) this stores the chosen sites, the pointwise
    log-likelihood :math:`\log p(y_i \mid x_i, θ_s)` over every batch of ``data`` (so
    ``az.loo`` / ``az.waic`` work), posterior-predictive draws
    :math:`\tilde y_{s,i} \sim p(\cdot\mid x_i, θ_s)`, the observed targets, and per draw
    :math:`\log q(θ_s)` and :math:`\log p(θ_s, D) = \sum_i \log p(y_i\mid x_i,θ_s) + \log p(θ_s)`.

    Parameters
    ----------
    model : FineTuneModel
    guide : PosteriorGuide
    data : iterable of batches
        The data set (re-iterable, e.g. a DataLoader or a list, when the posterior is larger
        than ``max_site_numel``: it is then traversed once per chunk of draws).
    num_samples : int
        S, the number of draws (the ``draw`` dimension; ``chain`` has size 1).
    seed : int, optional
        Seed of the draws and of the posterior-predictive sampling.
    sites : sequence of str, optional
        Sites to export in full. Default: all, as long as their total ``numel`` is at most
        ``max_site_numel`` (taken in declaration order); the others are exported as per-draw
        Frobenius norms ``<site>_norm`` and named in an INFO log and in the attribute
        ``omitted_sites``.
    max_site_numel : int
        Budget of exported posterior scalars per draw. It also bounds memory: one
        ``guide.sample_posterior`` call draws at most ``max(S · max_site_numel, numel(θ))``
        scalars, so a very large adapter is drawn a few samples at a time and never kept.
    losses : sequence of float, optional
        The loss trace of the fit (``FitResult.losses``), stored as group ``optimization``,
        variable ``loss`` over dimension ``step``.
    samples_per_forward : int, optional
        Draws evaluated per forward pass (default: all on an accelerator; on CPU as many as keep
        ``draws · rows · numel(net)`` under 2e8).

    Returns
    -------
    arviz.InferenceData or xarray.DataTree
        ``InferenceData`` with arviz 0.x, ``DataTree`` with ArviZ >= 1 (the latter path is not
        exercised by the test-suite).

    Warns
    -----
    UncalibratedExportWarning
        The guide is calibrated in a form that no single draw carries (see the Notes): the
        export is of the uncalibrated posterior.
    UserWarning
        A Laplace guide with ``pred_type="probit"``, which has no per-draw form: the export is
        of its linearised (``"glm"``) predictive (see the Notes).

    Notes
    -----
    **The predictive.** The draws are evaluated with the predictive :func:`pyrobayes.predict`
    gives, as the attribute ``predictive`` records: ``"nn"``, the network at each draw,
    :math:`p(y \mid f(x; θ_s))`, for every family but Laplace's linearised predictive;
    ``"glm"``, the linearised network :math:`f(x; θ̂) + J(x)(θ_s - θ̂)` at each draw, for a
    Laplace guide with ``pred_type="glm"`` (its default; the Monte Carlo form of its
    predictive, whose regression mixture tends to the closed-form Gaussian ``pb.predict``
    reports) and, with a warning, ``pred_type="probit"`` (probit is a closed-form approximation
    of it, with no per-draw log-likelihood). ``log_likelihood``, ``posterior_predictive`` and
    ``log_joint`` are then the linearised model's, so ``az.loo`` / ``az.waic`` describe the
    predictive the guide predicts with; set ``guide.pred_type = "nn"`` to export the network's.
    The Jacobians cost what ``pb.predict``'s linearised predictive costs (one forward and K
    backward passes per chunk of examples).

    **Calibrated guides.** A temperature ``T`` fitted by :func:`pyrobayes.calibrate` is
    applied as :func:`pyrobayes.predict` applies it wherever it is defined per draw, to
    ``log_likelihood`` and ``posterior_predictive``: for a classifier calibrated per draw
    (``calibrate(..., pool=False)``), or in the default pooled form on a point mass (MAP,
    whose one draw is the average), :math:`\log p_T(y \mid x, θ_s) =
    \operatorname{log\_softmax}(\log p(\cdot \mid x, θ_s) / T)_y`; for a Gaussian
    likelihood the draw's :math:`σ` becomes :math:`Tσ`. The pooled form on any other posterior
    tempers the posterior-predictive average :math:`\log \frac1S \sum_s p(y \mid x, θ_s)`,
    which no per-draw log-likelihood can hold: those groups are then the uncalibrated
    posterior's, with an :class:`UncalibratedExportWarning`. Either way the attributes record
    ``temperature`` (T), ``temperature_pooled`` (1 for the pooled form) and
    ``temperature_applied`` (1 when the two groups are tempered, 0 when uncalibrated); an
    uncalibrated guide's export has none of them and is unchanged. ``sample_stats`` (``log_q``,
    ``log_prior``, ``log_joint``, ``lp``) are always the model's own, untempered: ``T``
    calibrates the predictive, it is no part of the posterior's density.

    ``log_joint`` is summed over ``data``: it is the log joint of the training posterior only
    when ``data`` is the training set (``model.num_data`` examples); held-out data is
    exported as it is, without a warning.

    Examples
    --------
    >>> idata = pyrobayes.to_inference_data(model, guide, test_loader, num_samples=200)  # doctest: +SKIP
    >>> az.loo(idata)                                                                    # doctest: +SKIP
    """
    tempered, temperature_attrs, uncalibrated = _export_temperature(model, guide)
    linearized, other_predictive = _export_predictive(guide)
    ev = evaluate_draws(
        model,
        guide,
        data,
        num_samples=num_samples,
        seed=seed,
        sites=sites,
        max_site_numel=max_site_numel,
        samples_per_forward=samples_per_forward,
        temperature=tempered,
        training_data=False,
        linearized=linearized,
    )
    if other_predictive:
        warnings.warn(other_predictive, UserWarning, stacklevel=2)
    if uncalibrated:
        warnings.warn(uncalibrated, UncalibratedExportWarning, stacklevel=2)
    shapes = _site_shapes(model, guide)

    chains = _num_components(guide)

    def chained(a: np.ndarray) -> np.ndarray:
        # (S, ...) -> (chain, draw, ...): one chain, or one per mixture component (draw s of
        # evaluate_draws is from component s mod K)
        return a.reshape(-1, chains, *a.shape[1:]).swapaxes(0, 1)

    posterior = {s: chained(v) for s, v in ev.site_values.items()}
    posterior.update({f"{s}_norm": chained(v) for s, v in ev.site_norms.items()})
    dims = {s: _site_dims(s, shapes[s]) for s in ev.chosen}
    groups: dict[str, dict[str, np.ndarray]] = {"posterior": posterior}
    if ev.log_q is None:  # evaluate_draws fills it
        raise RuntimeError("to_inference_data: the draws were evaluated without log q.")
    sample_stats = {"log_q": chained(ev.log_q)}
    log_joint = ev.log_joint
    if log_joint is not None and ev.log_prior is not None:  # (log_joint needs log_prior)
        sample_stats["log_joint"] = chained(log_joint)
        sample_stats["lp"] = chained(log_joint)
        sample_stats["log_prior"] = chained(ev.log_prior)
    groups["sample_stats"] = sample_stats
    if ev.predictive is not None:
        groups["posterior_predictive"] = {"obs": chained(ev.predictive)}
    if ev.pointwise is not None and ev.observed is not None:
        groups["log_likelihood"] = {"obs": chained(ev.pointwise)}
        groups["observed_data"] = {"obs": ev.observed}
    attrs = _export_attrs(model, guide, ev, seed, linearized, temperature_attrs)
    extra: dict[str, Any] = {}
    if losses is not None:
        import xarray as xr

        loss = np.asarray(torch.as_tensor(losses).detach().cpu().double().numpy()).reshape(-1)
        extra["optimization"] = xr.Dataset(
            {"loss": (("step",), loss)},
            coords={"step": np.arange(loss.size)},
            attrs=dict(attrs),
        )
    # obs keeps ArviZ's default names obs_dim_0, ... (the same in every group that holds it)
    return _to_arviz(groups, dims=dims, attrs=attrs, extra_groups=extra)


#: Alias of :func:`to_datatree` (the name used by arviz 0.x converters).
to_inference_data = to_datatree
