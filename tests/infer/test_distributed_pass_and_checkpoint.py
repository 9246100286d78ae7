"""Under ``torch.distributed``, one rank's error in Laplace's curvature pass or in rank 0's
checkpoint write stops every rank.

Laplace's curvature pass all-reduces every batch's curvature, and its data checks (non-finite
inputs, labels outside the head's classes, an empty or one-shot iterable) raised on the rank
whose batch failed, between those all-reduces; only rank 0 writes a checkpoint, and a write
that failed there (a full disk, a permission error) left the other ranks in the next step's
all-reduce (or the end's barrier). In both the other ranks waited until gloo's timeout (30
minutes by default; 10 s here: gloo's own RuntimeError, measured at 10.0 s for every case).
Now the pass checks every batch before its first collective and gathers the outcome once, and
every checkpoint ends in one gather of rank 0's outcome: the failing rank raises its own error,
every other rank a RuntimeError naming it, and the ranks stay in step for the next fit. The
ranks' agreement compares whether (and how often) each checkpoints, since every rank joins that
gather; the collectives of a good fit grow by one gather per checkpoint and per Laplace pass.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as torch_dist

import pyrobayes as pb
from tests.common import counting_collectives, run_gloo_rank, run_two_gloo_ranks

pytestmark = pytest.mark.integration  # every test spawns two gloo ranks

#: each curvature case's failing rank and the start of its own error
PASS_CASES = {
    "nan": (1, "ValueError: Laplace: batch 1 of the curvature data has non-finite inputs"),
    "labels": (0, "ValueError: Laplace: batch 2 of the curvature data has class labels [7]"),
    "empty": (1, "ValueError: Laplace: the curvature data hold no examples"),
    "one-shot": (0, "TypeError: Laplace: the curvature data is a one-shot iterator"),
}
#: both ranks' error when rank 1 holds one batch fewer (the pass all-reduces every batch)
UNEVEN = "ValueError: Laplace: under torch.distributed the ranks' curvature data hold different "
UNEVEN += "numbers of batches (rank 0: 3, rank 1: 2)"
#: rank 0's own error when its second checkpoint's write fails
FULL_DISK = "OSError: [Errno 28] No space left on device"
#: the gloo timeout of the test's ranks (seconds): a rank left waiting fails in this long
TIMEOUT = 10


def _share(rank: int, seed: int = 0) -> tuple[Any, list[Any]]:
    """The kit's problem, each batch this rank's half of it."""
    from pyrobayes.testing import tiny_problem

    model, data = tiny_problem(seed=seed)
    return model, [(x[rank::2], y[rank::2]) for x, y in data]


def _generator(data: list[Any]) -> Iterator[Any]:
    yield from data


def _pass_case(rank: int, case: str) -> str:
    """This rank's curvature pass of ``case`` (:data:`PASS_CASES`; "ok": none fails): what it
    raised, ``"<type>: <message>"``, or the fitted prior precision. The data checks run in a
    post-hoc fit (``epochs=0``); the empty and one-shot data, which the fit's agreement of the
    ranks' batches per epoch refuses first, in the fitter's end (a fitter driven by hand)."""
    model, data = _share(rank)
    bad = case == "uneven" and rank == 1 or case in PASS_CASES and PASS_CASES[case][0] == rank
    if case == "nan" and bad:
        data[1][0][1, 2] = float("nan")
    if case == "labels" and bad:
        data[2][1][3] = 7  # the head has 3 classes
    guide = pb.posterior(model, "laplace", structure="kron")
    try:
        if case in ("empty", "one-shot", "uneven"):
            fitter = pb.infer.make_fitter(model, guide)
            fitter.begin(data)
            used: Any = data
            if bad:
                used = {"empty": [], "uneven": data[:-1]}.get(case, _generator(data))
            fitter.end(used)
        else:
            pb.fit(model, guide, data, epochs=0, progress=False)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return f"{float(guide.prior_precision):.12g}"


def _float16_case(rank: int) -> str:
    """A float16 network's Kronecker Laplace where only rank 1's inputs (size ~40 on 300
    examples) make its K-FAC input factor pass float16's 65504; rank 0's (size ~1) do not."""
    from torch import nn

    from pyrobayes.models import FineTuneModel, LoRAXS

    torch.manual_seed(0)
    x, y = torch.randn(300, 4) * (40.0 if rank == 1 else 1.0), torch.arange(300) % 3
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)).to(torch.float16)
    model = FineTuneModel(
        net, LoRAXS(rank=3, target_modules=["0"]), num_data=600, trainable_modules=["2"]
    )
    guide = pb.posterior(model, "laplace", structure="kron")
    data = [(x[i : i + 30].to(torch.float16), y[i : i + 30]) for i in range(0, 300, 30)]
    try:
        pb.fit(model, guide, data, epochs=0, progress=False)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "fitted"


class _FullDisk:
    """``_write_generation`` that writes the first ``good`` generations, then fails part way
    through the next (its first file written) as a full disk does."""

    def __init__(self, good: int) -> None:
        from pyrobayes.infer import checkpoint

        self.good, self.plain = good, checkpoint._write_generation

    def __call__(self, folder: Path, parts: dict[str, Any]) -> None:
        if self.good > 0:
            self.good -= 1
            self.plain(folder, parts)
            return
        torch.save(parts["fitter"], folder / "fitter.pt")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / "rng.pt"))


def _checkpoint_case(rank: int, folder: Path) -> dict[str, Any]:
    """A MAP fit of 3 steps checkpointed every step whose second write fails on rank 0: what
    each rank raised, the step of the checkpoint left in the folder and what it holds, then a
    resume of the fit on both ranks (the ranks still in step) and its head's first value."""
    from pyrobayes.infer import checkpoint

    model, data = _share(rank)
    ckpt = folder / "ckpt"
    run = {"optim": pb.Optimization(num_steps=3), "lr": 0.01, "seed": 0, "progress": False}
    plain = checkpoint._write_generation
    if rank == 0:
        checkpoint._write_generation = _FullDisk(good=1)
    try:
        pb.fit(
            model,
            pb.posterior(model, "map"),
            data,
            checkpoint=pb.Checkpointing(ckpt, every=1),
            **run,
        )
        out: dict[str, Any] = {"raised": "nothing"}
    except Exception as err:
        out = {"raised": f"{type(err).__name__}: {err}"}
    finally:
        checkpoint._write_generation = plain
    torch_dist.barrier()  # rank 0 is out of its write before rank 1 reads the folder
    kept = checkpoint.latest(ckpt)
    out["kept"] = None if kept is None else kept.name
    out["entries"] = sorted(p.name for p in ckpt.iterdir() if p.name != ".lock")
    if kept is not None:
        out["kept_step"] = int(json.loads((kept / "state.json").read_text())["step"])
    model, data = _share(rank)
    guide = pb.posterior(model, "map")
    pb.fit(model, guide, data, checkpoint=pb.Checkpointing(ckpt, every=1, resume=True), **run)
    out["resumed"] = f"{float(model.point_params['4.weight'].flatten()[0]):.12g}"
    return out


def _checkpointing_on_rank_0_alone(rank: int, folder: Path) -> str:
    """A MAP fit checkpointed on rank 0 alone: what it raised (every rank gathers the outcome
    of each checkpoint, so the ranks must checkpoint alike)."""
    model, data = _share(rank)
    ckpt = pb.Checkpointing(folder / "alone", every=1) if rank == 0 else None
    try:
        pb.fit(model, pb.posterior(model, "map"), data, epochs=1, checkpoint=ckpt, progress=False)
    except ValueError as err:
        return f"ValueError: {err}"
    return "nothing"


def _collectives(rank: int, folder: Path) -> dict[str, Any]:
    """The collectives of good fits: MAP fits of 6 steps without and with checkpoints (written
    at 2 epoch ends, and every 4 steps: 3 writes, counted on rank 0), and a post-hoc Laplace."""
    from pyrobayes.infer import loop

    out: dict[str, Any] = {}
    writes = [0]
    plain = loop.save_checkpoint

    def counted_save(*args: Any, **kwargs: Any) -> Any:
        writes[0] += 1
        return plain(*args, **kwargs)

    run = {"optim": pb.Optimization(num_steps=6), "seed": 0, "progress": False}
    for name in ("plain", "checkpointed"):
        model, data = _share(rank)
        ckpt = pb.Checkpointing(folder / "counted", every=4) if name == "checkpointed" else None
        loop.save_checkpoint = counted_save
        try:
            with counting_collectives() as counts:
                pb.fit(model, pb.posterior(model, "map"), data, checkpoint=ckpt, **run)
        finally:
            loop.save_checkpoint = plain
        out[name] = dict(counts)
    out["writes"] = writes[0]
    model, data = _share(rank)
    with counting_collectives() as counts:
        pb.fit(model, pb.posterior(model, "laplace", structure="diag"), data, epochs=0)
    out["laplace"] = dict(counts)
    return out


def _cases(rank: int, folder: Path) -> dict[str, Any]:
    """This rank's results of every case."""
    cases = ["ok", *PASS_CASES, "uneven", "ok again"]
    results: dict[str, Any] = {c: _pass_case(rank, c) for c in cases}
    results["checkpoint"] = _checkpoint_case(rank, folder)
    results["collectives"] = _collectives(rank, folder)
    results["alone"] = _checkpointing_on_rank_0_alone(rank, folder)
    results["float16"] = _float16_case(rank)
    results["after float16"] = _pass_case(rank, "ok")
    return results


def _worker(rank: int, init_file: str, folder: str, dtype: str) -> None:
    """One gloo rank running :func:`_cases`, saved as ``pass<rank>.pt``."""
    cases = lambda r: _cases(r, Path(folder))  # noqa: E731
    run_gloo_rank(rank, init_file, folder, dtype, "pass", cases, seconds=TIMEOUT)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' results of :func:`_worker` (one spawn for the module's tests)."""
    return run_two_gloo_ranks(_worker, tmp_path_factory.mktemp("pass"), "pass")


def test_an_error_in_the_curvature_pass_on_one_rank_stops_every_rank(ranks):
    """The failing rank raises its own error, the other a RuntimeError naming that rank and its
    message, and the next pass runs on both ranks alike; ranks with other numbers of batches
    both refuse the pass. Before, the other rank (the longer one) waited in the pass's next
    all-reduce until gloo's timeout (gloo's RuntimeError instead of the message)."""
    for case, (bad, own) in PASS_CASES.items():
        mine, other = ranks[bad][case], ranks[1 - bad][case]
        assert mine.startswith(own), (case, mine)
        stopped = f"RuntimeError: Laplace: rank {bad} of 2 refused its curvature data ({mine})"
        assert other.startswith(stopped), (case, other)
    assert ranks[0]["uneven"].startswith(UNEVEN) and ranks[1]["uneven"].startswith(UNEVEN)
    for case in ("ok", "ok again"):  # a number (no error), the same on both ranks
        float(ranks[0][case])
        assert ranks[0][case] == ranks[1][case], (case, ranks[0][case], ranks[1][case])
    assert ranks[0]["ok"] == ranks[0]["ok again"]


def test_a_failed_checkpoint_write_on_rank_0_stops_every_rank_and_keeps_the_last(ranks):
    """Rank 0 raises its write's error, rank 1 a RuntimeError naming it (before: rank 1 waited
    in the next step's all-reduce until gloo's timeout); the folder keeps the first step's
    complete checkpoint and nothing of the failed write, and both ranks resume from it."""
    mine, other = (ranks[r]["checkpoint"] for r in range(2))
    assert mine["raised"].startswith(FULL_DISK), mine
    stopped = f"RuntimeError: fit(): rank 0 of 2 failed to write a checkpoint ({mine['raised']})"
    assert other["raised"].startswith(stopped), other
    for out in (mine, other):
        assert out["kept"] == "ckpt-000001" and out["kept_step"] == 1, out
        assert out["entries"] == ["LATEST", "ckpt-000001"], out  # no temporary folder left
    assert mine["resumed"] == other["resumed"], (mine, other)


def test_the_pass_and_the_checkpoints_gather_once_each(ranks):
    """A checkpoint costs one gather and nothing else (the other collectives of a fit of 6
    steps are those of the same fit without checkpoints), and a post-hoc Laplace fit of a
    list of batches three: the agreement's, the start's and the curvature pass's (which
    replaces the pass's all-reduce of the examples' count)."""
    writes = ranks[0]["collectives"]["writes"]
    assert writes == 3, writes  # at steps 3 (an epoch end; 3 batches an epoch), 4 and 6
    for rank in ranks:
        plain, checkpointed = rank["collectives"]["plain"], rank["collectives"]["checkpointed"]
        assert plain["all_gather_object"] == 2, plain
        assert checkpointed == {**plain, "all_gather_object": 2 + writes}, (plain, checkpointed)
        laplace = rank["collectives"]["laplace"]
        assert laplace["all_gather_object"] == 3 and laplace["barrier"] == 1, laplace
        # diag: the loss and the diagonal of each of the 3 batches, and nothing else
        assert laplace["all_reduce"] == 3 * 2, laplace


def test_ranks_that_checkpoint_differently_are_refused_on_every_rank(ranks):
    """The ranks' agreement compares whether each writes checkpoints, and how often: a rank
    without them would never join the gather of rank 0's outcome of each."""
    for rank in ranks:
        told = "ranks differ in checkpoints (written, every) (rank 0: [True, 1], rank 1: [False,"
        assert told in rank["alone"], rank["alone"]


def test_a_float16_overflow_on_one_rank_stops_every_rank(ranks):
    """Only rank 1's K-FAC factor overflows float16: the check runs after the factors' sum over
    the ranks (an inf on one rank is an inf in the sum), so both ranks refuse with the cause,
    and a later pass runs on both. Before, rank 1 refused before its batch's all-reduce and
    rank 0 waited in it until gloo's timeout."""
    for rank in range(2):
        got = ranks[rank]["float16"]
        assert got.startswith("FloatingPointError: Laplace: the Kronecker (K-FAC) factors of "
                              "this float16 network overflowed"), (rank, got)  # fmt: skip
    assert ranks[0]["after float16"] == ranks[1]["after float16"] == ranks[0]["ok"]
