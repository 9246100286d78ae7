"""Objectives and fitters: ELBOs on the batched path, the public step API, the fit loop.

A guide is a posterior; a :class:`Fitter` fits it (:func:`make_fitter` picks the family's from
:data:`FITTERS` by the guide's ``default_fitter``) and :func:`fit` is a loop over one.
"""

from __future__ import annotations

from . import (
    diversity,
    ibdr,
    ivon,
    kron,
    laplace,
    meanfield,
    objectives,
    prior_precision,
    signorm,
    swag,
    symmetrized,
)
from .fitter import FITTERS, Fitter, SVIFitter, make_fitter, register_fitter, trainable_parameters
from .ibdr import IBDR, IBDRFitter, IBDRLoss
from .ivon import IVON
from .kron import KronIVON
from .laplace import Laplace, LaplaceFitter
from .loop import DivergenceWarning, FitResult, fit
from .meanfield import MeanField
from .objectives import ELBO, MAP
from .options import Checkpointing, Optimization, Progress, Validation, grouped
from .prior_precision import select_prior_precision
from .signorm import SigmaNormDiversity, SigmaNormFitter
from .swag import SWAG, SWAGFitter
from .symmetrized import BatchedSymmetrizedELBO, Symmetrized, SymmetrizedELBO

register_fitter("swag", SWAGFitter)
register_fitter("laplace", LaplaceFitter)
register_fitter("signorm", SigmaNormFitter)

__all__ = [
    "objectives",
    "ivon",
    "kron",
    "laplace",
    "prior_precision",
    "select_prior_precision",
    "swag",
    "ibdr",
    "diversity",
    "signorm",
    "fit",
    "FitResult",
    "Optimization",
    "Validation",
    "Checkpointing",
    "Progress",
    "DivergenceWarning",
    "grouped",
    "Fitter",
    "SVIFitter",
    "SWAGFitter",
    "LaplaceFitter",
    "Laplace",
    "SigmaNormFitter",
    "SigmaNormDiversity",
    "IBDR",
    "IBDRFitter",
    "IBDRLoss",
    "FITTERS",
    "register_fitter",
    "make_fitter",
    "trainable_parameters",
    "IVON",
    "KronIVON",
    "MeanField",
    "SWAG",
    "ELBO",
    "MAP",
    "meanfield",
    "symmetrized",
    "Symmetrized",
    "SymmetrizedELBO",
    "BatchedSymmetrizedELBO",
]
