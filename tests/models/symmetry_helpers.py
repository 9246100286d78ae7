"""Shared set-up of the tests of the symmetrized guide's first-batch checks
(``test_permutation_parent_calls.py``, ``test_permutation_numeric_check.py``): their batch and
a guide with a spread-out q."""

from __future__ import annotations

import pyro
import torch
from torch import Tensor

import pyrobayes as pb
from pyrobayes.guides import SymmetrizedGuide
from pyrobayes.models import FineTuneModel


def sym_batch() -> tuple[Tensor, Tensor]:
    """12 float64 inputs of 4 features and labels of 3 classes, the same at every call."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(12, 4, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (12,), generator=g
    )


def spread_guide(model: FineTuneModel) -> SymmetrizedGuide:
    """A symmetrized guide whose means are one N(0, 0.5²) draw per entry (the same at every
    call) and scales 1: a spread-out q, so that I_K is far from 0 and from log K."""
    pyro.clear_param_store()
    guide = pb.posterior(model, "symmetrized", init_scale=1.0)
    with torch.no_grad():
        for site in guide.sites:
            guide.base.loc_param(site).normal_(0.0, 0.5, generator=torch.Generator().manual_seed(2))
    return guide
