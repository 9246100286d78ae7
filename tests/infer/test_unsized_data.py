"""Data without ``len()`` (an ``IterableDataset``, a re-iterable generator of batches): an exact
resume, and under ``torch.distributed`` ranks whose data end apart stop together.

**Resume.** A fit resumed mid-epoch skips the batches done. Data that draw their order from
the global generators as they are read (``torch.randperm``, ``random.shuffle``,
``np.random.permutation`` in ``__iter__``) drew it from wherever the fit's own draws had left
those generators, so the resumed epoch replayed another order, silently: measured before the
fix on the 3-epoch fit below, interrupted after step 7 and resumed, the step losses differed
from the uninterrupted run's by up to 10.8 (torch), 13.4 (random), 6.9 (NumPy) and 13.4 (a
generator of batches shuffled with ``random``), with no warning. Now every read of the data is
made on streams of their own seeded from the fit's seed and the epoch, and a resume is
bit-identical; data whose order fit cannot seed (a generator of the dataset's own) warn at the
resume, naming the dataset.

**Distributed.** With ``len()``, the ranks compare their batches per epoch before the first
step; without it, a rank whose data ended first went on to its epoch's end work and the next
epoch while the others waited in a step's all-reduce, or whose read ending the epoch raised
stepped alone. Measured before the fix with the 2 gloo ranks below (timeout 10 s): rank 1
with a batch fewer, rank 1's end read raising, and the step budget spent at rank 1's epoch
end but not rank 0's each ended in gloo's timeout error (or ranks whose steps of two epochs
were all-reduced together). Now every rank stops with an error naming the ranks, at the cost
of one all-reduce of a float64 and one gather per epoch (none per step).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pyro
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import pyrobayes as pb
from pyrobayes.infer import grouped
from tests.common import COUNTED, counting_collectives, run_gloo_rank, run_two_gloo_ranks
from tests.infer import kill_fit

#: the step after which the interrupted fit stops (its newest checkpoint: step 6, batch 1 of
#: epoch 1, 5 batches an epoch)
STOP = 7


class _Shuffled(IterableDataset):
    """Examples in an order drawn when iterated: from torch's, Python's or NumPy's global
    generator, or from a NumPy generator of the dataset's own (``"own"``; ``"epoch"``: one
    seeded from the epoch that ``set_epoch`` gives)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, how: str) -> None:
        self.x, self.y, self.how = x, y, how
        self.rng, self.epoch = np.random.default_rng(0), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        n = len(self.x)
        if self.how == "torch":
            order = torch.randperm(n).tolist()
        elif self.how == "random":
            order = random.sample(range(n), n)
        elif self.how == "numpy":
            order = np.random.permutation(n).tolist()
        elif self.how == "epoch":
            order = np.random.default_rng(self.epoch).permutation(n).tolist()
        else:
            order = self.rng.permutation(n).tolist()
        for i in order:
            yield self.x[i], self.y[i]


class _Batches:
    """A re-iterable generator of batches of 8 (no ``len()``), shuffled with ``random``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __iter__(self) -> Any:
        order = list(range(len(self.x)))
        random.shuffle(order)
        for k in range(0, len(order), 8):
            yield self.x[order[k : k + 8]], self.y[order[k : k + 8]]


def _fit(how: str, **kw: Any) -> tuple[torch.Tensor, tuple[float, float]]:
    """kill_fit's meanfield fit (3 epochs, 5 batches each) over the data ``how`` shuffles: its
    losses, and a draw of Python's and NumPy's global generators after it."""
    pyro.set_rng_seed(0)
    model, guide, loader = kill_fit.problem("meanfield")
    x, y = loader.dataset.tensors
    data = _Batches(x, y) if how == "batches" else DataLoader(_Shuffled(x, y, how), batch_size=8)
    result = pb.fit(model, guide, data, epochs=3, seed=7, **grouped(progress_bar=False, **kw))
    return result.losses, (random.random(), float(np.random.random()))


def _interrupted_and_resumed(how: str, folder: Path) -> tuple[Any, Any]:
    def stop(step: int, loss: float) -> None:
        if step == STOP:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _fit(how, checkpoint_dir=folder, checkpoint_every=1, callback=stop)
    return _fit(how, checkpoint_dir=folder, resume=True)


@pytest.mark.parametrize("how", ["torch", "random", "numpy", "batches", "epoch"])
def test_a_resume_over_data_shuffled_as_read_is_exact(tmp_path, how):
    """Bit-identical losses (before: up to 13.4 apart), no warning, and Python's and NumPy's
    global generators left where the uninterrupted fit leaves them (the checkpoint saves the
    fit's states, not the data's mid-epoch ones). ``"epoch"``: a dataset generator seeded in
    ``set_epoch``, which fit calls before each epoch."""
    losses, after = _fit(how)
    resumed, resumed_after = _interrupted_and_resumed(how, tmp_path)  # (warnings are errors)
    assert torch.equal(resumed, losses)
    assert resumed_after == after


def test_a_resume_over_a_datasets_own_generator_warns(tmp_path):
    """A NumPy generator the dataset holds (fit cannot seed it): the resumed epoch replays
    another order, and the resume says so, naming the dataset."""
    losses, _ = _fit("own")
    with pytest.warns(UserWarning, match=r"resumed after 1 batch of epoch 1.*DataLoader over _S"):
        resumed, _ = _interrupted_and_resumed("own", tmp_path)
    assert not torch.equal(resumed, losses)  # what the warning is about


def test_fit_calls_a_datasets_set_epoch():
    """A dataset with ``set_epoch`` (an iterable dataset of Hugging Face ``datasets``) is told
    each epoch (before: only samplers were), so its own generator can follow the epoch."""
    model, guide, loader = kill_fit.problem("map")
    dataset = _Shuffled(*loader.dataset.tensors, "epoch")
    pb.fit(model, guide, DataLoader(dataset, batch_size=8), epochs=3, seed=7, progress=False)
    assert dataset.epoch == 2


# ---------------------------------------------------------------- torch.distributed
#: the gloo timeout of the test's ranks (seconds): a rank left waiting fails in this long
TIMEOUT = 10


class _Unsized:
    """Re-iterable batches without ``len()``; ``fail_at_end``: the read that should end them
    raises."""

    def __init__(self, batches: list[Any], fail_at_end: bool = False) -> None:
        self.batches, self.fail_at_end = batches, fail_at_end

    def __iter__(self) -> Any:
        yield from self.batches
        if self.fail_at_end:
            raise RuntimeError("out of memory (rank 1's read at the end, injected)")


def _rank_fit(rank: int, case: str) -> Any:
    """This rank's MAP fit over its half of the kit's 3 batches, without ``len()``, for 2
    epochs: ``"ok"``, rank 1 a batch short (``"short"``); for 1 epoch, rank 1's read ending it
    raising (``"end"``: rank 0 then waited in the closing barrier); or for a step budget spent
    at rank 1's epoch end but not at rank 0's, with validation data (``"budget"``: rank 1
    went on to score them, rank 0 to the closing barrier). Its losses, or what it raised
    (``"<type>: <message>"``)."""
    from pyrobayes.testing import tiny_problem

    model, data = tiny_problem()
    batches = [(x[rank::2], y[rank::2]) for x, y in data]
    if rank == 1 and case in ("short", "budget"):
        batches = batches[:-1]
    unsized = _Unsized(batches, fail_at_end=rank == 1 and case == "end")
    budget: dict[str, Any] = {"epochs": 1 if case == "end" else 2}
    if case == "budget":  # (the validation after rank 1's epoch all-reduces its scores)
        budget = {"optim": pb.Optimization(num_steps=2), "validation": pb.Validation(batches)}
    guide = pb.posterior(model, "map")
    try:
        return pb.fit(model, guide, unsized, lr=0.01, seed=0, progress=False, **budget).losses
    except Exception as err:
        return f"{type(err).__name__}: {err}"


def _collectives(rank: int, sized: bool) -> list[int]:
    """The collectives of a good 2-epoch fit over the 3 batches, with ``len()`` (a list) or
    without."""
    from pyrobayes.testing import tiny_problem

    model, data = tiny_problem()
    batches = [(x[rank::2], y[rank::2]) for x, y in data]
    with counting_collectives() as counts:
        guide = pb.posterior(model, "map")
        pb.fit(model, guide, batches if sized else _Unsized(batches), epochs=2, progress=False)
    return [counts[name] for name in COUNTED]


def _cases(rank: int) -> dict[str, Any]:
    results = {case: _rank_fit(rank, case) for case in ("ok", "short", "end", "budget", "ok 2")}
    results["collectives"] = {sized: _collectives(rank, sized) for sized in (True, False)}
    return results


def _worker(rank: int, init_file: str, folder: str, dtype: str) -> None:
    run_gloo_rank(rank, init_file, folder, dtype, "unsized", _cases, seconds=TIMEOUT)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_two_gloo_ranks(_worker, tmp_path_factory.mktemp("unsized"), "unsized")


@pytest.mark.integration
def test_ranks_whose_unsized_data_end_apart_stop_together(ranks):
    """Rank 1 a batch short: it stops naming both ranks' states, rank 0 (left in a step)
    naming rank 1 and how many batches its data gave (before: gloo's timeout)."""
    short0, short1 = ranks[0]["short"], ranks[1]["short"]
    assert short1.startswith("ValueError: fit(): under torch.distributed the ranks' data"), short1
    assert "rank 0: went on to a step, rank 1: ended after 2 batches" in short1, short1
    assert short0.startswith("RuntimeError: fit(): rank 1 of 2 raised an error in step 2"), short0
    assert "this rank's data (without a len()) ended after 2 batches in epoch 0" in short0
    assert "DistributedSampler" in short0 and "DistributedSampler" in short1


@pytest.mark.integration
def test_an_end_read_raising_on_one_rank_stops_every_rank(ranks):
    """Rank 1's read that ends the epoch raises: rank 1 raises its own error, rank 0 (whose
    data ended) a RuntimeError naming rank 1 and it (before: gloo's timeout)."""
    own = "RuntimeError: out of memory (rank 1's read at the end, injected)"
    assert ranks[1]["end"] == own
    other = ranks[0]["end"]
    assert other.startswith("RuntimeError: fit(): rank 1 of 2 raised an error in epoch 0"), other
    assert f"({own})" in other, other


@pytest.mark.integration
def test_a_step_budget_spent_at_one_ranks_epoch_end_stops_every_rank(ranks):
    """num_steps=2 is rank 1's epoch end (2 batches) but not rank 0's (3): rank 1 would do
    the epoch's end work while rank 0 ended the fit; both raise naming the ranks."""
    for rank in (0, 1):
        got = ranks[rank]["budget"]
        assert got.startswith("ValueError: fit(): under torch.distributed the ranks' data"), got
        assert "rank 0: went on after 2 batches, rank 1: ended after 2 batches" in got, got


@pytest.mark.integration
def test_good_unsized_fits_agree_and_add_two_collectives_an_epoch(ranks):
    """A good fit gives both ranks the same losses, before and after the failures (the ranks
    stay in step), and over the same batches without len() it adds one all-reduce and one
    gather per epoch (2 epochs) to the sized fit's collectives: none per step."""
    for case in ("ok", "ok 2"):
        assert isinstance(ranks[0][case], torch.Tensor), ranks[0][case]
        assert torch.equal(ranks[0][case], ranks[1][case])
    assert torch.equal(ranks[0]["ok"], ranks[0]["ok 2"])
    for rank in (0, 1):
        sized, unsized = ranks[rank]["collectives"][True], ranks[rank]["collectives"][False]
        added = dict(
            zip(COUNTED, (u - s for u, s in zip(unsized, sized, strict=True)), strict=True)
        )
        assert added == {"all_gather_object": 2, "broadcast": 0, "all_reduce": 2, "barrier": 0}
