"""``fit``'s ownership of a ``DataLoader``'s per-epoch order (:class:`DataOrder`).

The samplers' and the loader's generators are seeded from the fit's seed and the epoch
(:func:`mix_seed`) before each epoch, so a run resumed mid-epoch sees the batches the
uninterrupted run saw. Data that draw their order (or an augmentation) from the global
generators as they are read (an ``IterableDataset`` that shuffles with ``torch.randperm`` or
``random.shuffle``, a re-iterable generator of batches) read them from streams of their own,
seeded from the seed and the epoch too (:meth:`DataOrder.read`); what a resume replays is
checked against the interrupted run's last batch
(:func:`~pyrobayes.infer.data_record.batch_digest`).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch
from torch.utils.data import DataLoader

from ..user_frame import user_stacklevel

__all__ = ["DataOrder", "mix_seed"]

T = TypeVar("T")


def mix_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts``, the same on every machine and Python (not ``hash``)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _data_name(data: Any) -> str:
    """The class of ``data`` for a message: a loader's dataset's too."""
    if isinstance(data, DataLoader):
        return f"DataLoader over {type(data.dataset).__name__}"
    return type(data).__name__


class DataOrder:
    """``fit``'s ownership of a ``DataLoader``'s per-epoch order.

    Before each epoch the generators of its samplers (``RandomSampler`` of ``shuffle=True``,
    or any sampler with a ``generator`` attribute) and the loader's own generator (the base
    seed of its workers) are replaced by ones seeded from ``(seed, epoch)``, and ``set_epoch``
    is called on samplers that have it (``DistributedSampler``) and on a dataset (or data) that
    has it (an iterable dataset of Hugging Face ``datasets``). Nothing is drawn from the
    global RNG, so the order of an epoch does not depend on where in it a run was resumed.
    The original generators are put back by :meth:`restore`.

    Data other than a list or tuple of batches may draw from the global generators as they are
    read, between the fit's own draws. Their reads (:meth:`read`) use torch's CPU generator in
    a state of their own, and Python's and NumPy's global generators (which the fit does not
    draw from) are seeded for the epoch: both from ``(seed, epoch)``, so the batches of an
    epoch are a function of the two and a resume that skips the batches done replays them,
    while the fit's draws between the reads stay those of the uninterrupted run. Python's and
    NumPy's states of before the epoch are put back after its reads (:meth:`end_reads`).
    """

    def __init__(self, data: Any, seed: int) -> None:
        self.seed = seed
        self.loader = data if isinstance(data, DataLoader) else None
        self.samplers: list[Any] = []
        self._saved: list[tuple[Any, Any]] = []
        # the data's torch CPU generator state between reads (None: data that draw nothing,
        # or before the first epoch), and Python's and NumPy's states of before the epoch
        self.streams = not isinstance(data, (list, tuple))
        self._torch_state: torch.Tensor | None = None
        self._outer: tuple[Any, Any] | None = None
        held = self.loader.dataset if self.loader is not None else data
        self._epoch_setters: list[Any] = (
            [held] if callable(getattr(held, "set_epoch", None)) else []
        )
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
        """Seed the order of ``epoch`` (``-1``: the lower-block cache's read-ahead)."""
        for k, (obj, _) in enumerate(self._saved):
            obj.generator = torch.Generator().manual_seed(mix_seed(self.seed, epoch, k))
        for sampler in self.samplers:
            if callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(epoch)
        if epoch >= 0:  # (a dataset's own set_epoch may refuse the read-ahead's -1)
            for dataset in self._epoch_setters:
                dataset.set_epoch(epoch)
        if self.streams:
            self._seed_streams(mix_seed(self.seed, epoch, "global"))

    def _seed_streams(self, seed: int) -> None:
        """The data's streams for an epoch: torch's CPU state, Python's and NumPy's seeds."""
        self.end_reads()
        self._torch_state = torch.Generator().manual_seed(seed).get_state()
        self._outer = (random.getstate(), np.random.get_state())
        random.seed(seed)
        np.random.seed(seed % 2**32)

    def read(self, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)`` (``iter(data)``, ``next(batches)``) on the data's torch stream: the
        CPU generator's state is swapped in and out (two copies of its few kilobytes, about a
        microsecond each; no device work). The fit's draws are not moved by the data's."""
        state = self._torch_state
        if state is None:
            return call(*args)
        generator = torch.default_generator
        fit_state = generator.get_state()
        generator.set_state(state)
        try:
            return call(*args)
        finally:
            self._torch_state = generator.get_state()
            generator.set_state(fit_state)

    def end_reads(self) -> None:
        """Put back Python's and NumPy's states of before the epoch (its reads are over)."""
        outer, self._outer = self._outer, None
        self._torch_state = None
        if outer is not None:
            random.setstate(outer[0])
            np.random.set_state(outer[1])

    @contextlib.contextmanager
    def outside_reads(self) -> Iterator[None]:
        """A block with Python's and NumPy's states of before the epoch in place (a
        checkpoint saves those: a resume seeds the epoch's own again and replays its reads)."""
        outer = self._outer
        if outer is None:
            yield
            return
        inner = (random.getstate(), np.random.get_state())
        random.setstate(outer[0])
        np.random.set_state(outer[1])
        try:
            yield
        finally:
            random.setstate(inner[0])
            np.random.set_state(inner[1])

    def restore(self) -> None:
        self.end_reads()
        for obj, generator in self._saved:
            obj.generator = generator

    def warn_if_replay_differs(self, data: Any, epoch: int, done: int) -> None:
        """Warn when the batch a resume replays as the ``done``-th of ``epoch`` is not the one
        the interrupted run took there (by the digest the checkpoint saved): the data drew
        their order from a generator of their own that :meth:`set_epoch` does not seed (a
        NumPy ``default_rng``, a ``torch.Generator`` not seeded from the epoch, a shuffle
        buffer), so the resumed epoch goes on with other batches than the interrupted run's."""
        batches = f"{done} batch{'es' if done != 1 else ''}"
        warnings.warn(
            f"fit: resumed after {batches} of epoch {epoch}, but the data ({_data_name(data)}) "
            f"replayed another batch {done} of that epoch (the last one skipped) than the "
            "interrupted run took: their order comes from a generator that fit does not seed "
            "(one of the dataset's own, or the GPU's), so the resumed epoch skips the first batches of another order "
            "(some examples are seen twice in it, others not at all) and the run is not the "
            "uninterrupted one. Seed the dataset's generator from the epoch (a set_epoch(epoch) "
            "method on the dataset, which fit calls before each epoch), draw the order from "
            "torch's, Python's or NumPy's global generator (fit seeds them per epoch for the "
            "data's reads), use a map-style dataset, or resume from an epoch's end.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
