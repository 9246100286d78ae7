"""Family name → guide class, validated and collision-checked (as peft's ``register_peft_method``).

Third-party guides join with :func:`register_guide` without inheriting from pyrobayes classes,
as long as they honour the contract in :mod:`pyrobayes.guides.base`.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

__all__ = ["register_guide", "get_guide_class", "available_guides"]

_REGISTRY: dict[str, type] = {}


def register_guide(name: str, cls: type, *, aliases: tuple[str, ...] = ()) -> type:
    """Register ``cls`` under ``name`` and its ``aliases``.

    Parameters
    ----------
    name : str
        A lower-case family name, e.g. ``"kron-ivon"``.
    cls : type
        The guide class (not an instance): it must define the methods of
        :class:`pyrobayes.contract.Posterior` (inheriting
        :class:`~pyrobayes.guides.PosteriorGuide` is the easy way).
    aliases : tuple of str
        More names for the same class (a tuple of names, not one string).

    Returns
    -------
    type
        ``cls``, so it can decorate a class definition.

    Raises
    ------
    TypeError
        For a name that is not a string, ``aliases`` given as one string, a ``cls`` that is not a
        class, or a class missing some of the contract's methods (named).
    ValueError
        For a name that is not lower-case letters, digits, ``-`` and ``_``.
    KeyError
        When a name is already registered to another class. Nothing is registered unless every
        name is valid and free.
    """
    keys = _checked_names(name, aliases)
    _check_guide_class(name, cls)
    for key in keys:
        if key in _REGISTRY and _REGISTRY[key] is not cls:
            raise KeyError(
                f"Guide name {key!r} is already registered to {_REGISTRY[key].__name__}; "
                f"register {getattr(cls, '__name__', cls)} under another name."
            )
    for key in keys:
        _REGISTRY[key] = cls
    return cls


def _checked_names(name: Any, aliases: Any) -> tuple[str, ...]:
    """``(name, *aliases)``, each a lower-case family name (raises naming the bad one)."""
    if isinstance(aliases, str):  # ("a", *"abc") would register "a", "b" and "c"
        raise TypeError(
            f"register_guide({name!r}, ...): aliases must be a tuple of names, got the string "
            f"{aliases!r}; pass aliases=({aliases!r},)."
        )
    try:
        keys = (name, *aliases)
    except TypeError:
        raise TypeError(
            f"register_guide({name!r}, ...): aliases must be a tuple of names; got {aliases!r}."
        ) from None
    for key in keys:
        if not isinstance(key, str) or not re.fullmatch(r"[a-z][a-z0-9_-]*", key):
            raise (ValueError if isinstance(key, str) else TypeError)(
                f"register_guide: expected a lower-case guide name like 'kron-ivon' but got {key!r}."
            )
    return keys


def _check_guide_class(name: str, cls: Any) -> None:
    """Refuse a ``cls`` that is not a class, or lacks methods of the guide contract."""
    from .contract import POSTERIOR_METHODS

    if not isinstance(cls, type):
        raise TypeError(
            f"register_guide({name!r}, cls): cls must be the guide class, not an instance "
            f"({type(cls).__name__} object {cls!r}); pass the class itself, e.g. type(guide)."
        )
    missing = [m for m in POSTERIOR_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise TypeError(
            f"register_guide({name!r}, {cls.__name__}): the class lacks the guide contract's "
            f"methods {missing} (pyrobayes.contract.Posterior). Inherit "
            "pyrobayes.guides.PosteriorGuide, or define them; pyrobayes.testing.check_family "
            "checks the result."
        )


def get_guide_class(name: str) -> type:
    """The class registered under ``name``.

    Parameters
    ----------
    name : str
        A family name (case-insensitive, surrounding spaces ignored), e.g. ``"meanfield"``.

    Returns
    -------
    type

    Raises
    ------
    TypeError
        When ``name`` is not a string (``None``, a guide class, a number).
    ValueError
        When no family is registered under it (naming the closest registered names).
    """
    if not isinstance(name, str):
        if isinstance(name, type):
            got = f"the class {name.__name__}"
            hint = f" To build a {name.__name__} directly, call the class: {name.__name__}(model)."
        else:
            got, hint = f"{name!r} ({type(name).__name__})", ""
        raise TypeError(
            "posterior(model, family): family must be a registered family name (a str), one of "
            f"{available_guides()}; got {got}.{hint}"
        )
    key = name.strip().lower()
    if key in _REGISTRY:
        return _REGISTRY[key]
    close = difflib.get_close_matches(key, list(_REGISTRY), n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(f"Unknown posterior family {name!r}.{hint} Available: {available_guides()}.")


def available_guides() -> list[str]:
    """Registered family names (canonical names first, then aliases)."""
    canonical = sorted({getattr(c, "family", "") for c in _REGISTRY.values()} - {""})
    return canonical + sorted(k for k in _REGISTRY if k not in canonical)


def family_of(guide: Any) -> str:
    """The registry name of a guide instance."""
    family = getattr(type(guide), "family", "")
    if family and _REGISTRY.get(family) is type(guide):
        return family
    for key, cls in _REGISTRY.items():
        if cls is type(guide):
            return key
    raise ValueError(
        f"{type(guide).__name__} is not registered; call pyrobayes.register_guide(name, cls) "
        "so it can be saved and loaded by name."
    )
