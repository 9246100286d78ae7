r"""How far can a fitted guide be trusted? PSIS :math:`\hat k`, importance ESS, ELBO, calibration.

For draws :math:`θ_s \sim q`, :math:`s = 1..S`, on the full data set :math:`D`, the log
importance ratios of the guide against the posterior are

.. math:: r_s = \log p(θ_s, D) - \log q(θ_s), \qquad
    \log p(θ, D) = \sum_i \log p(y_i \mid x_i, θ) + \log p(θ),

and (Yao, Vehtari, Simpson & Gelman, 2018, *Yes, but did it work?: Evaluating variational
inference*, ICML) the Pareto shape :math:`\hat k` of their upper tail tells whether :math:`q` is
close to the posterior: :math:`\hat k < 0.5` good, :math:`0.5 \le \hat k < 0.7` usable,
:math:`\hat k \ge 0.7` unreliable; with S draws, any :math:`\hat k \ge \min(1 - 1/\log_{10} S,
0.7)` is unreliable too (Vehtari et al., 2024, *Pareto smoothed importance sampling*: too few
draws; :func:`khat_threshold`). :math:`\frac1S\sum_s r_s` estimates the ELBO and
:math:`\log \frac1S \sum_s e^{r_s}` the log evidence :math:`\log p(D)` (from below, in
expectation). :math:`\hat k` is meaningful for small latent spaces (a LoRA-XS core with
:math:`r \le 4`, a logistic regression); for thousands of parameters :math:`\hat k \gg 0.7` is
the rule.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..batch import split_batch
from ..calibration import apply_temperature, check_not_swapped
from ..metrics import report
from ..models.adapters import check_int
from ..predictive import Prediction, predict
from .draw_evaluation import DrawEvaluation, evaluate_draws
from .export_attrs import export_predictive
from .psis import importance_ess, psis_smooth, psis_tail_length
from .sites import DEFAULT_MAX_SITE_NUMEL

__all__ = ["Diagnostics", "diagnose", "khat_interpretation", "khat_threshold"]

logger = logging.getLogger(__name__)


def khat_threshold(num_samples: int) -> float:
    r"""Sample-size-dependent reliability threshold :math:`\min(1 - 1/\log_{10} S,\ 0.7)`.

    Vehtari et al. (2024), *Pareto smoothed importance sampling*, JMLR 25(72).
    """
    if num_samples <= 10:
        return -math.inf  # 1 - 1/log10(S) <= 0: no tail can be trusted with so few draws
    return min(1.0 - 1.0 / math.log10(num_samples), 0.7)


def khat_interpretation(k: float, num_samples: int | None = None) -> str:
    r"""Plain-text reading of a Pareto :math:`\hat k` (Yao et al., 2018 thresholds).

    Parameters
    ----------
    k : float
        :math:`\hat k` of the log importance ratios of ``q`` against the posterior.
    num_samples : int, optional
        S; when given, the PSIS (2024) threshold :math:`\min(1 - 1/\log_{10} S, 0.7)` is also
        checked: below 0.7, a :math:`\hat k` at or above it reads ``"bad"`` whatever band it is
        in (S is too small for the Pareto fit and the PSIS estimates to be reliable), with the
        number of draws whose threshold lies above it.

    Returns
    -------
    str
        One sentence starting with ``"good"``, ``"ok"``, ``"bad"`` or ``"undefined"``.
    """
    if math.isnan(k):
        return "undefined: k-hat is NaN (point-mass guide or no log-density)"
    if num_samples is not None and k == math.inf and psis_tail_length(num_samples) < 5:
        return (
            f"undefined: S = {num_samples} draws leave {psis_tail_length(num_samples)} in the "
            "tail, fewer than the 5 a Pareto fit needs (S >= 24); diagnose with S >= 1000"
        )
    if k == -math.inf:
        return "good: all importance ratios are equal, q matches the posterior up to a constant"
    if num_samples is not None and math.isfinite(k) and k < 0.7:
        threshold = khat_threshold(num_samples)
        if k >= threshold:  # Vehtari et al. (2024): S too small for this k-hat
            return (
                f"bad (k-hat {k:.2f} >= {threshold:.2f}, the PSIS threshold for S = "
                f"{num_samples} draws): too few draws for a reliable k-hat and PSIS estimates; "
                f"diagnose with more draws (S >= {_draws_above(k)} puts the threshold above "
                f"{k:.2f})"
            )
    if k < 0.5:
        return "good (k-hat < 0.5): q is close to the posterior; VI estimates can be trusted"
    if k < 0.7:
        return (
            "ok (0.5 <= k-hat < 0.7): q is usable but needs improvement; PSIS-correct expectations"
        )
    return (
        "bad (k-hat >= 0.7): q is far from the posterior; do not trust VI estimates, nor "
        "their PSIS correction"
    )


def _draws_above(k: float) -> int:
    """The smallest S whose :func:`khat_threshold` exceeds ``k`` (``k < 0.7``)."""
    needed = max(11, math.floor(10 ** (1.0 / (1.0 - k))))
    while khat_threshold(needed) <= k:
        needed += 1
    return needed


@dataclass
class Diagnostics:
    r"""Diagnostics of a guide on a data set (see :func:`diagnose`).

    Attributes
    ----------
    khat : float
        Pareto :math:`\hat k` of :math:`r_s = \log p(θ_s, D) - \log q(θ_s)`.
    interpretation : str
        :func:`khat_interpretation` of ``khat``.
    khat_threshold : float
        :math:`\min(1 - 1/\log_{10} S, 0.7)`.
    ess : float
        Effective sample size of the PSIS-smoothed importance weights, in ``[1, S]``.
    ess_raw : float
        Effective sample size of the raw weights :math:`e^{r_s}`.
    elbo : float
        :math:`\frac1S \sum_s r_s`, Monte Carlo estimate of the full-data ELBO.
    log_evidence : float
        :math:`\log\frac1S\sum_s e^{r_s}`, importance-sampling estimate of :math:`\log p(D)`.
    num_samples : int
        S.
    num_examples : int
        Examples in the data set.
    calibration : dict
        :func:`pyrobayes.metrics.report` of the posterior predictive (classification only),
        with ``num_predictive_samples`` draws.
    log_ratios : numpy.ndarray
        :math:`r_s`, shape ``(S,)`` (not in :meth:`to_dict`).
    """

    khat: float
    interpretation: str
    khat_threshold: float
    ess: float
    ess_raw: float
    elbo: float
    log_evidence: float
    num_samples: int
    num_examples: int
    calibration: dict[str, float] = field(default_factory=dict)
    log_ratios: np.ndarray | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (everything except ``log_ratios``)."""
        out = asdict(self)
        out.pop("log_ratios")
        out["calibration"] = {k: float(v) for k, v in self.calibration.items()}
        return out


def diagnose(
    model: Any,
    guide: Any,
    data: Iterable[Any],
    *,
    num_samples: int = 1000,
    seed: int | None = 0,
    num_bins: int = 15,
    num_predictive_samples: int = 200,
    samples_per_forward: int | None = None,
) -> Diagnostics:
    r"""PSIS :math:`\hat k`, importance ESS, ELBO and calibration of ``guide`` on ``data``.

    Draws :math:`θ_s \sim q` (S of them, jointly), evaluates the full-data log joint
    :math:`\log p(θ_s, D) = \sum_i \log p(y_i\mid x_i, θ_s) + \log p(θ_s)` over every batch of
    ``data`` and forms :math:`r_s = \log p(θ_s, D) - \log q(θ_s)`; :math:`\hat k` is the Pareto
    shape of the upper tail of :math:`e^{r_s}` (:func:`pyrobayes.diagnostics.psis.psis_smooth`).

    Parameters
    ----------
    model : FineTuneModel
    guide : PosteriorGuide
    data : iterable of batches
        The FULL data set the posterior is conditioned on (the training set), not a minibatch.
        A posterior larger than ``DEFAULT_MAX_SITE_NUMEL`` scalars is drawn in chunks, one
        pass over ``data`` each: every pass must then yield the same examples in the same order
        (a loader with ``shuffle=False``), else a ``ValueError``.
    num_samples : int
        S; use S >= 1000 for a stable :math:`\hat k`.
    seed : int, optional
    num_bins : int
        Calibration bins of the ECE.
    num_predictive_samples : int
        The first this-many draws (the same draws as for :math:`\hat k`) give the posterior
        predictive whose calibration is reported (classification likelihoods only), under the
        guide's :func:`pyrobayes.calibrate` temperature as :func:`pyrobayes.predict` applies it
        (:math:`\hat k` is the posterior's, untouched by it). An integer >= 0; 0 reports no
        calibration. A guide with a linearised predictive (Laplace with ``pred_type`` "glm",
        its default, or "probit") predicts with the linearised network, not the network at
        each draw: its calibration is that of ``pyrobayes.predict(model, guide, data,
        num_samples=num_predictive_samples, seed=seed)`` (one more pass over ``data``; the
        rows it holds, e.g. the guide's ``link_samples``, in ``num_predictive_samples``).
    samples_per_forward : int, optional
        Draws per forward pass, an integer >= 1 (default: as :func:`pyrobayes.predict`).

    Returns
    -------
    Diagnostics

    Raises
    ------
    ValueError
        ``num_bins`` below 1 or ``num_predictive_samples`` below 0 (before any draw is
        evaluated), data without targets, and what :func:`evaluate_draws` refuses.
    TypeError
        ``num_bins`` or ``num_predictive_samples`` not an integer.
    """
    check_not_swapped(model, guide, "diagnose", "pyrobayes.diagnose(model, guide, data)")
    # checked before the draws are evaluated (a float num_predictive_samples failed deep in the
    # evaluation, a negative one dropped the calibration silently, num_bins < 1 came last)
    num_bins = check_int("num_bins", num_bins, ge=1, owner="diagnose: ")
    num_predictive_samples = check_int(
        "num_predictive_samples", num_predictive_samples, ge=0, owner="diagnose: "
    )
    if iter(data) is data:  # a one-shot iterator: kept for the linearised predictive's pass
        data = list(data)
    _require_targets(model, data)  # before S draws are evaluated over every batch
    deterministic = bool(guide.is_deterministic)
    if deterministic:
        num_samples = 1
    linearized, _ = export_predictive(guide)
    ev = evaluate_draws(
        model,
        guide,
        data,
        num_samples=num_samples,
        seed=seed,
        sites=[],
        max_site_numel=DEFAULT_MAX_SITE_NUMEL,
        pointwise=False,
        predictive=False,
        summarise_omitted=False,
        # a linearised predictive's calibration comes from pyrobayes.predict (below)
        num_class_samples=0 if linearized else num_predictive_samples,
        samples_per_forward=samples_per_forward,
        owner="diagnose",
    )
    num_samples = ev.num_samples  # a mixture's S rounded up to whole rounds of its components
    log_joint = ev.log_joint
    if log_joint is None or ev.log_q is None:
        raise ValueError(_no_targets_message(getattr(model, "label_key", "labels")))
    log_ratios = log_joint - ev.log_q  # (S,)
    k_hat, ess, ess_raw = _khat_and_ess(log_ratios, guide, deterministic)
    top = float(np.max(log_ratios))
    log_evidence = top + math.log(float(np.mean(np.exp(log_ratios - top))))
    if linearized and num_predictive_samples and model.likelihood.is_classification:
        calibration = _linearized_calibration(
            model, guide, data, num_predictive_samples, seed, num_bins, samples_per_forward
        )
    else:
        calibration = _calibration(ev, guide, num_bins)
    result = Diagnostics(
        khat=float(k_hat),
        interpretation=khat_interpretation(float(k_hat), num_samples),
        khat_threshold=khat_threshold(num_samples),
        ess=float(ess),
        ess_raw=float(ess_raw),
        elbo=float(np.mean(log_ratios)),
        log_evidence=log_evidence,
        num_samples=num_samples,
        num_examples=ev.num_examples,
        calibration=calibration,
        log_ratios=log_ratios,
    )
    logger.info(
        "diagnose: k-hat = %.3f (%s), ESS = %.1f / %d",
        k_hat,
        result.interpretation,
        ess,
        num_samples,
    )
    return result


def _no_targets_message(label_key: str) -> str:
    """The refusal of unlabelled ``data``: what diagnose needs it for and what to pass."""
    return (
        "diagnose: `data` carries no targets (its batches are inputs only: a tensor, (x,), or a "
        f"dict without {label_key!r}), but diagnose needs labels: k-hat, the ESS and the ELBO "
        "compare the guide with the posterior p(θ | D), whose log joint sums log p(y | x, θ) "
        "over the labelled data set. Pass the labelled training data the guide was fitted on, "
        f"as batches (x, y) or dicts holding the targets under {label_key!r} "
        "(FineTuneModel's label_key). For predictions on unlabelled inputs use "
        "pyrobayes.predict(model, guide, data), which needs no labels."
    )


def _require_targets(model: Any, data: Iterable[Any]) -> None:
    """Refuse ``data`` whose first batch carries no targets, before any draw is evaluated
    (a batch without targets among labelled ones is :func:`evaluate_draws`'s refusal)."""
    label_key = getattr(model, "label_key", "labels")
    first = next(iter(data), None)
    if first is None:  # no batch: evaluate_draws names the empty data
        return
    if split_batch(first, label_key)[1] is None:
        raise ValueError(_no_targets_message(label_key))


def _khat_and_ess(
    log_ratios: np.ndarray, guide: Any, deterministic: bool
) -> tuple[float, float, float]:
    """PSIS k-hat, ESS of the smoothed and of the raw weights of ``log_ratios`` (NaN when
    undefined: a point mass, a mixture of point masses, non-finite ratios)."""
    # a mixture of point masses (IBDR's particles, a sigma-N ensemble's members) has no density
    # against the continuous posterior either: its ratios take K values and the Pareto fit of
    # their tail reads "bad" (k-hat inf) at ESS = S; undefined, as for MAP
    point_mixture = getattr(guide, "component_scale", None) == 0
    if deterministic or point_mixture or not np.isfinite(log_ratios).all():
        if not (deterministic or point_mixture):
            logger.warning("Non-finite log importance ratios; k-hat is undefined.")
        return math.nan, math.nan, math.nan
    smoothed, k_hat = psis_smooth(log_ratios)
    return k_hat, importance_ess(smoothed), importance_ess(log_ratios)


def _calibration(ev: DrawEvaluation, guide: Any, num_bins: int) -> dict[str, float]:
    """:func:`pyrobayes.metrics.report` of the draws' class log-probabilities (none: ``{}``),
    under the guide's :func:`pyrobayes.calibrate` temperature, as :func:`pyrobayes.predict`
    reports it."""
    if ev.class_log_probs is None or ev.targets is None:
        return {}
    prediction = apply_temperature(
        Prediction(log_probs=ev.class_log_probs, targets=ev.targets), guide
    )
    calibration = report(prediction, ev.targets, num_bins=num_bins)
    calibration["num_predictive_samples"] = float(ev.class_log_probs.shape[0])
    return calibration


def _linearized_calibration(
    model: Any,
    guide: Any,
    data: Iterable[Any],
    num_samples: int,
    seed: int | None,
    num_bins: int,
    samples_per_forward: int | None,
) -> dict[str, float]:
    """:func:`pyrobayes.metrics.report` of :func:`pyrobayes.predict` for a guide whose
    predictive is the linearised network (a Laplace ``pred_type`` "glm" or "probit"), which
    the draws of the network do not give (its own draws, or probit's one closed-form row)."""
    prediction = predict(
        model,
        guide,
        data,
        num_samples=num_samples,
        seed=seed,
        samples_per_forward=samples_per_forward,
    )
    if prediction.targets is None:
        return {}
    calibration = report(prediction, prediction.targets, num_bins=num_bins)
    calibration["num_predictive_samples"] = float(prediction.num_samples)
    return calibration
