"""The blocks below the first adapted one, run once for all S draws, on networks with ALiBi
position biases (Press et al., 2022): BLOOM passes its blocks ``(rows·heads, 1, L)`` biases, MPT
``(heads, 1, max_seq_len)`` biases shared by the batch, Falcon (``alibi=True``) adds them to its
``(rows, heads, L, L)`` mask. Scores with the lower blocks shared equal each draw computed alone
without sharing (tiny networks built from a config, three blocks, adapted in block 2 only)."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers as tr

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRA, MultipleChoice, sharing
from pyrobayes.models.multiple_choice import encode_multiple_choice
from pyrobayes.models.sharing import unshared
from tests.models.test_multiple_choice import CHOICES, PROMPTS, CharTokenizer

#: 3 prompts x 3 choices: the network runs on 9 rows, and S = 3 draws
ROWS, DRAWS = 9, 3


def _bloom(heads: int = 2) -> tuple[torch.nn.Module, str]:
    config = tr.BloomConfig(hidden_size=8 * heads, n_layer=3, n_head=heads, vocab_size=99)
    return tr.BloomForCausalLM(config), r".*h\.2\.self_attention\.query_key_value"


def _mpt(heads: int) -> tuple[torch.nn.Module, str]:
    config = tr.MptConfig(
        d_model=4 * heads, n_layers=3, n_heads=heads, max_seq_len=64, vocab_size=99
    )
    return tr.MptForCausalLM(config), r".*blocks\.2\.attn\.Wqkv"


def _falcon(attention: str) -> tuple[torch.nn.Module, str]:
    config = tr.FalconConfig(
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        alibi=True,
        new_decoder_architecture=False,
        multi_query=False,
        vocab_size=99,
        attn_implementation=attention,
    )
    return tr.FalconForCausalLM(config), r".*h\.2\.self_attention\.query_key_value"


def _model(made: tuple[torch.nn.Module, str], dtype: torch.dtype) -> FineTuneModel:
    net, targets = made
    net.config.pad_token_id = 0
    return FineTuneModel(
        net.eval().to(dtype),
        LoRA(rank=2, target_modules=targets),
        likelihood=MultipleChoice(normalize="length"),
        trainable_modules=[],
    )


def _draws(model: FineTuneModel) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {
        s: 0.5 * torch.randn(DRAWS, *v.shape, dtype=v.dtype) for s, v in model.init_values().items()
    }


def _rows_at(block: torch.nn.Module) -> list[int]:
    """The rows of the hidden states ``block`` (a layer norm inside a block of the stack: it
    runs on the expanded rows, and only if its block computes) is called on, call by call."""
    rows: list[int] = []
    block.register_forward_pre_hook(
        lambda m, a, k: rows.append(int(a[0].shape[0])), with_kwargs=True
    )
    return rows


def _each_draw(model: FineTuneModel, batch, values, share_prompts: bool) -> torch.Tensor:
    """(S, B, K) scores of each draw in a forward of its own (no lower block to share): the
    prompts shared or not, as the shared call."""
    out = []
    for i in range(DRAWS):
        one = {s: v[i : i + 1] for s, v in values.items()}
        if share_prompts:
            out.append(model.batched_output(batch, one)[0])
        else:
            with unshared():
                out.append(model.batched_output(batch, one)[0])
    return torch.stack(out)


def test_bloom_alibi_is_expanded_as_the_expanded_batch_builds_it():
    """BLOOM's ``(rows·heads, 1, L)`` biases, row-major: repeated S times whole they are those
    of the S-fold sample-major batch, entry for entry (a heads-major order would not be)."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    for rows_mask, rows in ((mask, 3), (mask[:1], 1)):
        alibi = build_alibi_tensor(rows_mask, 4, torch.float32)  # (rows·4, 1, 5)
        expected = build_alibi_tensor(rows_mask.repeat(DRAWS, 1), 4, torch.float32)
        args, kwargs = sharing._expand_arguments((), {"alibi": alibi}, rows, DRAWS)
        assert args == () and torch.equal(kwargs["alibi"], expected)
        assert kwargs["alibi"].shape == (DRAWS * rows * 4, 1, 5)


@pytest.mark.parametrize(
    ("dtype", "side", "atol"),
    [
        # the same rows through the same blocks: 0 seen over 5 seeds; float32 per-token means
        # (~5 nats, ulp 4.8e-7) of ~20 terms summed in another order would move by a few ulps
        (torch.float32, "left", 1e-5),
        (torch.float32, "right", 1e-5),
        # float64 left padding is refused by both paths (eager attention's NaN, see
        # test_padding_gemma2_bloom.py); ulps of ~5 nats are 8.9e-16: 1e-10 as elsewhere
        (torch.float64, "right", 1e-10),
    ],
)
def test_bloom_scores_with_shared_lower_blocks_equal_each_draw_unshared(dtype, side, atol):
    """Was: ``RuntimeError: The expanded size of the tensor (54) must match ... [18, 1, 50]``
    (the biases of 9 rows x 2 heads not repeated for the 3 draws)."""
    torch.manual_seed(0)
    model = _model(_bloom(), dtype)
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, CHOICES, padding_side=side)
    values = _draws(model)
    blocks = model.net.transformer.h
    below, adapted = _rows_at(blocks[0].input_layernorm), _rows_at(blocks[2].input_layernorm)
    with torch.no_grad():
        shared = model.batched_output(batch, values)
        assert below == [ROWS] and adapted == [DRAWS * ROWS]  # block 0 once for all draws
        ref = _each_draw(model, batch, values, share_prompts=False)
    assert shared.shape == (DRAWS, 3, 3) and bool(torch.isfinite(shared).all())
    torch.testing.assert_close(shared, ref, rtol=0, atol=atol)


@pytest.mark.parametrize("heads", [ROWS, 4])
def test_mpt_biases_shared_by_the_batch_are_not_taken_for_its_rows(heads, caplog):
    """MPT's ``(heads, 1, max_seq_len)`` biases are shared by the batch: with as many heads as
    rows they were expanded as rows ("The size of tensor a (9) must match the size of tensor
    b (27)"); the lower blocks then run for every draw, logged once per network. With other
    head counts they are shared as before."""
    torch.manual_seed(0)
    model = _model(_mpt(heads), torch.float32)
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, CHOICES, padding_side="right")
    values = _draws(model)
    below = _rows_at(model.net.transformer.blocks[0].norm_1)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="pyrobayes.models.sharing"):
        first = model.batched_output(batch, values)
        second = model.batched_output(batch, values)
        ref = _each_draw(model, batch, values, share_prompts=False)
    told = [r.getMessage() for r in caplog.records if "run for every draw" in r.getMessage()]
    if heads == ROWS:  # the first call stops at block 2, then runs the full rows
        assert below[:3] == [ROWS, DRAWS * ROWS, DRAWS * ROWS]  # then once per call
        assert len(told) == 1 and "position_bias" in told[0] and f"{ROWS} rows" in told[0]
    else:
        assert below[:2] == [ROWS, ROWS] and not told
    assert torch.equal(first, second)
    # the same rows through the same blocks (0 seen): float32 per-token means, as above
    torch.testing.assert_close(first, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("attention", "dtype", "side", "atol"),
    [
        # float32 per-token means, as above (0 seen against each draw with shared prompts)
        ("eager", torch.float32, "left", 1e-5),
        ("sdpa", torch.float32, "right", 1e-5),
        # float64: 1.8e-15 seen (eager float64 refuses left padding, and shares neither
        # prompts of different lengths nor, then, its lower blocks: sdpa here)
        ("sdpa", torch.float64, "left", 1e-10),
        ("sdpa", torch.float64, "right", 1e-10),
    ],
)
def test_falcon_alibi_shares_its_lower_blocks_exactly(attention, dtype, side, atol):
    """Falcon adds its biases to the ``(rows, heads, L, L)`` mask, which holds the rows: the
    prompts and continuations pass block 0 once for all draws, and the scores equal each draw's
    (its prompts shared too: the only difference is the lower blocks' sharing)."""
    torch.manual_seed(0)
    model = _model(_falcon(attention), dtype)
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, CHOICES, padding_side=side)
    values = _draws(model)
    below = _rows_at(model.net.transformer.h[0].input_layernorm)
    with torch.no_grad():
        model.batched_output(batch, values)  # the first call checks the head once
        below.clear()
        shared = model.batched_output(batch, values)
        assert below == [3, ROWS]  # the 3 prompts, then the 9 continuations, once
        ref = _each_draw(model, batch, values, share_prompts=True)
    torch.testing.assert_close(shared, ref, rtol=0, atol=atol)


def test_bloom_predict_keeps_its_lower_blocks_across_chunks_of_draws():
    """pb.predict's chunks of draws read the lower blocks' output of their batch back (block 0
    computes once per batch); every chunk expands BLOOM's biases for its draws."""
    torch.manual_seed(0)
    net, targets = _bloom()
    net.config.pad_token_id = 0
    model = FineTuneModel(
        net.eval(), LoRA(rank=2, target_modules=targets), likelihood="multiple_choice", num_data=3
    )
    batch = encode_multiple_choice(
        CharTokenizer(), PROMPTS, CHOICES, answers=[0, 1, 2], padding_side="right"
    )
    guide = pb.posterior(model, "meanfield", init_scale=0.3)
    pb.fit(model, guide, [batch], epochs=1, lr=1e-2, seed=0, progress=False)
    below = _rows_at(net.transformer.h[0].input_layernorm)
    shared = pb.predict(model, guide, [batch], num_samples=4, samples_per_forward=2, seed=0)
    assert below == [ROWS]
    with unshared():
        plain = pb.predict(model, guide, [batch], num_samples=4, samples_per_forward=2, seed=0)
    assert shared.log_probs is not None and plain.log_probs is not None
    # the same rows through the same blocks (0 seen): float32 log-probabilities of softmaxes
    # over scores of ~115 nats (ulp 7.6e-6), 1e-5
    torch.testing.assert_close(shared.log_probs, plain.log_probs, rtol=0, atol=1e-5)
