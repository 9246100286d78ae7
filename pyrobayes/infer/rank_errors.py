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
from typing import TypeVar

import torch
from torch import Tensor

from .distributed import world
from .fit_checks import gather_rank_errors

__all__ = [
    "PASS_REMEDY",
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
