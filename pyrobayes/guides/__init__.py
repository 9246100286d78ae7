"""Posterior families. Each is a Pyro guide; each registers itself here under its family name."""

from __future__ import annotations

from ..contract import AnalyticKL, Mixture, OnlineNewton, Posterior, PostHoc, Symmetrized
from ..registry import register_guide
from .base import PosteriorGuide, SitewiseKL
from .delta import DeltaGuide
from .ivon import IVONGuide
from .joint import JointGaussianGuide, SitePacking
from .kron import KroneckerIVONGuide
from .laplace import LaplaceGuide
from .lowrank import SWAGGuide
from .meanfield import MeanFieldGuide
from .particles import IBDRGuide, ParticleGuide
from .signorm import SigmaNormGuide
from .symmetrized import SymmetrizedGuide

register_guide("meanfield", MeanFieldGuide, aliases=("mean-field", "normal"))
register_guide("map", DeltaGuide, aliases=("delta",))
register_guide("ivon", IVONGuide)
register_guide("kron-ivon", KroneckerIVONGuide, aliases=("kron_ivon", "kronecker-ivon"))
register_guide("swag", SWAGGuide, aliases=("b-lora-xs",))
register_guide("laplace", LaplaceGuide, aliases=("l-lora-xs",))
register_guide("symmetrized", SymmetrizedGuide, aliases=("permutation-invariant",))
register_guide("ibdr", IBDRGuide, aliases=("particles",))
register_guide("signorm", SigmaNormGuide, aliases=("sigma-norm", "sn-ens"))

__all__ = [
    "Posterior",
    "AnalyticKL",
    "PostHoc",
    "OnlineNewton",
    "Symmetrized",
    "Mixture",
    "PosteriorGuide",
    "SitewiseKL",
    "SitePacking",
    "JointGaussianGuide",
    "MeanFieldGuide",
    "DeltaGuide",
    "IVONGuide",
    "KroneckerIVONGuide",
    "SWAGGuide",
    "LaplaceGuide",
    "SymmetrizedGuide",
    "ParticleGuide",
    "IBDRGuide",
    "SigmaNormGuide",
]
