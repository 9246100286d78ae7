"""Checks of :func:`pyrobayes.fit`'s arguments, made before anything is touched.

Explicit checks with messages that name the argument and what to pass (no ``assert``, no
reliance on torch's argument validation: both vanish under ``python -O`` or come too late).
"""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Any, NamedTuple

from ..models.adapters import check_int, check_real

__all__ = ["FitArguments", "plain_number", "validate_fit_arguments"]

_OWNER = "fit(): "


class FitArguments(NamedTuple):
    """:func:`pyrobayes.fit`'s counts and rates as plain Python numbers (``None`` where not
    given): what :func:`validate_fit_arguments` checked, converted from NumPy scalars and
    one-element tensors, which the seeding, the schedule and the checkpoint's JSON refuse."""

    epochs: int | None
    num_steps: int | None
    lr: float | None
    warmup: int | float
    seed: int | None


def plain_number(value: Any) -> Any:
    """``value`` as a Python ``int`` when it is an integer of any kind (``int``, a NumPy
    integer, a one-element integer tensor), else as a ``float`` (a float of any kind); a
    Python ``int`` or ``float`` as it is. Call it on a value already checked as a number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return float(value)


def validate_fit_arguments(
    *,
    epochs: Any = None,
    num_steps: Any = None,
    lr: Any = None,
    warmup: Any = 0,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: Any = None,
    resume: Any = False,
    overwrite: Any = False,
    patience: Any = None,
    validated: bool = False,
    seed: Any = None,
) -> FitArguments:
    """Raise on an invalid combination of :func:`pyrobayes.fit` arguments; return the counts
    and rates as plain Python numbers.

    Parameters
    ----------
    epochs, num_steps : int, optional
        At least one of them; integers >= 0 (``2.5`` or ``3.0`` is refused, not truncated).
    lr : float, optional
        A finite number >= 0 (``None``: the family's default).
    warmup : int or float
        A finite number >= 0 (the schedule checks the rest).
    checkpoint_dir : str or Path, optional
    checkpoint_every : int, optional
        An integer >= 1; needs ``checkpoint_dir`` (without one nothing would be written).
    resume, overwrite : bool
        ``resume=True`` needs ``checkpoint_dir`` (without one there is nothing to resume from
        and the run would silently start from scratch).
    patience : int, optional
        An integer >= 1; needs validation data (``validated``), the only thing it can wait on.
    validated : bool
        Whether ``val_data`` was passed.
    seed : int, optional
        An integer in ``0 .. 2**32 - 1`` (NumPy's range, which Pyro's seeding uses).

    Returns
    -------
    FitArguments
        ``epochs``, ``num_steps``, ``lr``, ``warmup`` and ``seed`` as Python numbers (a NumPy
        integer or a 0-d tensor passes the checks, but Pyro's seeding, the schedule's rounding
        and the checkpoint's JSON take plain numbers only).

    Raises
    ------
    TypeError
        For a non-integer count or a non-bool flag.
    ValueError
        For a missing, negative or non-finite value, or a checkpoint option without
        ``checkpoint_dir``.
    """
    if epochs is None and num_steps is None:
        raise ValueError(f"{_OWNER}pass epochs=... or optim=Optimization(num_steps=...) (or both).")
    if epochs is not None:
        epochs = check_int("epochs", epochs, ge=0, owner=_OWNER)
    if num_steps is not None:
        num_steps = check_int("num_steps", num_steps, ge=0, owner=_OWNER)
    if lr is not None:  # None: the family's default
        lr = check_real("lr", lr, ge=0, owner=_OWNER)
    check_real("warmup", warmup, ge=0, owner=_OWNER)
    if seed is not None:
        seed = check_int("seed", seed, ge=0, owner=_OWNER)
    if seed is not None and seed >= 2**32:
        raise ValueError(
            f"{_OWNER}seed must be at most 2**32 - 1 (the range NumPy's generator, seeded "
            f"with it, takes); got {seed}."
        )
    for name, flag in (("resume", resume), ("overwrite", overwrite)):
        if not isinstance(flag, bool):
            raise TypeError(f"{_OWNER}{name} must be True or False; got {flag!r}.")
    if checkpoint_every is not None:
        check_int("checkpoint_every", checkpoint_every, ge=1, owner=_OWNER)
    if patience is not None:
        check_int("patience", patience, ge=1, owner=_OWNER)
        if not validated:
            raise ValueError(
                f"{_OWNER}patience={patience} needs val_data=... (the held-out batches whose "
                "score it waits on); without it nothing could stop the fit early."
            )
    if checkpoint_dir is None:
        if resume:
            raise ValueError(
                f"{_OWNER}resume=True needs checkpoint_dir=... (the folder of the run to "
                "continue); without it the fit would start from scratch."
            )
        if checkpoint_every is not None:
            raise ValueError(
                f"{_OWNER}checkpoint_every={checkpoint_every} needs checkpoint_dir=... (the "
                "folder to write to); without it no checkpoint would be written."
            )
    return FitArguments(epochs, num_steps, lr, plain_number(warmup), seed)
