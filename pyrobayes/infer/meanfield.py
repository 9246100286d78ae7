r"""Mean-field's fit settings: the learning-rate factor of the posterior scales.

A mean-field Gaussian ``q(θ) = Π_i N(θ_i; μ_i, σ_i²)`` (:class:`~pyrobayes.guides.MeanFieldGuide`)
is fitted by the ``"svi"`` fitter (:class:`~pyrobayes.infer.fitter.SVIFitter`): Adam on the
reparameterized ELBO. How fast its scales may move is a setting of that fit, not of q, so it is
the fitter's (saved in its checkpoint, never with the posterior).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..models.adapters import check_real

__all__ = ["MeanField"]


@dataclass(frozen=True)
class MeanField:
    r"""Mean-field's fit settings, the fitter's, not the posterior's.

    Pass it as the fit's optimizer, ``pb.fit(model, guide, data, ...,
    optim=pb.Optimization(optimizer=pb.infer.MeanField(scale_lr=10.0)))`` or
    ``make_fitter(model, guide, optimizer=pb.infer.MeanField(...))``: the fitter's default Adam
    then steps the scale parameters at ``scale_lr · lr`` and every other parameter at ``lr``.
    Saved in the fitter's checkpoint (a resume under other settings is refused).

    Parameters
    ----------
    scale_lr : float
        Multiplier (> 0) of the learning rate for the scale parameters (default 1: plain Adam,
        one parameter group). Adam moves the unconstrained scale ``softplus⁻¹(σ) ≈ log σ`` by
        about ``lr`` a step whatever its gradient (Kingma and Ba, 2015, Sec. 2.1: the step is
        bounded by the learning rate), so σ changes by at most ``e^{lr·t}`` in t steps: at
        ``lr = 1e-2`` a factor 7 in 200 steps. ``scale_lr=10`` lets σ reach the ELBO's optimum
        within a short fit.
    """

    scale_lr: float = 1.0

    def __post_init__(self) -> None:
        owner = f"{type(self).__name__}(): "
        object.__setattr__(
            self, "scale_lr", check_real("scale_lr", self.scale_lr, gt=0, owner=owner)
        )

    def bind(self, objective: Any) -> Any:
        """The fit's objective under these settings (unchanged here; see
        :class:`pyrobayes.infer.symmetrized.Symmetrized`)."""
        return objective
