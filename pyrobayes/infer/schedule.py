"""Learning-rate schedules for :func:`pyrobayes.fit`, stepped once per optimizer step.

``fit(scheduler=...)`` takes ``"cosine"`` (``α_t = α·½(1 + cos(π t/T))``), ``"linear"``
(``α_t = α·(1 − t/T)``), ``"constant"`` (``α_t = α``: no schedule, where a family's fitter
would otherwise apply its default one, e.g. IVON's cosine), with ``T`` the run's number of
steps and an optional linear warm-up
(``fit(warmup=W)``: ``α_t = α·t/W`` for ``t < W``, then the decay over the remaining ``T − W``
steps), built by Hugging Face transformers' ``get_cosine_schedule_with_warmup`` /
``get_linear_schedule_with_warmup`` (the cosine schedule of Loshchilov & Hutter, 2017, SGDR,
Eq. 5, as one half-period without restarts), or a factory
``optimizer -> torch.optim.lr_scheduler.LRScheduler`` for anything else (one-cycle, steps).
Every family's optimizer reads its learning rate from ``param_groups`` at each step, IVON's
closure-driven one included, so one schedule works for all.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from ..user_frame import user_stacklevel

__all__ = ["SCHEDULES", "check_schedule", "make_scheduler", "warn_if_no_warmup_step"]

#: The named schedules and the ``transformers.optimization`` factory that builds each
#: (``factory(optimizer, num_warmup_steps, num_training_steps)``, a ``LambdaLR``).
SCHEDULES: dict[str, str] = {
    "cosine": "get_cosine_schedule_with_warmup",
    "linear": "get_linear_schedule_with_warmup",
    "constant": "get_constant_schedule_with_warmup",  # (optimizer, num_warmup_steps)
}
#: the named schedule that leaves the learning rate as it is (without a warm-up: no scheduler)
CONSTANT = "constant"


def check_schedule(
    spec: str | Callable[[torch.optim.Optimizer], Any] | None,
    total_steps: int | None,
    warmup: float = 0,
) -> int:
    """Validate ``fit(scheduler=spec, warmup=warmup)`` before anything is touched.

    Returns the number of warm-up steps. ``warmup``: steps (an int ≥ 1) or a fraction of
    ``total_steps`` (a float < 1); named schedules only.

    Raises
    ------
    ValueError
        For an unknown name, a named schedule when the number of steps is unknown (pass
        ``num_steps``, or ``epochs`` with a data loader that has a length), or a bad warm-up.
    TypeError
        For a scheduler instance or anything else that is neither a name nor a factory.
    """
    if warmup < 0 or (warmup >= 1 and warmup != int(warmup)):
        raise ValueError(
            "fit(warmup=...) is a number of steps (an int >= 1) or a fraction of the run "
            f"(a float < 1); got {warmup}."
        )
    if warmup and not isinstance(spec, str):
        raise ValueError(
            "fit(warmup=...) goes with a named schedule (scheduler='cosine', 'linear' or "
            "'constant'); "
            "a scheduler factory builds its own warm-up."
        )
    if spec is None:
        return 0
    if not isinstance(spec, str):
        if isinstance(spec, LRScheduler) or not callable(spec):
            raise TypeError(
                "fit(scheduler=...) takes a name or a factory optimizer -> LRScheduler (fit "
                "builds the optimizer), e.g. lambda opt: torch.optim.lr_scheduler.OneCycleLR("
                f"opt, ...); got {type(spec).__name__}."
            )
        return 0
    if spec not in SCHEDULES:
        raise ValueError(
            f"fit(scheduler=...) must be one of {tuple(SCHEDULES)} or a factory "
            f"optimizer -> LRScheduler; got {spec!r}."
        )
    if spec == CONSTANT and (not warmup or warmup >= 1):
        # needs no length, nothing decays; but a warm-up of the whole run, where it is known,
        # never reaches the rate (20 steps of warm-up=100 end at 0.2 α): refused as below
        if total_steps and warmup >= total_steps:
            raise ValueError(
                f"fit(warmup={warmup}) covers the whole run of {total_steps} steps, so the "
                "learning rate would never reach its value; use fewer."
            )
        return int(warmup)
    if total_steps is None:
        raise ValueError(
            f"fit(scheduler={spec!r}) needs the number of steps: pass "
            "optim=Optimization(num_steps=...), or "
            "epochs=... with a data loader that has a length."
        )
    num_warmup = int(round(warmup * total_steps)) if warmup < 1 else int(warmup)
    if total_steps and num_warmup >= total_steps:
        raise ValueError(
            f"fit(warmup={warmup}) covers the whole run of {total_steps} steps; use fewer."
        )
    return num_warmup


def warn_if_no_warmup_step(
    spec: str | Callable[[torch.optim.Optimizer], Any] | None,
    total_steps: int | None,
    warmup: float,
) -> None:
    """Warn when a warm-up the user asked for as a fraction of the run rounds to 0 steps.

    ``fit(optim=Optimization(warmup=0.05))`` over a 9-step run is ``round(0.45) = 0`` steps
    (:func:`check_schedule`), so the schedule starts at the full rate as if no warm-up had been
    asked for. Call it for a user's ``warmup`` only: a family's default (IVON's 10 % of the run)
    may round to 0 in a short fit without a word.

    Warns
    -----
    UserWarning
        Naming the argument, the run's steps and the smallest fraction that gives one step.
    """
    if not 0 < warmup < 1 or not isinstance(spec, str) or not total_steps:
        return
    if check_schedule(spec, total_steps, warmup):
        return
    if total_steps > 1:
        remedy = (
            f"Give the warm-up in steps (warmup=1 or more), or a fraction of at least "
            f"{1 / total_steps:.3g} (one step of this run), or warmup=0 for none."
        )
    else:
        remedy = "A 1-step run has no room for a warm-up: pass warmup=0."
    warnings.warn(
        f"fit(optim=Optimization(warmup={warmup:g})): {warmup:g} of this run's {total_steps} "
        f"steps rounds to 0 warm-up steps, so the {spec!r} schedule starts at the full "
        f"learning rate with no warm-up. {remedy}",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def make_scheduler(
    spec: str | Callable[[torch.optim.Optimizer], Any] | None,
    optimizer: torch.optim.Optimizer,
    total_steps: int | None,
    warmup: float = 0,
) -> Any:
    """The scheduler for ``fit(scheduler=spec, warmup=warmup)``; ``None`` for no schedule.

    Validates with :func:`check_schedule` (same errors). A run of zero steps (e.g. a post-hoc
    family's zero epochs) has nothing to schedule.

    Raises
    ------
    TypeError
        When a factory returns something without ``step()`` and ``state_dict()``, or whose
        ``step`` needs an argument (``ReduceLROnPlateau``'s metric): ``fit`` calls
        ``step()`` after every optimizer step.
    """
    num_warmup = check_schedule(spec, total_steps, warmup)
    if spec is None or total_steps == 0 or (spec == CONSTANT and not num_warmup):
        return None
    if isinstance(spec, str):
        # imported here: transformers.optimization costs seconds, and only named schedules need it
        factory = getattr(importlib.import_module("transformers.optimization"), SCHEDULES[spec])
        if spec == CONSTANT:  # a warm-up, then α: no length needed
            return factory(optimizer, num_warmup_steps=num_warmup)
        if total_steps is None:  # check_schedule refuses a named schedule without it
            raise ValueError(f"scheduler={spec!r} needs the fit's total number of steps.")
        return factory(optimizer, num_warmup_steps=num_warmup, num_training_steps=int(total_steps))
    scheduler = spec(optimizer)
    if not (hasattr(scheduler, "step") and hasattr(scheduler, "state_dict")):
        raise TypeError(
            "fit(scheduler=...) factory must return a torch.optim.lr_scheduler.LRScheduler "
            f"(with step() and state_dict()); got {type(scheduler).__name__}."
        )
    _check_steps_without_arguments(scheduler)
    other = getattr(scheduler, "optimizer", optimizer)
    if other is not optimizer:  # it would schedule that one: the fit's rate never changes
        raise ValueError(
            "fit(scheduler=...) factory returned a scheduler over another optimizer than the "
            "one it was given, so the fit's rate would never be scheduled; build it on its "
            "argument, e.g. lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, ...)."
        )
    return scheduler


def _check_steps_without_arguments(scheduler: Any) -> None:
    """Refuse a scheduler whose ``step`` needs an argument: ``fit`` calls ``scheduler.step()``
    after every optimizer step, so ``ReduceLROnPlateau.step(metrics)`` would fail there, after
    the first step changed the guide."""
    try:
        params = inspect.signature(scheduler.step).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    needed = [p.name for p in params if p.kind in positional and p.default is p.empty]
    if needed:
        raise TypeError(
            f"fit(scheduler=...) factory returned a {type(scheduler).__name__}, whose step() "
            f"needs {needed} (e.g. ReduceLROnPlateau's validation metric); fit calls step() "
            "with no argument after every optimizer step. Use a scheduler stepped by the step "
            "count (a name, LambdaLR, OneCycleLR, ...); to act on a validation score, use "
            "validation=pb.Validation(data, patience=...)."
        )
