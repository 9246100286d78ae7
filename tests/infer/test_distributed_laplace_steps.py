"""Under ``torch.distributed``, Laplace's own collectives: the curvature pass, MacKay's
alternation and the held-out choice of τ.

- The curvature pass all-reduces each batch's loss and curvature. An error in one rank's
  forward or backward of a batch (an out-of-memory error; its data passed the pass's checks)
  left the other rank in that all-reduce until gloo's timeout (10 s here: gloo's own
  "Connection closed by peer" on rank 0 after 9.5 s, measured). Now the failing rank shares NaN
  (:func:`pyrobayes.infer.rank_errors.run_shared`) and every rank stops with its error.
- ``Laplace(prior_optimization="alternate")`` refits the MAP until its whole-data gradient is
  small, halving the rate after an epoch that did not lower it. That gradient was each rank's
  own shard's, so the ranks halved their rates at different epochs, their MAPs drifted apart
  and they ended with different posteriors (τ 13.39 on rank 0, 13.66 on rank 1, 20.13 in one
  process on the union; measured). Now the gradient is summed over the ranks.
- ``select_prior_precision`` pools the held-out NLL over the ranks once per τ of its grid; a
  rank whose held-out shard failed (empty, unlabelled) raised before that all-reduce, and the
  other waited in it (gloo's timeout). Shards of other numbers of batches were never a problem
  (no per-batch collective): both ranks choose the one-process τ of the union (measured before
  and after). A fit's per-epoch validation pools its metrics the same way, and waited the same.
  Now a failing rank shares NaN there too, and every rank stops with its error.

Each error case runs after the good ones (without its fix a case breaks the group for the
cases after it).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import pyrobayes as pb
from tests.common import run_gloo_rank, run_two_gloo_ranks

pytestmark = pytest.mark.integration  # every test spawns two gloo ranks

#: the failing rank's own error in the curvature pass (a forward of its second batch)
OOM = "RuntimeError: CUDA out of memory (simulated in the curvature pass)"
#: ... and in the alternation's whole-data gradient pass (:meth:`LaplaceFitter.map_residual`)
OOM_RESIDUAL = "RuntimeError: CUDA out of memory (simulated in the MAP's gradient pass)"
#: the alternation's settings: a few short refits (the rate halves inside them)
ALTERNATE = {"alternate_max_iter": 2, "alternate_epochs": 4}
#: the multiples of τ the held-out choice tries (the union's choice is inside the grid)
FACTORS = (1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0)
#: the gloo timeout of the test's ranks (seconds): a rank left waiting fails in this long
TIMEOUT = 10


def _problem(rank: int | None) -> tuple[Any, list[Any]]:
    """The kit's problem: one process's batches (``rank`` None) or a rank's half of each."""
    from pyrobayes.testing import tiny_problem

    model, data = tiny_problem(seed=0)
    return model, data if rank is None else [(x[rank::2], y[rank::2]) for x, y in data]


def _held_out(rank: int | None, case: str = "uneven") -> list[Any]:
    """Held-out batches: one process's 30 examples, or a rank's share (rank 0 two batches of
    12 and 6, rank 1 one of 12; "unlabelled": rank 1's batches carry no labels)."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(30, 4, generator=g) * 3, torch.randint(0, 3, (30,), generator=g)
    if rank is None:
        return [(x, y)]
    if rank == 0:
        return [(x[:12], y[:12]), (x[12:18], y[12:18])]
    if case == "unlabelled":
        return [x[18:]]
    return [] if case == "empty" else [(x[18:], y[18:])]


def _failing_forward(model: Any, message: str) -> Any:
    """A hook that raises ``message`` at the second forward with gradients (the second batch of
    the curvature pass: the pass's probes of the output run without them)."""
    calls = [0]

    def hook(module: Any, inputs: Any) -> None:
        if torch.is_grad_enabled():
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError(message.removeprefix("RuntimeError: "))

    return model.net.register_forward_pre_hook(hook)


def _outcome(run: Any) -> Any:
    try:
        return run()
    except Exception as err:
        return f"{type(err).__name__}: {err}"


def _curvature(rank: int, structure: str, fail: bool) -> Any:
    """A post-hoc Laplace on this rank's share (``fail``: rank 1's second batch runs out of
    memory): its τ, or what it raised."""
    model, data = _problem(rank)
    guide = pb.posterior(model, "laplace", structure=structure)
    hook = _failing_forward(model, OOM) if fail and rank == 1 else None

    def run() -> str:
        pb.fit(model, guide, data, epochs=0, progress=False)
        return f"{float(guide.prior_precision):.17g}"

    try:
        return _outcome(run)
    finally:
        if hook is not None:
            hook.remove()


def _alternate(rank: int | None, fail: bool = False) -> Any:
    """MacKay's alternation at the kit's point, driven by hand: every τ, the refits' relative
    gradients and the posterior's state (or what it raised: ``fail``, rank 1's whole-data
    gradient pass runs out of memory)."""
    model, data = _problem(rank)
    guide = pb.posterior(model, "laplace", structure="diag")
    settings = pb.infer.Laplace(prior_optimization="alternate", **ALTERNATE)
    fitter = pb.infer.make_fitter(model, guide, optimizer=settings, lr=0.05)
    if fail and rank == 1:  # the first refit's 3 steps, then its whole-data gradient pass
        objective, calls = fitter.objective, [0]
        plain = objective.loss

        def failing(*args: Any) -> Any:
            calls[0] += 1
            if calls[0] == 4:
                raise RuntimeError(OOM_RESIDUAL.removeprefix("RuntimeError: "))
            return plain(*args)

        objective.loss = failing

    def run() -> dict[str, Any]:
        fitter.begin(data)
        fitter.end(data)
        state = {k: v.detach().clone() for k, v in guide.state_dict().items()}
        return {
            "taus": torch.tensor(fitter.prior_precisions),
            "residuals": torch.tensor(fitter.map_residuals),
            "state": state,
        }

    return _outcome(run)


def _select(rank: int | None, case: str = "uneven") -> Any:
    """τ chosen on held-out data after a post-hoc Kronecker Laplace (or what it raised)."""
    model, data = _problem(rank)
    guide = pb.posterior(model, "laplace", structure="kron")
    val = _held_out(rank, case)

    def run() -> float:
        pb.fit(model, guide, data, epochs=0, progress=False)
        return pb.infer.select_prior_precision(model, guide, val, factors=FACTORS)

    return _outcome(run)


def _validation_fit(rank: int | None, case: str = "uneven") -> Any:
    """``Laplace(prior_optimization="validation")`` in a post-hoc fit: its τ (or the error)."""
    model, data = _problem(rank)
    guide = pb.posterior(model, "laplace", structure="diag")
    optim = pb.Optimization(optimizer=pb.infer.Laplace(prior_optimization="validation"))
    validation = pb.Validation(_held_out(rank, case))

    def run() -> float:
        pb.fit(model, guide, data, epochs=0, optim=optim, validation=validation, progress=False)
        return float(guide.prior_precision)

    return _outcome(run)


def _epoch_validation(rank: int, case: str = "uneven") -> Any:
    """A MAP fit of one epoch scored on held-out shards: the pooled validation NLL of its epoch
    (or what it raised)."""
    model, data = _problem(rank)
    validation = pb.Validation(_held_out(rank, case))

    def run() -> float:
        result = pb.fit(model, pb.posterior(model, "map"), data, epochs=1, lr=0.01, seed=0,
                        validation=validation, progress=False)  # fmt: skip
        return float(result.state["validation"][-1]["nll"])

    return _outcome(run)


def _cases(rank: int) -> dict[str, Any]:
    """This rank's results (the error cases last, each family's own: without its fix a case
    breaks the group)."""
    out: dict[str, Any] = {}
    out["alternate"] = _alternate(rank)
    out["select"] = _select(rank)
    out["validation fit"] = _validation_fit(rank)
    out["select empty"] = _select(rank, "empty")
    out["validation unlabelled"] = _validation_fit(rank, "unlabelled")
    out["select after"] = _select(rank)
    out["epoch validation unlabelled"] = _epoch_validation(rank, "unlabelled")
    out["epoch validation"] = _epoch_validation(rank)
    out["alternate oom"] = _alternate(rank, fail=True)
    for structure in ("diag", "kron"):
        out[f"{structure} ok"] = _curvature(rank, structure, fail=False)
        out[f"{structure} oom"] = _curvature(rank, structure, fail=True)
        out[f"{structure} after"] = _curvature(rank, structure, fail=False)
    return out


def _worker(rank: int, init_file: str, folder: str, dtype: str) -> None:
    """One gloo rank running :func:`_cases`, saved as ``steps<rank>.pt``."""
    run_gloo_rank(rank, init_file, folder, dtype, "steps", _cases, seconds=TIMEOUT)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' results of :func:`_worker` (one spawn for the module's tests)."""
    return run_two_gloo_ranks(_worker, tmp_path_factory.mktemp("steps"), "steps")


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    """One process on the union of the ranks' shards (each batch whole, in float64)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return {
                "alternate": _alternate(None),
                "select": _select(None),
                "validation fit": _validation_fit(None),
            }
    finally:
        torch.set_default_dtype(default)


def _stopped(ranks: list[dict[str, Any]], case: str, own: str, where: str) -> None:
    """Rank 1 raised ``own``, rank 0 a RuntimeError naming rank 1, ``where`` and its error."""
    mine, other = ranks[1][case], ranks[0][case]
    assert isinstance(mine, str) and mine.startswith(own), (case, mine)
    told = f"rank 1 of 2 raised an error in {where} ({mine})"
    assert isinstance(other, str) and told in other, (case, other)


def test_an_error_in_one_ranks_curvature_pass_stops_every_rank(ranks):
    """Rank 1's forward of its second batch fails (after the data checks): rank 1 raises its
    own error, rank 0 a RuntimeError naming it (before: gloo's error after the timeout), and
    the next pass on both ranks gives the τ of the pass before the failure, bit for bit."""
    for structure, what in (("diag", "diagonal GGN"), ("kron", "K-FAC")):
        where = f"Laplace's curvature pass ({what} of a batch)"
        _stopped(ranks, f"{structure} oom", OOM, where)
        ok = ranks[0][f"{structure} ok"]
        float(ok)  # a τ, not an error
        for rank in ranks:
            assert rank[f"{structure} ok"] == rank[f"{structure} after"] == ok, structure


def test_the_alternation_gives_every_rank_the_posterior_of_the_union(ranks, single):
    """Both ranks take the same τ at every iteration, the same refit gradients and the same
    posterior, bit for bit (every value they use is an all-reduced sum, the same on both), and
    it is the one-process alternation's on the union of the shards: the ranks' steps average
    two half-batches' gradients, which is the union batch's gradient. Tolerance: the two ways
    sum the examples in another order (float64 round-off, ~1e-15 relative); τ is the argmax of
    the evidence, which an error ε in its values moves by ~sqrt(ε) (a maximum is flat), ~1e-7,
    and each refit carries it into the next MAP: rtol 1e-5 (measured 1e-6 at most)."""
    r0, r1, one = ranks[0]["alternate"], ranks[1]["alternate"], single["alternate"]
    assert isinstance(r0, dict) and isinstance(r1, dict), (r0, r1)
    assert len(r0["taus"]) == 2 + ALTERNATE["alternate_max_iter"], r0["taus"]  # τ₀, fits
    for key in ("taus", "residuals"):
        told = (
            f"{key}: rank 0 {r0[key].tolist()}, rank 1 {r1[key].tolist()}, one {one[key].tolist()}"
        )
        torch.testing.assert_close(r0[key], r1[key], rtol=0, atol=0, msg=told)
        torch.testing.assert_close(r0[key], one[key], rtol=1e-5, atol=0, msg=told)
    assert set(r0["state"]) == set(one["state"])
    for key, value in one["state"].items():
        torch.testing.assert_close(r0["state"][key], r1["state"][key], rtol=0, atol=0, msg=key)
        torch.testing.assert_close(r0["state"][key], value, rtol=1e-5, atol=1e-9, msg=key)


def test_an_error_in_one_ranks_refit_check_stops_every_rank(ranks):
    """Rank 1's whole-data gradient pass (the refits' stopping test) fails: both ranks stop with
    its error (before: rank 0 waited in the gradient's all-reduce until gloo's timeout)."""
    _stopped(
        ranks, "alternate oom", OOM_RESIDUAL, "Laplace (alternate)'s check of the refitted MAP"
    )


def test_both_ranks_choose_the_union_tau_on_held_out_shards(ranks, single):
    """Shards of 2 and 1 batches (18 and 12 examples): both ranks choose the one-process τ of
    the 30 examples, by ``select_prior_precision`` and by ``Laplace(prior_optimization=
    "validation")``; the same τ bit for bit on both ranks (a pooled NLL, the same sums), and to
    float64 round-off the one process's (the same grid point: a τ of the grid, the evidence's
    τ times a factor, where the evidence's τ is the argmax above: rtol 1e-6)."""
    for case in ("select", "validation fit", "select after"):
        r0, r1 = ranks[0][case], ranks[1][case]
        assert isinstance(r0, float) and r0 == r1, (case, r0, r1)
        one = single["validation fit" if case == "validation fit" else "select"]
        assert r0 == pytest.approx(one, rel=1e-6), (case, r0, one)


def test_a_failing_held_out_shard_stops_every_rank(ranks):
    """Rank 1's held-out shard is empty (select_prior_precision) or unlabelled (a fit's
    Laplace(prior_optimization="validation")): rank 1 raises its own error, rank 0 a
    RuntimeError naming it (before: rank 0 waited in the NLL's all-reduce), and a later choice
    runs on both ranks (test above)."""
    where = "the held-out NLL"
    own = "ValueError: select_prior_precision: val_data yielded no batches"
    _stopped(ranks, "select empty", own, where)
    _stopped(ranks, "validation unlabelled", "ValueError: select_prior_precision: ", where)


def test_a_failing_held_out_shard_in_an_epochs_validation_stops_every_rank(ranks):
    """Rank 1's held-out shard is unlabelled in a fit's per-epoch validation: rank 1 raises its
    own error, rank 0 a RuntimeError naming it (before: rank 0 waited in the pooling's
    all-reduce until gloo's timeout), and the next fit's validation pools on both ranks."""
    own = "ValueError: fit(validation=Validation(data)): val_data has no labels"
    _stopped(ranks, "epoch validation unlabelled", own, "the validation of epoch 0")
    r0, r1 = ranks[0]["epoch validation"], ranks[1]["epoch validation"]
    assert isinstance(r0, float) and r0 == r1, (r0, r1)
