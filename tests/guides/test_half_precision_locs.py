"""The point families keep their locations in float32 on a half-precision network, as
mean-field and IVON keep theirs: the network runs each value in its own dtype.

Before, MAP's θ̂ (and Laplace's, SWAG's, IBDR's and σN's particles) lived in the network's
bfloat16: an Adam step of about ``lr`` is below half of bfloat16's spacing at ``|θ| ≈ 0.1``
(2⁻¹¹ ≈ 4.9e-4 between 0.0625 and 0.125) once ``lr`` < 2.4e-4, so LoRA's A factors, which start
at that size, never moved at LoRA's usual rates (measured: 0.0 after 20 steps at lr 1e-4, 2e-3
in float32), silently.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pyrobayes as pb


def _model() -> pb.models.FineTuneModel:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).to(torch.bfloat16)
    adapter = pb.models.LoRA(rank=2, target_modules=["0"])
    return pb.models.FineTuneModel(net, adapter, num_data=64, trainable_modules=["2"])


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g).to(torch.bfloat16)
    return [(x[i : i + 16], torch.arange(i, i + 16) % 3) for i in range(0, 64, 16)]


@pytest.mark.parametrize("family", ["map", "laplace", "swag", "ibdr"])
def test_point_locations_are_float32_on_a_bfloat16_network(family: str) -> None:
    model = _model()
    guide = pb.posterior(model, family)
    pb.fit(model, guide, _data(), epochs=2, seed=0, progress=False)
    for site in model.latent_sites:
        assert guide.loc(site).dtype == torch.float32, site
    probs = pb.predict(model, guide, _data(), num_samples=2).probs
    assert bool(torch.isfinite(probs).all())


def test_map_moves_loras_a_at_a_small_learning_rate() -> None:
    """20 Adam steps at lr 1e-4 move every A factor by about 20·1e-4 = 2e-3 (the first Adam
    steps are ±lr per coordinate): measured median 2.0e-3, no entry still. In bfloat16 every
    entry of |A| >= 2⁻⁴ (its spacing 2⁻¹¹, half of which exceeds the step) rounded back to its
    start: 7 of 8 entries never moved (median change 0.0)."""
    model = _model()
    start = {s: model.site_value(s).float().clone() for s in model.latent_sites}
    guide = pb.posterior(model, "map")
    pb.fit(model, guide, _data(), epochs=5, lr=1e-4, seed=0, progress=False)
    for site, value in start.items():
        if site.endswith("lora_A"):
            moved = (guide.loc(site).detach() - value).abs()
            assert float(moved.min()) > 1e-4, (site, moved)  # every entry: half a step apart
