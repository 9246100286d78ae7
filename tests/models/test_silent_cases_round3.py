"""Silent cases of the peft import, the deployment and the LoRA-XS projections, each now warned
about or refused by name: a peft ``lora_dropout`` the import does not apply, a peft LoRA layer
on an embedding or a convolution, a merge into an ``nn.Linear`` subclass with its own forward,
a deployed network left in training mode, a half-precision merge that rounds the update away,
and one module path given to ``collect_input_moments`` as a string."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRA, LoRAXS
from pyrobayes.models.deploy import MergeRoundingWarning, merged_network, to_peft
from pyrobayes.models.projections import collect_input_moments

# ------------------------------------------------------------------------------------------------
# peft import: lora_dropout, and LoRA layers on modules pyrobayes does not adapt
# ------------------------------------------------------------------------------------------------


def _bert_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 99, (4, 6), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _peft_bert(**options):
    peft = pytest.importorskip("peft")
    from tests.common import tiny_bert

    config = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["query"], init_lora_weights=False, **options
    )
    return peft.get_peft_model(tiny_bert().eval(), config)


def test_a_peft_lora_dropout_is_imported_with_a_warning_naming_the_adapter_and_value():
    assert "LoRADropoutWarning" in pb.models.__all__
    peft_model = _peft_bert(lora_dropout=0.05)
    inputs = _bert_inputs()
    with torch.no_grad():
        reference = peft_model.eval()(**inputs).logits.clone()  # peft's dropout off in eval
    with pytest.warns(
        pb.models.LoRADropoutWarning,
        match=r"peft LoRA adapter 'default' has lora_dropout=0\.05, which pyrobayes' LoRA does "
        r"not apply.*peft_config\['default'\]\.lora_dropout = 0",
    ):
        model = FineTuneModel(peft_model)
    with torch.no_grad():  # the function at evaluation is the peft model's
        torch.testing.assert_close(model.output(inputs, model.init_values()), reference)


def test_a_peft_model_without_lora_dropout_imports_without_a_warning():
    peft_model = _peft_bert(lora_dropout=0.05)
    peft_model.peft_config["default"].lora_dropout = 0.0  # as the warning says
    with warnings.catch_warnings():
        warnings.simplefilter("error", pb.models.LoRADropoutWarning)
        FineTuneModel(peft_model)


def test_an_explicit_lora_config_with_dropout_on_a_peft_model_is_warned_about():
    peft = pytest.importorskip("peft")
    same = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["query"], lora_dropout=0.1)
    peft_model = _peft_bert()
    with pytest.warns(pb.models.LoRADropoutWarning, match=r"adapter=LoraConfig.*=0\.1"):
        model = FineTuneModel(peft_model, same)
    assert model.adapter.rank == 2


def test_a_lora_config_with_dropout_on_a_plain_network_is_warned_about():
    peft = pytest.importorskip("peft")
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["0"], lora_dropout=0.1)
    with pytest.warns(pb.models.LoRADropoutWarning, match=r"adapter=LoraConfig.*=0\.1"):
        model = FineTuneModel(net, config)
    assert model.adapter.rank == 2
    config.lora_dropout = 0.0  # as the warning says: then silent
    with warnings.catch_warnings():
        warnings.simplefilter("error", pb.models.LoRADropoutWarning)
        FineTuneModel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), config)


class _EmbedConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.conv = nn.Conv1d(4, 4, 1)
        self.fc = nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.emb(ids).transpose(1, 2)).transpose(1, 2)
        return self.fc(h).mean(1)


@pytest.mark.parametrize(
    ("target", "kind"), [("emb", "Embedding"), ("conv", "Conv1d")], ids=["embedding", "conv"]
)
def test_a_peft_lora_layer_on_a_module_pyrobayes_does_not_adapt_is_refused_not_dropped(
    target, kind
):
    # an embedding's LoRA (lora_embedding_A, no lora_A) was dropped, the import computing
    # another function (a regex target only warned that it left the embedding "as it is"); a
    # convolution's failed with a KeyError
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=f".*({target}|fc)", init_lora_weights=False
    )
    peft_model = peft.get_peft_model(_EmbedConvNet().eval(), config)
    with pytest.raises(
        ValueError,
        match=rf"adapter 'default' adapts '{target}' \(a {kind}\).*drop that layer's trained "
        r"update.*merge_and_unload\(\)",
    ):
        FineTuneModel(peft_model, likelihood="categorical")


# ------------------------------------------------------------------------------------------------
# merged_network: an nn.Linear subclass with a forward of its own
# ------------------------------------------------------------------------------------------------


class _Doubled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


class _TanhWeight(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.tanh(), self.bias)


class _Renamed(nn.Linear):  # a subclass keeping nn.Linear's forward: x W^T + b
    pass


_ADAPTERS = {
    "lora": lambda: LoRA(rank=2, target_modules=["0"]),
    "lora-xs": lambda: LoRAXS(rank=2, target_modules=["0"]),
}


def _subclass_model(cls: type[nn.Linear], adapter: str):
    torch.manual_seed(0)
    net = nn.Sequential(cls(4, 3), nn.Tanh(), nn.Linear(3, 2)).eval()
    model = FineTuneModel(net, _ADAPTERS[adapter](), likelihood="categorical")
    values = {s: 0.5 * torch.randn(v.shape) for s, v in model.init_values().items()}
    return model, values, torch.randn(5, 4)


@pytest.mark.parametrize("adapter", sorted(_ADAPTERS))
@pytest.mark.parametrize("cls", [_Doubled, _TanhWeight], ids=["scaled-output", "tanh-weight"])
def test_merging_into_a_linear_subclass_with_its_own_forward_is_refused(cls, adapter):
    # the merged network computed forward(x; W0 + ΔW), not forward(x; W0) + ΔW x
    model, values, _ = _subclass_model(cls, adapter)
    with pytest.raises(
        TypeError,
        match=rf"base layer of '0' is a {cls.__name__}, an nn.Linear subclass with a forward "
        r"of its own.*Deploy the adapter unmerged",
    ):
        merged_network(model, values)


def test_to_peft_named_by_the_refusal_keeps_the_subclass_forward():
    pytest.importorskip("peft")
    model, values, x = _subclass_model(_Doubled, "lora")
    with pytest.raises(TypeError, match=r"to_peft\(model, values\)"):
        merged_network(model, values)
    with torch.no_grad():
        expected = model.output(x, values)
        torch.testing.assert_close(to_peft(model, values)(x), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("adapter", sorted(_ADAPTERS))
def test_a_linear_subclass_with_the_stock_forward_still_merges(adapter):
    model, values, x = _subclass_model(_Renamed, adapter)
    with torch.no_grad():
        expected = model.output(x, values)
        torch.testing.assert_close(merged_network(model, values)(x), expected)


# ------------------------------------------------------------------------------------------------
# deployed networks in eval mode, whatever train_backbone_mode
# ------------------------------------------------------------------------------------------------


def test_deployed_networks_are_in_eval_mode_for_a_train_backbone_mode_model():
    # the copy kept the backbone's training mode: dropout on in the deployed network
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    model = FineTuneModel(
        net, LoRA(rank=2, target_modules=["0"]), likelihood="categorical", train_backbone_mode=True
    )
    assert model.net.training  # fitting with dropout, as asked
    values = {s: 0.5 * torch.randn(v.shape) for s, v in model.init_values().items()}
    x = torch.randn(16, 4)
    merged = merged_network(model, values)
    assert not any(m.training for m in merged.modules())
    with torch.no_grad():
        expected = model.eval().output(x, values)
        torch.testing.assert_close(merged(x), expected)
    model.train()
    pytest.importorskip("peft")
    exported = to_peft(model, values)
    assert not any(m.training for m in exported.modules())
    with torch.no_grad():
        torch.testing.assert_close(exported(x), expected)


# ------------------------------------------------------------------------------------------------
# half-precision merges that round the update away
# ------------------------------------------------------------------------------------------------


def _bf16_model(scale: float):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))
    nn.init.normal_(net[0].weight, 0.0, 0.02)
    model = FineTuneModel(
        net.to(torch.bfloat16), LoRA(rank=4, target_modules=["0"]), likelihood="categorical"
    )
    values = {s: v.float() for s, v in model.init_values().items()}
    values["0.lora_B"] = scale * torch.randn(values["0.lora_B"].shape).float()
    return model, values


def _merged_delta_error(model, values, merged) -> float:
    layer = model.net[0]
    exact = layer.delta_weight(values["0.lora_A"], values["0.lora_B"]).double()
    kept = merged[0].weight.double() - layer.base.weight.double()
    return float((kept - exact).norm() / exact.norm())


def test_a_bfloat16_merge_that_rounds_the_update_away_warns_naming_the_layer():
    model, values = _bf16_model(1e-3)  # ΔW about 1% of W0: much of it below bf16's step
    with pytest.warns(
        MergeRoundingWarning, match=r"relative error of the merged ΔW: '0' \(\d+%\).*float32"
    ):
        merged = merged_network(model, values)
    assert _merged_delta_error(model, values, merged) > 0.1
    model.net.float()  # as the warning says: merged in float32, silent, ΔW kept
    assert _merged_delta_error(model, values, merged_network(model, values)) < 1e-4


def test_a_bfloat16_merge_of_a_large_update_does_not_warn():
    model, values = _bf16_model(1.0)
    merged_network(model, values)  # (a warning would fail the test)


# ------------------------------------------------------------------------------------------------
# collect_input_moments: one path as a string
# ------------------------------------------------------------------------------------------------


def test_collect_input_moments_takes_one_module_path_as_a_string():
    # a string was iterated as one-letter paths: "0.0" was refused as ['.'] missing, and "0"
    # only worked by accident
    net = nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 2))
    moments = collect_input_moments(net, "0.0", [torch.randn(5, 4)], forward=lambda m, b: m(b))
    assert list(moments) == ["0.0"] and moments["0.0"].n == 5
    with pytest.raises(ValueError, match=r"collect_input_moments: module_names \['head'\]"):
        collect_input_moments(net, "head", [torch.randn(5, 4)], forward=lambda m, b: m(b))


def test_a_target_modules_regex_that_does_not_compile_is_a_value_error_naming_it():
    """re.error is no ValueError: a bad regex escaped from the adapter as a bare traceback."""
    with pytest.raises(
        ValueError, match=r"target_modules 'q_proj\(' is a regex .* does not compile"
    ):
        pb.models.LoRA(rank=2, target_modules="q_proj(")
