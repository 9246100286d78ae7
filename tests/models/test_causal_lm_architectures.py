"""Causal LMs the tests elsewhere do not build (GPT-NeoX/Pythia, OPT, GPT-J, Gemma, Phi, Qwen3,
StableLM, Cohere, OLMo, Starcoder2, Granite, SmolLM3, a tied-embedding LLaMA, GPTBigCode, ...),
each two layers from its config: shared prompts and shared lower blocks give the scores of the
unshared rows, LoRA-XS on the job's default targets adapts real modules, and the cases that
cannot share fall back to the unshared computation."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import transformers as tr

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRA, LoRAXS, MultipleChoice, sharing
from pyrobayes.models.layers import _AdapterBase
from pyrobayes.models.multiple_choice import encode_multiple_choice, prompt_ids
from pyrobayes.models.sharing import unshared
from tests.models.test_multiple_choice import PROMPTS, CharTokenizer

#: these tests check the predictive's arithmetic on guides at their initialisation, on purpose
pytestmark = pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")

#: ragged: 4, 2 and 3 choices, one of them as long as a prompt
RAGGED = [
    ["it rained", "the sun", "nobody knows why at all", "maybe"],
    ["put the pan on the stove", "x"],
    ["purple", "a colour called green", "none of these"],
]

#: the CharTokenizer's ids (< 99) and the special ids
IDS = dict(vocab_size=99, pad_token_id=0, bos_token_id=1, eos_token_id=2)
#: a LLaMA-like decoder of two blocks, hidden size 32, two heads
DECODER = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=128,
    **IDS,
)
GPT = dict(n_embd=32, n_layer=2, n_head=2, n_positions=128, **IDS)

#: architecture -> (config class, network class, config fields)
ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=128,
            rotary_pct=0.25,
            **IDS,
        ),
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        # OPT-350m's layout: a projection between the 16-wide embeddings and the blocks
        dict(
            hidden_size=32,
            ffn_dim=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=128,
            word_embed_proj_dim=16,
            do_layer_norm_before=False,
            **IDS,
        ),
    ),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(rotary_dim=8, **GPT)),
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM", dict(rotary_dim=8, n_ctx=128, **GPT)),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", GPT),
    "gpt_neo": (
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        dict(
            hidden_size=32,
            num_layers=2,
            num_heads=2,
            attention_types=[[["global", "local"], 1]],
            window_size=4,
            max_position_embeddings=128,
            **IDS,
        ),
    ),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(DECODER, head_dim=16)),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(DECODER, head_dim=16, sliding_window=4),
    ),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(DECODER, partial_rotary_factor=0.5)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(DECODER, head_dim=16)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", DECODER),
    "cohere": ("CohereConfig", "CohereForCausalLM", DECODER),  # logit_scale: not a plain head
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(DECODER, sliding_window=4)),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", DECODER),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", DECODER),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", DECODER),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(DECODER, logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5),
    ),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", DECODER),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(DECODER, tie_word_embeddings=True)),
    "persimmon": ("PersimmonConfig", "PersimmonForCausalLM", DECODER),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", DECODER),
    "glm": ("GlmConfig", "GlmForCausalLM", dict(DECODER, head_dim=16)),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(DECODER, sliding_window=4)),
}

#: the job's default targets (q_proj, v_proj), or the fused attention projection where the
#: network has no q_proj
FUSED = {
    "gpt_neox": "query_key_value",
    "persimmon": "query_key_value",
    "codegen": "qkv_proj",
    "gpt_bigcode": "c_attn",
}


def _net(arch: str, **overrides: Any) -> torch.nn.Module:
    config_type, net_type, fields = ARCHS[arch]
    if not hasattr(tr, net_type):
        pytest.skip(f"transformers {tr.__version__} has no {net_type}")
    torch.manual_seed(0)
    config = getattr(tr, config_type)(**{**fields, **overrides})
    return getattr(tr, net_type)(config).eval()


def _targets(arch: str) -> list[str]:
    return [FUSED[arch]] if arch in FUSED else ["q_proj", "v_proj"]


def _draws(model: FineTuneModel, num: int = 3) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {
        s: 0.5 * torch.randn(num, *v.shape, dtype=v.dtype) for s, v in model.init_values().items()
    }


def _rows(net: torch.nn.Module) -> list[int]:
    """Token positions the input embeddings see, call by call."""
    seen: list[int] = []
    net.get_input_embeddings().register_forward_hook(lambda m, a, o: seen.append(a[0].numel()))
    return seen


def _shared_and_plain(model: FineTuneModel, batch: dict, values: dict) -> tuple:
    """(S, B, K) scores shared and unshared, and the token positions each ran through the
    input embeddings."""
    seen = _rows(model.net)
    with torch.no_grad():
        model.batched_output(batch, values)  # the first call checks the head once
        seen.clear()
        shared = model.batched_output(batch, values)
        shared_tokens = sum(seen)
        seen.clear()
        with unshared():
            plain = model.batched_output(batch, values)
    return shared, plain, shared_tokens, sum(seen)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("side", ["left", "right"])
def test_shared_scores_equal_the_unshared_rows_on_default_targets(arch, side):
    net = _net(arch).double()
    model = FineTuneModel(
        net,
        LoRAXS(rank=4, target_modules=_targets(arch)),
        likelihood=MultipleChoice(normalize="none"),
        trainable_modules=[],
    )
    adapted = [n for n, m in model.net.named_modules() if isinstance(m, _AdapterBase)]
    assert len(adapted) == 2 * len(_targets(arch))  # every target of both blocks
    assert {n.rsplit(".", 1)[-1] for n in adapted} == set(_targets(arch))
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, RAGGED, padding_side=side, ragged=True)
    shared, plain, shared_tokens, plain_tokens = _shared_and_plain(model, batch, _draws(model))
    assert shared_tokens < plain_tokens  # the prompts ran once for their choices
    finite = torch.isfinite(plain)
    assert torch.equal(finite, torch.isfinite(shared))
    assert torch.equal(finite, batch["choice_mask"].bool().expand_as(finite))
    # float64: both paths sum the same log-probabilities (scores of ~150 nats, ulp 3e-14) in
    # another order; 1e-10 leaves ~1e3 ulps
    torch.testing.assert_close(shared[finite], plain[finite], rtol=0, atol=1e-10)


def test_gpt_bigcode_lower_blocks_fall_back_to_the_unshared_rows(caplog):
    """GPTBigCode views its last hidden states to its un-expanded input's shape, so the S-fold
    rows of the blocks above the first adapted one cannot leave its forward: the lower blocks
    then run per draw (declined once, logged), with the unshared rows' scores (before: a
    RuntimeError ``shape '[3, 25, 32]' is invalid`` in prediction and S-draw training steps)."""
    net = _net("gpt_bigcode", n_layer=3).double()
    model = FineTuneModel(
        net,
        LoRA(rank=2, target_modules=r".*h\.[12]\.attn\.c_attn"),
        likelihood=MultipleChoice(normalize="chars"),
        trainable_modules=[],
    )
    found = model._first_adapted()
    assert found is not None and found[1] == 1  # block 0 could be shared
    values = _draws(model)
    for side in ("left", "right"):
        batch = encode_multiple_choice(
            CharTokenizer(), PROMPTS, RAGGED, padding_side=side, ragged=True
        )
        with caplog.at_level(logging.INFO, logger="pyrobayes.models.sharing"):
            shared, plain, _, _ = _shared_and_plain(model, batch, values)
        finite = torch.isfinite(plain)
        assert torch.equal(finite, torch.isfinite(shared))
        # float64, the same terms in another order (see above)
        torch.testing.assert_close(shared[finite], plain[finite], rtol=0, atol=1e-10)
    told = [r.getMessage() for r in caplog.records if "fails on the S-fold rows" in r.getMessage()]
    assert len(told) == 1  # once per network
    assert sharing._lower_declined(found, len(PROMPTS), 3)


def test_gpt_bigcode_upper_adapters_fit_and_predict_as_unshared():
    """pb.fit with three draws per step (IVON's mc_samples) and pb.predict on GPTBigCode adapted
    above block 0: the shared computation falls back per draw and equals the unshared one."""
    batch = encode_multiple_choice(
        CharTokenizer(), PROMPTS, RAGGED, answers=[0, 1, 2], padding_side="right", ragged=True
    )
    results = []
    for context in (torch.enable_grad, unshared):
        model = FineTuneModel(
            _net("gpt_bigcode"),
            LoRAXS(rank=4, target_modules=r".*h\.1\.attn\.c_attn"),
            likelihood=MultipleChoice(normalize="length"),
            num_data=6,
        )
        guide = pb.posterior(model, "ivon")
        with context():
            pb.fit(
                model,
                guide,
                [batch, batch],
                epochs=1,
                lr=1e-2,
                progress=False,
                optim=pb.Optimization(optimizer=pb.infer.IVON(mc_samples=3)),
            )
            results.append(pb.predict(model, guide, [batch], num_samples=3, seed=0).log_probs)
    finite = torch.isfinite(results[1])
    assert torch.equal(finite, torch.isfinite(results[0]))
    # float32 log-probabilities of softmaxes over per-token means (~5 nats): a few ulps, 1e-5
    torch.testing.assert_close(results[0][finite], results[1][finite], rtol=0, atol=1e-5)


class OPTLikeTokenizer(CharTokenizer):
    """OPT's tokenizer: its BOS is its EOS (``</s>``, id 2), put before the text."""

    bos_token_id = 2
    all_special_ids = [0, 2]

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [3 + ord(c) % 95 for c in text]
        return {"input_ids": ([2] if add_special_tokens else []) + ids}


class EosAppendingTokenizer(CharTokenizer):
    """A LLaMA tokenizer saved with ``add_eos_token=True``: BOS 1 before, EOS 2 after."""

    bos_token_id = 1
    all_special_ids = [0, 1, 2]

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [3 + ord(c) % 95 for c in text]
        return {"input_ids": [1, *ids, 2] if add_special_tokens else ids}


def test_an_empty_prompt_keeps_a_bos_that_is_also_the_eos():
    """An empty prompt (a Winogrande sentence whose blank comes first) encodes to the BOS alone;
    the BOS is kept where it is also the EOS id (OPT) or the tokenizer appends an EOS after it
    (before: both were dropped as trailing specials and the batch refused, saying the
    tokenizer adds no BOS)."""
    assert prompt_ids(OPTLikeTokenizer(), "") == [2]
    assert prompt_ids(OPTLikeTokenizer(), "ab") == [2, 3 + ord("a") % 95, 3 + ord("b") % 95]
    assert prompt_ids(EosAppendingTokenizer(), "") == [1]
    assert prompt_ids(EosAppendingTokenizer(), "ab") == [1, 3 + ord("a") % 95, 3 + ord("b") % 95]
    batch = encode_multiple_choice(OPTLikeTokenizer(), ["", "Red and"], ["blue", "green"])
    real = batch["input_ids"][0, 0][batch["attention_mask"][0, 0].bool()]
    assert real.tolist() == [2] + [3 + ord(c) % 95 for c in " blue"]
    net = _net("opt")
    model = FineTuneModel(
        net, LoRAXS(rank=4, target_modules=["q_proj", "v_proj"]), likelihood=MultipleChoice()
    )
    shared, plain, _, _ = _shared_and_plain(model, batch, _draws(model))
    # float32 sums of ~6 log-probabilities of ~5 nats: a few ulps of 30, 1e-5
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-5)


def _adapted_above_block_0() -> tuple[Any, FineTuneModel]:
    """A three-block tied LLaMA with LoRA on blocks 1 and 2 (block 0 shared by the draws)."""
    net = _net("llama_tied", num_hidden_layers=3)
    model = FineTuneModel(
        net,
        LoRA(rank=2, target_modules=r".*layers\.[12]\.self_attn\.(q_proj|v_proj)"),
        likelihood=MultipleChoice(),
        trainable_modules=[],
    )
    return net, model


def test_a_failure_of_the_network_itself_still_reaches_the_user():
    """The fallback on a forward that fails on the S-fold rows runs the plain rows, which raise
    a failure of the network's own (here a block that always fails) as it is."""
    net, model = _adapted_above_block_0()

    def fail(module, args):
        raise RuntimeError("block 2 cannot run")

    net.model.layers[2].register_forward_pre_hook(fail)
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, RAGGED, ragged=True)
    with torch.no_grad(), pytest.raises(RuntimeError, match="block 2 cannot run"):
        model.batched_output(batch, _draws(model))


def test_an_out_of_memory_error_on_the_s_fold_rows_keeps_the_sharing():
    """A device out-of-memory error in an upper block (on the S-fold rows) propagates as it is
    and leaves the lower layers shared: the plain forward needs more memory, not less, so no
    reason to decline (before, any RuntimeError there turned the sharing off for the network)."""
    net, model = _adapted_above_block_0()
    found = model._first_adapted()
    assert found is not None and found[1] == 1
    calls = [0]

    def out_of_memory(module, args):
        calls[0] += 1
        if calls[0] == 1:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory in block 2")

    net.model.layers[2].register_forward_pre_hook(out_of_memory)
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, RAGGED, ragged=True)
    with torch.no_grad(), pytest.raises(torch.OutOfMemoryError, match="simulated"):
        model.batched_output(batch, _draws(model))
    assert not sharing._lower_declined(found, len(PROMPTS), 3)
