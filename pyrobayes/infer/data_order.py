"""``fit``'s ownership of a ``DataLoader``'s per-epoch order (:class:`DataOrder`).

The samplers' and the loader's generators are seeded from the fit's seed and the epoch
(:func:`mix_seed`) before each epoch, so a run resumed mid-epoch sees the batches the
uninterrupted run saw.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from ..user_frame import user_stacklevel

__all__ = ["DataOrder", "mix_seed"]


def mix_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts``, the same on every machine and Python (not ``hash``)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class DataOrder:
    """``fit``'s ownership of a ``DataLoader``'s per-epoch order.

    Before each epoch the generators of its samplers (``RandomSampler`` of ``shuffle=True``,
    or any sampler with a ``generator`` attribute) and the loader's own generator (the base
    seed of its workers) are replaced by ones seeded from ``(seed, epoch)``, and ``set_epoch``
    is called on samplers that have it (``DistributedSampler``). Nothing is drawn from the
    global RNG, so the order of an epoch does not depend on where in it a run was resumed.
    The original generators are put back by :meth:`restore`.
    """

    def __init__(self, data: Any, seed: int) -> None:
        self.seed = seed
        self.loader = data if isinstance(data, DataLoader) else None
        self.samplers: list[Any] = []
        self._saved: list[tuple[Any, Any]] = []
        if self.loader is None:
            return
        for sampler in (
            self.loader.sampler,
            self.loader.batch_sampler,
            getattr(self.loader.batch_sampler, "sampler", None),
        ):
            if sampler is not None and all(sampler is not s for s in self.samplers):
                self.samplers.append(sampler)
        self._saved = [
            (obj, obj.generator)
            for obj in (self.loader, *self.samplers)
            if hasattr(obj, "generator")
        ]

    def set_epoch(self, epoch: int) -> None:
        for k, (obj, _) in enumerate(self._saved):
            obj.generator = torch.Generator().manual_seed(mix_seed(self.seed, epoch, k))
        for sampler in self.samplers:
            if callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(epoch)

    def restore(self) -> None:
        for obj, generator in self._saved:
            obj.generator = generator

    def unseeded(self) -> list[str]:
        """The class names of the loader's samplers whose order :meth:`set_epoch` cannot set:
        neither a ``SequentialSampler`` nor a ``BatchSampler`` (which follows its own
        sampler), with no ``generator`` to replace and no ``set_epoch`` (a custom sampler
        drawing from torch's global RNG, or from a NumPy generator of its own). An iterable
        dataset's loader has none: the dataset yields its batches in an order of its own."""
        if self.loader is None or isinstance(self.loader.dataset, IterableDataset):
            return []
        return [
            type(sampler).__name__
            for sampler in self.samplers
            if not isinstance(sampler, (SequentialSampler, BatchSampler))
            and not hasattr(sampler, "generator")
            and not callable(getattr(sampler, "set_epoch", None))
        ]

    def warn_if_unseeded(self, epoch: int, done: int) -> None:
        """Warn, for a fit resumed after ``done`` batches of ``epoch``, when the loader's order
        is not the fit's to set (:meth:`unseeded`): the resumed epoch skips the first ``done``
        batches of a new order, so some examples are seen twice in it and others not at all,
        and the run is not the uninterrupted one."""
        names = self.unseeded()
        if not names or done == 0:
            return
        batches = f"{done} batch{'es' if done != 1 else ''}"
        warnings.warn(
            f"fit: resumed after {batches} of epoch {epoch}, but the DataLoader's sampler "
            f"({', '.join(names)}) has no generator that fit can seed (nor set_epoch), so if it "
            f"draws a random order the resumed epoch skips the first {batches} of another "
            "order than the interrupted run's: some examples are seen twice in this epoch, "
            "others not at all, and the run is not the uninterrupted one. Give the sampler a "
            "torch.Generator attribute named generator that it draws its order from (as "
            "RandomSampler(dataset, generator=...) does), or resume from an epoch's end.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
