r"""Plots: reliability diagram of a predictive, posterior summary of an ArviZ export.

Both work headless (they never call ``plt.show``; pick the Agg backend in scripts with
``MPLBACKEND=Agg``) and return the :class:`matplotlib.figure.Figure`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from ..metrics import calibration_error
from ..models.adapters import check_int

__all__ = ["reliability_diagram", "plot_posterior_summary"]

logger = logging.getLogger(__name__)


def reliability_diagram(probs: Tensor, labels: Tensor, num_bins: int = 15, ax: Any = None) -> Any:
    r"""Reliability diagram: accuracy per confidence bin against the diagonal.

    Examples fall in equal-width bins of confidence :math:`\max_c \bar p_{nc}` (as
    :func:`pyrobayes.metrics.calibration_error`); bar :math:`b` has height
    :math:`\mathrm{acc}_b` (0 for an empty bin), the dots mark :math:`\mathrm{conf}_b`, and the
    gap to the diagonal is the calibration error of the bin. The title carries the ECE.

    Parameters
    ----------
    probs : Tensor
        ``(S, N, C)`` per-sample probabilities (or ``(N, C)``).
    labels : Tensor
        ``(N,)`` integer labels.
    num_bins : int
    ax : matplotlib.axes.Axes, optional
        Draw into this axes (its figure is returned); a new figure otherwise.

    Returns
    -------
    matplotlib.figure.Figure
        Its first axes holds one bar per bin, in bin order (``ax.patches``).
    """
    from matplotlib.figure import Figure

    calib = calibration_error(probs, labels, num_bins=num_bins)
    if ax is None:
        fig = Figure(figsize=(4.0, 4.0))  # no pyplot: no global state, works on any backend
        ax = fig.add_subplot(1, 1, 1)
    else:
        fig = ax.figure
    width = 1.0 / num_bins
    lefts = [b * width for b in range(num_bins)]
    accuracy = calib.bin_accuracy.detach().cpu().double().tolist()
    confidence = calib.bin_confidence.detach().cpu().double().tolist()
    counts = calib.bin_counts.detach().cpu().tolist()
    ax.bar(lefts, accuracy, width=width, align="edge", edgecolor="black", label="accuracy")
    centres = [left + width / 2 for left, c in zip(lefts, counts, strict=True) if c > 0]
    conf = [v for v, c in zip(confidence, counts, strict=True) if c > 0]
    ax.plot(centres, conf, "o", color="tab:red", label="mean confidence")
    ax.plot([0.0, 1.0], [0.0, 1.0], "--", color="gray", label="perfect calibration")
    ax.set_xlim(0.0, 1.0)
    ax.set_ylim(0.0, 1.0)
    ax.set_xlabel("confidence")
    ax.set_ylabel("accuracy")
    ax.set_title(f"ECE = {calib.ece:.3f} ({num_bins} bins)")
    ax.legend(loc="upper left")
    return fig


def plot_posterior_summary(
    idata: Any,
    path: str | Path,
    *,
    var_names: list[str] | str | None = None,
    kind: str = "forest",
    max_rows: int | None = 48,
) -> Path:
    """Plot the posterior group of an export and save it to ``path``.

    Parameters
    ----------
    idata : arviz.InferenceData or xarray.DataTree
        The result of :func:`pyrobayes.to_inference_data`.
    path : str or Path
        Output file; its suffix picks the format (``.png``, ``.pdf``, ``.svg``, ... any that
        matplotlib's ``savefig`` writes; PNG without a suffix).
    var_names : list of str or str, optional
        Variables of the ``posterior`` group to show (default: all); one variable may be named
        by a ``str``, as ArviZ takes it.
    kind : {"forest", "posterior"}
        ``az.plot_forest`` (one row per scalar, compact for matrices) or ``az.plot_posterior``
        (one density panel per scalar).
    max_rows : int (>= 1) or None
        At most this many scalars in all: each variable shows its first entries (the first
        index of every dimension but the last, the first entries of the last), as many as an
        equal share of ``max_rows`` allows. A forest of a LoRA factor's thousands of entries
        is unreadable and took minutes to draw; the file keeps every draw. ``None``: all.

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    ValueError
        ``max_rows`` below 1, or a suffix that names no format matplotlib writes.
    """
    import arviz as az
    import matplotlib.pyplot as plt

    if isinstance(var_names, str):  # as ArviZ reads it (it was split into one-letter names)
        var_names = [var_names]
    path = Path(path)
    file_format = _file_format(path)
    if max_rows is not None:
        max_rows = check_int("max_rows", max_rows, ge=1, owner="plot_posterior_summary: ")
    coords = None if max_rows is None else _first_entries(idata, var_names, max_rows)
    if kind == "forest":
        axes = az.plot_forest(idata, var_names=var_names, coords=coords, combined=True)
    elif kind == "posterior":
        axes = az.plot_posterior(idata, var_names=var_names, coords=coords)
    else:
        raise ValueError(f"Expected kind 'forest' or 'posterior' but got {kind!r}.")
    first = axes.flat[0] if hasattr(axes, "flat") else axes
    fig = first.figure
    fig.savefig(path, format=file_format, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return path


def _file_format(path: Path) -> str:
    """The format ``path``'s suffix names, as matplotlib's ``savefig`` reads it; PNG for a
    path without a suffix (written as given: ``savefig`` would append ``.png``)."""
    from matplotlib.figure import Figure

    suffix = path.suffix.lower().lstrip(".")
    if not suffix:
        return "png"
    formats = Figure().canvas.get_supported_filetypes()
    if suffix not in formats:
        raise ValueError(
            f"plot_posterior_summary: path {str(path)!r} ends in {path.suffix!r}, which names "
            f"no format matplotlib writes; end it in one of {sorted('.' + f for f in formats)} "
            "(e.g. '.png' or '.pdf')."
        )
    return suffix


def _first_entries(
    idata: Any, var_names: list[str] | None, max_rows: int
) -> dict[str, list[Any]] | None:
    """ArviZ ``coords`` that keep about ``max_rows`` scalars of the posterior group in all
    (``None`` when it holds no more): per variable, index 0 of every dimension but the last and
    the first entries of the last."""
    posterior = getattr(idata, "posterior", None)
    if posterior is None:
        try:
            posterior = idata["posterior"].to_dataset()
        except (KeyError, TypeError, AttributeError):
            return None
    names = list(var_names) if var_names is not None else list(posterior.data_vars)
    dims = {n: [d for d in posterior[n].dims if d not in ("chain", "draw")] for n in names}
    total = sum(int(np.prod([posterior.sizes[d] for d in ds])) for ds in dims.values())
    if total <= max_rows:
        return None
    share = max(1, max_rows // max(1, len(names)))
    coords: dict[str, list[Any]] = {}
    for ds in dims.values():
        for d in ds[:-1]:
            coords[d] = posterior[d].values[:1].tolist()
        if ds:
            coords[ds[-1]] = posterior[ds[-1]].values[:share].tolist()
    return coords
