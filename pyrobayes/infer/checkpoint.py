"""Crash-safe checkpoints of :func:`pyrobayes.fit`: numbered generations, one pointer, a lock.

A checkpoint folder holds::

    <dir>/ckpt-000007/   posterior.safetensors  the guide + the model's point parameters
                         fitter.pt              the fitter's state (optimizer, counters)
                         rng.pt                 torch (CPU and CUDA), Python and NumPy RNG states
                         scheduler.pt           the learning-rate schedule, if any
                         best.pt                the best validated snapshot, if any
                         state.json             step, epoch, batches done, losses, validation
    <dir>/LATEST         "ckpt-000007": the newest *complete* generation
    <dir>/.lock          held (an OS file lock) while a fit writes here

A generation is written into a temporary folder, every file is ``fsync``-ed, and the folder is
renamed to ``ckpt-NNNNNN``; only then is ``LATEST`` replaced (a temporary file,
``fsync``, ``os.replace``: the one atomic switch), and only after that is the previous generation
deleted. A kill at any instant therefore leaves ``LATEST`` naming a complete generation (or no
``LATEST`` at all before the first one). Temporary folders, and generations that ``LATEST`` does
not name (a kill before the switch), are removed by :func:`clean` at the next start.

The earlier layout (a single ``<dir>/last`` folder, or ``<dir>/.last-old`` after
a kill between its two renames) is still read for resume; the next checkpoint replaces it.
Checkpoint files are read with ``torch.load(weights_only=True)`` only.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from .fitter import Fitter
from .selection import Snapshot

__all__ = [
    "CheckpointLock",
    "clean",
    "holds_run",
    "latest",
    "load_checkpoint",
    "save_checkpoint",
]

POINTER = "LATEST"
LOCK = ".lock"
_GENERATION = re.compile(r"ckpt-(\d{6,})")
_TEMP_PREFIXES = (".tmp-", ".LATEST-", ".ckpt-")  # ".ckpt-": the temp folders of the old layout
_LEGACY = ("last", ".last-old")

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]
try:  # Windows
    import msvcrt
except ImportError:
    msvcrt = None  # type: ignore[assignment]


# ---------------------------------------------------------------------------------- the lock
class CheckpointLock:
    """An exclusive OS lock on ``<directory>/.lock`` while a fit writes to ``directory``.

    ``fcntl.flock`` on POSIX and ``msvcrt.locking`` on Windows, both non-blocking and released
    by the OS when the process dies (a killed fit leaves no stale lock). Where neither exists
    the folder is used unlocked, with a warning.

    Raises
    ------
    RuntimeError
        From :meth:`acquire` when another fit (in this or another process) holds the folder.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._file: IO[str] | None = None

    def acquire(self) -> CheckpointLock:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / LOCK
        handle = open(path, "a+")  # noqa: SIM115 - held open as long as the lock
        try:
            if fcntl is not None:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            elif msvcrt is not None:  # pragma: no cover - Windows
                handle.seek(0)
                msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)
            else:  # pragma: no cover
                warnings.warn(
                    f"No file locking on this platform: {self.directory} is not protected "
                    "against a second fit writing to it at the same time.",
                    RuntimeWarning,
                    stacklevel=3,
                )
        except OSError:
            handle.seek(0)
            holder = handle.read().strip()
            handle.close()
            who = f"process {holder}" if holder else "another process"
            raise RuntimeError(
                f"Checkpoint folder {self.directory} is in use by another fit ({who} holds the "
                f"lock {path}). Wait for that fit to finish, or give this one another "
                "checkpoint_dir."
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self._file = handle
        return self

    def release(self) -> None:
        handle, self._file = self._file, None
        if handle is None:
            return
        try:
            if fcntl is not None:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
            elif msvcrt is not None:  # pragma: no cover - Windows
                handle.seek(0)
                msvcrt.locking(handle.fileno(), msvcrt.LK_UNLCK, 1)
        finally:
            handle.close()

    def __enter__(self) -> CheckpointLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# ---------------------------------------------------------------------------------- the layout
def _pointed(directory: Path) -> Path | None:
    """The generation ``LATEST`` names, or None without a ``LATEST``."""
    pointer = directory / POINTER
    try:
        name = pointer.read_text().strip()
    except FileNotFoundError:
        return None
    folder = directory / name
    if not _GENERATION.fullmatch(name) or not folder.is_dir():
        raise RuntimeError(
            f"{pointer} names {name!r}, which is not a checkpoint generation in {directory}. "
            "The folder was edited by hand; restore it or start a new run with overwrite=True."
        )
    return folder


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint in ``directory``: the generation ``LATEST`` names, else
    an old-layout ``last`` (or ``.last-old``, left by a kill between its renames), else None."""
    directory = Path(directory)
    folder = _pointed(directory)
    if folder is not None:
        return folder
    for name in _LEGACY:
        if (directory / name / "state.json").is_file():
            return directory / name
    return None


def holds_run(directory: str | Path) -> bool:
    """Whether ``directory`` holds a resumable checkpoint."""
    return latest(directory) is not None


def clean(directory: str | Path) -> list[str]:
    """Remove what a killed fit left behind: temporary folders and files, generations that
    ``LATEST`` does not name, and an old-layout folder superseded by another. Call it holding
    the folder's :class:`CheckpointLock`. Returns the names removed."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    keep = latest(directory)
    removed = []
    for entry in directory.iterdir():
        name = entry.name
        stale = name.startswith(_TEMP_PREFIXES)
        stale |= bool(_GENERATION.fullmatch(name)) and entry != keep
        stale |= name in _LEGACY and entry != keep
        if stale:
            _remove(entry)
            removed.append(name)
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a folder's entries on POSIX) to the disk."""
    if path.is_dir() and os.name != "posix":  # pragma: no cover - folders can't be opened there
        return
    fd = os.open(path, os.O_RDONLY if os.name == "posix" else os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _next_name(directory: Path) -> str:
    numbers = [int(m.group(1)) for e in directory.iterdir() if (m := _GENERATION.fullmatch(e.name))]
    return f"ckpt-{max(numbers, default=0) + 1:06d}"


def _write_generation(folder: Path, parts: dict[str, Any]) -> None:
    """Write the checkpoint's files into ``folder`` and flush them."""
    from ..io import save  # local: io imports the guide registry

    guide, model = parts["guide"], parts["model"]
    save(guide, folder / "posterior.safetensors", model=model)
    torch.save(parts["fitter"], folder / "fitter.pt")
    torch.save(parts["rng"], folder / "rng.pt")
    if parts["best"] is not None:
        torch.save(parts["best"], folder / "best.pt")
    if parts["scheduler"] is not None:
        torch.save(parts["scheduler"], folder / "scheduler.pt")
    (folder / "state.json").write_text(json.dumps(parts["meta"], indent=2))
    for file in folder.iterdir():
        _fsync(file)
    _fsync(folder)


def _switch(directory: Path, name: str) -> None:
    """Point ``LATEST`` at generation ``name``: the one atomic step of a checkpoint."""
    fd, tmp = tempfile.mkstemp(prefix=".LATEST-", dir=directory)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(name + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, directory / POINTER)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync(directory)


def save_checkpoint(
    directory: str | Path,
    guide: Any,
    model: Any,
    fitter: Fitter,
    meta: dict[str, Any],
    best: Snapshot | None = None,
    scheduler: Any = None,
) -> Path:
    """Write a new generation into ``directory``, switch ``LATEST`` to it, drop the previous.

    Hold the folder's :class:`CheckpointLock`. Returns the new generation's folder.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    previous = latest(directory)
    name = _next_name(directory)
    parts = {
        "guide": guide,
        "model": model,
        "fitter": fitter.state_dict(),
        "rng": rng_state(),
        "best": None if best is None else best.to_dict(),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "meta": meta,
    }
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=directory))
    try:
        _write_generation(tmp, parts)
        os.rename(tmp, directory / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync(directory)
    _switch(directory, name)
    if previous is not None:
        _remove(previous)
    for legacy in _LEGACY:  # an old-layout checkpoint this run resumed from
        if (directory / legacy).exists():
            _remove(directory / legacy)
    return directory / name


def load_checkpoint(
    folder: str | Path, guide: Any, model: Any, fitter: Fitter, scheduler: Any = None
) -> tuple[dict[str, Any], Snapshot | None]:
    """Restore guide, point parameters, fitter, RNG and schedule from the checkpoint ``folder``
    (from :func:`latest`); returns its ``state.json`` and the best snapshot (or None)."""
    from ..io import load_state

    folder = Path(folder)
    load_state(guide, folder / "posterior.safetensors", model=model)
    fitter.load_state_dict(torch.load(folder / "fitter.pt", weights_only=True))
    set_rng_state(torch.load(folder / "rng.pt", weights_only=True))
    if scheduler is not None and (folder / "scheduler.pt").exists():
        scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
    best = None
    if (folder / "best.pt").exists():
        best = Snapshot.from_dict(torch.load(folder / "best.pt", weights_only=True))
    return json.loads((folder / "state.json").read_text()), best


# ---------------------------------------------------------------------------------- RNG
def rng_state() -> dict[str, Any]:
    """torch's CPU (and initialised CUDA) generators, Python's ``random`` and NumPy's global
    generator, in types ``torch.load(weights_only=True)`` reads."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state` (older checkpoints hold only ``"torch"``)."""
    torch.set_rng_state(state["torch"])
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        s = state["numpy"]
        keys = s["keys"].numpy().astype(np.uint32)
        np.random.set_state((s["kind"], keys, s["pos"], s["has_gauss"], s["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
