"""``pb.predict`` over a loader that drops or reorders examples says so.

The rows of a prediction are the loader's pass: with ``drop_last=True`` the last partial batch
is never predicted, and a shuffling loader returns the rows in a random order. Scoring against
``pred.targets`` stays right in the second case (collected in the same order); against the
dataset's own labels it is silently wrong (the README's train loader shuffles).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import pyrobayes as pb
from pyrobayes.predictive import ShuffledDataWarning
from tests.common import teacher_mlp


def _fitted() -> tuple[pb.models.FineTuneModel, object, TensorDataset]:
    model, x, y = teacher_mlp(130, num_data=130)
    guide = pb.posterior(model, "map")
    data = TensorDataset(x, y)
    pb.fit(model, guide, DataLoader(data, batch_size=50), epochs=3, lr=1e-2, seed=0)
    return model, guide, data


def test_drop_last_and_shuffle_are_told_and_an_ordered_loader_is_not() -> None:
    model, guide, data = _fitted()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ordered = pb.predict(model, guide, DataLoader(data, batch_size=50))
        pb.predict(model, guide, DataLoader(data, batch_size=65, drop_last=True))  # drops none
    assert ordered.log_probs.shape[1] == 130
    with pytest.warns(UserWarning, match=r"drop_last=True, so the last 30 of its 130 examples"):
        dropped = pb.predict(model, guide, DataLoader(data, batch_size=50, drop_last=True))
    assert dropped.log_probs.shape[1] == 100  # what the warning is about
    loader = DataLoader(
        data, batch_size=50, shuffle=True, generator=torch.Generator().manual_seed(1)
    )
    with pytest.warns(ShuffledDataWarning, match=r"pred.targets"):
        shuffled = pb.predict(model, guide, loader)
    assert not torch.equal(shuffled.targets, data.tensors[1])  # another order than the dataset's
    # scored against its own targets the shuffled prediction is the ordered one's
    report = pb.metrics.report(shuffled, shuffled.targets)
    assert report["nll"] == pytest.approx(pb.metrics.report(ordered, ordered.targets)["nll"])


def test_calibrate_on_a_shuffling_validation_loader_is_silent() -> None:
    model, guide, data = _fitted()  # calibrate scores against the prediction's own targets
    loader = DataLoader(data, batch_size=50, shuffle=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pb.calibrate(model, guide, loader)
