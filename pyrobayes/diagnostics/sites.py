"""Which latent sites an export keeps in full, and which it summarises by their norm."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["DEFAULT_MAX_SITE_NUMEL", "select_sites"]

#: Default cap on the number of posterior scalars per draw exported to the ``posterior`` group.
DEFAULT_MAX_SITE_NUMEL = 10_000


def site_numel(shape: Sequence[int]) -> int:
    return int(torch.Size(shape).numel())


def site_shapes(model: Any, guide: Any) -> dict[str, torch.Size]:
    guide.require_setup()
    shapes = dict(guide.sites)
    if not shapes:
        shapes = {s: torch.Size(spec.shape) for s, spec in model.latent_sites.items()}
    return {s: torch.Size(v) for s, v in shapes.items()}


def select_sites(
    shapes: dict[str, torch.Size],
    sites: Sequence[str] | None = None,
    max_site_numel: int = DEFAULT_MAX_SITE_NUMEL,
) -> tuple[list[str], list[str]]:
    """Split latent sites into exported (full values) and summarised (norm only) ones.

    With ``sites=None`` sites are taken in declaration order while their cumulative ``numel``
    stays within ``max_site_numel``; the rest are summarised. An explicit ``sites`` list is
    exported as asked (unknown names raise ``KeyError``).

    Parameters
    ----------
    shapes : dict
        ``{site: shape}`` of every latent site.
    sites : sequence of str, optional
        Site names; one name may be given as a ``str`` (it was read as a sequence of
        one-character names), and any iterable of names (a generator) is read once.
    max_site_numel : int or float
        A number >= 0; ``float("inf")`` keeps every site in full.

    Returns
    -------
    chosen, omitted : list of str

    Raises
    ------
    KeyError
        An unknown site.
    TypeError, ValueError
        ``max_site_numel`` that is not a number >= 0 (``None``, ``-1``: read as "no limit",
        they failed in a comparison or summarised every site and drew one draw per pass).
    """
    _check_max_site_numel(max_site_numel)
    if isinstance(sites, str):
        sites = [sites]
    if sites is not None:
        # a one-shot iterable (a generator) was consumed by the check below: none was chosen
        sites = list(sites)
        unknown = [s for s in sites if s not in shapes]
        if unknown:
            raise KeyError(f"Unknown sites {unknown}; the latent sites are {list(shapes)}.")
        chosen = list(dict.fromkeys(sites))
        return chosen, [s for s in shapes if s not in chosen]
    chosen, omitted, used = [], [], 0
    for site, shape in shapes.items():
        if used + site_numel(shape) <= max_site_numel:
            chosen.append(site)
            used += site_numel(shape)
        else:
            omitted.append(site)
    return chosen, omitted


def _check_max_site_numel(max_site_numel: Any) -> None:
    """Raise unless ``max_site_numel`` is a number >= 0 (an integer, NumPy's included, or a
    float such as ``inf``)."""
    number = isinstance(max_site_numel, numbers.Real) and not isinstance(max_site_numel, bool)
    if not number:
        raise TypeError(
            "to_inference_data / select_sites: max_site_numel must be a number >= 0, the "
            f"posterior scalars exported per draw; got {max_site_numel!r} "
            f"({type(max_site_numel).__name__}). Pass float('inf') to export every site in full."
        )
    if not max_site_numel >= 0:  # (NaN too)
        raise ValueError(
            "to_inference_data / select_sites: max_site_numel must be a number >= 0, the "
            f"posterior scalars exported per draw; got {max_site_numel!r}. Pass float('inf') "
            "to export every site in full, 0 to export only their norms."
        )
