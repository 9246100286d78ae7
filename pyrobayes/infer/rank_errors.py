"""One rank's error during a step, carried to every rank by the step's own all-reduce.

Under ``torch.distributed`` every step of a fit all-reduces its loss and its gradients. A rank
whose forward or backward raises (a bad batch, a CUDA out-of-memory error) used to leave that
all-reduce at once, and the other ranks waited in it until the group's timeout (30 minutes
under gloo), after which the group is broken. Here the failing rank keeps its error, takes
part in the all-reduce with a NaN share instead, and every rank, seeing the same non-finite
sum, calls :func:`raise_kept` at the same point: one gather of the ranks' errors, on the
failure path only. A step that succeeds costs nothing more (no collective, no device sync).

In a single process (or a world of size 1) everything here is the plain call: errors are raised
where they happen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as torch_dist
from torch import Tensor

from .distributed import all_reduce_sum_, world
from .fit_checks import gather_rank_errors

__all__ = [
    "PASS_REMEDY",
    "check_ended_together",
    "run_shared",
    "raise_kept",
    "keep_for_ranks",
    "shared_copy",
    "nan_share",
    "nan_grads_",
]

T = TypeVar("T")

#: What the ranks that did not fail are told to do outside a step.
PASS_REMEDY = "Fix that rank's error (e.g. its data, or the memory it ran out of) and run it again."

#: What the ranks that did not fail a step are told to do.
_STEP_REMEDY = (
    "The fit stopped before updating the parameters at this step; the last checkpoint is "
    "intact. Fix that rank's error (e.g. its batch, or the memory it ran out of) and resume."
)

#: The error this process's rank kept for the step's all-reduce (at most one: the first).
_kept: list[Exception] = []


def run_shared(compute: Callable[[], T], share_instead: Callable[[], T]) -> T:
    """``compute()``, whose result this rank then all-reduces with the others.

    Under ``torch.distributed``, an ``Exception`` it raises is kept for :func:`raise_kept`
    and ``share_instead()`` is returned: a share that makes the all-reduce's result
    non-finite on every rank (a NaN loss, NaN gradients). Once this rank keeps an error, later
    parts of the same step skip ``compute`` and share ``share_instead()`` too, so the rank
    takes part in each of the step's collectives until the ranks stop together.

    Parameters
    ----------
    compute : callable
        The rank's part of the step (a forward, a backward).
    share_instead : callable
        The non-finite share that stands for it when it fails.
    """
    if world()[0] == 1:
        return compute()
    if _kept:
        return share_instead()
    try:
        return compute()
    except Exception as error:
        _kept.append(error)
        return share_instead()


def keep_for_ranks(error: Exception) -> None:
    """Keep ``error``, raised on this rank outside :func:`run_shared` (e.g. by a check of its
    batch before the step), for the step's all-reduce: the step then shares NaN. Raises
    ``error`` in a single process."""
    if world()[0] == 1:
        raise error
    if not _kept:
        _kept.append(error)


def raise_kept(at: str, *, caller: str = "fit()", remedy: str | None = None) -> None:
    """Stop every rank with the error one of them kept, or return if none kept one.

    Every rank calls it at the same point: where a value the ranks all-reduced came out
    non-finite (the same sum on every rank), before refusing the step as non-finite. One
    gather of the ranks' errors; a no-op in a single process.

    Parameters
    ----------
    at : str
        Where, for the message (e.g. ``"step 12"``, ``"Laplace's curvature pass"``).
    caller : str
        The call the others' message names.
    remedy : str, optional
        What to do, for the others' message; by default that of an error during a step.

    Raises
    ------
    Exception
        On the rank that kept an error: that error, with its own traceback.
    RuntimeError
        On the other ranks: naming the rank that failed and its error.
    """
    if world()[0] == 1:
        return
    error = _kept[0] if _kept else None
    _kept.clear()
    failed = f"raised an error in {at}"
    waited_in = f"the all-reduce of {at}"
    fix = _STEP_REMEDY if remedy is None else remedy
    gather_rank_errors(None, error, failed, waited_in, caller=caller, remedy=fix)
    if error is not None:
        raise error


def shared_copy(loss: Tensor) -> Tensor:
    """The copy of a step's ``loss`` that the ranks all-reduce: float64 on its device, so that
    a failing rank's :func:`nan_share` (which cannot know the loss's dtype) matches it."""
    return loss.detach().to(torch.float64, copy=True)


def nan_share(device: torch.device | None = None) -> Tensor:
    """A failing rank's share of the loss all-reduce: a float64 NaN (:func:`shared_copy`)."""
    return torch.full((), float("nan"), dtype=torch.float64, device=device)


def nan_grads_(params: Sequence[Tensor]) -> None:
    """A failing rank's share of the gradient all-reduce: NaN in every gradient."""
    with torch.no_grad():
        for p in params:
            if p.grad is None:
                p.grad = torch.full_like(p, float("nan"))
            else:
                p.grad.fill_(float("nan"))


#: What ranks whose data (without ``len()``) end at different steps are told to do.
_EQUAL_BATCHES = (
    "Give every rank the same number of batches per epoch: a DataLoader over a map-style "
    "dataset with a DistributedSampler (its shards are padded to equal sizes; or "
    "drop_last=True), whose len() fit then compares before the first step, or an iterable "
    "dataset that yields as many batches on every rank."
)


def _ended_text(batches: int, epoch: int) -> str:
    """What a rank whose data ended after ``batches`` of ``epoch`` tells the others."""
    return (
        f"ValueError: fit(): this rank's data (without a len()) ended after {batches} batches "
        f"in epoch {epoch} while another rank's went on; under torch.distributed every step "
        f"all-reduces over the ranks, so every rank must take as many steps. {_EQUAL_BATCHES}"
    )


def check_ended_together(
    batches: int,
    epoch: int,
    *,
    more: bool = False,
    error: Exception | None = None,
    device: torch.device | None = None,
) -> None:
    """Under ``torch.distributed``, for data without ``len()``: check that every rank's data
    ended the epoch together (a no-op in one process).

    A rank calls it where its data ended after ``batches`` batches of ``epoch`` (the read
    that raised ``StopIteration``), or, once the fit's step budget is spent, after the read
    past it (``more``: it yielded a batch; ``error``: it raised). A rank whose data ended
    before the others' would go on to the epoch's end (its validation, its checkpoint's
    gather, the next epoch's steps) while they wait in the next step's all-reduce: a hang
    until gloo's timeout (30 minutes), or steps of two epochs all-reduced together. Here it
    shares NaN in an all-reduce shaped as a step's loss (one float64), which meets the loss
    all-reduce of a rank still in a step (that rank then gathers the ranks' errors,
    :func:`raise_kept`), and then takes part in that gather, with a record saying it ended.
    When every rank's data ended (or every one's went on past the budget), every rank is
    here and nothing is raised. Two collectives per epoch, none per step.

    Raises
    ------
    Exception
        ``error``, on the rank that passed it (after the gather).
    RuntimeError
        When another rank raised an error (at its read, or in its step), naming it.
    ValueError
        When the ranks' data did not end together, naming the ranks.
    """
    size = world()[0]
    if size == 1:
        if error is not None:
            raise error
        return
    all_reduce_sum_([nan_share(device)])  # (its value is not read: every rank's share is NaN)
    if error is not None:
        text: str | None = f"{type(error).__name__}: {error}"
    else:
        text = None if more else _ended_text(batches, epoch)
    gathered: list[Any] = [None] * size
    torch_dist.all_gather_object(gathered, ({"ended": not more, "batches": batches}, text))
    if error is not None:
        raise error
    _raise_uneven(gathered, epoch)


def _raise_uneven(gathered: list[Any], epoch: int) -> None:
    """:func:`check_ended_together`'s verdict over every rank's ``(record, error text)``:
    another rank's error (a record of ``None``: a rank in a step's gather), or ranks whose
    data did not end together."""
    size = len(gathered)
    for rank, (record, why) in enumerate(gathered):
        if why is not None and not (isinstance(record, dict) and record["ended"]):
            raise RuntimeError(
                f"fit(): rank {rank} of {size} raised an error in epoch {epoch} ({why}); every "
                f"rank stops with it (the others would wait for it in the next all-reduce). "
                f"{PASS_REMEDY}"
            )
    states = [
        "went on to a step" if r is None else "ended" if r["ended"] else "went on"
        for r, _ in gathered
    ]
    if len(set(states)) == 1:
        return
    shown = ", ".join(
        f"rank {i}: {state}" + (f" after {r['batches']} batches" if r is not None else "")
        for i, (state, (r, _)) in enumerate(zip(states, gathered, strict=True))
    )
    raise ValueError(
        f"fit(): under torch.distributed the ranks' data (without a len()) did not end "
        f"together in epoch {epoch} ({shown}); every step all-reduces over the ranks, so a "
        f"rank whose data end first would wait for the others' steps. {_EQUAL_BATCHES}"
    )
