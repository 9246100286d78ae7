r"""The Laplace prior precision chosen on held-out data (laplace-torch's ``method="gridsearch"``).

The marginal likelihood picks ``τ`` from the training data alone,
``τ ≈ γ / ‖θ^*‖²`` at its optimum (MacKay 1992, "Bayesian interpolation": ``γ = Σ_j h_j / (h_j + τ)`` the
number of directions the data determine). On adapters trained with Adam that is a weak prior: ``‖θ^*‖²``
holds what the optimiser put there without the data asking for it (the random initialisation of
LoRA's ``A``, which the data never move; steps of Adam in directions with no curvature), while
``γ`` counts only the few hundred determined directions, so every other direction keeps the
prior's wide variance ``1/τ`` and the predictive is under-confident. :func:`select_prior_precision`
instead picks ``τ`` from a grid around the guide's current one by the NLL of the predictive on a
held-out split,

.. math:: \hat τ = \arg\min_{τ \in \{τ_0 \cdot 10^{k}\}} -\frac1N \sum_{n} \log
          p_τ(y_n \mid x_n, \mathcal D),

as laplace-torch's README does with ``la.optimize_prior_precision(method="gridsearch",
val_loader=...)`` (Daxberger et al. 2021). The grid includes ``τ_0`` (factor 1), so the held-out
NLL never rises above the current posterior's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..calibration import TEMPERATURE_BUFFER, labelled_prediction, temperature
from ..linearized import linearize, linearized_predict
from ..models.adapters import check_int
from ..predictive import Prediction
from .distributed import all_reduce_sum_, world
from .rank_errors import PASS_REMEDY, raise_kept, run_shared

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_FACTORS", "select_prior_precision"]

#: Multiples of the current τ searched by default: 10^-2 … 10^4 in half-decades. Larger τ shrinks
#: the posterior toward the MAP (10^4 times the evidence's τ is the MAP's predictive on the
#: suite's tasks); smaller τ widens it for an over-confident MAP.
DEFAULT_FACTORS: tuple[float, ...] = tuple(10.0 ** (k / 2) for k in range(-4, 9))

#: Held-out Jacobians kept for the whole grid up to this size (bytes); above it every grid point
#: runs the linearised predictive's network passes again.
LINEARIZATION_MAX_BYTES = 2**30
#: :func:`pyrobayes.predict` options that the cached linearised predictive honours (the
#: network draws' chunking does not apply to it).
_LINEARIZED_OPTIONS = frozenset({"examples_per_forward", "progress_bar", "samples_per_forward"})


def _refuse_one_shot(val_data: Iterable[Any], owner: str) -> None:
    """Refuse a one-shot iterator (a generator): the grid reads ``val_data`` once per τ, so the
    first grid point's pass would use it up."""
    if iter(val_data) is val_data:
        raise TypeError(
            f"{owner}val_data is a one-shot iterator ({type(val_data).__name__}), but it is "
            "read for every τ of the grid. Pass a list of batches or a DataLoader."
        )


def select_prior_precision(
    model: Any,
    guide: Any,
    val_data: Iterable[Any],
    *,
    factors: Sequence[float] = DEFAULT_FACTORS,
    num_samples: int = 32,
    seed: int = 0,
    device: str | torch.device | None = None,
    **predict_kwargs: Any,
) -> float:
    r"""Set a fitted Laplace guide's prior precision to the one of least held-out NLL.

    Evaluates the guide's predictive (its ``pred_type``) on ``val_data`` at
    ``τ = τ_0 · f`` for each ``f`` in ``factors`` (``τ_0`` the guide's current τ, e.g. the
    marginal likelihood's) and keeps the ``τ`` of least NLL
    :math:`-\frac1N\sum_n \log p_τ(y_n \mid x_n, \mathcal D)`; ties keep the smaller factor's
    first occurrence. The curvature and the mean are not refitted (the covariance is
    ``(H + τ I)^{-1}`` at the new τ). Saved with the posterior (:func:`pyrobayes.save`).
    For a linearised predictive (``pred_type`` ``"glm"`` or ``"probit"``) the network passes
    over ``val_data`` (``f(x; θ̂)`` and ``J(x)``, independent of τ) run once for the whole grid
    while their Jacobians fit in :data:`LINEARIZATION_MAX_BYTES`.

    Parameters
    ----------
    model : FineTuneModel
    guide : LaplaceGuide
        Fitted (``pyrobayes.fit`` or :func:`~pyrobayes.infer.laplace.fit_laplace`) and not yet
        calibrated: a temperature is fitted against one τ, so select τ first, then
        :func:`pyrobayes.calibrate`.
    val_data : iterable of batches
        Labelled held-out batches (a validation split, never the test split).
    factors : sequence of float
        Multiples of the current τ to try (default :data:`DEFAULT_FACTORS`, 10^-2 … 10^4 in
        half-decades); 1 is added if missing, so the result is never worse on ``val_data``.
    num_samples, seed, device, **predict_kwargs
        Passed to :func:`pyrobayes.predict` (the same draws at every τ: one ``seed``).

    Returns
    -------
    float
        The selected τ (also set on ``guide``).

    Raises
    ------
    TypeError
        ``guide`` is not a Laplace posterior, or ``val_data`` is a one-shot iterator (a
        generator), which the grid would use up.
    ValueError
        The guide is calibrated, ``factors`` holds a non-positive number, or ``val_data`` has
        no batches or no labels.
    """
    owner = "select_prior_precision: "
    _check_guide(guide, owner)
    check_int("num_samples", num_samples, ge=1, owner=owner)
    _refuse_one_shot(val_data, owner)
    grid = [float(f) for f in factors]
    if not grid or not all(math.isfinite(f) and f > 0 for f in grid):
        raise ValueError(f"{owner}factors must be finite numbers > 0, got {list(factors)!r}.")
    if 1.0 not in grid:
        grid.append(1.0)
    grid.sort()
    tau0 = guide.prior_precision
    scores: list[float] = []
    try:
        # the linearised predictive's network passes (f(x; θ̂), J(x)) do not depend on τ: run
        # them once for the whole grid when they fit in memory
        # (under torch.distributed a rank whose passes fail keeps its error and shares NaN in
        # the first grid point's all-reduce, where every rank stops with it: _held_out_nll)
        predict_fn = run_shared(
            lambda: _cached_predict(model, guide, val_data, device, predict_kwargs), lambda: None
        )
        for factor in grid:
            guide.set_prior_precision(tau0 * factor)
            scores.append(
                _held_out_nll(
                    model,
                    guide,
                    val_data,
                    owner,
                    predict_fn,
                    num_samples=num_samples,
                    seed=seed,
                    device=device,
                    **predict_kwargs,
                )
            )
    except BaseException:
        guide.set_prior_precision(tau0)
        raise
    finite = [s if math.isfinite(s) else math.inf for s in scores]
    if not any(math.isfinite(s) for s in scores):  # min() would pick the smallest factor
        guide.set_prior_precision(tau0)
        raise FloatingPointError(
            f"{owner}the held-out NLL is NaN or inf at every factor of the grid "
            f"{[f'{f:.3g}' for f in grid]} (τ = {tau0:.4g} times each), so none can be chosen; "
            "τ is left at its value. Check the held-out data (labels the model gives "
            "probability 0) and the posterior (guide.check_finite()), or pass other factors=."
        )
    best = min(range(len(grid)), key=lambda i: finite[i])
    tau = tau0 * grid[best]
    guide.set_prior_precision(tau)
    if best in (0, len(grid) - 1) and len(grid) > 1:
        logger.warning(
            "select_prior_precision: τ = %.4g is at the end of the grid (factor %.3g of %.4g); "
            "pass wider factors= if the held-out NLL is still falling there.",
            tau,
            grid[best],
            tau0,
        )
    logger.info(
        "select_prior_precision: τ %.4g -> %.4g, held-out NLL %.4f -> %.4f (per factor: %s)",
        tau0,
        tau,
        scores[grid.index(1.0)],
        scores[best],
        ", ".join(f"{f:.3g}: {v:.4f}" for f, v in zip(grid, scores, strict=True)),
    )
    return tau


def _check_guide(guide: Any, owner: str) -> None:
    """A fitted, uncalibrated Laplace guide, or an error that says what to do."""
    from ..guides.laplace import LaplaceGuide

    if not isinstance(guide, LaplaceGuide):
        raise TypeError(
            f"{owner}expected a Laplace posterior (pyrobayes.posterior(model, 'laplace')), got "
            f"{type(guide).__name__}; only Laplace has a prior precision in its covariance."
        )
    guide.require_fitted()
    if TEMPERATURE_BUFFER in guide._buffers:
        raise ValueError(
            f"{owner}the guide is calibrated (T = {temperature(guide):.4g}), and its temperature "
            "was fitted at the current τ. Select τ first, then call pyrobayes.calibrate; or "
            "remove T with pyrobayes.calibration.set_temperature(guide, None)."
        )


def _cached_predict(
    model: Any,
    guide: Any,
    val_data: Any,
    device: str | torch.device | None,
    predict_kwargs: dict[str, Any],
) -> Callable[..., Prediction] | None:
    """The guide's predictive on ``val_data`` from ``f(x; θ̂)`` and ``J(x)`` formed once (what
    :func:`pyrobayes.predict` evaluates for a linearised predictive; called as it is), or
    ``None``: the network predictive (``pred_type="nn"``), options only
    :func:`pyrobayes.predict` reads, or Jacobians above :data:`LINEARIZATION_MAX_BYTES` (each
    grid point then runs its own passes)."""
    if getattr(guide, "pred_type", "nn") == "nn" or set(predict_kwargs) - _LINEARIZED_OPTIONS:
        return None
    if device is not None:
        model.to(device)
        guide.to(device)
    cached = linearize(
        model,
        guide,
        val_data,
        examples_per_forward=predict_kwargs.get("examples_per_forward"),
        max_bytes=LINEARIZATION_MAX_BYTES,
    )
    if cached is None:
        logger.info(
            "select_prior_precision: the held-out Jacobians exceed %d bytes; every grid point "
            "runs its own network passes",
            LINEARIZATION_MAX_BYTES,
        )
        return None

    def predict_fn(model: Any, guide: Any, data: Any, **kwargs: Any) -> Prediction:
        return linearized_predict(
            model,
            guide,
            data,
            num_samples=kwargs["num_samples"],
            seed=kwargs["seed"],
            linearization=cached,
        )

    return predict_fn


def _held_out_nll(
    model: Any,
    guide: Any,
    val_data: Any,
    owner: str,
    predict_fn: Callable[..., Prediction] | None,
    **predict_kwargs: Any,
) -> float:
    """The NLL of the guide's predictive on ``val_data`` (non-empty and labelled), by
    ``predict_fn`` where given (else :func:`pyrobayes.predict`)."""
    from ..metrics import report

    def local() -> tuple[int, float]:
        pred = labelled_prediction(
            model,
            guide,
            val_data,
            owner=owner,
            why="the prior precision is chosen by the held-out NLL",
            predict_fn=predict_fn,
            **predict_kwargs,
        )
        return int(pred.targets.shape[0]), float(report(pred, pred.targets)["nll"])

    if world()[0] == 1:
        return local()[1]
    # under torch.distributed: the NLL of the union of the ranks' shards (a count-weighted sum
    # of their means), the same on every rank, so every rank picks the same τ. A rank whose
    # shard fails (empty, unlabelled, an out-of-memory error) shares NaN, and every rank stops
    # with its error rather than waiting in this all-reduce
    count, nll = run_shared(local, lambda: (0, math.nan))
    sums = torch.tensor([count, count * nll], dtype=torch.float64)
    all_reduce_sum_([sums])
    if not bool(sums.isfinite().all()):  # the same sums on every rank: all decide alike
        raise_kept("the held-out NLL", caller="select_prior_precision()", remedy=PASS_REMEDY)
    return float(sums[1] / sums[0])
