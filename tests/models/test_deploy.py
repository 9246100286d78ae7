"""Deployment: a merged network saved with ``save_pretrained`` reloads in plain transformers with
no unexpected keys and reproduces the adapted network's logits; ``to_peft`` round-trips LoRA."""

from __future__ import annotations

import pytest
import torch

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRA, LoRAXS
from tests.common import tiny_llama

ADAPTERS = {
    "lora-xs": lambda: LoRAXS(rank=2, target_modules=["q_proj", "v_proj"]),
    "lora": lambda: LoRA(rank=2, target_modules=["q_proj", "v_proj"]),
    # A latent, every B a point parameter of the model (set to random values below)
    "lora-a": lambda: LoRA(rank=2, target_modules=["q_proj", "v_proj"], latent="A"),
}


def _model_and_values(adapter_name):
    torch.manual_seed(0)
    model = FineTuneModel(
        tiny_llama().eval(),
        ADAPTERS[adapter_name](),
        likelihood="multiple_choice",
        trainable_modules=[],
    )
    values = {s: 0.5 * torch.randn(v.shape) for s, v in model.init_values().items()}
    with torch.no_grad():
        for p in model.point_params.values():  # LoRA(latent="A"): B, zero at init
            p.copy_(0.5 * torch.randn(p.shape))
    return model, values


def _adapted_logits(model, values, ids):
    """``f(x; θ)`` of the network with its pyrobayes layers, every position."""
    params = {model.latent_sites[s].param_name: v for s, v in values.items()}
    out = torch.func.functional_call(model.net, params, args=(), kwargs={"input_ids": ids})
    return out.logits


def test_public():
    assert pb.models.merged_network is pb.models.deploy.merged_network
    assert pb.models.to_peft is pb.models.deploy.to_peft
    assert {"merged_network", "to_peft"} <= set(pb.models.__all__)


@pytest.mark.parametrize("adapter_name", sorted(ADAPTERS))
def test_merged_network_reloads_without_unexpected_keys(adapter_name, tmp_path):
    from transformers import AutoModelForCausalLM

    model, values = _model_and_values(adapter_name)
    merged = pb.models.merged_network(model, values)
    names = [n for n, _ in merged.named_modules()]
    assert not any(n.endswith((".core", ".lora_A", ".lora_B")) for n in names)
    merged.save_pretrained(tmp_path)
    reloaded, info = AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True, dtype=torch.float64
    )
    assert not info["unexpected_keys"]
    assert not info["missing_keys"]
    assert not info["mismatched_keys"]
    ids = torch.randint(1, 99, (3, 7))
    with torch.no_grad():
        expected = _adapted_logits(model, values, ids)
        got = reloaded.eval()(input_ids=ids).logits
    assert not torch.allclose(expected, tiny_llama_logits(model, ids))  # the adapter matters
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def tiny_llama_logits(model, ids):
    """Logits of the base network (the adapter removed, nothing merged)."""
    with torch.no_grad():
        return pb.models.deploy.unwrapped_network(model).eval()(input_ids=ids).logits


@pytest.mark.parametrize("adapter_name", ["lora", "lora-a"])
def test_to_peft_round_trip(adapter_name, tmp_path):
    from peft import PeftModel

    model, values = _model_and_values(adapter_name)
    peft_model = pb.models.to_peft(model, values)
    peft_model.save_pretrained(tmp_path)
    base = pb.models.deploy.unwrapped_network(model)
    reloaded = PeftModel.from_pretrained(base, tmp_path).eval()
    ids = torch.randint(1, 99, (2, 6))
    with torch.no_grad():
        expected = _adapted_logits(model, values, ids)
        got = reloaded(input_ids=ids).logits
    assert not torch.allclose(expected, tiny_llama_logits(model, ids))  # the adapter matters
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("head", ["point", "latent"])
def test_to_peft_carries_the_task_head(head, tmp_path):
    """A sequence classifier's head trained beside LoRA (a point parameter, or made latent post
    hoc with the draw's values) is saved with the adapter (peft's ``modules_to_save``), so
    loading onto a *freshly initialised* pretrained network, as a user does, restores it."""
    from peft import PeftModel

    from tests.common import tiny_bert

    torch.manual_seed(0)
    model = FineTuneModel(
        tiny_bert(num_labels=3).eval(), LoRA(rank=2, target_modules=["query", "value"])
    )
    with torch.no_grad():
        for p in model.point_params.values():
            p.copy_(torch.randn(p.shape))  # a "trained" head
    # the pretrained body with a freshly initialised head, as loading the checkpoint gives
    fresh = pb.models.deploy.unwrapped_network(model).eval()
    fresh.classifier.reset_parameters()
    assert not torch.equal(fresh.classifier.weight, model.point_params["classifier.weight"])
    if head == "latent":
        model.make_latent(["classifier"])
    values = {s: 0.5 * torch.randn(v.shape) for s, v in model.init_values().items()}
    peft_model = pb.models.to_peft(model, values)
    peft_model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(fresh, tmp_path).eval()
    ids = torch.randint(1, 99, (2, 6))
    params = {model.latent_sites[s].param_name: v for s, v in values.items()}
    with torch.no_grad():
        expected = torch.func.functional_call(
            model.net, params, args=(), kwargs={"input_ids": ids}
        ).logits
        got = reloaded(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_deploying_refuses_draws_and_unknown_sites_by_name():
    # S draws (guide.sample_posterior(S)) instead of one parameter set failed inside torch
    # ("output with shape [32, 32] doesn't match the broadcast shape [4, 32, 32]")
    from pyrobayes.models.deploy import merged_network

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    model = pb.models.FineTuneModel(
        net, pb.models.LoRA(rank=2, target_modules=["0"]), num_data=8, trainable_modules=["2"]
    )
    draws = pb.posterior(model, "meanfield").sample_posterior(4)
    with pytest.raises(ValueError, match=r"these are 4 draws; pass one"):
        merged_network(model, draws)
    with pytest.raises(KeyError, match="no site"):
        merged_network(model, {"nope": torch.zeros(2)})
    one = {s: v[0] for s, v in draws.items()}
    x = torch.randn(5, 4)
    torch.testing.assert_close(merged_network(model, one)(x), model.output(x, one))


def test_lora_xs_takes_float32_values_on_a_bfloat16_network_as_lora_does():
    # the core's values in float32 on a bf16 network raised a dtype mismatch in the core's
    # matmul (LoRA casts its factors); now computed in the values' dtype and cast back
    from pyrobayes.models.deploy import merged_network

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    model = pb.models.FineTuneModel(
        net.bfloat16(), LoRAXS(rank=2, target_modules=["0"]), num_data=8, trainable_modules=["2"]
    )
    values = {s: 0.3 * torch.randn(v.shape) for s, v in model.init_values().items()}  # float32
    x = torch.randn(5, 4).bfloat16()
    out = model.output(x, values)
    assert out.dtype == torch.bfloat16
    low = {s: v.bfloat16() for s, v in values.items()}
    # the same values rounded to bf16 first: equal up to bf16 rounding of outputs near 1 (2^-8)
    torch.testing.assert_close(out.float(), model.output(x, low).float(), rtol=0, atol=2e-2)
    torch.testing.assert_close(
        merged_network(model, values)(x).float(), out.float(), rtol=0, atol=2e-2
    )


def _fitted_lora_map():
    """A small LoRA classifier and its MAP guide after a few steps (lora_B away from 0)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    model = pb.models.FineTuneModel(
        net, LoRA(rank=2, target_modules=["0"]), num_data=40, trainable_modules=["2"]
    )
    x = torch.randn(40, 4)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    guide = pb.posterior(model, "map")
    pb.fit(model, guide, [(x[:20], y[:20]), (x[20:], y[20:])], epochs=3, lr=0.05, progress=False)
    return model, guide, x


def test_deploying_needs_the_values_the_network_never_holds_after_a_fit():
    # a fit keeps its values in the guide: merged_network(model) and to_peft(model) merged the
    # adapter's initialisation (to_peft wrote lora_B = 0, a no-op adapter) without a word
    from pyrobayes.models.deploy import merged_network, to_peft

    model, guide, x = _fitted_lora_map()
    fitted = guide.mean()
    assert float(fitted["0.lora_B"].abs().max()) > 1e-3  # the fit moved B away from 0
    for deploy in (merged_network, to_peft):
        for missing in ((), (None,), ({},)):
            with pytest.raises(
                ValueError,
                match=rf"{deploy.__name__}: pass the parameter values.*"
                r"values=guide\.mean\(\).*values=model\.init_values\(\)",
            ):
                deploy(model, *missing)
    # the guide itself stands for its posterior mean
    with torch.no_grad():
        torch.testing.assert_close(merged_network(model, guide)(x), model.output(x, fitted))
        torch.testing.assert_close(
            merged_network(model, guide)(x), merged_network(model, fitted)(x), rtol=0, atol=0
        )
    peft_b = {k: v for k, v in to_peft(model, guide).state_dict().items() if "lora_B" in k}
    assert len(peft_b) == 1
    torch.testing.assert_close(next(iter(peft_b.values())), fitted["0.lora_B"], rtol=0, atol=0)
    # the stored values on purpose: the adapter's initialisation (B = 0: the base network)
    with torch.no_grad():
        base = merged_network(model, model.init_values())
        torch.testing.assert_close(base(x), model.output(x, model.init_values()))


def test_deploying_a_mixture_guide_asks_for_one_member():
    from pyrobayes.models.deploy import merged_network

    model, _, _ = _fitted_lora_map()
    particles = pb.posterior(model, "ibdr", num_particles=3)
    with pytest.raises(ValueError, match=r"mixture of 3 components.*deploy one member"):
        merged_network(model, particles)
    with pytest.raises(TypeError, match=r"values must be a dict .* or a fitted pyrobayes"):
        merged_network(model, [1, 2])


def test_deploying_refuses_values_missing_sites_by_name():
    # a subset of the sites was accepted: merged_network merged the network's initial values for
    # the others and to_peft left peft's random initialisation in them (B = 0.68, not 0)
    from pyrobayes.models.deploy import merged_network, to_peft

    model, guide, x = _fitted_lora_map()
    fitted = guide.mean()
    only_a = {s: v for s, v in fitted.items() if s.endswith("lora_A")}
    for deploy in (merged_network, to_peft):
        with pytest.raises(
            ValueError,
            match=rf"{deploy.__name__}: values has no value for the site\(s\) \['0\.lora_B'\].*"
            r"values=\{\*\*model\.init_values\(\), \*\*values\}",
        ):
            deploy(model, only_a)
    # the initial values on purpose, as the message says: B = 0, the base layer
    both = {**model.init_values(), **only_a}
    torch.testing.assert_close(merged_network(model, both)(x), model.output(x, both))
    peft_b = {k: v for k, v in to_peft(model, both).state_dict().items() if "lora_B" in k}
    assert all(float(v.abs().max()) == 0.0 for v in peft_b.values())


def test_deploying_a_guide_built_before_make_latent_names_the_new_sites():
    from pyrobayes.models.deploy import merged_network

    model, guide, _ = _fitted_lora_map()
    model.make_latent(["2"])
    with pytest.raises(
        ValueError,
        match=r"no value for the site\(s\) \['2\.weight', '2\.bias'\].*"
        r"values=\{\*\*model\.init_values\(\), \*\*guide\.mean\(\)\}",
    ):
        merged_network(model, guide)
    merged_network(model, {**model.init_values(), **guide.mean()})


def test_deploying_a_calibrated_guide_warns_that_its_outputs_are_untempered():
    # the guide's temperature T was dropped without a word: a network has no place for it
    import warnings

    from pyrobayes.calibration import set_temperature
    from pyrobayes.models.deploy import UntemperedDeployWarning, merged_network, to_peft

    model, guide, x = _fitted_lora_map()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # uncalibrated: nothing to say
        plain = merged_network(model, guide)(x)
    set_temperature(guide, 2.0)
    for deploy in (merged_network, to_peft):
        with pytest.warns(
            UntemperedDeployWarning,
            match=rf"{deploy.__name__}: DeltaGuide is calibrated \(temperature T = 2, .*"
            r"untempered.*divide the network's logits by T.*logits / 2",
        ) as caught:
            deploy(model, guide)
        assert caught[0].filename == __file__  # points at the caller's line
    # the network deployed is the uncalibrated one (dict values carry no T: no warning)
    torch.testing.assert_close(merged_network(model, guide.mean())(x), plain)


def test_init_values_are_copies_of_the_stored_values():
    # init_values() returned the network's own tensors: an in-place edit of "the copy" changed
    # the stored initial value, and every guide built after it started there
    model, _, _ = _fitted_lora_map()
    stored = {s: model.site_value(s).clone() for s in model.latent_sites}
    values = model.init_values()
    for v in values.values():
        v.add_(1.0)
    for s, v in stored.items():
        torch.testing.assert_close(model.site_value(s), v, rtol=0, atol=0)
        assert not model.init_values()[s].requires_grad
    start = pb.posterior(model, "map").mean()
    for s, v in stored.items():
        torch.testing.assert_close(start[s], v, rtol=0, atol=0)
