"""Objectives and fitters: ELBOs on the batched path, the fit loop, family-specific fitters."""

from __future__ import annotations

from . import objectives
from .loop import FitResult, fit
from .objectives import ELBO, MAP

__all__ = ["objectives", "fit", "FitResult", "ELBO", "MAP"]
