"""Under ``torch.distributed``, an error on one rank after the ranks' agreement stops every rank.

:func:`~pyrobayes.infer.fit_checks.check_ranks_agree` gathers every rank's error raised before
the agreement. Between the agreement and the fit's first per-step all-reduce a fit still does
rank-local work that can fail on one rank: the fitter's ``begin`` (its refusals), the resume's
load of the checkpoint, the data order and the lower-block cache's pass over the data. An error
there on one rank left the other ranks waiting in the next collective (rank 0's broadcast of
the parameters, or the first step's all-reduce) until gloo's timeout (30 minutes by default;
15 s here, which turned the wait into gloo's own RuntimeError). Now that stretch ends in one
gather (:func:`~pyrobayes.infer.fit_checks.check_ranks_started`): the failing rank raises its
own error, every other rank a RuntimeError naming it and its message, and the ranks stay in
step for the next fit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as torch_dist

import pyrobayes as pb
from tests.common import COUNTED, counting_collectives, run_gloo_rank, run_two_gloo_ranks

pytestmark = pytest.mark.integration  # every test spawns two gloo ranks

#: each case's failing rank: its error comes after the agreement, before the first step
CASES = {
    "begin": 1,  # LaplaceFitter.check_begin refuses: rank 1's model lost its prior_scale
    "resume": 0,  # rank 0 cannot read the checkpoint when it loads it (load_checkpoint)
    "cache": 1,  # rank 1 fails to build the lower-block cache (an out-of-memory, say)
}
OWN = {
    "begin": "TypeError: Laplace(prior_optimization='alternate') refits the MAP",
    "resume": "PermissionError: [Errno 13] Permission denied:",
    "cache": "RuntimeError: out of memory building the lower-block cache",
}


@contextlib.contextmanager
def _failing_cache(*datasets: Any) -> Iterator[None]:
    raise RuntimeError("out of memory building the lower-block cache (rank-local)")
    yield  # pragma: no cover - a generator, for contextmanager


def _failing_load(folder: Any, *args: Any, **kwargs: Any) -> Any:
    raise PermissionError(13, "Permission denied", str(Path(folder) / "posterior.safetensors"))


def _rank_case(rank: int, case: str, folder: Path) -> str:
    """This rank's fit of ``case`` (:data:`CASES`; "ok": no rank fails): what it raised,
    ``"<type>: <message>"``, or the fitted head's first value."""
    from pyrobayes.infer import loop
    from pyrobayes.testing import tiny_problem

    model, data = tiny_problem()
    data = [(x[rank::2], y[rank::2]) for x, y in data]  # this rank's share of every batch
    bad = CASES.get(case) == rank
    family, run = "map", {"epochs": 1, "lr": 0.01, "seed": 0, "progress": False}
    if case == "begin":  # the MAP stage of Laplace's alternation needs the model's prior scale
        family = "laplace"
        run["optim"] = pb.Optimization(optimizer=pb.infer.Laplace(prior_optimization="alternate"))
    guide = pb.posterior(model, family)
    kept = None
    if case == "begin":  # a fitted posterior first, which the refused fit must leave alone
        pb.fit(model, guide, data, **run)
        kept = {k: v.clone() for k, v in guide.state_dict().items()}
    if case == "begin" and bad:
        model.prior_scale = None  # what LaplaceFitter.begin refuses (and no rank record holds)
    if case == "cache":
        run["epochs"] = 2  # two passes: the fit opens the model's lower-block cache
        if bad:
            model.caching_lower_blocks = _failing_cache
    if case in ("write", "resume"):
        run["checkpoint"] = pb.Checkpointing(folder / "ckpt", resume=case == "resume")
        run["epochs"] = 1 if case == "write" else 2
    load = loop.load_checkpoint
    if case == "resume" and bad:
        loop.load_checkpoint = _failing_load  # after _checked_resume read every file
    try:
        pb.fit(model, guide, data, **run)
    except Exception as err:
        if kept is not None:  # the guide as it was (no rank began: none reset its posterior)
            now = guide.state_dict()
            assert now.keys() == kept.keys() and all(torch.equal(now[k], kept[k]) for k in kept)
        return f"{type(err).__name__}: {err}"
    finally:
        loop.load_checkpoint = load
    return f"{float(model.point_params['4.weight'].flatten()[0]):.12g}"


def _collectives(rank: int, num_steps: int) -> list[int]:
    """The calls of each collective of :data:`COUNTED` in a good MAP fit of ``num_steps``."""
    from pyrobayes.testing import tiny_problem

    model, data = tiny_problem()
    data = [(x[rank::2], y[rank::2]) for x, y in data]
    with counting_collectives() as counts:
        optim = pb.Optimization(num_steps=num_steps)
        pb.fit(model, pb.posterior(model, "map"), data, optim=optim, seed=0, progress=False)
    return [counts[name] for name in COUNTED]


def _cases(rank: int, folder: Path) -> dict[str, Any]:
    """This rank's results: a good fit first (the imports paid on both ranks at once), then
    each case, then a good fit again (the ranks are still in step; "write" leaves the
    checkpoint that "resume" continues), and the collectives of good fits."""
    cases = ["ok", "begin", "cache", "write", "resume", "ok again"]
    results: dict[str, Any] = {c: _rank_case(rank, c, folder) for c in cases}
    results["collectives"] = {n: _collectives(rank, n) for n in (2, 6)}
    return results


def _worker(rank: int, init_file: str, folder: str, dtype: str) -> None:
    """One gloo rank running :func:`_cases`, saved as ``after<rank>.pt``."""
    run_gloo_rank(rank, init_file, folder, dtype, "after", lambda r: _cases(r, Path(folder)))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' results of :func:`_worker` (one spawn for the module's tests)."""
    return run_two_gloo_ranks(_worker, tmp_path_factory.mktemp("after"), "after")


def test_an_error_on_one_rank_after_the_agreement_stops_every_rank(ranks):
    """The failing rank raises its own error, the other a RuntimeError naming that rank and its
    message, within the 15 s timeout, and the next fits run on both ranks alike. Before, the
    other rank waited in rank 0's broadcast (begin, resume) or in the first step's all-reduce
    (cache) until gloo's timeout: gloo's RuntimeError instead of the message."""
    for case, bad in CASES.items():
        mine, other = ranks[bad][case], ranks[1 - bad][case]
        assert mine.startswith(OWN[case]), (case, mine)
        # the fitter's own refusals (begin's) come before the agreement, so no rank begins
        what = "refused the fit" if case == "begin" else "failed as the fit started"
        stopped = f"RuntimeError: fit(): rank {bad} of 2 {what} ({mine})"
        assert other.startswith(stopped), (case, other)
    for case in ("ok", "write", "ok again"):  # a number (no error), the same on both ranks
        float(ranks[0][case])
        assert ranks[0][case] == ranks[1][case], (case, ranks[0][case], ranks[1][case])
    assert ranks[0]["ok"] == ranks[0]["ok again"]


def test_the_fit_gathers_twice_whatever_its_steps(ranks):
    """The errors' gathers cost a fit two ``all_gather_object`` (the agreement, the start) and
    nothing per step: a fit of 6 steps makes the collectives of a fit of 2 steps but its 4
    more steps' all-reduces (2 a step for MAP: the loss's mean, the flat gradient), one
    broadcast per guide tensor and the end's barrier."""
    for rank in ranks:
        two, six = (dict(zip(COUNTED, rank["collectives"][n], strict=True)) for n in (2, 6))
        assert two["all_gather_object"] == six["all_gather_object"] == 2, (two, six)
        assert six["all_reduce"] - two["all_reduce"] == 4 * 2, (two, six)
        assert two["broadcast"] == six["broadcast"] > 0, (two, six)
        assert two["barrier"] == six["barrier"] == 1, (two, six)


def test_a_one_process_fit_gathers_nothing(monkeypatch):
    """Without a process group the fit makes no collective (none is initialised: one would
    raise), the same as before the gathers."""
    from pyrobayes.testing import tiny_problem

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a collective in a one-process fit")

    for name in COUNTED:
        monkeypatch.setattr(torch_dist, name, refuse)
    model, data = tiny_problem()
    guide = pb.posterior(model, "map")
    pb.fit(model, guide, data, optim=pb.Optimization(num_steps=2), seed=0, progress=False)
