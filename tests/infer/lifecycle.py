"""Shared helpers of the fit-lifecycle tests: an interrupted fit, a quiet set-up fit and a
guide's state before and after."""

from __future__ import annotations

import warnings
from typing import Any

import torch

import pyrobayes as pb


class Kill(Exception):
    """Raised from the progress callback: a fit interrupted at a given step."""


def killer(at: int):
    """A progress callback that raises :class:`Kill` at step ``at``."""

    def callback(step: int, loss: float) -> None:
        if step == at:
            raise Kill

    return callback


def quiet_fit(*args: Any, **kwargs: Any) -> pb.FitResult:
    """A set-up fit whose warnings (a diverging tiny problem, Laplace's notes) are not the
    point of the test (no progress bar unless asked)."""
    kwargs.setdefault("progress", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pb.fit(*args, **kwargs)


def state(guide: Any) -> dict[str, torch.Tensor]:
    """A copy of ``guide``'s state dict."""
    return {k: v.detach().clone() for k, v in guide.state_dict().items()}


def same_state(guide: Any, before: dict[str, torch.Tensor]) -> bool:
    """Whether ``guide``'s state equals ``before`` (the same keys, bit for bit)."""
    now = guide.state_dict()
    return now.keys() == before.keys() and all(torch.equal(now[k], v) for k, v in before.items())
