"""Posterior draws for less than their forwards (pyrobayes.models.sharing): a question's prompt runs
once per draw for its K choices, and the blocks below the first adapted one once for all S draws;
both give the outputs of the plain S·K-row computation (``sharing.unshared``)."""

from __future__ import annotations

import pytest
import torch

import pyrobayes as pb
from pyrobayes.contract import LinearizedPredictive
from pyrobayes.models import FineTuneModel, LoRA, LoRAXS, MultipleChoice
from pyrobayes.models.multiple_choice import encode_multiple_choice
from pyrobayes.models.sharing import first_adapted_block, unshared
from pyrobayes.registry import _REGISTRY
from tests import families
from tests.common import tiny_bert, tiny_llama
from tests.models.test_multiple_choice import (
    ADAPTERS,
    MLP_ONLY_NETS,
    NETS,
    PROMPTS,
    TARGETS,
    CharTokenizer,
)

FAMILIES = sorted({cls.family for cls in _REGISTRY.values()})

#: ragged: 4, 2 and 3 choices, one of them as long as a prompt
RAGGED = [
    ["it rained", "the sun", "nobody knows why at all", "maybe"],
    ["put the pan on the stove", "x"],
    ["purple", "a colour called green", "none of these"],
]


def _counting(net):
    """Rows seen by the network's input embeddings, call by call."""
    rows: list[int] = []
    net.get_input_embeddings().register_forward_hook(lambda m, a, o: rows.append(a[0].numel()))
    return rows


def _draws(model, num=4, scale=0.5):
    torch.manual_seed(1)
    return {
        s: scale * torch.randn(num, *v.shape, dtype=v.dtype) for s, v in model.init_values().items()
    }


@pytest.mark.parametrize("arch", sorted(NETS))
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("normalize", ["none", "chars"])
def test_shared_prompt_scores_equal_the_full_rows_in_float64(arch, side, normalize):
    torch.manual_seed(0)
    net = NETS[arch]().eval().double()
    model = FineTuneModel(
        net,
        LoRA(rank=2, target_modules=TARGETS[arch]),
        likelihood=MultipleChoice(normalize=normalize),
        trainable_modules=[],
    )
    batch = encode_multiple_choice(
        CharTokenizer(), PROMPTS, RAGGED, answers=[0, 1, 2], padding_side=side, ragged=True
    )
    batch.pop("labels")
    values = _draws(model)
    tokens = _counting(model.net)
    with torch.no_grad():
        shared = model.batched_output(batch, values)  # (S, B, K)
        shared_tokens = sum(tokens)
        tokens.clear()
        with unshared():
            plain = model.batched_output(batch, values)
    # every token of the plain path runs once per draw and choice: S·B·K·L
    assert sum(tokens) == 4 * batch["input_ids"].numel()
    # shared: each prompt but its last token once per draw, then per choice that token and the
    # continuation but its last token (padded to the longest prompt / continuation)
    prompt_tokens = (batch["attention_mask"] - batch["continuation_mask"])[:, 0].sum(-1)
    expected = 4 * (
        len(PROMPTS) * (int(prompt_tokens.max()) - 1)
        + batch["input_ids"].shape[0]
        * batch["input_ids"].shape[1]
        * int(batch["continuation_mask"].sum(-1).max())
    )
    assert shared_tokens == expected < sum(tokens)
    assert torch.equal(torch.isinf(shared), batch["choice_mask"].eq(0).expand_as(shared))
    finite = torch.isfinite(plain)
    # float64: both paths sum the same terms in another order; 1e-10 is ~1e5 ulps of a score
    torch.testing.assert_close(shared[finite], plain[finite], rtol=0, atol=1e-10)


@pytest.mark.parametrize("arch", sorted(NETS))
def test_shared_prompt_falls_back_when_prompts_differ(arch):
    """A prompt truncated differently per choice (max_length) is not shared: the plain rows run."""
    torch.manual_seed(0)
    model = FineTuneModel(
        NETS[arch]().eval(),
        LoRAXS(rank=2, target_modules=TARGETS[arch]),
        likelihood="multiple_choice",
        trainable_modules=[],
    )
    batch = encode_multiple_choice(
        CharTokenizer(), PROMPTS, RAGGED, max_length=28, ragged=True, padding_side="left"
    )
    values = _draws(model, num=2)
    tokens = _counting(model.net)
    with torch.no_grad():
        shared = model.batched_output(batch, values)
        with unshared():
            plain = model.batched_output(batch, values)
    assert tokens[0] == tokens[1] == 2 * batch["input_ids"].numel()
    torch.testing.assert_close(shared, plain, rtol=0, atol=0)


CASES = [
    (family, arch, side)
    for family in FAMILIES
    for arch in sorted(NETS)
    for side in ("left", "right")
]


@pytest.mark.parametrize(("family", "arch", "side"), CASES)
def test_every_family_predicts_the_same_with_shared_prompts(family, arch, side):
    torch.manual_seed(0)
    net = NETS[arch]().eval()
    if family not in MLP_ONLY_NETS:
        net = families.net_for(family, net)
    adapter = families.adapter_for(family, ADAPTERS["lora"](TARGETS[arch]))
    choices = [c + ["perhaps", "none"] for c in RAGGED]
    batch = encode_multiple_choice(
        CharTokenizer(), PROMPTS, choices, answers=[0, 1, 4], padding_side=side, ragged=True
    )
    model = FineTuneModel(
        net, adapter, likelihood="multiple_choice", trainable_modules=[], num_data=3
    )
    guide = families.posterior(model, family)
    pb.fit(model, guide, [batch], epochs=1, lr=1e-2, progress=False)
    shared = pb.predict(model, guide, [batch], num_samples=4, seed=0)
    with unshared():
        plain = pb.predict(model, guide, [batch], num_samples=4, seed=0)
    assert shared.log_probs is not None and plain.log_probs is not None
    if not isinstance(guide, LinearizedPredictive):
        assert shared.log_probs.shape[1:] == (3, 6)
    finite = torch.isfinite(plain.log_probs)
    assert torch.equal(finite, torch.isfinite(shared.log_probs))
    # float32 log-probabilities of a softmax over scores of magnitude <= ~150 (30 tokens of at
    # most log 99 = 4.6 nats): the two summation orders differ by a few ulps of 150, ~1e-5
    torch.testing.assert_close(
        shared.log_probs[finite], plain.log_probs[finite], rtol=1e-6, atol=1e-5
    )


# ---------------------------------------------------------------------- lower layers
def _bert_model():
    torch.manual_seed(0)
    net = tiny_bert(num_labels=3, num_hidden_layers=4).eval()
    adapter = LoRA(rank=2, target_modules=r".*layer\.[23]\.attention\.self\.(query|value)")
    return FineTuneModel(net, adapter, likelihood="categorical")


def _llama_model():
    torch.manual_seed(0)
    net = tiny_llama(num_hidden_layers=3).eval()
    adapter = LoRAXS(rank=2, target_modules=r".*layers\.[12]\.self_attn\.(q_proj|v_proj)")
    return FineTuneModel(net, adapter, likelihood=MultipleChoice([5, 6, 7]), trainable_modules=[])


@pytest.mark.parametrize(("make", "first"), [(_bert_model, 2), (_llama_model, 1)])
def test_lower_layers_run_once_for_all_draws(make, first):
    model = make()
    names = [spec.param_name for spec in model.latent_sites.values()]
    found = first_adapted_block(model.net, names)
    assert found is not None and found[1] == first
    torch.manual_seed(2)
    ids = torch.randint(3, 90, (5, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding on one row
    batch = {"input_ids": ids, "attention_mask": mask}
    values = _draws(model)
    tokens = _counting(model.net)
    with torch.no_grad():
        shared = model.batched_output(batch, values)
        with unshared():
            plain = model.batched_output(batch, values)
    assert tokens == [ids.numel(), 4 * ids.numel()]  # embeddings (and lower blocks) once
    assert shared.shape == (4, 5, 3)
    # the same rows through the same blocks: float32 results agree to rounding
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-5)


def test_lower_layers_are_not_shared_when_a_site_sits_in_the_first_block():
    torch.manual_seed(0)
    model = FineTuneModel(
        tiny_bert(num_labels=3).eval(),
        LoRA(rank=2, target_modules=["query"]),
        likelihood="categorical",
    )
    names = [spec.param_name for spec in model.latent_sites.values()]
    assert first_adapted_block(model.net, names) is None
    tokens = _counting(model.net)
    with torch.no_grad():
        model.batched_output({"input_ids": torch.randint(3, 90, (2, 5))}, _draws(model, 3))
    assert tokens == [30]
