r"""Point-mass posterior (MAP): ``q(θ) = δ(θ − θ̂)``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyro.distributions as dist
import torch
from torch import Tensor

from ..batch import compute_dtype
from .base import PosteriorGuide

__all__ = ["DeltaGuide"]


class DeltaGuide(PosteriorGuide):
    r"""MAP estimate as a guide: ``q(θ) = δ(θ − θ̂)``.

    Fitted by default with the MAP objective ``L = −(N/B) Σ_b log p(y_b|θ̂) − log p(θ̂)``, which is
    fine-tuning with weight decay ``1/(N s_p²)``. Predictions use one draw.

    Parameters
    ----------
    model : FineTuneModel or Pyro model
    """

    family = "map"
    default_objective = "map"
    is_deterministic = True

    def __init__(self, model: Any) -> None:
        super().__init__(model)

    def _setup_site(self, site: str, init: Tensor) -> None:
        # a half-precision site keeps θ̂ in float32 (the network runs it in its dtype): an Adam
        # step of lr ≈ 1e-4 on |θ| ≈ 0.1 is below half of bfloat16's spacing there, so a
        # bfloat16 θ̂ never moved (LoRA's A at lr 1e-4: 0.0 in bfloat16, 2e-3 in float32)
        self._add_param("locs", site, init.detach().to(compute_dtype(init.dtype)).clone())

    def get_posterior(self, site: str) -> dist.TorchDistribution:
        loc = self.loc(site)
        return dist.Delta(loc, event_dim=loc.dim())

    def rsample(self, num_samples: int = 1) -> dict[str, Tensor]:
        self.require_setup()
        return {s: self.loc(s).expand(num_samples, *self.sites[s]) for s in self.sites}

    def log_prob(self, values: Mapping[str, Tensor]) -> Tensor:
        num = next(iter(values.values())).shape[0]
        return torch.zeros(num, dtype=self.loc(next(iter(self.sites))).dtype)
