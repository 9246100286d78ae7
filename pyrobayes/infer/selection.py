r"""Checkpoint selection on held-out data (SPECS 2(b) TRAIN_MAP: "select by validation").

At the end of every epoch :func:`pyrobayes.fit` scores the guide's
:meth:`~pyrobayes.guides.base.PosteriorGuide.validation_values` on ``val_data`` and keeps an
in-memory copy of the best state (guide state and the model's point parameters); at the end of
training that state is restored, *before* the family's ``fit_end`` (so Laplace fits its curvature
at the selected MAP).

Scores (all "lower is better" internally):

- ``"nll"``: :math:`-\frac1N\sum_n \log \frac1S \sum_s p(y_n \mid x_n, θ_s)` (any likelihood);
- ``"accuracy"``: classification accuracy of :math:`\bar p`, ties broken by the NLL;
- ``"rmse"``: regression RMSE of the predictive mean.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from .. import metrics

__all__ = ["SELECT_BY", "Snapshot", "validation_score"]

SELECT_BY = ("nll", "accuracy", "rmse")


def validation_score(
    model: Any, guide: Any, data: Iterable[Any], select_by: str
) -> tuple[tuple[float, ...], dict[str, float]]:
    """``(key, metrics)``: ``key`` sorts better scores first; ``metrics`` is what was measured.

    The model is left in training mode afterwards (this runs between epochs).
    """
    from ..predictive import predict  # local: predictive imports nothing from infer

    pred = predict(model, guide, data, values=guide.validation_values(), seed=None)
    model.train(True)
    if pred.targets is None:
        raise ValueError("fit(val_data=...): the validation batches carry no targets.")
    if pred.log_probs is not None:
        nll = metrics.nll(None, pred.targets, log_probs=pred.log_probs)
        measured = {"nll": nll, "accuracy": metrics.accuracy(pred.probs, pred.targets)}
        if select_by == "accuracy":
            return (-measured["accuracy"], nll), measured
        if select_by == "nll":
            return (nll,), measured
        raise ValueError(
            f"fit(select_by={select_by!r}) is for regression; use 'nll' or 'accuracy' here."
        )
    if select_by == "accuracy":
        raise ValueError(
            "fit(select_by='accuracy') needs a classification likelihood; use 'nll' or 'rmse'."
        )
    loc, targets = pred.loc.flatten(1), pred.targets.flatten()
    measured = {
        "nll": metrics.gaussian_nll(loc, targets, pred.scale),
        "rmse": metrics.gaussian_rmse(loc, targets),
    }
    return (measured[select_by],), measured


class Snapshot:
    """A detached copy of the guide's state and the model's point parameters."""

    def __init__(self, guide_state: dict[str, Tensor], point: dict[str, Tensor]) -> None:
        self.guide_state, self.point = guide_state, point

    @classmethod
    def capture(cls, model: Any, guide: Any) -> Snapshot:
        with torch.no_grad():
            state = {k: v.detach().clone() for k, v in guide.state_dict().items()}
            point = {k: p.detach().clone() for k, p in getattr(model, "point_params", {}).items()}
        return cls(state, point)

    def restore(self, model: Any, guide: Any) -> None:
        guide.load_state_dict(self.guide_state)
        params = getattr(model, "point_params", {})
        with torch.no_grad():
            for k, v in self.point.items():
                params[k].copy_(v)

    def to_dict(self) -> dict[str, dict[str, Tensor]]:
        return {"guide": self.guide_state, "point": self.point}

    @classmethod
    def from_dict(cls, d: dict[str, dict[str, Tensor]]) -> Snapshot:
        return cls(d["guide"], d["point"])
