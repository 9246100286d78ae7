"""Posterior draws for less than their forwards (pyrobayes.models.sharing): a question's prompt runs
once per draw for its K choices, and the blocks below the first adapted one once for all S draws;
both give the outputs of the plain S·K-row computation (``sharing.unshared``)."""

from __future__ import annotations

import pytest
import torch

import pyrobayes as pb
from pyrobayes.contract import LinearizedPredictive
from pyrobayes.models import FineTuneModel, LoRA, LoRAXS, MultipleChoice, sharing
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

#: these tests check the predictive's arithmetic on guides at their initialisation, on purpose;
#: the never-fitted warning itself is tested in tests/test_fitted_head.py
pytestmark = [
    pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning"),
    # one-step fits: SWAG collects one iterate (no spread), enough for these plumbing checks
    pytest.mark.filterwarnings("ignore::pyrobayes.guides.lowrank.DegenerateSWAGWarning"),
]

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
        model.batched_output(batch, values)  # the first call checks the head once (see below)
        tokens.clear()
        shared = model.batched_output(batch, values)  # (S, B, K)
        shared_tokens = sum(tokens)
        tokens.clear()
        with unshared():
            plain = model.batched_output(batch, values)
    # every token of the plain path runs once per draw and choice: S·B·K·L
    assert sum(tokens) == 4 * batch["input_ids"].numel()
    # shared: each prompt once per draw, then per choice the continuation but its last token
    # (padded to the longest prompt / continuation)
    prompt_tokens = (batch["attention_mask"] - batch["continuation_mask"])[:, 0].sum(-1)
    expected = 4 * (
        len(PROMPTS) * int(prompt_tokens.max())
        + batch["input_ids"].shape[0]
        * batch["input_ids"].shape[1]
        * (int(batch["continuation_mask"].sum(-1).max()) - 1)
    )
    assert shared_tokens == expected < sum(tokens)
    assert torch.equal(torch.isinf(shared), batch["choice_mask"].eq(0).expand_as(shared))
    finite = torch.isfinite(plain)
    # float64: both paths sum the same terms in another order; 1e-10 is ~1e5 ulps of a score
    torch.testing.assert_close(shared[finite], plain[finite], rtol=0, atol=1e-10)


@pytest.mark.parametrize("arch", sorted(NETS))
@pytest.mark.parametrize("side", ["left", "right"])
def test_single_token_choices_need_no_continuation_pass(arch, side):
    """One-token answers ("A"/"B"/...): every choice is read from its prompt's last position, so
    only the prompts run (once per draw), and one softmax per prompt serves its K choices."""
    torch.manual_seed(0)
    model = FineTuneModel(
        NETS[arch]().eval().double(),
        LoRAXS(rank=2, target_modules=TARGETS[arch]),
        likelihood="multiple_choice",
        trainable_modules=[],
    )
    choices = [["a", "b", "c"], ["d", "e"], ["f", "g", "h", "i"]]
    batch = encode_multiple_choice(
        CharTokenizer(), PROMPTS, choices, padding_side=side, ragged=True, delimiter=""
    )
    values = _draws(model, num=3)
    tokens = _counting(model.net)
    with torch.no_grad():
        model.batched_output(batch, values)  # the first call checks the head once
        tokens.clear()
        shared = model.batched_output(batch, values)
        assert sum(tokens) == 3 * len(PROMPTS) * int(batch["input_ids"].shape[-1] - 1)
        with unshared():
            plain = model.batched_output(batch, values)
    assert sharing._PLAIN_HEAD[model.net] is True
    finite = torch.isfinite(plain)
    assert torch.equal(finite, torch.isfinite(shared)) and int((~finite).sum()) == 3 * 3
    # float64, one log-softmax term per score: agreement to ~1e5 ulps
    torch.testing.assert_close(shared[finite], plain[finite], rtol=0, atol=1e-10)


@pytest.mark.parametrize("arch", sorted(NETS))
def test_a_scaled_head_is_detected_and_run_as_the_network_does(arch):
    """A network whose logits are not its output embedding of the last hidden states (a scaled
    or soft-capped head, simulated by a hook) is found out on the first call: the continuation
    slots then come from the network's own head, with the same scores as the full rows."""
    torch.manual_seed(0)
    net = NETS[arch]().eval().double()

    def scale(module, args, out):
        out.logits = 3.0 * out.logits
        return out

    net.register_forward_hook(scale)
    model = FineTuneModel(
        net,
        LoRA(rank=2, target_modules=TARGETS[arch]),
        likelihood=MultipleChoice(normalize="length"),
        trainable_modules=[],
    )
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, RAGGED, ragged=True)
    values = _draws(model, num=2)
    with torch.no_grad():
        shared = model.batched_output(batch, values)
        assert sharing._PLAIN_HEAD[net] is False
        again = model.batched_output(batch, values)  # known now: no second check
        with unshared():
            plain = model.batched_output(batch, values)
    finite = torch.isfinite(plain)
    torch.testing.assert_close(shared[finite], plain[finite], rtol=0, atol=1e-10)
    torch.testing.assert_close(again, shared, rtol=0, atol=0)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    ("rows", "dtype", "atol"),
    # float32: a log-probability of ~ -9 nats from sums over <= 5,000 logits, a few ulps of 9
    # (1e-6) each way -> 2e-5; bfloat16 logits are the same rounded numbers on both paths, the
    # sums in float32 -> the same bound
    [(300, torch.float32, 2e-5), (2100, torch.float32, 2e-5), (300, torch.bfloat16, 2e-5)],
)
def test_the_blocked_head_reads_the_log_softmax_of_the_whole_vocabulary(rows, dtype, atol, bias):
    """On the CPU the head runs over blocks of the vocabulary (300 rows: 2 blocks of 3,495 of
    5,000 tokens; 2,100 rows: 5 blocks of 1,024) and gives the log-softmax of its full output
    read at the tokens, for an ``(R, K)`` read as for a prompt's K first tokens."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 5000, bias=bias).to(dtype)
    states = torch.randn(rows, 16).to(dtype)
    tokens = torch.randint(0, 5000, (rows, 3))
    tokens[0] = torch.tensor([0, 4999, 3495])  # the first, last and a block's first column
    with torch.no_grad():
        got = sharing.head_log_probs(head, states, tokens)
        want = torch.log_softmax(head(states).double(), -1).gather(-1, tokens)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=atol)


@pytest.mark.parametrize("latent_head", [False, True])
def test_an_adapted_head_scores_its_slots_per_draw(latent_head):
    """A head with per-draw weights (LoRA on ``lm_head``, or the head made latent) is not packed
    (its rows must stay sample-major): the network's own head reads the continuation slots, and
    the scores equal the full rows'."""
    torch.manual_seed(0)
    model = FineTuneModel(
        tiny_llama().eval().double(),
        LoRA(rank=2, target_modules=["q_proj"] if latent_head else ["q_proj", "lm_head"]),
        likelihood="multiple_choice",
        trainable_modules=[],
        latent_modules=["lm_head"] if latent_head else (),
    )
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, RAGGED, ragged=True)
    values = _draws(model, num=3, scale=0.1)
    with torch.no_grad():
        shared = model.batched_output(batch, values)
        with unshared():
            plain = model.batched_output(batch, values)
    assert model.net not in sharing._PLAIN_HEAD  # the packed head was never considered
    finite = torch.isfinite(plain)
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


#: three-block causal LMs adapted in blocks 1-2 only: prompts shared and lower block 0 shared
UPPER_TARGETS = {
    "llama": r".*layers\.[12]\.self_attn\.(q_proj|v_proj)",
    "gpt2": r".*h\.[12]\.attn\.c_attn",
}
THREE_BLOCKS = {"llama": {"num_hidden_layers": 3}, "gpt2": {"n_layer": 3}}


@pytest.mark.parametrize("arch", sorted(NETS))
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("scaled", [False, True])
def test_shared_prompts_and_lower_blocks_together(arch, side, scaled):
    """Adapters in the upper blocks only: the prompts and continuations pass the lower block once
    for all S draws (the key/value cache of block 0 holds sample 0's rows only), the upper blocks
    once per draw; the scores equal the full rows' (with the packed head and with the
    network's own head)."""
    torch.manual_seed(0)
    net = NETS[arch](**THREE_BLOCKS[arch]).eval().double()
    if scaled:
        net.register_forward_hook(lambda m, a, out: setattr(out, "logits", 2 * out.logits))
    model = FineTuneModel(
        net,
        LoRA(rank=2, target_modules=UPPER_TARGETS[arch]),
        likelihood=MultipleChoice(normalize="chars"),
        trainable_modules=[],
    )
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, RAGGED, padding_side=side, ragged=True)
    values = _draws(model, num=4)
    tokens = _counting(model.net)
    with torch.no_grad():
        model.batched_output(batch, values)  # the first call checks the head once
        tokens.clear()
        shared = model.batched_output(batch, values)
        shared_tokens = sum(tokens)
        with unshared():
            plain = model.batched_output(batch, values)
    assert sharing._PLAIN_HEAD[net] is not scaled
    # the embeddings (and block 0) see each prompt and continuation once, not once per draw
    ids, cont = batch["input_ids"], batch["continuation_mask"]
    prompt_width = int((batch["attention_mask"] - cont)[:, 0].sum(-1).max())
    width = int(cont.sum(-1).max())
    assert shared_tokens == len(PROMPTS) * prompt_width + ids.shape[0] * ids.shape[1] * (width - 1)
    finite = torch.isfinite(plain)
    assert torch.equal(finite, torch.isfinite(shared))
    # float64: the same terms summed in another order, ~1e5 ulps of a score
    torch.testing.assert_close(shared[finite], plain[finite], rtol=0, atol=1e-10)


@pytest.mark.parametrize("arch", sorted(NETS))
def test_lower_blocks_are_not_shared_across_rows_of_different_examples(arch):
    """Per-row parameter sets (the linearised predictive's copies: S = R) over rows that are
    not copies of each other: the prompts are shared per row, the lower blocks are not."""
    torch.manual_seed(0)
    net = NETS[arch](**THREE_BLOCKS[arch]).eval().double()
    model = FineTuneModel(
        net,
        LoRA(rank=2, target_modules=UPPER_TARGETS[arch]),
        likelihood="multiple_choice",
        trainable_modules=[],
    )
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, RAGGED, ragged=True)
    values = _draws(model, num=3)  # one parameter set per example row
    params = {model.latent_sites[s].param_name: v for s, v in values.items()}
    with torch.no_grad():
        shared = model._functional(batch, params)
        with unshared():
            plain = model._functional(batch, params)
    per_row = torch.stack(
        [
            model.output(
                {k: v[i : i + 1] for k, v in batch.items()}, {s: v[i] for s, v in values.items()}
            )[0]
            for i in range(3)
        ]
    )
    scores = model.likelihood.params(shared, batch)
    finite = torch.isfinite(per_row)
    torch.testing.assert_close(scores[finite], per_row[finite], rtol=0, atol=1e-10)
    torch.testing.assert_close(
        model.likelihood.params(plain.logits, batch)[finite], per_row[finite], rtol=0, atol=1e-10
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


@pytest.mark.parametrize("chunk", [1, 2])
def test_predict_runs_the_lower_layers_once_per_batch_across_chunks(chunk):
    """pb.predict's chunks of draws (samples_per_forward) reuse the lower blocks' output of
    their batch: block 0 computes once per batch, and the predictive equals the unshared one."""
    model = _bert_model()
    guide = pb.posterior(model, "meanfield", init_scale=0.3)
    block = model.net.bert.encoder.layer[0].attention  # inside block 0: runs only if it computes
    calls: list[int] = []
    block.register_forward_hook(lambda m, a, o: calls.append(int(a[0].shape[0])))
    torch.manual_seed(2)
    batches = [
        {
            "input_ids": torch.randint(3, 90, (5, 9)),
            "attention_mask": torch.ones(5, 9, dtype=torch.long),
        }
        for _ in range(2)
    ]
    batches[1]["attention_mask"][2, 5:] = 0
    shared = pb.predict(model, guide, batches, num_samples=4, samples_per_forward=chunk, seed=0)
    assert calls == [5, 5]  # once per batch, on its 5 un-expanded rows
    calls.clear()
    with unshared():
        plain = pb.predict(model, guide, batches, num_samples=4, samples_per_forward=chunk, seed=0)
    assert calls == [5 * chunk] * (8 // chunk)  # every chunk of every batch, S-fold rows
    assert shared.log_probs is not None and plain.log_probs is not None
    # the same rows through the same blocks: float32 results agree to rounding
    torch.testing.assert_close(shared.log_probs, plain.log_probs, rtol=0, atol=1e-5)


def test_default_chunks_count_the_work_of_one_more_draw():
    """pb.predict's default chunk of draws on CPU divides 1,024 token positions by what one
    more draw costs: a multiple-choice batch's prompts once and continuations but their last
    token (here with the lower block shared too: 2 of 3 blocks per draw), the plain rows'
    tokens when nothing is shared."""
    from pyrobayes.predictive import default_samples_per_forward

    torch.manual_seed(0)
    model = FineTuneModel(
        tiny_llama(num_hidden_layers=3).eval(),
        LoRA(rank=2, target_modules=UPPER_TARGETS["llama"]),
        likelihood="multiple_choice",
        trainable_modules=[],
    )
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, RAGGED, ragged=True)
    ids, cont = batch["input_ids"], batch["continuation_mask"]
    prompt_width = int((batch["attention_mask"] - cont)[:, 0].sum(-1).max())
    tokens = len(PROMPTS) * prompt_width + ids.shape[0] * ids.shape[1] * (
        int(cont.sum(-1).max()) - 1
    )
    cpu = torch.device("cpu")
    with torch.no_grad():
        assert model.tokens_per_draw(batch) == -(-tokens * 2 // 3)
        assert default_samples_per_forward(64, cpu, batch, model) == 1024 // -(-tokens * 2 // 3)
        with unshared():
            assert model.tokens_per_draw(batch) is None
            assert default_samples_per_forward(64, cpu, batch, model) == 1024 // ids.numel()
    bert = _bert_model()  # blocks 2-3 of 4 adapted: half the tokens per draw
    rows = {"input_ids": torch.randint(3, 90, (16, 64))}
    assert bert.tokens_per_draw(rows) == 512
    assert default_samples_per_forward(16, cpu, rows, bert) == 2
