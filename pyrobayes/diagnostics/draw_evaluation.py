r"""S guide draws evaluated on a data set: :func:`evaluate_draws` and its :class:`DrawEvaluation`.

The one batched pass behind the ArviZ export (:mod:`pyrobayes.diagnostics.export`) and the k-hat
diagnostics (:mod:`pyrobayes.diagnostics.khat`): the draws, taken in chunks, their kept sites,
:math:`\log q` and :math:`\log p(θ)`, and what :mod:`~pyrobayes.diagnostics.chunk_evaluation`
computes from each chunk on every batch, collected into one :class:`DrawEvaluation`.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from ..batch import batch_size, split_batch
from ..contract import LinearizedPredictive, Mixture, implements
from ..fitted_head import warn_if_never_fitted
from ..models.adapters import check_int
from ..predictive import cat_examples, check_fitted_model
from ..user_frame import user_stacklevel
from .chunk_evaluation import Chunk, Linearization, PassOrder, Wanted, evaluate_chunk
from .sites import DEFAULT_MAX_SITE_NUMEL, select_sites, site_numel, site_shapes

__all__ = ["DrawEvaluation", "evaluate_draws"]

logger = logging.getLogger(__name__)


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


def num_components(guide: Any) -> int:
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
    owner: str = "to_inference_data",
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
        S (an integer >= 1).
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
        Draws per forward pass, an integer >= 1 (default:
        ``pyrobayes.predictive.default_samples_per_forward``).
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
    owner : str
        The function the user called (``"to_inference_data"``, ``"diagnose"``), which the
        refusals and warnings name. Default: ``"to_inference_data"``.

    Returns
    -------
    DrawEvaluation

    Warns
    -----
    UserWarning
        Before the draws are gathered, when the S draws' kept site values, pointwise
        log-likelihoods and predictive draws would take more than
        :data:`MEMORY_WARNING_BYTES` (4 GiB), with the size and what to pass instead. The
        number of examples is that of a list of batches or a ``DataLoader``'s data set, else
        of the first pass over ``data``.

    Raises
    ------
    ValueError
        ``linearized=True`` for a guide that has no linearised predictive; ``num_samples`` or
        ``samples_per_forward`` below 1; a pass over ``data`` after the first (one per chunk
        of draws) that yields other examples, or another order, than the first (a shuffling
        loader: pass one with ``shuffle=False``); ``data`` that mixes batches with targets and
        batches without (the log-likelihood must cover every example or none), naming the
        first batch without.
    TypeError
        ``num_samples``, ``samples_per_forward`` or ``seed`` not an integer (a NumPy integer
        is one).
    """
    caller = f"{owner}: "  # the function the user called (to_inference_data, diagnose)
    num_samples = check_int("num_samples", num_samples, ge=1, owner=caller)
    if seed is not None:  # as pyrobayes.predict (torch's manual_seed refuses a NumPy integer)
        seed = check_int("seed", seed, owner=caller)
    if samples_per_forward is not None:  # as pyrobayes.predict: < 1 left the per-draw loop empty
        samples_per_forward = check_int(
            "samples_per_forward", samples_per_forward, ge=1, owner=caller
        )
    if temperature is not None and not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"evaluate_draws: temperature must be finite and > 0, got {temperature}.")
    if linearized and not implements(guide, LinearizedPredictive):
        raise ValueError(
            f"evaluate_draws: linearized=True needs a guide with a linearised predictive "
            f"(Laplace); {type(guide).__name__} has none. Pass linearized=False."
        )
    check_fitted_model(model, guide, owner)
    warn_if_never_fitted(guide, model, owner)
    if iter(data) is data:  # a one-shot iterator: keep its batches for every chunk of draws
        data = list(data)
    model.train(False)
    plan = _DrawPlan.of(model, guide, num_samples, sites, max_site_numel, summarise_omitted)
    generator = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
    classification = bool(model.likelihood.is_classification)
    out = _Collected(plan)
    linearization = Linearization.of(model, guide) if linearized else None
    # one pass over data per chunk of draws
    order = PassOrder(-(-plan.num_samples // plan.chunk), owner, model.label_key)
    order.refuse_shuffling(data)  # before any work, where it can be told up front
    _warn_if_large(plan, _known_size(data, model.label_key), pointwise, predictive, owner)
    for start in range(0, plan.num_samples, plan.chunk):
        n = min(plan.chunk, plan.num_samples - start)
        values = _draw(guide, n, plan.components, generator, model.device)
        out.add_draws(model, guide, values, n)
        pp_seed = int(torch.randint(0, 2**62, (1,), generator=generator)) if generator else None
        keep_class = max(0, min(n, num_class_samples - start)) if classification else 0
        wanted = Wanted(
            pointwise, predictive, keep_class, samples_per_forward, temperature, linearization
        )
        chunk = evaluate_chunk(model, data, values, n, wanted, pp_seed, order)
        if start == 0 and _known_size(data, model.label_key) is None:  # now told by a pass
            _warn_if_large(plan, _chunk_size(chunk), pointwise, predictive, owner)
        out.add_chunk(chunk)
        del values, chunk
    return out.result(model if training_data else None)


#: Above this many bytes, the S draws' kept sites and per-example results that
#: :func:`evaluate_draws` holds in memory (before any copy an export makes) are warned of.
MEMORY_WARNING_BYTES = 4 * 2**30


def _known_size(data: Iterable[Any], label_key: str) -> tuple[int, int] | None:
    """``(examples, target scalars per example)`` of ``data`` without a pass over it: a list of
    batches, or a ``DataLoader`` over a sized data set (1 target scalar assumed); else None."""
    if isinstance(data, (list, tuple)):
        examples, per_example = 0, 1
        for batch in data:
            try:
                inputs, y = split_batch(batch, label_key)
                examples += batch_size(inputs)
            except (TypeError, ValueError):  # refused, with its reason, by the pass itself
                return None
            if y is not None and y.dim() > 1 and y.shape[0]:
                per_example = max(per_example, int(y[0].numel()))
        return examples, per_example
    dataset: Any = getattr(data, "dataset", None)
    try:
        return len(dataset), 1
    except TypeError:  # no data set, or an unsized (iterable) one
        return None


def _chunk_size(chunk: Chunk) -> tuple[int, int] | None:
    """``(examples, scalars per example)`` as the first chunk's pass found them."""
    if chunk.observed:
        first = chunk.observed[0]
        per_example = int(first[0].numel()) if first.dim() > 1 and len(first) else 1
        return sum(int(y.shape[0]) for y in chunk.observed), per_example
    if chunk.predictive:
        first = chunk.predictive[0]
        per_example = int(first[0, 0].numel()) if first.dim() > 1 and first.shape[1] else 1
        return sum(int(p.shape[1]) for p in chunk.predictive), per_example
    return None


def _warn_if_large(
    plan: _DrawPlan, size: tuple[int, int] | None, pointwise: bool, predictive: bool, owner: str
) -> None:
    """Warn, before the draws' results are gathered, when the S draws' kept sites and
    per-example results (``(S, N)`` pointwise log-likelihoods and ``(S, N, ...)`` predictive
    draws, 8 bytes a value) would take more than :data:`MEMORY_WARNING_BYTES`."""
    examples, per_example = size if size is not None else (0, 1)
    s = plan.num_samples
    sites = s * plan.kept_numel * 8
    per_draw = examples * ((8 if pointwise else 0) + (8 * per_example if predictive else 0))
    total = sites + s * per_draw
    if total <= MEMORY_WARNING_BYTES:
        return
    warnings.warn(
        f"{owner}: num_samples={s} draws on {examples} examples will hold about "
        f"{total / 2**30:.1f} GiB in memory ({sites / 2**30:.1f} GiB of kept site values, "
        f"{s * per_draw / 2**30:.1f} GiB of pointwise log-likelihoods and predictive draws), "
        "before the copy the export makes. Pass fewer num_samples, a subset of the data, "
        "pointwise=False / predictive=False where they are not needed, or fewer sites.",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


class _DrawPlan(NamedTuple):
    """How many draws, in chunks of how many, of how many mixture components; which sites."""

    num_samples: int
    chunk: int
    components: int
    chosen: list[str]
    omitted: list[str]
    kept_numel: int = 0  # scalars of the chosen sites per draw

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
        shapes = site_shapes(model, guide)
        chosen, omitted = select_sites(shapes, sites, max_site_numel)
        if not summarise_omitted:
            omitted = []
        if omitted:
            logger.info(
                "Posterior export keeps only the Frobenius norm of sites %s (%d scalars per "
                "draw; max_site_numel=%d). Pass sites=[...] to export them in full.",
                omitted,
                sum(site_numel(shapes[s]) for s in omitted),
                max_site_numel,
            )
        total = sum(site_numel(s) for s in shapes.values())
        chunk = _draw_chunk(num_samples, total, max_site_numel)
        components = num_components(guide)
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
        kept = sum(site_numel(shapes[s]) for s in chosen)
        return cls(num_samples, chunk, components, chosen, omitted, kept)


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

    def add_chunk(self, chunk: Chunk) -> None:
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
