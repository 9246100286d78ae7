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
    """Register ``cls`` under ``name`` (lower-case, unique; ``KeyError`` on collision)."""
    for key in (name, *aliases):
        if not re.fullmatch(r"[a-z][a-z0-9_-]*", key):
            raise ValueError(f"Expected a lower-case guide name like 'kron-ivon' but got {key!r}.")
        if key in _REGISTRY and _REGISTRY[key] is not cls:
            raise KeyError(
                f"Guide name {key!r} is already registered to {_REGISTRY[key].__name__}."
            )
        _REGISTRY[key] = cls
    return cls


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
