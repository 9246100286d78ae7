"""The model at one chunk of guide draws, on every batch of the data (for :mod:`.draw_evaluation`).

Per batch: the log-likelihoods, optionally tempered pointwise values and predictive draws, and
class log-probabilities, of the network or of a Laplace guide's linearised network at each draw.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import pyro.distributions as dist
import torch
from torch import Tensor

from ..batch import batch_size, slice_examples, split_batch, to_device
from ..models.sharing import reuse_within_batch
from ..predictive import checked_targets, default_samples_per_forward, shuffles
from ..rng import seed_forked
from .sites import DEFAULT_MAX_SITE_NUMEL


class Wanted(NamedTuple):
    """What a chunk's pass over the data keeps besides the log-likelihood sums."""

    pointwise: bool
    predictive: bool
    keep_class: int  # class log-probabilities of this many first draws of the chunk
    samples_per_forward: int | None
    temperature: float | None = None  # tempers pointwise and predictive, per draw
    linearization: Linearization | None = None  # the linearised network, else the network's


class Linearization(NamedTuple):
    """A :class:`~pyrobayes.contract.LinearizedPredictive` guide's linearised network
    ``f_lin(x; θ) = f(x; θ̂) + J(x)(θ − θ̂)`` (:mod:`pyrobayes.linearized`), at the export's
    draws: the per-draw form of the GLM predictive that :func:`pyrobayes.predict` evaluates."""

    point: dict[str, Tensor]  # θ̂ of the sites with a Gaussian posterior, in the Jacobians' order
    fixed: dict[str, Tensor] | None  # sites held at their point (Laplace's subset=): no Jacobian

    @classmethod
    def of(cls, model: Any, guide: Any) -> Linearization:
        dev = model.device
        point = {s: v.to(dev) for s, v in guide.linearization_point().items()}
        fixed_point = getattr(guide, "fixed_point", None)
        fixed = {s: v.to(dev) for s, v in fixed_point().items()} if callable(fixed_point) else None
        return cls(point, fixed)

    def at(self, model: Any, inputs: Any, values: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """``f(x; θ̂)`` `(B, *event)` and the draws' ``J(x)(θ_s − θ̂)`` `(n, B, *event)` on
        ``inputs``: the Jacobians of as many examples at a time as :func:`pyrobayes.predict`'s
        linearised predictive forms, each reduced against the draws at once."""
        # (linearized imports the predictive module, as this one)
        from ..linearized import default_examples_per_forward, linear_shifts, output_jacobians

        n = next(iter(values.values())).shape[0]
        deltas = torch.cat(
            [(values[s] - p).reshape(n, -1) for s, p in self.point.items()], -1
        )  # (n, d)
        size = batch_size(inputs)
        step = default_examples_per_forward(inputs, model.device)
        means, shifts = [], []
        for start in range(0, size, step):
            sub = slice_examples(inputs, start, min(size, start + step), size)
            with torch.enable_grad():  # (the export evaluates under no_grad)
                out, jac = output_jacobians(model, sub, self.point, fixed=self.fixed)
            # the Jacobians in the order of deltas' columns; float32 on a half-precision network
            mean, shift = linear_shifts(out, {s: jac[s] for s in self.point}, deltas)
            means.append(mean)
            shifts.append(shift)
        return torch.cat(means, 0), torch.cat(shifts, 1)


class PassOrder:
    """The examples of the first pass over the data, which every later pass must see again.

    A posterior larger than ``max_site_numel`` is drawn in chunks, each evaluated on a new pass
    over the data; the chunks' per-example results are joined column by column, so a pass in
    another order (a shuffling ``DataLoader``) or over other examples would pair the later
    draws with other examples than the first pass's ``observed_data`` (and the calibration
    report's targets). Per batch the first pass keeps its targets and a fingerprint of its
    inputs (a position-weighted sum of every input tensor per example); a later pass that
    differs raises. Random augmentation or masking of the inputs is a difference too: the
    chunks would be scored on different data.

    The first pass also refuses data whose batches do not all carry targets or all lack them:
    the log-likelihood (the export's ``log_likelihood`` and ``observed_data``, diagnose's log
    joint) would cover the labelled batches only. ``owner`` is the function the user called,
    which the refusals name; ``label_key`` the model's, named in them.
    """

    def __init__(
        self, passes: int, owner: str = "to_inference_data", label_key: str = "labels"
    ) -> None:
        self.batches: list[tuple[Tensor | None, list[Tensor]]] = []
        self.planned = passes
        self.check = passes > 1  # one pass: nothing to check, nothing kept
        self.passes = 0
        self.owner = owner
        self.label_key = label_key
        self.labelled: bool | None = None  # whether batch 0 of the first pass carries targets

    def refuse_shuffling(self, data: Any) -> None:
        """Raise before any work when ``data`` is a shuffling ``DataLoader`` and the draws take
        several passes (every later pass would be refused by :meth:`see`)."""
        if self.check and shuffles(data):
            raise ValueError(
                f"{self.owner}: data is a DataLoader that shuffles (RandomSampler). {self._why()}"
            )

    def begin(self) -> None:
        """A new pass over the data starts."""
        self.passes += 1

    @property
    def first(self) -> bool:
        """The current pass is the first."""
        return self.passes == 1

    def see(self, index: int, inputs: Any, y: Tensor | None) -> None:
        """Record batch ``index`` of the first pass, or check it against the first pass's."""
        if self.first:
            self._refuse_mixed_targets(index, y is not None)
        if not self.check:
            return
        seen = (None if y is None else y.detach().cpu(), _fingerprint(inputs))
        if self.first:
            self.batches.append(seen)
        elif index >= len(self.batches):
            raise self._reordered(f"more batches than the first's {len(self.batches)}")
        elif not _same_batch(self.batches[index], seen):
            raise self._reordered(f"batch {index} differs")

    def end(self, count: int) -> None:
        """The pass yielded ``count`` batches: as many as the first."""
        if self.check and not self.first and count != len(self.batches):
            raise self._reordered(f"{count} batches instead of {len(self.batches)}")

    def _refuse_mixed_targets(self, index: int, labelled: bool) -> None:
        """Raise when batch ``index`` carries targets and batch 0 does not, or the reverse."""
        if index == 0:
            self.labelled = labelled
            return
        if labelled == self.labelled:
            return
        without, carries = (index, 0) if self.labelled else (0, index)
        raise ValueError(
            f"{self.owner}: batch {without} of data carries no targets but batch {carries} "
            "does; the log-likelihood (to_inference_data's log_likelihood and observed_data, "
            "diagnose's log joint) must cover every example or none, so data cannot mix "
            "batches with and without targets. Give every batch its targets ((x, y), or a dict "
            f"holding the model's label key {self.label_key!r}); or, to export the posterior and "
            "its predictive only (to_inference_data), give none of them ((x,) or x)."
        )

    def _reordered(self, what: str) -> ValueError:
        return ValueError(
            f"{self.owner}: pass {self.passes} over data yielded other examples, "
            f"or the same in another order, than the first ({what}). {self._why()}"
        )

    def _why(self) -> str:
        """Why every pass must yield the first's examples in its order, and the remedy."""
        return (
            f"The draws are taken in {self.planned} chunks (the posterior has more scalars than "
            f"max_site_numel; diagnose: {DEFAULT_MAX_SITE_NUMEL}), each evaluated on a new pass "
            "over data, so every pass must yield the same examples in the same order, or the "
            "later draws are scored on other examples than the observed targets. Pass an "
            "ordered loader (DataLoader(..., shuffle=False), i.e. a SequentialSampler, without "
            "random augmentation or masking) or a list of batches."
        )


def _fingerprint(inputs: Any) -> list[Tensor]:
    """Per input tensor, a ``(B,)`` position-weighted sum of each example's values (CPU)."""
    if isinstance(inputs, Tensor):
        x = inputs.detach()
        x = x.cpu() if x.device.type == "mps" else x  # (MPS has no float64)
        if x.dim() == 0:
            return [x.reshape(1).cpu().double()]
        x = x.reshape(x.shape[0], -1).to(torch.float64)
        weights = torch.arange(1, x.shape[1] + 1, dtype=torch.float64, device=x.device)
        return [torch.mv(x, weights).cpu()]
    if isinstance(inputs, Mapping):
        return [f for k in sorted(inputs, key=str) for f in _fingerprint(inputs[k])]
    if isinstance(inputs, (tuple, list)):
        return [f for v in inputs for f in _fingerprint(v)]
    return []


def _same_batch(
    first: tuple[Tensor | None, list[Tensor]], later: tuple[Tensor | None, list[Tensor]]
) -> bool:
    """The same targets and input fingerprints (up to float rounding)."""
    (y0, f0), (y1, f1) = first, later
    if (y0 is None) != (y1 is None) or len(f0) != len(f1):
        return False
    if y0 is not None and y1 is not None and (y0.shape != y1.shape or not torch.equal(y0, y1)):
        return False
    return all(
        a.shape == b.shape and torch.allclose(a, b, rtol=1e-9, atol=0.0, equal_nan=True)
        for a, b in zip(f0, f1, strict=True)
    )


class Chunk(NamedTuple):
    """One chunk of draws evaluated on all of the data."""

    ll_sum: Tensor  # (n,)
    pointwise: list[Tensor]  # per batch (n, B)
    predictive: list[Tensor]  # per batch (n, B, ...)
    class_log_probs: list[Tensor]  # per batch (P, B, C)
    observed: list[Tensor]  # per batch targets, first chunk only
    has_targets: bool


def evaluate_chunk(
    model: Any,
    data: Iterable[Any],
    values: dict[str, Tensor],
    n: int,
    wanted: Wanted,
    pp_seed: int | None,
    order: PassOrder,
) -> Chunk:
    """The model on every batch of ``data`` at the ``n`` draws ``values``; ``order`` records
    the first pass over ``data`` and checks every later one against it."""
    dev = model.device
    chunk = Chunk(torch.zeros(n, dtype=torch.float64), [], [], [], [], True)
    has_targets = True
    devices = [dev] if dev.type == "cuda" else []
    # reuse_within_batch: the layers below the first adapted one run once per batch for all its
    # chunks of draws, as in pyrobayes.predict
    # (the linearised network's Jacobians run their own forward passes, with autograd)
    reuse = contextlib.nullcontext() if wanted.linearization else reuse_within_batch()
    order.begin()
    with torch.no_grad(), torch.random.fork_rng(devices=devices), reuse:
        if pp_seed is not None:
            seed_forked(pp_seed, dev)  # the forked generators only (not every GPU's)
        index = -1
        for index, batch in enumerate(data):
            inputs, y = split_batch(to_device(batch, dev), model.label_key)
            order.see(index, inputs, y)
            ll, pointwise, pp, lp, y = _evaluate_batch(model, inputs, y, values, n, wanted, index)
            if y is None:
                has_targets = False
            elif order.first:  # in the likelihood's shape, as log_likelihood and predictive
                chunk.observed.append(y.detach().cpu())
            if ll is not None:
                chunk.ll_sum.add_(ll.sum(1))
            if pointwise is not None:
                chunk.pointwise.append(pointwise)
            if pp is not None:
                chunk.predictive.append(pp)
            if lp is not None:
                chunk.class_log_probs.append(lp)
    if index < 0:
        raise ValueError(
            f"{order.owner}: data yielded no batches; pass a non-empty iterable of batches (the "
            "data set the posterior is evaluated on, e.g. the training loader)."
        )
    order.end(index + 1)
    return chunk._replace(has_targets=has_targets)


def _evaluate_batch(
    model: Any,
    inputs: Any,
    y: Tensor | None,
    values: dict[str, Tensor],
    n: int,
    wanted: Wanted,
    index: int,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """``(log-likelihoods (n, B), pointwise log-likelihoods (n, B), predictive draws, class
    log-probabilities, targets)`` on batch ``index``, ``samples_per_forward`` draws per forward
    pass; each ``None`` when not computed (no targets: ``y`` is ``None``). The pointwise values
    and the predictive draws are tempered by ``wanted.temperature`` (the log-likelihoods are the
    model's). The targets come back checked by the likelihood
    (:func:`~pyrobayes.predictive.checked_targets`), in the shape it scores."""
    parts_ll, parts_pw, parts_pp, parts_lp = [], [], [], []
    spf = wanted.samples_per_forward or default_samples_per_forward(n, model.device, inputs, model)
    linear = (
        None if wanted.linearization is None else wanted.linearization.at(model, inputs, values)
    )
    for s0 in range(0, n, spf):
        sub = {k: v[s0 : s0 + spf] for k, v in values.items()}
        params, at_temperature = _draw_params(model, inputs, sub, linear, s0, wanted.temperature)
        s_here = int(params.shape[0])
        if y is not None and s0 == 0:
            check = getattr(model.likelihood, "check_targets", None)
            y = checked_targets(check, params, y, f"batch {index} of the data")
        likelihood_dist = model.likelihood.dist(params)
        tempered = (
            likelihood_dist
            if wanted.temperature is None
            else _tempered(model.likelihood, at_temperature, likelihood_dist, wanted.temperature)
        )
        if y is not None:
            ll = model.log_likelihood(params, y)  # (s, B, [event...])
            parts_ll.append(ll.reshape(s_here, ll.shape[1], -1).sum(-1).double())
            if wanted.pointwise and tempered is likelihood_dist:
                parts_pw.append(parts_ll[-1])
            elif wanted.pointwise:
                tll = tempered.log_prob(y)
                parts_pw.append(tll.reshape(s_here, tll.shape[1], -1).sum(-1).double())
        if wanted.predictive:
            parts_pp.append(tempered.sample().cpu())
        if wanted.keep_class > s0:  # (multi-label: log (1 − p, p) per label, (s, B, L, 2))
            kept = params[: wanted.keep_class - s0]
            parts_lp.append(model.likelihood.class_log_probs(kept).cpu())
    return (
        torch.cat(parts_ll, 0).cpu() if parts_ll else None,  # (n, B)
        torch.cat(parts_pw, 0).cpu() if parts_pw else None,  # (n, B)
        torch.cat(parts_pp, 0) if parts_pp else None,
        torch.cat(parts_lp, 0) if parts_lp else None,
        y,
    )


def _draw_params(
    model: Any,
    inputs: Any,
    sub: dict[str, Tensor],
    linear: tuple[Tensor, Tensor] | None,
    s0: int,
    temperature: float | None,
) -> tuple[Tensor, Tensor]:
    """The likelihood's parameters `(s, B, ...)` at the draws ``sub`` (draws ``s0..`` of the
    chunk): the network's, or with ``linear`` (``f(x; θ̂)`` and every draw's ``J(x)(θ_s − θ̂)``)
    the linearised network's; and the parameters a Gaussian is tempered at. Tempering the
    linearised regression predictive multiplies its whole variance ``J Σ Jᵀ + σ²`` by ``T²``
    (:func:`pyrobayes.calibration.apply_temperature`): per draw, the shift by ``T`` and σ by
    ``T`` (:func:`_tempered`); the network's draws keep their means."""
    if linear is None:
        params = model.batched_output(inputs, sub)  # (s, B, ...)
        return params, params
    mean, shifts = linear
    shift = shifts[s0 : s0 + next(iter(sub.values())).shape[0]]
    params = mean.unsqueeze(0) + shift
    if temperature is None or model.likelihood.is_classification:
        return params, params
    return params, mean.unsqueeze(0) + temperature * shift


def _tempered(likelihood: Any, params: Tensor, untempered: Any, value: float) -> Any:
    """One draw's likelihood under ``pyrobayes.calibrate``'s ``T``, as ``pyrobayes.predict``
    tempers a draw: ``Categorical(log_softmax(log p / T))`` for a classifier, σ → T σ for a
    Gaussian (:func:`pyrobayes.calibration.apply_temperature`); a multi-label likelihood's
    per-label logits divided by ``T`` (the same as its pairs ``log (1 − p, p)`` tempered)."""
    if getattr(likelihood, "multi_label", False):
        return dist.Bernoulli(logits=params / value).to_event(1)
    if likelihood.is_classification:
        log_probs = torch.log_softmax(untempered.logits, dim=-1)
        return dist.Categorical(logits=torch.log_softmax(log_probs / value, dim=-1))
    normal = dist.Normal(params, likelihood.scale() * value)
    return normal.to_event(likelihood.event_dim) if likelihood.event_dim else normal
