"""What an ArviZ export records about its guide: the attributes of every group, and the
temperature and predictive (network or linearised network) a guide's draws are exported with."""

from __future__ import annotations

from typing import Any

import pyro

from .._version import __version__
from ..calibration import TEMPERATURE_BUFFER, pooled, temperature
from ..contract import LinearizedPredictive, implements
from ..models.likelihoods import Gaussian
from .draw_evaluation import DrawEvaluation, num_components


def _versions() -> dict[str, str]:
    return {
        "inference_library": "pyro",
        "inference_library_version": str(pyro.__version__),
        "creation_library": "pyrobayes",
        "creation_library_version": str(__version__),
    }


def export_temperature(model: Any, guide: Any) -> tuple[float | None, dict[str, Any], str]:
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


def export_predictive(guide: Any) -> tuple[bool, str]:
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
    if num_components(guide) > 1:
        return (
            "equal-weight mixture: one chain per component, independent draws within it; r-hat "
            "across chains measures how far apart the components are, not convergence"
        )
    return "independent draws of q in one chain (not a Markov chain: r-hat ≈ 1, ESS ≈ S)"


def export_attrs(
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
