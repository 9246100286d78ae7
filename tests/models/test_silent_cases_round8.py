"""Silent cases of the shared prompt and lower-block computations (round 8): configurations
whose shared passes gave other scores than the full rows, or that raised or fell back to the
full rows without saying so. Each compares ``sharing.unshared()`` with the default path."""

from __future__ import annotations

import logging

import pytest
import torch

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRA, MultipleChoice
from pyrobayes.models.multiple_choice import encode_multiple_choice
from pyrobayes.models.sharing import unshared
from tests.models.test_multiple_choice import PROMPTS, CharTokenizer

pytestmark = [pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")]

#: ragged choices: the batch's rows reach position 49, its prompts position 25
RAGGED = [
    ["it rained", "the sun", "nobody knows why at all", "maybe"],
    ["put the pan on the stove", "x"],
    ["purple", "a colour called green", "none of these"],
]

_TINY = dict(
    hidden_size=32,
    num_attention_heads=2,
    num_key_value_heads=2,
    intermediate_size=37,
    vocab_size=99,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _phi3_longrope(original: int, layers: int = 2):
    """A tiny Phi-3 with ``longrope`` scaling whose long factors apply past ``original``
    positions (Phi-3/3.5-128k: 4,096 of 131,072)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    rope = {
        "rope_type": "longrope",
        "short_factor": [1.0] * 8,
        "long_factor": [4.0] * 8,
        "original_max_position_embeddings": original,
    }
    config = Phi3Config(
        **_TINY,
        num_hidden_layers=layers,
        rope_scaling=rope,
        original_max_position_embeddings=original,
    )
    return Phi3ForCausalLM(config)


def _draws(model, num=4, scale=0.5):
    torch.manual_seed(1)
    return {
        s: scale * torch.randn(num, *v.shape, dtype=v.dtype) for s, v in model.init_values().items()
    }


def _scores(net, targets, side="left"):
    """(shared, unshared) ``(S, B, K)`` scores of the ragged batch under four draws (the shared
    ones computed twice: the first call checks the network's head)."""
    model = FineTuneModel(
        net, LoRA(rank=2, target_modules=targets), likelihood=MultipleChoice(), trainable_modules=[]
    )
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, RAGGED, padding_side=side, ragged=True)
    batch.pop("labels", None)
    values = _draws(model)
    with torch.no_grad():
        model.batched_output(batch, values)
        shared = model.batched_output(batch, values)
        with unshared():
            plain = model.batched_output(batch, values)
    return shared, plain


def _told(caplog, logger, text):
    return [r for r in caplog.records if r.name == logger and text in r.getMessage()]


@pytest.mark.parametrize("side", ["left", "right"])
def test_longrope_prompts_past_the_short_factors_score_as_the_full_rows(side, caplog):
    """longrope picks its factors by each forward's largest position: the prompts run alone
    stayed under position 30 (short factors) while the full rows, reaching 49, used the long
    ones; the scores differed by 0.78 nats. Now those batches run the full rows, and say so."""
    torch.manual_seed(0)
    net = _phi3_longrope(original=30).eval().double()
    with caplog.at_level(logging.INFO, logger="pyrobayes.models.sharing"):
        shared, plain = _scores(net, ["qkv_proj"], side)
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-10)
    assert len(_told(caplog, "pyrobayes.models.sharing", "past position 30")) == 1


def test_longrope_rows_within_the_short_factors_still_share_prompts():
    """Rows that stay under ``original_max_position_embeddings`` (the usual multiple-choice
    question on Phi-3: 4,096) use the short factors in every pass: the prompts are shared."""
    torch.manual_seed(0)
    net = _phi3_longrope(original=64).eval().double()
    rows: list[int] = []
    net.get_input_embeddings().register_forward_hook(lambda m, a, o: rows.append(a[0].numel()))
    shared, plain = _scores(net, ["qkv_proj"])
    ids = encode_multiple_choice(CharTokenizer(), PROMPTS, RAGGED, ragged=True)["input_ids"]
    assert rows[0] < 4 * ids.numel()  # shared: fewer tokens than the S = 4 draws' full rows
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-10)


def test_pb_predict_on_longrope_equals_the_unshared_predict():
    torch.manual_seed(0)
    net = _phi3_longrope(original=30).eval()
    model = FineTuneModel(
        net, LoRA(rank=2, target_modules=["qkv_proj"]), likelihood="multiple_choice", num_data=3
    )
    batch = encode_multiple_choice(
        CharTokenizer(), PROMPTS, RAGGED, answers=[0, 1, 2], padding_side="left", ragged=True
    )
    guide = pb.posterior(model, "meanfield", init_scale=0.3)
    shared = pb.predict(model, guide, [batch], num_samples=4, seed=0)
    with unshared():
        plain = pb.predict(model, guide, [batch], num_samples=4, seed=0)
    finite = torch.isfinite(plain.log_probs)
    assert torch.equal(finite, torch.isfinite(shared.log_probs))
    torch.testing.assert_close(
        shared.log_probs[finite], plain.log_probs[finite], rtol=1e-6, atol=1e-5
    )


def _longrope_rows():
    """Two batches of prompt + choice rows, some under position 20 and some past it."""
    encode = encode_multiple_choice
    prompts = ["abc", "The ground is wet because"]
    choices = [["d", "ef"], ["it rained", "the sun"]]
    return [
        encode(CharTokenizer(), prompts, choices, answers=[0, 1]),
        encode(CharTokenizer(), prompts[::-1], choices[::-1], answers=[1, 0]),
    ]


def test_a_longrope_fit_with_the_lower_block_cache_equals_the_plain_fit(caplog):
    """An entry computed on an example's own tokens under position 20 got longrope's short
    factors, the plain forward of its batch (reaching 35) the long ones: the cached fit fitted
    another function. Past the limit the cache is off (INFO) and the fit is the plain one."""
    targets = r".*layers\.[12]\.self_attn\.qkv_proj"

    def fit():
        torch.manual_seed(0)
        net = _phi3_longrope(original=20, layers=3).eval().double()
        model = FineTuneModel(
            net, LoRA(rank=2, target_modules=targets), likelihood="multiple_choice", num_data=4
        )
        guide = pb.posterior(model, "map")
        result = pb.fit(model, guide, _longrope_rows(), epochs=3, lr=1e-2, seed=0)
        return guide, result

    with caplog.at_level(logging.INFO, logger="pyrobayes.models.lower_cache"):
        guide, result = fit()
    with unshared():
        plain_guide, plain = fit()
    torch.testing.assert_close(result.losses, plain.losses, rtol=1e-10, atol=0)
    for name, value in plain_guide.state_dict().items():
        torch.testing.assert_close(guide.state_dict()[name], value, rtol=0, atol=1e-10, msg=name)
    assert _told(caplog, "pyrobayes.models.lower_cache", "past position 20")


def test_a_network_without_position_ids_says_once_that_prompts_are_not_shared(caplog):
    """MPT (ALiBi) takes no position_ids: every batch ran the full rows without a word. Now the
    reason is logged, once per network (not per batch)."""
    from transformers import MptConfig, MptForCausalLM

    torch.manual_seed(0)
    config = MptConfig(d_model=32, n_layers=2, n_heads=2, vocab_size=99, max_seq_len=128)
    net = MptForCausalLM(config).eval().double()
    with caplog.at_level(logging.INFO, logger="pyrobayes.models.sharing"):
        shared, plain = _scores(net, ["Wqkv"], side="right")
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-10)
    assert len(_told(caplog, "pyrobayes.models.sharing", "takes no position_ids")) == 1
