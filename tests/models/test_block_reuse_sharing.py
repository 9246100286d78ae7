"""Where sharing the lower layers across draws is not the unshared computation, it is not done:
ALBERT's blocks that run more than once in a forward (shared layer groups, inner layers), a
stack holding one module twice, DeBERTa's batch-shared relative positions in a one-row batch,
and a pooled head that reads the un-expanded inputs (found once per network, not per call)."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers as tr

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRA, sharing
from pyrobayes.models.lower_cache import LowerBlockCache
from pyrobayes.models.sharing import first_adapted_block, lower_layers_shared, unshared
from tests.common import tiny_bert

#: these tests check the predictive's arithmetic on guides at their initialisation, on purpose;
#: the never-fitted warning itself is tested in tests/test_fitted_head.py
pytestmark = pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")

VOCAB = 60

#: (num_hidden_groups, inner_group_num, num_hidden_layers, adapted): the stack's blocks run
#: 0, 0, 1, 1 (group 0 twice below the adapted group 1) and 0, 1, 0, 1 (layer 0 again after
#: the adapted layer 1); the last is the control, each block once
ALBERT = {
    "groups": (2, 1, 4, r".*albert_layer_groups\.1\..*(query|value)"),
    "inner": (1, 2, 2, r".*albert_layers\.1\..*(query|value)"),
    "once": (2, 1, 2, r".*albert_layer_groups\.1\..*(query|value)"),
}


def _albert(case: str) -> FineTuneModel:
    groups, inner, layers, adapted = ALBERT[case]
    torch.manual_seed(0)
    config = tr.AlbertConfig(
        vocab_size=VOCAB,
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=layers,
        num_hidden_groups=groups,
        inner_group_num=inner,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=3,
        pad_token_id=0,
    )
    net = tr.AlbertForSequenceClassification(config).eval()
    return FineTuneModel(
        net, LoRA(rank=2, target_modules=adapted), num_data=16, trainable_modules=["classifier"]
    )


def _batches(num: int = 2, rows: int = 4, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Batches of token ids, right padded, with labels."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num):
        ids = torch.randint(2, VOCAB, (rows, 7), generator=gen)
        mask = torch.ones_like(ids)
        if rows > 1:
            mask[1, 4:] = 0
            ids[1, 4:] = 0
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids[:, 0] % 3})
    return batches


def _draws(model: FineTuneModel, num: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return {
        name: torch.randn(num, *spec.shape, generator=gen) * 0.5
        for name, spec in model.latent_sites.items()
    }


def _inputs(batch):
    return {k: v for k, v in batch.items() if k != "labels"}


@pytest.mark.parametrize("case", ["groups", "inner"])
def test_albert_blocks_run_twice_the_fit_cache_is_off_and_exact(case, caplog):
    model = _albert(case)
    found = model._first_adapted()
    assert found is not None and found[1] == 1
    data = _batches()
    cache = LowerBlockCache(model.net, list(found[0]), found[1], [])
    with caplog.at_level(logging.DEBUG, logger="pyrobayes.models.lower_cache"):
        assert not cache.build([data], _inputs, model.device)
    assert "runs more than once" in caplog.text or "runs after block" in caplog.text
    batch = _inputs(data[0])
    with torch.no_grad():
        with unshared():
            plain = model.batched_output(batch, _draws(model, 1))
        with model.caching_lower_blocks(data):
            cached = model.batched_output(batch, _draws(model, 1))
    torch.testing.assert_close(cached, plain, rtol=0, atol=1e-5)


def test_albert_blocks_running_once_keep_the_fit_cache():
    model = _albert("once")
    found = model._first_adapted()
    assert found is not None
    cache = LowerBlockCache(model.net, list(found[0]), found[1], [])
    assert cache.build([_batches()], _inputs, model.device)


@pytest.mark.parametrize("case", ["groups", "inner"])
def test_albert_blocks_run_twice_predict_and_fit_equal_the_unshared_path(case, caplog):
    model = _albert(case)
    data = _batches()
    batch = _inputs(data[0])
    values = _draws(model)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="pyrobayes.models.sharing"):
        shared = [model.batched_output(batch, values) for _ in range(2)]  # no crash in SDPA
        with unshared():
            plain = model.batched_output(batch, values)
    for out in shared:
        torch.testing.assert_close(out, plain, rtol=0, atol=1e-5)
    found = [r.getMessage() for r in caplog.records if "run for every draw" in r.getMessage()]
    assert len(found) == 1 and "block" in found[0]  # once per network, saying why
    # pb.predict's chunks of draws (the lower blocks' output kept per batch) and a fit whose
    # steps run S draws (the lower-block cache and S-fold sharing together)
    guide = pb.posterior(model, "meanfield", init_scale=0.3)
    got = pb.predict(model, guide, data, num_samples=4, samples_per_forward=2, seed=0)
    with unshared():
        ref = pb.predict(model, guide, data, num_samples=4, samples_per_forward=2, seed=0)
    torch.testing.assert_close(got.log_probs, ref.log_probs, rtol=0, atol=1e-5)
    results = []
    for context in (torch.enable_grad, unshared):
        fitted = _albert(case)
        guide = pb.posterior(fitted, "ibdr")
        with context():
            pb.fit(fitted, guide, data, epochs=2, lr=1e-2, seed=0)
        with unshared():
            results.append(pb.predict(fitted, guide, data, num_samples=2, seed=0).log_probs)
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=1e-5)


def test_a_stack_holding_one_module_twice_is_not_shared():
    torch.manual_seed(0)
    net = tiny_bert(num_labels=3, num_hidden_layers=4).eval()
    layers = net.bert.encoder.layer
    layers[2] = layers[0]  # block 0 also runs at depth 2
    names = ["bert.encoder.layer.3.attention.self.query.weight"]
    assert first_adapted_block(net, names) is None
    cache = LowerBlockCache(net, list(layers), 3, [])
    ids = torch.randint(3, 90, (2, 5))
    assert not cache.build([[{"input_ids": ids}]], dict, torch.device("cpu"))
    with pytest.raises(Exception, match="holds one module twice"):
        with lower_layers_shared(list(layers)[3:], 2, 4, list(layers)[:3]):
            pass


def _deberta() -> FineTuneModel:
    torch.manual_seed(0)
    config = tr.DebertaV2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=3,
        pad_token_id=0,
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
        position_buckets=16,
        max_relative_positions=-1,
    )
    net = tr.DebertaV2ForSequenceClassification(config).eval()
    adapted = r".*layer\.1\.attention\.self\.(query_proj|value_proj)"
    return FineTuneModel(net, LoRA(rank=2, target_modules=adapted), num_data=16)


@pytest.mark.parametrize("rows", [1, 4])
def test_deberta_one_row_batches_predict_as_unshared(rows):
    """DeBERTa's relative positions ``(1, L, L)`` are shared by the batch: a one-row batch
    cannot tell them from the row's tensors, and its lower layers run per draw."""
    model = _deberta()
    data = _batches(num=3, rows=rows)
    guide = pb.posterior(model, "meanfield", init_scale=0.3)
    got = pb.predict(model, guide, data, num_samples=4, seed=0)
    with unshared():
        ref = pb.predict(model, guide, data, num_samples=4, seed=0)
    torch.testing.assert_close(got.log_probs, ref.log_probs, rtol=0, atol=1e-5)
    with torch.no_grad():
        shared = model.batched_output(_inputs(data[0]), _draws(model))
        with unshared():
            plain = model.batched_output(_inputs(data[0]), _draws(model))
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-5)


def _decoder(arch: str) -> FineTuneModel:
    torch.manual_seed(0)
    config_type, net_type = {
        "llama": (tr.LlamaConfig, tr.LlamaForSequenceClassification),
        "qwen2": (tr.Qwen2Config, tr.Qwen2ForSequenceClassification),
    }[arch]
    config = config_type(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=3,
        pad_token_id=0,
    )
    adapted = r".*layers\.1\..*(q_proj|v_proj)"
    return FineTuneModel(
        net_type(config).eval(),
        LoRA(rank=2, target_modules=adapted),
        num_data=16,
        trainable_modules=["score"],
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_pooled_head_falls_back_once_per_network(arch, caplog):
    """The sequence classifier's head indexes with the un-expanded ``input_ids``: the shared
    forward loses the S-fold rows once, and every later call runs the network once."""
    model = _decoder(arch)
    guide = pb.posterior(model, "meanfield", init_scale=0.3)
    rows: list[int] = []
    model.net.register_forward_pre_hook(
        lambda m, a, kw: rows.append(int(kw["input_ids"].shape[0])), with_kwargs=True
    )
    data = _batches(num=3)
    with caplog.at_level(logging.INFO, logger="pyrobayes.models.sharing"):
        got = pb.predict(model, guide, data, num_samples=4, samples_per_forward=4, seed=0)
    assert rows == [4, 16, 16, 16]  # one wasted forward on the first batch, then one a call
    assert sum("S-fold rows" in r.getMessage() for r in caplog.records) == 1
    rows.clear()
    with unshared():
        ref = pb.predict(model, guide, data, num_samples=4, samples_per_forward=4, seed=0)
    assert rows == [16, 16, 16]
    torch.testing.assert_close(got.log_probs, ref.log_probs, rtol=0, atol=1e-5)
    assert model.tokens_per_draw(_inputs(data[0])) is None  # chunks sized for the full rows


def test_sharing_declines_are_kept_per_network():
    """Another network with the same architecture still shares its lower layers."""
    model, other = _albert("inner"), _albert("once")
    batch = _inputs(_batches()[0])
    with torch.no_grad():
        model.batched_output(batch, _draws(model))
    assert sharing._DECLINED.get(model._first_adapted()[0][1])
    found = other._first_adapted()
    assert found is not None and sharing._DECLINED.get(found[0][found[1]]) is None
    calls: list[int] = []
    block = found[0][0]
    block.register_forward_hook(lambda m, a, o: calls.append(int(a[0].shape[0])))
    with torch.no_grad():
        shared = other.batched_output(batch, _draws(other))
        with unshared():
            plain = other.batched_output(batch, _draws(other))
    assert calls == [4, 16]  # the lower group once on the un-expanded rows, then per draw
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-5)
