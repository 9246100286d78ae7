"""Under ``torch.distributed``, an error on one rank during a step stops every rank.

Every step all-reduces its loss and gradients. A rank whose forward or backward raised (a bad
batch, an out-of-memory error) left that all-reduce at once, and the other rank waited in it
until gloo's timeout (30 minutes by default; 10 s here, which turned the wait into gloo's own
RuntimeError on the healthy rank, measured for every case below before the fix). Now the
failing rank keeps its error and shares a NaN loss (or NaN gradients) in the step's own
all-reduce; both ranks then see the same non-finite sum and gather the ranks' errors once
(:mod:`pyrobayes.infer.rank_errors`): the failing rank raises its own error, the other a
RuntimeError naming it, and both stay in step for the next fit. A good step gains no collective.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pyrobayes as pb
from tests.common import run_gloo_rank, run_two_gloo_ranks

pytestmark = pytest.mark.integration  # every test spawns two gloo ranks

#: (family, where rank 1 fails): the forward or the backward of its 3rd training forward, its
#: first batch's check before the first step, or fetching its 3rd batch from the data
CASES = [
    ("map", "forward"),
    ("map", "backward"),
    ("meanfield", "forward"),
    ("swag", "backward"),
    ("ivon", "forward"),
    ("ivon", "backward"),
    ("kron-ivon", "backward"),
    ("ibdr", "forward"),
    ("ibdr", "backward"),
    ("map", "first batch"),
    ("map", "fetch"),
    ("ivon", "fetch"),
]
#: rank 1's own error
OWN = "RuntimeError: out of memory (rank 1's "
#: the gloo timeout of the test's ranks (seconds): a rank left waiting fails in this long
TIMEOUT = 10


def _fault(model: Any, where: str) -> None:
    """Make the model's last linear layer (its trained head) raise in the forward (or the
    backward) of its 3rd forward with gradients enabled (evaluation forwards do not count)."""
    layer = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    calls = [0]

    def fail(*args: Any) -> None:
        raise RuntimeError(f"out of memory (rank 1's {where}, injected)")

    def hook(module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return output
        calls[0] += 1
        if calls[0] == 3 and where == "forward":
            fail()
        if calls[0] == 3 and where == "backward":
            output.register_hook(fail)
        return output

    layer.register_forward_hook(hook)


class _Unreadable:
    """Batches whose 3rd raises when fetched (a shard's unreadable file)."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        for i, batch in enumerate(self.batches):
            if i == 2:
                raise RuntimeError("out of memory (rank 1's fetch, injected)")
            yield batch


def _rank_case(rank: int, family: str, where: str) -> str:
    """This rank's fit of ``family`` (rank 1 failing at ``where``; ``"ok"``: no rank fails):
    what it raised, ``"<type>: <message>"``, or the fitted head's first value."""
    from pyrobayes.infer import loop
    from pyrobayes.testing import tiny_problem

    model, data = tiny_problem()
    data = [(x[rank::2], y[rank::2]) for x, y in data]  # this rank's share of every batch
    options = {"num_particles": 2} if family == "ibdr" else {}
    guide = pb.posterior(model, family, **options)
    check = loop.check_first_batch
    if rank == 1 and where in ("forward", "backward"):
        _fault(model, where)
    if rank == 1 and where == "first batch":

        def failing_check(*args: Any) -> None:
            raise RuntimeError("out of memory (rank 1's first batch, injected)")

        loop.check_first_batch = failing_check
    if rank == 1 and where == "fetch":
        data = _Unreadable(data)
    try:
        pb.fit(model, guide, data, epochs=2, lr=0.01, seed=0, progress=False)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    finally:
        loop.check_first_batch = check
    return f"{float(model.point_params['4.weight'].flatten()[0]):.12g}"


def _cases(rank: int) -> dict[str, Any]:
    """This rank's results: a good fit, every case, and a good fit again."""
    results = {"ok": _rank_case(rank, "map", "ok")}
    for family, where in CASES:
        results[f"{family} {where}"] = _rank_case(rank, family, where)
    results["ok again"] = _rank_case(rank, "map", "ok")
    return results


def _worker(rank: int, init_file: str, folder: str, dtype: str) -> None:
    """One gloo rank running :func:`_cases`, saved as ``steps<rank>.pt``."""
    run_gloo_rank(rank, init_file, folder, dtype, "steps", _cases, seconds=TIMEOUT)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' results of :func:`_worker` (one spawn for the module's tests)."""
    return run_two_gloo_ranks(_worker, tmp_path_factory.mktemp("steps"), "steps")


@pytest.mark.parametrize(("family", "where"), CASES)
def test_an_error_on_one_rank_during_a_step_stops_every_rank(ranks, family, where):
    """Rank 1 raises its own error; rank 0 a RuntimeError naming rank 1, the step and that
    error (before: gloo's timeout error after 10 s on rank 0)."""
    mine, other = ranks[1][f"{family} {where}"], ranks[0][f"{family} {where}"]
    assert mine.startswith(OWN + where), (family, where, mine)
    assert other.startswith("RuntimeError: fit(): rank 1 of 2 raised an error in step "), other
    assert f"({mine})" in other, (other, mine)
    assert "the last checkpoint is intact" in other, other


def test_the_ranks_stay_in_step_after_the_errors(ranks):
    """A good fit after all the failures gives both ranks the same result, the same as the
    good fit before them."""
    for case in ("ok", "ok again"):
        float(ranks[0][case])  # a number, not an error
        assert ranks[0][case] == ranks[1][case], (case, ranks[0][case], ranks[1][case])
    assert ranks[0]["ok"] == ranks[0]["ok again"]


def test_a_kept_error_is_raised_where_it_happens_in_one_process(monkeypatch):
    """Without a process group nothing is kept: the forward's error propagates from the step
    itself, unchanged (no NaN share, no gather)."""
    from pyrobayes.testing import tiny_problem

    model, data = tiny_problem()
    _fault(model, "forward")
    with pytest.raises(RuntimeError, match=r"^out of memory \(rank 1's forward, injected\)$"):
        pb.fit(model, pb.posterior(model, "map"), data, epochs=2, lr=0.01, progress=False)
