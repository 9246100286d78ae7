r"""The linearised (GLM) Laplace predictive with dense Jacobians.

GLM predictive. ``f(x) ~ N(f(x; θ*), J(x) Σ J(x)ᵀ)``; class probabilities by the probit
approximation ``softmax(f / sqrt(1 + π/8 · diag(JΣJᵀ)))`` or Monte Carlo over the logits.
:func:`pyrobayes.predict` evaluates it by default (:mod:`pyrobayes.linearized`: Jacobians of the
K read outputs only, chunked); :func:`glm_predict` here forms dense Jacobians of the whole
batch output and is kept for comparison.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from ..batch import split_batch, to_device
from ..predictive import Prediction

logger = logging.getLogger(__name__)

__all__ = ["glm_moments", "glm_predict"]


def _functional_variance(guide: Any, jac: Mapping[str, Tensor]) -> Tensor:
    """``J Σ Jᵀ`` `(B, C, C)` from per-site Jacobians ``(B, C, *site_shape)`` (the guide's)."""
    return guide.functional_covariance(jac)


def _check_posterior(guide: Any, owner: str) -> None:
    """A fitted guide whose posterior precision is usable (a Laplace guide's ``check_finite``
    names a non-finite ``H + τ I`` by site)."""
    guide.require_fitted()
    check_finite = getattr(guide, "check_finite", None)
    if callable(check_finite):
        check_finite(owner)


def glm_moments(model: Any, guide: Any, inputs: Any) -> tuple[Tensor, Tensor]:
    """Mean ``f(x; θ*)`` `(B, C)` and covariance ``J Σ Jᵀ`` `(B, C, C)` of the linearized model."""
    _check_posterior(guide, "glm_moments: ")
    return _moments(model, guide, inputs)


def _moments(model: Any, guide: Any, inputs: Any) -> tuple[Tensor, Tensor]:
    """:func:`glm_moments` of a guide already checked (once per prediction, not per batch)."""
    values = dict(guide.linearization_point())
    fixed = guide.fixed_point()  # sites outside subset=: held at their MAP, no Jacobian

    def f(vals: dict[str, Tensor]) -> Tensor:
        out = model.output(inputs, {**fixed, **vals})
        return out.unsqueeze(-1) if out.dim() == 1 else out

    with torch.no_grad():
        mean = f(values)
    # forward mode costs one JVP per site number, reverse mode one VJP per output (B·C): the
    # reverse-mode Jacobian of a batched function is O(B²C), so use forward mode when it needs fewer
    # passes and every op supports it (e.g. CPU flash attention does not)
    jac = None
    if sum(int(v.numel()) for v in values.values()) < mean.numel():
        try:
            jac = torch.func.jacfwd(f)(values)
        except NotImplementedError:
            logger.debug("forward-mode AD unavailable; using reverse mode for the GLM Jacobian")
    if jac is None:
        jac = torch.func.jacrev(f)(values)
    return mean.detach(), _functional_variance(guide, {s: j.detach() for s, j in jac.items()})


def glm_predict(
    model: Any,
    guide: Any,
    data: Iterable[Any],
    *,
    link: str = "probit",
    num_samples: int = 100,
    seed: int | None = 0,
    device: str | torch.device | None = None,
) -> Prediction:
    r"""Linearized (GLM) Laplace predictive on every batch of ``data``.

    ``f(x) ~ N(f(x; θ*), J Σ Jᵀ)``. Classification: ``link="probit"`` returns one "sample"
    ``log softmax(f / sqrt(1 + π/8 diag(JΣJᵀ)))``; ``link="mc"`` returns ``num_samples`` draws of
    ``log softmax(f)`` (average the probabilities, as every pyrobayes metric does). Regression:
    ``"probit"`` returns the mean (``loc (1, N)``), ``"mc"`` draws of the latent mean.

    Returns
    -------
    Prediction
    """
    if link not in ("probit", "mc"):
        raise ValueError(f"Expected link 'probit' or 'mc' but got {link!r}.")
    if device is not None:
        model.to(device)
        guide.to(device)
    _check_posterior(guide, "glm_predict: ")
    model.train(False)
    dev = model.device
    generator = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
    classification = model.likelihood.is_classification
    outputs: list[Tensor] = []
    targets: list[Tensor] = []
    for batch in data:
        inputs, y = split_batch(to_device(batch, dev), model.label_key)
        mean, cov = _moments(model, guide, inputs)
        if link == "probit":
            if classification:
                kappa = torch.rsqrt(1.0 + math.pi / 8.0 * torch.diagonal(cov, dim1=-2, dim2=-1))
                out = torch.log_softmax(kappa * mean, -1).unsqueeze(0)
            else:
                out = mean.squeeze(-1).unsqueeze(0)
        else:
            c = cov.shape[-1]
            jitter = 1e-10 * torch.eye(c, dtype=cov.dtype, device=cov.device)
            chol = torch.linalg.cholesky(cov + jitter)
            eps = torch.randn((num_samples, *mean.shape), generator=generator, dtype=mean.dtype).to(
                dev
            )
            logits = mean + torch.einsum("bce,sbe->sbc", chol, eps)
            out = torch.log_softmax(logits, -1) if classification else logits.squeeze(-1)
        outputs.append(out.detach())
        if y is not None:
            targets.append(y)
    target = torch.cat(targets, 0) if targets else None
    return Prediction.from_outputs(torch.cat(outputs, 1), target, model.likelihood)
