"""Decoder-only (causal) language models as sequence classifiers, built tiny from their configs:
LLaMA, Qwen2, Mistral, Phi-3, Gemma, Gemma-2, GPT-2, OPT, Falcon, BLOOM, StableLM and GPTBigCode
``*ForSequenceClassification``, whose head reads each row at its last token whose id is not
``config.pad_token_id``.

Which modules an adapter targets, padded rows (right and left padding) against their unpadded
selves, a MAP fit that learns, the refusal of a classifier without a pad token, and of batches
padded with another id than the one the head looks for (the head read the padding: the fit's
lower-block cache then computed another function than the plain forward)."""

from __future__ import annotations

import pytest
import torch

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRA, LoRAXS
from pyrobayes.models.sharing import block_stack, unshared

transformers = pytest.importorskip("transformers")

#: the draws' predictions here come from a network as built, on purpose
pytestmark = pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")

VOCAB, CLASSES, PAD = 100, 3, 0
LLAMA_LIKE = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
    initializer_range=0.2,  # outputs that move with their inputs (0.02 leaves them ~constant)
)
GPT2_LIKE = dict(n_embd=32, n_layer=2, n_head=2, n_positions=64, initializer_range=0.2)
FUSED = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, initializer_range=0.2)

#: arch -> (config and model class names, config entries, the attention targets' leaf names)
ARCHS = {
    "llama": ("Llama", LLAMA_LIKE, ["q_proj", "v_proj"]),
    "qwen2": ("Qwen2", LLAMA_LIKE, ["q_proj", "v_proj"]),
    "mistral": ("Mistral", {**LLAMA_LIKE, "sliding_window": 4}, ["q_proj", "v_proj"]),
    "phi3": ("Phi3", LLAMA_LIKE, ["qkv_proj"]),
    "gemma": ("Gemma", {**LLAMA_LIKE, "head_dim": 16}, ["q_proj", "v_proj"]),
    "gemma2": (
        "Gemma2",
        {**LLAMA_LIKE, "head_dim": 16, "sliding_window": 4, "attn_implementation": "eager"},
        ["q_proj", "v_proj"],
    ),
    "gpt2": ("GPT2", GPT2_LIKE, ["c_attn"]),
    "opt": (
        "OPT",
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            ffn_dim=64,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            init_std=0.2,
        ),
        ["q_proj", "v_proj"],
    ),  # fmt: skip
    "falcon": ("Falcon", FUSED, ["query_key_value"]),
    "bloom": ("Bloom", {**FUSED, "n_layer": 2, "n_head": 2}, ["query_key_value"]),
    "stablelm": ("StableLm", LLAMA_LIKE, ["q_proj", "v_proj"]),
    "gpt_bigcode": ("GPTBigCode", GPT2_LIKE, ["c_attn"]),
}


def _net(arch: str, **overrides):
    """A tiny ``*ForSequenceClassification`` of ``arch`` (2 layers, width 32, 2 heads), in
    float32 whatever the suite's default dtype: transformers' float64 Gemma-2 (its soft-capped
    scores) and left-padded BLOOM (its ALiBi) add their masks' ``finfo.min`` into -inf, NaN."""
    name, extra, _ = ARCHS[arch]
    ids = dict(pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    config = getattr(transformers, f"{name}Config")(
        vocab_size=VOCAB, num_labels=CLASSES, **{**ids, **extra, **overrides}
    )
    return getattr(transformers, f"{name}ForSequenceClassification")(config).float()


def _padded(ids: torch.Tensor, side: str, width: int = 5, pad: int = PAD) -> dict:
    """``ids`` (no padding) with ``width`` padding tokens ``pad`` on ``side``; left padding with
    the ``position_ids`` that count the real tokens (GPT-2 and GPTBigCode number positions
    from 0 at the first column otherwise: transformers' own padded rows then move by ~1)."""
    rows = ids.shape[0]
    fill, zeros = torch.full((rows, width), pad), torch.zeros(rows, width, dtype=torch.long)
    ones = torch.ones_like(ids)
    if side == "right":
        return {
            "input_ids": torch.cat([ids, fill], 1),
            "attention_mask": torch.cat([ones, zeros], 1),
        }
    mask = torch.cat([zeros, ones], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return {
        "input_ids": torch.cat([fill, ids], 1),
        "attention_mask": mask,
        "position_ids": positions,
    }


def _batch(side: str, pad: int = PAD, rows: int = 6, width: int = 10, seed: int = 0) -> dict:
    """Rows of 3 to ``width`` tokens (the first full), padded on ``side`` with ``pad``; the same
    examples whatever the side."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (rows, width), generator=g)
    lengths = torch.randint(3, width + 1, (rows,), generator=g)
    lengths[0] = width
    mask = (torch.arange(width) < lengths[:, None]).long()
    ids[mask == 0] = pad
    batch = {"input_ids": ids, "attention_mask": mask}
    if side == "left":  # each row's real tokens moved to its end
        shifts = [int(width - n) for n in lengths]
        for key in ("input_ids", "attention_mask"):
            batch[key] = torch.stack([t.roll(s) for t, s in zip(batch[key], shifts, strict=True)])
        batch["position_ids"] = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)
    return {**batch, "labels": torch.arange(rows) % CLASSES}


def _named_targets(arch: str) -> list[str]:
    """The leaf names the default LoRA adapts on ``arch`` (its attention projections)."""
    model = FineTuneModel(_net(arch), LoRA(rank=2), num_data=8)
    return sorted({s.module_path.rsplit(".", 1)[-1] for s in model.latent_sites.values()})


def _top_model(arch: str, net=None) -> tuple[FineTuneModel, list[str]]:
    """LoRA-XS on the top layer's attention projections (the layer below runs once per draw)."""
    net = _net(arch) if net is None else net
    names = ARCHS[arch][2]
    top = [p for p, _ in net.named_modules() if p.rsplit(".", 1)[-1] in names and ".1." in p]
    return FineTuneModel(net, LoRAXS(rank=2, target_modules=top, init_scale=0.1), num_data=24), top


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_decoder_classifier_scores_rows_as_unpadded_on_both_sides(arch) -> None:
    assert _named_targets(arch) == ARCHS[arch][2]
    torch.manual_seed(0)
    model, top = _top_model(arch, _net(arch).eval())
    assert sorted({s.module_path for s in model.latent_sites.values()}) == sorted(top)
    assert len(top) == len(ARCHS[arch][2])
    g = torch.Generator().manual_seed(1)
    values = {
        site: 0.5 * torch.randn(3, *spec.shape, generator=g, dtype=torch.float32)
        for site, spec in model.latent_sites.items()
    }
    ids = torch.randint(5, VOCAB, (3, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        alone = model.batched_output(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, values
        )
        right = model.batched_output(_padded(ids, "right"), values)
        left = model.batched_output(_padded(ids, "left"), values)
        with unshared():
            plain = model.batched_output(_padded(ids, "right"), values)
    # float32 outputs of scale ~3: padded and unpadded forwards differ by rounding (measured
    # <= 2e-6 on these twelve networks); 1e-5 leaves room, a padding leak is O(1e-1)
    for padded in (right, left, plain):
        torch.testing.assert_close(padded, alone, rtol=0, atol=1e-5)
    assert float((alone[0] - alone[1]).abs().max()) > 1e-3  # the draws reach the output

    # a MAP fit learns, and right- or left-padded, the same examples give the same losses
    losses = {}
    for side in ("right", "left"):
        torch.manual_seed(0)
        model, _ = _top_model(arch)
        batch = _batch(side)
        fitter = pb.infer.make_fitter(model, pb.posterior(model, "map"), lr=0.05)
        fitter.begin([batch])
        losses[side] = torch.tensor([float(fitter.step(batch)) for _ in range(5)])
    assert bool(torch.isfinite(losses["right"]).all())
    assert losses["right"][-1] < losses["right"][0]
    # float32 sums of ~30 over 6 rows: 1e-4 holds a few steps of rounding (~1e-6 relative)
    torch.testing.assert_close(losses["left"], losses["right"], rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "falcon", "opt"])
def test_a_decoder_classifier_without_a_pad_token_is_refused(arch) -> None:
    with pytest.raises(ValueError, match=r"net\.config\.pad_token_id = tokenizer\.pad_token_id"):
        FineTuneModel(_net(arch, pad_token_id=None), LoRA(rank=2, target_modules=ARCHS[arch][2]))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_batches_padded_with_another_id_than_the_pad_token_are_refused(arch) -> None:
    """The head reads each row at its last token whose id is not ``pad_token_id`` (0 here).
    Right-padded with another id (2, an EOS), every padded row was read at its last padding
    token: scored as its padding, not as itself, and the fit's lower-block cache (zeros at the
    padded positions) computed yet another function than the plain forward (the fit's losses
    moved by 9.9 of ~43 on LLaMA, 5.4 of ~38 on GPT-2). Such a batch is refused by name; left
    padding (the last position is real) and the head's own id pass, and the cached fit then
    gives the plain fit's losses."""

    def fit(batches, epochs=1):
        torch.manual_seed(0)
        model, _ = _top_model(arch)
        calls: list[int] = []  # block 0's runs (a block the cache stubs still calls its hooks)
        inside = next(block_stack(model.net)[0].children())
        inside.register_forward_hook(lambda m, a, o: calls.append(1))
        guide = pb.posterior(model, "map")
        result = pb.fit(model, guide, batches, epochs=epochs, seed=0, lr=0.01)
        return model, torch.as_tensor(result.losses).detach().clone(), len(calls)

    other = [_batch("right", pad=2, seed=s) for s in range(3)]
    with pytest.raises(ValueError, match=r"padded with token id\(s\) \[2\].*pad_token_id is 0"):
        fit(other)
    with pytest.raises(ValueError, match="rows .* of the batch"), unshared():
        fit(other)

    if arch == "llama":  # embeddings given: transformers reads the last position, padding here
        model, _ = _top_model(arch)
        batch = _batch("right")
        embeds = model.net.get_input_embeddings()(batch.pop("input_ids")).detach()
        with pytest.raises(ValueError, match="inputs_embeds.*padding_side = 'left'"):
            pb.predict(
                model, None, [{**batch, "inputs_embeds": embeds}], values=model.init_values()
            )
    # left padding with the other id is read at the real last token: it passes (and checks once)
    model, _, _ = fit([_batch("left", pad=2, seed=s) for s in range(3)])
    assert model._padding_checks == 0
    ours = [_batch("right", seed=s) for s in range(3)]
    _, cached, calls = fit(ours, epochs=4)
    with unshared():
        _, plain, plain_calls = fit(ours, epochs=4)
    # 12 steps run block 0 twelve times without the cache; with it, only its build does (a
    # probe, then one forward per length of the 18 examples: 8 here)
    assert plain_calls == 12 and calls < 12
    # float32 sums of ~40: the cached entries differ from the padded forward by rounding
    # (~1e-6 relative); 1e-4 absolute leaves room (the other id's padding moved them by 5-10)
    torch.testing.assert_close(cached, plain, rtol=0, atol=1e-4)


def test_gpt_neox_classifier_adapted_above_block_0_predicts_as_unshared():
    """GPT-NeoX's sequence classifier indexes its logits by the un-expanded ``input_ids``: with
    the adapter above block 0 the S-fold rows of the shared lower layers raised an IndexError
    in ``pb.predict`` (any family, S > 1); the sharing now declines and runs the plain rows."""
    torch.manual_seed(0)
    from transformers import GPTNeoXConfig, GPTNeoXForSequenceClassification

    config = GPTNeoXConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
        pad_token_id=0,
        max_position_embeddings=64,
    )
    net = GPTNeoXForSequenceClassification(config)
    adapter = pb.models.LoRA(rank=2, target_modules=r".*layers\.1\.attention\.query_key_value")
    model = pb.models.FineTuneModel(net, adapter, num_data=8, trainable_modules=["score"])
    ids = torch.randint(1, 100, (4, 7))
    mask = torch.ones_like(ids)
    ids[1, 5:], mask[1, 5:] = 0, 0  # right padding with the pad token
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 2, 1])}
    guide = pb.posterior(model, "meanfield")
    pb.fit(model, guide, [batch], epochs=1, progress=False)
    shared = pb.predict(model, guide, [batch], num_samples=3, seed=0)
    with unshared():
        plain = pb.predict(model, guide, [batch], num_samples=3, seed=0)
    # float32, the same terms: a few ulps of probabilities in [0, 1]
    torch.testing.assert_close(shared.probs, plain.probs, rtol=0, atol=1e-5)
