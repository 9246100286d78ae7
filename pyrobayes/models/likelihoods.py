"""Observation models: turn network outputs into a distribution over targets.

Each likelihood maps the raw network output to its parameters (``params``) and builds the
distribution (``dist``). Both work with any leading shape, so the same code scores one parameter
set inside a Pyro plate and S samples at once in the batched path.

Targets are checked against the parameters by ``check_targets`` (for the Gaussian likelihood,
:func:`check_gaussian_targets`: one rule used by the batched log-likelihood, the Pyro program,
prediction, the metrics and the Laplace loader; for class labels, :func:`check_class_targets`:
integer labels in range, one per example; for multi-label 0/1 targets,
:func:`check_binary_targets`: one 0/1 per label and example).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import pyro.distributions as dist
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..batch import batch_size, compute_dtype, flagged_examples
from ..user_frame import user_stacklevel
from .adapters import check_int, check_real
from .multiple_choice import (
    NORMALIZATIONS,
    accepts_argument,
    continuation_scores,
    continuation_targets,
    eager_attention_mask,
    flatten_choices,
    head_positions_supported,
    last_positions,
)
from .sharing import TokenLogProbs

__all__ = [
    "Likelihood",
    "Categorical",
    "Gaussian",
    "Bernoulli",
    "MultipleChoice",
    "make_likelihood",
    "network_output",
    "OutputKey",
    "check_gaussian_targets",
    "check_class_targets",
    "check_binary_targets",
    "bernoulli_log_probs",
    "logits_log_probs",
    "check_example_rows",
    "MULTI_LABEL_ADVICE",
]


#: How :func:`network_output` reads a network's output: an index of a tuple, a key of a mapping
#: or an attribute name, or a callable taking the output.
OutputKey = int | str | Callable[[Any], Tensor]


def _describe(item: Any) -> str:
    if isinstance(item, Tensor):
        return f"Tensor {tuple(item.shape)}"
    return type(item).__name__


def network_output(
    out: Any, key: OutputKey | None = None, *, first_of_tuple: bool = True
) -> Tensor:
    """The prediction tensor of a network output.

    Parameters
    ----------
    out : Any
        What the network returned.
    key : int, str or callable, optional
        Where the prediction is: ``out[key]`` (an index, or a key of a mapping),
        ``getattr(out, key)``, or ``key(out)``. Without it: a tensor itself, the ``logits`` of a
        Hugging Face ``ModelOutput`` (or a mapping's ``"logits"``), a tuple's first item.
    first_of_tuple : bool
        Read a tuple of several items by its first (a Hugging Face model's ``return_dict=False``
        output, logits first); ``False`` (a plain network) refuses it as ambiguous.
    """
    if key is not None:
        if callable(key):
            value = key(out)
        elif isinstance(key, int) or isinstance(out, Mapping):
            value = out[key]
        else:
            value = getattr(out, key)
        if not isinstance(value, Tensor):
            raise TypeError(
                f"output_key={key!r} selected a {type(value).__name__} from the network's "
                f"{type(out).__name__} output, not the prediction tensor."
            )
        return value
    if isinstance(out, Tensor):
        return out
    logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        if len(out) == 1 or first_of_tuple:
            return out[0]
        items = ", ".join(_describe(item) for item in out)
        raise TypeError(
            f"The network returned a {type(out).__name__} of {len(out)} items ({items}), and "
            "which one is the prediction cannot be told (only a Hugging Face model's tuple is "
            "read by its first item, its logits). Pass FineTuneModel(..., output_key=i) with "
            "the index of the logits (or mean), or a callable taking the output."
        )
    raise TypeError(
        f"Cannot find the prediction in a network output of type {type(out).__name__}; expected "
        "a tensor, an object with `.logits`, or a tuple whose first item is a tensor. Pass "
        "FineTuneModel(..., output_key=...) (an index, a key or attribute name, or a callable) "
        "to say where it is."
    )


class Likelihood:
    """Base class: ``params(output, inputs)`` then ``dist(params)`` with event shape of one target."""

    name: str = "base"
    #: True when the predictive is a probability vector over classes: :func:`pyrobayes.predict`
    #: returns log-probabilities (``Prediction.log_probs``), not means.
    is_classification: bool = True
    #: True when the targets are a 0/1 per label (multi-label classification, :class:`Bernoulli`):
    #: the predictive is then a probability vector over ``{0, 1}`` per label, log-probabilities
    #: ``(..., L, 2)`` (:meth:`class_log_probs`), and an example's log-likelihood the sum over
    #: its labels; the logits are not shift-invariant as a softmax's are.
    multi_label: bool = False

    def network_inputs(self, inputs: Any, net: nn.Module) -> Any:
        """The inputs ``net`` is called with (here: ``inputs``; a likelihood that reads only some
        output positions or reshapes its rows says so here)."""
        return inputs

    def params(self, output: Tensor, inputs: Any) -> Tensor:
        """Likelihood parameters from the network's output on ``inputs`` (the batch as given)."""
        return output

    def rows_per_output(self, inputs: Any) -> int | None:
        """``K`` when each of an example's K outputs is computed from a network row of its own
        (output k of example b from row ``b·K + k`` alone, e.g. one row per choice); ``None``
        when outputs share rows (here). The linearised predictive then forms every output's
        Jacobian in one backward pass."""
        return None

    def dist(self, params: Tensor) -> dist.TorchDistribution:
        raise NotImplementedError

    def log_prob(self, params: Tensor, targets: Tensor) -> Tensor:
        """Pointwise ``log p(y | params)`` with the leading shape of ``params`` (hot path)."""
        return self.dist(params).log_prob(targets)

    def check_targets(self, params: Tensor, targets: Tensor) -> Tensor:
        """``targets`` in the shape ``dist(params)`` scores, or a ``ValueError`` (here: as given)."""
        return targets

    def class_log_probs(self, params: Tensor) -> Tensor:
        """A classifier's log-probabilities from its parameters ``params`` ``(*lead, C)``, in
        float32 at least: the log-softmax over the classes (here). :class:`Bernoulli` returns
        ``(*lead, L, 2)``, ``log (1 − p, p)`` per label."""
        logits = self.dist(params).logits
        return torch.log_softmax(logits, -1, dtype=compute_dtype(logits.dtype))

    def check_params(self, params: Tensor) -> None:
        """Refuse parameters ``params`` (the network's raw outputs as :meth:`params` returns
        them, never their log-softmax) that the likelihood cannot read as its parameters, with a
        ``ValueError`` (here: none is refused). :func:`pyrobayes.predict` runs it on its first
        batch, labelled or not."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name}


def _categorical_log_prob(logits: Tensor, targets: Tensor) -> Tensor:
    # = Categorical(logits=logits).log_prob(targets), without argument validation; in float32
    # at least (a bf16 log-softmax rounds a log-probability to 2^-6 nats near -4)
    log_probs = torch.log_softmax(logits, dim=-1, dtype=compute_dtype(logits.dtype))
    index = targets.long().expand(logits.shape[:-1]).unsqueeze(-1)
    return log_probs.gather(-1, index).squeeze(-1)


#: What to do with a value per class for each example under a one-class-per-example likelihood.
MULTI_LABEL_ADVICE = (
    "For one-hot rows (exactly one 1 per example) pass the class indices, y.argmax(-1); for "
    "multi-label data (a 0/1 per label, any number of 1s per example) pass "
    "likelihood='bernoulli' (one sigmoid per label; the network returns a logit per label)."
)


def check_class_targets(
    targets: Tensor,
    logits_shape: Sequence[int],
    *,
    what: str = "categorical likelihood",
    classes: str = "classes, the last dim of the logits",
    fix: str = "give the network's head as many outputs as there are classes",
) -> Tensor:
    """Class labels checked against logits of shape ``(*lead, B, C)``; ``(B, 1)`` becomes ``(B,)``.

    Labels must be an integer (or bool) tensor of shape ``(B,)``, ``(B, 1)`` or ``(*lead, B)``
    (per-sample labels) with values in ``0 .. C-1``. A float tensor is refused rather than
    truncated (``0.7`` is no class); so are labels out of range and another batch size, and
    ``(B, C)`` labels, a value per class (multi-label targets: :class:`Bernoulli`'s). Explicit
    checks (no ``assert``, no torch argument validation), so they hold under ``python -O``; the
    range costs one reduction and one synchronisation.

    Parameters
    ----------
    targets : Tensor
    logits_shape : sequence of int
        Shape of the logits, ``(*lead, B, C)``.
    what : str
        The likelihood, as named in the messages.
    classes : str
        What the last dim of the logits counts, in the range message.
    fix : str
        The other way out of a label out of range (besides encoding the labels).

    Returns
    -------
    Tensor
        ``targets``, with a trailing unit dim dropped.

    Raises
    ------
    TypeError
        When ``targets`` is not a tensor.
    ValueError
        For a float or complex dtype, a shape that does not match the batch, or a label out of
        range.
    """
    if not isinstance(targets, Tensor):
        raise TypeError(
            f"{what}: labels must be a tensor of class indices, got {type(targets).__name__}."
        )
    out = tuple(int(n) for n in logits_shape)
    if len(out) < 2:
        raise ValueError(
            f"{what}: logits of shape {_shape(out)} have no batch dim before the classes."
        )
    lead, num_classes = out[:-1], out[-1]
    rows = lead[-1]
    shape = tuple(int(n) for n in targets.shape)
    if num_classes > 1 and shape == (rows, num_classes) and shape != lead:
        raise ValueError(
            f"{what}: labels of shape {_shape(shape)} hold a value per class for each of the "
            f"{rows} examples (logits {_shape(out)}): multi-hot (multi-label) targets, or "
            f"one-hot / soft labels; the {what} takes one class index per example. "
            f"{MULTI_LABEL_ADVICE}"
        )
    if targets.is_floating_point() or targets.is_complex():
        raise ValueError(
            f"{what}: labels must be integer class indices (torch.long) in 0..{num_classes - 1} "
            f"but have dtype {targets.dtype}; a float label is not truncated to a class. Pass "
            "integer labels (y.long() only if every value is already a whole number)."
        )
    if shape == (rows, 1):
        targets = targets.squeeze(-1)
    elif shape not in ((rows,), lead):
        if len(shape) >= 2 and shape == lead[-len(shape) :]:  # a label per output position
            raise ValueError(
                f"{what}: labels of shape {_shape(shape)} label every position of the network's "
                f"output (logits {_shape(out)}): a token-classification batch. This likelihood "
                "takes one label per example and the network's output one row of class logits "
                "per example (sequence classification, e.g. BertForSequenceClassification); "
                "per-token labels are not supported."
            )
        if len(shape) == 1 and shape[0] in lead[:-1]:  # the examples sit further left
            per_example = out[lead.index(shape[0]) + 1 :]
            raise ValueError(
                f"{what}: the network returns logits of shape {_shape(out)}, i.e. "
                f"{_shape(per_example)} per example for the {shape[0]} labels: one row of "
                f"{num_classes} class logits per example was expected. An unpooled sequence "
                "output (B, T, C) or a kept unit dim (B, 1, C)? Pool over the positions or "
                "select one (e.g. out[:, 0]), or squeeze the unit dim, so that the network "
                "returns (B, C)."
            )
        raise ValueError(
            f"{what}: labels of shape {_shape(shape)} do not match the batch of {rows} examples "
            f"(logits {_shape(out)}); pass one label per example, shape ({rows},)."
        )
    bad = (targets < 0) | (targets >= num_classes)
    if bool(bad.any()):
        low, high = int(targets.min()), int(targets.max())
        ignored = (
            " -100 is Hugging Face's ignore index (a loss skips it); here every example is "
            "scored: drop those examples."
            if bool((targets == -100).any())
            else ""
        )
        raise ValueError(
            f"{what}: labels must lie in 0..{num_classes - 1} ({num_classes} {classes}) but "
            f"range over {low}..{high} ({int(bad.sum())} of {targets.numel()} out of range). "
            f"Encode the labels as 0..{num_classes - 1}, or {fix}.{ignored}"
        )
    return targets


def check_example_rows(output: Tensor, inputs: Any, owner: str) -> None:
    """Refuse a per-example output whose leading dim is not the batch of one it came from.

    A forward that ends in ``.squeeze()`` drops the batch dim together with the unit dims when
    a batch holds a single example (often a loader's last batch): a ``(1, D)`` output becomes
    ``(D,)`` and would be read as D examples. Only a batch of one is compared (the one case a
    squeeze can change; larger batches' rows are checked against their targets).

    Raises
    ------
    ValueError
        When ``inputs`` hold one example and ``output`` leads with another size.
    """
    if output.dim() == 0 or output.shape[0] == 1:
        return
    try:
        rows = batch_size(inputs)
    except TypeError:  # inputs of no tensor size: nothing to compare with
        return
    if rows == 1:
        raise ValueError(
            f"{owner}: the network returned an output of shape {_shape(output.shape)} for a "
            f"batch of one example, which reads as {output.shape[0]} examples: its forward "
            "probably ends in .squeeze(), which drops the batch dim as well when the batch "
            "holds a single example (often the last batch of a loader). Squeeze only the dims "
            "you mean (.squeeze(-1) for a (B, 1) output), or return the (B, ...) output."
        )


def check_not_probabilities(logits: Tensor, owner: str) -> None:
    """Refuse class "logits" that are probabilities: every row non-negative and summing to 1.

    A network whose head ends in ``nn.Softmax`` returns probabilities; the likelihood applies
    the softmax again, which squeezes every prediction towards uniform (with 2 classes the top
    probability can never exceed ``e/(1 + e) ≈ .73``) while the accuracy stays the same: fits
    and metrics run, and only the NLL and calibration are wrong. Log-probabilities
    (``log_softmax``) are logits up to a constant and pass. ``Categorical.check_targets`` runs
    it on the first labelled batch its likelihood sees: a network returns probabilities by
    construction, so once suffices and no step pays for it; :func:`pyrobayes.predict` runs it
    (``Categorical.check_params``) on the raw outputs of its first batch, labelled or not.

    Raises
    ------
    ValueError
        When ``logits`` has at least 2 classes and every row is a probability vector.
    """
    if logits.dim() < 2 or logits.shape[-1] < 2 or logits.numel() == 0:
        return
    detached = logits.detach()
    rows_sum = detached.sum(-1)
    # a float32 (float64) softmax row sums to 1 within about C·1.2e-7 (C·2.2e-16), its unit
    # roundoff per addend: 1e-4·C leaves a wide margin; half-precision rows may escape the test
    looks = (detached.min() >= 0) & ((rows_sum - 1).abs().max() <= 1e-4 * logits.shape[-1])
    if bool(looks):
        raise ValueError(
            f"{owner}: the network's outputs are probabilities (every row of its "
            f"{logits.shape[-1]} class scores is non-negative and sums to 1), but the "
            "likelihood reads logits and applies the softmax itself, so it would be applied "
            "twice and every prediction squeezed towards uniform. Remove the final "
            "nn.Softmax from the network (or return log_softmax, which reads as logits)."
        )


class Categorical(Likelihood):
    """``y ~ Categorical(softmax(f(x; θ)))``; labels are checked (:func:`check_class_targets`)."""

    name = "categorical"
    #: whether :func:`check_not_probabilities` has seen this likelihood's outputs (once suffices)
    _outputs_checked: bool = False

    def params(self, output: Tensor, inputs: Any) -> Tensor:
        check_example_rows(output, inputs, "Categorical likelihood")
        return output

    def dist(self, params: Tensor) -> dist.TorchDistribution:
        return dist.Categorical(logits=params)

    def check_params(self, params: Tensor) -> None:
        """:func:`check_not_probabilities` on the logits ``params`` ``(*lead, B, C)``, the
        network's own (a log-softmax of probabilities passes as logits: pass the raw outputs).
        Once they pass, :meth:`check_targets` checks them no more."""
        check_not_probabilities(params, "Categorical likelihood")
        self._outputs_checked = True  # probabilities come from the network's structure

    def check_targets(self, params: Tensor, targets: Tensor) -> Tensor:
        """:func:`check_class_targets` against the logits ``params`` ``(*lead, B, C)``, which
        must not be probabilities already (:meth:`check_params`, on the first call: ``params``
        are the network's logits, not their log-softmax)."""
        if not self._outputs_checked:
            self.check_params(params)
        if params.dim() >= 1 and params.shape[-1] == 1:
            raise ValueError(
                "Categorical likelihood: the network returns one logit per example, and a "
                "softmax over one class is always 1 (nothing to learn, no uncertainty). Give "
                "the head one output per class (2 for a binary task), or use a Gaussian "
                "likelihood for a real-valued target."
            )
        return check_class_targets(targets, params.shape)

    def log_prob(self, params: Tensor, targets: Tensor) -> Tensor:
        return _categorical_log_prob(params, self.check_targets(params, targets))


def _bernoulli_log_prob(logits: Tensor, targets: Tensor) -> Tensor:
    """``Σ_l log p(y_l | z_l)`` per example: ``−BCEWithLogits`` summed over the labels, in
    float32 at least (as :func:`_categorical_log_prob`)."""
    dtype = compute_dtype(logits.dtype)
    z = logits.to(dtype)
    y = targets.to(dtype).expand(z.shape)
    return -F.binary_cross_entropy_with_logits(z, y, reduction="none").sum(-1)


def bernoulli_log_probs(logits: Tensor) -> Tensor:
    """``log (1 − σ(z), σ(z))`` ``(*lead, L, 2)`` of per-label logits ``z`` ``(*lead, L)``, in
    float32 at least: a softmax over ``(0, z)`` per label, so a temperature divides both by
    ``T`` and ``log p(1) − log p(0) = z`` holds exactly (no ``log(1 − p)`` from a rounded
    ``p``)."""
    z = logits.to(compute_dtype(logits.dtype))
    return torch.stack((F.logsigmoid(-z), F.logsigmoid(z)), -1)


def logits_log_probs(logits: Tensor, multi_label: bool) -> Tensor:
    """Log-probabilities of a classifier's logits: ``log_softmax`` over the last axis, or with
    ``multi_label`` per-label :func:`bernoulli_log_probs` ``(..., L, 2)`` (a linearised
    predictive's draws or probit-scaled logits)."""
    return bernoulli_log_probs(logits) if multi_label else torch.log_softmax(logits, -1)


def check_binary_targets(
    targets: Tensor, logits_shape: Sequence[int], *, what: str = "Bernoulli likelihood"
) -> Tensor:
    """Multi-label targets checked against per-label logits of shape ``(*lead, B, L)``.

    Targets are a 0/1 per label and example, shape ``(B, L)`` (or the full ``(*lead, B, L)``,
    per-sample targets), of a float, integer or bool dtype; ``(B,)`` is taken for ``L = 1``.
    Values other than 0 and 1 (a soft label, a class index, -100, NaN) are refused: one
    reduction and one synchronisation, as :func:`check_class_targets`' range check.

    Parameters
    ----------
    targets : Tensor
    logits_shape : sequence of int
        Shape of the logits, ``(*lead, B, L)``.
    what : str
        The likelihood (or function), as named in the messages.

    Returns
    -------
    Tensor
        ``targets`` in the logits' per-example shape (a ``(B,)`` for one label as ``(B, 1)``),
        their dtype kept.

    Raises
    ------
    TypeError
        When ``targets`` is not a tensor.
    ValueError
        For a complex dtype, a shape that does not match the logits (both named), or a value
        other than 0 and 1.
    """
    if not isinstance(targets, Tensor):
        raise TypeError(f"{what}: targets must be a tensor of 0/1 labels, got {type(targets)}.")
    out = tuple(int(n) for n in logits_shape)
    if len(out) < 2:
        raise ValueError(
            f"{what}: logits of shape {_shape(out)} have no batch dim before the labels; the "
            "network must return one logit per label, (B, L)."
        )
    per_batch = out[-2:]
    shape = tuple(int(n) for n in targets.shape)
    if shape == (per_batch[0],) and per_batch[1] == 1:
        targets = targets.unsqueeze(-1)
    elif shape not in (per_batch, out):
        hint = (
            " Class indices (one per example) belong to likelihood='categorical'."
            if shape == (per_batch[0],)
            else ""
        )
        raise ValueError(
            f"{what}: targets of shape {_shape(shape)} do not match the logits {_shape(out)}, "
            f"one logit per label for {per_batch[0]} examples and {per_batch[1]} labels; pass "
            f"targets of shape {_shape(per_batch)}, a 0/1 per example and label.{hint}"
        )
    if targets.is_complex():
        raise ValueError(f"{what}: targets have dtype {targets.dtype}; pass 0/1 labels.")
    if targets.dtype != torch.bool:
        bad = (targets != 0) & (targets != 1)  # NaN is neither
        if bool(bad.any()):
            raise ValueError(
                f"{what}: targets must be 0 or 1 (a 0/1 per label) but hold "
                f"{int(bad.sum())} other values of {targets.numel()} (examples "
                f"{flagged_examples(bad, bad.dim() - 2)}). Soft "
                "labels, NaN or -100 (Hugging Face's ignore index) are not taken: binarise "
                "the labels (y > 0.5), or drop those examples."
            )
    return targets


class Bernoulli(Likelihood):
    r"""Multi-label classification: ``y_l ~ Bernoulli(σ(f_l(x; θ)))`` independently per label.

    The network returns one logit per label, ``(B, L)``; targets are a 0/1 per label ``(B, L)``
    (float, integer or bool; :func:`check_binary_targets`). An example's log-likelihood is the
    joint over its labels, ``Σ_l [y_l log σ(f_l) + (1 − y_l) log σ(−f_l)]`` (minus
    ``BCEWithLogits`` summed over the labels), so the data plate stays over examples.

    It is a classifier (:attr:`is_classification`: :func:`pyrobayes.predict` returns
    log-probabilities) with :attr:`multi_label` set: the predictive is a distribution over
    ``{0, 1}`` per label, ``log_probs`` of shape ``(S, N, L, 2)`` holding
    ``log (1 − p, p)`` (:meth:`class_log_probs`), and its metrics are the multi-label ones
    (:func:`pyrobayes.metrics.multilabel_report`). Also known as ``"multilabel"``.
    """

    name = "bernoulli"
    multi_label = True

    def params(self, output: Tensor, inputs: Any) -> Tensor:
        check_example_rows(output, inputs, "Bernoulli likelihood")
        if output.dim() < 2:
            raise ValueError(
                f"Bernoulli likelihood: the network returned an output of shape "
                f"{_shape(output.shape)}; it must return one logit per label, (B, L) (a (B, 1) "
                "output for a single binary label)."
            )
        return output

    def dist(self, params: Tensor) -> dist.TorchDistribution:
        return dist.Bernoulli(logits=params).to_event(1)

    def class_log_probs(self, params: Tensor) -> Tensor:
        """``log (1 − p, p)`` per label, ``(*lead, L, 2)`` (:func:`bernoulli_log_probs`)."""
        return bernoulli_log_probs(params)

    def check_targets(self, params: Tensor, targets: Tensor) -> Tensor:
        """:func:`check_binary_targets` against the logits ``params`` ``(*lead, B, L)``."""
        return check_binary_targets(targets, params.shape)

    def log_prob(self, params: Tensor, targets: Tensor) -> Tensor:
        return _bernoulli_log_prob(params, self.check_targets(params, targets))


def _shape(shape: Sequence[int]) -> str:
    return str(tuple(int(n) for n in shape))


def check_gaussian_targets(
    targets: Tensor,
    output_shape: Sequence[int],
    event_dim: int | None = None,
    *,
    what: str = "network output",
    finite: bool = True,
) -> Tensor:
    """Targets of a Gaussian likelihood checked against its means; ``(B, 1)`` becomes ``(B,)``.

    The means have shape ``(*lead, B, *event)`` with ``event_dim`` trailing event dims (default:
    ``len(output_shape) - 1``, no leading sample dims). Accepted targets:

    - ``(B, *event)``, one target per example;
    - ``(B,)`` or ``(B, 1)`` for a scalar output (``event`` empty), treated identically;
    - the full shape of the means (per-sample targets, e.g. draws from the likelihood).

    Anything else (``(B, 2)`` targets for a scalar output, ``(B,)`` for a vector output, another
    batch size) raises a ``ValueError`` that names both shapes and the shape to pass. So do bool
    and complex targets (a Gaussian models real numbers; torch cannot subtract a bool tensor)
    and, with ``finite``, NaN or ±inf targets (their log-density, RMSE and NLL would be NaN, and
    torch's own check names no target): held-out data reaches this check in
    :func:`pyrobayes.predict`, the metrics, :func:`pyrobayes.calibrate` and the ArviZ export, which
    the training batches' check (``pyrobayes.infer.objectives``) does not cover.

    Parameters
    ----------
    targets : Tensor
    output_shape : sequence of int
        Shape of the means, ``(*lead, B, *event)``.
    event_dim : int, optional
        Number of event dims of the output.
    what : str
        What the means are called in the error message.
    finite : bool
        Refuse NaN and ±inf targets (one reduction and one synchronisation). ``False`` where the
        targets were checked already: :meth:`Gaussian.log_prob`, the training hot path, whose
        batches ``pyrobayes.infer.objectives.split_training_batch`` checks.

    Returns
    -------
    Tensor
        ``targets``, with a trailing unit dim dropped for a scalar output.

    Raises
    ------
    TypeError
        When ``targets`` is not a tensor.
    ValueError
        For a bool or complex dtype, a shape that does not match the means, or (``finite``) a
        NaN or ±inf target.
    """
    if not isinstance(targets, Tensor):
        raise TypeError(f"Gaussian likelihood: targets must be a tensor, got {type(targets)}.")
    if targets.dtype == torch.bool or targets.is_complex():
        raise ValueError(
            f"Gaussian likelihood: targets have dtype {targets.dtype}, but the Gaussian "
            "likelihood models real-valued targets. For binary labels use a classifier "
            "(likelihood='categorical' with two outputs, labels y.long()); for 0/1 regression "
            "targets pass y.float() (or y.to(the network's dtype))."
        )
    out = tuple(int(n) for n in output_shape)
    event_dim = len(out) - 1 if event_dim is None else int(event_dim)
    if event_dim < 0 or len(out) < event_dim + 1:
        raise ValueError(
            f"Gaussian likelihood: the {what} of shape {_shape(out)} has no batch dim before "
            f"its {event_dim} event dim(s)."
        )
    per_batch = out[len(out) - event_dim - 1 :]  # (B, *event)
    shape = tuple(int(n) for n in targets.shape)
    if shape in (per_batch, out):
        batch_dim = 0 if shape == per_batch else len(out) - event_dim - 1
    elif not event_dim and shape == (*per_batch, 1):
        targets, batch_dim = targets.squeeze(-1), 0
    else:
        rows = per_batch[0]
        if event_dim:
            expected = f"{_shape(per_batch)}"
            output = f"the {what} of shape {_shape(per_batch)}"
        else:
            expected = f"({rows},) or ({rows}, 1)"
            output = f"the {what}, one scalar per example for {rows} examples (shape {expected})"
        raise ValueError(
            f"Gaussian likelihood: targets of shape {_shape(shape)} do not match {output}; pass "
            f"targets of shape {expected}.{_one_target_hint(shape, per_batch)}"
        )
    if finite and targets.is_floating_point() and not bool(targets.isfinite().all()):
        _raise_non_finite(targets, batch_dim)
    return targets


def _one_target_hint(shape: tuple[int, ...], per_batch: tuple[int, ...]) -> str:
    """What a ``(B, D)`` output met with one scalar target per example (``shape`` ``(B,)`` or
    ``(B, 1)``) is read as: D means, not a mean and a scale (the likelihood's σ is one number,
    so a network that predicts its own, heteroscedastic regression, is not supported); ``""``
    for other shapes."""
    if len(per_batch) != 2 or shape not in ((per_batch[0],), (per_batch[0], 1)):
        return ""
    return (
        f" The Gaussian likelihood reads the output's {per_batch[1]} columns as the means of a "
        f"{per_batch[1]}-vector target, with one σ for every example (obs_scale, fixed or "
        "'learn'): a scale predicted by the network (heteroscedastic regression, a (mean, "
        "log σ) pair per example) is not supported. For one scalar target per example, return "
        "a (B, 1) or (B,) output."
    )


def _raise_non_finite(targets: Tensor, batch_dim: int) -> NoReturn:
    """The ``ValueError`` for NaN or ±inf ``targets``, naming the examples (along ``batch_dim``)."""
    raise ValueError(
        f"Gaussian likelihood: targets hold non-finite values ({int(targets.isnan().sum())} "
        f"NaN, {int(targets.isinf().sum())} inf of {targets.numel()}) at examples "
        f"{flagged_examples(~targets.isfinite(), batch_dim)} (of {targets.shape[batch_dim]}): "
        "their log-likelihood, RMSE and NLL would be NaN. This is a data problem: drop those "
        "examples (keep the rows where torch.isfinite(y) holds) or fill them in before "
        "predicting, evaluating or calibrating."
    )


def _softplus_inverse(value: float) -> float:
    """``ρ`` with ``softplus(ρ) = value`` (``value > 0``), stable for large values."""
    return value + math.log(-math.expm1(-value))


class Gaussian(Likelihood):
    r"""``y ~ N(f(x; θ), σ²)``, σ fixed (``obs_scale``) or learned (``obs_scale="learn"``).

    A ``(B, 1)`` or ``(B,)`` output predicts a scalar target (targets ``(B,)`` or ``(B, 1)``); a
    ``(B, D)`` output a D-vector target ``(B, D)`` (the D outputs form one event, so the data
    plate stays over examples). Other target shapes raise (:func:`check_gaussian_targets`).

    Learned noise: :math:`σ = \operatorname{softplus}(ρ)` with ``ρ`` an unconstrained point
    parameter (:attr:`raw_scale`, starting at ``σ = init_scale``) that the model trains with its
    other point parameters. :attr:`obs_scale` is then the current value of σ.

    Parameters
    ----------
    obs_scale : float or "learn"
        σ, or ``"learn"``.
    init_scale : float
        Initial σ when learned.
    """

    name = "gaussian"
    is_classification = False

    def __init__(self, obs_scale: float | str = 1.0, *, init_scale: float = 1.0) -> None:
        #: ``ρ`` of a learned ``σ = softplus(ρ)`` (a 0-dim parameter), or ``None`` for a fixed σ.
        self.raw_scale: nn.Parameter | None = None
        if isinstance(obs_scale, str):
            if obs_scale != "learn":
                raise ValueError(
                    f"Gaussian likelihood: obs_scale must be a finite number > 0 or 'learn'; got "
                    f"{obs_scale!r}."
                )
            init = check_real("init_scale", init_scale, gt=0, owner="Gaussian likelihood: ")
            self.raw_scale = nn.Parameter(torch.tensor(_softplus_inverse(init)))
            self._fixed_scale = init
        else:
            self._fixed_scale = check_real(
                "obs_scale", obs_scale, gt=0, owner="Gaussian likelihood: "
            )
        self.event_dim = 0

    def check_target_scale(self, targets: Any) -> None:
        """Warn when a learned noise starts far from the targets' scale (first batch).

        ``σ = softplus(ρ)`` moves by about the learning rate per step in ``ρ``, so from
        ``init_scale = 1`` it takes thousands of Adam steps to reach targets in the hundreds
        (the NLL is ``r²/2σ²`` meanwhile, and the fit follows it, not the data's noise).
        """
        if self.raw_scale is None or not isinstance(targets, Tensor):
            return
        if not targets.is_floating_point() or targets.numel() < 2:
            return
        spread = float(targets.detach().double().std())
        start = self.obs_scale
        if not math.isfinite(spread) or spread == 0 or 1 / 30 <= spread / start <= 30:
            return
        warnings.warn(
            f"Gaussian likelihood: the targets' standard deviation on the first batch is "
            f"{spread:.3g}, but the learned noise starts at σ = {start:.3g}; σ = softplus(ρ) "
            "moves by about the learning rate per step, so it may not reach the targets' "
            "scale within the fit (the NLL is r²/2σ² meanwhile). Standardize the targets "
            "((y − mean) / sd, undone after predict), or start σ near their scale: "
            f"likelihood=pb.models.Gaussian('learn', init_scale={spread:.3g}).",
            UserWarning,
            stacklevel=user_stacklevel(),
        )

    @property
    def learned(self) -> bool:
        """Whether σ is learned (``obs_scale="learn"``)."""
        return self.raw_scale is not None

    @property
    def obs_scale(self) -> float:
        """The current σ (for a learned σ, ``softplus(ρ)`` now, as a float)."""
        if self.raw_scale is None:
            return self._fixed_scale
        return float(F.softplus(self.raw_scale.detach()))

    def scale(self, raw_scale: Tensor | None = None) -> Tensor | float:
        """σ: the fixed float, or ``softplus(ρ)`` as a tensor differentiable in ``ρ``.

        ``raw_scale`` replaces :attr:`raw_scale` (the Pyro program's param-store value).
        """
        if self.raw_scale is None:
            return self._fixed_scale
        return F.softplus(self.raw_scale if raw_scale is None else raw_scale)

    def params(self, output: Tensor, inputs: Any) -> Tensor:
        if output.dim() == 0:
            raise ValueError(
                "Gaussian likelihood: the network returned a 0-dim output (one number, no "
                "batch dim) for a batch of one example: its forward probably ends in "
                ".squeeze(), which drops the batch dim as well when the batch holds a single "
                "example (often the last batch of a loader). Squeeze the output dim only "
                "(.squeeze(-1)), or return the (B, 1) output: the likelihood takes (B, 1) and "
                "(B,) alike."
            )
        check_example_rows(output, inputs, "Gaussian likelihood")
        if output.dim() == 2 and output.shape[-1] == 1:
            output = output.squeeze(-1)
        # output is (rows, *event): every dim after the leading row dim is part of one target
        self.event_dim = output.dim() - 1
        return output

    def check_targets(self, params: Tensor, targets: Tensor) -> Tensor:
        """:func:`check_gaussian_targets` against ``params`` ``(*lead, B, *event)``: the shape,
        the dtype (no bool) and finite values."""
        return check_gaussian_targets(targets, params.shape, self.event_dim)

    def dist(self, params: Tensor, raw_scale: Tensor | None = None) -> dist.TorchDistribution:
        d = dist.Normal(params, self.scale(raw_scale))
        return d.to_event(self.event_dim) if self.event_dim else d

    def log_prob(self, params: Tensor, targets: Tensor) -> Tensor:
        # the shape and dtype checks cost no synchronisation; the finiteness check (one) is the
        # training batch's (split_training_batch) on this hot path, and check_targets' elsewhere
        targets = check_gaussian_targets(targets, params.shape, self.event_dim, finite=False)
        scale = self.scale()
        log_scale = torch.log(scale) if isinstance(scale, Tensor) else math.log(scale)
        z = (targets - params) / scale
        lp = -0.5 * z.pow(2) - log_scale - 0.5 * math.log(2 * math.pi)
        return lp.flatten(-self.event_dim).sum(-1) if self.event_dim else lp

    def to_dict(self) -> dict[str, Any]:
        if self.raw_scale is None:
            return {"name": self.name, "obs_scale": self.obs_scale}
        return {"name": self.name, "obs_scale": "learn", "current_scale": self.obs_scale}


class MultipleChoice(Likelihood):
    r"""Causal-LM multiple choice: choices scored as continuations, or as single answer tokens.

    Continuations (``choice_token_ids=None``): the batch holds one row per (example, choice),
    ``input_ids`` / ``attention_mask`` / ``continuation_mask`` of shape ``(B, K, L)``
    (:func:`~pyrobayes.models.encode_multiple_choice`), and

    .. math::

        y_b \sim \operatorname{Categorical}(\operatorname{softmax}_k s_{bk}), \qquad
        s_{bk} = \frac{1}{n_{bk}} \sum_{t \in c_{bk}} \log p_θ(x_{bkt} \mid x_{bk,<t}),

    the summed log-probability of choice k's continuation tokens given the prompt, divided by
    ``n = 1`` (``normalize="none"``), its token count (``"length"``) or its characters
    (``"chars"``, lm-evaluation-harness's ``acc_norm``; Gao et al. 2021).

    Single answer tokens (``choice_token_ids=[...]``), the special case of one-token
    continuations listed in the prompt: ``y_b ~ Categorical(softmax(logits[b, t_b, ids]))``
    where ``t_b`` is the last non-padding position of example b (from ``attention_mask``).

    Either way the network's output head runs only at the positions read (``logits_to_keep``
    of a Hugging Face causal LM); other networks return every position and the likelihood
    gathers them.

    Parameters
    ----------
    choice_token_ids : list of int, optional
        One token per choice; ``None`` scores continuations.
    normalize : {"none", "length", "chars"}
        Normalisation of the continuation scores.
    """

    name = "multiple_choice"
    #: Whether a ``choice_token_ids`` batch on a device has passed :meth:`_refuse_empty_rows`
    #: (later device batches are not checked: each check reads the mask on the host).
    _checked_on_device: bool = False

    def __init__(
        self, choice_token_ids: Sequence[int] | None = None, *, normalize: str = "none"
    ) -> None:
        if normalize not in NORMALIZATIONS:
            raise ValueError(
                f"multiple_choice likelihood: normalize must be one of {list(NORMALIZATIONS)}, "
                f"got {normalize!r}."
            )
        self.normalize = normalize
        self.choice_token_ids: list[int] | None = None
        if choice_token_ids is None:
            return
        if normalize != "none":
            raise ValueError(
                "multiple_choice likelihood: normalize applies to continuations; with "
                "choice_token_ids each choice is one token, so leave normalize='none'."
            )
        if len(choice_token_ids) < 2:
            raise ValueError(
                f"Expected at least 2 choice_token_ids but got {list(choice_token_ids)}."
            )
        ids = [
            check_int("choice_token_ids[]", t, ge=0, owner="multiple_choice likelihood: ")
            for t in choice_token_ids
        ]
        if len(set(ids)) != len(ids):
            raise ValueError(
                f"multiple_choice likelihood: choice_token_ids {ids} repeat a token; each choice "
                "needs a token of its own."
            )
        self.choice_token_ids = ids

    @property
    def continuations(self) -> bool:
        """Whether choices are scored as continuations (no ``choice_token_ids``)."""
        return self.choice_token_ids is None

    def _read_positions(self, inputs: Any) -> tuple[Tensor, Tensor | None, int]:
        """Positions the head reads ``(R, P)``, the continuation slots' validity and ``L``."""
        if not isinstance(inputs, Mapping) or not isinstance(inputs.get("input_ids"), Tensor):
            raise ValueError(
                "likelihood='multiple_choice' needs dict batches with 'input_ids' (a causal LM's "
                f"inputs); got {type(inputs).__name__}."
            )
        ids = inputs["input_ids"]
        length = int(ids.shape[-1])
        if self.continuations:
            cmask = inputs.get("continuation_mask")
            if ids.dim() != 3 or not isinstance(cmask, Tensor) or cmask.shape != ids.shape:
                raise ValueError(
                    "multiple_choice likelihood (continuations): the batch needs 'input_ids', "
                    "'attention_mask' and 'continuation_mask' of shape (B, K, L); got input_ids "
                    f"{tuple(ids.shape)} and continuation_mask "
                    f"{None if not isinstance(cmask, Tensor) else tuple(cmask.shape)}. Build it "
                    "with pyrobayes.models.encode_multiple_choice, or pass choice_token_ids for "
                    "single-token answers."
                )
            if int(ids.shape[1]) < 2:
                raise ValueError(
                    f"multiple_choice likelihood (continuations): input_ids {tuple(ids.shape)} "
                    "hold K = 1 choice per example; a softmax over one choice is always 1 "
                    "(nothing to learn, no uncertainty). Give each example its K >= 2 choices "
                    "(encode_multiple_choice), or use the scores of one continuation directly."
                )
            attention, choices = _scoring_masks(inputs, ids, self.normalize == "chars")
            positions, valid = continuation_targets(cmask.reshape(-1, length), attention, choices)
            return positions - 1, valid, length
        if ids.dim() != 2:
            raise ValueError(
                "multiple_choice likelihood (choice_token_ids): expects input_ids (B, L) but got "
                f"{tuple(ids.shape)}; for (B, K, L) continuation batches leave choice_token_ids "
                "unset."
            )
        rows = int(ids.shape[0])
        mask = inputs.get("attention_mask")
        mask = mask if isinstance(mask, Tensor) else None
        if mask is not None and (mask.device.type == "cpu" or not self._checked_on_device):
            self._refuse_empty_rows(mask.reshape(rows, length))
        last = last_positions(mask, rows, length, ids.device)
        return last.unsqueeze(-1), None, length

    def _refuse_empty_rows(self, mask: Tensor) -> None:
        """Refuse rows of a ``(B, L)`` ``attention_mask`` without a real token: the last real
        position of such a row is undefined, so :func:`last_positions` would read the answer at
        its last position, a padding token.

        A CPU mask is checked on every forward (no synchronisation); a mask on a device once,
        on the first batch this likelihood sees there that passes (one synchronisation, not one
        per step)."""
        empty = ~mask.bool().any(-1)
        if not bool(empty.any()):  # on a device: the one synchronisation
            self._checked_on_device |= mask.device.type != "cpu"
            return
        raise ValueError(
            f"multiple_choice likelihood (choice_token_ids={self.choice_token_ids}): the "
            f"attention_mask of examples {flagged_examples(empty)} (of {empty.shape[0]}) is all "
            "zeros, so their answer tokens would be read at a padding position. Give each "
            "example at least one real token (an empty prompt encodes to none with a tokenizer "
            "that adds no BOS token; a max_length truncation must leave the prompt a token), or "
            "drop those examples."
        )

    def rows_per_output(self, inputs: Any) -> int | None:
        """``K`` for continuations (choice k of example b is scored on row ``b·K + k`` alone)."""
        if self.continuations and isinstance(inputs, Mapping):
            ids = inputs.get("input_ids")
            if isinstance(ids, Tensor) and ids.dim() == 3:
                return int(ids.shape[1])
        return None

    def check_positions(self, inputs: Any, net: nn.Module) -> None:
        """Refuse rows longer than the network's position table (``max_position_embeddings`` /
        ``n_positions`` of its config): learned positions fail inside torch (an index out of
        range), rotary ones extrapolate silently past the context the model was trained on."""
        config = getattr(net, "config", None)
        limit = getattr(config, "max_position_embeddings", None) or getattr(
            config, "n_positions", None
        )
        ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
        if not isinstance(limit, int) or not isinstance(ids, Tensor) or ids.shape[-1] <= limit:
            return
        positions = inputs.get("position_ids")
        longest = int(positions.max()) + 1 if isinstance(positions, Tensor) else int(ids.shape[-1])
        if longest > limit:
            raise ValueError(
                f"MultipleChoice likelihood: rows of {longest} token positions exceed the "
                f"network's {limit} (its config's max_position_embeddings / n_positions). "
                "Shorten the prompts, or pass max_length=... to encode_multiple_choice (which "
                "truncates each prompt from the left and keeps the choice)."
            )

    def network_inputs(self, inputs: Any, net: nn.Module) -> Any:
        """``(B, K, L)`` rows flattened to ``(B·K, L)``, the scoring keys dropped, and the
        positions the likelihood reads passed as ``logits_to_keep`` when ``net`` takes them."""
        read, _, length = self._read_positions(inputs)
        flat = flatten_choices(inputs)[0] if self.continuations else dict(inputs)
        if accepts_argument(net, "use_cache"):
            flat["use_cache"] = False  # one forward: no key/value cache to build
        if read.shape[1] < length and head_positions_supported(net):
            flat["logits_to_keep"] = read
        # float64 eager attention would turn left padding into NaN at the real tokens
        mask = eager_attention_mask(net, flat.get("attention_mask"))
        if mask is not None:
            flat["attention_mask"] = mask
        return flat

    def params(self, output: Tensor | TokenLogProbs, inputs: Any) -> Tensor:
        read, valid, length = self._read_positions(inputs)
        rows = read.shape[0]
        token_log_probs = None
        if isinstance(output, TokenLogProbs):  # models.sharing: the head ran on the tokens only
            token_log_probs, output = output.values, output.values.unsqueeze(-1)
        if output.dim() != 3 or output.shape[0] != rows:
            raise ValueError(
                "likelihood='multiple_choice' expects causal-LM logits (rows, positions, vocab) "
                f"with {rows} rows but got shape {tuple(output.shape)}."
            )
        if output.shape[1] == length and read.shape[1] < length:  # the full head: gather
            output = torch.take_along_dim(output, read.unsqueeze(-1), dim=1)
        elif output.shape[1] != read.shape[1]:
            raise ValueError(
                f"likelihood='multiple_choice': the network returned {output.shape[1]} positions; "
                f"expected {length} (all) or {read.shape[1]} (the positions read)."
            )
        if valid is None:
            token_ids = self.choice_token_ids or []
            ids = torch.as_tensor(token_ids, device=output.device)
            if max(token_ids) >= output.shape[-1]:
                raise ValueError(
                    f"MultipleChoice(choice_token_ids={token_ids}): the network "
                    f"scores {output.shape[-1]} tokens, so id {max(token_ids)} is "
                    "no token of its vocabulary. Take the ids from the model's own tokenizer "
                    "(tokenizer.convert_tokens_to_ids)."
                )
            return output[:, 0, ids]  # (B, num_choices)
        ids = inputs["input_ids"]
        chars = inputs.get("continuation_chars")
        scores = continuation_scores(
            output,
            ids.reshape(-1, length),
            read + 1,
            valid,
            normalize=self.normalize,
            chars=chars.reshape(-1) if isinstance(chars, Tensor) else None,
            token_log_probs=token_log_probs,
        )
        scores = scores.reshape(ids.shape[0], ids.shape[1])  # (B, K)
        present = inputs.get("choice_mask")  # ragged batches: padded choices score -inf
        if isinstance(present, Tensor):
            scores = scores.masked_fill(present.to(scores.device) == 0, float("-inf"))
        return scores

    def dist(self, params: Tensor) -> dist.TorchDistribution:
        return dist.Categorical(logits=params)

    def check_targets(self, params: Tensor, targets: Tensor) -> Tensor:
        """:func:`check_class_targets`: a label indexes the choices (not the vocabulary), and
        must not point at a choice scored ``-inf`` (:func:`check_labelled_choices`: a padded
        choice of a ragged batch)."""
        if self.choice_token_ids is None:
            what = "multiple_choice likelihood (continuations)"
            classes = "choices, the K rows of each example"
            fix = "give each example as many choices as its largest label + 1"
        else:
            what = f"multiple_choice likelihood (choice_token_ids={self.choice_token_ids})"
            classes = "choices, one per entry of choice_token_ids"
            fix = "add a token to choice_token_ids for each choice"
        labels = check_class_targets(targets, params.shape, what=what, classes=classes, fix=fix)
        check_labelled_choices(params, labels, what)
        return labels

    def log_prob(self, params: Tensor, targets: Tensor) -> Tensor:
        return _categorical_log_prob(params, self.check_targets(params, targets))

    def to_dict(self) -> dict[str, Any]:
        if self.choice_token_ids is None:
            return {"name": self.name, "normalize": self.normalize}
        return {"name": self.name, "choice_token_ids": self.choice_token_ids}


def _scoring_masks(
    inputs: Mapping[str, Any], ids: Tensor, chars: bool
) -> tuple[Tensor | None, Tensor | None]:
    """The ``attention_mask`` ``(B, K, L)`` (``None`` when absent or of another layout, e.g. a
    4D mask) and the ``choice_mask`` ``(B, K)`` of a continuation batch; ``choice_mask`` and
    (``chars``: ``normalize="chars"``) ``continuation_chars`` are checked for their shapes (no
    synchronisation)."""
    what = "multiple_choice likelihood (continuations)"
    rows, k_choices = int(ids.shape[0]), int(ids.shape[1])
    attention = inputs.get("attention_mask")
    if not isinstance(attention, Tensor) or attention.shape != ids.shape:
        attention = None
    choices = inputs.get("choice_mask")
    if choices is not None and (
        not isinstance(choices, Tensor) or tuple(choices.shape) != (rows, k_choices)
    ):
        shape = tuple(choices.shape) if isinstance(choices, Tensor) else type(choices).__name__
        raise ValueError(
            f"{what}: choice_mask must be a (B, K) = {(rows, k_choices)} tensor (1 on each "
            f"example's real choices) but is {shape}; a mask of another shape would be "
            "broadcast over the wrong choices. encode_multiple_choice(..., ragged=True) builds it."
        )
    counts = inputs.get("continuation_chars") if chars else None
    if isinstance(counts, Tensor) and counts.numel() != rows * k_choices:
        raise ValueError(
            f"{what}: continuation_chars must hold the characters of each of the "
            f"{rows} x {k_choices} choices, shape (B, K) = {(rows, k_choices)}, but has shape "
            f"{tuple(counts.shape)}; encode_multiple_choice adds it."
        )
    return attention, choices


def check_labelled_choices(scores: Tensor, labels: Tensor, what: str) -> None:
    """Refuse labels that point at a choice scored ``-inf``: a padded choice of a ragged batch
    (``choice_mask`` 0, which :meth:`MultipleChoice.params` scores ``-inf``), or a choice the
    network gives probability 0. Its log-likelihood is ``-inf``: an infinite NLL in
    :func:`pyrobayes.predict`'s metrics and a non-finite loss (blamed on the learning rate) in
    a fit.

    Parameters
    ----------
    scores : Tensor
        Choice scores ``(*lead, B, K)``.
    labels : Tensor
        Checked labels ``(B,)`` or ``(*lead, B)`` in ``0 .. K-1``
        (:func:`check_class_targets`).
    what : str
        The likelihood, as the message names it.

    Raises
    ------
    ValueError
        Naming the examples (the first 8) whose labelled choice scores ``-inf``.
    """
    if scores.numel() == 0 or not scores.is_floating_point():
        return
    index = labels.long().expand(scores.shape[:-1]).unsqueeze(-1)
    chosen = scores.detach().gather(-1, index).squeeze(-1)  # (*lead, B)
    masked = chosen == float("-inf")
    if not bool(masked.any()):
        return
    example_dim = chosen.dim() - 1
    raise ValueError(
        f"{what}: the labels of examples {flagged_examples(masked, example_dim)} (of "
        f"{chosen.shape[-1]}) point at a choice scored -inf: a padded choice (choice_mask 0 in "
        "a ragged batch, past the example's own choices) or one the network gives probability "
        "0. Their NLL would be infinite (and a fit's loss not finite). Give each example a "
        "label among its own choices (encode_multiple_choice's answers= index each example's "
        "choice list), or drop those examples."
    )


def make_likelihood(spec: str | Likelihood, **kwargs: Any) -> Likelihood:
    """Resolve ``"categorical"``, ``"gaussian"``, ``"multiple_choice"`` or ``"bernoulli"``
    (multi-label classification) (or pass an instance)."""
    if isinstance(spec, Likelihood):
        return spec
    table: dict[str, Callable[..., Likelihood]] = {
        "categorical": Categorical,
        "gaussian": Gaussian,
        "multiple_choice": MultipleChoice,
        "bernoulli": Bernoulli,
        "multilabel": Bernoulli,
    }
    if spec not in table:
        raise ValueError(f"Expected likelihood in {sorted(table)} but got {spec!r}.")
    return table[spec](**kwargs)
