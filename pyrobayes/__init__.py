"""pyrobayes: Bayesian fine-tuning of pretrained networks with Pyro.

Declare a posterior over adapter parameters as a Pyro guide, fit it with the objective of its
family, predict with the posterior predictive, measure calibration and OOD detection, and export
to ArviZ.
"""

from __future__ import annotations

from . import guides, infer, metrics, models
from ._version import __version__ as __version__
from .api import posterior
from .calibration import calibrate
from .diagnostics import Diagnostics, diagnose, to_datatree, to_inference_data
from .infer.loop import DivergenceWarning, FitResult, fit
from .infer.options import Checkpointing, Optimization, Progress, Validation
from .io import load, save
from .models.accounting import count_parameters
from .predictive import Prediction, predict
from .registry import available_guides, register_guide

__all__ = [
    # building blocks
    "models",
    "infer",
    "guides",
    "metrics",
    # workflow
    "posterior",
    "fit",
    "FitResult",
    "Optimization",
    "Validation",
    "Checkpointing",
    "Progress",
    "DivergenceWarning",
    "predict",
    "calibrate",
    "Prediction",
    # ArviZ export and diagnostics
    "to_datatree",
    "to_inference_data",
    "diagnose",
    "Diagnostics",
    # I/O and registry
    "save",
    "load",
    "register_guide",
    "available_guides",
    "count_parameters",
]
