"""A post-hoc Laplace (``epochs=0`` at a MAP) sums its curvature over exactly the examples it
is given. In one process nothing counted them: the curvature of a subset of the training set,
or of the validation split passed by mistake, came out without a word (a hunt on digits, MAP on
500 examples: τ 5.8 and a posterior sd of 0.28 over the training set; 27.6 and 0.18 over 100 of
its examples; 80.6 and 0.11 over 100 validation examples). The same fit with an epoch warned.
Now the pass is counted where that costs no read of the data (a list of batches, a
``DataLoader`` by its sampler) and checked against ``num_data``."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, Subset, SubsetRandomSampler, TensorDataset

import pyrobayes as pb
from pyrobayes.testing import tiny_problem

pytest.importorskip("laplace")


def _map_and_data() -> tuple[object, list, TensorDataset]:
    model, batches = tiny_problem(seed=0)
    assert model.num_data == sum(int(x.shape[0]) for x, _ in batches) == 24  # batches of 8
    guide = pb.posterior(model, "map")
    pb.fit(model, guide, batches, epochs=2, lr=1e-2)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    return model, batches, TensorDataset(x, y)


def _laplace(model: object, data: object, about: str = "num_data") -> list[str]:
    """The warnings about ``about`` of a post-hoc Laplace fit on ``data``."""
    guide = pb.posterior(model, "laplace")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pb.fit(model, guide, data, epochs=0)
    return [str(w.message) for w in seen if about in str(w.message)]


def test_a_post_hoc_laplace_on_part_of_the_training_data_warns() -> None:
    model, batches, dataset = _map_and_data()
    assert _laplace(model, batches) == []  # the whole training set: silent
    assert _laplace(model, DataLoader(dataset, batch_size=8)) == []
    assert _laplace(model, DataLoader(dataset, batch_size=8, shuffle=True)) == []
    assert _laplace(model, DataLoader(dataset, batch_size=5)) == []  # a short last batch

    (one,) = _laplace(model, batches[:1])  # a list: counted (8 of 24)
    assert "yielded 8 examples, but the model's num_data is 24" in one
    assert "the MAP was fitted" in one
    (sub,) = _laplace(model, DataLoader(Subset(dataset, range(10)), batch_size=4))
    assert "yielded 10 examples" in sub
    # a sampler over part of the dataset: the sampler's length, not the dataset's (24)
    sampler = SubsetRandomSampler(list(range(11)))
    (part,) = _laplace(model, DataLoader(dataset, batch_size=4, sampler=sampler))
    assert "yielded 11 examples" in part
    # drop_last: 15 examples (not < 24 / 2: silent) in batches of 10 read 10
    assert _laplace(model, DataLoader(Subset(dataset, range(15)), batch_size=10)) == []
    short = DataLoader(Subset(dataset, range(15)), batch_size=10, drop_last=True)
    (dropped,) = _laplace(model, short)
    assert "yielded 10 examples" in dropped


def test_a_post_hoc_laplace_on_more_than_num_data_warns_that_it_is_too_wide() -> None:
    model, batches, _ = _map_and_data()
    (more,) = _laplace(model, batches + batches)  # 48 examples of a 24-example model
    assert "yielded 48 examples" in more and "too wide" in more


def test_a_curvature_loader_that_drops_its_last_examples_warns() -> None:
    """A training loader's ``drop_last=True`` left its last examples out of every curvature
    pass, under the half-of-num_data check (249 examples in batches of 50: the curvature 0.77
    of the full pass's, the linearised predictive 25% wider, in silence; a hunt)."""
    model, _, dataset = _map_and_data()
    drops = DataLoader(dataset, batch_size=10, shuffle=True, drop_last=True)  # 20 of 24
    assert _laplace(model, drops, about="num_data") == []  # not under half: that check is silent
    (told,) = _laplace(model, drops, about="drop_last")
    assert "the last 4 of its 24 examples are left out of the curvature" in told
    assert _laplace(model, DataLoader(dataset, batch_size=8, drop_last=True), "drop_last") == []
