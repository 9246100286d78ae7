r"""Temperature scaling of the posterior predictive: a post-hoc calibration step for any posterior.

One scalar :math:`T > 0` is fitted on held-out data and stored on the guide; :func:`pyrobayes.predict`
applies it from then on. For a classification likelihood (categorical, binary as two classes,
multiple choice) the calibrated predictive tempers the posterior predictive itself, the average
over the posterior's draws ("pool then calibrate", Rahaman & Thiery 2021, "Uncertainty
quantification and deep ensembles", NeurIPS),

.. math:: p_T(y \mid x) = \operatorname{softmax}\big(\log \bar p(\cdot \mid x) / T\big)_y,
    \qquad \bar p = \frac1S \sum_{s=1}^S \operatorname{softmax}(f_{θ_s}(x)),

which is Guo et al. (2017, "On calibration of modern neural networks", eq. 9) with the Bayesian
model average's log-probabilities as the logits; for a point mass (MAP) it is exactly their
temperature scaling. The calibrated prediction is that one row (``Prediction.pooled_draws``
records the S draws it averaged): it has no per-draw spread, so its mutual information is 0 by
construction, and :func:`pyrobayes.metrics.report` gives NaN for it rather than a 0 (and an
MI-based OOD AUROC of 0.5) that would read as a certain posterior. ``pool=False`` tempers every
draw before the average instead, :math:`\frac1S \sum_s \operatorname{softmax}(f_{θ_s}(x)/T)`
("calibrate then pool", what this module did before and what a file calibrated then still
applies): a :math:`T < 1` then sharpens every draw, so on a wide, under-confident posterior the
average tends to the draws' vote fractions and over-fits the held-out split (measured on the
benchmark suite's MNIST and digits tasks, 3 seeds, 8 families: validation NLL .45–.75 against
.30–.40 pooled for mean-field over LoRA factors on MNIST, .015 lower pooled for IBDR on digits,
and the pooled form never worse than per draw by more than .005 on any seed). :math:`T`
minimises the validation NLL :math:`-\frac1N \sum_n \log p_T(y_n \mid x_n)` with the draws
:math:`θ_s` fixed (one seed), so the objective is a deterministic function of :math:`\log T`.

For a Gaussian likelihood the same scalar scales the predictive standard deviation of every
mixture component, :math:`p_T(y \mid x) = \frac1S \sum_s \mathcal N(y \mid μ_s(x),
T^2 (v_s(x) + σ^2))` (``σ`` the likelihood's noise, ``v_s`` a closed-form variance such as the
linearised Laplace's :math:`J Σ J^\top`): the "std scaling" of Levi et al. (2022, "Evaluating
and calibrating uncertainty prediction in regression tasks", eq. 11). The means, and so the
RMSE and the accuracy, never change; :math:`T = 1` is the fitted posterior bit for bit.

Under ``torch.distributed`` (more than one process) the objective is the NLL summed over
every rank's held-out shard divided by the ranks' total count, both all-reduced inside the
objective: every rank evaluates the same function, takes the same search steps and stores the
same ``T``, the one-process ``T`` on the union of the shards. A held-out set too small to pin
``T`` (:func:`min_examples`) and a ``T`` at an end of its search interval warn.

The temperature is a buffer of the guide (``predictive_temperature``, with
``predictive_temperature_pooled`` for the form), so it is part of ``guide.state_dict()`` and
:func:`pyrobayes.save` / :func:`pyrobayes.load` keep it. A later fit of the guide
(:func:`pyrobayes.fit`, a fitter of :func:`pyrobayes.infer.make_fitter`, or
:func:`pyrobayes.infer.laplace.fit_laplace`) removes it with a warning
(:func:`drop_temperature`): it was fitted for the posterior the fit replaces. A ``pb.fit`` that
is refused, or takes no step on a trained family, leaves it as it was.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from .contract import Posterior
from .metrics._inputs import check_log_probabilities
from .models.adapters import check_flag, check_int, check_real
from .models.likelihoods import check_binary_targets, check_class_targets, check_gaussian_targets
from .user_frame import user_stacklevel

logger = logging.getLogger(__name__)

__all__ = [
    "TEMPERATURE_BUFFER",
    "POOL_BUFFER",
    "pooled",
    "calibrate",
    "labelled_prediction",
    "fit_temperature",
    "min_examples",
    "temperature",
    "set_temperature",
    "drop_temperature",
    "checked_temperature",
    "apply_temperature",
    "tempered_nll",
]

#: The guide buffer holding the fitted temperature (absent: ``T = 1``, nothing is applied).
TEMPERATURE_BUFFER = "predictive_temperature"
#: The guide buffer saying how ``T`` applies to a classification predictive: 1 tempers the
#: averaged predictive (the default), 0 every draw (absent with a temperature: a file
#: calibrated before the pooled form existed, whose ``T`` was fitted per draw).
POOL_BUFFER = "predictive_temperature_pooled"


def temperature(guide: Any) -> float:
    """The guide's predictive temperature ``T`` (1.0 when it was never calibrated)."""
    value = getattr(guide, "_buffers", {}).get(TEMPERATURE_BUFFER)
    return 1.0 if value is None else float(value)


def pooled(guide: Any) -> bool:
    """Whether the guide's temperature tempers the averaged predictive (``True``) or every draw."""
    flag = getattr(guide, "_buffers", {}).get(POOL_BUFFER)
    return flag is not None and bool(flag)


def set_temperature(guide: Any, value: float | None, *, pool: bool = True) -> None:
    """Store ``T`` on ``guide`` (``None`` removes it: the uncalibrated predictive); ``pool``:
    temper the averaged classification predictive (default) or every draw.

    Raises
    ------
    TypeError
        When ``guide`` is not a torch module, or ``pool`` is not ``True`` / ``False`` (a
        string such as ``"False"`` is truthy).
    ValueError
        When ``value`` is not a finite number > 0 (:func:`checked_temperature`).
    """
    buffers = getattr(guide, "_buffers", None)
    if buffers is None:
        raise TypeError(
            f"set_temperature: {type(guide).__name__} is not a torch module; pass a pyrobayes "
            "posterior guide (pyrobayes.posterior(model, family))."
        )
    if value is None:
        buffers.pop(TEMPERATURE_BUFFER, None)
        buffers.pop(POOL_BUFFER, None)
        return
    value = checked_temperature(value, "set_temperature")
    check_flag("pool", pool, owner="set_temperature: ")
    device = next((b.device for b in guide.buffers()), None)
    if device is None:
        device = next((p.device for p in guide.parameters()), torch.device("cpu"))
    guide.register_buffer(
        TEMPERATURE_BUFFER, torch.tensor(float(value), dtype=torch.float64, device=device)
    )
    guide.register_buffer(
        POOL_BUFFER, torch.tensor(1.0 if pool else 0.0, dtype=torch.float64, device=device)
    )


def checked_temperature(value: Any, owner: str) -> float:
    """``value`` as a float ``T``: a finite real number > 0 (Python, NumPy, or a one-element
    tensor); ``T <= 0`` would reverse or erase the predictive's ranking.

    Raises
    ------
    TypeError
        When ``value`` is not a real number (a bool, a string, a tensor of several elements).
    ValueError
        When it is not finite or not > 0.
    """
    return check_real("the temperature", value, gt=0, owner=f"{owner}: ")


def drop_temperature(
    guide: Any,
    owner: str,
    reason: str = "the posterior it held; this fit changes that posterior",
    then: str = "after the fit",
) -> None:
    """Remove a temperature before ``owner`` changes the predictive it was fitted for, and say
    so (``reason``: what it was fitted for and what changes it; ``then``: when to calibrate
    again).

    ``T`` is fitted to one posterior's predictive; a fit moves that posterior (or, post hoc,
    recomputes it), and Laplace's ``pred_type`` selects another predictive, after which the old
    ``T`` calibrates nothing and would silently temper every later prediction (and the fit's
    own validation scores).
    """
    if TEMPERATURE_BUFFER not in getattr(guide, "_buffers", {}):
        return
    value = temperature(guide)
    set_temperature(guide, None)
    message = (
        f"{owner}{type(guide).__name__} was calibrated (T = {value:.4g}) for {reason}, so the "
        f"temperature is removed. Call pyrobayes.calibrate(model, guide, val_data) again {then}."
    )
    logger.warning(message)
    warnings.warn(message, UserWarning, stacklevel=user_stacklevel())


def match_state(guide: Any, state: Mapping[str, Any]) -> None:
    """Give ``guide`` a temperature buffer exactly when ``state`` (a state dict about to be
    loaded strictly) holds one, so a calibrated file loads into a fresh guide and an
    uncalibrated one into a calibrated guide (:mod:`pyrobayes.io`)."""
    if TEMPERATURE_BUFFER in state:
        if TEMPERATURE_BUFFER not in guide._buffers:
            set_temperature(guide, 1.0)  # the values come with the strict load
        if POOL_BUFFER not in state:  # calibrated before the pooled form: T was fitted per draw
            guide._buffers.pop(POOL_BUFFER, None)
        elif POOL_BUFFER not in guide._buffers:
            flag = torch.zeros(
                (), dtype=torch.float64, device=guide._buffers[TEMPERATURE_BUFFER].device
            )
            guide.register_buffer(POOL_BUFFER, flag)
    else:
        set_temperature(guide, None)


def apply_temperature(prediction: Any, guide_or_value: Any, *, pool: bool | None = None) -> Any:
    """``prediction`` under the temperature of a guide (or a number): a new ``Prediction``.

    Classification, pooled (a guide calibrated so, or a number with ``pool`` left ``True``):
    one row ``log_softmax(logmeanexp_s(log_probs) / T)``, with ``pooled_draws`` set to the S
    draws it averaged (no per-draw spread is left: :func:`pyrobayes.metrics.report` gives NaN
    mutual information for it); per draw: ``log_probs ← log_softmax(log_probs / T)``. Regression: the Gaussian ``scale`` and any closed-form
    ``loc_var`` become ``T·σ`` and ``T²·v``. At ``T = 1`` the same object is returned
    (bit-identical predictions). The result records ``T`` (``Prediction.temperature``).

    Raises
    ------
    TypeError, ValueError
        A temperature that is not a finite real number > 0 (:func:`checked_temperature`), a
        ``pool`` that is not ``None``, ``True`` or ``False``, or a prediction tempered already
        (a second ``T`` would compound the first).
    """
    if pool is not None:  # (a string such as "False" is truthy: it chose a form in silence)
        check_flag("pool", pool, owner="apply_temperature: ")
    if not isinstance(guide_or_value, torch.nn.Module):  # a number (any real, or a tensor)
        value = checked_temperature(guide_or_value, "apply_temperature")
        pool = True if pool is None else pool
    else:
        value = temperature(guide_or_value)
        pool = pooled(guide_or_value) if pool is None else pool
    if value == 1.0:
        return prediction
    _refuse_tempered(prediction, "apply_temperature", "temper")
    marked = {"temperature": value} if hasattr(prediction, "temperature") else {}
    if prediction.log_probs is not None:
        log_probs = _pooled_log_probs(prediction.log_probs) if pool else prediction.log_probs
        log_probs = torch.log_softmax(log_probs / value, dim=-1)
        changes: dict[str, Any] = {"log_probs": log_probs, **marked}
        if pool and "pooled_draws" in {f.name for f in dataclasses.fields(prediction)}:
            # the draws are averaged away: metrics.report gives NaN for their mutual information
            draws = int(prediction.log_probs.shape[0])
            changes["pooled_draws"] = max(draws, getattr(prediction, "pooled_draws", None) or 0)
        return dataclasses.replace(prediction, **changes)
    if prediction.scale is None:
        raise ValueError(
            "apply_temperature: this regression prediction has no Gaussian scale to temper "
            "(the likelihood has no obs_scale)."
        )
    loc_var = prediction.loc_var
    return dataclasses.replace(
        prediction,
        scale=prediction.scale * value,
        loc_var=None if loc_var is None else loc_var * value**2,
        **marked,
    )


def _refuse_tempered(prediction: Any, owner: str, verb: str) -> None:
    """Raise when ``prediction`` was tempered already (``Prediction.temperature``): a second
    ``T`` would compound the first."""
    done = getattr(prediction, "temperature", None)
    if done is None:
        return
    raise ValueError(
        f"{owner}: this prediction was tempered already (T = {done:.4g}: pyrobayes.predict "
        "applies a calibrated guide's temperature), and a second T would compound the first. "
        f"{verb.capitalize()} the uncalibrated prediction: predict with the guide's temperature "
        "removed (pyrobayes.calibration.set_temperature(guide, None), or a copy of the guide), "
        "or use pyrobayes.calibrate(model, guide, val_data), which does so."
    )


def _pooled_log_probs(log_probs: Tensor) -> Tensor:
    """``log (1/S) Σ_s p_s`` as one row ``(1, N, C)`` from the draws' ``(S, N, C)``."""
    return torch.logsumexp(log_probs, dim=0, keepdim=True) - math.log(log_probs.shape[0])


def tempered_nll(
    prediction: Any, targets: Tensor, value: float | Tensor, *, pool: bool = True
) -> Tensor:
    """Mean NLL of the tempered posterior predictive (a differentiable function of ``value``).

    Classification: ``-mean_n log softmax(log p̄ / T)[y_n]`` with ``p̄`` the draws' average
    (``pool=False``: ``-mean_n log (1/S) Σ_s softmax(log_probs_s / T)[y_n]``); regression: the
    Gaussian mixture with every component's σ multiplied by ``T``.

    Raises
    ------
    ValueError
        When ``targets`` do not match the prediction (:func:`fit_temperature`'s check).
    """
    targets = _checked_targets(prediction, targets, "tempered_nll")
    if not isinstance(value, Tensor):
        value = checked_temperature(value, "tempered_nll")
    elif not bool((value.detach() > 0).all()):  # a tensor stays differentiable in T
        raise ValueError(f"tempered_nll: the temperature must be > 0, got {value.detach()}.")
    return _nll_terms(prediction, targets, value, pool=pool).mean()


def _checked_targets(prediction: Any, targets: Any, owner: str) -> Tensor:
    """``targets`` checked against ``prediction`` as :func:`pyrobayes.metrics.report` checks
    them: class labels ``(N,)`` or ``(N, 1)`` in range (:func:`check_class_targets`); regression
    targets in the shape of one draw of ``loc``, ``(N, *event)`` (``(N,)`` or ``(N, 1)`` for a
    scalar output), real and finite (:func:`check_gaussian_targets`). The NLL flattens the
    targets, so a transposed ``(D, N)`` or a per-sample shape would otherwise be paired with the
    wrong means and give another ``T`` without an error.

    Raises
    ------
    TypeError
        When ``targets`` is not a tensor.
    ValueError
        When they do not match the prediction (the message starts with ``owner``, the
        function's name), or a regression prediction has no Gaussian scale to temper.
    """
    if not isinstance(targets, Tensor):
        raise TypeError(f"{owner}: targets must be a tensor, got {type(targets).__name__}.")
    if prediction.log_probs is not None:
        try:  # a Prediction built by hand from probabilities or logits: T would be wrong
            check_log_probabilities(prediction.log_probs, "prediction.log_probs")
        except ValueError as err:
            raise ValueError(f"{owner}: {err}") from None
        if prediction.log_probs.dim() == 4:  # multi-label: (S, N, L, 2), 0/1 targets (N, L)
            return check_binary_targets(targets, prediction.log_probs.shape[1:-1], what=owner)
        return check_class_targets(targets, prediction.log_probs.shape[1:], what=owner)
    loc = prediction.loc
    if loc is None:
        raise ValueError(
            f"{owner}: the prediction holds neither log_probs nor loc; pass a pyrobayes.predict "
            "result."
        )
    if prediction.scale is None:
        raise ValueError(
            f"{owner}: this regression prediction has no Gaussian scale to temper; build the "
            "model with obs_scale=<float> or 'learn'."
        )
    try:  # against one draw's (N, *event): one target per example, never per draw
        return check_gaussian_targets(
            targets, loc.shape[1:], loc.dim() - 2, what="predictive mean (loc of one draw)"
        )
    except ValueError as err:
        raise ValueError(f"{owner}: {err}") from None


def _nll_terms(prediction: Any, targets: Tensor, value: float | Tensor, *, pool: bool) -> Tensor:
    """The per-example (regression: per target entry) NLL terms :func:`tempered_nll` averages."""
    t = torch.as_tensor(value, dtype=torch.float64)
    if prediction.log_probs is not None:
        lp = prediction.log_probs.detach().to(torch.float64)
        if pool:
            lp = _pooled_log_probs(lp)
        tempered = torch.log_softmax(lp / t, dim=-1)  # (S, N, C), multi-label (S, N, L, 2)
        y = targets.to(lp.device).long().reshape(1, *tempered.shape[1:-1], 1)
        picked = tempered.gather(-1, y.expand(*tempered.shape[:-1], 1)).squeeze(-1)
        if picked.dim() == 3:  # multi-label: an example's label vector, its labels' sum
            picked = picked.sum(-1)  # (S, N)
        return -(torch.logsumexp(picked, dim=0) - math.log(lp.shape[0]))
    loc = prediction.loc.detach().to(torch.float64)
    loc = loc.reshape(loc.shape[0], -1)
    var = torch.as_tensor(float(prediction.scale) ** 2, dtype=torch.float64)
    if prediction.loc_var is not None:
        var = prediction.loc_var.detach().to(torch.float64).reshape(loc.shape) + var
    y = targets.detach().to(torch.float64).reshape(1, -1)
    log_lik = torch.distributions.Normal(loc, t * var.sqrt()).log_prob(y)
    return -(torch.logsumexp(log_lik, dim=0) - math.log(loc.shape[0]))


def _minimise(objective: Any, low: float, high: float, num_grid: int = 49) -> float:
    """argmin of ``objective(log T)`` on ``[low, high]``: a grid, then golden-section search in
    the bracket around the grid's best point (deterministic; no gradient needed)."""
    grid = torch.linspace(low, high, num_grid, dtype=torch.float64).tolist()
    values = [objective(t) for t in grid]
    best = min(range(num_grid), key=lambda i: values[i])
    a, b = grid[max(best - 1, 0)], grid[min(best + 1, num_grid - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = objective(c), objective(d)
    for _ in range(40):  # bracket shrinks by 0.618 per step: (2·step)·0.618⁴⁰ ≈ 1e-8 in log T
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = objective(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = objective(d)
    candidates = [(values[best], grid[best]), (fc, c), (fd, d)]
    return min(candidates)[1]


def calibrate(
    model: Any,
    guide: Any,
    val_data: Iterable[Any],
    *,
    num_samples: int = 32,
    seed: int | None = 0,
    bounds: tuple[float, float] = (0.05, 20.0),
    device: str | torch.device | None = None,
    pool: bool = True,
    all_ranks: bool = True,
    **predict_kwargs: Any,
) -> float:
    r"""Fit the predictive temperature ``T`` on held-out data and store it on ``guide``.

    Minimises the validation NLL of the tempered posterior predictive
    :math:`p_T(y \mid x) = \operatorname{softmax}(\log \bar p(\cdot \mid x) / T)_y`, with
    :math:`\bar p = \frac1S \sum_s \operatorname{softmax}(f_{θ_s}(x))`, over :math:`\log T` (a
    grid over ``bounds`` refined by golden-section search), the draws :math:`θ_s \sim q` fixed
    by ``seed`` (Guo et al. 2017, eq. 9, on the Bayesian model average: "pool then calibrate",
    Rahaman & Thiery 2021). Gaussian likelihoods get a scale on every component's predictive
    standard deviation instead (Levi et al. 2022, eq. 11); see :mod:`pyrobayes.calibration`.
    Any previous temperature is replaced (``T`` is fitted against the uncalibrated predictive).
    Afterwards :func:`pyrobayes.predict` applies ``T``; :func:`pyrobayes.save` stores it.

    Under ``torch.distributed`` (an initialised process group of more than one process) every
    rank passes its shard of the held-out data (e.g. a loader with a ``DistributedSampler``)
    and the objective is the NLL summed over all ranks' examples divided by their total
    count (both all-reduced inside the objective, as :func:`pyrobayes.fit`'s validation
    reduces its score): every rank gets the same ``T``, the one-process ``T`` on the union of
    the shards (a ``DistributedSampler`` that pads the shards to equal length counts its
    repeated examples twice). Every rank must then call ``calibrate``; ``all_ranks=False``
    fits on this process's data alone (e.g. calibrating on rank 0 only).

    Parameters
    ----------
    model : FineTuneModel
    guide : PosteriorGuide
        A fitted posterior of any family (a MAP point mass included).
    val_data : iterable of batches
        Labelled held-out batches, as for :func:`pyrobayes.predict` (never the test split, nor
        the training data: ``T`` then undoes the fit's over-confidence on the examples it saw).
    num_samples : int
        Posterior draws S of the predictive (1 for a point mass).
    seed : int or None
        Seed of the draws (use the one predictions will use, e.g. 0, predict's default;
        ``None``: the global RNG, as for :func:`pyrobayes.predict`).
    bounds : (float, float)
        The search interval of ``T``; a fit at either end warns (``UserWarning``).
    device : str or torch.device, optional
    pool : bool
        Classification: temper the averaged predictive (default) or, ``False``, every draw
        before the average (:mod:`pyrobayes.calibration` says why the default is the former).
        Stored with ``T``. A pooled prediction is one row: it has no mutual information left
        (:func:`pyrobayes.metrics.report` gives NaN for it).
    all_ranks : bool
        Under ``torch.distributed``: fit ``T`` on every rank's data together (default; every
        rank must call ``calibrate``), or, ``False``, on this process's alone.
    **predict_kwargs
        Passed to :func:`pyrobayes.predict` (e.g. ``samples_per_forward``).

    Returns
    -------
    float
        The fitted temperature ``T`` (> 1: the predictive was over-confident, < 1: under-).

    Raises
    ------
    TypeError
        ``pool`` or ``all_ranks`` is not ``True`` / ``False``, ``num_samples`` or ``seed``
        is not an integer, ``bounds`` is not a pair of numbers, or ``model`` and ``guide``
        are passed the other way round.
    ValueError
        ``val_data`` yields no batches or no labels, ``bounds`` is not ``0 < low < high``, or the
        Gaussian likelihood has no noise scale to temper. Under ``torch.distributed`` an error
        on one rank is raised on every rank (none is left waiting in the objective's
        all-reduce).

    Warns
    -----
    UserWarning
        When the held-out set is too small to determine ``T`` (fewer than 30 examples for a
        classifier, 5 targets for a Gaussian likelihood, all ranks together; see
        :func:`min_examples`), or when ``T`` ends at either end of ``bounds``.

    Notes
    -----
    Calibrating on the training data is not detected: neither the guide nor the model keeps a
    reference to the data it was fitted on.
    """
    num_samples = check_int("num_samples", num_samples, ge=1, owner="calibrate: ")
    if seed is not None:  # (None: the global RNG, as for pb.predict)
        seed = check_int("seed", seed, owner="calibrate: ")
    check_flag("pool", pool, owner="calibrate: ")
    check_flag("all_ranks", all_ranks, owner="calibrate: ")
    low, high = _checked_bounds(bounds, "calibrate")
    _check_not_swapped(model, guide)
    size = _world_size() if all_ranks else 1
    previous = guide._buffers.get(TEMPERATURE_BUFFER) if hasattr(guide, "_buffers") else None
    was_pooled = pooled(guide)
    set_temperature(guide, None)  # fit against the uncalibrated predictive
    try:
        # under torch.distributed a rank whose prediction fails shares a NaN count in the
        # count's all-reduce (the one the objective needs anyway), and every rank stops there
        kwargs = {"num_samples": num_samples, "seed": seed, "device": device, **predict_kwargs}
        pred = _on_every_rank(size, lambda: _held_out_prediction(model, guide, val_data, **kwargs))
        targets = None if pred is None else pred.targets
        count = _examples_of_all_ranks(targets, size, _collective_device(model), "calibrate")
        fitted = _fit(pred, pred.targets, low, high, pool=pool, size=size, owner="calibrate")
    except Exception:
        if previous is not None:
            set_temperature(guide, float(previous), pool=was_pooled)
        raise
    value, at_bound = fitted
    set_temperature(guide, value, pool=pool)
    _warn_if_poorly_determined(
        value, count, at_bound, bounds, pred.log_probs is not None, size, pred.multi_label
    )
    if size == 1 and pred.log_probs is not None and pred.targets is not None:
        _warn_if_few_classes(value, pred.targets, int(pred.log_probs.shape[-1]))
    return value


def _checked_bounds(bounds: Any, owner: str) -> tuple[float, float]:
    """``bounds`` as ``(low, high)``: two finite real numbers ``0 < low < high`` (a pair of
    Python or NumPy numbers, or a two-element tensor).

    Raises
    ------
    TypeError
        When ``bounds`` is not a pair of real numbers (a single number, a string, three
        numbers), naming ``owner``'s ``bounds``.
    ValueError
        When they are not finite or not ``0 < low < high``.
    """
    usage = f"{owner}: bounds must be two finite numbers 0 < low < high, e.g. (0.05, 20.0)"
    values: list[float] | None = None
    if not isinstance(bounds, (str, bytes, Mapping)):
        try:
            items = list(bounds)
            if len(items) == 2 and not any(isinstance(b, (bool, str, bytes)) for b in items):
                values = [float(b) for b in items]
        except (TypeError, ValueError, RuntimeError):  # not iterable, or not numbers
            values = None
    if values is None:
        raise TypeError(f"{usage}; got {bounds!r} ({type(bounds).__name__}).")
    low, high = values
    if not (0 < low < high and math.isfinite(high)):
        raise ValueError(f"{usage}; got {bounds!r}.")
    return low, high


def check_not_swapped(model: Any, guide: Any, owner: str, call: str) -> None:
    """Refuse ``owner(guide, model, ...)``: the posterior passed as the model (and the model as
    the guide) failed deep inside the predictive on a missing attribute (``label_key``).

    ``call`` is the right call, for the message (``"pyrobayes.predict(model, guide, data)"``).
    """
    model_like = getattr(guide, "latent_sites", None) is not None
    if isinstance(model, Posterior) and model_like:
        raise TypeError(
            f"{owner}: the arguments are the other way round (got a {type(model).__name__} "
            f"posterior as model and a {type(guide).__name__} as guide); call {call}."
        )


def _check_not_swapped(model: Any, guide: Any) -> None:
    """:func:`check_not_swapped` for :func:`calibrate`, which also needs a guide that holds
    the temperature (a torch module)."""
    check_not_swapped(model, guide, "calibrate", "pyrobayes.calibrate(model, guide, val_data)")
    if getattr(guide, "_buffers", None) is None:
        raise TypeError(
            f"calibrate: guide must be a pyrobayes posterior (pyrobayes.posterior(model, "
            f"family)), a torch module that holds the temperature; got {type(guide).__name__}."
        )


def _warn_if_few_classes(value: float, labels: Tensor, num_classes: int) -> None:
    """:func:`calibrate`'s warning for held-out labels of one class, or of fewer than half the
    classes (a class-sorted, unshuffled slice): a temperature fitted there rewards confidence
    in those classes only."""
    seen = int(torch.unique(labels).numel())
    if num_classes < 2 or (seen > 1 and 2 * seen >= num_classes):
        return
    _warn(
        f"calibrate: T = {value:.4g} was fitted on held-out labels of only {seen} of the "
        f"{num_classes} classes: a temperature fitted there rewards confidence in "
        f"{'that class' if seen == 1 else 'those classes'} alone (an unshuffled, class-sorted "
        "slice of the data?). Calibrate on a held-out split drawn from every class."
    )


def _held_out_prediction(model: Any, guide: Any, val_data: Iterable[Any], **kwargs: Any) -> Any:
    """:func:`calibrate`'s prediction on ``val_data`` (:func:`labelled_prediction`), refused
    when a Gaussian likelihood has no noise scale to temper."""
    pred = labelled_prediction(
        model,
        guide,
        val_data,
        owner="calibrate: ",
        why="temperature scaling fits T to held-out labels",
        **kwargs,
    )
    if pred.log_probs is None and pred.scale is None:
        raise ValueError(
            "calibrate: the Gaussian likelihood has no noise scale (obs_scale) to temper; "
            "build the model with obs_scale=<float> or 'learn'."
        )
    return pred


def _on_every_rank(size: int, compute: Callable[[], Any]) -> Any:
    """``compute()``; with ``size > 1`` (the ranks fit ``T`` together) an error it raises is kept
    for :func:`_examples_of_all_ranks` and ``None`` is returned instead
    (:func:`~pyrobayes.infer.rank_errors.run_shared`)."""
    if size == 1:
        return compute()
    from .infer.rank_errors import run_shared  # (function-local: infer imports this module)

    return run_shared(compute, lambda: None)


def _examples_of_all_ranks(
    targets: Tensor | None, size: int, device: torch.device, owner: str
) -> int:
    """The number of examples ``T`` is fitted on, all ranks together: with ``size > 1`` one
    all-reduce, the one the objective's count needs anyway.

    ``targets`` is ``None`` on a rank whose part failed (:func:`_on_every_rank` kept its error):
    it shares NaN, so the sum is NaN on every rank and every rank stops there, instead of the
    others waiting in the objective's all-reduce (until gloo's timeout, 30 minutes).

    Raises
    ------
    Exception
        On the rank that failed: its own error.
    ValueError
        On the other ranks: naming that rank and its error (``owner``'s ``ValueError``, as in
        one process).
    """
    count = math.nan if targets is None else float(targets.numel())
    if size == 1:
        return int(count)
    total = torch.tensor([count], dtype=torch.float64, device=device)
    _all_reduce_mean(total)
    if not math.isfinite(float(total)):  # the same sum on every rank: all stop here together
        _stop_every_rank(owner, failed_here=targets is None)
    return round(float(total) * size)


def _stop_every_rank(owner: str, failed_here: bool) -> None:
    """Raise the error a rank kept for :func:`_examples_of_all_ranks`: its own on that rank
    (``failed_here``), a ``ValueError`` naming it on the others."""
    from .infer.rank_errors import raise_kept

    remedy = (
        "Under torch.distributed every rank fits T together, so none goes on when another "
        "rank's held-out data failed: fix that rank's data (or the memory it ran out of) and "
        f"call {owner} again on every rank."
    )
    try:
        raise_kept(f"{owner}'s held-out data", caller=owner, remedy=remedy)
    except RuntimeError as err:
        if failed_here:  # this rank's own error (e.g. out of memory)
            raise
        raise ValueError(str(err)) from None
    raise RuntimeError(  # (a count is finite on a rank that kept no error)
        f"{owner}: the ranks' held-out example counts summed to NaN, but no rank kept an error."
    )


def _warn_if_poorly_determined(
    value: float,
    count: int,
    at_bound: str | None,
    bounds: tuple[float, float],
    classification: bool,
    size: int,
    multi_label: bool = False,
) -> None:
    """:func:`calibrate`'s warnings: too few held-out examples (:func:`min_examples`), or ``T``
    at an end of ``bounds``. ``count`` is of the held-out targets' values: examples, a
    regression's target values, or a multi-label prediction's (example, label) pairs, each a
    binary prediction that ``T`` tempers."""
    needed = min_examples(classification=classification)
    if count < needed:
        what = "example" if classification else "target value"
        what = "binary prediction" if multi_label else what
        pairs = " (example × label pairs)" if multi_label else ""
        _warn(
            f"calibrate: T = {value:.4g} was fitted on {count} held-out {what}"
            f"{'' if count == 1 else 's'}{pairs}"
            f"{' (all ranks)' if size > 1 else ''}, fewer than {needed}: T is poorly determined "
            "(its standard error in log T exceeds 1/3, a factor of 2 either way at two "
            "standard errors). Calibrate on a larger held-out split."
        )
    if at_bound is not None:
        if classification:
            why = (
                ", i.e. the held-out labels are predicted (almost) perfectly: is val_data the "
                "training data, or too small?"
                if at_bound == "lower"
                else ", i.e. the predictive is that badly over-confident."
            )
        elif at_bound == "lower":  # the predictive σ is over 1/low times the residuals' scale
            why = (
                ", i.e. the predictive standard deviation is far too wide for the held-out "
                "residuals: the Gaussian noise scale (obs_scale) is probably far too large for "
                "these targets (their units?); refit with a smaller obs_scale or "
                "obs_scale='learn' (or is val_data the training data?)."
            )
        else:
            why = (
                ", i.e. the predictive standard deviation is far too narrow for the held-out "
                "residuals: the Gaussian noise scale (obs_scale) is probably far too small for "
                "these targets; refit with a larger obs_scale or obs_scale='learn'."
            )
        _warn(
            f"calibrate: T = {value:.4g} is at the {at_bound} end of bounds={bounds!r}: the "
            f"validation NLL still falls beyond it{why} Widen bounds if the temperature is "
            "meant to go further."
        )


def labelled_prediction(
    model: Any,
    guide: Any,
    val_data: Iterable[Any],
    *,
    owner: str,
    why: str,
    predict_fn: Callable[..., Any] | None = None,
    **predict_kwargs: Any,
) -> Any:
    """:func:`pyrobayes.predict` (or ``predict_fn``, called the same way) on held-out data that
    must be non-empty and labelled (what a post-hoc choice on held-out data needs: a
    temperature, a prior precision).

    Raises
    ------
    ValueError
        ``val_data`` yields no batches, or its batches carry no labels (the message starts with
        ``owner`` and says ``why`` the labels are needed).
    """
    from .predictive import (  # (predict applies the temperature: a function-local import)
        ShuffledDataWarning,
        predict,
    )

    try:
        with warnings.catch_warnings():  # scored against pred.targets: any order is right
            warnings.simplefilter("ignore", ShuffledDataWarning)
            pred = (predict_fn or predict)(model, guide, val_data, **predict_kwargs)
    except TypeError as err:
        if "unexpected keyword argument" in str(err):
            raise TypeError(
                f"{owner}{err}: its keyword arguments beyond its own are predict()'s "
                "(num_samples, seed, device, samples_per_forward, ...)."
            ) from None
        raise
    except ValueError as err:
        if "no batches" in str(err):
            raise ValueError(
                f"{owner}val_data yielded no batches; pass a non-empty iterable of labelled "
                "held-out batches (a validation loader, not the test split)."
            ) from None
        raise
    if pred.targets is None or pred.targets.numel() == 0:
        raise ValueError(
            f"{owner}val_data has no labels; {why}, so each batch must carry them (the model's "
            f"label key {model.label_key!r})."
        )
    return pred


def fit_temperature(
    prediction: Any,
    targets: Tensor | None = None,
    *,
    bounds: tuple[float, float] = (0.05, 20.0),
    pool: bool = True,
    all_ranks: bool = True,
) -> float:
    """The temperature ``T`` minimising the NLL of an (uncalibrated) ``Prediction``'s tempered
    posterior predictive on its ``targets`` (:func:`tempered_nll`, pooled or per draw as
    ``pool`` says); what :func:`calibrate` fits.

    For predictives that are not a guide's (a deep ensemble's members stacked as the draws,
    another library's probabilities as one row): apply the result with
    :func:`apply_temperature`. Never worse than ``T = 1`` on these targets. A fit at either
    end of ``bounds`` is logged (:func:`calibrate` warns). Under ``torch.distributed`` with
    ``all_ranks`` (default) the NLL is summed over every rank's prediction, so every rank must
    call it and all get the same ``T`` (see :func:`calibrate`).

    Raises
    ------
    TypeError
        ``bounds`` is not a pair of numbers.
    ValueError
        No targets, targets that do not match the prediction (class labels ``(N,)`` or
        ``(N, 1)``; regression targets shaped like one draw of ``loc``, ``(N, *event)``, and
        finite), ``bounds`` not ``0 < low < high``, or a prediction tempered already
        (``Prediction.temperature``: a calibrated guide's, which :func:`calibrate` removes
        before it predicts). Under ``torch.distributed`` (``all_ranks``) an error on one rank
        is raised on every rank (none is left waiting in the objective's all-reduce).
    """
    size = _world_size() if all_ranks else 1
    # under torch.distributed a rank whose arguments are refused shares a NaN count in the
    # count's all-reduce (the one the objective needs anyway), and every rank stops there
    checked = _on_every_rank(size, lambda: _fit_arguments(prediction, targets, bounds))
    device = _collective_device(prediction)
    _examples_of_all_ranks(None if checked is None else checked[0], size, device, "fit_temperature")
    targets, low, high = checked  # (None only on a rank that failed: it raised above)
    value, at_bound = _fit(
        prediction, targets, low, high, pool=pool, size=size, owner="fit_temperature"
    )
    if at_bound is not None:
        logger.warning(
            "fit_temperature: T = %.4g is at the %s end of bounds=%s; widen bounds if the "
            "predictive is that badly calibrated.",
            value,
            at_bound,
            bounds,
        )
    return value


def _fit_arguments(prediction: Any, targets: Any, bounds: Any) -> tuple[Tensor, float, float]:
    """:func:`fit_temperature`'s checked ``(targets, low, high)`` (its Raises)."""
    targets = prediction.targets if targets is None else targets
    if targets is None or targets.numel() == 0:
        raise ValueError("fit_temperature: the prediction has no targets; pass targets=.")
    targets = _checked_targets(prediction, targets, "fit_temperature")
    _refuse_tempered(prediction, "fit_temperature", "fit T on")
    low, high = _checked_bounds(bounds, "fit_temperature")
    return targets, low, high


def min_examples(*, classification: bool) -> int:
    """The fewest held-out examples (regression: target values) on which :func:`calibrate`
    fits ``T`` without warning that it is poorly determined.

    The maximum-likelihood ``log T`` from ``n`` examples has a standard error of about
    ``1 / sqrt(n·I)``, ``I`` the Fisher information of ``log T`` per example: the variance,
    under the tempered predictive, of the derivative of ``log p_T(y | x)`` in ``log T``. For a
    classifier that is the predictive variance of the tempered logits, about 0.3 on the
    teacher problems of tests/test_calibration.py (two classes: ``p(1-p)·log²(p/(1-p))``,
    at most 0.44, at p ≈ 0.92); for a Gaussian σ scale it is exactly 2 (the derivative is
    ``r² - 1``, ``r²`` a χ²₁). We ask for a standard error of at most 1/3 (``T`` within a
    factor of 2 either way at two standard errors): ``n ≥ 9 / I``, 30 examples for a
    classifier and 5 target values for a Gaussian likelihood.
    """
    return 30 if classification else 5


def _collective_device(prediction_or_model: Any) -> torch.device:
    """Where a collective's tensor lives: the prediction's (or model's) device; CPU for gloo."""
    device = getattr(prediction_or_model, "device", None)
    if device is None:
        ref = getattr(prediction_or_model, "log_probs", None)
        if ref is None:
            ref = getattr(prediction_or_model, "loc", None)
        device = ref.device if isinstance(ref, Tensor) else torch.device("cpu")
    return torch.device(device)


def _fit(
    prediction: Any,
    targets: Tensor,
    low: float,
    high: float,
    *,
    pool: bool,
    size: int,
    owner: str,
) -> tuple[float, str | None]:
    """``(T, at_bound)``: the NLL-minimising ``T`` in ``[low, high]``, and ``"lower"`` /
    ``"upper"`` when ``T`` ended at that end of the interval (else ``None``). ``size > 1``: the
    objective is the NLL summed over the ranks' examples divided by their total count,
    all-reduced inside the objective, so every rank evaluates the same values, takes the same
    steps and returns the same ``T``; an error in one rank's part of it stops every rank in
    that all-reduce (:func:`_stop_in_objective`, ``owner``'s), where the others waited until
    gloo's timeout (30 minutes) before.
    """
    device = _collective_device(prediction)

    def local(log_t: float) -> Tensor:  # this rank's (NLL sum, count)
        terms = _nll_terms(prediction, targets, math.exp(log_t), pool=pool)
        return torch.stack([terms.sum(), terms.new_tensor(float(terms.numel()))]).to(device)

    def objective(log_t: float) -> float:
        if size == 1:
            return float(_nll_terms(prediction, targets, math.exp(log_t), pool=pool).mean())
        # (Σ_rank NLL sum, Σ_rank count) in one all-reduce; all_reduce_mean_ divides both by
        # the world size, which their ratio does not see. A rank whose part raises (an
        # out-of-memory error) shares a NaN count instead (:func:`_on_every_rank`): a count
        # is finite on every other rank, so a NaN sum of the counts means a rank failed, and
        # every rank stops there (a NaN NLL alone is no error: the search goes on as before)
        both = _on_every_rank(size, lambda: local(log_t))
        if both is None:
            both = torch.full((2,), math.nan, dtype=torch.float64, device=device)
        _all_reduce_mean(both)
        if not math.isfinite(float(both[1])):  # the same sum on every rank: all stop here
            _stop_in_objective(owner)
        return float(both[0] / both[1])

    log_t = _minimise(objective, math.log(low), math.log(high))
    value = math.exp(log_t)
    before, after = objective(0.0), objective(log_t)
    if after > before:  # the grid holds log T = 0 only approximately: never worse than T = 1
        value, after = 1.0, before
    at_bound = None
    if value != 1.0 and abs(log_t - math.log(low)) < 1e-6:
        at_bound = "lower"
    elif value != 1.0 and abs(log_t - math.log(high)) < 1e-6:
        at_bound = "upper"
    logger.info("calibrate: T = %.4f, validation NLL %.4f -> %.4f", value, before, after)
    return value, at_bound


def _stop_in_objective(owner: str) -> None:
    """Raise the error a rank kept in :func:`_fit`'s objective: its own on that rank, a
    ``RuntimeError`` naming it on the others (one gather, on this failure path only)."""
    from .infer.rank_errors import raise_kept

    remedy = (
        "Under torch.distributed every rank fits T together, so none goes on when another "
        "rank's temperature objective failed: fix that rank's error (e.g. the memory it ran "
        f"out of: fewer held-out examples or num_samples per rank) and call {owner} again on "
        "every rank."
    )
    raise_kept(f"{owner}'s temperature objective", caller=owner, remedy=remedy)
    raise RuntimeError(  # (a count is finite on a rank that kept no error)
        f"{owner}: the ranks' held-out example counts summed to NaN in the temperature "
        "objective, but no rank kept an error."
    )


def _world_size() -> int:
    from .infer.distributed import world  # (function-local: infer imports this module)

    return world()[0]


def _all_reduce_mean(values: Tensor) -> None:
    """Average ``values`` in place over the ranks (as :func:`pyrobayes.fit`'s validation does)."""
    from .infer.distributed import all_reduce_mean_

    all_reduce_mean_([values])


def _warn(message: str) -> None:
    """A ``UserWarning`` at :func:`calibrate`'s caller (and the same line in the log)."""
    logger.warning(message)
    warnings.warn(message, UserWarning, stacklevel=user_stacklevel())
