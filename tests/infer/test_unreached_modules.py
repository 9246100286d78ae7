"""Modules holding latent or trained values that the loss's gradient never reaches: a fresh
fit warns after its first step, naming them (:func:`pyrobayes.infer.fit_checks.watching_reach`).

Such a module's values never reach the prediction, so a fit leaves them at their start (a point)
or at the prior (a latent site), silently. Longformer's last layer is the case found in the wild:
its classifier reads the ``[CLS]`` token, which attends globally through ``query_global`` /
``key_global`` / ``value_global``, so LoRA's default query/value targets there never reach it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

import pyrobayes as pb
from pyrobayes.infer import fit_checks
from pyrobayes.models import FineTuneModel, LoRA, LoRAXS

UNREACHED = "gradient never reached"
FAMILIES = ["ibdr", "ivon", "kron-ivon", "laplace", "map", "meanfield", "signorm", "swag",
            "symmetrized"]  # fmt: skip


def _data(vocab: int = 60, rows: int = 8, width: int = 8) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, width), generator=g)
    labels = torch.randint(0, 2, (rows,), generator=g)
    return [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}]


def _longformer() -> torch.nn.Module:
    config = transformers.LongformerConfig(
        vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, num_labels=2, attention_window=[4, 4],
        max_position_embeddings=64, pad_token_id=1,
    )  # fmt: skip
    return transformers.LongformerForSequenceClassification(config)


def _bert() -> torch.nn.Module:
    config = transformers.BertConfig(
        vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, num_labels=2,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def _model(net: torch.nn.Module, family: str, adapter: LoRA | LoRAXS) -> FineTuneModel:
    if family == "signorm":
        return pb.models.SigmaNormEnsemble(net, adapter, num_members=2, num_data=8)
    return FineTuneModel(net, adapter, num_data=8)


def _fit(model: FineTuneModel, family: str) -> list[str]:
    """The messages of the unreached-module warnings of a one-step fit."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pb.fit(model, pb.posterior(model, family), _data(), epochs=1, seed=0, progress=False)
    return [str(w.message) for w in record if UNREACHED in str(w.message)]


@pytest.mark.parametrize("family", FAMILIES)
def test_longformer_last_layer_query_value_are_named(family: str) -> None:
    torch.manual_seed(0)
    messages = _fit(_model(_longformer(), family, LoRA(rank=2)), family)
    assert len(messages) == 1, messages
    message = messages[0]
    assert "2 module(s)" in message, message
    for name in ("layer.1.attention.self.query", "layer.1.attention.self.value"):
        assert name in message, message
    assert "layer.0." not in message, message  # the first layer's reach the [CLS] token


@pytest.mark.parametrize("adapter", ["lora-AB", "lora-A", "lora-xs"])
@pytest.mark.parametrize("family", ["map", "meanfield", "signorm"])
def test_every_module_reached_is_not_warned_of(adapter: str, family: str) -> None:
    """Negative control on BERT. LoRA's B starts at zero, so A's gradient is zero in the first
    step (under ``latent="A"`` B is a point parameter inside the adapted layer): the check reads
    the gradient at a module's output, which the data term sends back whatever its factors."""
    torch.manual_seed(0)
    if adapter == "lora-xs":
        chosen: LoRA | LoRAXS = LoRAXS(rank=2)
    else:
        chosen = LoRA(rank=2, latent=adapter.split("-")[1])
    assert _fit(_model(_bert(), family, chosen), family) == []


def test_the_check_adds_no_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hooks on the step's own forward: a one-step fit runs the network as often with the check
    as without it."""

    def calls() -> int:
        torch.manual_seed(0)
        model = FineTuneModel(_bert(), LoRA(rank=2), num_data=8)
        count = [0]
        model.net.register_forward_pre_hook(lambda m, a: count.__setitem__(0, count[0] + 1))
        pb.fit(model, pb.posterior(model, "map"), _data(), epochs=1, seed=0, progress=False)
        return count[0]

    with_check = calls()
    monkeypatch.setattr(fit_checks, "_watched_modules", lambda model: {})
    assert with_check == calls() >= 1


class _ZeroesPadding(torch.nn.Module):
    """Wav2Vec2's classifier in small: its projector's output is zeroed at the padding in
    place (an ``index_put_`` with a 3-d mask), which a hook on the output tensor never sees."""

    def __init__(self) -> None:
        super().__init__()
        self.projector, self.classifier = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.projector(x)
        hidden[~mask.unsqueeze(-1).repeat(1, 1, hidden.shape[-1])] = 0.0
        return self.classifier(hidden.sum(1))


def test_an_output_changed_in_place_is_reached() -> None:
    """Before the probe copied each output, this warned that 'projector' was never reached
    (tiny Wav2Vec2 classifiers in tests/models/test_seq2seq_audio_architectures.py)."""
    torch.manual_seed(0)
    model = FineTuneModel(
        _ZeroesPadding(), LoRA(rank=2, target_modules=["projector"]), num_data=4,
        trainable_modules=["classifier"],
    )  # fmt: skip
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1, 3:] = False
    batch = {"x": torch.randn(4, 5, 4), "mask": mask, "labels": torch.tensor([0, 1, 0, 1])}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pb.fit(model, pb.posterior(model, "map"), [batch], epochs=1, seed=0, progress=False)
    assert not [w for w in record if UNREACHED in str(w.message)]
