"""``FineTuneModel._functional`` (cached-slot parameter swap) behaves like ``functional_call``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pyrobayes as pb
from tests.common import mlp


def _mlp_model() -> pb.models.FineTuneModel:
    torch.manual_seed(0)
    net = mlp(6, 12, 12, 3, activation=nn.ReLU)
    return pb.models.FineTuneModel(
        net, pb.models.LoRAXS(rank=2, target_modules=["0", "2"]), trainable_modules=["4"]
    )


def test_swap_equals_functional_call_and_restores_parameters() -> None:
    model = _mlp_model().double()
    x = torch.randn(5, 6, dtype=torch.float64)
    names = [s.param_name for s in model.latent_sites.values()] + list(model.point_params)
    params = {n: torch.randn_like(model.net.get_parameter(n)) for n in names}
    before = {n: model.net.get_parameter(n) for n in names}
    ours = model._functional(x, params)
    theirs = torch.func.functional_call(model.net, params, (x,))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    for n in names:  # the network's own Parameter objects are back in place
        assert model.net.get_parameter(n) is before[n]
        assert isinstance(model.net.get_parameter(n), nn.Parameter)


def test_swap_restores_parameters_when_the_forward_raises() -> None:
    model = _mlp_model()
    site = next(iter(model.latent_sites.values())).param_name
    before = model.net.get_parameter(site)
    with pytest.raises(RuntimeError):
        model._functional(torch.randn(5, 7), {site: torch.zeros_like(before)})  # wrong width
    assert model.net.get_parameter(site) is before


def test_gradients_flow_through_swapped_values() -> None:
    model = _mlp_model().double()
    x = torch.randn(5, 6, dtype=torch.float64)
    site = next(iter(model.latent_sites.values())).param_name
    value = torch.randn_like(model.net.get_parameter(site), requires_grad=True)
    g_ours = torch.autograd.grad(model._functional(x, {site: value}).sum(), value)[0]
    g_ref = torch.autograd.grad(
        torch.func.functional_call(model.net, {site: value}, (x,)).sum(), value
    )[0]
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-12, atol=1e-14)


def test_unknown_names_fall_back_to_functional_call() -> None:
    model = _mlp_model().double()
    x = torch.randn(5, 6, dtype=torch.float64)
    frozen = {"0.base.bias": torch.zeros(12, dtype=torch.float64)}  # not a site: generic path
    torch.testing.assert_close(
        model._functional(x, frozen), torch.func.functional_call(model.net, frozen, (x,))
    )
