"""Learning-rate schedules for :func:`pyrobayes.fit`, stepped once per optimizer step.

``fit(scheduler=...)`` takes ``"cosine"`` (``α_t = α·½(1 + cos(π t/T))``), ``"linear"``
(``α_t = α·(1 − t/T)``), with ``T`` the run's number of steps, or a factory
``optimizer -> torch.optim.lr_scheduler.LRScheduler`` for anything else (warm-up, one-cycle).
Every family's optimizer reads its learning rate from ``param_groups`` at each step, IVON's
closure-driven one included, so one schedule works for all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

__all__ = ["SCHEDULES", "make_scheduler"]

#: The named schedules; the multiplier of the base learning rate at step ``t`` of ``T``.
SCHEDULES: dict[str, Callable[[int, int], float]] = {
    "cosine": lambda t, T: 0.5 * (1.0 + math.cos(math.pi * min(t, T) / T)),
    "linear": lambda t, T: max(0.0, 1.0 - t / T),
}


def make_scheduler(
    spec: str | Callable[[torch.optim.Optimizer], Any] | None,
    optimizer: torch.optim.Optimizer,
    total_steps: int | None,
) -> Any:
    """The scheduler for ``fit(scheduler=spec)``; ``None`` for no schedule.

    Raises
    ------
    ValueError
        For an unknown name, or a named schedule when the number of steps is unknown (pass
        ``num_steps``, or ``epochs`` with a data loader that has a length).
    TypeError
        When a factory returns something without ``step()`` and ``state_dict()``.
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec not in SCHEDULES:
            raise ValueError(
                f"fit(scheduler=...) must be one of {tuple(SCHEDULES)} or a factory "
                f"optimizer -> LRScheduler; got {spec!r}."
            )
        if not total_steps:
            raise ValueError(
                f"fit(scheduler={spec!r}) needs the number of steps: pass num_steps=..., or "
                "epochs=... with a data loader that has a length."
            )
        multiplier = SCHEDULES[spec]
        return LambdaLR(optimizer, lambda t: multiplier(t, total_steps))
    if isinstance(spec, LRScheduler) or not callable(spec):
        raise TypeError(
            "fit(scheduler=...) takes a name or a factory optimizer -> LRScheduler (fit builds "
            "the optimizer), e.g. lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, ...); "
            f"got {type(spec).__name__}."
        )
    scheduler = spec(optimizer)
    if not (hasattr(scheduler, "step") and hasattr(scheduler, "state_dict")):
        raise TypeError(
            "fit(scheduler=...) factory must return a torch.optim.lr_scheduler.LRScheduler "
            f"(with step() and state_dict()); got {type(scheduler).__name__}."
        )
    return scheduler
