r"""The InfoNCE-corrected ELBO of a symmetrized (permutation-invariant) posterior.

For ``q_G(θ) = (1/|G|) Σ_g q(g⁻¹·θ)`` (:class:`~pyrobayes.guides.SymmetrizedGuide`),
``ELBO(q_G) = ELBO(q) + I(g; θ)`` (Gelberg et al., 2024, Sec. 4), and the training objective,
still a lower bound on ``log p(D)``, is

.. math::

    L_K(q) = \mathbb E_q[\log p(D\mid θ)] - \mathrm{KL}(q\,\|\,p) + I_K,\qquad
    I_K = \log q(θ_0) - \Big(\operatorname{logsumexp}_{k=1}^{K} \log q(h_k·θ_0) - \log K\Big)

with ``θ₀ ~ q`` (reparameterized), ``h_1 = id`` and ``h_{2..K} ~ Unif(G)``. The KL is the base's
closed form when it has one (as ``TraceMeanField_ELBO``), so ``L_K`` and the plain ELBO are
compared on the same estimator.

Two forms, the same value on the same draws (tested):

* :class:`BatchedSymmetrizedELBO`, the default objective of the family in :func:`pyrobayes.fit`
  (all particles in one batched forward);
* :class:`SymmetrizedELBO`, a ``pyro.infer.TraceMeanField_ELBO`` for plain ``pyro.infer.SVI``
  (``pyrobayes.fit(loss=SymmetrizedELBO())`` runs its batched form).
"""

from __future__ import annotations

import math
import warnings
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import pyro
import torch
from torch import Tensor

from ..contract import AnalyticKL, implements
from ..contract import Symmetrized as SymmetrizedPosterior
from ..models.adapters import check_int
from ..models.permutation import PermutationSpec
from ..user_frame import user_stacklevel
from .distributed import all_reduce_sum_, world
from .meanfield import MeanField
from .objectives import ELBO, register_objective, scaled_log_likelihood

__all__ = [
    "Symmetrized",
    "SymmetrizedELBO",
    "BatchedSymmetrizedELBO",
    "SaturationWatch",
    "SATURATION_PATIENCE",
]


@dataclass(frozen=True)
class Symmetrized(MeanField):
    r"""The symmetrized family's fit settings: the objective's K and the base's scale learning
    rate, the fitter's, not the posterior's.

    Pass it as the fit's optimizer, ``pb.fit(model, guide, data, ...,
    optim=pb.Optimization(optimizer=pb.infer.Symmetrized(num_permutations=16)))`` or
    ``make_fitter(model, guide, optimizer=pb.infer.Symmetrized(...))``: the fitter binds K to
    :class:`BatchedSymmetrizedELBO` (when the objective leaves K unset) and steps the base's
    scales at ``scale_lr · lr``. Saved in the fitter's checkpoint (a resume under other settings
    is refused).

    Parameters
    ----------
    scale_lr : float
        The base's scale learning-rate factor (:class:`~pyrobayes.infer.meanfield.MeanField`;
        default 1).
    num_permutations : int
        K ≥ 1, the group elements per draw of the InfoNCE estimate ``I_K`` (Gelberg et al.,
        2024, Sec. 4; default 16). K = 1 is the base's ELBO exactly.
    kl_weight : float
        Only 1 (the bound's); another value is refused.
    """

    num_permutations: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = f"{type(self).__name__}(): "
        num = check_int("num_permutations", self.num_permutations, ge=1, owner=owner)
        object.__setattr__(self, "num_permutations", num)
        if self.kl_weight != 1.0:
            raise ValueError(
                f"{owner}kl_weight={self.kl_weight:g}: the symmetrized objective is the ELBO "
                "plus I_K, a bound with the KL at weight 1; a tempered KL is mean-field's "
                "(pb.infer.MeanField(kl_weight=...))."
            )

    def bind(self, objective: Any) -> Any:
        """``objective`` with K set to ``num_permutations`` when it is the batched symmetrized
        ELBO with K unset (a K given to the objective wins)."""
        if isinstance(objective, BatchedSymmetrizedELBO) and objective.num_permutations is None:
            return BatchedSymmetrizedELBO(
                objective.num_particles, self.num_permutations, objective.analytic_kl
            )
        return objective


#: Consecutive saturated training evaluations after which the fit warns that I_K is inert.
SATURATION_PATIENCE = 50


class SaturationWatch:
    """Warns once when ``I_K`` sat at ``log K`` (zero gradient) for ``patience`` consecutive
    training evaluations: the symmetrized objective is then the base's ELBO exactly."""

    def __init__(self, patience: int = SATURATION_PATIENCE) -> None:
        self.patience = int(patience)
        self.count = 0
        self.warned = False

    def update(self, guide: Any, num_permutations: int) -> None:
        saturated, nearest = getattr(guide, "last_saturation", (False, 0.0))
        self.count = self.count + 1 if saturated else 0
        if self.warned or self.count < self.patience:
            return
        self.warned = True
        warnings.warn(
            f"I_K saturated at log K = {math.log(num_permutations):.3g} for {self.count} "
            "consecutive steps: the permutation bonus is inert on this model because the "
            "permuted copies of q do not overlap (the nearest copy's log density ratio at a "
            f"draw is {nearest:.3g}: the units' weights differ by many posterior standard "
            "deviations), so I_K's gradient is 0 (below 1e-8 of a term's) and the fit is the base's ELBO. Expected "
            "on pretrained or trained networks whose hidden units / LoRA rank components are "
            "distinct; the bonus acts only while q is as wide as the distance between units. "
            "See docs/methods/symmetrized.md.",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )


def _check_guide(guide: Any, owner: str) -> None:
    if not implements(guide, SymmetrizedPosterior):
        raise TypeError(
            f"{owner} needs a symmetrized guide (pb.posterior(model, 'symmetrized', ...)); got "
            f"{type(guide).__name__}. Use the plain ELBO for other families."
        )


def _recording_calls(guide: Any, model: Any, batch: Any) -> AbstractContextManager[None]:
    """The guide's :meth:`~pyrobayes.guides.SymmetrizedGuide.recording_calls` block (the
    first forward's check of the symmetry, measured on ``batch`` and agreed by the ranks,
    :func:`agree_across_ranks`), or a no-op for another implementation of the protocol."""
    record = getattr(guide, "recording_calls", None)
    return nullcontext() if record is None else record(model, batch=batch, agree=agree_across_ranks)


def agree_across_ranks(changes: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """Under ``torch.distributed``, per unit layer the worst of every rank's measurement
    ``(change, tolerance)`` (:meth:`~pyrobayes.models.PermutationSpec.worse_change`), the same
    on every rank; ``changes`` itself in one process.

    Each rank measures the symmetry on its own first batch: an asymmetry that only some ranks'
    rows expose would otherwise leave the ranks with different groups, so different ``I_K``
    whose all-reduced gradients mix two objectives. One all-reduce, once per fit: a sum of a
    ``(world, layers, 2)`` table in which each rank fills its own row, so that every rank
    receives every row (a NaN stays in its rank's row). None in one process.
    """
    size, rank = world()
    if size == 1 or not changes:
        return changes
    names = sorted(changes)  # the same layers on every rank: the spec is the model's
    table = torch.zeros(size, len(names), 2, dtype=torch.float64)
    table[rank] = torch.tensor([changes[n] for n in names], dtype=torch.float64)
    all_reduce_sum_([table])
    rows = table.tolist()
    agreed = {}
    for i, name in enumerate(names):
        worst = changes[name]
        for row in rows:
            worst = PermutationSpec.worse_change(worst, (row[i][0], row[i][1]))
        agreed[name] = worst
    return agreed


class BatchedSymmetrizedELBO(ELBO):
    r"""Negative ``L_K`` on the batched path: ``−(N/B) Σ_b mean_s log p(y_b|θ_s) + KL − I_K``
    (the symmetrized ELBO of Gelberg et al., 2024, Sec. 4).

    Parameters
    ----------
    num_particles : int
        S, draws ``θ₀`` per step (``I_K`` is averaged over them).
    num_permutations : int, optional
        K; default the fit's (:class:`Symmetrized`, bound by the fitter), else the guide's
        ``num_permutations`` (direct calls). K = 1 is the plain ELBO exactly.
    analytic_kl : bool
        The base's closed-form KL when it has one.

    Notes
    -----
    After each ``loss`` call :meth:`terms` holds ``L_K``, the plain ``elbo`` and ``I_K`` of that
    evaluation (detached); :func:`pyrobayes.fit` reports them in ``FitResult.state["terms"]``.
    """

    def __init__(
        self, num_particles: int = 1, num_permutations: int | None = None, analytic_kl: bool = True
    ) -> None:
        owner = f"{type(self).__name__}: "
        num_particles = check_int("num_particles", num_particles, ge=1, owner=owner)
        super().__init__(num_particles=num_particles, analytic_kl=analytic_kl)
        self.num_permutations = (
            None
            if num_permutations is None
            else check_int("num_permutations", num_permutations, ge=1, owner=owner)
        )
        self._terms: dict[str, Tensor] = {}
        self.saturation = SaturationWatch()

    def loss(self, model: Any, guide: Any, batch: Any) -> Tensor:
        _check_guide(guide, type(self).__name__)
        values, kl = None, None
        if self.analytic_kl and implements(guide, AnalyticKL):
            try:
                values, kl = guide.rsample_with_kl(self.num_particles, model)
            except NotImplementedError:  # no formula for this prior: Monte Carlo below
                values = None
        if values is None or kl is None:
            values = guide.rsample(self.num_particles)
            kl = (guide.log_prob(values) - model.log_prior(values)).mean()
        with _recording_calls(guide, model, batch):  # the first forward only (a no-op after)
            nll = -scaled_log_likelihood(model, values, batch)
        info = guide.infonce(values, self.num_permutations).mean()
        if torch.is_grad_enabled():  # a training evaluation
            num = self.num_permutations or guide.num_permutations
            self.saturation.update(guide, num)
        negative_elbo = nll + kl
        loss = negative_elbo - info
        self._terms = {
            "L_K": -loss.detach(),
            "elbo": -negative_elbo.detach(),
            "I_K": info.detach(),
        }
        return loss

    def terms(self) -> dict[str, Tensor]:
        """``{"L_K", "elbo", "I_K"}`` of the last evaluation (the bounds, not the loss)."""
        return dict(self._terms)


class SymmetrizedELBO(pyro.infer.TraceMeanField_ELBO):
    r"""``TraceMeanField_ELBO − I_K``: the symmetrized ELBO for plain ``pyro.infer.SVI``
    (Gelberg et al., 2024, Sec. 4).

    .. math:: \mathcal L = -\big(\mathbb E_q\log p(D\mid θ) - \mathrm{KL}(q\,\|\,p)\big) - I_K

    ``I_K`` is evaluated at the guide trace's draws of the latent sites (per particle).

    Parameters
    ----------
    num_permutations : int, optional
        K; default the guide's.
    **kwargs
        ``pyro.infer.TraceMeanField_ELBO`` options (``num_particles``, ...). Vectorized
        particles are not supported.

    Examples
    --------
    >>> svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), SymmetrizedELBO())  # doctest: +SKIP
    """

    def __init__(self, num_permutations: int | None = None, **kwargs: Any) -> None:
        if kwargs.get("vectorize_particles"):
            raise ValueError("SymmetrizedELBO does not support vectorize_particles=True.")
        owner = f"{type(self).__name__}: "
        if "num_particles" in kwargs:  # Pyro's ELBO stores any value (2.5 ran as 2 draws)
            kwargs["num_particles"] = check_int(
                "num_particles", kwargs["num_particles"], ge=1, owner=owner
            )
        super().__init__(**kwargs)
        self.num_permutations = (
            None
            if num_permutations is None
            else check_int("num_permutations", num_permutations, ge=1, owner=owner)
        )
        self._guide: Any = None
        self.saturation = SaturationWatch()

    def batched_objective(self) -> BatchedSymmetrizedELBO:
        """The same objective on pyrobayes' batched path (what :func:`pyrobayes.fit` runs)."""
        return BatchedSymmetrizedELBO(self.num_particles, self.num_permutations)

    def _with_guide(self, guide: Any) -> None:
        _check_guide(guide, type(self).__name__)
        self._guide = guide

    def loss(self, model: Any, guide: Any, *args: Any, **kwargs: Any) -> float:
        self._with_guide(guide)
        with _recording_calls(guide, model, _model_batch(args, kwargs)):  # settled by infonce
            return super().loss(model, guide, *args, **kwargs)

    def differentiable_loss(self, model: Any, guide: Any, *args: Any, **kwargs: Any) -> Any:
        self._with_guide(guide)
        with _recording_calls(guide, model, _model_batch(args, kwargs)):  # settled by infonce
            return super().differentiable_loss(model, guide, *args, **kwargs)

    def loss_and_grads(self, model: Any, guide: Any, *args: Any, **kwargs: Any) -> float:
        self._with_guide(guide)
        with _recording_calls(guide, model, _model_batch(args, kwargs)):  # settled by infonce
            return super().loss_and_grads(model, guide, *args, **kwargs)

    def _differentiable_loss_particle(self, model_trace: Any, guide_trace: Any) -> Any:
        loss, surrogate = super()._differentiable_loss_particle(model_trace, guide_trace)
        guide = self._guide
        values = {s: guide_trace.nodes[s]["value"].unsqueeze(0) for s in guide.sites}
        info = guide.infonce(values, self.num_permutations).sum()
        if torch.is_grad_enabled():
            self.saturation.update(guide, self.num_permutations or guide.num_permutations)
        return loss - float(info.detach()), surrogate - info


def _model_batch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The batch of a Pyro loss call ``loss(model, guide, batch)`` (``None`` when there is
    none: the symmetry check then reads the record of the network's calls alone)."""
    return args[0] if args else kwargs.get("batch")


register_objective("symmetrized-elbo", BatchedSymmetrizedELBO)
