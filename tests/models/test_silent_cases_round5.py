"""Silent failure cases of the multiple-choice likelihood and its encoding (round 5): hand-built
batch keys that would score padding, NaN probabilities or broadcast over the wrong choices, a
one-choice batch, and whitespace on both sides of a prompt/choice join."""

from __future__ import annotations

import warnings

import pytest
import torch

from pyrobayes.models import MultipleChoice
from pyrobayes.models.multiple_choice import continuation_targets, encode_multiple_choice
from tests.models.test_multiple_choice import CharTokenizer, tiny_gpt2_lm


def _batch(**kw):
    return encode_multiple_choice(
        CharTokenizer(), ["ab cd", "xy"], ["yes", "no"], answers=[0, 1], **kw
    )


def _scores(batch, likelihood=None):
    """The likelihood's (B, K) scores of ``batch`` on a tiny GPT-2 (network_inputs, then params)."""
    torch.manual_seed(0)
    net = tiny_gpt2_lm().eval()
    likelihood = likelihood or MultipleChoice()
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    flat = likelihood.network_inputs(inputs, net)
    with torch.no_grad():
        logits = net(**flat).logits
    return likelihood.params(logits, inputs)


def test_a_continuation_mask_over_right_padding_is_refused():
    # a mask built as "every position after the prompt" also marks the right padding: the pad
    # tokens' log-probabilities were added to the shorter choices' scores
    batch = _batch(padding_side="right", position_ids=False)
    cont = batch["continuation_mask"]
    first = cont.float().argmax(-1, keepdim=True)
    batch["continuation_mask"] = (torch.arange(cont.shape[-1]) >= first).long()
    assert bool((batch["continuation_mask"] & (1 - batch["attention_mask"])).any())
    with pytest.raises(ValueError, match=r"padding token \(attention_mask 0\)"):
        _scores(batch)
    with pytest.raises(ValueError, match="padding token"):
        continuation_targets(
            batch["continuation_mask"].reshape(4, -1), batch["attention_mask"].reshape(4, -1)
        )


def test_the_mask_of_the_encoding_still_scores():
    for side in ("left", "right"):
        scores = _scores(_batch(padding_side=side))
        assert scores.shape == (2, 2) and bool(scores.isfinite().all())


def test_an_example_without_a_real_choice_is_refused_not_nan():
    batch = _batch()
    batch["choice_mask"] = torch.tensor([[1, 1], [0, 0]])
    with pytest.raises(ValueError, match="choice_mask marks no real choice"):
        _scores(batch)
    batch["choice_mask"] = torch.tensor([[1, 1], [1, 0]])  # one real choice: finite
    scores = _scores(batch)
    assert bool(torch.softmax(scores, -1).isfinite().all())


def test_a_choice_mask_of_another_shape_is_refused():
    # (B,) = (2,) with K = 2 broadcast over the choices: it masked choice 1 of every example
    batch = _batch()
    batch["choice_mask"] = torch.tensor([1, 0])
    with pytest.raises(ValueError, match=r"choice_mask must be a \(B, K\) = \(2, 2\)"):
        _scores(batch)


def test_continuation_chars_of_another_shape_are_refused_for_chars_normalization():
    # one example, K = 2 choices and one char count: broadcast to both choices, the same divisor
    batch = encode_multiple_choice(CharTokenizer(), ["ab"], ["yes", "no"])
    batch["continuation_chars"] = torch.tensor([3.0])
    with pytest.raises(ValueError, match=r"continuation_chars must hold .* \(B, K\) = \(1, 2\)"):
        _scores(batch, MultipleChoice(normalize="chars"))
    # another normalization does not read it
    assert _scores(batch, MultipleChoice(normalize="length")).shape == (1, 2)


def test_a_batch_of_one_choice_per_example_is_refused():
    batch = _batch()
    one = {key: value[:, :1] for key, value in batch.items() if key != "labels"}
    with pytest.raises(ValueError, match="K = 1 choice"):
        _scores(one)


@pytest.mark.parametrize(
    ("prompt", "delimiter", "choice"),
    [("Answer: ", " ", "yes"), ("Answer:", " ", " yes"), ("Answer: ", "", " yes")],
)
def test_whitespace_on_both_sides_of_a_join_warns(prompt, delimiter, choice):
    with pytest.warns(UserWarning, match="whitespace on both sides"):
        encode_multiple_choice(CharTokenizer(), [prompt], [choice, "no"], delimiter=delimiter)


@pytest.mark.parametrize(
    ("prompt", "delimiter", "choice"),
    [("Answer:", " ", "yes"), ("Answer: ", "", "yes"), ("Q?\n", "", " yes"), ("A:\n", " ", "x")],
)
def test_one_whitespace_at_a_join_does_not_warn(prompt, delimiter, choice):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch = encode_multiple_choice(
            CharTokenizer(), [prompt], [choice, "no"], delimiter=delimiter
        )
    assert batch["input_ids"].shape[:2] == (1, 2)
