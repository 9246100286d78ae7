"""The grouped options of :func:`pyrobayes.fit`: small frozen records, checked when built.

``fit`` itself takes what nearly every call sets (``epochs``, ``lr``, ``seed``) and runs where the
model's parameters are (``model.to(device)`` first); the rest comes in four groups, each ``None``
(off / the family's defaults) unless given:

- :class:`Optimization` - the objective, the optimizer, the learning-rate schedule and a step
  budget;
- :class:`Validation` - held-out data, the selection criterion and early stopping;
- :class:`Checkpointing` - the crash-safe checkpoint folder, its period, resume and overwrite;
- :class:`Progress` - the progress bar and a per-step callback.

The CLI's demo pipeline builds the same records from its TOML sections.

Example::

    pb.fit(
        model, guide, train, epochs=3, lr=1e-3,
        optim=pb.Optimization(scheduler="cosine", warmup=0.06),
        validation=pb.Validation(val, select_by="nll", patience=2),
        checkpoint=pb.Checkpointing("runs/a", every=100, resume=True),
    )
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models.adapters import check_flag, check_int, check_real
from ..user_frame import user_stacklevel
from .arguments import plain_number
from .selection import SELECT_BY

__all__ = [
    "Checkpointing",
    "Optimization",
    "Progress",
    "Validation",
    "grouped",
    "progress_bar_default",
]


@dataclass(frozen=True)
class Optimization:
    """How :func:`pyrobayes.fit` optimises: objective, optimizer, learning-rate schedule.

    Parameters
    ----------
    loss : str, pyro.infer.ELBO or object with ``loss(model, guide, batch)``, optional
        Defaults to the family's objective (its fitter's ``default_objective()``).
    optimizer : torch optimizer, class or factory, optional
        Defaults to the family's (its fitter's ``default_optimizer``; Adam for SVI). The
        learning rate is ``fit``'s ``lr``.
    scheduler : {"cosine", "linear", "constant"} or callable, optional
        Learning-rate schedule, stepped after every optimizer step: ``"cosine"``
        (``α_t = α·½(1 + cos(π t/T))``, Loshchilov & Hutter, 2017, eq. 5 without restarts),
        ``"linear"`` (``α_t = α(1 − t/T)``) over the run's ``T`` steps, ``"constant"``, or a
        factory ``optimizer -> LRScheduler``. Default: the family's (a constant rate; IVON and
        Kronecker IVON: ``"cosine"`` after a warm-up over the first 10% of the run, as Shen
        et al., 2024, anneal it). Saved in checkpoints.
        Not with a fitter that schedules the learning rate itself
        (``pb.infer.SWAG(swa_lr=...)``).
    warmup : int or float
        Linear warm-up before a named schedule's decay: ``α_t = α·t/W`` for the first ``W``
        steps (an int), or that fraction of the run (a float < 1; 0.06 is the GLUE recipe of
        LoRA-XS, Bałazy et al., 2024).
    num_steps : int, optional
        A budget of optimizer steps: the fit ends after this many (with ``fit``'s ``epochs``,
        whichever ends first; alone, it sets the run's length, as Pyro's ``svi.step`` loops do).
        A named schedule's ``T`` is the run's length.

    Raises
    ------
    TypeError, ValueError
        For a warm-up that is not a finite number >= 0 or a ``num_steps`` that is not an
        integer >= 0 (the schedule checks the rest).
    """

    loss: Any = None
    optimizer: Any = None
    scheduler: str | Callable[[Any], Any] | None = None
    warmup: float = 0
    num_steps: int | None = None

    def __post_init__(self) -> None:
        check_real("warmup", self.warmup, ge=0, owner="Optimization(): ")
        # kept as Python numbers: a NumPy integer or a 0-d tensor passes the checks, but the
        # schedule's rounding and the checkpoint's JSON take plain numbers only
        object.__setattr__(self, "warmup", plain_number(self.warmup))
        if self.num_steps is not None:
            steps = check_int("num_steps", self.num_steps, ge=0, owner="Optimization(): ")
            object.__setattr__(self, "num_steps", steps)


@dataclass(frozen=True)
class Validation:
    """Held-out data scored at the end of every epoch, best-epoch selection, early stopping.

    The guide is scored at its ``validation_values()`` (its current ``loc``); the best epoch's
    guide state and point parameters are restored when training ends, before the family's
    ``fit_end`` (so Laplace fits its curvature at the selected MAP). ``FitResult.state``
    records ``best_epoch`` (0-based) and the ``validation`` history. Checkpoints keep the
    history and a fingerprint of the data (its batch and example counts, a hash of its targets
    and one of its examples, inputs with targets, in any order: another batching or order of
    the same examples is the same data): a resume with other validation data, or none, is
    refused.

    Parameters
    ----------
    data : iterable of batches
        The held-out batches (with targets), re-iterable (a list of batches or a
        ``DataLoader``): they are read after every epoch, so a one-shot iterator is refused by
        a fit of more than one epoch.
    select_by : {"nll", "accuracy", "rmse"}
        The criterion: predictive NLL (any likelihood), accuracy (classification; ties broken
        by NLL) or RMSE (regression).
    patience : int, optional
        Early stopping: end the fit after ``patience`` epochs in a row that do not improve on
        the best validation score; ``epochs`` is then the cap. ``FitResult.state
        ["stopped_early"]`` says whether the rule ended the fit before the cap; a resumed fit
        stops at the same epoch (the rule reads the checkpointed history alone).

    Raises
    ------
    ValueError
        For an unknown ``select_by``, missing ``data`` or a ``patience`` < 1.
    TypeError
        For a ``patience`` that is not an integer.
    """

    data: Iterable[Any]
    select_by: str = "nll"
    patience: int | None = None

    def __post_init__(self) -> None:
        if self.data is None:
            raise ValueError("Validation(data=None): pass the held-out batches.")
        if self.select_by not in SELECT_BY:
            raise ValueError(
                f"Validation(select_by=...) must be one of {SELECT_BY}; got {self.select_by!r}."
            )
        if self.patience is not None:
            patience = check_int("patience", self.patience, ge=1, owner="Validation(): ")
            object.__setattr__(self, "patience", patience)  # a Python int, as for every count


@dataclass(frozen=True)
class Checkpointing:
    """Crash-safe checkpoints of a fit, and resuming from them.

    A checkpoint (guide + point parameters + fitter state + RNG states + schedule + validation +
    position in the data) is written every ``every`` steps, at each epoch end and when the fit
    ends by ``num_steps`` mid-epoch, crash-safely: each is a complete, fsynced generation folder
    ``<dir>/ckpt-NNNNNN`` that ``<dir>/LATEST`` is atomically switched to before the previous
    one is deleted, so a kill at any instant leaves a checkpoint that ``resume=True`` finds (see
    :mod:`pyrobayes.infer.checkpoint`). The folder is locked (``<dir>/.lock``, an OS file lock)
    while the fit runs: a second fit on it is refused. Leftovers of a killed fit are removed at
    the start.

    Parameters
    ----------
    dir : str or Path
        The checkpoint folder.
    every : int, optional
        Also write one every this many steps (>= 1).
    resume : bool
        Continue from the newest checkpoint in ``dir`` if there is one (restores guide, point
        parameters, optimizer, RNG states, schedule and position: the rest of the run is the
        same as without the interruption, bit for bit, mid-epoch too; a run that ended by
        ``num_steps`` continues with a larger ``num_steps``). The earlier single-folder layout
        (``<dir>/last``) is still read.
    overwrite : bool
        Allow a new fit (``resume=False``) into a ``dir`` that holds another run's checkpoint;
        without it that is refused. The old checkpoint stays until this run's first checkpoint
        replaces it.

    Raises
    ------
    TypeError, ValueError
        For a missing or empty ``dir``, an ``every`` that is not an integer >= 1, or non-bool
        flags.
    NotADirectoryError
        From :func:`pyrobayes.fit`, when ``dir`` is a file or lies below one.
    """

    dir: str | Path
    every: int | None = None
    resume: bool = False
    overwrite: bool = False

    def __post_init__(self) -> None:
        owner = "Checkpointing(): "
        if not isinstance(self.dir, str | os.PathLike):
            raise TypeError(f"{owner}dir must be a folder path; got {self.dir!r}.")
        if not str(os.fspath(self.dir)).strip():  # Path("") is ".": the working directory
            raise ValueError(
                f"{owner}dir={self.dir!r} is empty, which would write the checkpoints, their "
                "LATEST pointer and lock into the current working directory. Name a folder for "
                "them, e.g. Checkpointing(dir='runs/ckpt') (it is created if missing)."
            )
        if self.every is not None:
            every = check_int("every", self.every, ge=1, owner=owner)
            object.__setattr__(self, "every", every)
        check_flag("resume", self.resume, owner=owner)
        check_flag("overwrite", self.overwrite, owner=owner)

    @property
    def path(self) -> Path:
        """``dir`` as a :class:`~pathlib.Path`."""
        return Path(self.dir)


def progress_bar_default() -> bool:
    """Whether ``Progress(bar=None)`` shows the bar: stderr is a terminal and no ``CI`` variable
    (set by GitHub Actions, GitLab CI, Travis, CircleCI, ...) is set."""
    stream = sys.stderr
    try:
        tty = stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        tty = False
    return tty and not os.environ.get("CI")


@dataclass(frozen=True)
class Progress:
    """What a fit shows while it runs.

    Parameters
    ----------
    bar : bool, optional
        A tqdm bar with the running loss (and the objective's named terms and the fitter's
        report). ``None`` (the default): on in interactive use, i.e. when stderr is a terminal
        and the environment variable ``CI`` is not set; off in scripts whose stderr is a file or
        a pipe, in notebooks' non-terminal streams and under CI.
    callback : callable(step, loss), optional
        Called after every step with the step count and the step's loss (a float).

    Raises
    ------
    TypeError
        For a ``bar`` that is not True, False or None, or a ``callback`` that is not callable.
    """

    bar: bool | None = None
    callback: Callable[[int, float], None] | None = None

    def __post_init__(self) -> None:
        if self.bar is not None:
            check_flag("bar", self.bar, owner="Progress(): ")
        if self.callback is not None and not callable(self.callback):
            raise TypeError(
                f"Progress(callback=...) must be callable(step, loss); got {self.callback!r}."
            )

    @property
    def show_bar(self) -> bool:
        """``bar``, with ``None`` resolved by :func:`progress_bar_default`."""
        return progress_bar_default() if self.bar is None else self.bar


# ------------------------------------------------------------- the keywords before the groups
#: Each keyword ``fit`` took before the groups: ``(group keyword, field)``.
DEPRECATED_KEYWORDS: dict[str, tuple[str, str]] = {
    "loss": ("optim", "loss"),
    "optimizer": ("optim", "optimizer"),
    "scheduler": ("optim", "scheduler"),
    "warmup": ("optim", "warmup"),
    "num_steps": ("optim", "num_steps"),
    "val_data": ("validation", "data"),
    "select_by": ("validation", "select_by"),
    "patience": ("validation", "patience"),
    "checkpoint_dir": ("checkpoint", "dir"),
    "checkpoint_every": ("checkpoint", "every"),
    "resume": ("checkpoint", "resume"),
    "overwrite": ("checkpoint", "overwrite"),
    "progress_bar": ("progress", "bar"),
    "callback": ("progress", "callback"),
}
_GROUPS: dict[str, Any] = {
    "optim": Optimization,
    "validation": Validation,
    "checkpoint": Checkpointing,
    "progress": Progress,
}
#: the field without which a group is off (the old keywords then did nothing, or were refused)
_REQUIRED = {"validation": "data", "checkpoint": "dir"}


def grouped(**flat: Any) -> dict[str, Any]:
    """:func:`pyrobayes.fit`'s group keywords for the flat spelling of its options.

    The flat names are those of a config file's section or of a call written before the groups
    (``val_data``, ``select_by``, ``patience``, ``checkpoint_dir``, ``checkpoint_every``,
    ``resume``, ``overwrite``, ``loss``, ``optimizer``, ``scheduler``, ``warmup``,
    ``progress_bar``, ``callback``); any other keyword passes through unchanged. A group whose
    required field is missing or ``None`` (``val_data``, ``checkpoint_dir``) stays off.

    Example: ``pb.fit(model, guide, data, epochs=3, **grouped(val_data=val, patience=2))``.

    Raises
    ------
    ValueError
        When a group is given both ways (``validation=`` and ``val_data=``).
    """
    out = {k: v for k, v in flat.items() if k not in DEPRECATED_KEYWORDS}
    for group, cls in _GROUPS.items():
        names = [k for k in flat if DEPRECATED_KEYWORDS.get(k, ("",))[0] == group]
        if not names:
            continue
        if out.get(group) is not None:
            listed = ", ".join(f"{k}=" for k in names)
            raise ValueError(
                f"fit(): pass {group}={cls.__name__}(...) or the flat {listed}, not both."
            )
        fields = {DEPRECATED_KEYWORDS[k][1]: flat[k] for k in names}
        required = _REQUIRED.get(group)
        if required is None or fields.get(required) is not None:
            out[group] = cls(**fields)
    return out


def upgrade_keywords(old: dict[str, Any], groups: dict[str, Any]) -> dict[str, Any]:
    """``groups`` (``{"optim": ..., "validation": ..., ...}``) with ``fit``'s pre-group keywords
    ``old`` folded in (:func:`grouped`), warning once (``DeprecationWarning``) with the new
    spelling.

    Raises
    ------
    TypeError
        For a keyword ``fit`` never took.
    ValueError
        When a group is given both ways (``validation=`` and ``val_data=``).
    """
    if not old:
        return dict(groups)
    unknown = sorted(set(old) - set(DEPRECATED_KEYWORDS))
    if unknown:
        raise TypeError(
            f"fit() got an unexpected keyword argument {unknown[0]!r}; it takes epochs, "
            f"lr, seed and the groups {', '.join(_GROUPS)}."
        )
    spellings = []
    for group, cls in _GROUPS.items():
        names = [k for k in old if DEPRECATED_KEYWORDS[k][0] == group]
        if names:
            args = ", ".join(f"{DEPRECATED_KEYWORDS[k][1]}=..." for k in names)
            listed = ", ".join(f"{k}=" for k in names)
            spellings.append(f"{listed} -> {group}=pyrobayes.{cls.__name__}({args})")
    out = grouped(**{k: v for k, v in groups.items() if v is not None}, **old)
    warnings.warn(
        "fit(): these keywords are deprecated and will be removed in the next release; "
        "pass instead " + "; ".join(spellings) + ".",
        DeprecationWarning,
        stacklevel=user_stacklevel(),
    )
    return {**dict.fromkeys(groups), **out}
