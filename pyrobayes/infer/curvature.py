r"""Curvature through laplace-torch: the network and data as it sees them, and its GGN backend.

Curvature. At the MAP ``θ*`` (the guide's point), with the head fixed, laplace-torch computes the
GGN of the summed negative log-likelihood over the sites only,

.. math:: H = \sum_i J_i^\top Λ_i J_i,\qquad J_i = ∂f(x_i; θ)/∂θ\,|_{θ^*},

as its diagonal (``DIAG``) or K-FAC blocks (``KRON``; a LoRA-XS core is an ordinary
``nn.Linear(r, r)``, so both factors are ``r×r``). The diagonal is accumulated from per-example
Jacobian rows (:func:`pyrobayes.linearized.output_jacobian_rows`: one forward and ``K − 1``
backward passes per batch for ``K`` classes, ``K`` for ``K`` regression outputs, a few rows at a
time, so memory stays a few ``B·d`` numbers, never the ``B·K·d`` Jacobian), with softmax's
``Λ_i = diag(p_i) − p_i p_iᵀ``

.. math:: \operatorname{diag} H = \sum_i \sum_k p_{ik} \big(J_{ik} - \textstyle\sum_j p_{ij} J_{ij}\big)^{2},

(``J_{ik}`` the k-th row of ``J_i``, squared elementwise) and ``Σ_i Σ_k J_{ik}²`` for a Gaussian
likelihood (laplace-torch's ``1/σ²`` applied as its ``_H_factor``). laplace-torch's default
backend forms the same diagonal from the Jacobian of the whole batch output with respect to the
parameters, ``B·K`` backward passes of the whole batch each (quadratic in the batch size).

:class:`LaplaceNet` is the network laplace-torch differentiates (a batch → the likelihood's
parameters), ``_Loader`` the re-iterable ``(X, y)`` / dict batches it reads, and
:func:`per_example_ggn_backend` its curvlinops backend with the per-example diagonal and the
real-token K-FAC. :func:`pyrobayes.infer.laplace.fit_laplace` puts them together.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..batch import batch_size, compute_dtype, split_batch, to_device, token_mask
from ..linearized import output_jacobian_rows, output_jacobians
from ..models.likelihoods import Categorical, check_binary_targets, check_gaussian_targets
from ..user_frame import user_stacklevel
from .distributed import all_reduce_sum_, world
from .fit_checks import gather_rank_errors, loader_pass_size
from .rank_errors import (
    PASS_REMEDY,
    keep_for_ranks,
    nan_share,
    raise_kept,
    run_shared,
    shared_copy,
)

__all__ = ["LaplaceNet", "per_example_ggn_backend"]


class LaplaceNet(nn.Module):
    """The network as laplace-torch sees it: a batch (dict or tensor) → likelihood parameters.

    The sites' current values live in the network's own parameters (``fit_laplace`` copies the
    MAP in); a Gaussian likelihood returns ``(B, 1)`` so laplace-torch's regression code applies.
    """

    def __init__(self, model: Any) -> None:
        super().__init__()
        dtype = compute_dtype(model.dtype)
        if dtype != model.dtype:
            # laplace-torch keeps its curvature sum, τ and evidence in the dtype of the model's
            # first parameter: a frozen, empty float32 one first makes that float32 (a bfloat16
            # sum of 30,000 examples' diagonal GGN came out half the float32 one)
            self.dtype_anchor = nn.Parameter(torch.zeros(0, dtype=dtype), requires_grad=False)
        self.net = model.net
        self._model = [model]  # not a submodule: its point params must not be seen twice

    @property
    def pyro_model(self) -> Any:
        """The :class:`~pyrobayes.models.FineTuneModel` whose network this is."""
        return self._model[0]

    def forward(self, x: Any) -> Tensor:
        if _probe_due and not torch.is_grad_enabled():  # laplace-torch's probe of a shared pass
            loader, retried = _probe_due[0]
            if loader.model is self.pyro_model:
                _probe_due.clear()
                return loader.probe(self._likelihood_params, x, retried)
        return self._likelihood_params(x)

    def _likelihood_params(self, x: Any) -> Tensor:
        """The likelihood's parameters for the batch ``x`` (see :class:`LaplaceNet`)."""
        model = self._model[0]
        inputs = _network_inputs(x, model.label_key)
        prediction = model.network_prediction(model._call_net(self.net, inputs))
        if (
            not torch.is_grad_enabled()
            and prediction.dim() == 1
            and prediction.shape[0] != 1
            and batch_size(inputs) == 1
        ):
            # laplace-torch's probe of the output width (its fit runs X[:1] under no_grad): a
            # forward that squeezes a batch of one is refused where rows are read (the
            # curvature's passes, the predictive), not on a probe the user's data never made
            prediction = prediction.unsqueeze(0)
        out = model.likelihood.params(prediction, inputs)
        if not model.likelihood.is_classification and out.dim() == 1:
            out = out.unsqueeze(-1)
        return out


#: keys of the dict batches :class:`_Loader` hands laplace-torch for inputs that are not one
#: tensor: the network's inputs as the user's batch holds them, and a ``(B, 0)`` tensor whose
#: leading size laplace-torch reads as the batch size (its ``dict_key_x``)
_INPUTS, _ROWS = "__pyrobayes_inputs__", "__pyrobayes_rows__"


def _network_inputs(x: Any, label_key: str) -> Any:
    """The network's inputs in a batch laplace-torch passes back (see :class:`_Loader`)."""
    if isinstance(x, Mapping):
        return x[_INPUTS] if _INPUTS in x else split_batch(x, label_key)[0]
    return x


class _Loader:
    """Re-iterable ``(X, y)`` / dict batches with ``.dataset`` of length N, as laplace-torch wants.

    A batch whose inputs are one tensor goes as ``(X, y)``; any other inputs (a dict of tensors
    such as ``pixel_values`` or ``input_ids``, a tuple of tensors) go as the dict
    ``{_INPUTS: inputs, _ROWS: (B, 0) tensor, label_key: y}``, laplace-torch's dict form with
    ``dict_key_x=_ROWS`` (it reads only the batch size from there; :class:`LaplaceNet` runs
    the network on ``_INPUTS``). Class labels become ``(B,)`` int64 (``(B, 1)`` and any integer
    dtype are accepted, as every other family accepts them).

    Regression targets are checked against the network output (``check_gaussian_targets``: a
    scalar output takes ``(B,)`` or ``(B, 1)``, a ``(B, D)`` output ``(B, D)``, anything else
    raises) and passed as laplace-torch wants them, ``(B, 1)`` or ``(B, D)``.

    Under ``torch.distributed`` the curvature pass all-reduces every batch's curvature, so a
    batch refused on one rank would leave the others waiting in that all-reduce (until gloo's
    timeout, 30 minutes): there every rank checks all its batches first, and the ranks gather
    the outcomes in one collective (:meth:`_checked_on_every_rank`) before the pass. What still
    fails on one rank inside laplace-torch's ``fit`` but outside the backend's per-batch calls
    (reading or moving a batch, laplace-torch's probe forward of the first example,
    :meth:`probe`; an out-of-memory error, a loader's worker) is kept for the pass's next
    all-reduce: the rank hands laplace-torch an empty batch in its place, the backend shares
    NaN for it, and every rank stops there with that error (:func:`_summed_over_ranks`). So
    is the read that should end a read after the batches every rank checked (made before the
    last batch's all-reduce: :meth:`_check_ended`) and a read that ends before them, and an
    error after the check but before laplace-torch's first read (:meth:`stop_unread`).
    """

    def __init__(self, model: Any, data: Iterable[Any], device: torch.device) -> None:
        self.model, self.data, self.device = model, data, device
        self._event_shape: tuple[int, ...] | None = None  # of one example's output, once probed
        self._output_dtype: torch.dtype | None = None  # of the outputs, probed with the shape
        #: the times laplace-torch began to read the batches (its probe's read, then its pass)
        self._reads = 0
        #: whether this rank kept an error for the pass's next all-reduce (torch.distributed)
        self._failed = False
        #: the batches every rank holds, once checked (torch.distributed; else ``None``)
        self._batches: int | None = None
        #: this rank's examples and every rank's, once checked (torch.distributed)
        self._examples = (0, 0)
        #: the laplace-torch ``Laplace`` fitted over this loader (:func:`fit_laplace` sets it):
        #: its observation counts are made every rank's at the end of a shared pass
        self.laplace: Any = None
        _warn_if_dropping(data)
        if world()[0] > 1:
            n = self._checked_on_every_rank()
        else:
            _refuse_one_shot(data)
            n = self._num_examples()
        if n == 0:  # laplace-torch's next(iter(loader)) raised a bare StopIteration
            raise ValueError(_NO_EXAMPLES)
        self.dataset = range(n)

    def _num_examples(self) -> int:
        """N: the length of the data's ``dataset`` (a sampler's is the whole set already), else
        the examples counted (one process)."""
        try:
            return len(getattr(self.data, "dataset", None))  # type: ignore[arg-type]
        except TypeError:  # None or an unsized dataset: counted
            key = self.model.label_key
            return sum(batch_size(split_batch(b, key)[0]) for b in self.data)

    def _checked_on_every_rank(self) -> int:
        """N under ``torch.distributed``, once every rank checked all its batches (the checks
        of :meth:`__iter__`, each batch once more) and the ranks gathered the outcomes in one
        collective: a rank that refused its data (a batch, or data that are empty or a
        one-shot iterator) raises its own error, every other rank a ``RuntimeError`` naming it.
        N is the ``dataset``'s length, else the ranks' examples summed.

        Raises
        ------
        ValueError
            When the ranks hold other numbers of batches (the pass all-reduces every batch).
        """
        failed, waited_in = "refused its curvature data", "the curvature pass's all-reduces"
        remedy = "Fix that rank's training data (every rank's share must pass these checks)."
        try:
            _refuse_one_shot(self.data)
            batches = examples = 0
            for index, batch in enumerate(self.data):
                examples += batch_size(self._checked(index, batch)[0])
                batches += 1
            if examples == 0:  # this rank's: laplace-torch would probe a batch it does not have
                raise ValueError(_NO_EXAMPLES)
        except Exception as err:
            gather_rank_errors(None, err, failed, waited_in, caller="Laplace", remedy=remedy)
            raise
        outcome = gather_rank_errors(
            (batches, examples), None, failed, waited_in, caller="Laplace", remedy=remedy
        )
        counts = [record for record, _ in outcome or []]
        self._batches = batches
        self._examples = (examples, sum(e for _, e in counts))
        if len({b for b, _ in counts}) > 1:
            shown = ", ".join(f"rank {i}: {b}" for i, (b, _) in enumerate(counts[:8]))
            raise ValueError(
                f"Laplace: under torch.distributed the ranks' curvature data hold different "
                f"numbers of batches ({shown}), but the curvature pass all-reduces every "
                "batch's curvature over the ranks. Give each rank a DistributedSampler over "
                "the same dataset (it pads the shards to equal sizes) and the same batch size."
            )
        dataset: Any = getattr(self.data, "dataset", None)
        try:
            return len(dataset)  # (a sampler's dataset is the whole set already)
        except TypeError:  # None or an unsized dataset: the ranks' shares summed
            return sum(e for _, e in counts)

    def __iter__(self) -> Iterator[Any]:
        shared = world()[0] > 1
        if shared:  # laplace-torch reads the first batch for its probe, then the pass
            self._reads += 1
            _probe_due[:] = [(self, False)] if self._reads == 1 else []
        batches: Iterator[Any] | None = None
        index = 0
        while not self._failed:
            try:
                batches = iter(self.data) if batches is None else batches
                batch = next(batches, _END)
                if batch is _END:
                    if self._batches is None or index >= self._batches:
                        return
                    raise ValueError(self._changed(f"ended after {index} batches"))
                item = self._laplace_batch(index, batch)
                if index + 1 == self._batches:  # the last: the read that ends it before its
                    self._check_ended(batches)  # all-reduce, where all stop on its error
            except Exception as error:
                if not shared:
                    raise
                keep_for_ranks(error)  # the backend shares NaN for the batch below
                self._failed = True
                break
            yield item
            if index + 1 == self._batches:
                self._count_every_rank()
                return
            index += 1
        yield self._failed_batch()
        # laplace-torch went on past the failed batch: its backend took no all-reduce that
        # stops every rank (not per_example_ggn_backend's); the ranks stop here instead
        raise_kept("Laplace's curvature pass", remedy=PASS_REMEDY)

    def _count_every_rank(self) -> None:
        """At the end of a pass under ``torch.distributed``: laplace-torch's observation
        counts (``n_obs``; ``n_obs_examples`` for K-FAC-reduce) made every rank's.

        laplace-torch (0.5 on) counts the observations of the batches it read, this rank's
        share, and divides the Kronecker input factors, which the pass sums over the ranks, by
        that count (``KronLaplace.fit``): W ranks' factors came out W times one process's (2×
        on two ranks). Each example is one observation here (:class:`LaplaceNet` returns one
        row of outputs per example), so the other ranks' examples are added. A laplace-torch
        without the counts is left as it is."""
        if self.laplace is None:
            return
        local, total = self._examples
        for name in ("n_obs", "n_obs_examples"):
            count = getattr(self.laplace, name, None)
            if isinstance(count, int) and not isinstance(count, bool) and count > 0:
                setattr(self.laplace, name, count + total - local)

    def stop_unread(self, error: Exception, params: Sequence[Tensor], structure: str) -> None:
        """Under ``torch.distributed``, stop every rank with ``error``, raised on this rank after
        the data's gather (:meth:`_checked_on_every_rank`) but before laplace-torch read a batch
        (its ``_init_H`` out of memory, in its constructor or its ``fit``): the other ranks wait
        in the pass's first all-reduce, so this rank shares NaN there in the backend's place
        (:func:`_summed_over_ranks`, the curvature of ``params`` in ``structure``, ``"kron"``
        or ``"diag"``) and raises ``error``, the others a ``RuntimeError`` naming it. Returns
        in one process, or once laplace-torch began to read (the pass shares its own errors).
        """
        if world()[0] == 1 or self._reads:
            return
        keep_for_ranks(error)
        if structure == "kron":
            shares = [f for fs in _nan_kron(params).kfacs for f in fs]
        else:
            shares = [_nan_diag(params)]
        _summed_over_ranks(None, shares, "K-FAC" if structure == "kron" else "diagonal GGN")

    def _check_ended(self, batches: Iterator[Any]) -> None:
        """The read that should end a read of the data after its last batch, made (under
        ``torch.distributed``) before that batch's all-reduce: made after it, its error (an
        unreadable file at the end of the shard) left the other ranks past the pass, waiting
        for this rank elsewhere until gloo's timeout.

        Raises
        ------
        ValueError
            When the data yield a batch past those they held when checked.
        """
        if next(batches, _END) is not _END:
            raise ValueError(self._changed(f"yielded more than {self._batches} batches"))

    def _changed(self, what: str) -> str:
        """The error of data whose read in the curvature pass ``what`` (under
        ``torch.distributed``), after holding :attr:`_batches` batches when checked."""
        return (
            f"Laplace: this rank's curvature data {what} when laplace-torch read them, but "
            f"held {self._batches} when checked before the pass; the pass all-reduces every "
            "batch over the ranks, so every rank must read the same number. Pass data that "
            "yield the same batches every time they are read (a list, or a DataLoader)."
        )

    def _laplace_batch(self, index: int, batch: Any) -> Any:
        """Batch ``index`` checked, as laplace-torch reads it: ``(X, y)``, or the dict form."""
        inputs, y = self._checked(index, batch)
        if isinstance(inputs, Tensor):
            return inputs, y
        rows = torch.empty(batch_size(inputs), 0, device=self.device)
        return {_INPUTS: inputs, _ROWS: rows, self.model.label_key: y}

    def probe(self, forward: Callable[[Any], Tensor], x: Any, retried: bool) -> Tensor:
        """laplace-torch's probe of the output width, ``forward(x)`` on the first batch, under
        ``torch.distributed``: an error is kept for the pass's first all-reduce (and an output
        of NaN returned in its place) instead of leaving the other ranks waiting there.

        A ``TypeError`` or ``AttributeError`` of the probe's first example (``retried`` false)
        is raised, as laplace-torch then probes the whole batch (:class:`LaplaceNet` calls this
        again for that).
        """
        if self._failed:  # (the probe's read of the first batch failed)
            return self._failed_output()
        try:
            return forward(x)
        except Exception as error:
            if isinstance(x, Tensor) and isinstance(error, TypeError | AttributeError):
                if not retried:
                    _probe_due[:] = [(self, True)]
                    raise
            keep_for_ranks(error)
            self._failed = True
            return self._failed_output()

    def _failed_output(self) -> Tensor:
        """A failed probe's output: NaN, one example of laplace-torch's output shape, so that
        its check of the regression targets' dimensions passes."""
        return torch.full((1, *(self._event_shape or (1,))), math.nan, device=self.device)

    def _failed_batch(self) -> tuple[Tensor, Tensor]:
        """The empty ``(X, y)`` a rank that kept an error hands laplace-torch for its next batch:
        the backend shares NaN for it without reading it (:func:`run_shared`)."""
        empty = self._failed_output()[:0]
        return empty, empty

    def _checked(self, index: int, batch: Any) -> tuple[Any, Tensor]:
        """Batch ``index``'s inputs (on the device) and its checked targets, as laplace-torch
        wants them."""
        regression = not self.model.likelihood.is_classification
        key = self.model.label_key
        inputs, y = split_batch(to_device(batch, self.device), key)
        y = _check_rows(inputs, y, index, key, regression)
        _check_finite_batch(inputs, y, index)
        if regression:
            return inputs, self._regression_targets(inputs, y)
        if getattr(self.model.likelihood, "multi_label", False):
            return inputs, self._binary_targets(inputs, y, index)
        return inputs, self._checked_classes(inputs, _class_targets(y, index), index)

    def _output_shape(self, inputs: Any) -> tuple[int, ...]:
        """One example's output shape (the likelihood's parameters), from one probe forward of
        the first batch (laplace-torch's own probe reads the output width once, too)."""
        model = self.model
        if self._event_shape is None:
            with torch.no_grad():
                out = model.likelihood.params(
                    model.network_prediction(model._call_net(model.net, inputs)), inputs
                )
            self._event_shape = tuple(int(n) for n in out.shape[1:])
            self._output_dtype = out.dtype if out.is_floating_point() else None
        return self._event_shape

    def _binary_targets(self, inputs: Any, y: Tensor, index: int) -> Tensor:
        """Multi-label 0/1 targets ``(B, L)`` checked against the output of ``inputs``
        (:func:`check_binary_targets`), in the output's dtype: laplace-torch's Bernoulli loss,
        ``BCEWithLogitsLoss``, takes float targets of the logits' shape."""
        event = self._output_shape(inputs)
        what = f"Laplace: batch {index} of the curvature data"
        y = check_binary_targets(y, (batch_size(inputs), *event), what=what)
        return y.to(self._output_dtype or torch.get_default_dtype())

    def _regression_targets(self, inputs: Any, y: Tensor) -> Tensor:
        """``y`` checked against the output of ``inputs``: ``(B, 1)`` (scalar) or ``(B, *event)``."""
        event = self._output_shape(inputs)
        y = check_gaussian_targets(y, (batch_size(inputs), *event))
        return y if event else y.unsqueeze(-1)

    def _checked_classes(self, inputs: Any, y: Tensor, index: int) -> Tensor:
        """Class labels ``(B,)`` refused outside ``0 .. C-1`` (one synchronisation): laplace-torch's
        cross-entropy raised an ``IndexError`` ("Target 10 is out of bounds") on the CPU, and a
        device-side assert, which ends the CUDA context, on a GPU. ``C`` is the categorical
        head's width; another classification likelihood (its width may vary by batch) is
        checked for negative labels only."""
        classes = None
        if isinstance(self.model.likelihood, Categorical):
            classes = self._output_shape(inputs)[-1]
        bad = y < 0 if classes is None else (y < 0) | (y >= classes)
        if bool(bad.any()):
            values = sorted(set(y[bad].tolist()))
            valid = "0 .. C-1" if classes is None else f"0 .. {classes - 1} ({classes} classes)"
            raise ValueError(
                f"Laplace: batch {index} of the curvature data has class labels {values[:5]} "
                f"outside {valid}, in {int(bad.sum())} of {y.shape[0]} rows. Encode the labels "
                "as 0 .. C-1, or give the network's head one output per class."
            )
        return y


#: the end of a rank's batches (``next``'s default)
_END = object()
#: the :class:`_Loader` whose probe laplace-torch's ``fit`` runs next under
#: ``torch.distributed`` (set at its first read, cleared by the probe or by the pass's read),
#: and whether that probe is its retry with the whole first batch
_probe_due: list[tuple[_Loader, bool]] = []

_NO_EXAMPLES = (
    "Laplace: the curvature data hold no examples (an empty list or data set): the "
    "posterior's curvature is a sum over the training examples. Pass the training batches."
)


def _warn_if_dropping(data: Iterable[Any]) -> None:
    """Warn when the curvature data is a ``DataLoader`` with ``drop_last=True`` that drops
    examples: a training loader's setting, under which every pass leaves its last examples out
    of the curvature (on 249 examples in batches of 50, the curvature was 0.77 of the full
    pass's and the linearised predictive 25% wider, in silence)."""
    sizes = loader_pass_size(data)
    if sizes is not None and sizes[0] > sizes[1]:
        sampled, kept = sizes
        warnings.warn(
            f"Laplace: the curvature data is a DataLoader with drop_last=True, so the last "
            f"{sampled - kept} of its {sampled} examples are left out of the curvature (and of "
            "the evidence that chooses τ) in every pass. Fit the curvature on a loader with "
            "drop_last=False (its order does not matter).",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def _refuse_one_shot(data: Iterable[Any]) -> None:
    """Refuse a one-shot iterator (a generator): laplace-torch probes its first batch, then
    passes over it, which would find it used up."""
    if iter(data) is data:
        raise TypeError(
            "Laplace: the curvature data is a one-shot iterator "
            f"({type(data).__name__}), but the fit reads it more than once (laplace-torch "
            "probes its first batch, then passes over it). Pass a list of batches or a "
            "DataLoader."
        )


def _check_rows(
    inputs: Any, y: Tensor | None, index: int, label_key: str, regression: bool
) -> Tensor:
    """``y``, refused when the batch holds no examples, has no labels, or (classification) one
    label per example fails: laplace-torch failed on them with a ``ZeroDivisionError``, an
    ``AttributeError`` on ``None`` or curvlinops' "number of loss terms" message. Regression
    targets' shapes are checked against the output by ``check_gaussian_targets``, whose message
    every path shares."""
    where = f"Laplace: batch {index} of the curvature data"
    size = batch_size(inputs)
    if size == 0:
        raise ValueError(
            f"{where} holds no examples (inputs with a batch size of 0); drop empty batches."
        )
    if y is None:
        raise ValueError(
            f"{where} carries no labels: the curvature (the GGN of the log-likelihood) is "
            f"fitted on labelled data. Pass (x, y) batches, or dicts with the model's label key "
            f"{label_key!r}."
        )
    if regression and isinstance(y, Tensor):
        return y
    if not isinstance(y, Tensor) or y.dim() == 0 or int(y.shape[0]) != size:
        got = tuple(y.shape) if isinstance(y, Tensor) else type(y).__name__
        raise ValueError(
            f"{where} has labels of shape {got} for {size} examples; pass one label (row) per "
            "example."
        )
    return y


def _class_targets(y: Tensor, index: int) -> Tensor:
    """Class labels as laplace-torch's cross-entropy wants them: ``(B,)`` int64."""
    if y.is_floating_point() or y.is_complex():
        raise ValueError(
            f"Laplace: batch {index} has class labels of dtype {y.dtype}; the categorical "
            "likelihood takes integer class indices of shape (B,) or (B, 1). Pass y.long() "
            "if they are whole numbers (multi-label 0/1 targets are not supported)."
        )
    if y.dim() == 2 and y.shape[-1] == 1:
        y = y.squeeze(-1)
    return y.long()


def _check_finite_batch(inputs: Any, y: Any, index: int) -> None:
    """Refuse a batch whose floating-point inputs or targets hold NaN or inf (they would reach the
    curvature, where laplace-torch's eigendecomposition fails)."""
    named = dict(inputs) if isinstance(inputs, Mapping) else {"inputs": inputs}
    named["targets"] = y
    for name, value in named.items():
        if isinstance(value, Tensor) and value.is_floating_point():
            bad = ~torch.isfinite(value)
            if bool(bad.any()):
                rows: list[int] = (
                    bad.reshape(bad.shape[0], -1).any(-1).nonzero().flatten().tolist()
                    if value.dim()
                    else []
                )
                raise ValueError(
                    f"Laplace: batch {index} of the curvature data has non-finite {name} (NaN or "
                    f"inf) in rows {rows[:5]}; drop or impute those examples."
                )


@functools.cache
def _import_laplace() -> None:
    """Import laplace-torch once, without the FutureWarning its dependency asdl raises on import
    (it decorates helpers with the deprecated ``torch.jit.script``): nothing the user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="`torch.jit.script` is deprecated", category=FutureWarning
        )
        import laplace  # noqa: F401
        import laplace.curvature  # noqa: F401


@functools.cache
def per_example_ggn_backend() -> type:
    """laplace-torch's default backend (curvlinops GGN) with an exact, per-example diagonal.

    ``kron`` and ``full`` are curvlinops'. ``diag`` returns the same ``(loss, diag GGN)`` as
    laplace-torch's ``GGNInterface.diag`` but from per-example Jacobians of the sites
    (:func:`pyrobayes.linearized.output_jacobian_rows` on the sample-batched forward): one
    forward and ``K − 1`` (classification) or ``K`` (regression) backward passes per batch
    instead of ``B·K`` backward passes of the whole batch, the rows reduced four at a time as
    they are formed (memory ``O(B·d)``, not the ``B·K·d`` Jacobian; a multiple-choice likelihood
    with ``rows_per_output``, whose copies are ``B·K·d`` anyway, uses
    :func:`pyrobayes.linearized.output_jacobians`). It applies to a :class:`LaplaceNet` whose
    gradient-requiring parameters are latent sites and to a deterministic GGN; anything else
    (``stochastic=True``, last-layer or subnetwork Laplace, another network) goes to
    laplace-torch's own ``diag``.

    Returns
    -------
    type
        A subclass of ``laplace.curvature.CurvlinopsGGN`` (built on first use: laplace-torch is
        imported only when a Laplace posterior is fitted).
    """
    _import_laplace()
    from laplace.curvature import CurvlinopsGGN

    class PerExampleGGN(CurvlinopsGGN):
        def kron(self, x: Any, y: Tensor, N: int, **kwargs: Any) -> tuple[Tensor, Any]:
            # under torch.distributed a rank whose batch fails (an out-of-memory error) shares
            # NaN factors in this batch's all-reduce instead, and every rank stops with its error
            local = run_shared(lambda: self._local_kron(x, y, N, **kwargs), lambda: None)
            loss, kron, half16 = local or (None, _nan_kron(self.params), False)
            factors = [f for fs in kron.kfacs for f in fs]
            # under torch.distributed each rank holds its share of the batch: the factors are
            # summed over ranks as laplace-torch sums them over batches (H += H_batch), so every
            # rank holds the curvature of one process whose batches are the ranks' shares
            loss = _summed_over_ranks(loss, factors, "K-FAC")
            if half16:  # checked after the sum: an inf on any rank is an inf on every rank
                _refuse_float16_overflow(factors)
            return loss, kron

        def _local_kron(self, x: Any, y: Tensor, N: int, **kwargs: Any) -> tuple[Tensor, Any, bool]:
            """This rank's ``(loss, K-FAC)`` of the batch and whether its factors were float16."""
            # token batches: the K-FAC input factors over the real tokens only (padding and a
            # ragged batch's padded choice rows are not data; laplace-torch's KFAC counts them)
            with _real_token_kfac(self.model, x, sys.modules[CurvlinopsGGN.__module__]):
                loss, kron = super().kron(x, y, N, **kwargs)
            # half-precision sites (a bf16 network): the factors go on in float32, since their
            # eigendecomposition (torch.linalg.eigh) has no half-precision kernel
            factors = [f for fs in kron.kfacs for f in fs]
            half16 = any(f.dtype == torch.float16 for f in factors)
            if any(compute_dtype(f.dtype) != f.dtype for f in factors):
                upcast: Any = [[f.float() for f in factors] for factors in kron.kfacs]
                kron = type(kron)(upcast)
                loss = loss.float()
            return loss, kron, half16

        def diag(self, x: Any, y: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
            local = run_shared(lambda: self._local_diag(x, y, **kwargs), lambda: None)
            loss, diag = local or (None, _nan_diag(self.params))
            # a sum over examples: exact under any sharding
            return _summed_over_ranks(loss, [diag], "diagonal GGN"), diag

        def _local_diag(self, x: Any, y: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
            wrapper: Any = self.model
            sites = _site_names(wrapper, self.params)
            if (
                sites is None
                or self.stochastic
                or self.last_layer
                or self.subnetwork_indices is not None
            ):
                return super().diag(x, y, **kwargs)
            model = wrapper.pyro_model
            classification = model.likelihood.is_classification
            # a softmax's rows are contrasted (J_k − J_K); a multi-label likelihood's logits are
            # independent Bernoulli logits, each weighted by its own p(1 − p)
            multi_label = bool(getattr(model.likelihood, "multi_label", False))
            contrast = classification and not multi_label
            inputs = _network_inputs(x, model.label_key)
            point = {s: p.detach() for s, p in zip(sites, self.params, strict=True)}
            size = batch_size(inputs)
            out, rows = _jacobian_rows(model, inputs, point, contrast)
            if classification and out.dim() != 2:  # laplace-torch's cross-entropy: (B, K)
                return super().diag(x, y, **kwargs)
            weights = torch.sigmoid(out).mul(torch.sigmoid(-out)) if multi_label else None
            diag = _streamed_diag_ggn(out, rows, point, sites, contrast, weights)
            if not classification:
                out = out.reshape(size, -1) if out.dim() == 1 else out  # LaplaceNet's (B, 1)
            loss = self.factor * self.lossfunc(out, y)
            return loss.detach(), diag.detach()

    return PerExampleGGN


def _jacobian_rows(
    model: Any, inputs: Any, point: dict[str, Tensor], contrast: bool
) -> tuple[Tensor, Iterator[tuple[int, dict[str, Tensor]]]]:
    """``f(x; θ̂)`` and its Jacobian rows ``(k0, {site: (k, B, *shape)})`` in chunks of outputs
    (:func:`~pyrobayes.linearized.output_jacobian_rows`); ``contrast``: the rows ``J_k − J_K``,
    ``k < K``, a softmax's (its Λ annihilates a shift common to the K rows)."""
    if model.likelihood.rows_per_output(inputs) is None:
        return output_jacobian_rows(model, inputs, point, contrast=contrast, outputs_per_pass=4)
    # one network row per output: one backward pass gives all K rows (the copies alone are
    # B·K·d, so nothing to stream); handed on as one chunk
    out, jac = output_jacobians(model, inputs, point)
    if contrast:  # the contrasts J_k − J_K, k < K, that the sum expects
        jac = {s: j[:, :-1] - j[:, -1:] for s, j in jac.items()}
    return out, iter([(0, {s: j.movedim(1, 0) for s, j in jac.items()})])


def _summed_over_ranks(loss: Tensor | None, curvature: list[Tensor], what: str) -> Tensor:
    """A batch's ``loss`` and ``curvature`` summed over the ranks in place (one all-reduce each,
    as before): a no-op in one process. ``loss`` is ``None`` on a rank whose part of the batch
    failed (:func:`~pyrobayes.infer.rank_errors.run_shared` kept its error): its share is NaN,
    so the summed loss is NaN on every rank, and every rank then stops with that rank's error
    (:func:`~pyrobayes.infer.rank_errors.raise_kept`) instead of waiting in this all-reduce
    until gloo's timeout. The loss is summed in float64 (a failing rank cannot know the dtype
    of the others' loss) and returned in its own dtype; reading it is one host sync per batch.
    """
    if world()[0] == 1:
        assert loss is not None  # (run_shared raises in one process)
        return loss
    total = nan_share(curvature[0].device) if loss is None else shared_copy(loss)
    all_reduce_sum_([total, *curvature])
    if not math.isfinite(float(total)):  # the same sum on every rank: all stop here together
        raise_kept(f"Laplace's curvature pass ({what} of a batch)", remedy=PASS_REMEDY)
    assert loss is not None  # (a failed rank's sum is NaN: raise_kept raised its own error)
    return total.to(loss.dtype)


def _refuse_float16_overflow(factors: list[Tensor]) -> None:
    """Refuse K-FAC factors of a float16 network that overflowed (checked after their sum over
    the ranks, so that every rank refuses together instead of one leaving the others in the
    all-reduce)."""
    if not all(bool(f.isfinite().all()) for f in factors):
        raise FloatingPointError(
            "Laplace: the Kronecker (K-FAC) factors of this float16 network overflowed "
            "(a sum of squared activations past float16's largest value, 65504), which "
            "laplace-torch's eigendecomposition would turn into a zero curvature. Fit "
            "the posterior on a bfloat16 or float32 copy of the network "
            "(model.to(torch.bfloat16) before pb.fit), or use structure='diag'."
        )


def _nan_diag(params: Sequence[Tensor]) -> Tensor:
    """A failing rank's share of a batch's diagonal GGN (:func:`_summed_over_ranks`): NaN, one
    entry per parameter, in their dtype (the diagonal's)."""
    size = sum(p.numel() for p in params)
    return torch.full((size,), math.nan, dtype=params[0].dtype, device=params[0].device)


def _nan_kron(params: Iterable[Tensor]) -> Any:
    """A failing rank's share of a batch's K-FAC (:func:`_summed_over_ranks`): NaN factors of the
    shapes laplace-torch's curvlinops backend gives ``params`` (``G ⊗ A`` for a weight, ``A``
    over its flattened input dimensions; one ``1×1`` factor for a ``1×1`` weight; one dense
    ``G`` for a bias), in the dtype the pass sums them in (:func:`compute_dtype`)."""
    from laplace.utils import Kron

    kfacs: Any = []  # (laplace-torch types its factors loosely)
    for p in params:
        dtype = compute_dtype(p.dtype)
        sizes = [p.shape[0]] if p.dim() == 1 else [p.shape[0], math.prod(p.shape[1:])]
        if sizes == [1, 1]:
            sizes = [1]
        kfacs.append([torch.full((n, n), math.nan, dtype=dtype, device=p.device) for n in sizes])
    return Kron(kfacs)


@contextlib.contextmanager
def _real_token_kfac(wrapper: Any, x: Any, backend: Any) -> Iterator[None]:
    """Within the block, ``backend`` (laplace-torch's curvlinops module) builds K-FAC with
    :func:`_masked_kfac`'s operator over the real tokens of the batch ``x`` (nothing changes
    for a batch without padding or token axes)."""
    model = getattr(wrapper, "pyro_model", None)
    mask = None
    if model is not None and isinstance(x, Mapping):
        mask = token_mask(_network_inputs(x, model.label_key))
    if mask is None or bool(mask.bool().all()):
        yield
        return
    masked: Any = _masked_kfac()
    plain, backend.KFACLinearOperator, masked.token_mask = (
        backend.KFACLinearOperator,
        masked,
        mask.bool(),
    )
    try:
        yield
    finally:
        backend.KFACLinearOperator, masked.token_mask = plain, None


@functools.cache
def _masked_kfac() -> type:
    """curvlinops' ``KFACLinearOperator`` whose K-FAC-expand input factor of a token layer
    averages each row (sequence) over its own real tokens (``token_mask`` ``(rows, T)``, set
    around one call): ``A = (1/N) Σ_rows (1/L_row) Σ_{t real} a_t a_tᵀ``, K-FAC-expand's
    input factor ``(1/(N R)) Σ_n Σ_r a_{n,r} a_{n,r}ᵀ`` for ``R`` positions per sequence
    (Eschenhagen et al. 2023, Sec. 3) with each sequence's own length for ``R``. It is
    curvlinops' ``Σ a aᵀ / (N · T)`` for a batch without padding, and depends neither on how a batch is
    padded (left or right, copies of a choice in a ragged batch's padded rows, which get weight
    0) nor on how examples of different lengths are grouped into batches (a batch-wide mean
    length, ``Σ_real a aᵀ / (N · n_tok / n_rows)``, moved the curvature by 3-8 % with the
    grouping). The output-gradient factor needs nothing: padding gets no gradient."""
    from curvlinops import KFACLinearOperator  # type: ignore[import-untyped]

    class MaskedKFAC(KFACLinearOperator):
        token_mask: Tensor | None = None

        def _hook_accumulate_input_covariance(
            self, module: nn.Module, inputs: tuple[Tensor, ...], module_name: str
        ) -> None:
            mask, x = type(self).token_mask, inputs[0].data.detach() if inputs else None
            if (
                mask is None
                or x is None
                or len(inputs) != 1
                or x.dim() != 3
                or tuple(x.shape[:-1]) != tuple(mask.shape)
                or str(getattr(self._kfac_approx, "value", self._kfac_approx)) != "expand"
            ):  # a layer without the batch's token axis (a pooled head), or KFAC-reduce
                super()._hook_accumulate_input_covariance(module, inputs, module_name)
                return
            real = mask.to(x.device)
            a = x[real]  # (n_tok, d): the real tokens' inputs
            params = self._mapping[module_name]
            if "weight" in params and "bias" in params and not self._separate_weight_and_bias:
                a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
            # each real token weighted by 1 / its row's real length (rows without any: none)
            length = real.sum(-1, keepdim=True).clamp_min(1).to(a.dtype)
            weight = (1 / length).expand(real.shape)[real]  # (n_tok,)
            covariance = (a.T * weight) @ a
            covariance.div_(self._N_data)
            me: Any = self
            me._input_covariances = me._set_or_add_(me._input_covariances, module_name, covariance)

    return MaskedKFAC


def _streamed_diag_ggn(
    out: Tensor,
    rows: Iterator[tuple[int, dict[str, Tensor]]],
    point: Mapping[str, Tensor],
    sites: list[str],
    classification: bool,
    weights: Tensor | None = None,
) -> Tensor:
    r"""The diagonal GGN accumulated from Jacobian rows as they come (never all ``K`` at once).

    Regression: ``Σ_i Σ_k J_{ik}²``; with ``weights`` ``w`` ``(B, K)`` (a multi-label
    likelihood's ``p(1 − p)``, the diagonal Hessian of its negative log-likelihood in the
    logits), ``Σ_i Σ_k w_{ik} J_{ik}²``. Classification (``rows`` the contrasts ``J_{ik} − J_{iK}``
    for ``k < K``, the K-th zero): per example the ``p_i``-weighted sum of squared deviations
    ``Σ_k p_{ik} (J_{ik} − Σ_j p_{ij} J_{ij})²``, merged chunk by chunk with the pairwise update
    of Chan, Golub & LeVeque (1983, "Algorithms for computing the sample variance", eq. 2.1,
    weighted): a chunk of weight ``w``, mean ``m_c`` and centred sum ``M_c`` joins the running
    ``(W, m, M)`` as ``δ = m_c − m``, ``m ← m + δ w/(W + w)``, ``M ← M + M_c + δ² W w/(W + w)``,
    ``W ← W + w`` — the centred sum without the cancellation of ``Σ p J² − (Σ p J)²``. Memory:
    ``m`` and a few temporaries of the chunk's size, ``B·d`` numbers each per row.
    """
    diag = {s: point[s].new_zeros(point[s].shape) for s in sites}
    if not classification:
        for k0, chunk in rows:
            for s in sites:
                if weights is None:
                    diag[s] += chunk[s].square().sum((0, 1))
                    continue
                count = chunk[s].shape[0]
                diag[s] += torch.einsum(
                    "cb,cb...->...", weights[:, k0 : k0 + count].T, chunk[s].square()
                )
        return torch.cat([diag[s].reshape(-1) for s in sites])
    probs = torch.softmax(out, -1)  # (B, K)
    size = probs.shape[0]
    tiny = torch.finfo(probs.dtype).tiny
    total = probs[:, -1].clone()  # W: the K-th row (zero) enters first, m = 0 and M = 0 after it
    mean = {s: point[s].new_zeros(size, *point[s].shape) for s in sites}
    for k0, chunk in rows:
        count = next(iter(chunk.values())).shape[0]
        weight = probs[:, k0 : k0 + count].T  # (c, B)
        chunk_total = weight.sum(0)  # w
        merged = total + chunk_total
        # w/(W + w) and W w/(W + w): 0 where the weights are 0 (then so are the terms they scale)
        ratio = chunk_total / merged.clamp_min(tiny)
        cross = total * ratio
        for s in sites:
            g, m = chunk[s], mean[s]
            shape = (size,) + (1,) * (m.dim() - 1)
            chunk_mean = torch.einsum("cb,cb...->b...", weight, g) / chunk_total.clamp_min(
                tiny
            ).view(shape)
            deviation = (g - chunk_mean).square_()
            delta = chunk_mean.sub_(m)
            diag[s] += torch.einsum("cb,cb...->...", weight, deviation)
            del deviation
            diag[s] += torch.einsum("b,b...->...", cross, delta.square())
            m.add_(delta.mul_(ratio.view(shape)))
        total = merged
    return torch.cat([diag[s].reshape(-1) for s in sites])


def _site_names(wrapper: Any, params: Iterable[Tensor]) -> list[str] | None:
    """The latent site of each of ``params`` (in order), or ``None`` if one is not a site."""
    if not isinstance(wrapper, LaplaceNet):
        return None
    model = wrapper.pyro_model
    net = model.net
    by_id = {id(net.get_parameter(spec.param_name)): s for s, spec in model.latent_sites.items()}
    names = [by_id.get(id(p)) for p in params]
    return None if any(n is None for n in names) else [n for n in names if n is not None]


def _laplace_likelihood(model: Any) -> tuple[str, float]:
    """laplace-torch's ``likelihood`` and ``sigma_noise`` (a learned σ: its current value)."""
    if getattr(model.likelihood, "multi_label", False):  # BCEWithLogitsLoss, one per label
        return "bernoulli", 1.0
    if model.likelihood.is_classification:
        return "classification", 1.0
    sigma = float(getattr(model.likelihood, "obs_scale", 1.0))
    if not (math.isfinite(sigma) and sigma > 0):  # laplace-torch's 1/σ²: an inf or NaN curvature
        raise FloatingPointError(
            f"Laplace: the Gaussian likelihood's noise σ (obs_scale) is {sigma}, not a finite "
            "number > 0; the curvature is the GGN scaled by 1/σ², which would be NaN or inf (and "
            "τ chosen on it). A learned σ (obs_scale='learn') is softplus(likelihood.raw_scale): "
            "set raw_scale to a finite value (a σ that collapsed to 0 in training: fix σ, "
            "Gaussian(obs_scale=...), or regularise the fit) and refit."
        )
    return "regression", sigma
