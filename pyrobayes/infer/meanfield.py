r"""Mean-field's fit settings: the learning-rate factor of the posterior scales and the KL's weight.

A mean-field Gaussian ``q(θ) = Π_i N(θ_i; μ_i, σ_i²)`` (:class:`~pyrobayes.guides.MeanFieldGuide`)
is fitted by the ``"svi"`` fitter (:class:`~pyrobayes.infer.fitter.SVIFitter`): Adam on the
reparameterized ELBO. How fast its scales may move is a setting of that fit, not of q, so it is
the fitter's (saved in its checkpoint, never with the posterior).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..models.adapters import check_real
from .objectives import ELBO

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
    kl_weight : float
        w > 0, the weight of ``KL(q ‖ p)`` in the fit's objective (default 1: the ELBO). w < 1
        fits a tempered ("cold") posterior, the ELBO of the likelihood raised to ``1/w``
        (Wenzel et al., 2020, Sec. 4): narrower, nearer the MAP. Needs the fitter's own
        :class:`~pyrobayes.infer.objectives.ELBO` (the default objective).
    """

    scale_lr: float = 1.0
    kl_weight: float = 1.0

    def __post_init__(self) -> None:
        owner = f"{type(self).__name__}(): "
        object.__setattr__(
            self, "scale_lr", check_real("scale_lr", self.scale_lr, gt=0, owner=owner)
        )
        object.__setattr__(
            self, "kl_weight", check_real("kl_weight", self.kl_weight, gt=0, owner=owner)
        )

    def bind(self, objective: Any) -> Any:
        """The fit's objective under these settings: the ELBO with ``kl_weight`` (unchanged at
        1; see also :class:`pyrobayes.infer.symmetrized.Symmetrized`)."""
        if self.kl_weight == 1.0:
            return objective
        if type(objective) is not ELBO:
            raise TypeError(
                f"{type(self).__name__}(kl_weight={self.kl_weight:g}) weights the KL of "
                f"pyrobayes.infer.ELBO, the fitter's default objective, not "
                f"{type(objective).__name__}; drop loss= (or pass ELBO(kl_weight=...) "
                "yourself) or keep kl_weight=1."
            )
        return ELBO(objective.num_particles, objective.analytic_kl, kl_weight=self.kl_weight)
