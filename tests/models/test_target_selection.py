"""Which modules ``target_modules`` adapts: modules under several names, layers an adapter could
never act on, entries that match nothing, and inputs that do not carry the batch's rows."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from pyrobayes.models import FineTuneModel, LoRA, LoRAXS, find_target_modules
from pyrobayes.models.deploy import merged_network, to_peft, unwrapped_network
from pyrobayes.models.layers import LoRALinear, LoRAXSLinear, batched_linear


class Tied(nn.Module):
    """One linear layer registered under two names (``dec`` is ``enc``), used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.dec = self.enc
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.dec(torch.tanh(self.enc(x)))))


class Mixed(nn.Module):
    """A Conv2d, an Embedding, a linear layer and a container of linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.emb = nn.Embedding(10, 8)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.fc = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x.view(-1, 1, 2, 4))).flatten(1)
        return self.fc(self.block(h))


@pytest.mark.parametrize(
    "adapter",
    [
        LoRA(rank=2, target_modules=["enc", "dec"]),
        LoRA(rank=2, target_modules=["dec"]),
        LoRA(rank=2, target_modules="dec"),
        LoRAXS(rank=2, target_modules=["enc", "dec"], init_scale=0.1),
    ],
    ids=["lora-both", "lora-alias", "lora-regex-alias", "lora-xs-both"],
)
def test_a_module_under_two_names_is_adapted_under_both(adapter) -> None:
    torch.manual_seed(0)
    net = Tied()
    w0, b0 = net.enc.weight.detach().clone(), net.enc.bias.detach().clone()
    model = FineTuneModel(net, adapter, num_data=10, trainable_modules=["head"])
    kind = LoRALinear if isinstance(adapter, LoRA) else LoRAXSLinear
    assert net.enc is net.dec and isinstance(net.dec, kind)
    # named by the first path, once
    roles = ["lora_A", "lora_B"] if isinstance(adapter, LoRA) else ["core"]
    assert list(model.latent_sites) == [f"enc.{r}" for r in roles]

    x = torch.randn(5, 8)
    values = {s: 0.3 * torch.randn(spec.shape) for s, spec in model.latent_sites.items()}
    layer = net.enc
    delta = (
        layer.delta_weight(values["enc.lora_A"], values["enc.lora_B"])
        if isinstance(adapter, LoRA)
        else layer.delta_weight(values["enc.core"])
    )
    w = w0 + delta  # both uses of the shared layer see the sampled adapter

    def by_hand(inputs):
        lin = lambda h: h @ w.T + b0  # noqa: E731
        return net.head(torch.tanh(lin(torch.tanh(lin(inputs)))))

    with torch.no_grad():
        out = model.output(x, values)
        torch.testing.assert_close(out, by_hand(x))
        # the site's parameter key reaches both uses through functional_call too (tied names)
        params = {model.latent_sites[s].param_name: v for s, v in values.items()}
        torch.testing.assert_close(torch.func.functional_call(net, params, (x,)), out)
        # S draws in one sample-batched forward: each draw at both uses
        draws = {s: torch.stack([v, -v]) for s, v in values.items()}
        batched = model.batched_output(x, draws)
        torch.testing.assert_close(batched[0], out)
        torch.testing.assert_close(batched[1], model.output(x, {s: -v for s, v in values.items()}))
        # merged and unwrapped copies keep the two names one layer
        merged = merged_network(model, values)
        assert merged.enc is merged.dec and type(merged.enc) is nn.Linear
        torch.testing.assert_close(merged(x), out)
        plain = unwrapped_network(model)
        assert plain.enc is plain.dec and type(plain.dec) is nn.Linear
        torch.testing.assert_close(plain.dec.weight, w0)


def test_to_peft_refuses_a_module_under_two_names() -> None:
    model = FineTuneModel(Tied(), LoRA(rank=2, target_modules=["enc"]), trainable_modules=[])
    with pytest.raises(ValueError, match=r"'enc' is registered under several names.*merged"):
        to_peft(model)


def test_a_module_under_two_names_is_made_latent_once() -> None:
    with pytest.raises(ValueError, match="'dec' is latent already"):
        FineTuneModel(Tied(), latent_modules=["enc", "dec"], trainable_modules=[])


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.att(self.proj(x), x, x)[0].mean(1))


@pytest.mark.parametrize("targets", [["out_proj"], ["proj", "out_proj"], r".*proj"])
def test_multihead_attention_out_proj_is_refused(targets) -> None:
    with pytest.raises(ValueError, match=r"'att\.out_proj'.*MultiheadAttention.*never calls"):
        FineTuneModel(Attention(), LoRA(rank=2, target_modules=targets), num_data=8)


def test_linear_layers_beside_multihead_attention_are_adapted() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = FineTuneModel(Attention(), LoRA(rank=2, target_modules=["proj"]), num_data=8)
    assert list(model.latent_sites) == ["proj.lora_A", "proj.lora_B"]


@pytest.mark.parametrize(
    ("entry", "kind"), [("conv", "Conv2d"), ("emb", "Embedding"), ("block", "Sequential")]
)
def test_an_entry_naming_an_unsupported_module_is_refused(entry, kind) -> None:
    with pytest.raises(ValueError, match=rf"entry '{entry}' names '{entry}', a {kind}.*nn\.Linear"):
        FineTuneModel(Mixed(), LoRAXS(rank=2, target_modules=[entry, "fc"]), num_data=10)


def test_a_container_entry_names_the_linear_layers_inside() -> None:
    with pytest.raises(ValueError, match=r"container.*\['0'\]"):
        FineTuneModel(Mixed(), LoRAXS(rank=2, target_modules=["block"]), num_data=10)


def test_an_entry_that_matches_nothing_is_warned_about_with_close_names() -> None:
    with pytest.warns(UserWarning, match=r"'fcc' \(did you mean \['fc'\]\?\) match no module"):
        model = FineTuneModel(Mixed(), LoRAXS(rank=2, target_modules=["fcc", "fc"]), num_data=10)
    assert list(model.latent_sites) == ["fc.core"]
    # nothing matched at all: the error, as before
    with pytest.raises(ValueError, match="matched no linear module"):
        FineTuneModel(Mixed(), LoRAXS(rank=2, target_modules=["fcc"]), num_data=10)


def test_a_regex_that_matches_a_conv_or_embedding_is_warned_about() -> None:
    with pytest.warns(UserWarning, match=r"'conv' \(Conv2d\), 'emb' \(Embedding\).*left as"):
        paths = find_target_modules(Mixed(), r"conv|emb|fc")
    assert paths == ["fc"]
    with warnings.catch_warnings():  # a container matched by the regex is not warned about
        warnings.simplefilter("error")
        assert find_target_modules(Mixed(), r"fc|block|block\.0") == ["block.0", "fc"]


class SharedTable(nn.Module):
    """A linear layer applied to a table computed once for the whole batch (as DeBERTa's
    relative-position projections), beside one applied to the batch's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(1, 4, 8))
        self.pos_proj = nn.Linear(8, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(x) + self.pos_proj(self.table).mean((0, 1))))


def test_an_input_without_the_batch_rows_names_the_module() -> None:
    model = FineTuneModel(SharedTable(), LoRA(rank=2, target_modules=["pos_proj", "proj"]))
    values = {s: torch.randn(3, *spec.shape) for s, spec in model.latent_sites.items()}
    with pytest.raises(RuntimeError) as err:
        model.batched_output(torch.randn(5, 8), values)
    message = str(err.value)
    assert "'pos_proj'" in message and "does not carry the batch's rows" in message
    assert "shared by the whole batch" in message and "target_modules" in message
    assert ".*(query_proj|value_proj)" in message
    with pytest.raises(RuntimeError, match="An adapted module got an input of shape"):
        batched_linear(torch.randn(1, 4, 8), torch.randn(3, 8, 8))


def test_deberta_relative_position_projections_name_themselves() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.DebertaV2Config(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, num_labels=3, pad_token_id=0,
        relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=16,
    )  # fmt: skip
    net = transformers.DebertaV2ForSequenceClassification(config)
    model = FineTuneModel(net, LoRA(rank=2, target_modules=["query_proj", "pos_key_proj"]))
    values = {s: 0.1 * torch.randn(2, *spec.shape) for s, spec in model.latent_sites.items()}
    batch = {"input_ids": torch.randint(1, 50, (3, 6)), "attention_mask": torch.ones(3, 6)}
    with pytest.raises(RuntimeError, match=r"'deberta\.encoder\.layer\.0\..*pos_key_proj'.*rows"):
        model.batched_output(batch, values)
    # the list entries select whole names: query_proj leaves pos_query_proj out
    model = FineTuneModel(
        transformers.DebertaV2ForSequenceClassification(config),
        LoRA(rank=2, target_modules=["query_proj", "value_proj"]),
    )
    assert not any("pos_" in s for s in model.latent_sites)
    assert model.batched_output(batch, values={
        s: 0.1 * torch.randn(2, *spec.shape) for s, spec in model.latent_sites.items()
    }).shape == (2, 3, 3)  # fmt: skip
