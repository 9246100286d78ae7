"""Fit settings still accepted by a guide's constructor (deprecated): kept for the fitter, warned.

A posterior file holds only the posterior. Settings that describe how a posterior is fitted (an
optimizer's rates, a collection schedule, Monte Carlo samples per step, a curvature refresh
period, an objective's weights, the search for a prior precision) are the fitter's:
``pb.infer.IVON`` / ``KronIVON`` / ``SWAG`` / ``IBDR`` / ``SigmaNormDiversity`` / ``Laplace`` /
``MeanField`` / ``Symmetrized``,
passed as ``pb.fit(..., optim=pb.Optimization(optimizer=...))``. For one release a family's
constructor still takes them (its ``fit_options``): they are kept in ``guide.fit_settings`` for
the fitter, left out of ``config()`` and never saved.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..user_frame import user_stacklevel

__all__ = ["warn_fit_settings"]


def warn_fit_settings(owner: str, given: dict[str, Any], settings: str) -> None:
    """Warn that ``given`` (the deprecated fit settings passed to a guide) belong to the fitter.

    Parameters
    ----------
    owner : str
        The guide's name and a colon, e.g. ``"IVONGuide: "``.
    given : dict
        The settings passed (``None`` values already left out); nothing is warned when empty.
    settings : str
        The settings class in ``pyrobayes.infer`` that takes them now, e.g. ``"IVON"``.
    """
    if not given:
        return
    spelled = ", ".join(f"{k}={v!r}" for k, v in given.items())
    are = "is a setting" if len(given) == 1 else "are settings"
    warnings.warn(
        f"{owner}{', '.join(given)} {are} of the fit, not of the posterior: pass "
        f"pb.fit(..., optim=pb.Optimization(optimizer=pb.infer.{settings}({spelled}))) (or "
        f"make_fitter(..., optimizer=pb.infer.{settings}(...))). The guide keeps them for its "
        "fitter for one release; they are no longer saved with the posterior.",
        DeprecationWarning,
        stacklevel=user_stacklevel(),
    )
