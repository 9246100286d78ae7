"""Where the prediction is in a network's output: a plain network that returns several items is
refused until ``output_key`` says which, and with it every family fits and predicts what the same
network returning its logits alone gives."""

from __future__ import annotations

import copy

import pyro
import pytest
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRA
from pyrobayes.models.likelihoods import network_output


class Features(nn.Module):
    """``(features, logits)``, or what ``wrap`` makes of them."""

    def __init__(self, wrap=None) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)
        self.wrap = wrap

    def forward(self, x):
        h = torch.relu(self.body(x))
        logits = self.head(h)
        return (h, logits) if self.wrap is None else self.wrap(h, logits)


class HFStyle(Features):
    """A Hugging Face-like network (``base_model_prefix``): its tuple holds the logits first."""

    base_model_prefix = "body"

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.head(h), h


def _model(net, **kwargs) -> FineTuneModel:
    return FineTuneModel(
        net,
        LoRA(rank=2, target_modules=["body"]),
        num_data=32,
        trainable_modules=["head"],
        **kwargs,
    )


def _data():
    torch.manual_seed(0)
    return [(torch.randn(32, 4), torch.randint(0, 3, (32,)))]


def test_a_plain_network_with_several_outputs_is_refused_until_told_where_the_logits_are():
    torch.manual_seed(0)
    model = _model(Features())
    guide = pb.posterior(model, "map")
    with pytest.raises(
        TypeError, match=r"tuple of 2 items \(Tensor \(32, 8\), Tensor \(32, 3\)\).*output_key"
    ):
        pb.fit(model, guide, _data(), epochs=1)


@pytest.mark.parametrize(
    ("wrap", "key"),
    [
        (None, 1),
        (None, lambda out: out[1]),
        (lambda h, z: {"features": h, "scores": z}, "scores"),
        (lambda h, z: (z,), None),  # a 1-tuple: its only item
        (lambda h, z: {"logits": z, "features": h}, None),  # a mapping's "logits"
    ],
)
@pytest.mark.parametrize("family", ["meanfield", "laplace"])
def test_the_selected_output_gives_what_the_logits_alone_give(wrap, key, family):
    """Same weights, same seeds: the fit's losses and the predictive equal those of the network
    returning its logits alone (``output_key=lambda out: out[1]`` on the plain tuple is the
    reference), bit for bit. Laplace reads the output in its own network wrapper."""
    results = []
    for net_wrap, net_key in ((wrap, key), (None, lambda out: out[1])):
        torch.manual_seed(1)
        net = Features(net_wrap)
        pyro.clear_param_store()
        model = _model(net, output_key=net_key)
        guide = pb.posterior(model, family)
        fit = pb.fit(model, guide, _data(), epochs=2)
        pred = pb.predict(model, guide, _data(), num_samples=3, seed=0)
        results.append((fit.losses, pred.log_probs))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)


def test_a_hugging_face_tuple_is_read_by_its_first_item():
    torch.manual_seed(0)
    net = HFStyle()
    twin = copy.deepcopy(net)
    model = _model(net)
    x, _ = _data()[0]
    values = {s: 0.1 * torch.ones(v.shape) for s, v in model.init_values().items()}
    out = model.output(x, values)
    assert out.shape == (32, 3)
    # the same as the logits read explicitly
    torch.testing.assert_close(out, _model(twin, output_key=0).output(x, values), rtol=0, atol=0)


def test_bad_output_keys_are_refused_by_name():
    with pytest.raises(TypeError, match="output_key must be an index"):
        _model(Features(), output_key=1.5)
    with pytest.raises(TypeError, match=r"output_key='features' selected a tuple"):
        network_output({"features": (torch.ones(1),)}, "features")
    with pytest.raises(TypeError, match="Pass FineTuneModel\\(..., output_key=...\\)"):
        network_output({"scores": torch.ones(1)})
