"""Checks of :func:`pyrobayes.fit`'s arguments, made before anything is touched.

Explicit checks with messages that name the argument and what to pass (no ``assert``, no
reliance on torch's argument validation: both vanish under ``python -O`` or come too late).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..models.adapters import check_int, check_real

__all__ = ["validate_fit_arguments"]

_OWNER = "fit(): "


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
) -> None:
    """Raise on an invalid combination of :func:`pyrobayes.fit` arguments.

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
        check_int("epochs", epochs, ge=0, owner=_OWNER)
    if num_steps is not None:
        check_int("num_steps", num_steps, ge=0, owner=_OWNER)
    if lr is not None:  # None: the family's default
        check_real("lr", lr, ge=0, owner=_OWNER)
    check_real("warmup", warmup, ge=0, owner=_OWNER)
    if seed is not None and check_int("seed", seed, ge=0, owner=_OWNER) >= 2**32:
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
