"""Edge cases of the adapter layer that once misbehaved silently: tied weights in a merged
copy, peft settings an import would drop, half-done conversions, module-name arguments of the
wrong type, normalisation statistics under a training backbone, parametrized layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRA, LoRAXS
from tests.common import TiedNet

# ------------------------------------------------------------------------------------------------
# merged_network and tied weights
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lora", "loraxs", "latent"])
def test_merged_network_unties_a_weight_shared_with_another_module(kind):
    net = TiedNet()
    emb = net.emb.weight.detach().clone()
    if kind == "latent":
        model = FineTuneModel(net, latent_modules=["head"], num_data=10, trainable_modules=[])
    else:
        adapter = (LoRA if kind == "lora" else LoRAXS)(rank=2, target_modules=["head"])
        model = FineTuneModel(net, adapter, num_data=10, trainable_modules=[])
    values = {s: 0.5 * torch.randn(spec.shape) for s, spec in model.latent_sites.items()}
    x = torch.randint(0, 10, (5, 3))
    with torch.no_grad():
        expected = model.output(x, values)
        merged = pb.models.merged_network(model, values)
        torch.testing.assert_close(merged(x), expected, atol=1e-6, rtol=0)
    assert torch.equal(merged.emb.weight, emb)  # the input embeddings keep their values
    assert merged.head.weight is not merged.emb.weight
    assert model.net.emb.weight is net.emb.weight and torch.equal(net.emb.weight, emb)


def test_merged_gpt2_lm_head_unties_from_the_input_embeddings_and_reloads(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=50,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        bos_token_id=49,
        eos_token_id=49,
    )
    net = GPT2LMHeadModel(config).eval()
    assert net.lm_head.weight is net.transformer.wte.weight
    wte = net.transformer.wte.weight.detach().clone()
    model = FineTuneModel(
        net,
        LoRA(rank=2, target_modules=["lm_head"]),
        likelihood="multiple_choice",
        choice_token_ids=[1, 2, 3],
        trainable_modules=[],
    )
    values = {s: 0.5 * torch.randn(spec.shape) for s, spec in model.latent_sites.items()}
    params = {model.latent_sites[s].param_name: v for s, v in values.items()}
    ids = torch.randint(0, 50, (3, 6))
    with torch.no_grad():
        expected = torch.func.functional_call(model.net, params, (ids,)).logits
        merged = pb.models.merged_network(model, values)
        torch.testing.assert_close(merged(ids).logits, expected, atol=1e-6, rtol=0)
        assert torch.equal(merged.transformer.wte.weight, wte)
        assert merged.config.tie_word_embeddings is False  # from_pretrained must not re-tie
        merged.save_pretrained(tmp_path)
        reloaded = GPT2LMHeadModel.from_pretrained(tmp_path, dtype=torch.float64).eval()
        torch.testing.assert_close(reloaded(ids).logits, expected, atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------------------
# peft: settings an import would drop, refused by name
# ------------------------------------------------------------------------------------------------


def _peft_model(adapter_name: str = "default", **options):
    peft = pytest.importorskip("peft")
    from tests.common import tiny_bert

    config = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["query"], init_lora_weights=False, **options
    )
    return peft.get_peft_model(tiny_bert().eval(), config, adapter_name=adapter_name)


@pytest.mark.parametrize(
    "option",
    [{"lora_bias": True}, {"trainable_token_indices": [5, 7]}],
    ids=lambda o: next(iter(o)),
)
def test_a_peft_model_with_a_setting_the_import_would_drop_is_refused(option):
    name = next(iter(option))
    with pytest.raises(ValueError, match=rf"the LoraConfig sets {name}=.*merge_and_unload"):
        FineTuneModel(_peft_model(**option))


@pytest.mark.parametrize(
    "option",
    [
        {"modules_to_save": ["pooler"]},
        {"bias": "all"},
        {"lora_bias": True},
        {"trainable_token_indices": [1, 2]},
    ],
    ids=lambda o: next(iter(o)),
)
def test_a_lora_config_setting_without_a_counterpart_is_refused_on_a_plain_network(option):
    peft = pytest.importorskip("peft")
    from tests.common import tiny_bert

    name = next(iter(option))
    config = peft.LoraConfig(r=2, target_modules=["query"], **option)
    with pytest.raises(ValueError, match=rf"the LoraConfig sets {name}=.*trainable_modules"):
        FineTuneModel(tiny_bert(), config)


def test_a_peft_adapter_merged_into_its_weights_is_refused_not_counted_twice():
    peft_model = _peft_model()
    peft_model.merge_adapter()
    with pytest.raises(ValueError, match=r"merged into the base weights.*unmerge_adapter\(\)"):
        FineTuneModel(peft_model)
    peft_model.unmerge_adapter()  # as the message says: then it imports with its function
    inputs = _bert_inputs()
    with torch.no_grad():
        reference = peft_model(**inputs).logits.clone()
        model = FineTuneModel(peft_model)
        torch.testing.assert_close(model.output(inputs, model.init_values()), reference)


def _bert_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 99, (4, 6), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_a_peft_model_with_several_active_adapters_is_refused():
    peft = pytest.importorskip("peft")
    peft_model = _peft_model("one")
    peft_model.add_adapter("two", peft.LoraConfig(r=2, target_modules=["query"]))
    peft_model.base_model.set_adapter(["one", "two"])
    with pytest.raises(ValueError, match=r"several active adapters \['one', 'two'\].*set_adapter"):
        FineTuneModel(peft_model)


def test_a_peft_model_with_disabled_adapter_layers_is_refused():
    peft_model = _peft_model()
    peft_model.base_model.disable_adapter_layers()
    with pytest.raises(ValueError, match=r"adapter layers are disabled.*enable_adapter_layers"):
        FineTuneModel(peft_model)


def test_peft_lora_model_inside_a_peft_model_is_refused_by_name():
    with pytest.raises(ValueError, match=r"net is a peft LoraModel .*pass the PeftModel itself"):
        FineTuneModel(_peft_model().base_model)


def test_an_explicit_adapter_on_a_peft_model_is_checked_never_dropped():
    peft = pytest.importorskip("peft")
    from pyrobayes.models import SigmaNorm

    other = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["value", "key"])
    with pytest.raises(ValueError, match=r"net is a peft LoRA model \(r=2, alpha=4.*differs"):
        FineTuneModel(_peft_model(), other)
    with pytest.raises(ValueError, match=r"adapter=SigmaNorm\(.*differs.*merge_and_unload"):
        FineTuneModel(_peft_model(), SigmaNorm(num_members=3))
    same = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["query"])
    model = FineTuneModel(_peft_model(), same)
    assert model.adapter.rank == 2 and model.adapter.scaling == 2.0


def test_peft_all_linear_target_is_named_as_peft_s_special_value():
    with pytest.raises(ValueError, match=r"'all-linear' is peft's special value"):
        FineTuneModel(nn.Sequential(nn.Linear(3, 3)), LoRA(rank=1, target_modules="all-linear"))


# ------------------------------------------------------------------------------------------------
# make_latent and latent_modules
# ------------------------------------------------------------------------------------------------


class _NormedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.body(x))))


@pytest.mark.parametrize(
    ("modules", "error", "match"),
    [
        (["head", "norm"], TypeError, "'norm' is a LayerNorm"),
        (["head", "head"], ValueError, "'head' is latent already"),
    ],
)
def test_make_latent_checks_every_module_before_converting_any(modules, error, match):
    model = FineTuneModel(
        _NormedNet(),
        LoRAXS(rank=2, target_modules=["body"]),
        num_data=40,
        trainable_modules=["norm", "head"],
    )
    points = dict(model.point_params)
    with pytest.raises(error, match=match):
        model.make_latent(modules)
    # nothing changed: the head is still a point-estimated nn.Linear, trained by a fit
    assert type(model.net.head) is nn.Linear
    assert list(model.latent_sites) == ["body.core"] and model.point_params == points
    assert model.net.head.weight.requires_grad
    assert model.make_latent(["head"]) == ["head.weight", "head.bias"]


def test_make_latent_function_changes_nothing_when_a_later_path_is_refused():
    from pyrobayes.models.adapters import make_latent

    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    with pytest.raises(TypeError, match="'1' is a Tanh"):
        make_latent(net, ["0", "1"])
    assert type(net[0]) is nn.Linear
    with pytest.raises(ValueError, match=r"'x' is no module of Sequential"):
        make_latent(net, ["2", "x"])
    assert type(net[2]) is nn.Linear
    assert [s.site for s in make_latent(net, "2")] == ["2.weight", "2.bias"]  # one path


def test_latent_modules_as_one_string_is_one_path():
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(11)])
    model = FineTuneModel(net, latent_modules="10", trainable_modules=[], num_data=10)
    assert list(model.latent_sites) == ["10.weight", "10.bias"]
    assert type(model.net[1]) is nn.Linear and type(model.net[0]) is nn.Linear


def test_a_module_inside_an_adapter_layer_cannot_be_made_latent():
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    with pytest.raises(ValueError, match=r"'0\.base' sits inside the LoRAXSLinear '0'"):
        FineTuneModel(
            net,
            LoRAXS(rank=2, target_modules=["0"]),
            num_data=40,
            trainable_modules=["2"],
            latent_modules=["0.base"],
        )


class _ScaledLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * super().forward(x)


def test_a_linear_subclass_with_its_own_forward_is_not_made_latent():
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), _ScaledLinear(8, 3))
    with pytest.raises(TypeError, match=r"'2' is a _ScaledLinear, an nn.Linear subclass"):
        FineTuneModel(net, latent_modules=["2"], num_data=40, trainable_modules=[])
    assert type(net[2]) is _ScaledLinear


# ------------------------------------------------------------------------------------------------
# parametrized layers (weight_norm)
# ------------------------------------------------------------------------------------------------


def _weight_normed() -> nn.Sequential:
    from torch.nn.utils.parametrizations import weight_norm

    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), weight_norm(nn.Linear(8, 8)), nn.Linear(8, 3))


@pytest.mark.parametrize("adapter", [LoRA, LoRAXS])
def test_merging_into_a_parametrized_layer_is_refused_then_exact_as_advised(adapter):
    model = FineTuneModel(
        _weight_normed(), adapter(rank=2, target_modules=["2"]), num_data=40, trainable_modules=[]
    )
    values = {s: torch.randn(spec.shape) for s, spec in model.latent_sites.items()}
    x = torch.randn(5, 4)
    with pytest.raises(ValueError, match=r"base layer of '2' .*remove_parametrizations"):
        pb.models.merged_network(model, values)
    with torch.no_grad():
        expected = model.output(x, values)
        torch.nn.utils.parametrize.remove_parametrizations(
            model.net.get_submodule("2.base"), "weight"
        )
        torch.testing.assert_close(model.output(x, values), expected)
        merged = pb.models.merged_network(model, values)
        torch.testing.assert_close(merged(x), expected, atol=1e-6, rtol=0)


def test_a_parametrized_linear_layer_is_not_made_latent():
    with pytest.raises(ValueError, match=r"weight of '2' is computed by a parametrization"):
        FineTuneModel(_weight_normed(), latent_modules=["2"], num_data=40, trainable_modules=[])


# ------------------------------------------------------------------------------------------------
# module-name and calibration arguments
# ------------------------------------------------------------------------------------------------


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.parametrize("adapter", [LoRA, LoRAXS])
@pytest.mark.parametrize(
    ("targets", "error", "match"),
    [
        (1.5, TypeError, r"target_modules must be a list of module names .* got 1\.5"),
        ([0], TypeError, r"target_modules entries must be module paths \(str\); got 0 \(int\)"),
        (["0", None], TypeError, r"target_modules entries .* got None"),
        (b"0", TypeError, r"target_modules must be .* got b'0'"),
        ([["0"]], TypeError, r"target_modules entries .* got \['0'\] \(list\)"),
        ([""], ValueError, r"target_modules names '' \(the network itself\)"),
    ],
)
def test_bad_target_modules_are_refused_by_name(adapter, targets, error, match):
    with pytest.raises(error, match=rf"{adapter.__name__}: {match}"):
        adapter(rank=2, target_modules=targets)


def test_a_set_of_target_modules_is_kept_in_a_fixed_order():
    assert LoRA(rank=2, target_modules={"b", "a"}).target_modules == ["a", "b"]
    assert LoRAXS(rank=2, target_modules=("q",)).target_modules == ("q",)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"trainable_modules": [2]}, TypeError, r"trainable_modules entries .* 2 \(int\)"),
        ({"trainable_modules": None}, TypeError, r"trainable_modules must be 'auto', a module"),
        ({"latent_modules": [2]}, TypeError, r"latent_modules entries .* 2 \(int\)"),
        ({"latent_modules": [""]}, ValueError, r"latent_modules names '' \(the network itself\)"),
    ],
)
def test_bad_module_arguments_are_refused_by_name_before_the_network_changes(options, error, match):
    net = _mlp()
    options = {"trainable_modules": [], **options}
    with pytest.raises(error, match=rf"FineTuneModel: {match}"):
        FineTuneModel(net, LoRA(rank=2, target_modules=["0"]), num_data=10, **options)
    assert type(net[0]) is nn.Linear  # refused before any layer was replaced


def _calibration_batches(rows: int = 40):
    x, y = torch.randn(rows, 4), torch.randint(0, 3, (rows,))
    return [(x[i : i + 10], y[i : i + 10]) for i in range(0, rows, 10)]


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"calibration_data": []}, ValueError, r"layer '0' got no input rows: calibration_data"),
        (
            {"calibration_data": _calibration_batches()[:1], "max_calibration_batches": 0},
            ValueError,
            r"max_calibration_batches must be an integer >= 1; got 0",
        ),
        (
            {"calibration_data": _calibration_batches(), "max_calibration_batches": -1},
            ValueError,
            r"max_calibration_batches must be an integer >= 1; got -1",
        ),
        (
            {"calibration_data": _calibration_batches(), "max_calibration_batches": 2.5},
            TypeError,
            r"max_calibration_batches must be an integer >= 1; got 2.5",
        ),
        (
            {"calibration_data": [(torch.randn(1, 4), torch.tensor([0]))]},
            ValueError,
            r"layer '0' got 1 input row .* needs at least 2",
        ),
    ],
)
def test_bad_wsvd_calibration_arguments_are_refused_by_name(options, error, match):
    with pytest.raises(error, match=match):
        FineTuneModel(
            _mlp(),
            LoRAXS(rank=2, projection="wsvd", target_modules=["0", "2"]),
            num_data=40,
            trainable_modules=["4"],
            **options,
        )


# ------------------------------------------------------------------------------------------------
# the backbone's mode, and a network adapted twice
# ------------------------------------------------------------------------------------------------


def test_train_backbone_mode_keeps_batch_norm_statistics_frozen():
    net = nn.Sequential(
        nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.1), nn.Tanh(), nn.Linear(8, 3)
    )
    model = FineTuneModel(
        net,
        LoRAXS(rank=2, target_modules=["0"]),
        num_data=40,
        trainable_modules=["4"],
        train_backbone_mode=True,
    )
    stats = {n: b.clone() for n, b in model.net[1].named_buffers()}
    model.train()
    assert model.net[2].training and not model.net[1].training  # dropout on, BatchNorm eval
    data = [(3 * x + 5, y) for x, y in _calibration_batches()]
    pb.fit(model, pb.posterior(model, "meanfield"), data, epochs=2)
    for name, buffer in model.net[1].named_buffers():
        assert torch.equal(buffer, stats[name]), name
    model.eval()
    assert not model.net[2].training


def test_wrapping_an_adapted_network_again_says_it_was_changed_in_place():
    net = _mlp()
    FineTuneModel(net, LoRAXS(rank=2, target_modules=["0"]), num_data=40, trainable_modules=["4"])
    with pytest.raises(
        ValueError, match=r"already holds pyrobayes layers \('0' \(LoRAXSLinear\)\)"
    ):
        FineTuneModel(net, LoRA(rank=2, target_modules=["2"]), num_data=40, trainable_modules=[])


def test_a_point_head_tied_to_the_embeddings_saves_a_posterior_that_loads(tmp_path):
    def build() -> FineTuneModel:
        torch.manual_seed(0)
        return FineTuneModel(
            TiedNet(),
            LoRA(rank=2, target_modules=["mid"]),
            num_data=40,
            trainable_modules=["head"],
        )

    model = build()
    assert list(model.point_params) == ["head.weight"]  # the embeddings' tensor too
    x, y = torch.randint(0, 10, (40, 3)), torch.randint(0, 10, (40,))
    guide = pb.posterior(model, "map")
    pb.fit(model, guide, [(x[i : i + 10], y[i : i + 10]) for i in range(0, 40, 10)], epochs=2)
    pb.save(guide, tmp_path / "tied.safetensors")
    fresh = build()
    loaded = pb.load(tmp_path / "tied.safetensors", fresh)
    assert torch.equal(fresh.net.head.weight, model.net.head.weight)
    with torch.no_grad():
        torch.testing.assert_close(fresh.output(x, loaded.mean()), model.output(x, guide.mean()))


# ------------------------------------------------------------------------------------------------
# LoRA-XS on a zero or rank-deficient weight
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("projection", ["svd", "dct", "random"])
def test_lora_xs_on_a_zero_weight_warns_that_its_core_does_nothing(projection):
    from pyrobayes.models.adapters import IneffectiveCoreWarning

    net = _mlp()
    with torch.no_grad():
        net[2].weight.zero_()
    with pytest.warns(IneffectiveCoreWarning, match=r"bases of '2' span 0 x 4 .* Leave '2' out"):
        model = FineTuneModel(
            net, LoRAXS(rank=4, projection=projection, target_modules=["2"]), trainable_modules=[]
        )
    x = torch.randn(5, 4)
    with torch.no_grad():
        torch.testing.assert_close(
            model.output(x, {"2.core": 10 * torch.randn(4, 4)}),
            model.output(x, {"2.core": torch.zeros(4, 4)}),
        )


def test_lora_xs_on_a_rank_one_weight_names_the_usable_rank():
    from pyrobayes.models.adapters import IneffectiveCoreWarning

    net = _mlp()
    with torch.no_grad():
        net[2].weight.copy_(torch.randn(8, 1) @ torch.randn(1, 8))
    with pytest.warns(IneffectiveCoreWarning, match=r"12 of the core's 16 .* rank to 1"):
        FineTuneModel(net, LoRAXS(rank=4, target_modules=["2"]), trainable_modules=[])
    FineTuneModel(_mlp(), LoRAXS(rank=4, target_modules=["2"]), trainable_modules=[])  # silent


@pytest.mark.parametrize("init", ["pissa", "olora", False])
def test_a_lora_config_initialisation_peft_would_apply_is_refused_on_a_plain_network(init):
    """LoraConfig(init_lora_weights="pissa") on a plain network started from pyrobayes' own
    initialisation (B = 0, the base weights untouched), not the one asked for."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, lora_alpha=2, target_modules=["0"], init_lora_weights=init)
    with pytest.raises(ValueError, match="init_lora_weights"):
        pb.models.LoRA.from_peft(config)
    for default in (True, "gaussian"):  # pyrobayes' own initialisation: accepted
        ok = peft.LoraConfig(r=2, lora_alpha=2, target_modules=["0"], init_lora_weights=default)
        assert pb.models.LoRA.from_peft(ok).rank == 2
