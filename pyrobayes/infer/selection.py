r"""Checkpoint selection on held-out data ("select by validation", as the LoRA-XS recipes do).

At the end of every epoch :func:`pyrobayes.fit` scores the guide's
:meth:`~pyrobayes.guides.base.PosteriorGuide.validation_values` on ``val_data`` and keeps an
in-memory copy of the best state (guide state and the model's point parameters); at the end of
training that state is restored, *before* the family's ``fit_end`` (so Laplace fits its curvature
at the selected MAP).

Scores (all "lower is better" internally):

- ``"nll"``: :math:`-\frac1N\sum_n \log \frac1S \sum_s p(y_n \mid x_n, θ_s)` (any likelihood);
- ``"accuracy"``: classification accuracy of :math:`\bar p`, ties broken by the NLL;
- ``"rmse"``: regression RMSE of the predictive mean.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .. import metrics
from ..batch import split_batch
from ..calibration import labelled_prediction
from ..user_frame import user_stacklevel
from .distributed import all_reduce_sum_, world
from .rank_errors import PASS_REMEDY, raise_kept, run_shared

__all__ = [
    "SELECT_BY",
    "Snapshot",
    "Selection",
    "data_fingerprint",
    "validation_score",
    "warn_if_training_data",
]

SELECT_BY = ("nll", "accuracy", "rmse")


def warn_if_training_data(validation_data: Iterable[Any], data: Iterable[Any]) -> None:
    """Warn when ``fit``'s held-out data are its training data (the same object, or loaders
    over the same dataset object): every epoch then scores the training fit, so the "best"
    epoch is the one that fits the training set best and early stopping never guards against
    over-fitting."""
    same = validation_data is data
    dataset = getattr(data, "dataset", None)
    same = same or (dataset is not None and getattr(validation_data, "dataset", None) is dataset)
    if same:
        warnings.warn(
            "fit(validation=Validation(data)): the validation data are the training data "
            "(the same object or a loader over the same dataset); the selected epoch and early "
            "stopping then follow the training fit. Pass held-out batches, e.g. a split made "
            "with torch.utils.data.random_split.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def validation_score(
    model: Any, guide: Any, data: Iterable[Any], select_by: str
) -> tuple[tuple[float, ...], dict[str, float]]:
    """``(key, metrics)``: ``key`` sorts better scores first; ``metrics`` is what was measured.

    The model is left in training mode afterwards (this runs between epochs).
    """
    measured, _ = _measure(model, guide, data, select_by)
    return _key(measured, select_by), measured


def _measure(
    model: Any, guide: Any, data: Iterable[Any], select_by: str
) -> tuple[dict[str, float], int]:
    """The validation metrics of ``guide`` on ``data`` and the number of examples scored."""
    pred = labelled_prediction(
        model,
        guide,
        data,
        owner="fit(validation=Validation(data)): ",
        why="the epoch is chosen by its score on held-out labels",
        values=guide.validation_values(),
        seed=None,
    )
    model.train(True)
    count = int(pred.targets.shape[0])
    check_select_by(select_by, classification=pred.log_probs is not None)
    if pred.multi_label:  # label-wise (Hamming) accuracy; NLL of each example's label vector
        measured = metrics.multilabel_report(pred, pred.targets)
        return {"nll": measured["nll"], "accuracy": measured["accuracy"]}, count
    if pred.log_probs is not None:
        nll = metrics.nll(None, pred.targets, log_probs=pred.log_probs)
        return {"nll": nll, "accuracy": metrics.accuracy(pred.probs, pred.targets)}, count
    if pred.loc is None or pred.scale is None:
        raise ValueError(
            "fit(validation=...): a regression likelihood needs an obs_scale to score the NLL."
        )
    # targets checked against the means: (N,) or (N, 1) for a scalar output, else a ValueError
    return metrics.regression_report(pred.loc, pred.targets, pred.scale), count


def check_select_by(select_by: str, *, classification: bool) -> None:
    """Refuse a criterion the likelihood has no score for: ``"rmse"`` for a classifier,
    ``"accuracy"`` for a regression (checked when the fit starts, from the model's likelihood,
    and again on the first validation, from the prediction)."""
    if classification and select_by not in ("nll", "accuracy"):
        raise ValueError(
            f"Validation(select_by={select_by!r}) is for regression; use 'nll' or 'accuracy' here."
        )
    if not classification and select_by == "accuracy":
        raise ValueError(
            "Validation(select_by='accuracy') needs a classification likelihood; use 'nll' or 'rmse'."
        )


def _key(measured: dict[str, float], select_by: str) -> tuple[float, ...]:
    """The sort key of ``measured`` (smaller is better; accuracy ties broken by the NLL)."""
    if select_by == "accuracy":
        return (-measured["accuracy"], measured["nll"])
    return (measured[select_by],)


def _pooled(measured: dict[str, float], count: int, device: Any) -> dict[str, float]:
    """``measured`` over the union of the ranks' validation shards: each metric is a mean over
    examples (accuracy, NLL) or the root of one (RMSE), so the count-weighted sum of the ranks'
    means (of squares, for RMSE) over the total count is the union's value — not the mean of
    the ranks' means, which a DistributedSampler's padding or uneven shards would bias."""
    names = sorted(measured)
    means = [measured[k] ** 2 if k == "rmse" else measured[k] for k in names]
    sums = torch.tensor([count, *(count * m for m in means)], dtype=torch.float64, device=device)
    all_reduce_sum_([sums])
    total = float(sums[0])
    pooled = {k: float(v) / total for k, v in zip(names, sums[1:].tolist(), strict=True)}
    if "rmse" in pooled:
        pooled["rmse"] = math.sqrt(pooled["rmse"])
    return pooled


def _measure_on_every_rank(
    model: Any, guide: Any, data: Iterable[Any], select_by: str, epoch: int
) -> dict[str, float]:
    """:func:`_measure` :func:`_pooled` over the ranks (under ``torch.distributed``). A rank
    whose scoring fails (its held-out shard is empty or unlabelled, an out-of-memory error)
    shares NaN metrics in the pooling's all-reduce instead of leaving the others waiting in it
    (until gloo's timeout, 30 minutes), and every rank then stops with its error. Its share has
    the metrics of the model's likelihood (:func:`_measure`'s: ``accuracy`` and ``nll`` for a
    classifier, ``nll`` and ``rmse`` for a regression), so the all-reduced sizes match."""
    likelihood = getattr(model, "likelihood", None)
    names = (
        ("accuracy", "nll") if getattr(likelihood, "is_classification", True) else ("nll", "rmse")
    )
    measured, count = run_shared(
        lambda: _measure(model, guide, data, select_by),
        lambda: (dict.fromkeys(names, math.nan), 0),
    )
    pooled = _pooled(measured, count, model.device)
    if not all(math.isfinite(v) for v in pooled.values()):  # the same on every rank
        raise_kept(f"the validation of epoch {epoch}", remedy=PASS_REMEDY)
    return pooled


def data_fingerprint(data: Iterable[Any], model: Any = None) -> dict[str, Any]:
    """A fingerprint of held-out data: batch and example counts, a SHA-256 of the targets
    (sorted, so a shuffling loader gives the same one) and a SHA-256 of the examples (the
    sorted digests of each example's inputs with its target: another batching or order of the
    same examples gives the same one, other examples with the same targets another).

    Reads every batch once, without the model, under a forked torch RNG (a shuffling loader's
    draws do not move the fit's random stream). ``model`` supplies the ``label_key``. The
    positions an ``attention_mask`` marks as padding are left out of an example's digest, so a
    collator's dynamic padding (which depends on the batch an example falls in) is not a change.
    """
    label_key = getattr(model, "label_key", "labels")
    batches, examples, values, rows = 0, 0, [], []
    with torch.random.fork_rng(devices=[]):
        for batch in data:
            batches += 1
            x, y = split_batch(batch, label_key)
            if y is not None:
                y = torch.as_tensor(y).detach().cpu()
                count = int(y.shape[0]) if y.dim() else 1
                examples += count
                values.append(y.reshape(-1).double())
                rows += _example_digests(x, y, count)
    digest = hashlib.sha256()
    if values:
        flat = torch.sort(torch.cat(values)).values.contiguous()
        digest.update(flat.numpy().tobytes())
    return {
        "batches": batches,
        "examples": examples,
        "targets_sha256": digest.hexdigest(),
        "examples_sha256": hashlib.sha256(b"".join(sorted(rows))).hexdigest(),
    }


def _example_digests(inputs: Any, targets: Tensor, count: int) -> list[bytes]:
    """The SHA-256 digest of each of a batch's ``count`` examples: its slice of every tensor of
    ``inputs`` (a tensor, or a mapping or tuple of them, read in a fixed order) and of
    ``targets``, padding positions (``attention_mask == 0``) left out."""
    mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
    if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.shape[0] != count:
        mask = None
    else:
        mask = mask.detach().cpu().bool()
    hashers = [hashlib.sha256() for _ in range(count)]
    for name, tensor in [
        *_tensors(inputs, "x"),
        ("y", targets if targets.dim() else targets[None]),
    ]:
        for hasher, part in zip(hashers, _example_bytes(tensor, count, mask), strict=True):
            hasher.update(f"{name}:{len(part)}:".encode())
            hasher.update(part)
    return [hasher.digest() for hasher in hashers]


def _tensors(value: Any, name: str) -> list[tuple[str, Tensor]]:
    """The tensors (and NumPy arrays) of a batch's inputs with their paths, in a fixed order
    (a mapping's by sorted key); anything else (strings, objects) is not read."""
    if isinstance(value, Tensor):
        return [(name, value)]
    if isinstance(value, np.ndarray) and value.dtype != object:
        return [(name, torch.from_numpy(value))]
    if isinstance(value, Mapping):
        return [t for key in sorted(value, key=str) for t in _tensors(value[key], f"{name}.{key}")]
    if isinstance(value, (tuple, list)):
        return [t for i, item in enumerate(value) for t in _tensors(item, f"{name}[{i}]")]
    return []


def _example_bytes(tensor: Tensor, count: int, mask: Tensor | None) -> list[bytes]:
    """Each example's slice of ``tensor`` as bytes (with its dtype and shape); a tensor that is
    not per example (its first dimension is not ``count``) counts whole for every example."""
    tensor = tensor.detach().cpu()
    if count == 0:
        return []
    if tensor.dim() == 0 or tensor.shape[0] != count:
        return [_bytes(tensor)] * count
    if mask is not None and tensor.shape[:2] == mask.shape:
        return [_bytes(tensor[i][mask[i]]) for i in range(count)]
    tag = f"{tensor.dtype}{tuple(tensor.shape[1:])}".encode()
    raw = tensor.reshape(count, -1).contiguous().view(torch.uint8).numpy()
    return [raw[i].tobytes() + tag for i in range(count)]


def _bytes(tensor: Tensor) -> bytes:
    """``tensor``'s values as bytes, with its dtype and shape."""
    flat = tensor.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    return flat + f"{tensor.dtype}{tuple(tensor.shape)}".encode()


class Snapshot:
    """A detached copy of the guide's state and the model's point parameters."""

    def __init__(self, guide_state: dict[str, Tensor], point: dict[str, Tensor]) -> None:
        self.guide_state, self.point = guide_state, point

    @classmethod
    def capture(cls, model: Any, guide: Any) -> Snapshot:
        with torch.no_grad():
            state = {k: v.detach().clone() for k, v in guide.state_dict().items()}
            point = {k: p.detach().clone() for k, p in getattr(model, "point_params", {}).items()}
        return cls(state, point)

    def restore(self, model: Any, guide: Any) -> None:
        guide.load_state_dict(self.guide_state)
        params = getattr(model, "point_params", {})
        with torch.no_grad():
            for k, v in self.point.items():
                params[k].copy_(v)

    def to_dict(self) -> dict[str, dict[str, Tensor]]:
        return {"guide": self.guide_state, "point": self.point}

    @classmethod
    def from_dict(cls, d: dict[str, dict[str, Tensor]]) -> Snapshot:
        return cls(d["guide"], d["point"])


class Selection:
    """The validation history of a fit and the best state so far (``fit(validation=Validation(...))``).

    Parameters
    ----------
    data : iterable of batches
        The held-out data.
    select_by : {"nll", "accuracy", "rmse"}
    """

    def __init__(self, data: Iterable[Any], select_by: str) -> None:
        if select_by not in SELECT_BY:
            raise ValueError(
                f"Validation(select_by=...) must be one of {SELECT_BY}; got {select_by!r}."
            )
        self.data, self.select_by = data, select_by
        self.history: list[dict[str, Any]] = []
        self.best: Snapshot | None = None

    def score(self, model: Any, guide: Any, epoch: int) -> dict[str, float]:
        """Score ``guide`` at the end of ``epoch``; keep a snapshot when it is the best so far.

        Under ``torch.distributed`` every rank scores its shard and every rank records the metrics
        of the union of the shards (:func:`_pooled`), so all agree on the history and the best.
        """
        if world()[0] > 1:
            measured = _measure_on_every_rank(model, guide, self.data, self.select_by, epoch)
        else:
            measured, _ = _measure(model, guide, self.data, self.select_by)
        key = _key(measured, self.select_by)
        self.history.append({"epoch": epoch, "key": list(key), **measured})
        if self.best_index() == len(self.history) - 1:
            self.best = Snapshot.capture(model, guide)
        return measured

    def best_index(self) -> int:
        return min(range(len(self.history)), key=lambda i: tuple(self.history[i]["key"]))

    def epochs_since_best(self) -> int:
        """Epochs scored after the best one (0 when the last scored epoch is the best)."""
        return len(self.history) - 1 - self.best_index() if self.history else 0

    def exhausted(self, patience: int | None) -> bool:
        """Whether ``patience`` epochs in a row have not improved on the best (early stopping).

        A function of the history alone, which checkpoints carry: a resumed fit stops where the
        uninterrupted one did.
        """
        return patience is not None and self.epochs_since_best() >= patience

    def restore_best(self, model: Any, guide: Any) -> int | None:
        """Restore the best state; returns its epoch (``None`` when nothing was scored)."""
        if self.best is None:
            return None
        self.best.restore(model, guide)
        return int(self.history[self.best_index()]["epoch"])
