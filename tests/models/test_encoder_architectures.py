"""Hugging Face encoders beyond BERT, built tiny from their configs: DistilBERT, ELECTRA,
XLM-RoBERTa, MPNet, ModernBERT, Longformer and ConvBERT for sequence classification.

Which modules an adapter targets, padded rows against their unpadded selves, the lower layers
shared across draws against the unshared forward, a MAP fit that learns, Longformer's
sequence-first projections and ConvBERT's padding-reading convolution under the fit's
lower-block cache."""

from __future__ import annotations

import logging
import re

import pytest
import torch

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRA, LoRAXS
from pyrobayes.models.sharing import block_stack, unshared

transformers = pytest.importorskip("transformers")

#: the draws' predictions here come from a network as built, on purpose
pytestmark = pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")

VOCAB, CLASSES = 100, 3
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
    num_labels=CLASSES,
    initializer_range=0.2,  # outputs that move with their inputs (0.02 leaves them ~constant)
)


def _net(arch: str):
    """A tiny ``*ForSequenceClassification`` of ``arch`` (2 layers, width 32, 2 heads)."""
    t = transformers
    if arch == "distilbert":
        config = t.DistilBertConfig(
            vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64, num_labels=CLASSES,
            max_position_embeddings=64, pad_token_id=0, initializer_range=0.2,
        )  # fmt: skip
        return t.DistilBertForSequenceClassification(config)
    classes = {
        "electra": (t.ElectraConfig, t.ElectraForSequenceClassification, {"embedding_size": 16}),
        "xlm-roberta": (t.XLMRobertaConfig, t.XLMRobertaForSequenceClassification, {}),
        "mpnet": (t.MPNetConfig, t.MPNetForSequenceClassification, {}),
        "modernbert": (
            t.ModernBertConfig,
            t.ModernBertForSequenceClassification,
            {"global_attn_every_n_layers": 2, "local_attention": 8},
        ),
        "convbert": (t.ConvBertConfig, t.ConvBertForSequenceClassification, {"embedding_size": 32}),
        "longformer": (
            t.LongformerConfig,
            t.LongformerForSequenceClassification,
            {"attention_window": 4, "max_position_embeddings": 66},
        ),
    }
    config_class, model_class, extra = classes[arch]
    pad = 1 if arch in ("xlm-roberta", "mpnet", "longformer") else 0
    return model_class(config_class(**{**SMALL, "pad_token_id": pad, **extra}))


def _pad_id(net) -> int:
    return int(net.config.pad_token_id)


def _batches(pad: int, n: int = 4, rows: int = 6, width: int = 10) -> list[dict[str, torch.Tensor]]:
    """``n`` batches of right-padded rows of 3 to ``width`` tokens (the first row full)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(5, VOCAB, (rows, width), generator=g)
        ids[:, 0] = 3
        lengths = torch.randint(3, width + 1, (rows,), generator=g)
        lengths[0] = width
        mask = (torch.arange(width) < lengths[:, None]).long()
        ids[mask == 0] = pad
        out.append({"input_ids": ids, "attention_mask": mask, "labels": torch.arange(rows) % 3})
    return out


def _draws(model, num: int, scale: float = 0.5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        site: scale * torch.randn(num, *spec.shape, generator=g, dtype=torch.float64)
        for site, spec in model.latent_sites.items()
    }


#: arch -> (the leaf names of its attention query / value projections, adapted modules per layer)
TARGETS = {
    "distilbert": (["q_lin", "v_lin"], 2),
    "electra": (["query", "value"], 2),
    "xlm-roberta": (["query", "value"], 2),
    "mpnet": (["q", "v"], 2),
    "modernbert": (["Wqkv"], 1),  # fused query-key-value: one adapter updates all three
}


def _targets(net) -> list[str]:
    """The leaf names the default LoRA adapts (the attention projections)."""
    model = FineTuneModel(net, LoRA(rank=2), num_data=8)
    return sorted({s.module_path.rsplit(".", 1)[-1] for s in model.latent_sites.values()})


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_an_encoder_is_adapted_at_its_attention_and_scores_rows_as_unpadded(arch) -> None:
    names, per_layer = TARGETS[arch]
    torch.manual_seed(0)
    net = _net(arch).double().eval()
    # the default adapts each architecture's own attention query / value names
    assert _targets(_net(arch)) == sorted(names)
    # the top layer only: the layers below run once for every draw (``sharing``)
    top = [p for p, m in net.named_modules() if p.rsplit(".", 1)[-1] in names and ".1." in p]
    assert len(top) == per_layer
    model = FineTuneModel(net, LoRAXS(rank=2, target_modules=top), num_data=24)
    assert sorted({s.module_path for s in model.latent_sites.values()}) == sorted(top)
    values = _draws(model, 3)

    pad = _pad_id(net)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(5, VOCAB, (3, 7), generator=g)
    ids[:, 0] = 3
    plain = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    padded = {
        "input_ids": torch.cat([ids, torch.full((3, 5), pad)], 1),
        "attention_mask": torch.cat([torch.ones_like(ids), torch.zeros(3, 5, dtype=torch.long)], 1),
    }
    block0 = block_stack(net)[0]
    rows: list[int] = []
    block0.register_forward_hook(lambda m, a, o: rows.append(int(a[0].shape[0])))
    with torch.no_grad():
        shared = model.batched_output(padded, values)
        with unshared():
            reference = model.batched_output(padded, values)
        alone = model.batched_output(plain, values)
    assert rows[0] == 3  # block 0 ran once on the 3 rows, not on the 9 of 3 draws
    # float64: padded rows, their unpadded selves and the unshared forward agree to rounding
    # (measured <= 2e-15 on these networks; 1e-10 leaves room, a padding leak is O(1e-1))
    assert float((shared - reference).abs().max()) < 1e-10
    assert float((shared - alone).abs().max()) < 1e-10
    spread = float((shared[0] - shared[1]).abs().max())
    assert spread > 1e-3  # the draws reach the output: the adapters act

    # a MAP fit on one padded batch learns: its loss falls over a few steps
    batch = _batches(pad, n=1)[0]
    fitter = pb.infer.make_fitter(model, pb.posterior(model, "map"), lr=0.05)
    fitter.begin([batch])
    losses = [float(fitter.step(batch)) for _ in range(6)]
    assert all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    "adapter, latent",
    [
        (LoRAXS(rank=2, target_modules=["query", "value"], init_scale=0.3), []),
        (LoRA(rank=2, target_modules=["query", "value"]), []),
        (None, ["longformer.encoder.layer.0.attention.self.query"]),
    ],
    ids=["lora-xs", "lora", "latent-layer"],
)
def test_longformer_applies_each_draw_to_its_own_rows(adapter, latent) -> None:
    """Longformer's self-attention calls its projections on ``(T, S·B, d)``: each draw must
    act on its rows (axis 1). Before, the S draws split axis 0, the positions: 3 draws on 8
    positions stopped with an error blaming a shared table, and 2 draws were silently wrong
    (0.36 off the per-draw forwards on outputs of scale 3)."""
    torch.manual_seed(0)
    net = _net("longformer").double().eval()
    model = FineTuneModel(net, adapter, num_data=8, latent_modules=latent)
    ids = torch.randint(5, VOCAB, (3, 8), generator=torch.Generator().manual_seed(2))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    for num in (2, 3):  # 8 positions: a multiple of 2 (silently wrong before), not of 3
        values = _draws(model, num)
        with torch.no_grad():
            batched = model.batched_output(inputs, values)
            each = torch.stack(
                [model.output(inputs, {k: v[s] for k, v in values.items()}) for s in range(num)]
            )
        # float64: one batched forward against S single ones differ by rounding (~1e-15)
        torch.testing.assert_close(batched, each, rtol=0, atol=1e-10)
        assert float((each[0] - each[1]).abs().max()) > 1e-3  # the draws differ


@pytest.mark.parametrize("arch, cached", [("convbert", False), ("electra", True)])
def test_the_lower_block_cache_runs_plain_where_the_lower_blocks_read_padding(
    arch, cached, caplog
) -> None:
    """ConvBERT's span-based convolution reads the padding: the cache's entries, computed on
    each example's real tokens, are another function than the padded batches' (the fit's loss
    moved by 0.88 of ~40 against the plain fit). The cache then runs the plain forward; ELECTRA,
    whose padded rows equal their unpadded selves, keeps it."""

    def fit():
        torch.manual_seed(0)
        net = _net(arch)
        top = [p for p, _ in net.named_modules() if re.search(r"\.1\..*\.(query|value)$", p)]
        model = FineTuneModel(net, LoRAXS(rank=2, target_modules=top, init_scale=0.1), num_data=24)
        rows: list[int] = []
        inside = next(block_stack(net)[0].children())  # a stubbed block still calls its hooks
        inside.register_forward_hook(lambda m, a, o: rows.append(1))
        result = pb.fit(model, pb.posterior(model, "map"), _batches(_pad_id(net)), epochs=3, seed=0)
        return torch.as_tensor(result.losses).detach().clone(), len(rows)

    with caplog.at_level(logging.INFO, logger="pyrobayes.models.lower_cache"):
        losses, calls = fit()
    with unshared():
        plain, plain_calls = fit()
    told = [r for r in caplog.records if "reads it" in r.getMessage()]
    assert bool(told) != cached
    # 12 steps run block 0 twelve times without the cache; with it, only its build does (a
    # probe, then one forward per length of the 24 examples: at most 9)
    assert plain_calls == 12 and (calls < 12) == cached
    # float32 sums of ~40: the cached entries differ from the padded forward by rounding
    # (~1e-6 relative), 1e-4 absolute leaves room; ConvBERT's leak moved them by 0.88
    torch.testing.assert_close(losses, plain, rtol=0, atol=1e-4)
