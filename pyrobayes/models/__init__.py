"""Pyro models over adapter parameters: adapters, projections, the fine-tuning model, likelihoods
(multiple choice with continuations) and deployment (merged networks, peft adapters)."""

from __future__ import annotations

from . import deploy, signorm
from .accounting import count_parameters
from .adapters import (
    IneffectiveCoreWarning,
    LoRA,
    LoRAXS,
    SiteSpec,
    attention_target_modules,
    find_target_modules,
)
from .deploy import merged_network, to_peft
from .finetune import FineTuneModel
from .layers import BatchedLinear, LoRALinear, LoRAXSLinear
from .likelihoods import Bernoulli, Categorical, Gaussian, Likelihood, MultipleChoice
from .multiple_choice import encode_multiple_choice
from .peft_import import LoRADropoutWarning
from .permutation import PermutationSpec, UnitLayer
from .signorm import SigmaNorm, SigmaNormEnsemble

__all__ = [
    "FineTuneModel",
    "LoRA",
    "LoRAXS",
    "SiteSpec",
    "find_target_modules",
    "attention_target_modules",
    "IneffectiveCoreWarning",
    "LoRADropoutWarning",
    "LoRALinear",
    "LoRAXSLinear",
    "BatchedLinear",
    "Likelihood",
    "Categorical",
    "Gaussian",
    "Bernoulli",
    "MultipleChoice",
    "encode_multiple_choice",
    "merged_network",
    "to_peft",
    "deploy",
    "count_parameters",
    "PermutationSpec",
    "UnitLayer",
    "signorm",
    "SigmaNorm",
    "SigmaNormEnsemble",
]
