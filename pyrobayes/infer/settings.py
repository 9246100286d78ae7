"""A fitter's settings record in its checkpoint: written as plain values, checked on resume.

Each family's fit settings are a frozen dataclass of :mod:`pyrobayes.infer` (``IVON``, ``SWAG``,
``IBDR``, ``Laplace``, ``SigmaNormDiversity``, ``MeanField``, ...) held by its fitter as
``fitter.settings``; :class:`~pyrobayes.infer.fitter.Fitter` saves it with these helpers and
refuses to resume under others.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["check_settings", "settings_record"]


def settings_record(settings: Any) -> dict[str, Any]:
    """The settings dataclass ``settings`` as the plain values a checkpoint holds (it is read
    with ``torch.load(weights_only=True)``): a torch optimizer class or factory by its name."""
    out = {}
    for key, value in dataclasses.asdict(settings).items():
        if callable(value):
            name = getattr(value, "__qualname__", type(value).__qualname__)
            value = f"{getattr(value, '__module__', '')}.{name}"
        out[key] = value
    return out


def check_settings(fitter: Any, saved: dict[str, Any] | None) -> None:
    """Refuse a checkpoint whose fitter ran with other settings (``fitter.settings``, e.g. an
    :class:`IVON`). Checkpoints written before the settings moved to the fitter carry none, and
    those written before a setting moved carry no value for it: both pass."""
    here = settings_record(fitter.settings)
    if saved is None:
        return
    diffs = [
        f"{k}={saved[k]!r} there, {v!r} here"
        for k, v in here.items()
        if k in saved and saved[k] != v
    ]
    if not diffs:
        return
    kind = type(fitter.settings).__name__
    spelled = ", ".join(f"{k}={v!r}" for k, v in saved.items() if k in here)
    raise ValueError(
        f"{type(fitter).__name__}: the checkpoint was written with other {kind} settings "
        f"({'; '.join(diffs)}); resume with optimizer=pb.infer.{kind}({spelled}), or start a "
        "new fit (overwrite=True)."
    )
