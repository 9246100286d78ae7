"""Multiple-choice scores of padded batches on networks whose attention treats padding apart:
Gemma-2 (sliding-window layers, a soft-capped head) in float64 eager attention, and BLOOM (ALiBi
biases built from the 2D attention mask), shared prompts or full rows, against each row scored
alone without padding (tiny networks built from a config)."""

from __future__ import annotations

import logging

import pytest
import torch

from pyrobayes.models import FineTuneModel, LoRA, MultipleChoice, sharing
from pyrobayes.models.multiple_choice import encode_multiple_choice
from pyrobayes.models.sharing import unshared
from tests.models.test_multiple_choice import (
    CHOICES,
    PROMPTS,
    CharTokenizer,
    _with_values,
    hand_scores,
)

#: prompts of one length (11 characters): the shared path runs the prompt and continuation
#: passes on them; PROMPTS differ in length (left-padded in the shared prompt pass)
EQUAL_PROMPTS = ["Wet ground:", "Boil water:", "Red + blue:"]

#: a window far shorter than the right padding of the shorter rows (up to 30 tokens)
WINDOW = 4


def tiny_gemma2(**overrides):
    """A two-layer ``Gemma2ForCausalLM`` (sliding-window then full attention, eager)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=37,
        vocab_size=99,
        max_position_embeddings=64,
        sliding_window=WINDOW,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    cfg.update(overrides)
    return Gemma2ForCausalLM(Gemma2Config(**cfg))


def tiny_bloom(**overrides):
    """A two-layer ``BloomForCausalLM`` (eager attention, its only one in transformers)."""
    from transformers import BloomConfig, BloomForCausalLM

    cfg = dict(hidden_size=32, n_layer=2, n_head=2, vocab_size=99, pad_token_id=0)
    cfg.update(overrides)
    return BloomForCausalLM(BloomConfig(**cfg))


def _model(net, targets, normalize="none"):
    torch.manual_seed(0)
    return FineTuneModel(
        net,
        LoRA(rank=2, target_modules=targets),
        likelihood=MultipleChoice(normalize=normalize),
        trainable_modules=[],
    )


def _draws(model, num=2):
    torch.manual_seed(1)
    return {
        s: 0.5 * torch.randn(num, *v.shape, dtype=v.dtype) for s, v in model.init_values().items()
    }


def _rows_alone(model, batch, values, normalize):
    """(S, B, K) scores of each row alone, unpadded, by the plain network at each draw."""
    return torch.stack(
        [
            hand_scores(_with_values(model, {s: v[i] for s, v in values.items()}), batch, normalize)
            for i in range(next(iter(values.values())).shape[0])
        ]
    )


@pytest.mark.parametrize("prompts", ["equal", "different"])
@pytest.mark.parametrize(
    ("dtype", "normalize", "atol"),
    [
        # eager attention rounds its probabilities to float32 (2^-24 relative) even in float64,
        # and the rounding depends on the row's length (the softmax's reduction order): sums of
        # ~30 log-probabilities move by ~1e-7 (6e-8 seen over 5 seeds); 1e-6
        (torch.float64, "none", 1e-6),
        # float32: per-token means (~5 nats, ulp 5e-7) of ~30 terms; 1e-6 seen on the raw sums
        # divided by 30, 1e-5
        (torch.float32, "length", 1e-5),
    ],
    ids=["float64", "float32"],
)
def test_gemma2_right_padding_scores_are_finite_and_those_of_the_rows_alone(
    prompts, dtype, normalize, atol, caplog
):
    torch.manual_seed(0)
    net = tiny_gemma2().eval().to(dtype)
    model = _model(net, ["q_proj", "v_proj"], normalize)
    texts = EQUAL_PROMPTS if prompts == "equal" else PROMPTS
    batch = encode_multiple_choice(CharTokenizer(), texts, CHOICES, padding_side="right")
    # some padding query lies more than a window past its row's last real token: it sees no key
    real = batch["attention_mask"].reshape(-1, batch["input_ids"].shape[-1])
    assert int((real.shape[-1] - real.sum(-1)).max()) > WINDOW
    values = _draws(model)
    rows: list[int] = []
    net.get_input_embeddings().register_forward_hook(lambda m, a, o: rows.append(a[0].numel()))
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="pyrobayes.models.sharing"):
        shared = model.batched_output(batch, values)  # (S, B, K)
        shared_tokens = sum(rows)
        with unshared():
            plain = model.batched_output(batch, values)
        ref = _rows_alone(model, batch, values, normalize)
    assert bool(torch.isfinite(shared).all()) and bool(torch.isfinite(plain).all())
    if prompts == "equal":  # shared: the prompts once per draw, a soft-capped head's own logits
        assert shared_tokens < 2 * batch["input_ids"].numel()  # 2 draws of the full rows
        assert sharing._PLAIN_HEAD[net] is False
    elif dtype == torch.float64:  # prompts left-padded in the prompt pass: the full rows, told
        assert "left-padded for the prompt pass" in caplog.text
    torch.testing.assert_close(shared.double(), plain.double(), rtol=0, atol=atol)
    torch.testing.assert_close(shared.double(), ref, rtol=0, atol=atol)
    torch.testing.assert_close(plain.double(), ref, rtol=0, atol=atol)


def test_gemma2_float64_left_padding_is_refused_with_what_to_do():
    """Left padding: every padding query sees no key, and one 4D mask cannot serve both the
    sliding-window and the full layers; the right-padded batch (above) scores the same rows."""
    model = _model(tiny_gemma2().eval().double(), ["q_proj", "v_proj"])
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, CHOICES, padding_side="left")
    values = _draws(model)
    with torch.no_grad():
        for context in (torch.no_grad(), unshared()):
            with (
                context,
                pytest.raises(
                    ValueError,
                    match=r"Gemma2ForCausalLM .*float64 on left-padded rows.*sliding-window.*"
                    r"padding_side='right'.*float32",
                ),
            ):
                model.batched_output(batch, values)


def test_bloom_float64_left_padding_is_refused_with_what_to_do():
    """BLOOM builds its ALiBi biases from the 2D attention mask, so it takes none of the 4D
    masks that keep float64 eager attention finite on left padding; without the refusal
    transformers failed inside ``build_alibi_tensor`` ("too many values to unpack")."""
    model = _model(tiny_bloom().eval().double(), ["query_key_value"])
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, CHOICES, padding_side="left")
    values = _draws(model)
    with torch.no_grad(), pytest.raises(ValueError) as info:
        model.batched_output(batch, values)
    text = str(info.value)
    assert "BloomForCausalLM" in text and "left-padded" in text and "ALiBi" in text
    assert "padding_side='right'" in text and "float32" in text
    assert "sdpa" not in text  # transformers has no sdpa attention for BLOOM


@pytest.mark.parametrize(
    ("dtype", "side", "normalize", "atol"),
    [
        # float32 per-token means (~5 nats, ulp 5e-7): 1e-5
        (torch.float32, "left", "length", 1e-5),
        (torch.float32, "right", "length", 1e-5),
        # float64 sums of ~30 terms; eager attention rounds its probabilities to float32, but
        # the rows' lengths change no reduction here (1.4e-14 seen): 1e-6 as for Gemma-2
        (torch.float64, "right", "none", 1e-6),
    ],
)
def test_bloom_scores_equal_the_rows_alone(dtype, side, normalize, atol, caplog):
    """BLOOM takes no ``position_ids`` (its ALiBi biases count the mask's real tokens), so a
    left- or right-padded row scores as the row alone; it cannot share prompts, which is logged
    once per network."""
    net = tiny_bloom().eval().to(dtype)
    model = _model(net, ["query_key_value"], normalize)
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, CHOICES, padding_side=side)
    values = _draws(model)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="pyrobayes.models.sharing"):
        first = model.batched_output(batch, values)
        second = model.batched_output(batch, values)
        ref = _rows_alone(model, batch, values, normalize)
    assert caplog.text.count("its forward takes no position_ids") == 1
    assert torch.equal(first, second)
    torch.testing.assert_close(first.double(), ref, rtol=0, atol=atol)


def test_eager_attention_mask_marks_only_the_trailing_padding_of_sliding_window_rows():
    """Right-padded rows of a float64 eager network with sliding-window layers: the padding
    after a row's last real token becomes real (no real query attends a later key), a hole
    before it stays padding; full-attention and float32 networks keep their own mask."""
    from pyrobayes.models.multiple_choice import eager_attention_mask
    from tests.common import tiny_llama

    real = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    mask = eager_attention_mask(tiny_gemma2().double(), real)
    assert mask is not None and mask.dtype == real.dtype
    assert mask.tolist() == [[1] * 6, [1, 0, 1, 1, 1, 1], [1] * 6]
    assert eager_attention_mask(tiny_gemma2().float(), real) is None
    assert eager_attention_mask(tiny_llama(attn_implementation="eager").double(), real) is None
