"""The point-estimated parameters a guide was fitted with, and the warning when they change.

A guide holds the posterior over the latent sites only; the model's point-estimated parameters
(a trained head, a learned noise scale, point LoRA factors) live in the model, which several
guides can share: the post-hoc recipe fits SWAG or Laplace from a MAP on the same model, and
``pb.load`` writes a file's head into the model it loads into. A fit that trains the head (SWAG,
Laplace with ``epochs > 0``) or a load then changes the head under every other guide on that
model, whose predictions would pair its posterior with a head it was not fitted with.

:func:`record_fitted_head` stores, on the guide, what each point parameter held when its fit
ended (or its file was loaded): the tensor's version counter and storage (a fast path) and a
SHA-256 of its values rounded to bfloat16 (so a cast of the model to float64 or bfloat16, or a
move to another device, is not a change; nor is a change below bfloat16's resolution, 2⁻⁸
relative). :func:`warn_if_head_changed` compares them.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .user_frame import user_stacklevel

__all__ = [
    "HeadChangedWarning",
    "record_fitted_head",
    "forget_fitted_head",
    "restore_fitted_head",
    "changed_heads",
    "warn_if_head_changed",
    "NeverFittedWarning",
    "record_initial_state",
    "warn_if_never_fitted",
    "still_as_built",
]

#: the guide attribute that holds the record (not part of its state: a file's load sets it anew)
_ATTRIBUTE = "_pyrobayes_fitted_head"
#: the guide attribute that holds :func:`record_initial_state`'s digest
_INITIAL = "_pyrobayes_initial_state"


class HeadChangedWarning(UserWarning):
    """The model's point-estimated parameters (the head) changed since the guide was fitted or
    loaded: another fit on the same model trained them, or ``pb.load`` wrote another file's."""


class NeverFittedWarning(UserWarning):
    """A guide used for prediction that was never fitted nor loaded: its posterior is still its
    initialisation (the model's initial values at every site)."""


@dataclass(frozen=True)
class _Entry:
    version: int
    data_ptr: int
    digest: str


def _digest(value: Tensor) -> str:
    """SHA-256 of ``value``'s shape and values rounded to bfloat16 (through float32)."""
    from .io.integrity import _feed_tensor  # local: pyrobayes.io imports the guide registry

    h = hashlib.sha256()
    _feed_tensor(h, "", value)
    return h.hexdigest()


def _entry(value: Tensor) -> _Entry:
    return _Entry(int(value._version), int(value.data_ptr()), _digest(value))


def record_fitted_head(guide: Any, model: Any) -> None:
    """Store on ``guide`` the current values of ``model``'s point-estimated parameters (called
    at the end of a fit and after a load)."""
    point = getattr(model, "point_params", None)
    if point is None:
        return
    record = {name: _entry(p.detach()) for name, p in point.items()}
    object.__setattr__(guide, _ATTRIBUTE, (id(model), record))


def forget_fitted_head(guide: Any) -> Any:
    """Drop ``guide``'s record (a fit begins: until it ends, the head is the fit's to change);
    returns it, for :func:`restore_fitted_head` when the fit changes nothing."""
    return guide.__dict__.pop(_ATTRIBUTE, None)


def restore_fitted_head(guide: Any, record: Any) -> None:
    """Put back a record :func:`forget_fitted_head` returned (``None``: leave none)."""
    if record is not None:
        object.__setattr__(guide, _ATTRIBUTE, record)


def changed_heads(guide: Any, model: Any) -> list[str]:
    """Names of ``model``'s point parameters whose values differ from those ``guide`` was
    fitted or loaded with (sorted; present in one of the two only counts as changed); ``[]``
    when the guide holds no record for this model (never fitted by ``pb.fit``, or fitted on
    another model object, which :func:`pyrobayes.predictive.check_fitted_model` compares)."""
    stored = getattr(guide, _ATTRIBUTE, None)
    point = getattr(model, "point_params", None)
    if stored is None or point is None or stored[0] != id(model):
        return []
    record: dict[str, _Entry] = stored[1]
    changed = sorted(set(record) ^ set(point))
    for name in sorted(set(record) & set(point)):
        value, entry = point[name].detach(), record[name]
        if int(value._version) == entry.version and int(value.data_ptr()) == entry.data_ptr:
            continue  # not written to since (the fast path: no pass over the values)
        digest = _digest(value)
        if digest != entry.digest:
            changed.append(name)
        else:  # written with the same values, moved or cast: the same head
            record[name] = _Entry(int(value._version), int(value.data_ptr()), digest)
    return changed


def warn_if_head_changed(guide: Any, model: Any, where: str) -> None:
    """Warn (:class:`HeadChangedWarning`) when ``model``'s point parameters changed since
    ``guide`` was fitted or loaded (:func:`changed_heads`), naming them and the remedy
    (the warning points at the user's line)."""
    changed = changed_heads(guide, model)
    if not changed:
        return
    warnings.warn(
        f"{where}: the model's point-estimated parameters {changed[:4]} (the head) changed since "
        f"this {type(guide).__name__} was fitted or loaded, by another fit on the same model "
        "(SWAG, or Laplace with epochs > 0, train the head of the MAP they start from) or by "
        "pb.load of another posterior into it; the result pairs this posterior with a head it "
        "was not fitted with. Give each fit its own copy of the model (copy.deepcopy(model) "
        "before the second fit), or pb.save this posterior and pb.load it back to restore its "
        "head.",
        HeadChangedWarning,
        stacklevel=user_stacklevel(),
    )


def _at_initial_values(guide: Any, model: Any) -> bool:
    """``guide``'s point (its mean) equals ``model``'s initial value at every site."""
    site_value = getattr(model, "site_value", None)
    mean = getattr(guide, "mean", None)
    if site_value is None or mean is None:
        return False
    try:
        values = mean()
    except (RuntimeError, ValueError, NotImplementedError):  # a family that refuses it unfitted
        return False
    if not values:
        return False
    for site, value in values.items():
        start = site_value(site)
        if start.shape != value.shape or not bool((start.to(value) == value.detach()).all()):
            return False
    return True


def _parameters_digest(guide: Any) -> str:
    """One SHA-256 over the guide's parameters' names and :func:`_digest` of each."""
    h = hashlib.sha256()
    for name, p in guide.named_parameters():
        h.update(name.encode())
        h.update(_digest(p.detach()).encode())
    return h.hexdigest()


def record_initial_state(guide: Any) -> None:
    """Store a digest of ``guide``'s parameters as built (called by guides whose initialisation
    is not the model's values, e.g. perturbed particles), for :func:`warn_if_never_fitted`."""
    object.__setattr__(guide, _INITIAL, _parameters_digest(guide))


def _at_initial_state(guide: Any) -> bool:
    """``guide``'s parameters are still those :func:`record_initial_state` saw."""
    initial = guide.__dict__.get(_INITIAL)
    return initial is not None and _parameters_digest(guide) == initial


def still_as_built(guide: Any) -> bool:
    """``guide`` was neither fitted by ``pb.fit`` nor loaded by ``pb.load``, and its parameters
    are still those :func:`record_initial_state` saw when it was built (IBDR's jittered
    particles, σN's members, before any fit).

    Parameters
    ----------
    guide : Any
        A posterior guide.

    Returns
    -------
    bool
        False for a guide that records no initial state (its family starts at the model's
        values, which :func:`warn_if_never_fitted` compares instead).
    """
    return getattr(guide, _ATTRIBUTE, None) is None and _at_initial_state(guide)


def warn_if_never_fitted(guide: Any, model: Any, where: str) -> None:
    """Warn (:class:`NeverFittedWarning`) when ``guide`` was neither fitted by ``pb.fit`` nor
    loaded by ``pb.load`` and its point is still ``model``'s initial value at every site, or
    its parameters are still those it was built with (:func:`record_initial_state`: IBDR's
    perturbed particles, σN's members); a guide built and passed to ``predict`` without a
    fit (a fit that moved nothing reads the same)."""
    if getattr(guide, _ATTRIBUTE, None) is not None:
        return
    if _at_initial_values(guide, model):
        what = "the model's initial value at every site"
    elif _at_initial_state(guide):
        what = "the values it was built with"
    else:
        return
    warnings.warn(
        f"{where}: this {type(guide).__name__} was never fitted (pb.fit) nor loaded (pb.load): "
        f"its posterior is its initialisation, {what}. Fit it first; to predict with the "
        "model's initial values on purpose (a zero-shot baseline), pass "
        "values=model.init_values() to pb.predict.",
        NeverFittedWarning,
        stacklevel=user_stacklevel(),
    )
