"""Posterior families. Each is a Pyro guide; each registers itself here under its family name."""

from __future__ import annotations

from ..registry import register_guide
from .base import PosteriorGuide
from .delta import DeltaGuide
from .meanfield import MeanFieldGuide

register_guide("meanfield", MeanFieldGuide, aliases=("mean-field", "normal"))
register_guide("map", DeltaGuide, aliases=("delta",))

__all__ = ["PosteriorGuide", "MeanFieldGuide", "DeltaGuide"]
