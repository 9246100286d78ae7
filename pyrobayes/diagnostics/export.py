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
hands them to ``from_dict`` through one adapter, :func:`~pyrobayes.diagnostics.arviz_adapter.to_arviz`.

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

import logging
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from ..calibration import check_not_swapped
from ..user_frame import user_stacklevel
from .arviz_adapter import to_arviz
from .draw_evaluation import DrawEvaluation, evaluate_draws, num_components
from .export_attrs import export_attrs, export_predictive, export_temperature
from .sites import DEFAULT_MAX_SITE_NUMEL, select_sites, site_shapes

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


class UncalibratedExportWarning(UserWarning):
    """A calibrated guide (:func:`pyrobayes.calibrate`) exported without its temperature: its
    ``T`` tempers the posterior-predictive average (the default, pooled form), which no single
    draw's log-likelihood or predictive draw can carry, so ``log_likelihood`` and
    ``posterior_predictive`` are those of the uncalibrated posterior (attribute
    ``temperature_applied = 0``). :func:`pyrobayes.predict` gives the calibrated predictive."""


def _site_dims(site: str, shape: torch.Size) -> list[str]:
    if len(shape) == 2:
        return [f"{site}_row", f"{site}_col"]
    return [f"{site}_dim_{k}" for k in range(len(shape))]


def _loss_trace(losses: Any) -> np.ndarray:
    """``losses`` as a 1-D float64 array, one loss per step."""
    try:
        loss = torch.as_tensor(losses).detach().cpu().double()
    except (TypeError, ValueError, RuntimeError) as err:
        hint = " (pass its .losses)" if hasattr(losses, "losses") else f" ({err})"
        raise TypeError(
            f"to_datatree: losses must be a 1-D sequence of floats (FitResult.losses); got "
            f"{type(losses).__name__}{hint}."
        ) from err
    if loss.dim() != 1:
        raise ValueError(
            f"to_datatree: losses must be 1-D, one loss per step (FitResult.losses); got shape "
            f"{tuple(loss.shape)}. Pass the fit's loss trace, e.g. losses=fit_result.losses."
        )
    return loss.numpy()


def _log_without_targets(label_key: str) -> None:
    """Say (INFO, as the sites summarised by their norm) which groups an export of data
    without targets leaves out."""
    logger.info(
        "to_inference_data: data carries no targets (batches (x,) or x, (x, None), or dicts "
        "without the model's label key %r), so the export has no log_likelihood nor "
        "observed_data group and sample_stats has no log_joint, lp nor log_prior (az.loo / "
        "az.waic need them). Give every batch its targets to export them.",
        label_key,
    )


def _warn_if_examples_dropped(data: Any) -> None:
    """Warn when a ``DataLoader`` with ``drop_last=True`` leaves examples out of the export
    (``log_likelihood``, and ``log_joint``, summed over the examples exported)."""
    if not isinstance(data, DataLoader) or not data.drop_last or not data.batch_size:
        return
    dropped = data.batch_size
    try:
        size = len(data.dataset)  # type: ignore[arg-type]
    except TypeError:  # an iterable dataset: nothing to count
        return
    if size % dropped:
        warnings.warn(
            f"to_inference_data: data is a DataLoader with drop_last=True, so the last "
            f"{size % dropped} of its {size} examples are left out of the export "
            "(log_likelihood, log_joint). Export with a loader with drop_last=False.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


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
        than ``max_site_numel``: it is then traversed once per chunk of draws, and every pass
        must yield the same examples in the same order, else a ``ValueError``: a loader with
        ``shuffle=False``). Every batch carries its targets, or none does: data without
        targets is exported without ``log_likelihood``, ``observed_data`` and
        ``sample_stats``' ``log_joint``, ``lp`` and ``log_prior`` (said in an INFO log).
    num_samples : int
        S, the number of draws (the ``draw`` dimension; ``chain`` has size 1).
    seed : int, optional
        Seed of the draws and of the posterior-predictive sampling.
    sites : sequence of str, optional
        Sites to export in full (one site may be named by a ``str``). Default: all, as long
        as their total ``numel`` is at most
        ``max_site_numel`` (taken in declaration order); the others are exported as per-draw
        Frobenius norms ``<site>_norm`` and named in an INFO log and in the attribute
        ``omitted_sites``.
    max_site_numel : int
        Budget of exported posterior scalars per draw, a number >= 0 (``float("inf")``: no
        budget; ``None`` and negative numbers are refused). It also bounds memory: one
        ``guide.sample_posterior`` call draws at most ``max(S · max_site_numel, numel(θ))``
        scalars, so a very large adapter is drawn a few samples at a time and never kept.
    losses : sequence of float, optional
        The loss trace of the fit (``FitResult.losses``), 1-D, stored as group
        ``optimization``, variable ``loss`` over dimension ``step``.
    samples_per_forward : int, optional
        Draws evaluated per forward pass, an integer >= 1 (default: all on an accelerator; on CPU as many as keep
        ``draws · rows · numel(net)`` under 2e8).

    Returns
    -------
    arviz.InferenceData or xarray.DataTree
        ``InferenceData`` with arviz 0.x, ``DataTree`` with ArviZ >= 1 (the latter path is not
        exercised by the test-suite).

    Raises
    ------
    ValueError
        ``data`` mixes batches with targets and batches without (``log_likelihood`` would
        cover the labelled examples only), naming the first batch without; a shuffling loader
        when the draws take several passes; ``data`` yielding no batches.

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
    check_not_swapped(model, guide, "to_datatree", "pyrobayes.to_datatree(model, guide, data)")
    _warn_if_examples_dropped(data)
    tempered, temperature_attrs, uncalibrated = export_temperature(model, guide)
    linearized, other_predictive = export_predictive(guide)
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
        warnings.warn(other_predictive, UserWarning, stacklevel=user_stacklevel())
    if uncalibrated:
        warnings.warn(uncalibrated, UncalibratedExportWarning, stacklevel=user_stacklevel())
    shapes = site_shapes(model, guide)

    chains = num_components(guide)

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
    else:  # data without targets (evaluate_draws refuses data with some)
        _log_without_targets(model.label_key)
    attrs = export_attrs(model, guide, ev, seed, linearized, temperature_attrs)
    extra: dict[str, Any] = {}
    if losses is not None:
        import xarray as xr

        loss = _loss_trace(losses)
        extra["optimization"] = xr.Dataset(
            {"loss": (("step",), loss)},
            coords={"step": np.arange(loss.size)},
            attrs=dict(attrs),
        )
    # obs keeps ArviZ's default names obs_dim_0, ... (the same in every group that holds it)
    return to_arviz(groups, dims=dims, attrs=attrs, extra_groups=extra)


#: Alias of :func:`to_datatree` (the name used by arviz 0.x converters).
to_inference_data = to_datatree
