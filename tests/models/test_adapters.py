"""Adapters on BERT-, GPT-2- and LLaMA-like models and MLPs: sites, init invariance, batching."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRA, LoRAXS
from pyrobayes.models.deploy import merged_network, to_peft
from tests.common import mlp, tiny_bert, tiny_gpt2, tiny_llama


def _bert_batch(batch_size: int = 5, seq: int = 7, vocab: int = 99) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (batch_size, seq), generator=g)
    mask = torch.ones(batch_size, seq, dtype=torch.long)
    mask[0, 5:] = 0  # one padded example
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 0, 1, 1])}


def test_site_names_are_stable_and_readable():
    names = []
    for _ in range(2):
        torch.manual_seed(0)
        model = FineTuneModel(tiny_bert(), LoRAXS(rank=4, target_modules=["query", "value"]))
        names.append(list(model.latent_sites))
    assert names[0] == names[1]
    assert names[0] == [
        f"bert.encoder.layer.{i}.attention.self.{m}.core"
        for i in range(2)
        for m in ("query", "value")
    ]
    assert all(model.latent_sites[s].shape == (4, 4) for s in names[0])
    # the BERT head is point-estimated, everything else frozen
    assert set(model.point_params) == {"classifier.weight", "classifier.bias"}
    trainable = {n for n, p in model.net.named_parameters() if p.requires_grad}
    assert trainable == {"classifier.weight", "classifier.bias"}


def test_lora_sites():
    model = FineTuneModel(tiny_bert(), LoRA(rank=3, target_modules=["query"]))
    assert list(model.latent_sites) == [
        f"bert.encoder.layer.{i}.attention.self.query.{r}"
        for i in range(2)
        for r in ("lora_A", "lora_B")
    ]
    assert model.latent_sites["bert.encoder.layer.0.attention.self.query.lora_A"].shape == (3, 32)
    assert model.latent_sites["bert.encoder.layer.0.attention.self.query.lora_B"].shape == (32, 3)


def test_no_match_lists_candidates():
    with pytest.raises(ValueError, match="Candidate module names") as err:
        FineTuneModel(tiny_bert(), LoRAXS(rank=2, target_modules=["q_proj"]))
    assert "query" in str(err.value) and "q_proj" in str(err.value)
    # a module name given as a string is a regex over whole paths: the message says so
    with pytest.raises(
        ValueError, match=r"for module names pass a list, target_modules=\['query'\]"
    ):
        FineTuneModel(tiny_bert(), LoRAXS(rank=2, target_modules="query"))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="rank"):
        LoRAXS(rank=0)
    with pytest.raises(ValueError, match="projection"):
        LoRAXS(projection="pca")
    with pytest.raises(ValueError, match="calibration_data"):
        FineTuneModel(tiny_bert(), LoRAXS(rank=2, projection="wsvd"))
    with pytest.raises(ValueError, match="adapter"):
        FineTuneModel(mlp(6, 16, 16, 3))


@pytest.mark.parametrize("projection", ["svd", "wsvd", "dct", "random"])
def test_init_output_equals_pretrained_bert(projection):
    net = tiny_bert().eval()
    batch = _bert_batch()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        reference = net(**inputs).logits.clone()
    model = FineTuneModel(
        net,
        LoRAXS(rank=4, projection=projection, target_modules=["query", "value", "dense"]),
        calibration_data=[batch, batch] if projection == "wsvd" else None,
    )
    with torch.no_grad():
        out = model.output(inputs, model.init_values())
    # SPECS 2(d) 3: R ~ N(0, 1e-5²) keeps the pretrained function to 1e-4 relative
    assert torch.linalg.norm(out - reference) <= 1e-4 * torch.linalg.norm(reference)


@pytest.mark.parametrize(
    "factory,targets,num_sites",
    [
        (tiny_gpt2, ["c_attn", "c_proj"], 6),  # c_proj is in attention and MLP: 3 per block
        (tiny_llama, ["q_proj", "v_proj"], 4),
    ],
)
def test_gpt2_conv1d_and_llama_targets(factory, targets, num_sites):
    net = factory().eval()
    ids = torch.randint(1, 99, (3, 6))
    with torch.no_grad():
        reference = net(input_ids=ids).logits.clone()
    model = FineTuneModel(net, LoRAXS(rank=4, target_modules=targets), trainable_modules=[])
    assert len(model.latent_sites) == num_sites
    with torch.no_grad():
        out = model.output({"input_ids": ids}, model.init_values())
        changed = model.output(
            {"input_ids": ids}, {s: torch.ones(4, 4) for s in model.latent_sites}
        )
    assert torch.linalg.norm(out - reference) <= 1e-4 * torch.linalg.norm(reference)
    assert not torch.allclose(changed, reference)  # the cores really act on the network


def _random_values(model: FineTuneModel, num_samples: int, scale: float = 0.3) -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        s: scale * torch.randn(num_samples, *spec.shape, generator=g)
        for s, spec in model.latent_sites.items()
    }


@pytest.mark.parametrize(
    "adapter",
    [
        LoRAXS(rank=4, target_modules=["query", "value", "dense"]),
        LoRA(rank=2, target_modules=["key", "value"]),
    ],
    ids=["lora_xs", "lora"],
)
def test_batched_forward_equals_sequential_bert(adapter):
    model = FineTuneModel(tiny_bert(), adapter, latent_modules=["classifier"])
    batch = _bert_batch()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    values = _random_values(model, 4)
    with torch.no_grad():
        batched = model.batched_output(inputs, values)
        sequential = torch.stack(
            [model.output(inputs, {s: v[i] for s, v in values.items()}) for i in range(4)]
        )
    assert batched.shape == (4, 5, 2)
    torch.testing.assert_close(batched, sequential, rtol=1e-6, atol=1e-6)


def test_batched_forward_equals_sequential_mlp():
    model = FineTuneModel(
        mlp(6, 16, 16, 3), LoRAXS(rank=3, target_modules=["0", "2"]), latent_modules=["4"]
    )
    x = torch.randn(9, 6)
    values = _random_values(model, 5)
    with torch.no_grad():
        batched = model.batched_output(x, values)
        sequential = torch.stack(
            [model.output(x, {s: v[i] for s, v in values.items()}) for i in range(5)]
        )
    torch.testing.assert_close(batched, sequential, rtol=1e-6, atol=1e-6)


def test_peft_round_trip():
    peft = pytest.importorskip("peft")
    net = tiny_bert().eval()
    config = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["query", "value"], init_lora_weights=False
    )
    peft_model = peft.get_peft_model(net, config)
    batch = _bert_batch()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        reference = peft_model(**inputs).logits.clone()
    model = FineTuneModel(peft_model)
    assert isinstance(model.adapter, LoRA) and model.adapter.scaling == 2.0
    with torch.no_grad():
        ours = model.output(inputs, model.init_values())
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)  # trained LoRA weights kept
    values = {s: v + 0.1 for s, v in model.init_values().items()}
    exported = to_peft(model, values).eval()
    with torch.no_grad():
        expected = model.output(inputs, values)
        torch.testing.assert_close(exported(**inputs).logits, expected, rtol=1e-6, atol=1e-6)
        merged = merged_network(model, values)
        torch.testing.assert_close(merged(**inputs).logits, expected, rtol=1e-6, atol=1e-6)


def test_merged_lora_xs_network_and_gpt2_conv1d():
    model = FineTuneModel(tiny_gpt2(), LoRAXS(rank=4, target_modules=["c_attn"]))
    ids = torch.randint(1, 99, (2, 5))
    values = {s: 0.5 * torch.randn(4, 4) for s in model.latent_sites}
    with torch.no_grad():
        expected = model.output({"input_ids": ids}, values)
        merged = merged_network(model, values)(input_ids=ids).logits
    torch.testing.assert_close(merged, expected, rtol=1e-6, atol=1e-6)
    assert not any("LoRA" in type(m).__name__ for m in merged_network(model, values).modules())


def test_multiple_choice_likelihood_on_llama():
    net = tiny_llama().eval()
    model = FineTuneModel(
        net,
        LoRAXS(rank=2, target_modules=["q_proj"]),
        likelihood="multiple_choice",
        choice_token_ids=[5, 6, 7, 8],
        trainable_modules=[],
    )
    ids = torch.randint(1, 99, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, 4:] = 0  # right padding: answer position is 3
    with torch.no_grad():
        logits = net(input_ids=ids, attention_mask=mask).logits
        params = model.output({"input_ids": ids, "attention_mask": mask}, model.init_values())
    assert params.shape == (3, 4)
    torch.testing.assert_close(params[1], logits[1, 3, [5, 6, 7, 8]], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(params[0], logits[0, 5, [5, 6, 7, 8]], rtol=1e-4, atol=1e-6)


def test_frozen_weights_never_in_param_store_and_unchanged_by_fit():
    torch.manual_seed(0)
    model = FineTuneModel(
        tiny_bert(), LoRAXS(rank=2, target_modules=["query", "value"]), num_data=10
    )
    frozen_before = {
        n: p.detach().clone()
        for n, p in model.net.named_parameters()
        if not n.startswith("classifier")
    }
    batch = _bert_batch()
    guide = pb.posterior(model, "meanfield")
    result = pb.fit(model, guide, [batch, batch], optim=pb.Optimization(num_steps=20), lr=0.05)
    import pyro

    # run through Pyro too: the param store then holds only guide params and the head
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), pyro.infer.Trace_ELBO())
    svi.step(batch)
    store = set(pyro.get_param_store().keys())
    # each instance keys its parameters by a name of its own (never shared with another guide)
    assert store == {f"{model._pyro_name}.classifier.{p}" for p in ("weight", "bias")} | {
        f"{guide._pyro_name}.{kind}.{s}" for s in model.latent_sites for kind in ("locs", "scales")
    }
    assert guide._pyro_name.startswith("MeanFieldGuide_")
    for n, p in model.net.named_parameters():
        if n in frozen_before:
            assert torch.equal(p, frozen_before[n]), n
    losses = result.losses
    assert torch.isfinite(losses).all()
    assert losses[-5:].mean() < losses[:5].mean()


def test_lora_config_is_accepted_as_adapter():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, lora_alpha=8, target_modules=["query"])
    model = FineTuneModel(tiny_bert(), config)
    assert isinstance(model.adapter, LoRA) and model.adapter.scaling == 4.0
    assert [s for s in model.latent_sites if s.endswith("lora_B")] == [
        f"bert.encoder.layer.{i}.attention.self.query.lora_B" for i in range(2)
    ]


@pytest.mark.parametrize(
    "option",
    [
        {"use_rslora": True},
        {"use_dora": True},
        {"rank_pattern": {"value": 1}},
        {"alpha_pattern": {"value": 32}},
    ],
    ids=lambda o: next(iter(o)),
)
def test_peft_settings_without_a_counterpart_are_refused_not_dropped(option):
    # each changes the adapted function (rsLoRA's alpha/sqrt(r), DoRA's magnitudes, per-module
    # rank or scaling): imported as plain LoRA the logits moved by up to 7e-3 with no word
    peft = pytest.importorskip("peft")
    name = next(iter(option))
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"], **option)
    with pytest.raises(ValueError, match=rf"LoRA.from_peft: the LoraConfig sets {name}="):
        FineTuneModel(tiny_bert(), config)
    with pytest.raises(ValueError, match=rf"sets {name}="):
        FineTuneModel(peft.get_peft_model(tiny_bert(), config))


@pytest.mark.parametrize(
    "scope",
    [
        {"layers_to_transform": [0]},
        {"exclude_modules": ["bert.encoder.layer.1.attention.self.value"]},
    ],
    ids=lambda o: next(iter(o)),
)
def test_a_peft_model_keeps_exactly_the_modules_peft_adapted(scope):
    # peft's layers_to_transform / exclude_modules narrow its targets; target_modules alone
    # adapted every query and value (a posterior over modules the user had excluded)
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["query", "value"], init_lora_weights=False, **scope
    )
    peft_model = peft.get_peft_model(tiny_bert().eval(), config)
    adapted = sorted(
        n.removeprefix("base_model.model.")
        for n, m in peft_model.named_modules()
        if isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict)
    )
    inputs = {k: v for k, v in _bert_batch().items() if k != "labels"}
    with torch.no_grad():
        reference = peft_model(**inputs).logits.clone()
    model = FineTuneModel(peft_model)
    assert sorted({s.module_path for s in model.latent_sites.values()}) == adapted
    assert len(adapted) in (2, 3)
    with torch.no_grad():
        torch.testing.assert_close(model.output(inputs, model.init_values()), reference)
    # the same scope in a bare LoraConfig cannot be resolved without the model: refused
    with pytest.raises(ValueError, match=rf"sets {next(iter(scope))}="):
        FineTuneModel(tiny_bert(), config)


def test_an_explicit_adapter_on_a_peft_model_may_only_change_the_latent_factors():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"])
    for other in (
        LoRA(rank=4, alpha=8, target_modules=["query", "value"]),  # another rank
        LoRA(rank=2, alpha=4, target_modules=["query"]),  # other modules
        LoRAXS(rank=2, target_modules=["query", "value"]),
    ):
        with pytest.raises(ValueError, match=r"net is a peft LoRA model \(r=2, alpha=4"):
            FineTuneModel(peft.get_peft_model(tiny_bert(), config), other)
    same = LoRA(rank=2, alpha=4, target_modules=["query", "value"], latent="A")
    model = FineTuneModel(peft.get_peft_model(tiny_bert(), config), same)
    assert model.adapter.latent == "A" and all(s.endswith("lora_A") for s in model.latent_sites)


@pytest.mark.parametrize("projection", ["svd", "random"])
def test_full_rank_lora_xs_reconstructs_float64_weights(projection):
    # with r = min(d_in, d_out) the frozen bases span W0 exactly (SPECS 2(d) 1): A B = W0. The
    # projection runs in float64, so a float64 model must get its bases to float64 round-off
    # (1e-12), not float32's (~1e-7: the error when the weight was cast to float32 first)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 6, dtype=torch.float64))
    w0 = net[0].weight.detach().clone()
    model = FineTuneModel(
        net, LoRAXS(rank=6, projection=projection, target_modules=["0"]), num_data=10
    )
    layer = model.net[0]
    assert layer.down.dtype == torch.float64
    # row convention W0 (d_in, d_out) ≈ A B with A = downᵀ, B = upᵀ; torch weight = (A B)ᵀ
    recon = (layer.down.T @ layer.up.T).T
    torch.testing.assert_close(recon, w0, rtol=0, atol=1e-12)


def test_lora_latent_a_makes_every_b_a_point_parameter():
    """``LoRA(latent="A")``: the A factors are the latent sites; every B is a point parameter
    (trained in place like the head), and the refusals name the option."""
    model = FineTuneModel(tiny_bert(), LoRA(rank=3, target_modules=["query"], latent="A"))
    paths = [f"bert.encoder.layer.{i}.attention.self.query" for i in range(2)]
    assert list(model.latent_sites) == [f"{p}.lora_A" for p in paths]
    assert set(model.point_params) == {"classifier.weight", "classifier.bias"} | {
        f"{p}.lora_B.weight" for p in paths
    }
    trainable = {n for n, p in model.net.named_parameters() if p.requires_grad}
    assert trainable == set(model.point_params)
    # the saved config says it; the default "AB" is left out, so files from before still match
    assert model.adapter.to_dict()["latent"] == "A"
    assert "latent" not in LoRA(rank=3).to_dict()
    assert pb.models.adapters.adapter_from_dict(model.adapter.to_dict()) == model.adapter
    with pytest.raises(ValueError, match="latent must be 'AB'"):
        LoRA(rank=2, latent="B")
    with pytest.raises(ValueError, match=r"only its A latent \(LoRA\(latent='A'\)"):
        pb.posterior(model, "symmetrized")


def test_lora_latent_a_fit_trains_b_in_place_and_saves_it(tmp_path):
    """A MAP fit moves the A sites and the B point parameters; ``pb.save`` / ``pb.load`` carry
    both, so a fresh model predicts the same; a file of an ``"A"`` model does not load into a
    model whose B factors are latent."""
    torch.manual_seed(0)
    x, y = torch.randn(40, 6), torch.randint(0, 3, (40,))
    loader = [(x[i : i + 20], y[i : i + 20]) for i in (0, 20)]

    def build(latent: str) -> FineTuneModel:
        torch.manual_seed(1)
        return FineTuneModel(
            mlp(6, 16, 3), LoRA(rank=2, target_modules=["0"], latent=latent), num_data=40
        )

    model = build("A")
    b_before = model.point_params["0.lora_B.weight"].detach().clone()
    assert not b_before.abs().sum()  # peft's init: B = 0, the pretrained function
    guide = pb.posterior(model, "map")
    pb.fit(model, guide, loader, epochs=5, lr=0.05, progress=False)
    assert model.point_params["0.lora_B.weight"].abs().min() > 0  # every entry moved
    a_fit = guide.mean()["0.lora_A"]
    assert not torch.equal(a_fit, model.init_values()["0.lora_A"])
    pred = pb.predict(model, guide, [x], num_samples=1).probs
    pb.save(guide, tmp_path / "a.safetensors", model=model)
    fresh = build("A")
    loaded = pb.load(tmp_path / "a.safetensors", fresh)
    torch.testing.assert_close(pb.predict(fresh, loaded, [x], num_samples=1).probs, pred)
    with pytest.raises(pb.io.PosteriorMismatchError):
        pb.load(tmp_path / "a.safetensors", build("AB"))


def test_make_latent_refuses_a_point_lora_factor() -> None:
    """LoRA(latent="A")'s point B factors are the adapter's choice, not a head to make latent."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    model = FineTuneModel(
        net, LoRA(rank=2, target_modules=["0"], latent="A"), num_data=10, trainable_modules=["2"]
    )
    assert "0.lora_B.weight" in model.point_params
    assert model.head_modules() == ["2"]  # the point B factors are the adapter's, not a head
    with pytest.raises(ValueError, match=r"'0\.lora_B' is not a point-estimated.*'2'"):
        model.make_latent(["0.lora_B"])
    assert model.make_latent(["2"]) == ["2.weight", "2.bias"]
    assert set(model.point_params) == {"0.lora_B.weight"}
    assert model.head_modules() == []


def test_head_modules_leave_out_a_learned_noise() -> None:
    """A learned Gaussian noise is a point parameter outside the network: not a head module
    (to_peft saves the head modules with the adapter; the demo makes them latent)."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    model = FineTuneModel(
        net,
        LoRA(rank=2, target_modules=["0"]),
        num_data=10,
        likelihood="gaussian",
        obs_scale="learn",
        trainable_modules=["2"],
    )
    assert "likelihood.raw_scale" in model.point_params
    assert model.head_modules() == ["2"]


def _enable_checkpointing(net: torch.nn.Module) -> None:
    """Hugging Face's activation (gradient) checkpointing, by whichever name this version has."""
    enable = (
        getattr(net, "activation_checkpointing_enable", None) or net.gradient_checkpointing_enable
    )
    enable()


def test_gradient_checkpointing_under_a_training_backbone_is_refused():
    # the checkpointed forward re-ran after the sampled adapter weights were put back: with
    # use_reentrant the LoRA B factors never left 0 (no error), without it torch's checkpoint
    # failed on "a different number of tensors saved"
    torch.manual_seed(0)
    net = tiny_bert()
    _enable_checkpointing(net)
    with pytest.raises(
        ValueError, match=r"gradient checkpointing on \(bert.*gradient_checkpointing_disable"
    ):
        FineTuneModel(net, LoRA(rank=2, target_modules=["query"]), train_backbone_mode=True)
    # in eval mode (the default) Hugging Face models do not checkpoint: allowed
    FineTuneModel(net, LoRA(rank=2, target_modules=["query"]), num_data=4)
    # switched on after the model was built: refused when the fit puts the backbone in training
    clean = tiny_bert()
    model = FineTuneModel(
        clean, LoRA(rank=2, target_modules=["query"]), train_backbone_mode=True, num_data=4
    )
    _enable_checkpointing(model.net)
    guide = pb.posterior(model, "map")
    with pytest.raises(ValueError, match=r"gradient checkpointing on"):
        pb.fit(model, guide, [_bert_batch()], epochs=1)
