"""What a resumed fit compares of its training data, read without a pass over them.

A checkpoint restores the run's position (step, epoch, batch within the epoch) and its data
order; resumed on other training data it would go on fitting them without a word whenever the
number of batches per epoch happens to match (a batch size of 50 or 64 over 200 examples both
give 4). :func:`training_data_record` is the part of the data a resume can check cheaply:

- a ``DataLoader``: the dataset's size, the batch size and ``drop_last``, the sampler's class
  (``shuffle`` on or off, a ``DistributedSampler``), and a SHA-256 of three examples (the
  first, the middle and the last of a map-style dataset);
- a list or tuple of batches: the number of batches and a SHA-256 of the first, middle and
  last batch;
- anything else (a generator, an iterable dataset's stream): nothing (``None``).

The order in which a shuffling loader serves the examples is not part of it, so a resume of a
``shuffle=True`` (or ``drop_last=True``) loader over the same dataset is accepted. The sampled
examples are read under fixed seeds of Python's, NumPy's and torch's global generators (and
the callers' states put back), so a dataset whose ``__getitem__`` draws a random augmentation
gives the same record on every call. Under ``torch.distributed`` nothing is compared (each
rank reads its own shard, and the checkpoint holds rank 0's record).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from ..rng import seed_forked

__all__ = ["describe_difference", "training_data_record"]


def training_data_record(data: Any) -> dict[str, Any] | None:
    """The training data's record (JSON values) for a resume to compare, or ``None``.

    Parameters
    ----------
    data : DataLoader, list or tuple of batches, or any iterable
        ``fit``'s training data.

    Returns
    -------
    dict or None
        ``{"examples", "batch_size", "drop_last", "sampler", "sample_sha256"}`` for a loader,
        ``{"batches", "sample_sha256"}`` for a list or tuple of batches, ``None`` otherwise.
        ``sample_sha256`` is ``None`` where the examples cannot be indexed.
    """
    if isinstance(data, DataLoader):
        return _loader_record(data)
    if isinstance(data, (list, tuple)):
        return {"batches": len(data), "sample_sha256": _sample_digest(data, len(data))}
    return None


def _loader_record(loader: DataLoader) -> dict[str, Any]:
    dataset = loader.dataset
    size: int | None = None
    if not isinstance(dataset, IterableDataset):
        try:
            size = len(dataset)  # type: ignore[arg-type]
        except TypeError:  # a map-style dataset without __len__
            size = None
    batch_size = loader.batch_size
    if batch_size is None:  # a batch_sampler of the user's: its own size, when it has one
        batch_size = getattr(loader.batch_sampler, "batch_size", None)
    sampler = loader.sampler if loader.batch_sampler is None else loader.batch_sampler
    sampler = getattr(sampler, "sampler", sampler)  # a BatchSampler's own sampler
    return {
        "examples": size,
        "batch_size": batch_size if isinstance(batch_size, int) else None,
        "drop_last": bool(loader.drop_last),
        "sampler": f"{type(sampler).__module__}.{type(sampler).__qualname__}",
        "sample_sha256": None if size is None else _sample_digest(dataset, size),
    }


def _sample_digest(items: Any, size: int) -> str | None:
    """SHA-256 of ``items[0]``, ``items[size // 2]`` and ``items[size - 1]`` (``None`` when
    ``size`` is 0 or indexing fails), read under fixed seeds of the global generators."""
    if size == 0:
        return None
    digest = hashlib.sha256()
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            for index in sorted({0, size // 2, size - 1}):
                random.seed(index)
                np.random.seed(index)
                seed_forked(index)  # the CPU's, which the fork restores (not every GPU's)
                _update(digest, items[index])
    except (IndexError, KeyError, TypeError, NotImplementedError):  # not indexable by position
        return None
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
    return digest.hexdigest()


def batch_digest(batch: Any) -> str:
    """SHA-256 of a batch's content (tensors by dtype, shape and bytes, as the record reads its
    examples): what a checkpoint keeps of the epoch's last batch, which a resume compares with
    the batch it replays there."""
    digest = hashlib.sha256()
    _update(digest, batch)
    return digest.hexdigest()


def _update(digest: Any, value: Any) -> None:
    """Feed ``value``'s content to ``digest``: tensors and arrays by dtype, shape and bytes,
    mappings by sorted key, sequences in order, scalars and strings by ``repr``; any other
    object by its type's name only (its ``repr`` may hold a memory address)."""
    if isinstance(value, torch.Tensor):
        dense = value if value.layout == torch.strided else value.to_dense()  # sparse inputs
        flat = dense.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, (np.ndarray, np.generic)):  # arrays and NumPy scalars
        digest.update(f"{value.dtype}{np.shape(value)}".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, Mapping):
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode())
            _update(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__}{len(value)}".encode())
        for item in value:
            _update(digest, item)
    elif value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        digest.update(repr(value).encode())
    else:
        digest.update(f"{type(value).__module__}.{type(value).__qualname__}".encode())


#: The record's fields as a refusal names them.
_FIELDS = {
    "examples": "number of examples",
    "batches": "number of batches",
    "batch_size": "batch size",
    "drop_last": "drop_last",
    "sampler": "sampler (shuffle on or off)",
    "sample_sha256": "examples themselves (a hash of the first, middle and last)",
}


def describe_difference(then: dict[str, Any] | None, now: dict[str, Any] | None) -> str:
    """The first field in which two records differ, with both values, for a refusal."""
    if then is None or now is None or then.keys() != now.keys():
        return f"{_kind(then)} then, {_kind(now)} now"
    key = next((k for k in _FIELDS if then.get(k) != now.get(k)), "sample_sha256")
    was, is_ = (_shown(key, record[key]) for record in (then, now))
    return f"{_FIELDS[key]}: {was} then, {is_} now"


def _kind(record: dict[str, Any] | None) -> str:
    if record is None:
        return "data that is neither a DataLoader nor a list of batches"
    return "a DataLoader" if "sampler" in record else "a list or tuple of batches"


def _shown(key: str, value: Any) -> str:
    return f"{value[:12]}…" if key == "sample_sha256" and isinstance(value, str) else str(value)
