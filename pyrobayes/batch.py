"""Batches: split inputs from targets, move to a device, expand S-fold for batched samples.

A batch is either a Hugging Face dict (``{"input_ids", "attention_mask", ..., "labels"}``) or a
tensor / tuple ``(x, y)`` / ``(x,)``. Targets are kept apart from the inputs so the network never
computes its own loss.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset

__all__ = [
    "split_batch",
    "to_device",
    "expand_samples",
    "batch_size",
    "image_tokens",
    "token_mask",
    "compute_dtype",
    "check_batches",
    "flagged_examples",
    "slice_examples",
    "detached",
    "check_not_meta",
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to compute with values of ``dtype``: float32 for float16/bfloat16 (a half
    log-softmax rounds a log-probability to a few bits; ``eigh`` and ``cholesky`` have no half
    kernels; running sums need the mantissa), else ``dtype`` itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


#: Names targets go by in dict batches (Hugging Face's ``labels``, the ``datasets`` column
#: ``label``): a batch holding the other one than ``label_key`` is refused, not fed to forward().
_LABEL_NAMES = ("labels", "label")


def split_batch(batch: Any, label_key: str = "labels") -> tuple[Any, Tensor | None]:
    """Return ``(inputs, targets)``; ``targets`` is ``None`` when the batch carries none."""
    if isinstance(batch, Mapping):
        if label_key not in batch:
            other = next((k for k in _LABEL_NAMES if k != label_key and k in batch), None)
            if other is not None:  # e.g. a `datasets` column "label": it would reach forward()
                raise ValueError(
                    f"The batch has no {label_key!r} but has {other!r} (keys: {sorted(batch)}): "
                    f"pass FineTuneModel(..., label_key={other!r}) if those are the targets, or "
                    f"rename the column to {label_key!r} (datasets: "
                    f"dataset.rename_column({other!r}, {label_key!r}))."
                )
        inputs = {k: v for k, v in batch.items() if k != label_key}
        return inputs, batch.get(label_key)
    if isinstance(batch, Tensor):
        return batch, None
    if isinstance(batch, (tuple, list)):
        if len(batch) == 1:
            return batch[0], None
        if len(batch) == 2:
            return batch[0], batch[1]
    if isinstance(batch, (tuple, list)):  # three or more items: which are the inputs?
        raise TypeError(
            f"Expected a batch (x, y) but got a {type(batch).__name__} of {len(batch)} items. "
            "For several inputs, nest them: ((x1, x2), y) (the network is called as "
            f"net(x1, x2)), or pass a dict of tensors with the targets under {label_key!r}; "
            "for a Hugging Face model pass the dict ({'input_ids': ..., 'attention_mask': ..., "
            f"{label_key!r}: y}}): its arguments are read by name, and its second positional "
            "argument is not the attention mask in every model (GPT-2: past_key_values)."
        )
    raise TypeError(
        "Expected a batch as a dict of tensors (Hugging Face style, targets under "
        f"{label_key!r}), a tensor, or a tuple (x, y) but got {type(batch).__name__}."
    )


def _rebuilt(obj: tuple[Any, ...] | list[Any], items: Iterable[Any]) -> Any:
    """A tuple or list of ``obj``'s type holding ``items``: a namedtuple (which torch's
    ``default_collate`` keeps) takes its fields as arguments, not one iterable."""
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*items)
    return type(obj)(items)


def to_device(obj: Any, device: torch.device | str | None) -> Any:
    """Move every tensor in a (nested) batch to ``device`` (a namedtuple stays one).

    Raises
    ------
    ValueError
        For a tensor on the ``meta`` device (shapes without values), moved anywhere else.
    """
    if device is None:
        return obj
    if isinstance(obj, Tensor):
        if obj.is_meta and torch.device(device).type != "meta":
            raise ValueError(_meta_message(obj))
        return obj.to(device, non_blocking=True)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return _rebuilt(obj, (to_device(v, device) for v in obj))
    return obj


def _meta_message(tensor: Tensor) -> str:
    return (
        f"A batch holds a tensor on the 'meta' device ({tensor.dtype}, shape "
        f"{tuple(tensor.shape)}): it has a shape but no values, so nothing can be computed "
        "from it. Build the batches' tensors on a real device (not under "
        "torch.device('meta') or with device='meta'), e.g. torch.randn(..., device='cpu')."
    )


def check_not_meta(obj: Any) -> None:
    """Refuse a (nested) batch holding a tensor on the ``meta`` device, which a computation on
    it fails at with an error of torch's that does not name the batch.

    Raises
    ------
    ValueError
        Naming the tensor's dtype and shape.
    """
    if isinstance(obj, Tensor):
        if obj.is_meta:
            raise ValueError(_meta_message(obj))
    elif isinstance(obj, Mapping):
        for value in obj.values():
            check_not_meta(value)
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            check_not_meta(value)


def _requires_grad(obj: Any) -> bool:
    if isinstance(obj, Tensor):
        return obj.requires_grad
    if isinstance(obj, Mapping):
        return any(_requires_grad(v) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return any(_requires_grad(v) for v in obj)
    return False


def detached(obj: Any) -> Any:
    """``obj`` itself, or, when a tensor in it requires grad, a copy of the (nested) batch
    with every tensor detached (a namedtuple stays one). A fit's gradients are the
    parameters'; a batch's ``requires_grad`` tensors (the leaves of a user's own graph)
    would take the backward pass into them and have it accumulate their ``.grad``."""
    if not _requires_grad(obj):
        return obj
    if isinstance(obj, Tensor):
        return obj.detach()
    if isinstance(obj, Mapping):
        return {k: detached(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return _rebuilt(obj, (detached(v) for v in obj))
    return obj


def expand_samples(inputs: Any, num_samples: int) -> Any:
    """Sample-major S-fold expansion: row ``s * B + b`` of the result is row ``b`` of the input."""
    if num_samples == 1:
        return inputs
    if isinstance(inputs, Tensor):
        if inputs.dim() == 0:
            return inputs
        return inputs.unsqueeze(0).expand(num_samples, *inputs.shape).reshape(-1, *inputs.shape[1:])
    if isinstance(inputs, Mapping):
        return {k: expand_samples(v, num_samples) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return _rebuilt(inputs, (expand_samples(v, num_samples) for v in inputs))
    return inputs


#: Pixels per work unit of an image: one 16 x 16 patch, a ViT-B/16 token (196 per 224² image).
PIXELS_PER_TOKEN = 256


def image_tokens(inputs: Any) -> int | None:
    """Work units of a batch of images: ``B · max(1, H·W / 256)``, one per 16 × 16 patch (a
    ViT-B/16's tokens, Dosovitskiy et al. 2021), for a floating ``(B, C, H, W)`` tensor given
    as the inputs, first in a tuple, or as ``pixel_values``; ``None`` for other inputs.

    Sizing a forward by its images alone takes a 224² image for one row, as cheap as an MLP's;
    its per-row work is that of a 196-token sequence."""
    if isinstance(inputs, Mapping):
        inputs = inputs.get("pixel_values")
    elif isinstance(inputs, (tuple, list)) and inputs:
        inputs = inputs[0]
    if not isinstance(inputs, Tensor) or inputs.dim() != 4 or not inputs.is_floating_point():
        return None
    height, width = int(inputs.shape[-2]), int(inputs.shape[-1])
    return int(inputs.shape[0]) * max(1, height * width // PIXELS_PER_TOKEN)


def flagged_examples(flags: Tensor | list[int], example_dim: int = 0) -> str:
    """The examples an error message names: those along ``example_dim`` where the boolean
    ``flags`` holds anywhere (or the indices given), the first 8, e.g. ``[0, 3, 9] ...``."""
    if isinstance(flags, Tensor):
        flags = flags.movedim(example_dim, 0).reshape(flags.shape[example_dim], -1).any(-1)
        flags = flags.nonzero().flatten().tolist()
    return f"{flags[:8]}{' ...' if len(flags) > 8 else ''}"


def batch_size(inputs: Any) -> int:
    """Number of examples in ``inputs`` (the leading size of its first tensor; a
    multiple-choice batch ``(B, K, L)`` has B examples).

    Raises
    ------
    TypeError
        When ``inputs`` holds no tensor with a batch dim: a 0-dim tensor, an empty tuple, a
        dict of Python lists or of scalars.
    """
    if isinstance(inputs, Tensor):
        if inputs.dim() == 0:  # (shape[0] was an IndexError)
            raise TypeError(
                f"Cannot tell the batch size of a 0-dim tensor ({inputs!r}): the batch's "
                "inputs are one value, not a batch of examples. Pass inputs with a leading "
                "batch dim, shape (B, ...) (a single example x as x.unsqueeze(0))."
            )
        return int(inputs.shape[0])
    if isinstance(inputs, Mapping):
        for v in inputs.values():
            if isinstance(v, Tensor) and v.dim() > 0:
                return int(v.shape[0])
    if isinstance(inputs, (tuple, list)):
        if not inputs:  # (inputs[0] was an IndexError)
            raise TypeError(
                f"Cannot tell the batch size of an empty {type(inputs).__name__}: the batch "
                "has no inputs. Pass (x, y) batches whose x is a tensor (or a tuple of tensors)."
            )
        return batch_size(inputs[0])
    if isinstance(inputs, Mapping) and any(isinstance(v, list) for v in inputs.values()):
        raise TypeError(
            f"Cannot tell the batch size of a dict whose values are Python lists (keys: "
            f"{sorted(inputs)}): collate the batch to tensors (datasets: "
            "dataset.with_format('torch'), or a DataLoader with a collator such as "
            "transformers' DataCollatorWithPadding)."
        )
    raise TypeError(f"Cannot tell the batch size of {type(inputs).__name__}.")


#: What ``data`` must be, in the refusals of :func:`check_batches`.
_PASS_BATCHES = (
    "Pass an iterable of batches: a DataLoader with a batch size "
    "(torch.utils.data.DataLoader(dataset, batch_size=32)), or a list of (inputs, targets) "
    "batches ([(x, y)] for a single batch, list(zip(x.split(32), y.split(32))) for several)."
)


def check_batches(data: Any, owner: str, label_key: str = "labels") -> None:
    """Refuse ``data`` whose items are not batches: iterating it would give single examples,
    a tensor's rows, a dict's keys, or the inputs and then the targets of one batch.

    ``data`` is an iterable of batches (a ``DataLoader`` with a batch size, a list of
    ``(inputs, targets)`` batches, a generator). Refused, each with what to pass instead:

    - a Hugging Face ``datasets.Dataset`` (or ``IterableDataset``): one example dict at a time;
    - a map-style torch ``Dataset`` (``TensorDataset``, ``Subset``, ...) not wrapped in a
      ``DataLoader``;
    - a ``DataLoader`` that does not batch (``batch_size=None``) over a map-style dataset whose
      first item is one example (a 0-dim or scalar target);
    - a tensor (its rows) and a dict, a single batch (its keys);
    - a single ``(inputs, targets)`` pair (the targets a tensor of another rank or dtype kind
      than the inputs, with as many rows, or beside a dict or tuple of inputs).

    Parameters
    ----------
    data : Any
        The ``data`` argument of ``owner``.
    owner : str
        The function the message names (``"fit()"``, ``"predict"``).
    label_key : str
        The dict batches' target key (a ``DataLoader`` item's target is read under it).

    Raises
    ------
    TypeError
        Naming ``owner``'s ``data``, what it is, and what to pass.
    """
    if hasattr(data, "column_names") and hasattr(data, "features"):
        raise TypeError(
            f"{owner}: data is a {type(data).__name__} (Hugging Face datasets), whose items "
            "are single examples, not batches. Batch it: "
            "torch.utils.data.DataLoader(dataset.with_format('torch'), batch_size=32, "
            "collate_fn=DataCollatorWithPadding(tokenizer)), or dataset.with_format('torch')"
            ".iter(batch_size=32) for equal-length rows."
        )
    why = _not_batches(data, label_key)
    if why is not None:
        raise TypeError(f"{owner}: data is {why}. {_PASS_BATCHES}")


def _not_batches(data: Any, label_key: str) -> str | None:
    """What ``data`` is and why its items are not batches (:func:`check_batches`), or ``None``."""
    name = type(data).__name__
    if isinstance(data, Tensor):
        return (
            f"a tensor of shape {tuple(data.shape)}, which iterates its rows, one example at a "
            "time (if its leading dim indexes whole batches, pass list(data))"
        )
    if isinstance(data, Mapping):
        return (
            f"a {name} (keys {sorted(map(str, data))[:6]}): one batch, and iterating it gives "
            "its keys; for a single dict batch pass [batch]"
        )
    if isinstance(data, Dataset) and not isinstance(data, (IterableDataset, DataLoader)):
        return (
            f"a {name} (a torch Dataset), whose items are single examples, not batches: wrap "
            "it in a DataLoader (or, if its items are whole batches already, "
            "DataLoader(dataset, batch_size=None))"
        )
    if isinstance(data, DataLoader) and _one_example_per_item(data, label_key):
        return (
            "a DataLoader with batch_size=None over single examples (its first item's target "
            "is one value), so every item is one example, not a batch: give it a batch_size"
        )
    if _one_batch(data):
        return (
            f"a {name} of two items that reads as one (inputs, targets) batch (the second, "
            f"{_described(data[1])}, has a row per example of the first); iterating it gives "
            "the inputs and then the targets, each as a batch of its own"
        )
    return None


def _described(item: Any) -> str:
    if isinstance(item, Tensor):
        return f"a {item.dtype} tensor of shape {tuple(item.shape)}"
    return f"a {type(item).__name__}"


def _one_example_per_item(loader: DataLoader[Any], label_key: str) -> bool:
    """Whether ``loader`` does not batch (``batch_size=None``, no batch sampler) and the first
    item of its map-style dataset is one example: a 0-dim tensor or a scalar as its target."""
    if loader.batch_sampler is not None or isinstance(loader.dataset, IterableDataset):
        return False
    try:
        item = loader.dataset[0]
        targets = split_batch(item, label_key)[1]
    except (IndexError, KeyError, TypeError, ValueError):  # not indexable by 0, or no batch
        return False
    if isinstance(targets, Tensor):
        return targets.dim() == 0
    return isinstance(targets, (bool, int, float)) or getattr(targets, "ndim", None) == 0


def _one_batch(data: Any) -> bool:
    """Whether a pair ``data`` is one ``(inputs, targets)`` batch rather than two batches: its
    second item is a tensor, beside a dict or tuple of inputs, or beside a tensor of as many
    rows and of another rank or dtype kind (two batches are alike: x and x, not x and y)."""
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        return False
    inputs, targets = data
    if not isinstance(targets, Tensor) or targets.dim() == 0:
        return False
    if isinstance(inputs, Mapping):
        return True
    if isinstance(inputs, (tuple, list)):  # ((x1, x2), y): two inputs and their targets
        return len(inputs) >= 2 and all(isinstance(t, Tensor) for t in inputs)
    if not isinstance(inputs, Tensor) or inputs.dim() == 0:
        return False
    return inputs.shape[0] == targets.shape[0] and (
        inputs.dim() != targets.dim() or inputs.is_floating_point() != targets.is_floating_point()
    )


def token_mask(inputs: Any) -> Tensor | None:
    """The batch's ``attention_mask`` (``(B, T)``, nonzero on real tokens), or ``None``.

    Curvature and input statistics over token activations ``(B, T, d)`` skip the padded
    positions with it: padding is not data. A multiple-choice batch's ``(B, K, T)`` mask is
    returned as ``(B·K, T)``, the rows the network sees, zero on the rows of padded choices
    (``choice_mask`` of a ragged batch: copies of a question's first choice, not data either).
    """
    if isinstance(inputs, Mapping):
        mask = inputs.get("attention_mask")
        if not isinstance(mask, Tensor):
            return None
        choices = inputs.get("choice_mask")
        if isinstance(choices, Tensor) and mask.dim() == 3 and choices.shape == mask.shape[:2]:
            mask = mask * choices.to(mask.dtype).unsqueeze(-1)
        return mask.reshape(-1, mask.shape[-1]) if mask.dim() > 2 else mask
    return None


def slice_examples(inputs: Any, start: int, stop: int, size: int) -> Any:
    """Examples ``start:stop`` of a batch of ``size``: every tensor whose leading size is
    ``size`` sliced (in dicts, tuples and lists too), anything else as it is."""
    if isinstance(inputs, Tensor):
        return inputs[start:stop] if inputs.dim() and inputs.shape[0] == size else inputs
    if isinstance(inputs, Mapping):
        return {k: slice_examples(v, start, stop, size) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return _rebuilt(inputs, (slice_examples(v, start, stop, size) for v in inputs))
    return inputs
