"""Plain ``torch.nn`` networks a user writes, and regression heads, built tiny in the test.

An ``nn.TransformerEncoder`` (batch first and sequence first, a ``src_key_padding_mask`` in the
batch) with its feed-forward ``linear1`` / ``linear2`` adapted, a CNN with BatchNorm and dropout
(also under ``train_backbone_mode``), LSTM / GRU encoders with a latent head, forwards that return
a tuple or a dict or take keyword / two positional inputs, weight- and spectral-normalised
layers, a head without bias, tied layers, and Gaussian regression heads ((B, 1) with (B,) and
(B, 1) targets, (B, D), a learned σ, a Hugging Face ``BertForSequenceClassification`` regressor).

Each is fitted (MAP and mean-field) and predicted; its draw-batched forward is checked against
the per-draw forwards in float64. Then the cases the sweep found: torch's fused encoder-layer
kernel, which reads the adapted layers' weights instead of calling them, and the lower-block
sharing on a plain network's own keyword inputs and on a sequence-first stack.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.batch import split_batch
from pyrobayes.models import FineTuneModel, LoRA, LoRAXS
from pyrobayes.models.layers import LoRALinear, LoRAXSLinear
from pyrobayes.models.sharing import unshared

#: the draws' predictions here come from networks as built, on purpose
pytestmark = pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")

CLASSES, ROWS, VOCAB, WIDTH = 3, 8, 50, 16


# ------------------------------------------------------------------------------------- networks
class Encoder(nn.Module):
    """Token embeddings, an ``nn.TransformerEncoder`` of 2 layers, a LayerNorm, a mean (or
    first-token) pool over the real tokens and a linear head; ``src_key_padding_mask`` is True
    at the padding, as torch's."""

    def __init__(
        self, batch_first: bool = True, out: int = CLASSES, pool: str = "mean", nested: bool = False
    ) -> None:
        super().__init__()
        self.batch_first, self.pool = batch_first, pool
        self.emb = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, 2, 32, dropout=0.1, batch_first=batch_first)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, out)

    def forward(self, input_ids: torch.Tensor, src_key_padding_mask: Any = None) -> torch.Tensor:
        h = self.emb(input_ids)
        h = h if self.batch_first else h.transpose(0, 1)
        h = self.enc(h, src_key_padding_mask=src_key_padding_mask)
        h = self.norm(h if self.batch_first else h.transpose(0, 1))
        if self.pool == "first" or src_key_padding_mask is None:
            return self.head(h[:, 0] if self.pool == "first" else h.mean(1))
        keep = (~src_key_padding_mask).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


class Recurrent(nn.Module):
    def __init__(self, kind: type[nn.Module], out: int = CLASSES) -> None:
        super().__init__()
        self.rnn = kind(5, 12, batch_first=True)
        self.head = nn.Linear(12, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


class Features(nn.Module):
    """``(features, logits)``; the subclasses return a dict or take other inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 12), nn.Tanh())
        self.head = nn.Linear(12, CLASSES)

    def forward(self, x: torch.Tensor) -> Any:
        f = self.body(x)
        return f, self.head(f)


class DictOut(Features):
    def forward(self, x: torch.Tensor) -> Any:
        f = self.body(x)
        return {"features": f, "logits": self.head(f)}


class Keywords(Features):
    def forward(self, x: torch.Tensor, z: torch.Tensor) -> Any:
        return self.head(self.body(x + z))


class TwoInputs(Features):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> Any:
        return self.head(self.body(a * b))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, CLASSES)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _cnn(out: int = CLASSES) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.2),
        nn.Flatten(), nn.Linear(4 * 6 * 6, 16), nn.ReLU(), nn.Linear(16, out),
    )  # fmt: skip


def _mlp(out: int = CLASSES, norm: str | None = None, head_bias: bool = True) -> nn.Module:
    net = nn.Sequential(
        nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, out, head_bias)
    )
    if norm == "weight":
        nn.utils.parametrizations.weight_norm(net[2])
    elif norm == "spectral":
        nn.utils.parametrizations.spectral_norm(net[2])
    return net


def _bert_regressor() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, num_labels=1,
        problem_type="regression", initializer_range=0.2,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


# -------------------------------------------------------------------------------------- batches
def _targets(g: torch.Generator, regression: Any) -> torch.Tensor:
    """Class labels (``regression`` falsy) or standard-normal targets of shape ``regression``."""
    if not regression:
        return torch.randint(0, CLASSES, (ROWS,), generator=g)
    return torch.randn(ROWS, *regression[1:], generator=g)


def _token_batches(regression: Any = None, length: int = 7, mask_key: str = "src_key_padding_mask"):
    """Two batches of token ids right-padded to ``length`` (the first row full)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(2):
        ids = torch.randint(1, VOCAB, (ROWS, length), generator=g)
        lengths = torch.randint(3, length + 1, (ROWS,), generator=g)
        lengths[0] = length
        pad = torch.arange(length) >= lengths[:, None]
        ids[pad] = 0
        mask = pad if mask_key == "src_key_padding_mask" else (~pad).long()
        out.append({"input_ids": ids, mask_key: mask, "labels": _targets(g, regression)})
    return out


def _tensor_batches(shape: tuple[int, ...], regression: Any = None, inputs: str = "x"):
    """Two ``(x, y)`` batches (``inputs="xz"``: dict batches ``{x, z, labels}``; ``"ab"``:
    ``((a, b), y)``)."""
    g = torch.Generator().manual_seed(0)
    out: list[Any] = []
    for _ in range(2):
        x, z = torch.randn(ROWS, *shape, generator=g), torch.randn(ROWS, *shape, generator=g)
        y = _targets(g, regression)
        out.append({"x": x, "z": z, "labels": y} if inputs == "xz" else ((x, z), y))
        if inputs == "x":
            out[-1] = (x, y)
    return out


#: name -> (network, batches, FineTuneModel options)
NETWORKS: dict[str, tuple[Callable[[], nn.Module], Callable[[], list], dict[str, Any]]] = {
    "transformer": (
        Encoder,
        _token_batches,
        {
            "adapter": LoRAXS(rank=2, target_modules=r"enc\.layers\.1\.linear[12]"),
            "trainable": ["head"],
        },
    ),
    "transformer-seq-first-head": (
        lambda: Encoder(batch_first=False),
        _token_batches,
        {"latent": ["head"], "trainable": []},
    ),
    "transformer-regression": (
        lambda: Encoder(out=1),
        lambda: _token_batches(regression=(ROWS,)),
        {
            "adapter": LoRAXS(rank=2, target_modules=r"enc\.layers\.1\.linear[12]"),
            "trainable": ["head"],
        },
    ),
    "cnn": (
        _cnn,
        lambda: _tensor_batches((1, 6, 6)),
        {"adapter": LoRAXS(rank=2, target_modules=["5"]), "trainable": ["7"]},
    ),
    "cnn-train-mode": (
        _cnn,
        lambda: _tensor_batches((1, 6, 6)),
        {
            "adapter": LoRAXS(rank=2, target_modules=["5"]),
            "trainable": ["7"],
            "train_backbone_mode": True,
        },
    ),
    "cnn-regression": (
        lambda: _cnn(1),
        lambda: _tensor_batches((1, 6, 6), regression=(ROWS,)),
        {"adapter": LoRAXS(rank=2, target_modules=["5"]), "trainable": ["7"]},
    ),
    "lstm": (lambda: Recurrent(nn.LSTM), lambda: _tensor_batches((4, 5)), {"latent": ["head"]}),
    "gru-regression": (
        lambda: Recurrent(nn.GRU, out=1),
        lambda: _tensor_batches((4, 5), regression=(ROWS, 1)),
        {"latent": ["head"]},
    ),
    "tuple-output": (
        Features,
        lambda: _tensor_batches((6,)),
        {
            "adapter": LoRAXS(rank=2, target_modules=["body.0"]),
            "trainable": ["head"],
            "output_key": 1,
        },
    ),
    "dict-output": (
        DictOut,
        lambda: _tensor_batches((6,)),
        {"adapter": LoRAXS(rank=2, target_modules=["body.0"]), "trainable": ["head"]},
    ),
    "keyword-inputs": (
        Keywords,
        lambda: _tensor_batches((6,), inputs="xz"),
        {"adapter": LoRAXS(rank=2, target_modules=["body.0"]), "trainable": ["head"]},
    ),
    "two-positional": (
        TwoInputs,
        lambda: _tensor_batches((6,), inputs="ab"),
        {"adapter": LoRAXS(rank=2, target_modules=["body.0"]), "trainable": ["head"]},
    ),
    "weight-norm": (
        lambda: _mlp(norm="weight"),
        lambda: _tensor_batches((6,)),
        {"adapter": LoRAXS(rank=2, target_modules=["2"]), "trainable": ["4"]},
    ),
    "spectral-norm": (
        lambda: _mlp(norm="spectral"),
        lambda: _tensor_batches((6,)),
        {"adapter": LoRAXS(rank=2, target_modules=["2"]), "trainable": ["4"]},
    ),
    "bias-free-head": (
        lambda: _mlp(head_bias=False),
        lambda: _tensor_batches((6,)),
        {"adapter": LoRAXS(rank=2, target_modules=["0"]), "latent": ["4"]},
    ),
    "tied-layers": (
        Tied,
        lambda: _tensor_batches((6,)),
        {"adapter": LoRA(rank=2, target_modules=["a", "b"]), "trainable": ["head"]},
    ),
    "regression-B-targets": (
        lambda: _mlp(1),
        lambda: _tensor_batches((6,), regression=(ROWS,)),
        {"adapter": LoRAXS(rank=2, target_modules=["0", "2"]), "trainable": ["4"]},
    ),
    "regression-B1-targets-learned-noise": (
        lambda: _mlp(1),
        lambda: _tensor_batches((6,), regression=(ROWS, 1)),
        {
            "adapter": LoRAXS(rank=2, target_modules=["0", "2"]),
            "trainable": ["4"],
            "obs_scale": "learn",
        },
    ),
    "regression-BD": (
        lambda: _mlp(2),
        lambda: _tensor_batches((6,), regression=(ROWS, 2)),
        {"adapter": LoRAXS(rank=2, target_modules=["0", "2"]), "trainable": ["4"]},
    ),
    "bert-regression": (
        _bert_regressor,
        lambda: _token_batches(regression=(ROWS,), mask_key="attention_mask"),
        {"adapter": LoRAXS(rank=2, target_modules=["query", "value"]), "trainable": "auto"},
    ),
}


def _model(name: str, dtype: torch.dtype = torch.float32) -> tuple[FineTuneModel, list]:
    """The model of :data:`NETWORKS` ``name`` in ``dtype``, and its batches in that dtype."""
    build, batches, options = NETWORKS[name]
    options = dict(options)
    torch.manual_seed(0)
    net = build().to(dtype).eval()
    regression = name.endswith("regression") or "regression-" in name
    kwargs: dict[str, Any] = {
        "likelihood": "gaussian" if regression else "categorical",
        "trainable_modules": options.pop("trainable", []),
        "latent_modules": options.pop("latent", ()),
    }
    adapter = options.pop("adapter", None)
    model = FineTuneModel(net, adapter, num_data=2 * ROWS, **kwargs, **options)
    cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    return model, [_map_tensors(b, cast) for b in batches()]


def _map_tensors(obj: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return fn(obj)


def _draws(model: FineTuneModel, num: int, scale: float = 0.5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        site: scale * torch.randn(num, *spec.shape, generator=g, dtype=torch.float64)
        for site, spec in model.latent_sites.items()
    }


def _per_draw(model: FineTuneModel, inputs: Any, values: dict[str, torch.Tensor]) -> torch.Tensor:
    num = next(iter(values.values())).shape[0]
    return torch.stack(
        [model.output(inputs, {k: v[s] for k, v in values.items()}) for s in range(num)]
    )


# ------------------------------------------------------------------------------ the smoke sweep
@pytest.mark.parametrize("name", sorted(NETWORKS))
def test_a_torch_network_fits_predicts_and_batches_its_draws(name) -> None:
    model, data = _model(name, torch.float64)
    model.eval()  # dropout off (train_backbone_mode turns it on in the fits)
    inputs, _ = split_batch(data[0], model.label_key)
    values = _draws(model, 3)
    with torch.no_grad():
        batched, each = model.batched_output(inputs, values), _per_draw(model, inputs, values)
    # float64: one forward of 3 draws against 3 forwards differs by rounding (measured <= 5e-16
    # on these networks); a draw applied to another row is O(1e-2) or more
    torch.testing.assert_close(batched, each, rtol=0, atol=1e-10)
    assert float((each[0] - each[1]).abs().max()) > 1e-4  # the draws reach the output

    norms = [m for m in model.net.modules() if isinstance(m, nn.BatchNorm2d)]
    stats = [(m.running_mean.clone(), m.running_var.clone()) for m in norms]
    for family in ("map", "meanfield"):
        guide = pb.posterior(model, family)
        pb.fit(model, guide, data, epochs=1, lr=1e-2, seed=0)
        pred = pb.predict(model, guide, data, num_samples=4, seed=0)
        if pred.loc is None:
            assert pred.log_probs is not None and pred.log_probs.shape == (
                pred.num_samples,
                2 * ROWS,
                CLASSES,
            )
            assert torch.isfinite(pred.log_probs).all()
            continue
        assert pred.targets is not None
        # the report's RMSE is that of the predictive mean, by hand (float64: rounding only)
        rmse = float((pred.loc.mean(0) - pred.targets).pow(2).mean().sqrt())
        assert pb.metrics.report(pred, pred.targets)["rmse"] == pytest.approx(rmse, rel=1e-9)
    # the frozen BatchNorm keeps its statistics, train_backbone_mode or not
    for m, (mean, var) in zip(norms, stats, strict=True):
        assert torch.equal(m.running_mean, mean) and torch.equal(m.running_var, var)


# ------------------------------------------------------------------ the cases the sweep found
def _padded_tokens(length: int = 7) -> dict[str, torch.Tensor]:
    """The inputs of one batch of :func:`_token_batches` (right padding, the first row full)."""
    inputs, _ = split_batch(_token_batches(length=length)[0])
    return inputs


@pytest.mark.parametrize(
    "adapter, latent",
    [
        (LoRAXS(rank=2, target_modules=["linear1", "linear2"]), []),
        (LoRA(rank=2, target_modules=["linear1", "linear2"]), []),
        (None, ["enc.layers.0.linear1", "enc.layers.1.linear2"]),
    ],
    ids=["lora-xs", "lora", "latent"],
)
def test_a_batch_first_encoder_layer_runs_its_adapted_feed_forward(adapter, latent) -> None:
    """In eval mode a batch-first ``nn.TransformerEncoderLayer`` reads ``linear1.weight``,
    ``linear2.weight`` (and its norms') to call torch's fused kernel, and an
    ``nn.TransformerEncoder`` given a padding mask reads its first layer's to build a nested
    tensor: an adapted feed-forward failed there with an ``AttributeError`` that blamed the
    adapted layers ("leave such a layer out of target_modules"), and a latent one's S draws
    reached the fused kernel. The layers now run their modules (torch's own training-mode
    path, the same function)."""
    torch.manual_seed(0)
    net = Encoder(nested=True).double().eval()
    model = FineTuneModel(net, adapter, num_data=ROWS, latent_modules=latent, trainable_modules=[])
    inputs = _padded_tokens()
    values = _draws(model, 3)
    with torch.no_grad():
        batched, each = model.batched_output(inputs, values), _per_draw(model, inputs, values)
        torch.backends.mha.set_fastpath_enabled(False)  # torch's unfused path: the reference
        try:
            reference = _per_draw(model, inputs, values)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
    # float64: a batched forward against single ones, and against torch's unfused path, differ
    # by rounding (measured <= 4e-16); the draws move the outputs by O(1e-1)
    torch.testing.assert_close(batched, each, rtol=0, atol=1e-10)
    torch.testing.assert_close(each, reference, rtol=0, atol=1e-10)
    assert float((each[0] - each[1]).abs().max()) > 1e-3


def test_a_plain_networks_own_keyword_inputs_are_cut_with_the_rows() -> None:
    """The blocks below the first adapted one run once on the batch's rows, their inputs cut
    from the S-fold batch. A Hugging Face model's are known by name (``input_ids``,
    ``attention_mask``, ...); a plain network's ``src_key_padding_mask`` stayed S-fold beside
    ``input_ids`` cut to B rows, and torch's shape check in the lower block stopped every
    forward of S > 1 draws (``AssertionError: Expected key_padded_mask.shape[0] to be 8, but
    got 24``), in a fit as in predict."""
    torch.manual_seed(0)
    net = Encoder(pool="first").double().eval()
    adapter = LoRAXS(rank=2, target_modules=r"enc\.layers\.1\.linear[12]")
    model = FineTuneModel(net, adapter, num_data=ROWS, trainable_modules=[])
    inputs = _padded_tokens()
    values = _draws(model, 3)
    rows: list[int] = []
    net.enc.layers[0].register_forward_hook(lambda m, a, o: rows.append(int(o.shape[0])))
    with torch.no_grad():
        batched = model.batched_output(inputs, values)
        assert rows == [ROWS]  # block 0 ran once, on the 8 rows (not on the 24 of 3 draws)
        with unshared():
            plain = model.batched_output(inputs, values)
        each = _per_draw(model, inputs, values)
    # float64: shared, unshared and per-draw forwards agree to rounding (measured 0)
    torch.testing.assert_close(batched, plain, rtol=0, atol=1e-10)
    torch.testing.assert_close(batched, each, rtol=0, atol=1e-10)
    assert float((each[0] - each[1]).abs().max()) > 1e-3


@pytest.mark.parametrize("length", [7, 8])  # 8: as many positions as the batch has rows
def test_a_sequence_first_stack_runs_its_draws_without_lower_sharing(length) -> None:
    """A ``batch_first=False`` stack passes ``(T, B, d)`` hidden states from block to block:
    the lower-block sharing, which expands a block's arguments along their leading axis,
    left them at B rows beside an S-fold ``src_key_padding_mask`` (torch's assertion stopped
    the forward), and with ``T == B`` would copy the positions. Such a stack runs the plain
    forward. (The adapted layers act on axis 1 here, ``sequence_first``, as the adapters of
    Longformer's sequence-first projections do.)"""
    torch.manual_seed(0)
    net = Encoder(batch_first=False).double().eval()
    adapter = LoRAXS(rank=2, target_modules=r"enc\.layers\.1\.linear[12]")
    model = FineTuneModel(net, adapter, num_data=ROWS, trainable_modules=[])
    for module in net.modules():  # (what the adapters of Longformer's attention are given)
        if isinstance(module, (LoRAXSLinear, LoRALinear)):
            module.sequence_first = True
    inputs = _padded_tokens(length)
    values = _draws(model, 2)
    with torch.no_grad():
        batched, each = model.batched_output(inputs, values), _per_draw(model, inputs, values)
    # float64: one forward of 2 draws against 2 single ones differs by rounding (measured 0)
    torch.testing.assert_close(batched, each, rtol=0, atol=1e-10)
    assert float((each[0] - each[1]).abs().max()) > 1e-3


def test_a_sequence_first_encoder_layer_applies_each_draw_to_its_own_rows() -> None:
    """``nn.TransformerEncoderLayer(batch_first=False)`` calls ``linear1`` / ``linear2`` on
    ``(T, S·B, d)``: each draw must act on axis 1. On axis 0 the draws split the positions:
    silently wrong when T is a multiple of S (2 draws, 8 positions), an error otherwise."""
    torch.manual_seed(0)
    net = Encoder(batch_first=False).double().eval()
    model = FineTuneModel(
        net, LoRAXS(rank=2, target_modules=["linear1", "linear2"]), num_data=ROWS,
        trainable_modules=[],
    )  # fmt: skip
    inputs = _padded_tokens(8)
    values = _draws(model, 2)
    with torch.no_grad():
        batched, each = model.batched_output(inputs, values), _per_draw(model, inputs, values)
    torch.testing.assert_close(batched, each, rtol=0, atol=1e-10)


def test_a_mean_and_scale_output_is_refused_as_unsupported_heteroscedastic_regression() -> None:
    """A regressor that returns ``(mean, log σ)`` per example, ``(B, 2)``, with one target per
    example: the Gaussian likelihood has one σ (``obs_scale``, fixed or learned), and the error
    asked for ``(B, 2)`` targets, as if the second column were a second target. It now says
    the columns are read as two means and that a predicted scale is not supported."""
    net = _mlp(2)
    model = FineTuneModel(
        net, LoRAXS(rank=2, target_modules=["0"]), likelihood="gaussian", num_data=2 * ROWS,
        trainable_modules=["4"],
    )  # fmt: skip
    data = _tensor_batches((6,), regression=(ROWS,))
    with pytest.raises(ValueError, match=r"\(mean, log σ\) pair per example\) is not supported"):
        pb.fit(model, pb.posterior(model, "map"), data, epochs=1)


def test_sigma_norm_members_of_a_sequence_first_encoder_layer_act_on_their_rows() -> None:
    """σN's member norms replace ``norm1`` / ``norm2`` of a ``batch_first=False`` encoder layer,
    which calls them on ``(T, S·B, d)``: the members stopped every forward of 2 members on 7
    positions ("expected the input's leading size to be a multiple of the 2 parameter
    sets")."""
    torch.manual_seed(0)
    net = Encoder(batch_first=False).double().eval()
    sigma_norm = pb.models.SigmaNorm(num_members=2, norm_modules=r"enc\.layers\.1\.norm[12]")
    model = FineTuneModel(net, sigma_norm, num_data=ROWS, trainable_modules=[])
    inputs = _padded_tokens(7)
    values = _draws(model, 2)
    with torch.no_grad():
        batched, each = model.batched_output(inputs, values), _per_draw(model, inputs, values)
    torch.testing.assert_close(batched, each, rtol=0, atol=1e-10)
    assert float((each[0] - each[1]).abs().max()) > 1e-3


class _AssertingPool(Encoder):
    """:class:`Encoder` whose pooling asserts that its mask holds a row per hidden state (a
    user's shape check, as torch's attention makes with ``assert``)."""

    def forward(self, input_ids: torch.Tensor, src_key_padding_mask: Any = None) -> torch.Tensor:
        h = self.norm(self.enc(self.emb(input_ids), src_key_padding_mask=src_key_padding_mask))
        assert src_key_padding_mask.shape[0] == h.shape[0], "one mask row per hidden state"
        keep = (~src_key_padding_mask).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


def test_an_assertion_above_the_shared_lower_blocks_runs_the_plain_forward() -> None:
    """The lower blocks run once on the B rows; a head that reads the (cut) mask again meets
    the S-fold hidden states. A RuntimeError there already fell back to the plain forward; a
    shape check written as ``assert`` stopped the forward instead."""
    torch.manual_seed(0)
    net = _AssertingPool().double().eval()
    model = FineTuneModel(
        net, LoRAXS(rank=2, target_modules=["enc.layers.1.linear1"]), num_data=ROWS,
        trainable_modules=[],
    )  # fmt: skip
    inputs, values = _padded_tokens(), _draws(model, 3)
    with torch.no_grad():
        batched, each = model.batched_output(inputs, values), _per_draw(model, inputs, values)
    torch.testing.assert_close(batched, each, rtol=0, atol=1e-10)
