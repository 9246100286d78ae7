r"""The linearised (GLM) Laplace predictive with dense Jacobians.

GLM predictive. ``f(x) ~ N(f(x; θ*), J(x) Σ J(x)ᵀ)``; class probabilities by the probit
approximation ``softmax(f / sqrt(1 + π/8 · diag(JΣJᵀ)))`` or Monte Carlo over the logits.
:func:`pyrobayes.predict` evaluates it by default (:mod:`pyrobayes.linearized`: Jacobians of the
K read outputs only, chunked); :func:`glm_predict` here forms dense Jacobians of the whole
batch output and is kept for comparison.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from ..batch import check_batches, split_batch, to_device
from ..models.adapters import check_int
from ..models.likelihoods import logits_log_probs
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
    """Mean ``f(x; θ*)`` `(B, C)` and covariance ``J Σ Jᵀ`` `(B, C, C)` of the linearized model.

    The network is evaluated in eval mode (dropout off: in train mode every call drew another
    dropout mask, so ``f`` and ``J`` were those of a random sub-network); a model in train mode
    is put back in train mode afterwards.
    """
    _check_posterior(guide, "glm_moments: ")
    training = bool(getattr(model, "training", False))
    model.train(False)
    try:
        return _moments(model, guide, inputs)
    finally:
        model.train(training)


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


def _link_outputs(
    mean: Tensor,
    cov: Tensor,
    link: str,
    classification: bool,
    num_samples: int,
    generator: torch.Generator | None,
    multi_label: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """One batch's outputs under ``link`` from ``f(x; θ*)`` `(B, C)` and ``J Σ Jᵀ`` `(B, C, C)`:
    the probit log-probabilities `(1, B, C)`, a regression's mean `(1, B[, C])` with its
    linearized variance (else ``None``), or ``num_samples`` Monte Carlo draws. ``multi_label``:
    per-label sigmoids, log-probabilities ``log (1 − p, p)`` `(S, B, C, 2)`."""
    if link == "probit":
        var = torch.diagonal(cov, dim1=-2, dim2=-1)
        if classification:
            kappa = torch.rsqrt(1.0 + math.pi / 8.0 * var)
            return logits_log_probs(kappa * mean, multi_label).unsqueeze(0).detach(), None
        # the exact Gaussian predictive: its mean and the variance of the linearized mean
        return mean.squeeze(-1).unsqueeze(0).detach(), var.squeeze(-1).unsqueeze(0).detach()
    c = cov.shape[-1]
    jitter = 1e-10 * torch.eye(c, dtype=cov.dtype, device=cov.device)
    chol = torch.linalg.cholesky(cov + jitter)
    eps = torch.randn((num_samples, *mean.shape), generator=generator, dtype=mean.dtype)
    logits = mean + torch.einsum("bce,sbe->sbc", chol, eps.to(mean.device))
    out = logits_log_probs(logits, multi_label) if classification else logits.squeeze(-1)
    return out.detach(), None


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
    ``"probit"`` returns the exact Gaussian predictive, the mean ``f(x; θ*)`` (``loc (1, N)``)
    and the variance of the linearized mean ``diag(J Σ Jᵀ)`` (``loc_var``; ``predictive_scale``
    is ``sqrt(loc_var + σ²)``); ``"mc"`` returns ``num_samples`` draws of the latent mean.

    Returns
    -------
    Prediction

    Raises
    ------
    ValueError
        An unknown ``link``, ``num_samples`` < 1 with ``link="mc"``, or ``data`` that yields no
        batch.
    TypeError
        A ``num_samples`` that is not an integer (``link="mc"``), or ``data`` that is not an
        iterable of batches (a single ``(inputs, targets)`` batch, a tensor, a dict, a Dataset:
        :func:`pyrobayes.batch.check_batches`).
    """
    if link not in ("probit", "mc"):
        raise ValueError(f"Expected link 'probit' or 'mc' but got {link!r}.")
    if link == "mc":  # the Monte Carlo draws of the linearized outputs
        num_samples = check_int("num_samples", num_samples, ge=1, owner="glm_predict: ")
    check_batches(data, "glm_predict", model.label_key)
    if device is not None:
        model.to(device)
        guide.to(device)
    _check_posterior(guide, "glm_predict: ")
    model.train(False)
    dev = model.device
    generator = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
    classification = model.likelihood.is_classification
    multi_label = bool(getattr(model.likelihood, "multi_label", False))
    outputs: list[Tensor] = []
    variances: list[Tensor] = []
    targets: list[Tensor] = []
    for batch in data:
        inputs, y = split_batch(to_device(batch, dev), model.label_key)
        mean, cov = _moments(model, guide, inputs)
        out, var = _link_outputs(
            mean, cov, link, classification, num_samples, generator, multi_label
        )
        if var is not None:
            variances.append(var)
        outputs.append(out.detach())
        if y is not None:
            targets.append(y)
    if not outputs:
        raise ValueError(
            "glm_predict: data yielded no batches; pass a non-empty iterable of batches (a "
            "DataLoader over a non-empty data set, or a list holding at least one batch)."
        )
    target = torch.cat(targets, 0) if targets else None
    pred = Prediction.from_outputs(torch.cat(outputs, 1), target, model.likelihood)
    if variances:
        pred = dataclasses.replace(pred, loc_var=torch.cat(variances, 1))
    return pred
