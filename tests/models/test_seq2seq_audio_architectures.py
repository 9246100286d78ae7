"""Encoder-decoder and audio classifiers a user brings, built tiny from their configs: T5's,
BART's and mBART's sequence classifiers, a T5 encoder under a user's masked-mean head, and
Wav2Vec2's, HuBERT's and Whisper's audio classifiers.

Each is adapted at its encoder's top layer (the attention query and value projections named
explicitly), so the layers below are candidates for sharing across draws: the shared forward
must give the unshared one, or decline (an encoder-decoder's decoder and BART's EOS pooling read
the un-expanded ``input_ids`` above the cut; a pooled audio head reads the un-expanded mask).
Padded rows score as their unpadded selves, and a MAP and a mean-field fit learn and predict.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRAXS
from pyrobayes.models.finetune import task_head_modules
from pyrobayes.models.sharing import block_stack, unshared

transformers = pytest.importorskip("transformers")

#: the draws' predictions here come from a network as built, on purpose
pytestmark = pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")

VOCAB, CLASSES = 100, 3
#: text: (pad id, EOS id); BART-like pooling reads the last EOS of every row
TOKENS = {"t5": (0, 1), "t5-encoder": (0, 1), "bart": (1, 2), "mbart": (1, 2)}
AUDIO = ("wav2vec2", "hubert", "whisper")
#: the leaf names of the attention query / value projections
QUERY_VALUE = {"t5": ["q", "v"], "t5-encoder": ["q", "v"]}


class MeanPooled(nn.Module):
    """A user's classifier: a T5 encoder, the mean of its real positions, a linear head."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(32, CLASSES)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask)[0]
        weight = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * weight).sum(1) / weight.sum(1))


def _seq2seq(arch: str) -> nn.Module:
    t = transformers
    if arch in ("t5", "t5-encoder"):
        config = t.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
            num_labels=CLASSES, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
            initializer_factor=5.0,  # outputs that move with their inputs
        )  # fmt: skip
        if arch == "t5":
            return t.T5ForSequenceClassification(config)
        return MeanPooled(t.T5EncoderModel(config))
    config_class, model_class = {
        "bart": (t.BartConfig, t.BartForSequenceClassification),
        "mbart": (t.MBartConfig, t.MBartForSequenceClassification),
    }[arch]
    return model_class(
        config_class(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
            num_labels=CLASSES,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            init_std=0.2,
        )  # fmt: skip
    )


def _audio(arch: str, group_norm: bool = False) -> nn.Module:
    """A tiny audio classifier. ``group_norm``: wav2vec2-base's feature encoder (a GroupNorm
    over time in its first convolution, 2 convolutions), else one LayerNorm convolution (as
    wav2vec2-large-lv60's), whose padded rows equal their unpadded selves."""
    t = transformers
    if arch == "whisper":
        config = t.WhisperConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
            decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=16, num_labels=CLASSES,
            classifier_proj_size=16, init_std=0.2, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, decoder_start_token_id=1,
        )  # fmt: skip
        return t.WhisperForAudioClassification(config)
    config_class, model_class = {
        "wav2vec2": (t.Wav2Vec2Config, t.Wav2Vec2ForSequenceClassification),
        "hubert": (t.HubertConfig, t.HubertForSequenceClassification),
    }[arch]
    convolutions = dict(conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3))
    if not group_norm:
        convolutions = dict(conv_dim=(16,), conv_stride=(5,), conv_kernel=(10,))
    return model_class(
        config_class(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            num_conv_pos_embeddings=8,
            num_conv_pos_embedding_groups=2,
            num_labels=CLASSES,
            feat_extract_norm="group" if group_norm else "layer",
            do_stable_layer_norm=not group_norm,
            mask_time_prob=0.0,
            classifier_proj_size=16,
            initializer_range=0.2,
            **convolutions,
        )  # fmt: skip
    )


def _net(arch: str, group_norm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if arch == "vit":  # an image classifier: its pixel_values feed the lower layers too
        config = transformers.ViTConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            image_size=16, patch_size=4, num_labels=CLASSES,
        )  # fmt: skip
        return transformers.ViTForImageClassification(config).double().eval()
    net = _audio(arch, group_norm) if arch in AUDIO else _seq2seq(arch)
    return net.double().eval()


def _encoder_top(net: nn.Module, arch: str) -> list[str]:
    """The query / value projections of the encoder's last layer (the top of the lower stack)."""
    names = QUERY_VALUE.get(arch, ["q_proj", "v_proj"])
    return [
        path
        for path, module in net.named_modules()
        if isinstance(module, nn.Linear)
        and path.rsplit(".", 1)[-1] in names
        and "decoder" not in path.split(".")
        and ".1." in path
    ]


def _text(arch: str, lengths: list[int], width: int) -> dict[str, torch.Tensor]:
    """Rows of ``lengths`` real tokens, each ending in the EOS, right-padded to ``width``."""
    pad, eos = TOKENS[arch]
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(5, VOCAB, (len(lengths), 16), generator=g)[:, :width]  # width <= 16
    size = torch.tensor(lengths)
    mask = (torch.arange(width) < size[:, None]).long()
    ids[torch.arange(len(lengths)), size - 1] = eos
    ids[mask == 0] = pad
    return {"input_ids": ids, "attention_mask": mask}


def _sound(arch: str, lengths: list[int], width: int) -> dict[str, torch.Tensor]:
    """Waveforms of ``lengths`` samples zero-padded to ``width`` (Whisper: log-mel frames of
    its fixed length, which it does not mask)."""
    g = torch.Generator().manual_seed(5)
    if arch == "vit":
        return {"pixel_values": torch.randn(len(lengths), 3, 16, 16, generator=g).double()}
    if arch == "whisper":
        return {"input_features": torch.randn(len(lengths), 16, 32, generator=g).double()}
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    waves = torch.randn(len(lengths), 320, generator=g).double()[:, :width] * mask  # <= 320
    return {"input_values": waves, "attention_mask": mask}


def _inputs(arch: str, lengths: list[int], width: int) -> dict[str, torch.Tensor]:
    return (_sound if arch in AUDIO else _text)(arch, lengths, width)


def _draws(model: FineTuneModel, num: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        site: 0.5 * torch.randn(num, *spec.shape, generator=g, dtype=torch.float64)
        for site, spec in model.latent_sites.items()
    }


@pytest.mark.parametrize("arch", ["t5", "bart", "mbart", "t5-encoder", *AUDIO])
def test_a_seq2seq_or_audio_classifier_shares_exactly_and_fits(arch) -> None:
    net = _net(arch)
    top = _encoder_top(net, arch)
    assert len(top) == 2  # the encoder's last query and value projections
    model = FineTuneModel(net, LoRAXS(rank=2, target_modules=top), num_data=3)
    assert sorted({s.module_path for s in model.latent_sites.values()}) == sorted(top)
    values = _draws(model, 3)
    text = arch not in AUDIO
    short, wide = (7, 12) if text else (160, 240)
    plain = _inputs(arch, [short] * 3, short)
    padded = _inputs(arch, [short] * 3, wide)
    ragged = _inputs(arch, [wide, short, wide - 1], wide)
    with torch.no_grad():
        shared = model.batched_output(ragged, values)
        with unshared():
            reference = model.batched_output(ragged, values)
        alone, with_padding = (
            model.batched_output(plain, values),
            model.batched_output(padded, values),
        )
    # float64: the shared forward (or its fallback: the decoder and the pooled heads read the
    # un-expanded inputs above the cut) against the unshared one, and padded rows against
    # their unpadded selves, agree to rounding (measured <= 8e-14 on these networks, T5's
    # outputs of scale ~10; a padding leak or a row paired with another draw is O(1e-1))
    assert float((shared - reference).abs().max()) < 1e-10
    assert float((with_padding - alone).abs().max()) < 1e-10
    assert float((shared[0] - shared[1]).abs().max()) > 1e-3  # the draws reach the output

    batch = {**ragged, "labels": torch.tensor([0, 1, 2])}
    for family in ("map", "meanfield"):
        guide = pb.posterior(model, family)
        result = pb.fit(model, guide, [batch], epochs=3, lr=0.05, seed=0)
        losses = torch.as_tensor(result.losses)
        assert bool(torch.isfinite(losses).all()) and float(losses[-1]) < float(losses[0])
        probs = pb.predict(model, guide, [batch], num_samples=4).probs
        draws = 1 if family == "map" else 4  # a point mass predicts with its one draw
        assert probs.shape == (draws, 3, CLASSES) and bool(torch.isfinite(probs).all())


@pytest.mark.parametrize(
    "arch, masked", [("wav2vec2", True), ("wav2vec2", False), ("whisper", False), ("vit", False)]
)
def test_an_audio_input_is_cut_to_the_batch_rows_below_the_first_adapted_layer(
    arch, masked
) -> None:
    """The audio (and image) inputs, ``input_values``, ``input_features`` (``pixel_values``),
    feed the layers below the cut: they are cut to the B un-expanded rows with the mask.
    Before, they stayed S-fold: a masked waveform met its mask of B rows in the feature
    encoder (``IndexError``, raised to the user by ``pb.predict``), an unmasked one ran every
    lower layer S times."""
    net = _net(arch, group_norm=True)  # wav2vec2-base's feature encoder
    top = _encoder_top(net, arch)
    model = FineTuneModel(net, LoRAXS(rank=2, target_modules=top), num_data=8)
    inputs = _sound(arch, [240, 160, 200, 240], 240)
    if not masked:
        inputs.pop("attention_mask", None)
    blocks = block_stack(net)
    assert blocks is not None  # the adapters sit in its block 1 (the encoder's, not the convs')
    stack = next(name for name, module in net.named_modules() if module is blocks)
    assert len(top) == 2 and all(path.startswith(f"{stack}.1.") for path in top)
    rows: list[int] = []
    blocks[0].register_forward_hook(lambda m, a, o: rows.append(int(a[0].shape[0])))
    values = _draws(model, 3)
    with torch.no_grad():
        shared = model.batched_output(inputs, values)
        ran = list(rows)
        with unshared():
            reference = model.batched_output(inputs, values)
    # float64 rounding (measured 0); a draw paired with another's rows is O(1e-1)
    assert float((shared - reference).abs().max()) < 1e-10
    # unmasked: block 0 ran once, on the 4 rows; masked, the pooled head reads the mask of 4
    # rows: the shared forward declines and the 12 rows run (exact)
    assert ran == ([4, 12] if masked else [4])
    batch = {**inputs, "labels": torch.tensor([0, 1, 2, 0])}
    prediction = pb.predict(model, pb.posterior(model, "meanfield"), [batch], num_samples=3)
    assert prediction.probs.shape == (3, 4, CLASSES)


def test_sigma_norm_converts_t5s_rms_norms_exactly() -> None:
    """T5LayerNorm is an RMSNorm (x / sqrt(mean x² + ε) · w) by another name; σN refused T5
    ("no LayerNorm / BatchNorm / RMSNorm layer σN can convert"). Converted, the members at their
    initial values give the original network's output: in float32 to float32's rounding (the
    member scale is w / σ(γ₀) times σ(γ₀), a few ulps off w: 1e-6 relative over the network's
    five norms), the member's RMS being computed in float32 as T5's is."""
    torch.manual_seed(0)
    net = _net("t5").eval()
    inputs = _inputs("t5", [7, 5, 7], 7)
    with torch.no_grad():
        before = net(**inputs).logits
    model = FineTuneModel(net, pb.models.SigmaNorm(num_members=2, heads=[]), num_data=3)
    assert any("layer_norm" in site for site in model.latent_sites), list(model.latent_sites)
    with torch.no_grad():
        after = model.output(inputs, model.init_values())
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["bart", "t5"])
def test_sigma_norm_auto_heads_are_the_task_head_trainable_auto_trains(arch: str) -> None:
    """BART's, mBART's and T5's sequence classifiers keep their head in ``classification_head``
    (dense + out_proj), a name outside ``HEAD_NAMES``: ``SigmaNorm(heads="auto")`` found no head
    and warned, so the members shared one head, while ``trainable_modules="auto"`` (the
    layers a task model adds beside its base model) did train it. Both now take that head."""
    torch.manual_seed(0)
    net = _net(arch).eval()
    expected = {"classification_head.dense", "classification_head.out_proj"}
    assert set(task_head_modules(net)) == {"classification_head"}
    model = FineTuneModel(net, pb.models.SigmaNorm(num_members=2), num_data=3)
    heads = {site.rsplit(".", 1)[0] for site in model.latent_sites if "classification_head" in site}
    assert heads == expected, list(model.latent_sites)
