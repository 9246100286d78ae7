"""Top-level conveniences: the ``posterior`` factory (``fit`` and ``predict`` live beside it)."""

from __future__ import annotations

import logging
from typing import Any

from .registry import get_guide_class

logger = logging.getLogger(__name__)

__all__ = ["posterior"]


def posterior(model: Any, family: str = "meanfield", **kwargs: Any) -> Any:
    """Build a posterior guide by family name (as ``laplace.Laplace(...)``).

    Parameters
    ----------
    model : FineTuneModel
    family : str
        A registered name (``pyrobayes.available_guides()``), e.g. ``"meanfield"``, ``"map"``.
    **kwargs
        Passed to the family's constructor.

    Examples
    --------
    >>> guide = pyrobayes.posterior(model, "meanfield", init_scale=0.01)  # doctest: +SKIP
    """
    return get_guide_class(family)(model, **kwargs)
