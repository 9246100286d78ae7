"""Silent cases of the adapter layers and the deployment, each now carried over, warned about or
refused by name: forward hooks and pre-hooks on an adapted layer, on its base, inside it, on a
latent layer and on a σN member norm, which a merged (or peft) network dropped or applied to
another part of the layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pyrobayes.models import FineTuneModel, LoRA, LoRAXS
from pyrobayes.models.deploy import merged_network, to_peft

_ADAPTERS = {
    "lora": lambda: LoRA(rank=2, target_modules=["0"]),
    "lora-xs": lambda: LoRAXS(rank=2, target_modules=["0"]),
}


def _doubled(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return 2 * out


def _tripled_input(module: nn.Module, args: tuple) -> tuple:
    return (3 * args[0],)


def _register(module: nn.Module, kind: str) -> torch.utils.hooks.RemovableHandle:
    if kind == "forward":
        return module.register_forward_hook(_doubled)
    return module.register_forward_pre_hook(_tripled_input)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).eval()


def _values(model: FineTuneModel) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {s: 0.5 * torch.randn(v.shape) for s, v in model.init_values().items()}


# ------------------------------------------------------------------------------------------------
# hooks on a layer before the adapter wraps it: they stay on the frozen base
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["forward", "pre"])
@pytest.mark.parametrize("adapter", sorted(_ADAPTERS))
def test_a_hooked_target_is_warned_about_and_merging_its_base_is_refused(adapter, kind):
    # the hook stayed on the base (acting on W0 x alone), and merged_network applied it to
    # (W0 + ΔW) x: the merged network differed from the adapted one in silence
    net = _net()
    _register(net[0], kind)
    with pytest.warns(
        UserWarning, match=r"selects '0', with forward hook.*frozen base \('0\.base'"
    ):
        model = FineTuneModel(net, _ADAPTERS[adapter](), likelihood="categorical")
    values = _values(model)
    with pytest.raises(
        ValueError,
        match=r"merged_network: the frozen base layer '0\.base' of the adapted layer '0' has "
        r"forward hook.*_(doubled|tripled_input).*Remove them from the base",
    ):
        merged_network(model, values)
    base = model.net.get_submodule("0.base")
    base._forward_hooks.clear()  # as the message says
    base._forward_pre_hooks.clear()
    x = torch.randn(5, 4)
    with torch.no_grad():
        torch.testing.assert_close(merged_network(model, values)(x), model.output(x, values))


@pytest.mark.parametrize("kind", ["forward", "pre"])
@pytest.mark.parametrize("adapter", sorted(_ADAPTERS))
def test_hooks_on_an_adapter_layer_are_carried_into_the_merged_network(adapter, kind):
    # the merged copy replaced the adapter layer by its base, dropping the hooks on it
    model = FineTuneModel(_net(), _ADAPTERS[adapter](), likelihood="categorical")
    values = _values(model)
    x = torch.randn(5, 4)
    with torch.no_grad():
        plain = model.output(x, values)
        handle = _register(model.net[0], kind)
        expected = model.output(x, values)
        assert (expected - plain).abs().max() > 1e-3  # the hook changes the output
        merged = merged_network(model, values)
        torch.testing.assert_close(merged(x), expected)
        handle.remove()  # the merged network's hooks are its own
        torch.testing.assert_close(merged(x), expected)
        torch.testing.assert_close(model.output(x, values), plain)


@pytest.mark.parametrize("where", ["parent", "root"])
def test_hooks_on_the_other_modules_come_with_the_merged_network(where):
    net = nn.Sequential(_net(), nn.Tanh())
    model = FineTuneModel(net, LoRA(rank=2, target_modules=["0.0"]), likelihood="categorical")
    _register(model.net[0] if where == "parent" else model.net, "forward")
    values = _values(model)
    x = torch.randn(5, 4)
    with torch.no_grad():
        torch.testing.assert_close(merged_network(model, values)(x), model.output(x, values))


@pytest.mark.parametrize("part", ["lora_A", "lora_B"])
def test_hooks_inside_an_adapter_are_refused_by_both_deployments(part):
    # the deployed networks have no lora_A / lora_B module: the hook was dropped in silence
    model = FineTuneModel(_net(), LoRA(rank=2, target_modules=["0"]), likelihood="categorical")
    model.net.get_submodule(f"0.{part}").register_forward_hook(_doubled)
    values = _values(model)
    match = rf"'0\.{part}', a part of the adapted layer '0', has forward hook.*_doubled"
    with pytest.raises(ValueError, match=r"merged_network: " + match):
        merged_network(model, values)
    pytest.importorskip("peft")
    with pytest.raises(ValueError, match=r"to_peft: " + match):
        to_peft(model, values)


def test_a_lora_xs_core_hook_is_refused_by_merged_network():
    model = FineTuneModel(_net(), LoRAXS(rank=2, target_modules=["0"]), likelihood="categorical")
    model.net.get_submodule("0.core").register_forward_pre_hook(_tripled_input)
    with pytest.raises(ValueError, match=r"'0\.core', a part of the adapted layer '0'"):
        merged_network(model, _values(model))


@pytest.mark.parametrize("kind", ["forward", "pre"])
def test_to_peft_carries_the_hooks_of_an_adapter_layer(kind):
    pytest.importorskip("peft")
    model = FineTuneModel(_net(), LoRA(rank=2, target_modules=["0"]), likelihood="categorical")
    _register(model.net[0], kind)
    values = _values(model)
    x = torch.randn(5, 4)
    with torch.no_grad():
        torch.testing.assert_close(to_peft(model, values)(x), model.output(x, values))


# ------------------------------------------------------------------------------------------------
# latent layers and σN member norms
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["forward", "pre"])
def test_make_latent_keeps_the_hooks_of_the_layer_it_replaces(kind):
    # the BatchedLinear that replaced the head was a new module without the hooks
    net = _net()
    handle = _register(net[2], kind)
    x = torch.randn(5, 4)
    with torch.no_grad():
        expected = net(x)
    model = FineTuneModel(net, None, latent_modules=["2"], likelihood="categorical")
    with torch.no_grad():
        torch.testing.assert_close(model.output(x, model.init_values()), expected)
        handle.remove()  # the user's handle still removes it
        assert (model.output(x, model.init_values()) - expected).abs().max() > 1e-3


def test_a_hook_on_a_latent_layer_is_carried_into_the_merged_network():
    # the plain nn.Linear that replaced the latent layer in the copy had no hooks
    model = FineTuneModel(_net(), None, latent_modules=["2"], likelihood="categorical")
    model.net[2].register_forward_hook(_doubled)
    values = _values(model)
    x = torch.randn(5, 4)
    with torch.no_grad():
        torch.testing.assert_close(merged_network(model, values)(x), model.output(x, values))


def test_a_hook_on_a_member_norm_is_carried_into_the_merged_network():
    from pyrobayes.models.signorm import SigmaNorm

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 2)).eval()
    config = SigmaNorm(num_members=2, norm_modules=["1"], heads=["3"])
    model = FineTuneModel(net, config, likelihood="categorical")
    model.net[1].register_forward_hook(_doubled)
    values = {s: 0.3 * torch.randn(spec.shape) for s, spec in model.latent_sites.items()}
    x = torch.randn(5, 4)
    with torch.no_grad():
        torch.testing.assert_close(merged_network(model, values)(x), model.output(x, values))
