"""Under ``torch.distributed``, the last one-rank errors that left the other rank waiting.

Three stretches of a distributed fit still let one rank's error leave the others in a collective
until gloo's timeout (30 minutes by default; 8 s here, which turned the wait into gloo's own
RuntimeError on the healthy rank, measured for every case below before the fix):

- the temperature objective of :func:`pyrobayes.calibrate` / ``fit_temperature`` (one rank's
  NLL raising during the search: the other waited in the objective's all-reduce);
- Laplace's curvature pass failing on one rank before laplace-torch read its first batch
  (laplace-torch's ``_init_H``, in its constructor or in its ``fit``: the other waited in the
  curvature data's gather, or in the first batch's all-reduce);
- a read at the end of an epoch (the ``next()`` that should end it raising, or a rank's data
  ending before its ``len()``), in the fit loop and in the curvature pass.

Now each ends in a collective the healthy ranks take anyway (the objective's, the data's gather,
a step's or a batch's all-reduce, sharing NaN), then one gather of the ranks' errors: the failing
rank raises its own error, the others a RuntimeError naming it, and the ranks stay in step for
the next fit. A good fit or calibration makes the same collectives as before.
"""

from __future__ import annotations

from typing import Any

import pytest

import pyrobayes as pb
from tests.common import COUNTED, counting_collectives, run_gloo_rank, run_two_gloo_ranks

pytestmark = pytest.mark.integration  # every test spawns two gloo ranks

#: the gloo timeout of the test's ranks (seconds): a rank left waiting fails in this long
TIMEOUT = 8
#: rank 1's own error in every case
OWN = "RuntimeError: out of memory (rank 1's "
#: the collectives of a good post-hoc Kronecker Laplace (measured before the fix): the gathers
#: of the agreement, the start and the curvature data; a broadcast per guide tensor; a batch's
#: all-reduces, its loss and the 4 K-FAC factors of the 2 sites (3 batches: 15); the barrier
LAPLACE_COLLECTIVES = [3, 11, 15, 1]


def _share(rank: int) -> tuple[Any, list[Any]]:
    """The kit's problem (3 batches), each batch this rank's half of it."""
    from pyrobayes.testing import tiny_problem

    model, data = tiny_problem()
    return model, [(x[rank::2], y[rank::2]) for x, y in data]


def _outcome(run: Any) -> str:
    """``run()``'s value as text, or what it raised, ``"<type>: <message>"``."""
    try:
        return str(run())
    except Exception as err:
        return f"{type(err).__name__}: {err}"


class _Ending:
    """Batches whose reads from the ``fail_from``-th on (1-based) go wrong at their end: the
    ``next()`` that should end the read raises (``"end"``), or the read ends one batch early
    (``"short"``) or late, the first batch once more (``"long"``), while ``len()`` counts the
    batches."""

    def __init__(self, batches: list[Any], how: str, fail_from: int) -> None:
        self.batches, self.how, self.fail_from, self.reads = batches, how, fail_from, 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        self.reads += 1
        failing = self.reads >= self.fail_from
        if failing and self.how == "short":
            yield from self.batches[:-1]
            return
        yield from self.batches
        if failing and self.how == "long":
            yield self.batches[0]
            return
        if failing:
            raise RuntimeError("out of memory (rank 1's read at the end, injected)")


# ---------------------------------------------------------------- the temperature objective
def _failing_nll(after: int) -> Any:
    """``calibration._nll_terms`` that raises from its ``after + 1``-th call on."""
    from pyrobayes import calibration

    plain, calls = calibration._nll_terms, [0]

    def nll(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] > after:
            raise RuntimeError("out of memory (rank 1's temperature objective, injected)")
        return plain(*args, **kwargs)

    return nll


def _temperature_case(rank: int, case: str) -> str:
    """This rank's ``calibrate`` (or ``fit_temperature``) of a MAP fit, rank 1's objective
    failing at its 5th evaluation (``"... objective"``); ``"... ok"``: none fails."""
    from pyrobayes import calibration

    model, data = _share(rank)
    guide = pb.posterior(model, "map")
    pb.fit(model, guide, data, epochs=1, lr=0.01, seed=0, progress=False)
    plain = calibration._nll_terms
    if rank == 1 and case.endswith("objective"):
        calibration._nll_terms = _failing_nll(after=4)
    try:
        if case.startswith("calibrate"):
            return _outcome(lambda: f"{pb.calibrate(model, guide, data, num_samples=1):.12g}")
        pred = pb.predict(model, guide, data, num_samples=1)
        return _outcome(lambda: f"{pb.calibration.fit_temperature(pred):.12g}")
    finally:
        calibration._nll_terms = plain


def _nan_inputs_case(rank: int) -> str:
    """This rank's ``calibrate`` of a MAP fit, rank 1's held-out data holding a NaN input."""
    model, data = _share(rank)
    guide = pb.posterior(model, "map")
    pb.fit(model, guide, data, epochs=1, lr=0.01, seed=0, progress=False)
    if rank == 1:
        data[1][0][0, 0] = float("nan")
    return _outcome(lambda: f"{pb.calibrate(model, guide, data, num_samples=1):.12g}")


# ---------------------------------------------------------------- Laplace before its first read
def _laplace_case(rank: int, structure: str, where: str) -> str:
    """This rank's post-hoc Laplace (``epochs=0``), rank 1's laplace-torch ``_init_H`` raising
    in its constructor (``"constructor"``) or in its ``fit`` (``"fit"``, before the loader is
    read); ``"ok"``: none fails. The fitted τ, or what it raised."""
    from laplace import DiagLaplace, KronLaplace

    model, data = _share(rank)
    guide = pb.posterior(model, "laplace", structure=structure)
    fails_at = {"constructor": 1, "fit": 2}.get(where) if rank == 1 else None
    saved = {c: c.__dict__["_init_H"] for c in (DiagLaplace, KronLaplace)}
    calls = [0]

    def failing(original: Any) -> Any:
        def init_h(self: Any) -> None:
            calls[0] += 1  # the constructor's call, then fit's
            if calls[0] == fails_at:
                raise RuntimeError(f"out of memory (rank 1's _init_H in {where}, injected)")
            original(self)

        return init_h

    for cls, original in saved.items():
        cls._init_H = failing(original)
    try:
        return _outcome(lambda: _posthoc_tau(model, guide, data))
    finally:
        for cls, original in saved.items():
            cls._init_H = original


def _posthoc_tau(model: Any, guide: Any, data: Any) -> str:
    """A post-hoc fit of ``guide`` (``epochs=0``): its prior precision τ."""
    pb.fit(model, guide, data, epochs=0, progress=False)
    return f"{float(guide.prior_precision):.12g}"


# ---------------------------------------------------------------- the read that ends an epoch
def _fit_end_case(rank: int, how: str, epochs: int) -> str:
    """This rank's MAP fit of ``epochs``, rank 1's data going wrong at the end of its first
    epoch (:class:`_Ending`); ``how="ok"``: none does. The head's first value, or the error."""
    model, data = _share(rank)
    used: Any = _Ending(data, how, fail_from=1) if rank == 1 and how != "ok" else data
    guide = pb.posterior(model, "map")
    run = {"epochs": epochs, "lr": 0.01, "seed": 0, "progress": False}
    try:
        pb.fit(model, guide, used, **run)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return f"{float(model.point_params['4.weight'].flatten()[0]):.12g}"


def _pass_end_case(rank: int, how: str, structure: str) -> str:
    """This rank's Laplace curvature pass (its fitter driven by hand: the curvature data are
    read 3 times, the checks, laplace-torch's probe, the pass), rank 1's data going wrong at
    the end of the pass's read; ``how="ok"``: none does. The fitted τ, or the error."""
    model, data = _share(rank)
    used: Any = _Ending(data, how, fail_from=3) if rank == 1 and how != "ok" else data
    guide = pb.posterior(model, "laplace", structure=structure)
    fitter = pb.infer.make_fitter(model, guide)
    fitter.begin(used)
    try:
        fitter.end(used)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return f"{float(guide.prior_precision):.12g}"


# ---------------------------------------------------------------- the ranks' runs
def _collectives(rank: int) -> dict[str, list[int]]:
    """The calls of each collective of :data:`COUNTED` in good runs: a MAP fit of 2 epochs, a
    post-hoc Kronecker Laplace and a ``calibrate``."""
    out = {}
    model, data = _share(rank)
    guide = pb.posterior(model, "map")
    with counting_collectives() as counts:
        pb.fit(model, guide, data, epochs=2, lr=0.01, seed=0, progress=False)
    out["map"] = [counts[name] for name in COUNTED]
    with counting_collectives() as counts:
        pb.calibrate(model, guide, data, num_samples=1)
    out["calibrate"] = [counts[name] for name in COUNTED]
    model, data = _share(rank)
    guide = pb.posterior(model, "laplace", structure="kron")
    with counting_collectives() as counts:
        pb.fit(model, guide, data, epochs=0, progress=False)
    out["laplace"] = [counts[name] for name in COUNTED]
    return out


#: every case run by :func:`_cases`, each a function of the rank
CASES: dict[str, Any] = {
    "calibrate objective": lambda r: _temperature_case(r, "calibrate objective"),
    "fit_temperature objective": lambda r: _temperature_case(r, "fit_temperature objective"),
    "calibrate nan inputs": lambda r: _nan_inputs_case(r),
    "laplace diag constructor": lambda r: _laplace_case(r, "diag", "constructor"),
    "laplace kron constructor": lambda r: _laplace_case(r, "kron", "constructor"),
    "laplace diag fit": lambda r: _laplace_case(r, "diag", "fit"),
    "laplace kron fit": lambda r: _laplace_case(r, "kron", "fit"),
    "fit end, 2 epochs": lambda r: _fit_end_case(r, "end", 2),
    "fit end, 1 epoch": lambda r: _fit_end_case(r, "end", 1),
    "fit short, 2 epochs": lambda r: _fit_end_case(r, "short", 2),
    "fit short, 1 epoch": lambda r: _fit_end_case(r, "short", 1),
    "fit long, 1 epoch": lambda r: _fit_end_case(r, "long", 1),
    "pass end, kron": lambda r: _pass_end_case(r, "end", "kron"),
    "pass end, diag": lambda r: _pass_end_case(r, "end", "diag"),
    "pass short, kron": lambda r: _pass_end_case(r, "short", "kron"),
    "pass long, diag": lambda r: _pass_end_case(r, "long", "diag"),
}
#: the good runs before and after the cases (the ranks still in step)
GOOD: dict[str, Any] = {
    "calibrate": lambda r: _temperature_case(r, "calibrate ok"),
    "fit_temperature": lambda r: _temperature_case(r, "fit_temperature ok"),
    "laplace": lambda r: _laplace_case(r, "kron", "ok"),
    "map": lambda r: _fit_end_case(r, "ok", 2),
    "pass": lambda r: _pass_end_case(r, "ok", "diag"),
}


def _cases(rank: int) -> dict[str, Any]:
    """This rank's results: the good runs, every case, the good runs again, the collectives."""
    results = {f"{name} ok": run(rank) for name, run in GOOD.items()}
    results.update({name: run(rank) for name, run in CASES.items()})
    results.update({f"{name} ok again": run(rank) for name, run in GOOD.items()})
    results["collectives"] = _collectives(rank)
    return results


def _worker(rank: int, init_file: str, folder: str, dtype: str) -> None:
    """One gloo rank running :func:`_cases`, saved as ``rest<rank>.pt``."""
    run_gloo_rank(rank, init_file, folder, dtype, "rest", _cases, seconds=TIMEOUT)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' results of :func:`_worker` (one spawn for the module's tests)."""
    return run_two_gloo_ranks(_worker, tmp_path_factory.mktemp("rest"), "rest")


#: (case, rank 0's message after "RuntimeError: ": the caller, then where rank 1 failed)
EXPECTED = {
    "calibrate objective": "calibrate: rank 1 of 2 raised an error in calibrate's temperature",
    "fit_temperature objective": "fit_temperature: rank 1 of 2 raised an error in "
    "fit_temperature's temperature objective",
    "calibrate nan inputs": "calibrate: rank 1 of 2 raised an error in calibrate's held-out",
    "laplace diag constructor": "fit(): rank 1 of 2 raised an error in Laplace's curvature pass",
    "laplace kron constructor": "fit(): rank 1 of 2 raised an error in Laplace's curvature pass",
    "laplace diag fit": "fit(): rank 1 of 2 raised an error in Laplace's curvature pass",
    "laplace kron fit": "fit(): rank 1 of 2 raised an error in Laplace's curvature pass",
    "fit end, 2 epochs": "fit(): rank 1 of 2 raised an error in step 2 ",
    "fit end, 1 epoch": "fit(): rank 1 of 2 raised an error in step 2 ",
    "fit short, 2 epochs": "fit(): rank 1 of 2 raised an error in step 2 ",
    "fit short, 1 epoch": "fit(): rank 1 of 2 raised an error in step 2 ",
    "fit long, 1 epoch": "fit(): rank 1 of 2 raised an error in step 2 ",
    "pass end, kron": "fit(): rank 1 of 2 raised an error in Laplace's curvature pass",
    "pass end, diag": "fit(): rank 1 of 2 raised an error in Laplace's curvature pass",
    "pass short, kron": "fit(): rank 1 of 2 raised an error in Laplace's curvature pass",
    "pass long, diag": "fit(): rank 1 of 2 raised an error in Laplace's curvature pass",
}


def _check_case(ranks: list[dict[str, Any]], case: str) -> None:
    """Rank 1 raised its own error; rank 0 a RuntimeError naming rank 1, where it failed and
    its error (before the fix: gloo's timeout error after 8 s on the waiting rank)."""
    mine, other = ranks[1][case], ranks[0][case]
    own = {
        "calibrate nan inputs": "ValueError: predict: batch 1: rows [0] of the inputs hold NaN",
        "fit short, 2 epochs": "ValueError: fit(): this rank's data yielded 2 batches in epoch 0",
        "fit short, 1 epoch": "ValueError: fit(): this rank's data yielded 2 batches in epoch 0",
        "pass short, kron": "ValueError: Laplace: this rank's curvature data ended after 2 "
        "batches when laplace-torch read them, but held 3",
        "fit long, 1 epoch": "ValueError: fit(): this rank's data yielded more than the 3 "
        "batches its len() gives per epoch (epoch 0)",
        "pass long, diag": "ValueError: Laplace: this rank's curvature data yielded more than "
        "3 batches when laplace-torch read them",
    }.get(case, OWN)
    assert mine.startswith(own), (case, mine)
    if case == "calibrate nan inputs":  # (the data pass's ValueError, as in one process)
        assert other.startswith("ValueError: " + EXPECTED[case]), (case, other)
    else:
        assert other.startswith("RuntimeError: " + EXPECTED[case]), (case, other)
    assert f"({mine})" in other, (case, other, mine)


@pytest.mark.parametrize("case", ["calibrate objective", "fit_temperature objective"])
def test_an_error_in_one_ranks_temperature_objective_stops_every_rank(ranks, case):
    """Rank 1's NLL raising at the objective's 5th evaluation (an out-of-memory error): rank 1
    raises it, rank 0 a RuntimeError naming it, instead of waiting in the objective's
    all-reduce (gloo's timeout error after 8 s before)."""
    _check_case(ranks, case)


def test_one_ranks_non_finite_logits_stop_every_rank_before_the_objective(ranks):
    """A guard (this worked before): rank 1's NaN input, which gives NaN log-probabilities, is
    refused by its prediction before the search, and the data pass's count all-reduce carries
    that to rank 0, which raises the one-process ValueError naming rank 1."""
    _check_case(ranks, "calibrate nan inputs")


@pytest.mark.parametrize("structure", ["diag", "kron"])
@pytest.mark.parametrize("where", ["constructor", "fit"])
def test_an_error_before_laplace_torch_reads_a_batch_stops_every_rank(ranks, structure, where):
    """laplace-torch's ``_init_H`` failing on rank 1 in its constructor (after the curvature
    data's gather since the fix; before it, rank 0 waited in that gather) or in its ``fit``
    before the first read (rank 0 waited in the first batch's all-reduce): rank 1 shares NaN
    in the pass's first all-reduce and every rank stops there."""
    _check_case(ranks, f"laplace {structure} {where}")


@pytest.mark.parametrize("how", ["end", "short"])
@pytest.mark.parametrize("epochs", [1, 2])
def test_a_read_error_at_the_end_of_an_epoch_stops_every_rank(ranks, how, epochs):
    """Rank 1's ``next()`` that should end its first epoch raises (``"end"``), or its data end
    a batch before their ``len()`` (``"short"``): that read is made before the epoch's last
    step, whose all-reduce stops every rank (step 2, the third). Before, rank 0 went on past
    the epoch (to the next epoch's step, or the fit's closing barrier) and, but for the
    2-epoch "end" case (which the next epoch's first step happened to stop), waited there
    until gloo's timeout."""
    _check_case(ranks, f"fit {how}, {epochs} epoch{'s' if epochs > 1 else ''}")


def test_a_rank_whose_data_go_on_past_their_len_stops_every_rank(ranks):
    """Rank 1's data yield a batch more than their ``len()`` (3): it is read before the
    epoch's last step (a ValueError kept for that step). Before, rank 1 took a 4th step alone
    and waited in its all-reduce until gloo's timeout while rank 0 ended the fit."""
    _check_case(ranks, "fit long, 1 epoch")


@pytest.mark.parametrize(
    "case", ["pass end, kron", "pass end, diag", "pass short, kron", "pass long, diag"]
)
def test_a_read_error_at_the_end_of_the_curvature_pass_stops_every_rank(ranks, case):
    """Rank 1's read that should end the curvature pass raises, or ends a batch early: it is
    made before the pass's last all-reduce, where every rank stops. Before, rank 0 finished the
    pass and returned a posterior while rank 1 waited in an all-reduce until gloo's timeout."""
    _check_case(ranks, case)


def test_the_ranks_stay_in_step_after_the_errors(ranks):
    """The good runs after the failures give both ranks the same results as before them."""
    for name in GOOD:
        before, after = ranks[0][f"{name} ok"], ranks[0][f"{name} ok again"]
        float(before)  # a number, not an error
        assert before == after == ranks[1][f"{name} ok"] == ranks[1][f"{name} ok again"], name


def test_good_runs_make_the_collectives_they_made_before(ranks):
    """No collective per step, per batch or per evaluation of the objective: the calls of
    each collective of a good MAP fit (2 epochs of 3 steps), ``calibrate`` and post-hoc
    Kronecker Laplace are those measured before the fix (all_gather_object, broadcast,
    all_reduce, barrier: :data:`COUNTED`)."""
    for rank in ranks:
        counts = rank["collectives"]
        # MAP: the agreement's and the start's gathers; the broadcast of the guide's and the
        # head's tensors; 2 all-reduces a step (the loss, the flat gradient); the end's barrier
        assert counts["map"] == [2, 4, 2 * 6, 1], counts  # (4 tensors measured before)
        # calibrate: the count's all-reduce, then one per objective evaluation (49 grid
        # points, 2 + 40 golden-section steps, T = 1 and the optimum once more): 1 + 93
        assert counts["calibrate"] == [0, 0, 1 + 93, 0], counts
        assert counts["laplace"] == LAPLACE_COLLECTIVES, counts
