"""Networks as users hand them over: compiled, data-parallel, peft-wrapped, gradient
checkpointed with dropout on, in half precision, and with their own ``requires_grad`` flags.

``torch.compile``'s ``OptimizedModule`` and ``nn.DataParallel`` / ``DistributedDataParallel``
are taken apart by :class:`~pyrobayes.models.FineTuneModel`, with a warning: left wrapped, a
compiled network failed in K-FAC Laplace and in tracing a Hugging Face model, and a
``DataParallel`` one hid the Hugging Face config from the model's checks. The other cases
already worked; their tests guard the equality (or tolerance) measured against the plain
float32 network.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRA

transformers = pytest.importorskip("transformers")

VOCAB, CLASSES = 100, 3
COMPILE_WARNING = r"wrapped in OptimizedModule.*net\._orig_mod"
DP_WARNING = r"wrapped in DataParallel.*net\.module"


def _mlp(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    return net.to(dtype)


def _mlp_data(dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=gen)
    y = (x @ torch.randn(4, 3, generator=gen)).argmax(-1)
    return [(x[i : i + 16].to(dtype), y[i : i + 16]) for i in range(0, 64, 16)]


def _bert() -> Any:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, num_labels=CLASSES,
        initializer_range=0.2,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config).float()


def _llama(**config: Any) -> Any:
    torch.manual_seed(0)
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
        num_labels=CLASSES, pad_token_id=0,
    )  # fmt: skip
    settings.update(config)
    return transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**settings)).float()


def _token_data(pad_id: int = 0) -> list[dict[str, torch.Tensor]]:
    """4 batches of 8 rows of 8 tokens; every third row right-padded (with ``pad_id``)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (32, 8), generator=gen)
    mask = torch.ones_like(ids)
    mask[::3, 6:] = 0
    ids[mask == 0] = pad_id
    labels = torch.randint(0, CLASSES, (32,), generator=gen)
    return [
        {
            "input_ids": ids[i : i + 8],
            "attention_mask": mask[i : i + 8],
            "labels": labels[i : i + 8],
        }
        for i in range(0, 32, 8)
    ]


def _fit(
    model: FineTuneModel, family: str, data: list[Any], **options: Any
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """``(guide, losses, predictive probabilities)`` of a 2-epoch fit and a 4-draw prediction."""
    guide = pb.posterior(model, family)
    result = pb.fit(model, guide, data, epochs=2, seed=0, progress=False, **options)
    return guide, result.losses, pb.predict(model, guide, data, num_samples=4, seed=0).probs


def _mlp_model(net: nn.Module, **kwargs: Any) -> FineTuneModel:
    return FineTuneModel(
        net, LoRA(rank=2, target_modules=["2"]), num_data=64, trainable_modules=["4"], **kwargs
    )


# ----------------------------------------------------------------------------- torch.compile
def test_a_compiled_network_fits_laplace_as_the_plain_one_and_its_posterior_loads_into_it(
    tmp_path,
):
    """A compiled network failed K-FAC Laplace with ``KeyError: 'model.net._orig_mod.2.lora_A'``
    (the curvature's hooks, registered after compiling, were never run). Unwrapped, the fit is
    the plain network's: the same float32 operations in the same order, so the losses and
    predictions are bitwise equal (measured 0.0), and the names carry no ``_orig_mod``."""
    data = _mlp_data()
    plain = _mlp_model(_mlp())
    _, losses, probs = _fit(plain, "laplace", data)
    with pytest.warns(UserWarning, match=COMPILE_WARNING):
        model = _mlp_model(torch.compile(_mlp(), backend="eager"))
    guide, c_losses, c_probs = _fit(model, "laplace", data)
    assert list(model.point_params) == ["4.weight", "4.bias"]
    assert torch.equal(c_losses, losses) and torch.equal(c_probs, probs)
    pb.save(guide, tmp_path / "laplace.safetensors")
    loaded = pb.load(tmp_path / "laplace.safetensors", plain)
    assert torch.equal(pb.predict(plain, loaded, data, num_samples=4, seed=0).probs, c_probs)


def test_a_compiled_hugging_face_model_fits_as_the_plain_one():
    """A compiled BERT failed in tracing (dynamo's "UnspecializedNNModuleVariable(...) is already
    tracked for mutation"); unwrapped, its MAP fit is the plain one's, bitwise (measured 0.0)."""
    data = _token_data()
    _, losses, probs = _fit(FineTuneModel(_bert(), LoRA(rank=2), num_data=32), "map", data)
    with pytest.warns(UserWarning, match=COMPILE_WARNING):
        model = FineTuneModel(torch.compile(_bert(), backend="eager"), LoRA(rank=2), num_data=32)
    _, c_losses, c_probs = _fit(model, "map", data)
    assert torch.equal(c_losses, losses) and torch.equal(c_probs, probs)


# ----------------------------------------------------------------------- data parallelism
def test_data_parallel_no_longer_hides_the_hugging_face_config_from_the_checks():
    """Wrapped in ``nn.DataParallel``, a LLaMA classifier whose batches are padded with another
    id than its pad token was fitted in silence (each padded row scored at its padding), and a
    regression head was accepted under the categorical likelihood; unwrapped, both are refused
    as they are for the plain network."""
    with pytest.warns(UserWarning, match=DP_WARNING):
        model = FineTuneModel(nn.DataParallel(_llama()), LoRA(rank=2), num_data=32)
    with pytest.raises(ValueError, match="pad_token_id"):
        pb.fit(model, pb.posterior(model, "map"), _token_data(pad_id=7), epochs=1, progress=False)
    regression = _llama(problem_type="regression")
    with (
        pytest.warns(UserWarning, match=DP_WARNING),
        pytest.raises(ValueError, match="problem_type is 'regression'"),
    ):
        FineTuneModel(nn.DataParallel(regression), LoRA(rank=2), num_data=32)


def test_a_plain_networks_posterior_loads_into_a_model_built_on_its_data_parallel_wrapper(
    tmp_path,
):
    """The names were prefixed with ``module.`` (``module.classifier.weight``), so a posterior
    saved from the plain network did not load into the wrapped one's model; unwrapped, it loads
    and predicts bitwise as on the plain network (the same float32 forward)."""
    data = _token_data()
    plain = FineTuneModel(_bert(), LoRA(rank=2), num_data=32)
    guide, _, probs = _fit(plain, "meanfield", data)
    pb.save(guide, tmp_path / "q.safetensors")
    with pytest.warns(UserWarning, match=DP_WARNING):
        wrapped = FineTuneModel(nn.DataParallel(_bert()), LoRA(rank=2), num_data=32)
    assert list(wrapped.point_params) == ["classifier.weight", "classifier.bias"]
    loaded = pb.load(tmp_path / "q.safetensors", wrapped)
    assert torch.equal(pb.predict(wrapped, loaded, data, num_samples=4, seed=0).probs, probs)


def test_distributed_and_nested_wrappers_are_taken_apart_one_warning_each(tmp_path):
    """``DistributedDataParallel`` (a gloo group of one process here) and a compiled
    ``DataParallel``: the model runs the innermost network, and each wrapper is named."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        net = _mlp()
        with pytest.warns(UserWarning, match=r"wrapped in DistributedDataParallel.*net\.module"):
            model = _mlp_model(nn.parallel.DistributedDataParallel(net))
    finally:
        dist.destroy_process_group()
    assert model.net is net
    net = _mlp()
    with pytest.warns(UserWarning) as record:
        model = _mlp_model(torch.compile(nn.DataParallel(net), backend="eager"))
    assert model.net is net
    wrappers = [str(w.message).split(";")[0].rpartition(" ")[2] for w in record]
    assert wrappers == ["OptimizedModule", "DataParallel"]


# ------------------------------------------------------------------------------------ peft
@pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")
def test_a_peft_model_given_directly_fits_as_its_base_with_the_same_lora_weights():
    """A ``peft.get_peft_model`` LLaMA passed as the network (not through ``LoRA.from_peft``)
    gives the fit of its base network with ``LoRA.from_peft(config)`` and peft's LoRA weights
    copied in: the same sites, head and float32 operations, bitwise (measured 0.0)."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
        init_lora_weights="gaussian", task_type="SEQ_CLS",
    )  # fmt: skip
    base = _llama()
    wrapped = peft.get_peft_model(copy.deepcopy(base), copy.deepcopy(config))
    weights = {
        n.replace("base_model.model.", "").replace(".default", ""): p.detach().clone()
        for n, p in wrapped.named_parameters()
        if "lora_" in n
    }
    direct = FineTuneModel(wrapped, num_data=32)
    routed = FineTuneModel(base, LoRA.from_peft(config), num_data=32)
    state = routed.net.state_dict()
    for name, value in weights.items():
        state[name].copy_(value)
    assert sorted(direct.latent_sites) == sorted(routed.latent_sites)
    assert list(direct.point_params) == list(routed.point_params) == ["score.weight"]
    data = _token_data()
    _, losses, probs = _fit(direct, "meanfield", data)
    _, r_losses, r_probs = _fit(routed, "meanfield", data)
    assert torch.equal(losses, r_losses) and torch.equal(probs, r_probs)


# ------------------------------------------------------------ checkpointing, train mode, flags
def _changed(before: dict[str, torch.Tensor], model: FineTuneModel) -> list[str]:
    """The entries of the network's state dict (as built) whose values the fit changed."""
    after = {k.replace(".base.", "."): v for k, v in model.net.state_dict().items()}
    return sorted(k for k, v in before.items() if not torch.equal(v, after[k]))


@pytest.mark.parametrize("family", ["meanfield", "swag"])
def test_gradient_checkpointing_and_train_mode_left_on_fit_as_the_eval_network(family):
    """A BERT with gradient checkpointing on and ``net.train()`` (dropout 0.1 active) is put in
    eval mode by the model (``train_backbone_mode=False``), where Hugging Face neither drops
    nor checkpoints: the fit is the plain network's, bitwise (measured 0.0)."""
    data = _token_data()
    _, losses, probs = _fit(FineTuneModel(_bert(), LoRA(rank=2), num_data=32), family, data)
    net = _bert()
    enable = getattr(net, "activation_checkpointing_enable", None)
    (enable or net.gradient_checkpointing_enable)()
    net.train()
    model = FineTuneModel(net, LoRA(rank=2), num_data=32)
    assert not net.training
    _, c_losses, c_probs = _fit(model, family, data)
    assert torch.equal(c_losses, losses) and torch.equal(c_probs, probs)


@pytest.mark.parametrize("flag", [False, True])
def test_the_users_requires_grad_flags_change_nothing_and_the_backbone_stays_bit_identical(flag):
    """Whether the user froze every parameter (``requires_grad=False``) or left them all
    trainable, ``trainable_modules="auto"`` trains the head only: it alone requires a gradient,
    the optimizer holds it and the guide's parameters, and every other tensor of the network
    is bitwise unchanged by the fit."""
    net = _bert()
    for p in net.parameters():
        p.requires_grad_(flag)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    model = FineTuneModel(net, LoRA(rank=2), num_data=32)
    assert list(model.point_params) == ["classifier.weight", "classifier.bias"]
    assert sorted(n for n, p in net.named_parameters() if p.requires_grad) == [
        "classifier.bias",
        "classifier.weight",
    ]
    data = _token_data()
    guide = pb.posterior(model, "map")
    fitter = pb.infer.make_fitter(model, guide)
    fitter.begin(data)
    for batch in data:
        fitter.step(batch)
    fitter.end(data)
    optimized = {id(p) for group in fitter.optimizer.param_groups for p in group["params"]}
    expected = {id(p) for p in model.point_params.values()}
    expected |= {id(p) for p in guide.parameters()}
    assert optimized == expected
    assert _changed(before, model) == ["classifier.bias", "classifier.weight"]


# ------------------------------------------------------------------------- half precision
@pytest.mark.parametrize(
    ("family", "dtype"),
    [("meanfield", torch.bfloat16), ("laplace", torch.bfloat16), ("ivon", torch.float16)],
)
def test_a_half_precision_network_fits_close_to_its_float32_self(family, dtype):
    """A bfloat16 (float16 under IVON, which keeps its state in float32) network and batches:
    finite losses within 1% of the float32 fit's and predictive probabilities within 0.02.

    Measured: losses within 0.16% (bfloat16) / 0.013% (float16), probabilities within 3.6e-3 /
    2.3e-4. bfloat16 rounds each operation to 2⁻⁸ ≈ 3.9e-3 relative, a few such errors pass
    through the 3 layers and the softmax, and two epochs of steps move the fitted values apart
    by as much again: 0.02 is five such roundings at probability scale, 1% of the loss ~2.5."""
    data = _mlp_data()
    _, losses, probs = _fit(_mlp_model(_mlp()), family, data)
    _, h_losses, h_probs = _fit(_mlp_model(_mlp(dtype)), family, _mlp_data(dtype))
    assert bool(torch.isfinite(h_losses).all())
    assert ((h_losses.float() - losses) / losses.abs()).abs().max() < 0.01
    assert (h_probs.float() - probs).abs().max() < 0.02


def test_a_float16_network_under_adam_trains_its_head_through_float32_masters():
    """Adam's eps = 1e-8 rounds to 0 in float16 (a NaN first step in place): the fit steps
    float32 masters of the float16 head and the guide's float32 locations, so it trains."""
    model = _mlp_model(_mlp(torch.float16))
    result = pb.fit(
        model, pb.posterior(model, "map"), _mlp_data(torch.float16), epochs=1, progress=False
    )
    assert bool(torch.isfinite(result.losses).all())
