"""The blocks below the first adapted one, shared by the full rows when the prompt-sharing path
declines a multiple-choice batch (Falcon's float64 eager attention on prompts of different
lengths, rotary frequencies that change within the batch, choices whose prompts differ): block 0
runs on the R rows once for all S draws, in prediction and from the fit's lower-block cache, and
``tokens_per_draw`` reports what runs (tiny networks built from a config, three blocks, adapted
in block 2 only)."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers as tr

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRA, MultipleChoice
from pyrobayes.models.multiple_choice import encode_multiple_choice
from pyrobayes.models.sharing import unshared
from tests.models.test_multiple_choice import CHOICES, PROMPTS, CharTokenizer
from tests.models.test_padding_gemma2_bloom import tiny_gemma2
from tests.models.test_silent_cases_round8 import RAGGED, _phi3_longrope

pytestmark = [pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")]

#: 3 prompts x 3 choices: the network runs on 9 rows, and S = 3 draws
ROWS, DRAWS = 9, 3


def _falcon(attention: str = "eager", heads: int = 4) -> tr.FalconForCausalLM:
    config = tr.FalconConfig(
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=heads,
        alibi=True,
        new_decoder_architecture=False,
        multi_query=False,
        vocab_size=99,
        pad_token_id=0,
        attn_implementation=attention,
    )
    return tr.FalconForCausalLM(config)


def _model(net: torch.nn.Module, target: str, dtype: torch.dtype, **options) -> FineTuneModel:
    torch.manual_seed(0)
    return FineTuneModel(
        net.eval().to(dtype),
        LoRA(rank=2, target_modules=target),
        likelihood=MultipleChoice(normalize="length"),
        trainable_modules=[],
        **options,
    )


def _falcon_model(dtype: torch.dtype = torch.float64, **options) -> FineTuneModel:
    torch.manual_seed(0)
    return _model(_falcon(), r".*h\.2\.self_attention\.query_key_value", dtype, **options)


def _draws(model: FineTuneModel, num: int = DRAWS) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {
        s: 0.5 * torch.randn(num, *v.shape, dtype=v.dtype) for s, v in model.init_values().items()
    }


def _rows_at(module: torch.nn.Module) -> list[int]:
    """The rows ``module`` (a layer norm inside a block: it runs only if its block computes) is
    called on, call by call."""
    rows: list[int] = []
    module.register_forward_pre_hook(lambda m, a: rows.append(int(a[0].shape[0])))
    return rows


def _batch(side: str = "right") -> dict[str, torch.Tensor]:
    """PROMPTS (of different lengths: left-padded in the prompt pass) x CHOICES."""
    return encode_multiple_choice(CharTokenizer(), PROMPTS, CHOICES, padding_side=side)


def _told(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records)


def test_falcon_float64_eager_prompts_of_different_lengths_share_the_lower_blocks(caplog):
    """The prompt pass declines (its left-padded prompts would give NaN in float64 eager
    attention, logged): block 0 ran on the 27 rows of the 3 draws, it now runs on the 9 rows
    once, and the scores are the unshared ones."""
    model = _falcon_model()
    batch, values = _batch(), _draws(model)
    blocks = model.net.transformer.h
    below, adapted = _rows_at(blocks[0].input_layernorm), _rows_at(blocks[2].input_layernorm)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="pyrobayes.models.sharing"):
        shared = model.batched_output(batch, values)
        assert below == [ROWS] and adapted == [DRAWS * ROWS]  # block 0 once for all draws
        with unshared():
            plain = model.batched_output(batch, values)
    assert _told(caplog, "left-padded for the prompt pass") == 1
    assert bool(torch.isfinite(shared).all())
    # the same rows through the same blocks (0 seen); per-token means of ~5 nats in float64
    # (ulp 8.9e-16) summed in another order would move by a few ulps: 1e-10
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-10)


def test_falcon_float64_eager_predict_runs_block_0_once_per_batch():
    """pb.predict's chunks of draws: block 0 once for the batch (not once per chunk, nor per
    draw), with the log-probabilities of the unshared predict."""
    model = _falcon_model(num_data=3)
    batch = encode_multiple_choice(
        CharTokenizer(), PROMPTS, CHOICES, answers=[0, 1, 2], padding_side="right"
    )
    guide = pb.posterior(model, "meanfield", init_scale=0.3)
    below = _rows_at(model.net.transformer.h[0].input_layernorm)
    shared = pb.predict(model, guide, [batch], num_samples=4, samples_per_forward=2, seed=0)
    assert below == [ROWS]
    with unshared():
        plain = pb.predict(model, guide, [batch], num_samples=4, samples_per_forward=2, seed=0)
    assert shared.log_probs is not None and plain.log_probs is not None
    # float64 log-softmaxes over scores of a few nats, the same rows and blocks: 1e-10
    torch.testing.assert_close(shared.log_probs, plain.log_probs, rtol=0, atol=1e-10)


def test_longrope_batch_past_the_short_factors_shares_the_lower_blocks(caplog):
    """float32: a batch reaching past longrope's short factors runs the full rows (its prompts
    alone would be rotated otherwise, logged); their block 0 runs once for the 3 draws."""
    torch.manual_seed(0)
    model = _model(
        _phi3_longrope(original=30, layers=3), r".*layers\.2\.self_attn\.qkv_proj", torch.float32
    )
    batch = encode_multiple_choice(
        CharTokenizer(), PROMPTS, RAGGED, padding_side="right", ragged=True
    )
    values = _draws(model)
    rows = int(batch["input_ids"].shape[:2].numel())
    below = _rows_at(model.net.model.layers[0].input_layernorm)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="pyrobayes.models.sharing"):
        shared = model.batched_output(batch, values)
        assert below == [rows]
        with unshared():
            plain = model.batched_output(batch, values)
    assert _told(caplog, "past position 30") == 1
    # the same rows through the same blocks (0 seen); float32 per-token means of ~5 nats (ulp
    # 4.8e-7) of ~20 terms summed in another order would move by a few ulps: 1e-5
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-5)


def test_choices_whose_prompts_differ_share_the_lower_blocks():
    """A question whose choices do not share their prompt tokens has no shared prompt (float32
    sdpa, where the prompt path otherwise runs): the full rows share block 0 all the same."""
    torch.manual_seed(0)
    model = _model(_falcon("sdpa"), r".*h\.2\.self_attention\.query_key_value", torch.float32)
    batch = _batch()
    batch["input_ids"][0, 1, 0] = 7  # choice 1 of question 0 starts with another token
    values = _draws(model)
    below = _rows_at(model.net.transformer.h[0].input_layernorm)
    with torch.no_grad():
        shared = model.batched_output(batch, values)
        assert below == [ROWS]
        with unshared():
            plain = model.batched_output(batch, values)
    # float32 per-token means, the same rows and blocks (0 seen): 1e-5 as above
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-5)


@pytest.mark.parametrize("num_samples", [1, DRAWS])
def test_fit_lower_cache_serves_batches_whose_prompts_decline(num_samples):
    """Inside a fit's lower-block cache (validation: no gradients) Gemma-2's declined prompt
    pass (float64 eager sliding-window layers, prompts of different lengths) left the cache
    unread, and block 0 ran on every row; now it is read back and block 0 does not run."""
    torch.manual_seed(0)
    net = tiny_gemma2(num_hidden_layers=3)
    model = _model(net, r".*layers\.2\.self_attn\.(q|v)_proj", torch.float64)
    batch, values = _batch(), _draws(model, num_samples)
    below = _rows_at(model.net.model.layers[0].input_layernorm)
    with torch.no_grad(), model.caching_lower_blocks([batch]):
        assert "_lower_cache" in model.__dict__  # the cache applies to this network
        below.clear()  # the cache's own pass over the data
        cached = model.batched_output(batch, values)
        assert below == []
    with torch.no_grad(), unshared():
        plain = model.batched_output(batch, values)
    # an entry is its example's block 0 on its real tokens alone: another reduction length,
    # float64 rounding of scores of ~5 nats (0 seen over 5 seeds): 1e-10
    torch.testing.assert_close(cached, plain, rtol=0, atol=1e-10)


def _block_tokens(blocks: list[torch.nn.Module]) -> list[int]:
    """Token positions entering the blocks (a layer norm of each), summed over calls."""
    seen = [0]

    def count(module: torch.nn.Module, args: tuple) -> None:
        seen[0] += int(args[0].shape[:-1].numel())

    for block in blocks:
        block.register_forward_pre_hook(count)
    return seen


@pytest.mark.parametrize("case", ["declined prompts", "shared prompts", "mpt rows = heads"])
def test_tokens_per_draw_is_what_one_more_draw_runs(case):
    """``tokens_per_draw`` against the block tokens measured between S = 2 and S = 3 draws,
    divided by the 3 blocks (a block-0 token is a third of a token's cost). It said 150 where
    the declined prompts' full rows ran 450 per draw, and 150 for MPT with as many heads as the
    batch has rows (its lower blocks never shared: 450)."""
    if case == "mpt rows = heads":
        torch.manual_seed(0)
        config = tr.MptConfig(d_model=36, n_layers=3, n_heads=ROWS, max_seq_len=64, vocab_size=99)
        model = _model(tr.MptForCausalLM(config), r".*blocks\.2\.attn\.Wqkv", torch.float32)
        norms = [block.norm_1 for block in model.net.transformer.blocks]
    else:
        dtype = torch.float64 if case == "declined prompts" else torch.float32
        attention = "eager" if case == "declined prompts" else "sdpa"
        torch.manual_seed(0)
        target = r".*h\.2\.self_attention\.query_key_value"
        model = _model(_falcon(attention), target, dtype)
        norms = [block.input_layernorm for block in model.net.transformer.h]
    batch = _batch()
    seen = _block_tokens(norms)
    with torch.no_grad():
        model.batched_output(batch, _draws(model, 2))  # checks the head, learns a refusal
        costs = []
        for num in (2, 3):
            seen[0] = 0
            model.batched_output(batch, _draws(model, num))
            costs.append(seen[0])
        reported = model.tokens_per_draw(batch)
    per_draw = (costs[1] - costs[0]) / len(norms)
    expected = int(batch["input_ids"].numel()) if reported is None else reported
    assert abs(expected - per_draw) < 1  # tokens_per_draw rounds up
