r"""Training objectives evaluated on the sample-batched path (no Pyro tracing on the hot path).

Every objective here is a **dataset-sum** estimate (the Pyro ELBO convention: the minibatch
log-likelihood is scaled by N/B, the prior / KL enters once). They agree with Pyro's
``TraceMeanField_ELBO`` / ``Trace_ELBO`` on the same draws (tested), but evaluate all particles in
one forward and skip trace bookkeeping.

A ``pyro.infer.ELBO`` instance can be passed to :func:`pyrobayes.fit` instead; it is then run
through Pyro (``loss.differentiable_loss(model, guide, batch)``).
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

from ..batch import batch_size, split_batch
from ..guides.contract import AnalyticKL, Posterior, PostHoc

__all__ = ["Objective", "ELBO", "MAP", "PyroObjective", "make_objective", "scaled_log_likelihood"]


class Objective(Protocol):
    """``loss(model, guide, batch) -> scalar tensor`` to minimise."""

    def loss(self, model: Any, guide: Any, batch: Any) -> Tensor: ...


def split_training_batch(model: Any, batch: Any) -> tuple[Any, Tensor]:
    """``(inputs, targets)`` of a training batch; a clear error when it carries no targets."""
    inputs, targets = split_batch(batch, model.label_key)
    if targets is None:
        raise ValueError(
            f"Training batches must carry targets (under {model.label_key!r} for dict batches, "
            "or as (x, y) tuples)."
        )
    return inputs, targets


def scaled_log_likelihood(model: Any, values: dict[str, Tensor], batch: Any) -> Tensor:
    r"""``(N/B) Σ_b mean_s log p(y_b | θ_s)`` on the batched path."""
    inputs, targets = split_training_batch(model, batch)
    params = model.batched_output(inputs, values)  # (S, B, ...)
    log_lik = model.log_likelihood(params, targets)  # (S, B)
    size = batch_size(inputs)
    scale = (model.num_data or size) / size
    return scale * log_lik.mean(0).sum()


class ELBO:
    r"""Reparameterized negative ELBO.

    .. math::

        \mathcal L = -\frac{N}{B}\sum_{b}\frac1S\sum_s \log p(y_b\mid x_b,θ_s)
                     + \mathrm{KL}(q\,\|\,p),\qquad θ_s \sim q

    The KL is analytic when ``analytic_kl`` and the family/prior pair has one (mean-field vs the
    Gaussian prior), else the Monte Carlo estimate ``(1/S) Σ_s [log q(θ_s) − log p(θ_s)]``.
    Unbiased for the ELBO in both cases; particles run in one batched forward.

    Parameters
    ----------
    num_particles : int
        S, draws per step.
    analytic_kl : bool
        Use the closed-form KL when available.
    """

    def __init__(self, num_particles: int = 1, analytic_kl: bool = True) -> None:
        if num_particles < 1:
            raise ValueError(f"Expected num_particles >= 1 but got {num_particles}.")
        self.num_particles = int(num_particles)
        self.analytic_kl = analytic_kl

    def loss(self, model: Any, guide: Any, batch: Any) -> Tensor:
        if self.analytic_kl and isinstance(guide, AnalyticKL):
            try:  # draws and the analytic KL in one pass
                values, kl = guide.rsample_with_kl(self.num_particles, model)
            except NotImplementedError:  # no formula for this prior: Monte Carlo below
                pass
            else:
                return kl - scaled_log_likelihood(model, values, batch)
        values = guide.rsample(self.num_particles)
        nll = -scaled_log_likelihood(model, values, batch)
        kl = (guide.log_prob(values) - model.log_prior(values)).mean()
        return nll + kl


class MAP:
    r"""Negative log joint at the point estimate: ``−(N/B) Σ_b log p(y_b|θ̂) − log p(θ̂)``.

    ``θ̂`` is the point of a :class:`~pyrobayes.guides.contract.PostHoc` posterior (its ``loc``,
    which SWAG and Laplace train before their posterior exists), else one draw of the guide
    (the point itself for :class:`~pyrobayes.guides.DeltaGuide`).
    """

    def loss(self, model: Any, guide: Posterior, batch: Any) -> Tensor:
        if isinstance(guide, PostHoc):
            values = {s: guide.loc(s).unsqueeze(0) for s in guide.sites}
        else:
            values = guide.rsample(1)
        return -scaled_log_likelihood(model, values, batch) - model.log_prior(values).sum()


class PyroObjective:
    """Wrap a ``pyro.infer.ELBO``: ``loss = elbo.differentiable_loss(model, guide, batch)``."""

    def __init__(self, elbo: Any) -> None:
        self.elbo = elbo

    def loss(self, model: Any, guide: Any, batch: Any) -> Tensor:
        return self.elbo.differentiable_loss(model, guide, batch)


def make_objective(spec: Any) -> Any:
    """Resolve a name (``"elbo"``, ``"map"``), a ``pyro.infer.ELBO`` or an object with ``loss``."""
    if isinstance(spec, str):
        table = {"elbo": ELBO, "map": MAP}
        if spec not in table:
            raise ValueError(
                f"Unknown objective {spec!r}; expected one of {sorted(table)}, a "
                "pyro.infer.ELBO instance, or an object with loss(model, guide, batch)."
            )
        return table[spec]()
    if hasattr(spec, "differentiable_loss"):
        return PyroObjective(spec)
    if hasattr(spec, "loss"):
        return spec
    raise TypeError(f"Cannot use {type(spec).__name__} as an objective.")
