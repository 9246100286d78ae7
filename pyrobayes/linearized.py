r"""The linearised (GLM) predictive of a Gaussian posterior ``N(θ̂, Σ)`` over the latent sites.

The network is replaced by its first-order Taylor expansion at the point ``θ̂`` (MacKay 1992;
Foong et al. 2019; Immer, Korzepa & Bauer 2021, eq. 5 — laplace-torch's default predictive):

.. math:: f_{\rm lin}(x; θ) = f(x; θ̂) + J(x)\,(θ - θ̂),\qquad J(x) = ∂f(x;θ)/∂θ\,|_{θ̂}
          \in \mathbb R^{K \times d},

where ``f`` is what the likelihood reads: the K class logits, the K choice scores of a
multiple-choice likelihood (not the vocabulary), or the D regression means. Under
``θ ~ N(θ̂, Σ)``, ``f_lin(x) ~ N(f(x; θ̂), J Σ Jᵀ)``:

- regression: the exact Gaussian predictive ``y ~ N(f(x; θ̂), J Σ Jᵀ + σ² I)`` (the reported
  ``Prediction.loc_var`` is the diagonal of ``J Σ Jᵀ``; the metrics score each entry);
- classification, ``pred_type="glm"``: Monte Carlo over the linearised logits,
  ``p̄ = (1/S) Σ_s softmax(f(x; θ̂) + J(x)(θ_s − θ̂))`` with ``S = guide.link_samples`` draws
  ``θ_s ~ q`` (default 100 as laplace-torch; predict's ``num_samples`` when it is ``None``): a
  draw costs one ``J(x)(θ_s − θ̂)`` product once ``J`` is formed, and the Monte Carlo NLL
  ``−log p̄`` is biased upwards by about ``Var(p)/(2 S p̄²)`` (Jensen), so S is not tied to the
  network draws of the sampled predictives;
- classification, ``pred_type="probit"``: ``softmax(f / sqrt(1 + π/8 · diag(J Σ Jᵀ)))``;
- multi-label classification (a :class:`~pyrobayes.models.Bernoulli` likelihood): the same per
  label with the sigmoid, ``σ(f_l / sqrt(1 + π/8 · v_l))`` (probit; MacKay 1992, exact for
  the probit link and within about 0.02 of the logistic-Gaussian integral) or the Monte Carlo
  average of ``σ`` of the logits' draws, without contrasts (a sigmoid is not shift-invariant).

How ``J`` is formed. Each example of a chunk gets its own copy of ``θ̂`` (the sample-batched
forward of :mod:`pyrobayes.models.layers` gives row ``b`` the copy ``b``), so the gradient of
``Σ_b f_k(x_b)`` with respect to the copies is the k-th Jacobian row of every example at once:
one forward with autograd and ``K`` backward passes per chunk (batched into one call, vmapped
over the K cotangents, where every op has a batching rule), whatever ``d`` and the vocabulary
size. For the Monte Carlo classification predictive only differences of logits matter
(``softmax`` is shift-invariant per draw), so ``J_k − J_K`` is formed for ``k < K`` (``K − 1``
backward passes). When every output has a network row of its own (multiple choice with
continuations: ``likelihood.rows_per_output``), each row gets its own copy and ONE backward pass
gives all K Jacobians. Memory: the forward's saved activations (a training step's), the
buffers of the batched backward passes (up to K times a training step's backward), and ``J``,
``examples_per_forward · K · d`` numbers; ``examples_per_forward`` bounds all three.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from .batch import (
    batch_size,
    check_batches,
    compute_dtype,
    slice_examples,
    split_batch,
    to_device,
)
from .models.adapters import check_int
from .models.likelihoods import logits_log_probs
from .predictive import (
    CPU_MAX_ROWS_PER_FORWARD,
    Prediction,
    _rows,
    cat_examples,
    check_not_empty,
    check_outputs,
    checked_params,
    checked_targets,
    observation_scale,
)

logger = logging.getLogger(__name__)

__all__ = [
    "output_jacobians",
    "output_jacobian_rows",
    "linearized_predict",
    "linearize",
    "Linearization",
    "default_examples_per_forward",
    "linear_shifts",
]


def default_examples_per_forward(inputs: Any, device: torch.device) -> int:
    """Examples per Jacobian forward: the whole batch on an accelerator; on CPU as many as keep
    one forward within :data:`~pyrobayes.predictive.CPU_MAX_ROWS_PER_FORWARD` rows (or tokens)."""
    size = max(1, batch_size(inputs))
    if device.type != "cpu":
        return size
    per_example = max(1, _rows(inputs) // size)
    return max(1, min(size, CPU_MAX_ROWS_PER_FORWARD // per_example))


def output_jacobians(
    model: Any,
    inputs: Any,
    point: Mapping[str, Tensor],
    *,
    contrast: bool = False,
    fixed: Mapping[str, Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""``f(x; θ̂)`` and its per-example Jacobians with respect to the sites.

    Parameters
    ----------
    model : FineTuneModel
    inputs : batch inputs (B examples)
    point : dict
        ``θ̂`` per site.
    contrast : bool
        Return ``J_k − J_K`` (last row zero) instead of ``J_k``: enough for a shift-invariant
        use (softmax over the K outputs) and one backward pass fewer.
    fixed : dict, optional
        Values of further sites, held (no Jacobian); the rest are the network's own.

    Returns
    -------
    mean : Tensor `(B, *event)`
        The likelihood's parameters at ``θ̂`` (K = prod(event) outputs per example).
    jacobians : dict
        ``{site: (B, K, *site_shape)}``, ``∂f_k(x_b)/∂θ_site`` at ``θ̂``.
    """
    size = batch_size(inputs)
    rows = model.likelihood.rows_per_output(inputs)
    if rows is not None:
        return _row_jacobians(model, inputs, point, size, rows, fixed)
    # every row in one (vmapped) backward call, gathered into (B, K, *site_shape)
    out, chunks = output_jacobian_rows(
        model, inputs, point, contrast=contrast, outputs_per_pass=None, fixed=fixed
    )
    num_outputs = out.reshape(size, -1).shape[1]
    jac = {s: v.new_zeros(size, num_outputs, *v.shape) for s, v in point.items()}
    for k0, chunk in chunks:
        for s, g in chunk.items():
            jac[s][:, k0 : k0 + g.shape[0]] = g.movedim(0, 1)
    return out, jac


def _held_copies(fixed: Mapping[str, Tensor] | None, count: int) -> dict[str, Tensor]:
    """``count`` per-row copies (no grad) of sites held at a value, for the batched forward."""
    return {s: v.detach().unsqueeze(0).expand(count, *v.shape) for s, v in (fixed or {}).items()}


def _row_jacobians(
    model: Any,
    inputs: Any,
    point: Mapping[str, Tensor],
    size: int,
    rows: int,
    fixed: Mapping[str, Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Jacobians when output k of example b is computed from network row ``b·K + k`` alone
    (``likelihood.rows_per_output``): a copy of ``θ̂`` per row and ONE backward pass of the
    summed outputs give every output's Jacobian (its row's gradient)."""
    with torch.enable_grad():
        copies = {
            s: v.detach().unsqueeze(0).expand(size * rows, *v.shape).clone().requires_grad_(True)
            for s, v in point.items()
        }
        held = _held_copies(fixed, size * rows)
        out = model.output(inputs, {**held, **copies})  # (B, K): row b·K + k at copy b·K + k
        if out.reshape(size, -1).shape[1] != rows:
            raise RuntimeError(
                f"{type(model.likelihood).__name__}.rows_per_output says {rows} rows per example "
                f"but the likelihood returned {tuple(out.shape)}; please report this."
            )
        grads = torch.autograd.grad(out.sum(), list(copies.values()), allow_unused=True)
    jac = {
        s: (g if g is not None else torch.zeros_like(v)).reshape(size, rows, *v.shape[1:])
        for (s, v), g in zip(copies.items(), grads, strict=True)
    }
    return out.detach(), jac


def output_jacobian_rows(
    model: Any,
    inputs: Any,
    point: Mapping[str, Tensor],
    *,
    contrast: bool = False,
    outputs_per_pass: int | None = 4,
    fixed: Mapping[str, Tensor] | None = None,
) -> tuple[Tensor, Iterator[tuple[int, dict[str, Tensor]]]]:
    r"""``f(x; θ̂)`` and its per-example Jacobians a few rows ``k`` at a time, never all K.

    One forward at per-example copies of ``θ̂`` and ``K`` (with ``contrast``, ``K − 1``)
    backward passes; the Jacobian rows are handed out as they are formed, ``outputs_per_pass``
    at a time, for a caller that reduces them on the fly: memory ``outputs_per_pass · B · d``
    numbers instead of ``B · K · d`` (:func:`output_jacobians` gathers them all). Not for a likelihood with
    ``rows_per_output`` (there one backward pass gives every row at once: use
    :func:`output_jacobians`).

    Parameters
    ----------
    model : FineTuneModel
    inputs : batch inputs (B examples)
    point : dict
        ``θ̂`` per site.
    contrast : bool
        Rows ``J_k − J_K`` for ``k < K`` (the K-th, zero, is not handed out).
    outputs_per_pass : int or None
        Rows per (vmapped) backward call; ``None``: all of them in one call.
    fixed : dict, optional
        Values of further sites, held (no Jacobian); the rest are the network's own.

    Returns
    -------
    mean : Tensor `(B, *event)`
        The likelihood's parameters at ``θ̂`` (K = prod(event) outputs per example).
    rows : iterator of (int, dict)
        ``(k0, {site: (c, B, *site_shape)})``: rows ``k0 .. k0 + c − 1`` of every example's
        Jacobian (``∂f_k(x_b)/∂θ_site``), in order. The forward's graph is freed when the
        iterator is exhausted or dropped.
    """
    if outputs_per_pass is not None and outputs_per_pass < 1:
        raise ValueError(
            f"output_jacobian_rows: outputs_per_pass must be ≥ 1, got {outputs_per_pass}."
        )
    if model.likelihood.rows_per_output(inputs) is not None:
        raise ValueError(
            f"output_jacobian_rows: {type(model.likelihood).__name__} computes each output from "
            "a network row of its own (rows_per_output); use output_jacobians instead."
        )
    size = batch_size(inputs)
    with torch.enable_grad():
        copies = {
            s: v.detach().unsqueeze(0).expand(size, *v.shape).clone().requires_grad_(True)
            for s, v in point.items()
        }
        out = model.output(inputs, {**_held_copies(fixed, size), **copies})  # row b at copy b
    flat = out.reshape(size, -1)
    num_outputs = flat.shape[1]
    passes = num_outputs - 1 if contrast else num_outputs
    per_call = max(1, passes) if outputs_per_pass is None else outputs_per_pass

    def rows() -> Iterator[tuple[int, dict[str, Tensor]]]:
        leaves = list(copies.values())
        batched = True
        for k0 in range(0, passes, per_call):
            count = min(per_call, passes - k0)
            # cotangents (c, B, K): e_k, or e_k − e_K for the contrasts
            cotangents = flat.new_zeros(count, num_outputs)
            cotangents[:, k0 : k0 + count] = torch.eye(count, dtype=flat.dtype, device=flat.device)
            if contrast:
                cotangents[:, -1] = -1.0
            cotangents = cotangents.unsqueeze(1).expand(count, size, num_outputs)
            grads: Any = None
            if batched:
                try:  # the c backward passes batched (vmap over the cotangents): one call
                    grads = torch.autograd.grad(
                        flat,
                        leaves,
                        grad_outputs=cotangents,
                        is_grads_batched=True,
                        retain_graph=True,
                        allow_unused=True,
                    )
                except (RuntimeError, NotImplementedError) as err:  # an op without a batching rule
                    logger.debug("batched backward unavailable (%s); one pass per output", err)
                    batched = False
            if grads is None:
                per_row = [
                    torch.autograd.grad(
                        flat,
                        leaves,
                        grad_outputs=cotangents[j],
                        retain_graph=True,
                        allow_unused=True,
                    )
                    for j in range(count)
                ]
                # per site: the c rows' gradients (None for a site the outputs do not use)
                grads = [
                    None if col[0] is None else torch.stack(col)
                    for col in zip(*per_row, strict=True)
                ]
            yield (
                k0,
                {
                    s: g if g is not None else v.new_zeros(count, *v.shape)
                    for (s, v), g in zip(copies.items(), grads, strict=True)
                },
            )

    return out.detach(), rows()


#: One chunk of a batch: ``f(x; θ̂)``, the per-site ``J(x)``, and on a batch's last chunk its
#: targets (``None`` without labels) and ``True``; ``None, False`` on the others.
_Chunk = tuple[Tensor, dict[str, Tensor], Tensor | None, bool]


@dataclass(frozen=True)
class Linearization:
    """``f(x; θ̂)`` and ``J(x)`` of every chunk of a data set (:func:`linearize`): what the
    linearised predictive needs that does not depend on the posterior's covariance.

    ``contrast``: the Jacobians are the Monte Carlo predictive's ``J_k − J_K`` (``True``) or
    the plain rows (``False``). ``chunks``: in data order (see ``_Chunk``)."""

    contrast: bool
    chunks: list[_Chunk]


def _uses_monte_carlo(model: Any, guide: Any) -> bool:
    """Whether ``guide``'s linearised predictive is the Monte Carlo one (classification)."""
    return bool(model.likelihood.is_classification and guide.pred_type == "glm")


def _uses_contrast(model: Any, guide: Any) -> bool:
    """Whether ``guide``'s linearised predictive uses contrasted Jacobians ``J_k − J_K``: the
    Monte Carlo one of a softmax, which a shift common to the logits leaves unchanged (not of a
    multi-label likelihood, whose per-label logits are each read as they are)."""
    multi_label = bool(getattr(model.likelihood, "multi_label", False))
    return _uses_monte_carlo(model, guide) and not multi_label


def _chunks(
    model: Any,
    guide: Any,
    data: Iterable[Any],
    *,
    contrast: bool,
    examples_per_forward: int | None,
    progress_bar: bool,
) -> Iterator[_Chunk]:
    """The network passes of the linearised predictive: ``f(x; θ̂)`` and ``J(x)`` per chunk of
    at most ``examples_per_forward`` examples of each batch, streamed (one chunk's ``J`` lives
    at a time)."""
    dev = model.device
    point = {s: v.to(dev) for s, v in guide.linearization_point().items()}
    # sites the posterior holds at a point (a Laplace subset=): their values, no Jacobian
    fixed_point = getattr(guide, "fixed_point", None)
    fixed = {s: v.to(dev) for s, v in fixed_point().items()} if fixed_point else None
    classification = model.likelihood.is_classification
    batches = tqdm(data, disable=not progress_bar, desc="predict (linearised)")
    for index, batch in enumerate(batches):
        inputs, y = split_batch(to_device(batch, dev), model.label_key)
        size = check_not_empty(inputs, f"predict: batch {index}")
        chunk = examples_per_forward or default_examples_per_forward(inputs, dev)
        starts = range(0, size, chunk)
        for start in starts:
            sub = slice_examples(inputs, start, min(size, start + chunk), size)
            out, jac = output_jacobians(model, sub, point, contrast=contrast, fixed=fixed)
            # non-finite f(x; θ̂) (inputs holding NaN or inf: their rows named in the batch)
            where = f"batch {index}:"
            check_outputs(out.unsqueeze(0), classification, where=where, inputs=sub, offset=start)
            if index == 0 and start == 0:  # f(x; θ̂), the network's raw outputs
                checked_params(model.likelihood, out, "predict: batch 0")
            last = start == starts[-1]
            yield out, jac, (y if last else None), last


def _check_data(model: Any, data: Any, examples_per_forward: int | None, owner: str) -> int | None:
    """``examples_per_forward`` checked (``None`` or an integer >= 1: ``0`` was taken for the
    default and a negative count gave no chunk at all, reported as data without batches) and
    ``data`` an iterable of batches (:func:`pyrobayes.batch.check_batches`: a single
    ``(inputs, targets)`` pair was read as two batches).

    Raises
    ------
    TypeError
        ``examples_per_forward`` not an integer, or ``data`` not an iterable of batches.
    ValueError
        ``examples_per_forward`` below 1.
    """
    check_batches(data, owner, model.label_key)
    if examples_per_forward is None:
        return None
    return check_int("examples_per_forward", examples_per_forward, ge=1, owner=f"{owner}: ")


def _draw_deltas(guide: Any, num_samples: int, seed: int | None, dev: torch.device) -> Tensor:
    """``θ_s − θ̂`` `(S, d)` of the Monte Carlo predictive's draws over the sites laid flat, in
    site order (``S = guide.link_samples`` when set, else ``num_samples``)."""
    point = guide.linearization_point()
    if guide.link_samples is not None:
        num_samples = int(guide.link_samples)
    generator = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
    draws = guide.sample_posterior(num_samples, generator=generator)
    return torch.cat(
        [(draws[s].to(dev) - point[s].to(dev)).reshape(num_samples, -1) for s in point], -1
    )


def _linear_dtype(out: Tensor, jac: Mapping[str, Tensor]) -> torch.dtype:
    """The dtype the linearised network is computed in: float32 on a half-precision network
    (``J·δ`` of a small ``δ`` vanishes in bf16), whichever of the output (a multiple-choice
    score is float32 already) and the Jacobians is half."""
    dtype = compute_dtype(out.dtype)
    for j in jac.values():
        dtype = torch.promote_types(dtype, compute_dtype(j.dtype))
    return dtype


def linear_shifts(out: Tensor, jac: Mapping[str, Tensor], deltas: Tensor) -> tuple[Tensor, Tensor]:
    """``f(x; θ̂)`` `(b, *event)` and every draw's ``J(x)(θ_s − θ̂)`` `(S, b, *event)` on one
    chunk of examples: the linearised network ``f_lin(x; θ_s)`` is their sum.

    Parameters
    ----------
    out : Tensor
        ``f(x; θ̂)`` `(b, *event)` (:func:`output_jacobians`).
    jac : dict of str to Tensor
        Per-site Jacobians `(b, K, *site_shape)`, in the order of ``deltas``' columns.
    deltas : Tensor
        `(S, d)`: each draw's ``θ_s − θ̂``, its sites flattened and concatenated in ``jac``'s
        order (a Laplace posterior's float32 draws included).

    Returns
    -------
    tuple of Tensor
        Both in float32 on a half-precision network (``_linear_dtype``), else in its dtype.
    """
    dtype = _linear_dtype(out, jac)
    flat = torch.cat([j.reshape(*j.shape[:2], -1).to(dtype) for j in jac.values()], -1)
    shifts = torch.einsum("bkd,sd->sbk", flat, deltas.to(dtype))  # (S, b, K)
    return out.to(dtype), shifts.reshape(deltas.shape[0], *out.shape)


def _chunk_predictive(
    guide: Any,
    out: Tensor,
    jac: dict[str, Tensor],
    deltas: Tensor | None,
    classification: bool,
    multi_label: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """One chunk's predictive from ``f(x; θ̂)`` and ``J(x)``: the Monte Carlo log-probabilities
    `(S, b, K)` (``deltas`` = the draws' ``θ_s − θ̂``), the probit ones `(1, b, K)`, or the
    regression mean `(1, b, *event)` with the variance of ``f_lin`` (else ``None``).
    ``multi_label``: the K outputs are per-label logits, and the log-probabilities
    ``log (1 − p, p)`` per label, `(S, b, K, 2)` (the probit per label,
    ``σ(f / sqrt(1 + π/8 · v))``)."""
    dtype = _linear_dtype(out, jac)
    out, jac = out.to(dtype), {s: j.to(dtype) for s, j in jac.items()}
    mean = out.reshape(out.shape[0], -1)  # (b, K)
    if deltas is not None:  # (the Monte Carlo predictive)
        _, shifts = linear_shifts(out, jac, deltas)
        logits = mean.unsqueeze(0) + shifts.reshape(deltas.shape[0], *mean.shape)
        return logits_log_probs(logits, multi_label), None
    var = torch.diagonal(guide.functional_covariance(jac), dim1=-2, dim2=-1)  # (b, K)
    if classification:  # probit (MacKay 1992)
        kappa = torch.rsqrt(1.0 + math.pi / 8.0 * var)
        return logits_log_probs(kappa * mean, multi_label).unsqueeze(0), None
    return out.unsqueeze(0), var.reshape(1, *out.shape)


def linearize(
    model: Any,
    guide: Any,
    data: Iterable[Any],
    *,
    examples_per_forward: int | None = None,
    max_bytes: int | None = None,
) -> Linearization | None:
    """``f(x; θ̂)`` and ``J(x)`` of every batch of ``data`` under ``guide``'s predictive, kept,
    so :func:`linearized_predict` (``linearization=``) re-evaluates the predictive under another
    covariance (e.g. another prior precision) without a network pass.

    Returns ``None`` once the Jacobians held would exceed ``max_bytes`` (``J`` holds
    ``N · K · d`` numbers for ``N`` examples, ``K`` outputs and ``d`` posterior dimensions).
    ``examples_per_forward`` and ``data`` are checked as by :func:`linearized_predict`."""
    examples_per_forward = _check_data(model, data, examples_per_forward, "linearize")
    model.train(False)
    contrast = _uses_contrast(model, guide)
    kept: list[_Chunk] = []
    held = 0
    for item in _chunks(
        model,
        guide,
        data,
        contrast=contrast,
        examples_per_forward=examples_per_forward,
        progress_bar=False,
    ):
        held += sum(j.numel() * j.element_size() for j in item[1].values())
        if max_bytes is not None and held > max_bytes:
            return None
        kept.append(item)
    return Linearization(contrast, kept)


#: :attr:`~pyrobayes.predictive.Prediction.pooled_by` of the probit predictive
_PROBIT = (
    "the probit approximation (pred_type='probit'), one closed-form row; predict with "
    "pred_type='glm' (Monte Carlo over the linearised logits) to keep the draws"
)


def _batch_predictives(
    guide: Any, likelihood: Any, chunks: Iterable[_Chunk], deltas: Tensor | None
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Per batch of ``chunks``: its predictive (:func:`_chunk_predictive` of its chunks,
    joined), the variance of ``f_lin`` (regression only) and its targets, checked against
    ``f(x; θ̂)`` (the raw outputs: log-probabilities would pass a categorical check as logits).

    Raises
    ------
    FloatingPointError
        When a chunk's predictive is NaN although ``f(x; θ̂)`` is finite (checked in
        :func:`_chunks`): the posterior's draws or covariance are not finite.
    """
    classification = likelihood.is_classification
    multi_label = bool(getattr(likelihood, "multi_label", False))
    check_targets = getattr(likelihood, "check_targets", None)
    locs: list[Tensor] = []
    variances: list[Tensor] = []
    targets: list[Tensor] = []
    parts: list[Tensor] = []
    part_vars: list[Tensor] = []
    outs: list[Tensor] = []  # f(x; θ̂) of the batch's chunks
    for out, jac, y, last in chunks:
        part, var = _chunk_predictive(guide, out, jac, deltas, classification, multi_label)
        where = f"batch {len(locs)}:"
        check_outputs(part, classification, where=where, offset=sum(p.shape[1] for p in parts))
        parts.append(part)
        outs.append(out)
        if var is not None:
            part_vars.append(var)
        if not last:
            continue
        locs.append(torch.cat(parts, 1))
        if part_vars:
            variances.append(torch.cat(part_vars, 1))
        if y is not None:
            where = f"predict: batch {len(locs) - 1}"
            targets.append(checked_targets(check_targets, torch.cat(outs, 0), y, where))
        parts, part_vars, outs = [], [], []
    return locs, variances, targets


def linearized_predict(
    model: Any,
    guide: Any,
    data: Iterable[Any],
    *,
    num_samples: int = 32,
    seed: int | None = 0,
    examples_per_forward: int | None = None,
    progress_bar: bool = False,
    linearization: Linearization | None = None,
) -> Prediction:
    r"""The linearised predictive of ``guide`` (a :class:`~pyrobayes.contract.LinearizedPredictive`)
    on every batch of ``data`` (see the module docstring for the formulas).

    Parameters
    ----------
    model : FineTuneModel
    guide : LinearizedPredictive
        ``guide.pred_type`` selects ``"glm"`` or ``"probit"``.
    data : iterable of batches
    num_samples : int
        S, draws ``θ_s ~ q`` for the Monte Carlo classification predictive when
        ``guide.link_samples`` is ``None`` (else ``guide.link_samples`` draws; unused by
        regression and probit, which return one "sample", the exact moments).
    seed : int, optional
        Seed of the draws (the same draws for every batch).
    examples_per_forward : int, optional
        Examples per Jacobian forward (bounds the memory); default
        :func:`default_examples_per_forward`.
    progress_bar : bool
    linearization : Linearization, optional
        ``f(x; θ̂)`` and ``J(x)`` of ``data`` from :func:`linearize` (same model, point and
        predictive type): no network pass; ``data`` is not read.

    Returns
    -------
    Prediction
        Classification: ``log_probs`` `(S, N, K)` (``"glm"``, S the Monte Carlo draws) or
        `(1, N, K)` (``"probit"``).
        Regression: ``loc`` `(1, N, *event)` = ``f(x; θ̂)``, ``loc_var`` `(1, N, *event)` =
        ``diag(J Σ Jᵀ)`` and ``scale`` = σ; ``predictive_scale`` is ``sqrt(loc_var + σ²)``.

    Raises
    ------
    FloatingPointError
        Before any network pass, when the posterior precision ``H + τ I`` of a site is not
        finite or not positive (a Laplace guide's ``check_finite``: the message names the site
        and the remedy).
    ValueError
        An ``examples_per_forward`` below 1, or ``data`` that yields no batch.
    TypeError
        An ``examples_per_forward`` that is not an integer, or ``data`` that is not an iterable
        of batches (a single ``(inputs, targets)`` pair, a tensor, a dict, a Dataset).
    """
    pred_type = guide.pred_type
    if pred_type not in ("glm", "probit"):
        raise ValueError(
            f"linearized_predict: pred_type must be 'glm' or 'probit', got {pred_type!r}."
        )
    if linearization is None:  # (else data is not read)
        examples_per_forward = _check_data(model, data, examples_per_forward, "predict")
    check_finite = getattr(guide, "check_finite", None)  # a non-finite H + τ I: which site
    if callable(check_finite):  # (else torch's parameter check printed it, or NaN rows)
        check_finite("predict: ")
    model.train(False)
    dev = model.device
    likelihood = model.likelihood
    classification = likelihood.is_classification
    scale = None if classification else observation_scale(likelihood)  # before any pass
    monte_carlo = _uses_monte_carlo(model, guide)
    contrast = _uses_contrast(model, guide)
    if linearization is not None and linearization.contrast != contrast:
        raise ValueError(
            "linearized_predict: the linearization was formed for another predictive "
            f"(contrast={linearization.contrast}, the guide's pred_type {pred_type!r} needs "
            f"{contrast}); call linearize() again after changing pred_type."
        )
    deltas = _draw_deltas(guide, num_samples, seed, dev) if monte_carlo else None
    chunks: Iterable[_Chunk] = (
        linearization.chunks
        if linearization is not None
        else _chunks(
            model,
            guide,
            data,
            contrast=contrast,
            examples_per_forward=examples_per_forward,
            progress_bar=progress_bar,
        )
    )
    locs, variances, targets = _batch_predictives(guide, likelihood, chunks, deltas)
    if not locs:
        raise ValueError(
            "predict: data yielded no batches; pass a non-empty iterable of batches (a "
            "DataLoader over a non-empty data set, or a list holding at least one batch)."
        )
    target = torch.cat(targets, 0) if targets else None
    if classification:
        return Prediction(
            log_probs=cat_examples(locs, True),
            targets=target,
            pooled_by=None if monte_carlo else _PROBIT,
        )
    return Prediction(
        loc=torch.cat(locs, 1),
        scale=scale,
        loc_var=torch.cat(variances, 1),
        targets=target,
    )
