"""``fit``'s ownership of a ``DataLoader``'s per-epoch order (:class:`DataOrder`).

The samplers' and the loader's generators are seeded from the fit's seed and the epoch
(:func:`mix_seed`) before each epoch, so a run resumed mid-epoch sees the batches the
uninterrupted run saw.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch.utils.data import DataLoader

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
