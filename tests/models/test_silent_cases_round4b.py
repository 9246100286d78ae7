"""Silent failure cases, round 4b: hooks on a norm layer σN converts, and tied weights between a
latent head and the input embeddings."""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRA, SigmaNormEnsemble
from pyrobayes.models.signorm import MemberNorm
from tests.common import TiedNet, tied_data

# ------------------------------------------------------------------------------------------------
# σN: hooks registered on a norm layer before the conversion
# ------------------------------------------------------------------------------------------------


def _normed_mlp(norm: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), norm, nn.Tanh(), nn.Linear(8, 3))
    with torch.no_grad():  # a pretrained, non-trivial scale and shift
        net[1].weight.copy_(torch.rand(8) + 0.5)
        if getattr(net[1], "bias", None) is not None:
            net[1].bias.copy_(0.1 * torch.randn(8))
    return net


def _members(model: FineTuneModel, num: int) -> dict[str, torch.Tensor]:
    """``num`` members around the initial values (shifts kept: an RMSNorm merges none)."""
    gen = torch.Generator().manual_seed(1)
    noise = 0.3
    return {
        site: v.expand(num, *v.shape)
        + (0.0 if site.endswith(".beta") else noise) * torch.randn(num, *v.shape, generator=gen)
        for site, v in model.init_values().items()
    }


@pytest.mark.parametrize("norm", [nn.LayerNorm(8), nn.RMSNorm(8)], ids=["layer", "rms"])
def test_sigma_norm_carries_an_output_changing_hook_over_to_the_member_layer(norm):
    # before: the conversion check ran the hook on the pretrained layer only and refused the
    # layer as "not a LayerNorm"
    net = _normed_mlp(norm)
    handle = net[1].register_forward_hook(lambda module, args, out: 2 * out + 1)
    reference = copy.deepcopy(net)
    x = torch.randn(5, 4)
    model = SigmaNormEnsemble(net, num_members=2, heads=["3"], num_data=10)
    layer = model.net.get_submodule("1")
    assert isinstance(layer, MemberNorm)
    with torch.no_grad():
        torch.testing.assert_close(model.output(x, model.init_values()), reference(x))
        members = _members(model, 2)
        batched = model.batched_output(x, members)
        one = {site: v[1] for site, v in members.items()}
        merged = pb.models.merged_network(model, one)
        torch.testing.assert_close(merged(x), batched[1])  # the deployed layer keeps the hook
        handle.remove()  # the user's handle still removes it from the member layer
        assert not layer._forward_hooks
        unhooked = model.output(x, model.init_values())
    reference[1]._forward_hooks.clear()
    with torch.no_grad():
        torch.testing.assert_close(unhooked, reference(x))


def test_an_rms_norm_pre_hook_is_carried_over():
    net = _normed_mlp(nn.RMSNorm(8))
    net[1].register_forward_pre_hook(lambda module, args: (args[0] + 1.0,))
    reference = copy.deepcopy(net)
    x = torch.randn(5, 4)
    model = SigmaNormEnsemble(net, num_members=2, heads=["3"], num_data=10)
    with torch.no_grad():
        torch.testing.assert_close(model.output(x, model.init_values()), reference(x))


def test_an_observing_hook_on_a_norm_is_neither_dropped_nor_called_by_the_conversion(caplog):
    # before: the hook saw the conversion check's random (4, 8) input, then was dropped with
    # the replaced layer, so the model's forwards never reached it
    net = _normed_mlp(nn.LayerNorm(8))
    seen: list[tuple[int, ...]] = []
    net[1].register_forward_hook(lambda module, args, out: seen.append(tuple(out.shape)))
    with caplog.at_level(logging.INFO, logger="pyrobayes.models.signorm"):
        model = SigmaNormEnsemble(net, num_members=3, heads=["3"], num_data=10)
    assert seen == []
    assert "registered on the norm layer '1' now run on its member layer" in caplog.text
    with torch.no_grad():
        model.batched_output(torch.randn(5, 4), _members(model, 3))
    assert seen == [(15, 8)]  # the three members' rows, sample-major


def test_a_norm_whose_weight_torch_recomputes_is_refused_by_name():
    # before: the older weight_norm failed inside copy.deepcopy, and a parametrized norm was
    # converted but merged into a layer that recomputed the pretrained weight over the member's
    net = _normed_mlp(nn.LayerNorm(8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation of the older weight_norm
        torch.nn.utils.weight_norm(net[1], dim=None)
    with pytest.raises(ValueError, match=r"norm layer '1' has its weight recomputed.*WeightNorm"):
        SigmaNormEnsemble(net, num_members=2, heads=["3"], num_data=10)
    net = _normed_mlp(nn.LayerNorm(8))
    torch.nn.utils.parametrizations.weight_norm(net[1], dim=None)
    with pytest.raises(ValueError, match=r"'1' has .* by a parametrization.*norm_modules"):
        SigmaNormEnsemble(net, num_members=2, heads=["3"], num_data=10)


# ------------------------------------------------------------------------------------------------
# A latent head tied to the input embeddings
# ------------------------------------------------------------------------------------------------


def test_a_latent_head_tied_to_trained_embeddings_is_refused():
    # before: emb.weight was trained as a point parameter while the head's draws replaced the
    # same tensor in the head only, and the site's starting value moved with the training
    with pytest.raises(
        ValueError,
        match=r"latent site 'head\.weight' \(module 'head'\) is the same tensor as 'emb\.weight' "
        r"of module 'emb', a point parameter.*Leave 'emb' frozen.*untie the weights",
    ):
        FineTuneModel(TiedNet(), latent_modules=["head"], trainable_modules=["emb", "mid"])


def test_a_latent_head_tied_to_frozen_embeddings_is_last_layer_and_says_so(caplog):
    net = TiedNet()
    emb = net.emb.weight.detach().clone()
    with caplog.at_level(logging.INFO, logger="pyrobayes.models.finetune"):
        model = FineTuneModel(net, latent_modules=["head"], trainable_modules=["mid"], num_data=40)
    assert "'head.weight' is the same tensor as the frozen ['emb.weight']" in caplog.text
    guide = pb.posterior(model, "map")
    pb.fit(model, guide, tied_data(), epochs=2)
    assert torch.equal(net.emb.weight, emb)  # the features' embeddings stay at their values
    head = guide.mean()["head.weight"]
    assert not torch.equal(head, emb)
    x = tied_data()[0][0]
    with torch.no_grad():
        features = torch.tanh(net.mid(emb[x].mean(1)))
        torch.testing.assert_close(model.output(x, guide.mean()), features @ head.T)


def test_make_latent_refuses_a_head_tied_to_a_point_embedding_and_changes_nothing():
    model = FineTuneModel(
        TiedNet(), LoRA(rank=2, target_modules=["mid"]), trainable_modules=["emb", "head"]
    )
    before = dict(model.point_params)
    with pytest.raises(ValueError, match=r"make_latent: the latent site 'head\.weight'.*'emb'"):
        model.make_latent(["head"])
    assert type(model.net.head) is nn.Linear and model.point_params == before


def test_two_latent_modules_sharing_one_weight_are_refused():
    class Twin(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x)))

    with pytest.raises(
        ValueError, match=r"'a\.weight' .* 'b\.weight' of module 'b', another latent"
    ):
        FineTuneModel(Twin(), latent_modules=["a", "b"], trainable_modules=[])
