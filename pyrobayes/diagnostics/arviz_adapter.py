"""The ArviZ adapter (the only place that knows the ArviZ API): plain group dicts to
``InferenceData`` (arviz 0.x) or ``DataTree`` (ArviZ >= 1)."""

from __future__ import annotations

import importlib.metadata
import warnings
from typing import Any

import numpy as np

_SAMPLE_DIMS = ("chain", "draw")


def _arviz_major() -> int:
    """Major version of the installed ``arviz`` (1 when only ``arviz-base`` is installed)."""
    try:
        return int(importlib.metadata.version("arviz").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        importlib.metadata.version("arviz-base")  # raises if neither is installed
        return 1


def to_arviz(
    groups: dict[str, dict[str, np.ndarray]],
    *,
    dims: dict[str, list[str]],
    attrs: dict[str, Any],
    extra_groups: dict[str, Any] | None = None,
) -> Any:
    """Hand plain group dicts to ArviZ's ``from_dict``: InferenceData (0.x) or DataTree (1.x).

    ``groups`` hold sample-shaped arrays ``(chain, draw, ...)`` (``observed_data``: no sample
    dims); ``extra_groups`` are ready ``xarray.Dataset`` objects without sample dimensions (the
    ``optimization`` group) that are attached unchanged.
    """
    extra_groups = extra_groups or {}
    if _arviz_major() >= 1:
        # ArviZ >= 1 (arviz-base): UNTESTED here (this machine has arviz 0.23.4); written from
        # arviz_base.io_dict.from_dict(data, *, sample_dims, dims, attrs={group|"/": {...}}).
        import xarray as xr
        from arviz_base import from_dict

        tree = from_dict(
            groups,
            sample_dims=list(_SAMPLE_DIMS),
            dims=dims,
            attrs={"/": dict(attrs), **{g: dict(attrs) for g in groups}},
        )
        for name, dataset in extra_groups.items():
            tree[name] = xr.DataTree(dataset=dataset)
        return tree
    import arviz as az

    # `attrs` goes on the InferenceData itself (and observed_data); `<group>_attrs` on each group
    group_attrs = {f"{g}_attrs": dict(attrs) for g in groups if g != "observed_data"}
    arguments: dict[str, Any] = {**groups, **group_attrs}  # keyword arguments of from_dict
    with warnings.catch_warnings():
        # a mixture's chains are its K components (a delta particle has one distinct draw):
        # ArviZ's guess that chains > draws means swapped axes does not apply to this layout
        warnings.filterwarnings("ignore", "More chains .* than draws", UserWarning)
        idata = az.from_dict(dims=dims, attrs=dict(attrs), **arguments)
    if extra_groups:
        idata.add_groups(extra_groups)
    return idata
