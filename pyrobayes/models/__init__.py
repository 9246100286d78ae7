"""Pyro models over adapter parameters: adapters, projections, the fine-tuning model."""

from __future__ import annotations

from . import signorm
from .accounting import count_parameters
from .adapters import LoRA, LoRAXS, SiteSpec, find_target_modules
from .finetune import FineTuneModel
from .layers import BatchedLinear, LoRALinear, LoRAXSLinear
from .likelihoods import Categorical, Gaussian, Likelihood, MultipleChoice
from .signorm import SigmaNorm, SigmaNormEnsemble

__all__ = [
    "FineTuneModel",
    "LoRA",
    "LoRAXS",
    "SiteSpec",
    "find_target_modules",
    "LoRALinear",
    "LoRAXSLinear",
    "BatchedLinear",
    "Likelihood",
    "Categorical",
    "Gaussian",
    "MultipleChoice",
    "count_parameters",
    "signorm",
    "SigmaNorm",
    "SigmaNormEnsemble",
]
