"""The fit's cache of the frozen lower blocks (pyrobayes.models.lower_cache): each example's
input to the first adapted block is computed once per fit, the fit equals the plain one, a
resumed fit stays bit-exact, and where the cache does not apply every block runs."""

from __future__ import annotations

import functools
import logging

import pytest
import torch

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRA, MultipleChoice
from pyrobayes.models.lower_cache import LowerBlockCache
from pyrobayes.models.multiple_choice import encode_multiple_choice
from pyrobayes.models.sharing import unshared
from tests.common import tiny_bert

#: adapted blocks 2 and 3 of 4: blocks 0 and 1 (and the embeddings) are the cached lower part
ADAPTED = r".*layer\.[23]\.attention\.self\.(query|value)"


def _model(dtype=torch.float64, **options):
    torch.manual_seed(0)
    net = tiny_bert(num_labels=3, num_hidden_layers=4).to(dtype)
    return FineTuneModel(
        net, LoRA(rank=2, target_modules=ADAPTED), likelihood="categorical", num_data=20, **options
    )


def _batches(order=(0, 1, 2, 3), left=False):
    """Four batches of five sentences of 3..9 tokens, right padded (or left) to the batch's
    longest; ``order`` permutes the 20 sentences' batch membership."""
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(3, 10, (20,), generator=gen)
    tokens = [torch.randint(3, 90, (int(n),), generator=gen) for n in lengths]
    labels = torch.randint(0, 3, (20,), generator=gen)
    index = torch.arange(20).reshape(4, 5)[list(order)].reshape(-1)
    if order != (0, 1, 2, 3):  # also mix rows across batches
        index = index[torch.randperm(20, generator=torch.Generator().manual_seed(5))]
    batches = []
    for rows in index.reshape(4, 5):
        width = max(int(lengths[i]) for i in rows)
        ids = torch.zeros(5, width, dtype=torch.long)
        mask = torch.zeros(5, width, dtype=torch.long)
        for j, i in enumerate(rows.tolist()):
            n = int(lengths[i])
            cols = slice(width - n, width) if left else slice(0, n)
            ids[j, cols], mask[j, cols] = tokens[i], 1
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels[rows]})
    return batches


class _Iterable:
    """Batches behind an iterable that is not a list, tuple or DataLoader (not read ahead)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def _block0_rows(model):
    """Rows block 0 computes on, call by call (its attention runs only when it computes)."""
    rows: list[int] = []
    attention = model.net.bert.encoder.layer[0].attention
    attention.register_forward_hook(lambda m, a, o: rows.append(int(a[0].shape[0])))
    return rows


def _fit(model, data, epochs=3, **kwargs):
    guide = pb.posterior(model, "meanfield", init_scale=0.05)
    result = pb.fit(model, guide, data, epochs=epochs, lr=1e-2, seed=0, **kwargs)
    return guide, result


def test_a_fit_computes_the_lower_blocks_once_and_equals_the_plain_fit():
    data = _batches()
    model = _model()
    rows = _block0_rows(model)
    guide, result = _fit(model, data)
    # one probe of one example, then the 20 sentences in groups of one length (no padding):
    # 20 rows in all, and never again in the 12 training steps
    assert rows[0] == 1 and sum(rows[1:]) == 20
    plain_model = _model()
    plain_rows = _block0_rows(plain_model)
    with unshared():
        plain_guide, plain_result = _fit(plain_model, data)
    assert plain_rows == [5] * 12  # every step computes block 0 on its padded batch
    # float64: the cached entries differ from the padded batch's by rounding (~1e-16 relative);
    # twelve Adam steps on a 4-block network amplify that by far less than 1e6
    torch.testing.assert_close(result.losses, plain_result.losses, rtol=1e-10, atol=0)
    for name, value in plain_guide.state_dict().items():
        torch.testing.assert_close(guide.state_dict()[name], value, rtol=0, atol=1e-10, msg=name)


def test_entries_do_not_depend_on_the_batches_the_examples_came_in():
    model = _model(dtype=torch.float32)
    found = model._first_adapted()
    assert found is not None and found[1] == 2

    def build(data):
        cache = LowerBlockCache(model.net, found[0], found[1], [])
        assert cache.build(
            [data], lambda b: {k: v for k, v in b.items() if k != "labels"}, model.device
        )
        return cache

    a, b = build(_batches()), build(_batches(order=(3, 1, 0, 2)))
    assert a.entries.keys() == b.entries.keys() and len(a.entries) == 20
    for key, entry in a.entries.items():
        assert torch.equal(entry, b.entries[key])  # bit for bit: the canonical groups
    # assembled for a padded batch, the entries are the plain lower blocks' output at the real
    # tokens (float32 rounding apart: the padded rows run through other kernels' orders)
    batch = {k: v for k, v in _batches()[1].items() if k != "labels"}
    recorded = {}
    block = model.net.bert.encoder.layer[1]
    handle = block.register_forward_hook(lambda m, a, o: recorded.setdefault("out", o))
    with torch.no_grad():
        model.net(**batch)
    handle.remove()
    plain = recorded["out"][0] if isinstance(recorded["out"], tuple) else recorded["out"]
    assembled = a.output(batch)
    hidden = assembled[0] if isinstance(assembled, tuple) else assembled
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(hidden[real], plain[real], rtol=0, atol=1e-5)
    assert torch.all(hidden[~real] == 0)


def test_a_resumed_fit_with_the_cache_is_bit_identical(tmp_path):
    data = _batches()
    full_guide, full = _fit(_model(dtype=torch.float32), data)

    def interrupt(step: int, loss: float) -> None:
        if step == 7:
            raise KeyboardInterrupt

    checkpoint = pb.Checkpointing(tmp_path, every=1)
    with pytest.raises(KeyboardInterrupt):
        _fit(
            _model(dtype=torch.float32),
            data,
            checkpoint=checkpoint,
            progress=pb.Progress(callback=interrupt),
        )
    model = _model(dtype=torch.float32)
    rows = _block0_rows(model)
    guide, resumed = _fit(model, data, checkpoint=pb.Checkpointing(tmp_path, resume=True))
    assert rows[0] == 1 and sum(rows[1:]) == 20  # the resumed fit rebuilt its cache
    torch.testing.assert_close(resumed.losses, full.losses, rtol=0, atol=0)
    for name, value in full_guide.state_dict().items():
        torch.testing.assert_close(guide.state_dict()[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    "case",
    ["left padding", "dropout", "trained embeddings", "site in block 0", "an iterable", "short"],
)
def test_every_block_runs_where_the_cache_does_not_apply(case):
    data = _batches(left=case == "left padding")
    options = {
        "dropout": {"train_backbone_mode": True},
        "trained embeddings": {"trainable_modules": ["classifier", "bert.embeddings.LayerNorm"]},
    }.get(case, {})
    if case == "site in block 0":
        torch.manual_seed(0)
        net = tiny_bert(num_labels=3, num_hidden_layers=4).double()
        model = FineTuneModel(
            net, LoRA(rank=2, target_modules=["query"]), likelihood="categorical", num_data=20
        )
    else:
        model = _model(**options)
    rows = _block0_rows(model)
    # "short": a fit of less than two passes over the data (the cache's own pass would cost
    # more than it saves) -- 1.5 epochs here
    steps = {"short": pb.Optimization(num_steps=6)}.get(case)
    _fit(
        model,
        _Iterable(data) if case == "an iterable" else data,
        **({"optim": steps} if steps else {}),
    )
    if case == "short":
        assert rows == [5] * 6
        return
    # every step computes block 0 on its padded batch (at most a probe of one example before:
    # the trained embeddings are found by running one)
    assert rows[-12:] == [5] * 12 and rows[:-12] in ([], [1])


# ---------------------------------------------------------------------- causal LMs
def _lm_model(arch, dtype=torch.float64):
    """A three-block causal LM adapted in blocks 1-2 (block 0 and the embeddings cached),
    scoring continuations."""
    from tests.models.test_multiple_choice import NETS

    torch.manual_seed(0)
    layers = {"llama": {"num_hidden_layers": 3}, "gpt2": {"n_layer": 3}}[arch]
    net = NETS[arch](**layers).to(dtype)
    targets = {
        "llama": r".*layers\.[12]\.self_attn\.(q_proj|v_proj)",
        "gpt2": r".*h\.[12]\.attn\.c_attn",
    }
    return FineTuneModel(
        net,
        LoRA(rank=2, target_modules=targets[arch]),
        likelihood=MultipleChoice(normalize="length"),
        trainable_modules=[],
        num_data=6,
    )


def _lm_batches(side):
    from tests.models.test_multiple_choice import CHOICES, PROMPTS, CharTokenizer

    tok = CharTokenizer()
    encode = functools.partial(encode_multiple_choice, tok, padding_side=side)
    return [
        encode(PROMPTS, CHOICES, answers=[0, 1, 2]),
        encode(PROMPTS[::-1], [c[::-1] for c in CHOICES[::-1]], answers=[1, 0, 2]),
    ]


def _lm_block0_rows(model):
    rows: list[int] = []
    blocks = model.net.model.layers if hasattr(model.net, "model") else model.net.transformer.h
    blocks[0].mlp.register_forward_hook(lambda m, a, o: rows.append(int(a[0].shape[0])))
    return rows


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_causal_lm_fit_caches_its_choice_rows_and_equals_the_plain_fit(arch, side):
    """Multiple-choice rows (prompt + choice; position ids count the real tokens, so left
    padding is cached too): block 0 runs on each of the distinct rows once, and the fit is the
    plain one."""
    data = _lm_batches(side)
    model = _lm_model(arch)
    rows = _lm_block0_rows(model)
    guide = pb.posterior(model, "map")
    result = pb.fit(model, guide, data, epochs=3, lr=1e-2, seed=0)
    # the two batches' 18 rows are 9 distinct prompt + choice rows: one probe (and on left
    # padding two forwards of one row that find the network causal), then those 9
    probes = 3 if side == "left" else 1
    assert rows[:probes] == [1] * probes and sum(rows[probes:]) == 9
    plain_model = _lm_model(arch)
    plain_rows = _lm_block0_rows(plain_model)
    plain_guide = pb.posterior(plain_model, "map")
    with unshared():
        plain = pb.fit(plain_model, plain_guide, data, epochs=3, lr=1e-2, seed=0)
    assert plain_rows == [9] * 6  # 3 questions x 3 choices, every step
    # float64: rounding-level entries (~1e-16 relative) through six Adam steps
    torch.testing.assert_close(result.losses, plain.losses, rtol=1e-10, atol=0)
    for name, value in plain_guide.state_dict().items():
        torch.testing.assert_close(guide.state_dict()[name], value, rtol=0, atol=1e-10, msg=name)


def test_a_loop_of_ones_own_inside_the_cache_is_pb_fit_bit_for_bit():
    """docs/fitting.md: the step API inside ``model.caching_lower_blocks(data)`` gives the
    posterior pb.fit gives, bit for bit (float32)."""
    data = _batches()
    model = _model(dtype=torch.float32)
    guide, result = _fit(model, data)

    import pyro

    own_model = _model(dtype=torch.float32)
    own_guide = pb.posterior(own_model, "meanfield", init_scale=0.05)
    pyro.set_rng_seed(0)
    fitter = pb.infer.make_fitter(own_model, own_guide, lr=1e-2)
    own_model.train(True)
    losses = []
    with own_model.caching_lower_blocks(data):
        fitter.begin(data)
        for epoch in range(3):
            losses += [fitter.step(batch) for batch in data]
            fitter.epoch_end(epoch)
        fitter.end(data)
    assert torch.equal(torch.tensor(losses, dtype=result.losses.dtype), result.losses)
    for name, value in guide.state_dict().items():
        assert torch.equal(own_guide.state_dict()[name], value), name


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_validation_with_shared_prompts_is_not_read_from_the_cache(arch):
    """A fit's validation passes (gradients off) score choices from shared prompt states, whose
    forwards see other rows than the cached ones: they run their own lower blocks, and the
    validation history equals the plain fit's."""
    data, val = _lm_batches("left"), _lm_batches("left")[::-1]

    def fit(model):
        guide = pb.posterior(model, "map")
        validation = pb.Validation(data=val)
        return pb.fit(model, guide, data, epochs=3, lr=1e-2, seed=0, validation=validation)

    def steps_in_block0(model):  # block 0's calls with gradients on: the training steps'
        calls: list[int] = []
        blocks = model.net.model.layers if hasattr(model.net, "model") else model.net.transformer.h
        blocks[0].mlp.register_forward_hook(
            lambda m, a, o: calls.append(1) if torch.is_grad_enabled() else None
        )
        return calls

    model = _lm_model(arch)
    calls = steps_in_block0(model)
    result = fit(model)
    assert calls == []  # the cache served every training step
    plain_model = _lm_model(arch)
    plain_calls = steps_in_block0(plain_model)
    with unshared():
        plain = fit(plain_model)
    assert len(plain_calls) == 6
    # float64: rounding-level entries through six Adam steps (as above)
    torch.testing.assert_close(result.losses, plain.losses, rtol=1e-10, atol=0)
    history = result.state["validation"]
    plain_history = plain.state["validation"]
    assert len(history) == len(plain_history) == 3
    for ours, theirs in zip(history, plain_history, strict=True):
        assert ours["nll"] == pytest.approx(theirs["nll"], rel=1e-10)


# ---------------------------------------------------------------------- inputs of each example
def _pairs(batches):
    """``batches`` as sentence pairs: token type 1 on the second half of each row's real
    tokens (the segment embedding then changes the lower blocks' output)."""
    out = []
    for batch in batches:
        mask = batch["attention_mask"]
        real = mask.sum(1, keepdim=True)
        rank = mask.cumsum(1)  # 1..n on the real tokens (right padding)
        types = ((rank > real // 2) & (mask == 1)).long()
        out.append({**batch, "token_type_ids": types})
    return out


def _without_types(batch):
    return {k: v for k, v in batch.items() if k != "token_type_ids"}


def _steps_in_block0(model):
    """Block 0's calls with gradients on (the training steps'; a validation pass has them off)."""
    calls: list[int] = []
    model.net.bert.encoder.layer[0].attention.register_forward_hook(
        lambda m, a, o: calls.append(1) if torch.is_grad_enabled() else None
    )
    return calls


@pytest.mark.parametrize(
    "case",
    ["validation without token types", "other validation sentences", "some batches without"],
)
def test_each_examples_entry_is_computed_on_its_own_inputs(case):
    """Examples carrying other inputs (a sentence pair's token types; validation batches
    without them) are computed in forwards of their own: the first example of a forward no
    longer decides the inputs of all (without token types: silently; with them first: a
    KeyError), and the fit equals the plain one."""
    train = _pairs(_batches())
    val = [_without_types(b) for b in train]
    if case == "other validation sentences":  # sorting after the training sentences
        val = [{**b, "input_ids": torch.where(b["input_ids"] > 0, 95, 0)} for b in val]
    if case == "some batches without":
        train = [b if j % 2 else _without_types(b) for j, b in enumerate(train)]
        val = None

    def fit(model):
        validation = pb.Validation(data=val) if val is not None else None
        return _fit(model, train, validation=validation)

    model = _model()
    calls = _steps_in_block0(model)
    guide, result = fit(model)
    assert calls == []  # the cache served every training step
    plain_model = _model()
    with unshared():
        plain_guide, plain = fit(plain_model)
    # float64: rounding-level entries (~1e-16 relative) through twelve Adam steps (the first
    # test); an entry computed without its token types is off by O(1)
    torch.testing.assert_close(result.losses, plain.losses, rtol=1e-10, atol=0)
    for name, value in plain_guide.state_dict().items():
        torch.testing.assert_close(guide.state_dict()[name], value, rtol=0, atol=1e-10, msg=name)
    if val is not None:
        history, plain_history = result.state["validation"], plain.state["validation"]
        assert len(history) == len(plain_history) == 3
        for ours, theirs in zip(history, plain_history, strict=True):
            assert ours["nll"] == pytest.approx(theirs["nll"], rel=1e-10)


def test_token_types_and_positions_of_equal_values_are_other_examples():
    """One sentence with token types ``t`` and the same sentence with position ids ``t`` (and
    no token types) are two examples: each batch reads the lower blocks' output on its own
    inputs."""
    model = _model()
    found = model._first_adapted()
    assert found is not None
    ids = torch.tensor([[5, 17, 33, 8, 61, 2]])
    values = torch.tensor([[0, 0, 0, 1, 1, 1]])
    typed = {"input_ids": ids, "token_type_ids": values}
    positioned = {"input_ids": ids, "position_ids": values}
    cache = LowerBlockCache(model.net, found[0], found[1], [])
    assert cache.build([[typed, positioned]], dict, model.device)
    assert len(cache.entries) == 2
    block = model.net.bert.encoder.layer[found[1] - 1]
    recorded: list = []
    handle = block.register_forward_hook(lambda m, a, o: recorded.append(o))
    for batch in (typed, positioned):
        recorded.clear()
        with torch.no_grad():
            model.net(**batch)
        plain = recorded[0][0] if isinstance(recorded[0], tuple) else recorded[0]
        assembled = cache.output(batch)
        hidden = assembled[0] if isinstance(assembled, tuple) else assembled
        # float64, one row of the same length: the same forward, bit for bit up to kernels
        torch.testing.assert_close(hidden, plain, rtol=0, atol=1e-12)
    handle.remove()


# ---------------------------------------------------------------------- left padding, encoders
def _left_with_positions(batches):
    """Left-padded batches whose ``position_ids`` count the real tokens (0 on the padding)."""
    out = []
    for batch in batches:
        mask = batch["attention_mask"]
        positions = ((mask.cumsum(1) - 1) * mask).long()
        out.append({**batch, "position_ids": positions})
    return out


def test_left_padding_on_an_encoder_runs_the_plain_forward(caplog):
    """BERT pools position 0, a padding token under left padding, whose hidden states the
    plain forward computes from the real tokens (zeros in the cache's assembly): the fit on
    such batches runs every block, logs why once, and equals the plain fit."""
    data = _left_with_positions(_batches(left=True))
    assert bool((data[0]["attention_mask"][:, 0] == 0).any())  # position 0 is padding
    model = _model()
    rows = _block0_rows(model)
    with caplog.at_level(logging.INFO, logger="pyrobayes.models.lower_cache"):
        guide, result = _fit(model, data)
    plain_model = _model()
    with unshared():
        plain_guide, plain = _fit(plain_model, data)
    # float64, the same forwards: equal to rounding (~1e-16 relative); zeros in place of the
    # padding's hidden states moved the losses by up to 4e-4 relative
    torch.testing.assert_close(result.losses, plain.losses, rtol=1e-10, atol=0)
    for name, value in plain_guide.state_dict().items():
        torch.testing.assert_close(guide.state_dict()[name], value, rtol=0, atol=1e-10, msg=name)
    assert rows[-12:] == [5] * 12  # every step computes block 0 on its padded batch
    told = [r for r in caplog.records if "does not attend causally" in r.getMessage()]
    assert len(told) == 1 and told[0].levelno == logging.INFO


def test_left_padded_validation_not_read_ahead_runs_the_plain_forward():
    """Right-padded training data is cached; validation batches not read ahead (an iterable)
    holding the same sentences left padded are not assembled from the entries (zeros where
    BERT pools): the validation history equals the plain fit's."""
    data = _left_with_positions(_batches())  # positions 0..n-1 on the real tokens
    val = _Iterable(_left_with_positions(_batches(left=True)))

    def fit(model):
        return _fit(model, data, validation=pb.Validation(data=val))

    model = _model()
    calls = _steps_in_block0(model)
    _, result = fit(model)
    assert calls == []  # the training steps still read the cache
    with unshared():
        _, plain = fit(_model())
    # float64: rounding-level entries through twelve Adam steps, as above
    torch.testing.assert_close(result.losses, plain.losses, rtol=1e-10, atol=0)
    history, plain_history = result.state["validation"], plain.state["validation"]
    assert len(history) == len(plain_history) == 3
    for ours, theirs in zip(history, plain_history, strict=True):
        assert ours["nll"] == pytest.approx(theirs["nll"], rel=1e-10)


def test_hidden_states_tokens_first_turn_the_cache_off():
    """XLNet's blocks take and return (tokens, rows, width): the cache, which assembles
    (rows, tokens, width), is off (it failed inside the fit), and the fit is the plain one."""
    from transformers import XLNetConfig, XLNetForSequenceClassification

    def model():
        torch.manual_seed(0)
        config = XLNetConfig(
            vocab_size=99, d_model=32, n_layer=4, n_head=2, d_inner=37, pad_token_id=0, num_labels=3
        )
        net = XLNetForSequenceClassification(config).double()
        return FineTuneModel(
            net,
            LoRA(rank=2, target_modules=r".*layer\.[23]\.ff\.layer_1"),
            likelihood="categorical",
            num_data=20,
        )

    data = [_without_types(b) for b in _batches()]
    cached = model()
    found = cached._first_adapted()
    assert found is not None and found[1] == 2
    assert not LowerBlockCache(cached.net, found[0], found[1], []).build(
        [data], lambda b: {k: v for k, v in b.items() if k != "labels"}, cached.device
    )
    guide, result = _fit(cached, data)
    with unshared():
        plain_guide, plain = _fit(model(), data)
    # the same forwards (the cache is off): equal to rounding
    torch.testing.assert_close(result.losses, plain.losses, rtol=1e-10, atol=0)
