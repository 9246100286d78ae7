"""A continuation must follow a real token: a left-padded row with an empty prompt is refused.

The head scores continuation token ``t`` from position ``t - 1``. A right-padded row whose
continuation starts at position 0 was refused, but the same row left-padded (its continuation
right after the padding) passed, and its first token was scored from a padding position.
"""

from __future__ import annotations

import pytest
import torch

from pyrobayes.models.multiple_choice import continuation_targets


def _masks(rows: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(continuation_mask, attention_mask)`` from rows of ``p`` (padding), ``q`` (prompt)
    and ``c`` (continuation) characters."""
    cont = torch.tensor([[ch == "c" for ch in row] for row in rows])
    attn = torch.tensor([[ch != "p" for ch in row] for row in rows], dtype=torch.long)
    return cont, attn


def test_a_left_padded_row_with_an_empty_prompt_is_refused():
    cont, attn = _masks(["ppccc", "qqqcc"])
    with pytest.raises(ValueError, match="starts right after padding"):
        continuation_targets(cont, attn)


def test_a_left_padded_row_with_a_prompt_token_passes():
    """One prompt token after the padding suffices; the positions are the continuation's."""
    cont, attn = _masks(["pqccc", "qqqcc"])
    positions, valid = continuation_targets(cont, attn)
    assert positions.tolist() == [[2, 3, 4], [3, 4, 3]]
    assert valid.tolist() == [[True, True, True], [True, True, False]]


def test_padding_inside_a_continuation_keeps_its_own_message():
    """A mask that marks right padding as continuation is named as such (checked first)."""
    cont = torch.tensor([[0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    attn = torch.tensor([[1, 1, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match="marks a padding token"):
        continuation_targets(cont, attn)
