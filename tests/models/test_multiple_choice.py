"""Multiple choice with continuations on causal LMs: encoding, scores against a hand loop over
``model(**inputs).logits``, and fit/predict for every registered family."""

from __future__ import annotations

import math
import re

import pytest
import torch

import pyrobayes as pb
from pyrobayes.batch import batch_size, split_batch, token_mask
from pyrobayes.contract import LinearizedPredictive, Mixture
from pyrobayes.io import PosteriorMismatchError
from pyrobayes.models import FineTuneModel, LoRA, LoRAXS, MultipleChoice
from pyrobayes.models.deploy import merged_network
from pyrobayes.models.multiple_choice import eager_attention_mask, encode_multiple_choice
from pyrobayes.models.projections import collect_input_moments
from pyrobayes.registry import _REGISTRY
from tests import families
from tests.common import tiny_llama

FAMILIES = sorted({cls.family for cls in _REGISTRY.values()})

PROMPTS = ["The ground is wet because", "To boil water you", "Red and blue make"]
CHOICES = [
    ["it rained", "the sun", "nobody knows why at all"],
    ["put the pan on the stove", "freeze it", "wait"],
    ["purple", "a colour called green", "x"],
]


class CharTokenizer:
    """A deterministic character tokenizer over the tiny models' vocabulary (99 tokens):
    BOS = 1 with special tokens, pad = 0, characters map to 3..97."""

    pad_token_id = 0
    eos_token_id = 2

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [3 + ord(c) % 95 for c in text]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}


def tiny_gpt2_lm(**overrides):
    """A two-layer ``GPT2LMHeadModel`` (n_embd 32, vocab 99) from a config (``overrides``
    replace its fields)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = dict(n_embd=32, n_layer=2, n_head=2, n_positions=64, vocab_size=99, pad_token_id=0)
    cfg.update(overrides)
    return GPT2LMHeadModel(GPT2Config(**cfg))


NETS = {"llama": tiny_llama, "gpt2": tiny_gpt2_lm}


def hand_scores(net, batch, normalize, dtype=None):
    """Per-choice scores by a loop over rows: ``model(input_ids).logits`` of one row at a time,
    its padding removed (no attention mask, no padding position for any attention to mishandle);
    the log-softmax in ``dtype`` (default: the logits')."""
    ids, mask, cont = batch["input_ids"], batch["attention_mask"], batch["continuation_mask"]
    num, k_choices, _ = ids.shape
    out = torch.zeros(num, k_choices, dtype=torch.float64)
    for b in range(num):
        for k in range(k_choices):
            real = mask[b, k].bool()
            row, row_cont = ids[b, k][real], cont[b, k][real]
            logp = net(input_ids=row[None]).logits[0].log_softmax(-1, dtype=dtype)
            terms = [float(logp[t - 1, row[t]]) for t in range(len(row)) if row_cont[t]]
            score = math.fsum(terms)
            if normalize == "length":
                score /= len(terms)
            elif normalize == "chars":
                score /= len(CHOICES[b][k])
            out[b, k] = score
    return out


def test_encoding_layout():
    tok = CharTokenizer()
    for side in ("left", "right"):
        batch = encode_multiple_choice(tok, PROMPTS, CHOICES, answers=[0, 0, 0], padding_side=side)
        ids, mask, cont = batch["input_ids"], batch["attention_mask"], batch["continuation_mask"]
        assert ids.shape == mask.shape == cont.shape == (3, 3, ids.shape[-1])
        assert batch["labels"].tolist() == [0, 0, 0]
        for b in range(3):
            for k in range(3):
                real = ids[b, k][mask[b, k].bool()].tolist()
                expected = [1] + [3 + ord(c) % 95 for c in PROMPTS[b] + " " + CHOICES[b][k]]
                assert real == expected
                # the continuation is the last len(" " + choice) real tokens
                assert int(cont[b, k].sum()) == len(CHOICES[b][k]) + 1
                assert bool((cont[b, k] <= mask[b, k]).all())
                positions = batch["position_ids"][b, k][mask[b, k].bool()]
                assert positions.tolist() == list(range(len(expected)))
        assert batch["continuation_chars"].tolist() == [[float(len(c)) for c in x] for x in CHOICES]
    left = encode_multiple_choice(tok, PROMPTS, CHOICES, padding_side="left")
    assert bool(left["attention_mask"][..., -1].all())  # every row ends at the last position


def test_encoding_truncates_the_prompt_from_the_left_and_refuses_bad_input():
    tok = CharTokenizer()
    batch = encode_multiple_choice(tok, ["abcdefgh"], ["xy", "z"], max_length=6)
    assert batch["input_ids"].shape[-1] == 6
    assert batch["input_ids"][0, 0].tolist()[-3:] == [3 + ord(c) % 95 for c in " xy"]
    with pytest.raises(ValueError, match="max_length"):
        encode_multiple_choice(tok, ["ab"], ["a long choice", "b"], max_length=4)
    with pytest.raises(ValueError, match="same number"):
        encode_multiple_choice(tok, ["a", "b"], [["x", "y"], ["x"]])
    with pytest.raises(ValueError, match="padding_side"):
        encode_multiple_choice(tok, ["a"], ["x", "y"], padding_side="middle")
    with pytest.raises(ValueError, match="answers"):
        encode_multiple_choice(tok, ["a"], ["x", "y"], answers=[0, 1])

    class NoBos(CharTokenizer):
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [3 + ord(c) % 95 for c in text]}

    with pytest.raises(ValueError, match="no BOS"):
        encode_multiple_choice(NoBos(), [""], ["x", "y"])


@pytest.mark.parametrize("arch", sorted(NETS))
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("normalize", ["none", "length", "chars"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_scores_equal_a_hand_loop(arch, side, normalize, attn, dtype):
    # eager attention in float64 on left padding: transformers' own mask gives the padding
    # queries a softmax over -inf only (NaN, which its next layer spreads to the real tokens);
    # the likelihood hands the network a mask without such rows (eager_attention_mask)
    torch.manual_seed(0)
    net = NETS[arch](attn_implementation=attn).eval().to(dtype)
    assert net.config._attn_implementation == attn
    model = FineTuneModel(
        net,
        LoRAXS(rank=2, target_modules={"llama": ["q_proj"], "gpt2": ["c_attn"]}[arch]),
        likelihood=MultipleChoice(normalize=normalize),
        trainable_modules=[],
    )
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, CHOICES, padding_side=side)
    values = {s: 0.3 * torch.randn(v.shape, dtype=v.dtype) for s, v in model.init_values().items()}
    with torch.no_grad():
        scores = model.output(batch, values)  # (B, K)
        # the hand loop runs the plain network at the same adapter values, one unpadded row at
        # a time
        ref = hand_scores(_with_values(model, values), batch, normalize)
    assert scores.shape == (3, 3) and scores.dtype == dtype
    # float32 rounding of sums of ~30 log-probabilities of size ~5 (eps·30·5 ≈ 2e-5 at worst,
    # 3e-6 seen); eager attention takes its softmax in float32 even in float64
    torch.testing.assert_close(scores.double(), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", sorted(NETS))
def test_bfloat16_scores_are_summed_in_float32(arch):
    """A bf16 network's continuation scores are float32 sums of float32 log-softmaxes of its
    bf16 logits, shared or not: a bf16 log-softmax rounds each token's log-probability to 2^-6
    nats and tied or reordered choices (here it was off by 0.17-0.21 nats). The reference is the
    same network's bf16 logits of one unpadded row at a time, log-softmaxed in float64; the
    padded batch's bf16 logits may differ from those by an ulp (2^-8 relative), so the sums of
    ~20 log-probabilities agree to a few 1e-3 (3e-3 seen): tolerance 0.02."""
    from pyrobayes.models.sharing import unshared

    torch.manual_seed(0)
    net = NETS[arch]().eval().to(torch.bfloat16)
    model = FineTuneModel(
        net,
        LoRAXS(rank=2, target_modules={"llama": ["q_proj"], "gpt2": ["c_attn"]}[arch]),
        likelihood=MultipleChoice(),
        trainable_modules=[],
    )
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, CHOICES, padding_side="left")
    values = {s: (0.3 * torch.randn(v.shape)).to(v.dtype) for s, v in model.init_values().items()}
    with torch.no_grad():
        shared = model.output(batch, values)
        with unshared():
            plain = model.output(batch, values)
        ref = hand_scores(_with_values(model, values), batch, "none", dtype=torch.float64)
    assert shared.dtype == plain.dtype == torch.float32
    torch.testing.assert_close(shared.double(), ref, rtol=0, atol=0.02)
    torch.testing.assert_close(plain.double(), ref, rtol=0, atol=0.02)


def _with_values(model, values):
    """The model's network with ``values`` merged in (a plain transformers model)."""
    return merged_network(model, values).eval()


def test_eager_attention_mask_replaces_only_the_rows_that_see_no_key():
    real = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]])
    eager64 = tiny_llama(attn_implementation="eager").double()
    mask = eager_attention_mask(eager64, real)
    assert mask is not None and mask.shape == (3, 1, 4, 4) and mask.dtype == torch.float64
    attend = mask[:, 0] == 0
    causal = torch.ones(4, 4).tril().bool()
    expected = causal[None] & real.bool()[:, None, :]  # the network's own causal padding mask
    expected[0, 0, 0] = expected[0, 1, 1] = True  # the left-padding queries see themselves
    assert torch.equal(attend, expected)
    assert bool((mask[:, 0][~attend] == torch.finfo(torch.float64).min).all())
    # nothing to replace: sdpa, float32 (the mask's minimum stays finite in the float32
    # softmax), or no row that starts with padding
    assert eager_attention_mask(tiny_llama(attn_implementation="sdpa").double(), real) is None
    assert eager_attention_mask(tiny_llama(attn_implementation="eager").float(), real) is None
    assert eager_attention_mask(eager64, real[1:]) is None


def test_eager_attention_mask_refuses_sliding_window_layers():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=37,
        vocab_size=99,
        sliding_window=4,
        attn_implementation="eager",
    )
    net = MistralForCausalLM(cfg).double()
    with pytest.raises(ValueError, match="attn_implementation='sdpa'.*padding_side='right'"):
        eager_attention_mask(net, torch.tensor([[0, 1, 1]]))


def _eager_float64_model(**kwargs):
    torch.manual_seed(0)
    return FineTuneModel(
        tiny_llama(attn_implementation="eager").double().eval(),
        LoRAXS(rank=2, target_modules=["q_proj", "v_proj"]),
        trainable_modules=[],
        **kwargs,
    )


def test_eager_float64_single_token_choices_on_left_padding():
    # the answer-token path reads the last real token of a left-padded row: finite, and the
    # unpadded row's logits at the same draw
    model = _eager_float64_model(likelihood="multiple_choice", choice_token_ids=[5, 6, 7])
    ids = torch.randint(3, 99, (4, 7))
    mask = torch.ones(4, 7, dtype=torch.long)
    mask[1, :3] = 0
    mask[3, :1] = 0
    values = {s: torch.randn(3, *v.shape, dtype=v.dtype) for s, v in model.init_values().items()}
    with torch.no_grad():
        out = model.batched_output({"input_ids": ids, "attention_mask": mask}, values)
        assert out.shape == (3, 4, 3) and bool(out.isfinite().all())
        for i in range(3):
            net = _with_values(model, {s: v[i] for s, v in values.items()})
            for b in range(4):
                row = ids[b][mask[b].bool()]
                ref = net(input_ids=row[None]).logits[0, -1, [5, 6, 7]]
                # eager attention's float32 softmax: ~1e-7 relative on logits of size ~1
                torch.testing.assert_close(out[i, b], ref, rtol=0, atol=1e-5)


def test_eager_float64_left_padding_trains_as_right_padding():
    # the negative log-likelihood and its gradient on the adapter values do not depend on
    # the padding side (eager attention's float32 softmax: agreement to ~1e-7 relative)
    model = _eager_float64_model(likelihood="multiple_choice", num_data=3)
    torch.manual_seed(1)
    values = {
        s: torch.randn(2, *v.shape, dtype=v.dtype, requires_grad=True)
        for s, v in model.init_values().items()
    }

    def nll_and_grads(side):
        batch = encode_multiple_choice(
            CharTokenizer(), PROMPTS, CHOICES, answers=[0, 1, 2], padding_side=side
        )
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        nll = -model.log_likelihood(model.batched_output(inputs, values), batch["labels"]).sum()
        return nll.detach(), torch.autograd.grad(nll, list(values.values()))

    nll_left, grads_left = nll_and_grads("left")
    nll_right, grads_right = nll_and_grads("right")
    assert bool(nll_left.isfinite())
    torch.testing.assert_close(nll_left, nll_right, rtol=0, atol=1e-5)
    for g_left, g_right in zip(grads_left, grads_right, strict=True):
        assert bool(g_left.isfinite().all())
        torch.testing.assert_close(g_left, g_right, rtol=1e-4, atol=1e-5)


def test_left_padding_does_not_change_the_scores():
    # with position_ids counting real tokens only, left and right padding score alike
    torch.manual_seed(0)
    model = FineTuneModel(
        tiny_llama().eval(),
        LoRAXS(rank=2, target_modules=["q_proj"]),
        likelihood="multiple_choice",
        trainable_modules=[],
    )
    tok = CharTokenizer()
    with torch.no_grad():
        left = model.output(encode_multiple_choice(tok, PROMPTS, CHOICES), model.init_values())
        right = model.output(
            encode_multiple_choice(tok, PROMPTS, CHOICES, padding_side="right"),
            model.init_values(),
        )
    torch.testing.assert_close(left, right, rtol=0, atol=1e-10)


def test_batched_draws_equal_one_draw_at_a_time():
    torch.manual_seed(0)
    model = FineTuneModel(
        tiny_llama().eval(),
        LoRAXS(rank=2, target_modules=["q_proj", "v_proj"]),
        likelihood="multiple_choice",
        trainable_modules=[],
    )
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, CHOICES, padding_side="right")
    values = {s: torch.randn(4, *v.shape) for s, v in model.init_values().items()}
    with torch.no_grad():
        batched = model.batched_output(batch, values)  # (S, B, K)
        single = torch.stack(
            [model.output(batch, {s: v[i] for s, v in values.items()}) for i in range(4)]
        )
    assert batched.shape == (4, 3, 3)
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-10)


def test_continuation_errors_name_the_fix():
    model = FineTuneModel(
        tiny_llama(),
        LoRAXS(rank=2, target_modules=["q_proj"]),
        likelihood="multiple_choice",
        trainable_modules=[],
    )
    ids = torch.randint(1, 99, (2, 5))
    with pytest.raises(ValueError, match="encode_multiple_choice"):
        model.output({"input_ids": ids}, model.init_values())
    with pytest.raises(ValueError, match="normalize"):
        MultipleChoice(normalize="bytes")
    with pytest.raises(ValueError, match="normalize"):
        MultipleChoice([5, 6], normalize="length")


TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}
ADAPTERS = {
    "lora-xs": lambda targets: LoRAXS(rank=2, target_modules=targets),
    "lora": lambda targets: LoRA(rank=2, target_modules=targets),
}

#: families whose registry-test network transform (tests/families.NETS) is written for the MLP
#: problem (it appends a LayerNorm to an nn.Sequential): a causal LM is used as it is.
MLP_ONLY_NETS = {"signorm"}

#: (family, adapter) pairs left out of the parametrization, and why.
EXCLUDED = {
    ("symmetrized", "lora-xs"): "LoRA-XS cores sit between fixed SVD bases: no rank permutation "
    "symmetry (the family refuses them); tests/families.py maps them to LoRA, so the case would "
    "repeat the LoRA one",
}

#: every (family, adapter, architecture) that applies
CASES = [
    (family, adapter_name, arch)
    for family in FAMILIES
    for adapter_name in sorted(ADAPTERS)
    for arch in sorted(NETS)
    if (family, adapter_name) not in EXCLUDED
]


def causal_lm_problem(family, arch, adapter_name, likelihood="multiple_choice", **encode_kw):
    """A tiny causal LM with ``family``'s adapter (and network) transform, and a batch of three
    questions with five choices each (a family with K particles and a diversity term needs more
    than K classes)."""
    torch.manual_seed(0)
    net = NETS[arch]().eval()
    if family not in MLP_ONLY_NETS:
        net = families.net_for(family, net)
    adapter = families.adapter_for(family, ADAPTERS[adapter_name](TARGETS[arch]))
    choices = [c + ["maybe", "none of these"] for c in CHOICES]
    batch = encode_multiple_choice(
        CharTokenizer(), PROMPTS, choices, answers=[0, 1, 4], **encode_kw
    )
    model = FineTuneModel(net, adapter, likelihood=likelihood, trainable_modules=[], num_data=3)
    return model, batch


@pytest.mark.parametrize(("family", "adapter_name", "arch"), CASES)
def test_fit_and_predict_run_for_every_family(family, adapter_name, arch):
    model, batch = causal_lm_problem(family, arch, adapter_name)
    guide = families.posterior(model, family)
    result = pb.fit(model, guide, [batch], epochs=2, lr=1e-2, progress=False)
    assert all(math.isfinite(v) for v in result.losses)
    pred = pb.predict(model, guide, [batch], num_samples=3)
    s = 1 if guide.is_deterministic else 3
    if isinstance(guide, Mixture):  # rounded up to a multiple of K: equal component weights
        s = -(-3 // guide.num_components) * guide.num_components
    if isinstance(guide, LinearizedPredictive) and guide.pred_type == "glm" and guide.link_samples:
        s = guide.link_samples  # its own draws of the linearised logits
    assert pred.log_probs is not None and pred.log_probs.shape == (s, 3, 5)
    torch.testing.assert_close(pred.probs.sum(-1), torch.ones(s, 3), rtol=0, atol=1e-10)
    assert pred.targets is not None and pred.targets.tolist() == [0, 1, 4]


def test_choice_rows_count_examples_and_mask_tokens():
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, CHOICES, answers=[0, 1, 2])
    inputs, _ = split_batch(batch)
    assert batch_size(inputs) == 3  # examples, not 3·K rows: the data plate's size
    mask = token_mask(inputs)
    assert mask is not None and mask.shape == (9, inputs["input_ids"].shape[-1])
    torch.testing.assert_close(mask, inputs["attention_mask"].reshape(9, -1))


def test_wsvd_calibration_sees_the_real_tokens_of_every_choice_row():
    # the input statistics of a W-SVD projection run through the likelihood's network inputs,
    # and count each choice row's real tokens once (padding is masked)
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, CHOICES, answers=[0, 1, 2])
    torch.manual_seed(0)
    model = FineTuneModel(
        tiny_llama().eval(),
        LoRAXS(rank=2, target_modules=["q_proj"], projection="wsvd"),
        likelihood="multiple_choice",
        trainable_modules=[],
        calibration_data=[batch],
    )
    moments = collect_input_moments(
        model.net,
        ["model.layers.0.self_attn.q_proj"],
        [batch],
        forward=lambda m, b: model._call_net(m, split_batch(b)[0]),
        mask_fn=token_mask,
    )
    assert moments["model.layers.0.self_attn.q_proj"].n == int(batch["attention_mask"].sum())
    assert len(model.latent_sites) == 2


def test_pyro_predictive_and_save_load(tmp_path):
    # Pyro's vectorized Predictive runs the continuation batch through the model's Pyro program
    # (obs (S, B): the data plate counts examples); save/load keeps the normalisation
    import pyro

    def build(normalize):
        torch.manual_seed(0)
        return FineTuneModel(
            tiny_llama().eval(),
            LoRAXS(rank=2, target_modules=["q_proj"]),
            likelihood=MultipleChoice(normalize=normalize),
            trainable_modules=[],
            num_data=3,
        )

    model = build("length")
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, CHOICES, answers=[0, 1, 2])
    inputs, _ = split_batch(batch)
    guide = pb.posterior(model, "meanfield")
    pb.fit(model, guide, [batch], epochs=1)
    samples = pyro.infer.Predictive(model, guide=guide, num_samples=4, parallel=True)(inputs)
    assert samples["obs"].shape == (4, 3)
    assert int(samples["obs"].min()) >= 0 and int(samples["obs"].max()) <= 2
    path = pb.save(guide, tmp_path / "mc.safetensors", model=model)
    loaded = pb.load(path, build("length"))
    for site in guide.sites:
        torch.testing.assert_close(loaded.loc(site), guide.loc(site), rtol=0, atol=0)
    with pytest.raises(PosteriorMismatchError, match="normalize"):
        pb.load(path, build("none"))


def _float64_llama(num_data: int) -> FineTuneModel:
    """The tiny LLaMA in float64 with LoRA r = 2 on q/v, length-normalised continuations."""
    torch.manual_seed(0)
    return FineTuneModel(
        NETS["llama"]().eval().double(),
        LoRA(rank=2, target_modules=TARGETS["llama"]),
        likelihood=MultipleChoice(normalize="length"),
        num_data=num_data,
        trainable_modules=[],
    )


def test_padded_choice_rows_are_not_data_for_kronecker_statistics():
    """A ragged batch pads a question's choice list with copies of its first choice (masked out
    of the likelihood); Kronecker IVON's input factor averaged over them too, so the fit depended
    on what the padded rows held (3.8e-3 in the posterior mean against 9e-3 moved by the fit).
    With the rows masked (``batch.token_mask``), padded rows copying choice 0 or choice 1 give
    the same fit in float64, to rounding."""
    from pyrobayes.batch import token_mask

    questions = [
        ("Q0 pick one", ["alpha", "betabeta"], 0),
        ("Q1 pick one", ["gamma", "delta", "epsilon", "zeta"], 2),
        ("Q2 pick one", ["eta", "theta", "iota"], 1),
        ("Q3 pick one", ["kappa", "lambda"], 1),
    ]

    def batches(copy: int) -> list:
        out = []
        for i in (0, 2):
            chunk = questions[i : i + 2]
            b = encode_multiple_choice(
                CharTokenizer(),
                [q[0] for q in chunk],
                [q[1] for q in chunk],
                answers=[q[2] for q in chunk],
                padding_side="left",
                ragged=True,
            )
            for row, col in (b["choice_mask"] == 0).nonzero().tolist():
                for key in ("input_ids", "attention_mask", "continuation_mask", "position_ids"):
                    b[key][row, col] = b[key][row, copy]
                b["continuation_chars"][row, col] = b["continuation_chars"][row, copy]
            out.append(b)
        return out

    mask = token_mask(batches(0)[0])
    assert mask is not None and int(mask.reshape(2, 4, -1)[0, 2:].sum()) == 0  # padded rows
    means = []
    for copy in (0, 1):
        model = _float64_llama(num_data=4)
        guide = pb.posterior(model, "kron-ivon")
        pb.fit(model, guide, batches(copy), epochs=2, lr=0.1, seed=0, progress=False)
        means.append(guide.mean())
    for site, value in means[0].items():
        torch.testing.assert_close(value, means[1][site], rtol=0, atol=1e-12)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_is_not_data_for_the_kronecker_laplace(side):
    """laplace-torch's K-FAC (curvlinops, KFAC-expand) averaged the input factor over every
    position of a token batch: the same questions padded left instead of right moved the
    curvature by 61 % (relative norm), and the contents of a ragged batch's padded choice rows
    by 15 %. With the factor over the real tokens (pyrobayes.infer.curvature, ``(1/N) Σ_rows
    (1/L_row) Σ_real a aᵀ``), one more padding column changes nothing: float64, equal to the
    eigendecomposition's rounding (1e-8 relative)."""
    from pyrobayes.models.multiple_choice import encode_multiple_choice as encode

    prompts, choices = ["The sky is", "Grass is a"], [["blue", "gray"], ["four", "five"]]
    batch = encode(CharTokenizer(), prompts, choices, answers=[0, 1], padding_side=side)
    assert bool(batch["attention_mask"].all())  # equal lengths: no padding at all
    padded = {k: v.clone() for k, v in batch.items()}
    for key in ("input_ids", "attention_mask", "continuation_mask", "position_ids"):
        pad = torch.zeros_like(batch[key][..., :1])
        parts = (pad, batch[key]) if side == "left" else (batch[key], pad)
        padded[key] = torch.cat(parts, -1)
    curvature = []
    for data in (batch, padded):
        model = _float64_llama(num_data=2)
        start = pb.posterior(model, "map")
        with torch.no_grad():  # a point away from LoRA's B = 0, where A gets no gradient
            for site in start.sites:
                start.loc(site).normal_(0.0, 0.3, generator=torch.Generator().manual_seed(1))
        guide = pb.posterior(model, "laplace", init=start, prior_precision=1.0)
        pb.fit(model, guide, [data], epochs=0, progress=False)
        curvature.append({s: guide.posterior_precision(s) for s in guide.sites})
    for site, value in curvature[0].items():
        torch.testing.assert_close(curvature[1][site], value, rtol=1e-8, atol=1e-10)


def _laplace_curvature(batches: list, num_data: int) -> dict[str, torch.Tensor]:
    """The Kronecker Laplace's curvature (posterior precision less the prior's τ I) of the
    float64 tiny LLaMA at a fixed point away from LoRA's B = 0 (where A gets no gradient)."""
    model = _float64_llama(num_data=num_data)
    start = pb.posterior(model, "map")
    with torch.no_grad():
        for site in start.sites:
            start.loc(site).normal_(0.0, 0.3, generator=torch.Generator().manual_seed(1))
    guide = pb.posterior(model, "laplace", init=start, prior_precision=1.0)
    pb.fit(model, guide, batches, epochs=0, progress=False)
    out = {}
    for site in guide.sites:
        precision = guide.posterior_precision(site)
        out[site] = precision - torch.eye(precision.shape[0], dtype=precision.dtype)
    return out


def test_the_kronecker_laplace_does_not_depend_on_how_questions_are_batched():
    """The K-FAC input factor averaged over a batch's real tokens (``Σ_real a aᵀ / (N · n_tok /
    n_rows)``) weighted a sequence by the batch's mean length, so the same four questions of
    different lengths grouped [0 1 | 2 3], [0 2 | 1 3] or in one batch moved the curvature by
    2.9-7.7 % against one question per batch. Each sequence averaged over its own real tokens
    (``(1/N) Σ_rows (1/L_row) Σ_real a aᵀ``) is additive over questions: the groupings agree to
    the eigendecomposition's rounding (float64, 1e-8 relative)."""
    from pyrobayes.models.multiple_choice import encode_multiple_choice as encode

    questions = [
        ("The sky is", ["blue", "gray"], 0),
        ("Grass is a lovely", ["green", "red"], 0),
        ("Snow", ["white", "black as coal"], 0),
        ("A long prompt about fire is", ["hot", "cold"], 1),
    ]

    def batches(groups: list[list[int]]) -> list:
        return [
            encode(
                CharTokenizer(),
                [questions[i][0] for i in group],
                [questions[i][1] for i in group],
                answers=[questions[i][2] for i in group],
                padding_side="left",
            )
            for group in groups
        ]

    single = _laplace_curvature(batches([[0], [1], [2], [3]]), num_data=4)
    for groups in ([[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 1, 2, 3]]):
        grouped = _laplace_curvature(batches(groups), num_data=4)
        for site, value in single.items():
            torch.testing.assert_close(grouped[site], value, rtol=1e-8, atol=1e-10)


def test_ibdr_diversity_is_taken_per_question_with_enough_real_choices():
    """A ragged batch's 2-choice question padded to the 5 of another passed IBDR's C − 1 ≥ K
    check (on the padded width) and added a constant 46.97 nats without gradient; the default α was switched off by the first narrow batch, so the objective
    depended on the batch order. Now the term is the 5-choice question's alone (padded choices
    add zero coordinates, leaving the cosines as they are), in any batch."""
    from pyrobayes.infer.diversity import diversity_loss
    from pyrobayes.infer.ibdr import IBDRLoss

    model = _float64_llama(num_data=4)
    guide = pb.posterior(model, "ibdr")  # K = 4 particles
    narrow, wide = ["red", "blue"], ["red", "blue", "green", "black", "white"]
    batch = encode_multiple_choice(
        CharTokenizer(), ["Pick"] * 2, [narrow, wide], answers=[0, 1], ragged=True
    )
    torch.manual_seed(3)
    values = {
        s: 0.3 * torch.randn(4, *shape, dtype=torch.float64) for s, shape in guide.sites.items()
    }
    with torch.no_grad():
        total, _ = IBDRLoss(alpha=0.02).data_term(model, values, batch)
        plain, _ = IBDRLoss(alpha=0.0).data_term(model, values, batch)
        scores = model.batched_output(batch, values)  # (K, 2, 5), -inf on padded choices
        wide_div = diversity_loss(torch.softmax(scores[:, 1:], -1), torch.tensor([1]))
    scale = 4 / 2  # N / B
    torch.testing.assert_close(total - plain, scale * 0.02 * wide_div.sum(), rtol=1e-12, atol=0)
    # a batch of narrow questions only: no term, and the default alpha stays for the next batch
    loss = IBDRLoss()
    narrow_only = encode_multiple_choice(
        CharTokenizer(), ["Pick"] * 2, [narrow, narrow], answers=[0, 1], ragged=True
    )
    with torch.no_grad():
        loss.data_term(model, values, narrow_only)
    assert loss.alpha == 0.02


@pytest.mark.parametrize(
    ("choices", "words"),
    [
        (["yes", "yes"], "holds 'yes' twice (choices 0 and 1)"),  # shared by every prompt
        ([["a", "b"], ["c", "c"], ["d", "e"]], "choices[1] holds 'c' twice"),
        ([["a", ""], ["c", "d"], ["e", "f"]], "choices[0][1] is '', an empty answer"),
        (["yes", "  "], "an empty answer"),
    ],
)
def test_duplicate_and_empty_answer_texts_are_refused(choices, words):
    # a duplicate capped its question's probability at 1/2; an empty answer was scored on the
    # delimiter alone and won with p = .997 under normalize="none"
    with pytest.raises(ValueError, match=re.escape(words)):
        encode_multiple_choice(CharTokenizer(), PROMPTS, choices)


@pytest.mark.parametrize("net", ["llama", "gpt2"])
def test_rows_longer_than_the_position_table_are_refused(net):
    # GPT-2's learned positions failed inside torch ("index out of range in self"); LLaMA's
    # rotary ones scored 203-token rows of a 64-position model without a word
    torch.manual_seed(0)
    model = FineTuneModel(
        NETS[net]().eval(),
        LoRA(rank=2, target_modules=["q_proj"] if net == "llama" else ["c_attn"]),
        likelihood="multiple_choice",
        trainable_modules=[],
    )
    prompts = [p * 8 for p in PROMPTS]  # 130+ characters: rows past the 64 positions
    batch = encode_multiple_choice(CharTokenizer(), prompts, CHOICES)
    with pytest.raises(ValueError, match=r"token positions exceed the network's 64.*max_length"):
        model.output(batch, model.init_values())
    short = encode_multiple_choice(CharTokenizer(), prompts, CHOICES, max_length=48)
    with torch.no_grad():
        assert model.output(short, model.init_values()).isfinite().all()


def test_choice_token_ids_outside_the_vocabulary_are_refused():
    torch.manual_seed(0)
    model = FineTuneModel(
        tiny_llama().eval(),
        LoRA(rank=2, target_modules=["q_proj"]),
        likelihood="multiple_choice",
        choice_token_ids=[5, 500],
        trainable_modules=[],
    )
    batch = {"input_ids": torch.randint(3, 90, (2, 6)), "labels": torch.tensor([0, 1])}
    with pytest.raises(ValueError, match=r"scores 99 tokens, so id 500 is no token"):
        model.output({"input_ids": batch["input_ids"]}, model.init_values())
