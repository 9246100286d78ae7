"""Under ``torch.distributed``: ``pb.calibrate``'s failure agreement, and laplace-torch's own work
in the curvature pass.

- ``pb.calibrate`` all-reduced a failure flag after its held-out prediction on every call, so
  that a rank whose prediction failed stopped the others before the objective's all-reduces: a
  good calibration paid one all-reduce for it (95 all-reduces on two gloo ranks, measured: the
  flag, the example count and 93 evaluations of the objective). Now the failing rank shares a
  NaN count in the count's all-reduce, which every rank takes anyway, and every rank stops
  there (:func:`pyrobayes.infer.rank_errors.raise_kept`): 94 all-reduces. ``fit_temperature``
  had no agreement at all: a rank whose targets were refused left the other in that all-reduce
  until gloo's timeout (measured: the same gloo error after 10 s); it now rides the same
  all-reduce.
- laplace-torch's ``fit`` probes the output width (``model(X[:1])``) and reads each batch from
  the loader outside the backend's per-batch calls, which share NaN when they fail
  (:mod:`pyrobayes.infer.curvature`). A failure there on one rank (an out-of-memory error in
  the probe, a batch that could not be read) left the other ranks in the first batch's
  all-reduce until gloo's timeout (10 s here: gloo's "Timed out waiting 10000ms for recv
  operation" on rank 0, measured, and the group broken for every later case). Now the failing rank keeps its error and shares NaN in the pass's next all-reduce,
  and every rank stops with it.

Each error case runs after the good ones (without its fix a case breaks the group for the cases
after it).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import pyrobayes as pb
from tests.common import COUNTED, counting_collectives, run_gloo_rank, run_two_gloo_ranks

pytestmark = pytest.mark.integration  # every test spawns two gloo ranks

#: the gloo timeout of the test's ranks (seconds): a rank left waiting fails in this long
TIMEOUT = 10
#: the failing rank's own errors
OOM_PREDICT = "RuntimeError: CUDA out of memory (simulated in calibrate's prediction)"
OOM_PROBE = "RuntimeError: CUDA out of memory (simulated in laplace-torch's probe)"
LOST_BATCH = "RuntimeError: DataLoader worker exited unexpectedly (simulated in the pass)"
EMPTY = "ValueError: calibrate: val_data yielded no batches"


def _share(rank: int) -> tuple[Any, list[Any]]:
    """The kit's problem, each batch this rank's half of it."""
    from pyrobayes.testing import tiny_problem

    model, data = tiny_problem(seed=0)
    return model, [(x[rank::2], y[rank::2]) for x, y in data]


def _outcome(run: Any) -> Any:
    try:
        return run()
    except Exception as err:
        return f"{type(err).__name__}: {err}"


def _calibrate(rank: int, case: str = "ok", **kwargs: Any) -> Any:
    """``pb.calibrate`` of a MAP on this rank's share of the kit's data (as held-out data): its
    T and the collectives it took, or what it raised (``case``: rank 1's data are empty, or its
    prediction runs out of memory)."""
    model, data = _share(rank)
    guide = pb.posterior(model, "map")
    if rank == 1 and case == "empty":
        data = []
    hook = None
    if rank == 1 and case == "oom":

        def fail(module: Any, inputs: Any) -> None:
            raise RuntimeError(OOM_PREDICT.removeprefix("RuntimeError: "))

        hook = model.net.register_forward_pre_hook(fail)

    def run() -> dict[str, Any]:
        with counting_collectives() as counts:
            value = pb.calibrate(model, guide, data, num_samples=1, **kwargs)
        return {"T": value, "collectives": [counts[n] for n in COUNTED]}

    try:
        return _outcome(run)
    finally:
        if hook is not None:
            hook.remove()


def _fit_temperature(rank: int, bad: bool) -> Any:
    """``fit_temperature`` on a prediction of this rank's share (``bad``: rank 1 passes targets
    of the wrong length): T, or what it raised."""
    model, data = _share(rank)
    guide = pb.posterior(model, "map")
    prediction = pb.predict(model, guide, data, num_samples=1)
    targets = prediction.targets[:-1] if bad and rank == 1 else None
    return _outcome(lambda: pb.calibration.fit_temperature(prediction, targets))


class _Flaky:
    """A rank's batches whose reading fails at batch 1 of laplace-torch's pass (the loader's
    second iteration inside ``la.fit``), after every check passed."""

    def __init__(self, data: list[Any], inside: list[int]) -> None:
        self.data, self.inside = data, inside

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Iterator[Any]:
        if self.inside[0]:  # inside la.fit: its probe's read of batch 0 (2), then its pass (3)
            self.inside[0] += 1
        for index, batch in enumerate(self.data):
            if self.inside[0] == 3 and index == 1:
                raise RuntimeError(LOST_BATCH.removeprefix("RuntimeError: "))
            yield batch


def _laplace(rank: int, structure: str, case: str = "ok") -> Any:
    """A post-hoc Laplace on this rank's share: its τ, or what it raised (``case``: rank 1's
    network fails in laplace-torch's probe, the first forward inside ``la.fit``, or its data
    in the pass's second batch; "retry": the probe's one example raises a ``TypeError``, on
    which laplace-torch probes the whole first batch instead)."""
    from laplace.baselaplace import ParametricLaplace

    model, data = _share(rank)
    guide = pb.posterior(model, "laplace", structure=structure)
    inside = [0]  # 0: outside la.fit, then 1 + the reads of the data begun inside it
    plain = ParametricLaplace.fit

    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        inside[0] = 1
        try:
            return plain(self, *args, **kwargs)
        finally:
            inside[0] = 0

    def probe(module: Any, inputs: Any) -> None:
        if inside[0] and case == "probe":
            raise RuntimeError(OOM_PROBE.removeprefix("RuntimeError: "))
        if inside[0] and inputs[0].shape[0] == 1:  # "retry": the probe of one example only
            raise TypeError("a network that takes no batch of one (simulated)")

    hook = None
    if rank == 1 and case in ("probe", "retry"):
        hook = model.net.register_forward_pre_hook(probe)
    if rank == 1 and case == "batch":
        data = _Flaky(data, inside)  # type: ignore[assignment]

    def run() -> str:
        pb.fit(model, guide, data, epochs=0, progress=False)
        return f"{float(guide.prior_precision):.17g}"

    ParametricLaplace.fit = fit  # type: ignore[method-assign]
    try:
        return _outcome(run)
    finally:
        ParametricLaplace.fit = plain  # type: ignore[method-assign]
        if hook is not None:
            hook.remove()


def _cases(rank: int) -> dict[str, Any]:
    """This rank's results (the error cases after the good ones they are compared with)."""
    out: dict[str, Any] = {"calibrate ok": _calibrate(rank)}
    out["calibrate empty"] = _calibrate(rank, "empty")
    out["calibrate oom"] = _calibrate(rank, "oom")
    out["calibrate after"] = _calibrate(rank)
    out["fit_temperature ok"] = _fit_temperature(rank, bad=False)
    out["fit_temperature bad"] = _fit_temperature(rank, bad=True)
    out["fit_temperature after"] = _fit_temperature(rank, bad=False)
    for structure in ("diag", "kron"):
        out[f"{structure} ok"] = _laplace(rank, structure)
        for case in ("retry", "probe", "batch"):
            out[f"{structure} {case}"] = _laplace(rank, structure, case)
        out[f"{structure} after"] = _laplace(rank, structure)
    return out


def _worker(rank: int, init_file: str, folder: str, dtype: str) -> None:
    """One gloo rank running :func:`_cases`, saved as ``probe<rank>.pt``."""
    run_gloo_rank(rank, init_file, folder, dtype, "probe", _cases, seconds=TIMEOUT)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' results of :func:`_worker` (one spawn for the module's tests)."""
    return run_two_gloo_ranks(_worker, tmp_path_factory.mktemp("probe"), "probe")


def _stopped(ranks: list[dict[str, Any]], case: str, own: str, told: str) -> None:
    """Rank 1 raised ``own``, rank 0 ``told`` followed by rank 1's error."""
    mine, other = ranks[1][case], ranks[0][case]
    assert isinstance(mine, str) and mine.startswith(own), (case, mine)
    assert isinstance(other, str) and other.startswith(f"{told} ({mine})"), (case, other)


def test_a_good_calibration_takes_one_all_reduce_besides_its_objective(ranks):
    """The all-reduces of a good ``pb.calibrate`` on two ranks: one of the examples' count and
    one per evaluation of the objective (49 grid points, 2 to open the golden-section bracket,
    40 steps, then T = 1 and the T found: 93), nothing else. Before, a failure flag's all-reduce
    came first: 95. Both ranks get the same T, and the same again after the failures below."""
    for rank in ranks:
        ok = rank["calibrate ok"]
        assert isinstance(ok, dict), ok
        assert ok["collectives"] == [0, 0, 1 + 93, 0], ok  # in the order of COUNTED
        assert rank["calibrate after"] == ok
    assert ranks[0]["calibrate ok"]["T"] == ranks[1]["calibrate ok"]["T"]


def test_a_failing_held_out_shard_stops_every_rank_in_the_count_all_reduce(ranks):
    """Rank 1's held-out data are empty, or its prediction runs out of memory: rank 1 raises its
    own error, rank 0 a ``ValueError`` (calibrate's, as before) naming rank 1 and its error."""
    told = "ValueError: calibrate: rank 1 of 2 raised an error in calibrate's held-out data"
    _stopped(ranks, "calibrate empty", EMPTY, told)
    _stopped(ranks, "calibrate oom", "RuntimeError: predict: batch 0", told)  # (predict's)
    assert OOM_PREDICT.removeprefix("RuntimeError: ") in ranks[1]["calibrate oom"]
    assert "another rank's held-out data failed" in ranks[0]["calibrate empty"]


def test_fit_temperature_refused_on_one_rank_stops_every_rank(ranks):
    """``fit_temperature`` with rank 1's targets one short: rank 1 raises its own error, rank 0
    one naming it (before: rank 0 waited in the count's all-reduce until gloo's timeout, and the
    group was broken for the next call), and the next call gives both ranks the same T again."""
    own = "ValueError: fit_temperature: labels of shape (11,) do not match the batch of 12"
    told = "ValueError: fit_temperature: rank 1 of 2 raised an error in fit_temperature's "
    _stopped(ranks, "fit_temperature bad", own, told + "held-out data")
    ok = ranks[0]["fit_temperature ok"]
    assert isinstance(ok, float), ok
    for rank in ranks:
        assert rank["fit_temperature ok"] == rank["fit_temperature after"] == ok


@pytest.mark.parametrize("case, own", [("probe", OOM_PROBE), ("batch", LOST_BATCH)])
def test_an_error_in_laplace_torchs_own_work_stops_every_rank(ranks, case, own):
    """Rank 1's network fails in laplace-torch's probe (its first forward inside ``la.fit``), or
    its second batch cannot be read in the pass: rank 1 raises its own error, rank 0 one naming
    it at the pass's next all-reduce (before: rank 0 waited in the first batch's all-reduce
    until gloo's timeout), and the next fit gives both ranks the τ of the fit before, bit for
    bit (the group is intact and nothing was kept)."""
    for structure, what in (("diag", "diagonal GGN"), ("kron", "K-FAC")):
        told = "RuntimeError: fit(): rank 1 of 2 raised an error in Laplace's curvature pass "
        _stopped(ranks, f"{structure} {case}", own, f"{told}({what} of a batch)")
        ok = ranks[0][f"{structure} ok"]
        float(ok)  # a τ, not an error
        for rank in ranks:
            assert rank[f"{structure} ok"] == rank[f"{structure} after"] == ok, structure
            # laplace-torch's retry of its probe with the whole batch is left to it
            assert rank[f"{structure} retry"] == ok, (structure, rank[f"{structure} retry"])
