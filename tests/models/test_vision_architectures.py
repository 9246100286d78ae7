"""Image classifiers a user brings, built tiny from their configs (no downloads): Hugging Face's
ViT, DeiT, BEiT, DINOv2, Swin, ConvNeXt (pointwise convolutions as ``nn.Linear`` on
channels-last maps), SigLIP and CLIP ``*ForImageClassification`` on ``{"pixel_values", "labels"}``
batches, and torchvision's ``VisionTransformer``, ``SwinTransformer`` and ``resnet18`` built
without weights on ``(x, y)`` batches.

The draws of an adapter in the top block against the per-draw forwards and the unshared
forward (float64), a MAP and a mean-field fit with a prediction; and the layers the network
reads without calling them (torchvision Swin's ``qkv`` / ``proj``, ``nn.MultiheadAttention``'s
``out_proj``) and torchvision's zero-initialised head, which ``trainable_modules="auto"`` does
not find."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRAXS
from pyrobayes.models.sharing import unshared

transformers = pytest.importorskip("transformers")
torchvision = pytest.importorskip("torchvision")

#: the draws' predictions here come from a network as built, on purpose
pytestmark = pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")

CLASSES = 3
VIT = dict(
    image_size=32,
    patch_size=8,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    num_channels=3,
)


def _hf(arch: str) -> nn.Module:
    """A tiny ``*ForImageClassification`` of ``arch`` (2 layers or stages, width 32 or less)."""
    t = transformers
    if arch in ("siglip", "clip"):  # a vision tower of the dual encoder's config
        config_class, model_class = {
            "siglip": (t.SiglipConfig, t.SiglipForImageClassification),
            "clip": (t.CLIPConfig, t.CLIPForImageClassification),
        }[arch]
        text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=50)
        config = config_class(vision_config=VIT, text_config={**text, "intermediate_size": 64})
        config.num_labels = CLASSES
        return model_class(config)
    if arch == "swin":
        config = t.SwinConfig(
            image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 2],
            window_size=4, num_labels=CLASSES,
        )  # fmt: skip
        return t.SwinForImageClassification(config)
    if arch == "convnext":
        config = t.ConvNextConfig(
            image_size=32, patch_size=4, hidden_sizes=[16, 32], depths=[2, 2], num_stages=2,
            num_labels=CLASSES, layer_scale_init_value=1.0,  # 1e-6: the blocks barely act
        )  # fmt: skip
        return t.ConvNextForImageClassification(config)
    if arch == "dinov2":
        config = t.Dinov2Config(
            **{k: v for k, v in VIT.items() if k != "intermediate_size"},
            mlp_ratio=2,
            num_labels=CLASSES,
        )
        return t.Dinov2ForImageClassification(config)
    config_class, model_class = {
        "vit": (t.ViTConfig, t.ViTForImageClassification),
        "deit": (t.DeiTConfig, t.DeiTForImageClassification),
        "beit": (t.BeitConfig, t.BeitForImageClassification),
    }[arch]
    extra = {"layer_scale_init_value": 1.0} if arch == "beit" else {}  # 0.1: blocks act less
    return model_class(config_class(**VIT, num_labels=CLASSES, **extra))


def _torchvision(arch: str) -> nn.Module:
    """A torchvision classifier built without weights (tiny but for ResNet-18)."""
    models = torchvision.models
    if arch == "tv-vit":
        return models.VisionTransformer(
            image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
            num_classes=CLASSES,
        )  # fmt: skip
    if arch == "tv-swin":
        return models.swin_transformer.SwinTransformer(
            patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=[4, 4],
            num_classes=CLASSES,
        )  # fmt: skip
    return models.resnet18(num_classes=CLASSES)


#: arch -> (the adapted layers of the top block, the head trained beside them; latent layers)
ARCHS = {
    "vit": (r".*layers\.1\..*\.(q_proj|v_proj)", "auto", []),
    "deit": (r".*layers\.1\..*\.(q_proj|v_proj)", "auto", []),
    "beit": (r".*layers\.1\..*\.(q_proj|v_proj)", "auto", []),
    "dinov2": (r".*layer\.1\..*\.(q_proj|v_proj)", "auto", []),
    "swin": (r".*layers\.1\.blocks\.1\..*\.(q_proj|v_proj)", "auto", []),
    "convnext": (r".*stages\.1\.layers\.1\.(pwconv1|pwconv2)", "auto", []),
    "siglip": (r".*layers\.1\..*\.(q_proj|v_proj)", "auto", []),
    "clip": (r".*layers\.1\..*\.(q_proj|v_proj)", "auto", []),
    # torchvision: the MLP (the attention reads its projections' weights without calling them)
    "tv-vit": (r".*encoder_layer_1\.mlp\.(0|3)", ["heads"], []),
    "tv-swin": (r".*features\.3\.1\.mlp\.(0|3)", ["head"], []),
    "tv-resnet": (None, [], ["fc"]),  # its head alone, latent
}


def _model(arch: str, dtype: torch.dtype | None = None) -> FineTuneModel:
    """``arch`` with its adapter, head and latent layers (:data:`ARCHS`), in ``dtype`` (the
    default dtype when ``None``)."""
    torch.manual_seed(0)
    net = _torchvision(arch) if arch.startswith("tv-") else _hf(arch)
    net = net.to(dtype or torch.get_default_dtype()).eval()
    if arch == "tv-vit":  # torchvision's new head is zeros: drawn here, trained by the fits
        nn.init.normal_(net.heads.head.weight, std=0.3)
    targets, trainable, latent = ARCHS[arch]
    adapter = None if targets is None else LoRAXS(rank=2, target_modules=targets, init_scale=0.1)
    return FineTuneModel(
        net, adapter, num_data=8, trainable_modules=trainable, latent_modules=latent
    )


def _batch(arch: str, rows: int = 4, dtype: torch.dtype | None = None, seed: int = 0) -> object:
    """``rows`` random images with labels: a dict for Hugging Face, ``(x, y)`` for torchvision."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, 32, 32, generator=g, dtype=dtype or torch.get_default_dtype())
    y = torch.arange(rows) % CLASSES
    return (x, y) if arch.startswith("tv-") else {"pixel_values": x, "labels": y}


def _inputs(batch: object) -> object:
    return (batch[0],) if isinstance(batch, tuple) else {"pixel_values": batch["pixel_values"]}


def _draws(model: FineTuneModel, num: int, scale: float = 0.5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        site: model.site_value(site)
        + scale * torch.randn(num, *spec.shape, generator=g, dtype=model.dtype)
        for site, spec in model.latent_sites.items()
    }


@pytest.mark.parametrize("arch", list(ARCHS))
def test_an_image_classifier_applies_each_draw_to_its_rows_and_fits(arch) -> None:
    model = _model(arch, torch.float64)
    assert len(model.latent_sites) == 2  # two layers of the top block (or the head's W, b)
    values = _draws(model, 3)
    inputs = _inputs(_batch(arch, rows=2, dtype=torch.float64))
    with torch.no_grad():
        batched = model.batched_output(inputs, values)
        with unshared():
            plain = model.batched_output(inputs, values)
        each = torch.stack(
            [model.output(inputs, {k: v[s] for k, v in values.items()}) for s in range(3)]
        )
    # float64: one batched forward, its unshared self and 3 single ones differ by rounding
    # (measured <= 1e-15 on these networks); draws on the wrong rows are O(1e-2) or more
    torch.testing.assert_close(batched, each, rtol=0, atol=1e-10)
    torch.testing.assert_close(batched, plain, rtol=0, atol=1e-10)
    assert float((each[0] - each[1]).abs().max()) > 1e-3  # the draws reach the output

    data = [_batch(arch, seed=s) for s in range(2)]
    for family in ("map", "meanfield"):
        model = _model(arch)
        guide = pb.posterior(model, family)
        start = {s: v.clone() for s, v in guide.mean().items()}
        result = pb.fit(model, guide, data, epochs=1, seed=0)
        assert all(map(torch.isfinite, torch.as_tensor(result.losses).flatten()))
        moved = max(float((guide.mean()[s] - v).abs().max()) for s, v in start.items())
        assert moved > 0  # the sites got gradients through the network
        probs = pb.predict(model, guide, data[:1], num_samples=2).mean_probs
        assert probs.shape == (4, CLASSES)
        torch.testing.assert_close(probs.sum(-1), torch.ones_like(probs[:, 0]))


@pytest.mark.parametrize("target", ["qkv", "proj"])
def test_an_adapter_on_a_layer_the_network_reads_without_calling_is_refused(target) -> None:
    """torchvision's Swin attention passes ``qkv.weight`` and ``proj.weight`` to ``F.linear``
    and never calls the layers: an adapter there cannot act. Before, the fit's first forward
    failed with ``'LoRAXSLinear' object has no attribute 'weight'``, naming neither the layer
    nor what to do; now the model refuses it when it is built."""
    net = _torchvision("tv-swin")
    with pytest.raises(ValueError, match=rf"'features\.1\.0\.attn\.{target}'.*never calls"):
        FineTuneModel(net, LoRAXS(rank=2, target_modules=[target]), num_data=8)


class _ReadsWeight(nn.Module):
    """A hand-written block that reads its ``proj`` layer's weight instead of calling it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.proj.weight, self.proj.bias)


def test_a_network_that_reads_an_adapted_layer_itself_is_told_why_it_fails() -> None:
    """A network pyrobayes does not know to read a layer directly: torch's AttributeError at
    the forward, said in its terms (the adapted layers listed, what to do)."""
    model = FineTuneModel(
        nn.Sequential(_ReadsWeight()), LoRAXS(rank=2, target_modules=["proj"]), num_data=8
    )
    with pytest.raises(AttributeError, match=r"read the weight of an adapted layer.*'0\.proj'"):
        model.output((torch.randn(2, 4),), model.init_values())


@pytest.mark.parametrize(
    "arch, layer",
    [
        ("tv-vit", "encoder.layers.encoder_layer_1.self_attention.out_proj"),
        ("tv-swin", "features.3.1.attn.qkv"),
    ],
)
def test_a_latent_layer_the_network_reads_without_calling_is_refused(arch, layer) -> None:
    """``nn.MultiheadAttention`` reads ``out_proj.weight``, torchvision's Swin attention
    ``qkv.weight``: S draws there reach ``F.linear`` as ``(S, d_out, d_in)``. Before, that
    failed at a forward of S > 1 draws as torch's ``t() expects a tensor with <= 2
    dimensions``, naming no layer."""
    with pytest.raises(ValueError, match=rf"latent_modules: '{layer}'.*never calls"):
        FineTuneModel(
            _torchvision(arch), None, num_data=8, trainable_modules=[], latent_modules=[layer]
        )


def test_a_latent_layer_read_by_an_unknown_module_is_named_under_draws() -> None:
    """A module pyrobayes does not know to read its child's weight: one draw runs (the slot
    holds one matrix), S draws fail at the forward with the layer named."""
    torch.manual_seed(0)
    net = nn.Sequential(_ReadsWeight()).double()
    model = FineTuneModel(net, None, num_data=8, trainable_modules=[], latent_modules=["0.proj"])
    values = _draws(model, 3, scale=0.1)
    inputs = (torch.randn(2, 4, dtype=torch.float64),)
    with torch.no_grad():
        one = model.batched_output(inputs, {k: v[:1] for k, v in values.items()})
        alone = model.output(inputs, {k: v[0] for k, v in values.items()})
        with pytest.raises(RuntimeError, match=r"'0\.proj'.*latent_modules"):
            model.batched_output(inputs, values)
    torch.testing.assert_close(one[0], alone, rtol=0, atol=1e-12)  # one draw: the same forward


def test_torchvisions_zero_head_left_frozen_warns() -> None:
    """torchvision's ``VisionTransformer`` initialises ``heads.head`` to zeros, and
    ``trainable_modules="auto"`` finds no head by its names: left frozen, every prediction was
    uniform (1/3 each after a MAP fit, the loss flat) without a word. Trained, no warning."""
    torch.manual_seed(0)
    adapter = LoRAXS(rank=2, target_modules=r".*mlp\.(0|3)")
    with pytest.warns(UserWarning, match=r"'heads\.head'.*trainable_modules=\['heads\.head'\]"):
        model = FineTuneModel(_torchvision("tv-vit"), adapter, num_data=8)
    with torch.no_grad():
        out = model.batched_output(_inputs(_batch("tv-vit")), _draws(model, 2))
    assert float(out.abs().max()) == 0.0  # the bias (zeros) for every row and draw
    FineTuneModel(_torchvision("tv-vit"), adapter, num_data=8, trainable_modules=["heads"])
    FineTuneModel(_torchvision("tv-vit"), adapter, num_data=8, latent_modules=["heads.head"])


def test_sigma_norm_refuses_a_channels_first_norm_by_name() -> None:
    """ConvNeXt's downsampling norms normalise the channels of (B, C, H, W) maps; σN's member
    norm normalises the last axis. Before, the default ``norm_modules="all"`` failed inside
    torch (``permute(sparse_coo): number of dimensions ...``), naming no layer."""
    with pytest.raises(
        ValueError, match=r"SigmaNorm: the norm layer '.*' \(ConvNextLayerNorm\).*channels_first"
    ):
        FineTuneModel(_hf("convnext"), pb.models.SigmaNorm(num_members=2), num_data=8)
    layers = pb.models.SigmaNorm(num_members=2, norm_modules=r".*layers\.\d+\.layernorm")
    model = FineTuneModel(_hf("convnext"), layers, num_data=8)
    assert model.latent_sites
