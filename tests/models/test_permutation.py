"""PermutationSpec: the unit-permutation group of a model's latent sites, found automatically."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pyrobayes.models import FineTuneModel, LoRA, LoRAXS, PermutationSpec
from tests.common import tiny_bert


def _mlp_with_norm() -> nn.Sequential:
    """3 → 5 (LayerNorm, Tanh) → 6 (GELU, dropout) → 2, biases everywhere."""
    return nn.Sequential(
        nn.Linear(3, 5),
        nn.LayerNorm(5),
        nn.Tanh(),
        nn.Linear(5, 6),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(6, 2),
    )


def _latent_mlp(net: nn.Module | None = None, **kw) -> FineTuneModel:
    torch.manual_seed(0)
    kw.setdefault("trainable_modules", [])
    return FineTuneModel(
        _mlp_with_norm() if net is None else net,
        None,
        latent_modules=["0", "3", "6"],
        num_data=16,
        **kw,
    ).double()


def _random_values(model: FineTuneModel, generator: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        s: torch.randn(tuple(spec.shape), generator=generator, dtype=torch.float64)
        for s, spec in model.latent_sites.items()
    }


def test_hidden_units_of_a_latent_mlp_never_the_input_or_output():
    spec = PermutationSpec.from_model(_latent_mlp())
    assert spec.sizes == (5, 6)  # the two hidden layers; inputs (3) and outputs (2) stay
    assert spec.layers[0].members == (("0.weight", 0), ("0.bias", 0), ("3.weight", 1))
    assert spec.layers[1].members == (("3.weight", 0), ("3.bias", 0), ("6.weight", 1))
    assert spec.order == math.factorial(5) * math.factorial(6)
    assert spec.log_order == pytest.approx(math.log(spec.order), rel=1e-12)


def test_function_invariance_mlp_with_biases_and_layernorm():
    """f(x; h·θ) = f(x; θ) for random θ and random h (float64, 1e-6): rows of W_l and b_l and
    columns of W_{l+1} move together, and LayerNorm over the hidden units is equivariant."""
    model = _latent_mlp()
    spec = PermutationSpec.from_model(model)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 3, generator=g, dtype=torch.float64)
    theta = _random_values(model, g)
    perms = spec.sample(5, generator=g)
    moved = spec.act({s: v.unsqueeze(0) for s, v in theta.items()}, perms)  # (1, 5, *shape)
    reference = model.output(x, theta)
    for k in range(5):
        out = model.output(x, {s: v[0, k] for s, v in moved.items()})
        assert torch.allclose(out, reference, atol=1e-6, rtol=0)
        # a genuine move: the permuted weights differ from θ unless h is the identity
        is_identity = all(torch.equal(p[k], torch.arange(p.shape[1])) for p in perms)
        assert is_identity or not torch.equal(moved["0.weight"][0, k], theta["0.weight"])
    # permuting the input or output units instead does change the function (a control)
    wrong = dict(theta)
    wrong["6.weight"] = theta["6.weight"].flip(0)
    assert (model.output(x, wrong) - reference).abs().max() > 1e-3
    assert spec.check_function(model, x, theta) <= 1e-6


def test_act_equals_index_select_per_element():
    """The vectorised gather equals one index_select per (site, axis) and element."""
    model = _latent_mlp()
    spec = PermutationSpec.from_model(model)
    g = torch.Generator().manual_seed(4)
    theta = {
        s: v.unsqueeze(0).repeat(2, *([1] * v.dim())) for s, v in _random_values(model, g).items()
    }
    perms = spec.sample(3, generator=g)
    moved = spec.act(theta, perms)
    for k in range(3):
        for s in theta:
            expected = theta[s]
            for layer, perm in zip(spec.layers, perms, strict=True):
                for site, axis in layer.members:
                    if site == s:
                        expected = expected.index_select(axis + 1, perm[k])
            assert torch.equal(moved[s][:, k], expected), s


def test_enumerate_is_the_whole_group_identity_first():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1))
    model = FineTuneModel(net, None, latent_modules=["0", "2"], num_data=4, trainable_modules=[])
    spec = PermutationSpec.from_model(model)
    (perms,) = spec.enumerate()
    assert spec.order == 24 and perms.shape == (24, 4)
    assert torch.equal(perms[0], torch.arange(4))
    assert len({tuple(p.tolist()) for p in perms}) == 24
    assert torch.equal(spec.inverse([perms])[0].gather(1, perms), torch.arange(4).expand(24, 4))


def test_lora_rank_permutations_keep_tiny_bert_invariant():
    """Rows of lora_A with columns of lora_B: B A = (B Pᵀ)(P A) (float64, 1e-6)."""
    torch.manual_seed(0)
    model = FineTuneModel(
        tiny_bert(), LoRA(rank=4, target_modules=["query", "value"]), num_data=8
    ).double()
    model.eval()
    spec = PermutationSpec.from_model(model)
    assert spec.sizes == (4, 4, 4, 4)  # two layers × (query, value)
    assert all(
        u.members == ((f"{u.name[:-5]}.lora_A", 0), (f"{u.name[:-5]}.lora_B", 1))
        for u in spec.layers
    )
    g = torch.Generator().manual_seed(5)
    theta = _random_values(model, g)  # lora_B random (not its zero init): a real update
    ids = torch.randint(1, 99, (3, 6), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    reference = model.output(batch, theta)
    base = model.output(batch, {s: torch.zeros_like(v) for s, v in theta.items()})
    assert (reference - base).abs().max() > 1e-2  # the adapters do change the function
    moved = spec.act({s: v.unsqueeze(0) for s, v in theta.items()}, spec.sample(3, generator=g))
    for k in range(3):
        out = model.output(batch, {s: v[0, k] for s, v in moved.items()})
        assert torch.allclose(out, reference, atol=1e-6, rtol=0)


def test_lora_xs_cores_have_no_symmetry():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    model = FineTuneModel(net, LoRAXS(rank=2, target_modules=["0"]), num_data=8)
    with pytest.raises(ValueError, match="LoRA-XS cores") as err:
        PermutationSpec.from_model(model)
    assert "LoRA(rank=r" in str(err.value)


def test_a_non_invariant_prior_is_refused():
    class PerUnitPrior(FineTuneModel):
        def site_prior(self, site):
            prior = super().site_prior(site)
            shape = self.latent_sites[site].shape
            scale = torch.linspace(0.5, 2.0, shape[0]).reshape(-1, *([1] * (len(shape) - 1)))
            return type(prior.base_dist)(0.0, scale.expand(shape)).to_event(len(shape))

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    model = PerUnitPrior(net, None, latent_modules=["0", "2"], num_data=8, trainable_modules=[])
    with pytest.raises(ValueError, match="not invariant") as err:
        PermutationSpec.from_model(model)
    assert "site '0." in str(err.value)  # the first site of the sorted list is named


def test_a_norm_that_breaks_the_symmetry_is_named():
    net = _mlp_with_norm()
    with torch.no_grad():
        net[1].weight.copy_(torch.linspace(0.5, 1.5, 5))
    with pytest.raises(ValueError, match="LayerNorm '1'.*differs between units"):
        PermutationSpec.from_model(_latent_mlp(net))
    with pytest.raises(ValueError, match="LayerNorm '1'.*point-estimated"):
        PermutationSpec.from_model(_latent_mlp(trainable_modules=["1"]))


def test_no_symmetry_and_not_a_finetune_model():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    head_only = FineTuneModel(net, None, latent_modules=["2"], num_data=8, trainable_modules=[])
    with pytest.raises(ValueError, match="no permutation symmetry"):
        PermutationSpec.from_model(head_only)
    with pytest.raises(TypeError, match="FineTuneModel"):
        PermutationSpec.from_model(net)
