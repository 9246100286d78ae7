"""What ``to_datatree`` / ``diagnose`` accept: the data's order over several passes, the draws'
options, the loss trace.

A posterior larger than ``max_site_numel`` is drawn in chunks, each evaluated on a new pass over
the data; a shuffling loader paired the later chunks' draws with other examples than
``observed_data`` (the export's pointwise log-likelihood scrambled, ``az.loo`` changed, the
calibration report of ``diagnose`` wrong), silently.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import pyrobayes as pb
import pyrobayes.diagnostics.khat as khat_module
from pyrobayes.diagnostics.export import to_datatree
from pyrobayes.diagnostics.khat import diagnose
from pyrobayes.guides import MeanFieldGuide
from pyrobayes.models import LoRAXS

from .common import mlp_problem, split_batches

#: the guides are used at their initialisation, on purpose
pytestmark = pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")

NUM_DATA = 48


def _problem(constant_labels: bool = False):
    prob = mlp_problem(
        (4, 6, 3), LoRAXS(rank=2, target_modules=["0"]), num_data=NUM_DATA, seed=0, data_seed=1
    )
    y = torch.zeros_like(prob.y) if constant_labels else prob.y
    return prob.model, MeanFieldGuide(prob.model, init_scale=0.3), prob.x, y


class _Permuted:
    """Re-iterable batches of ``(x, y)`` in a new random order on every pass (no DataLoader)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch: int = 16) -> None:
        self.x, self.y, self.batch = x, y, batch
        self.generator = torch.Generator().manual_seed(0)

    def __iter__(self):
        order = torch.randperm(len(self.x), generator=self.generator)
        return iter(split_batches(self.x[order], self.y[order], self.batch))


class _Shrinking:
    """Re-iterable batches whose passes after the first whole one leave out the last batch."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.batches = split_batches(x, y, 16)
        self.passed = False

    def __iter__(self):
        yield from self.batches[:-1] if self.passed else self.batches
        self.passed = True


def test_a_shuffling_loader_is_refused_when_the_draws_take_several_passes():
    model, guide, x, y = _problem()
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    # max_site_numel=2: the core's 4 scalars are drawn 2 draws per chunk, 2 passes over data
    with pytest.raises(ValueError, match=r"a DataLoader that shuffles .* 2 chunks .*shuffle=False"):
        to_datatree(model, guide, loader, num_samples=4, max_site_numel=2)

    # refused before any draw is evaluated: no example was read
    class Counting(TensorDataset):
        reads = 0

        def __getitem__(self, index):
            Counting.reads += 1
            return super().__getitem__(index)

    counting = DataLoader(Counting(x, y), batch_size=16, shuffle=True)
    with pytest.raises(ValueError, match="a DataLoader that shuffles"):
        to_datatree(model, guide, counting, num_samples=4, max_site_numel=2)
    assert Counting.reads == 0


def test_an_ordered_loader_over_several_passes_gives_the_list_of_batches_export():
    model, guide, x, y = _problem()
    kw = dict(num_samples=4, max_site_numel=2, seed=3)
    ordered = to_datatree(model, guide, DataLoader(TensorDataset(x, y), batch_size=16), **kw)
    listed = to_datatree(model, guide, split_batches(x, y, 16), **kw)
    np.testing.assert_array_equal(ordered["observed_data"]["obs"].values, y.numpy())
    np.testing.assert_allclose(
        ordered["log_likelihood"]["obs"].values, listed["log_likelihood"]["obs"].values
    )


def test_one_pass_over_a_shuffling_loader_stays_consistent():
    # one chunk of draws, one pass: its targets and its log-likelihoods come in the same order
    model, guide, x, y = _problem()
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    idata = to_datatree(model, guide, loader, num_samples=4, seed=3)
    observed = idata["observed_data"]["obs"].values
    assert sorted(observed.tolist()) == sorted(y.tolist())


@pytest.mark.parametrize("constant_labels", [False, True])
def test_a_re_iterable_in_another_order_on_each_pass_is_refused(constant_labels):
    # with one label for all examples the targets agree on every pass: the inputs tell
    model, guide, x, y = _problem(constant_labels)
    with pytest.raises(ValueError, match=r"same examples in the same order"):
        to_datatree(model, guide, _Permuted(x, y), num_samples=4, max_site_numel=2)


def test_a_later_pass_with_fewer_batches_is_refused():
    model, guide, x, y = _problem()
    with pytest.raises(ValueError, match=r"2 batches instead of 3"):
        to_datatree(model, guide, _Shrinking(x, y), num_samples=4, max_site_numel=2)


def test_diagnose_refuses_a_shuffling_loader_over_several_passes(monkeypatch):
    model, guide, x, y = _problem()
    monkeypatch.setattr(khat_module, "DEFAULT_MAX_SITE_NUMEL", 2)  # as a posterior of > 10,000
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    with pytest.raises(ValueError, match=r"shuffle=False"):
        diagnose(model, guide, loader, num_samples=30, num_predictive_samples=30)
    ordered = DataLoader(TensorDataset(x, y), batch_size=16)
    chunked = diagnose(model, guide, ordered, num_samples=30, num_predictive_samples=30)
    assert chunked.num_examples == NUM_DATA


@pytest.mark.parametrize("value", [0, -1])
@pytest.mark.parametrize("export", [True, False])
def test_samples_per_forward_below_one_is_refused(export, value):
    # it left the per-draw loop empty: no log-likelihood groups, an ELBO without the data
    model, guide, x, y = _problem()
    data = split_batches(x, y, 16)
    with pytest.raises(ValueError, match=r"samples_per_forward must be an integer >= 1"):
        if export:
            to_datatree(model, guide, data, num_samples=4, samples_per_forward=value)
        else:
            diagnose(model, guide, data, num_samples=30, samples_per_forward=value)


def test_samples_per_forward_and_num_samples_must_be_integers():
    model, guide, x, y = _problem()
    data = split_batches(x, y, 16)
    with pytest.raises(TypeError, match=r"samples_per_forward must be an integer"):
        to_datatree(model, guide, data, num_samples=4, samples_per_forward=2.5)
    with pytest.raises(TypeError, match=r"num_samples must be an integer"):
        to_datatree(model, guide, data, num_samples=True)


@pytest.mark.parametrize("losses", [[[1.0, 2.0], [3.0, 4.0]], 3.0])
def test_a_loss_trace_that_is_not_1d_is_refused(losses):
    model, guide, x, y = _problem()
    with pytest.raises(ValueError, match=r"losses must be 1-D"):
        to_datatree(model, guide, split_batches(x, y, 16), num_samples=4, losses=losses)


def test_a_fit_result_as_losses_is_refused_with_its_losses_named():
    model, guide, x, y = _problem()
    data = split_batches(x, y, 16)
    result = pb.fit(model, guide, data, epochs=1, progress=False)
    with pytest.raises(TypeError, match=r"pass its \.losses"):
        to_datatree(model, guide, data, num_samples=4, losses=result)
    idata = to_datatree(model, guide, data, num_samples=4, losses=result.losses)
    assert idata["optimization"]["loss"].shape == (len(result.losses),)
