"""Crash-safe checkpoints of :func:`pyrobayes.fit`: numbered generations, one pointer, a lock.

A checkpoint folder holds::

    <dir>/ckpt-000007/   posterior.safetensors  the guide + the model's point parameters
                         fitter.pt              the fitter's state (optimizer, counters)
                         rng.pt                 torch (CPU and CUDA), Python and NumPy RNG states
                         scheduler.pt           the learning-rate schedule, if any
                         best.pt                the best validated snapshot, if any
                         state.json             step, epoch, batches done (and the last one's
                                                SHA-256, compared on resume), losses, validation
    <dir>/LATEST         "ckpt-000007": the newest *complete* generation
    <dir>/.lock          held (an OS file lock) while a fit writes here

A generation is written into a temporary folder, every file is ``fsync``-ed, and the folder is
renamed to ``ckpt-NNNNNN``; only then is ``LATEST`` replaced (a temporary file,
``fsync``, ``os.replace``: the one atomic switch), and only after that are the older generations
deleted. A kill at any instant therefore leaves ``LATEST`` naming a complete generation (or no
``LATEST`` at all before the first one). Temporary folders are removed by :func:`clean` at the
next start.

A generation is *complete* when it holds ``posterior.safetensors``, ``fitter.pt``, ``rng.pt`` and
a ``state.json`` that parses as a JSON object. Nothing but a new checkpoint of the fit that holds
the folder ever deletes a complete generation: :func:`clean` removes only temporary entries, and
:func:`save_checkpoint` removes the older generations only after its own generation is complete
and ``LATEST`` names it. When ``LATEST`` is missing, unreadable, or names a missing or
incomplete generation (a folder edited by hand), :func:`latest` falls back to the newest complete
generation (with a logged warning), and :func:`holds_run` still sees it, so ``fit`` neither
restarts from step 0 over it nor deletes it without ``overwrite=True``. A ``state.json`` whose
position does not add up is refused on resume by :func:`check_position`.

The earlier layout (a single ``<dir>/last`` folder, or ``<dir>/.last-old`` after
a kill between its two renames) is still read for resume; the next checkpoint replaces it.
Checkpoint files are read with ``torch.load(weights_only=True)`` only.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from ..user_frame import user_stacklevel
from .fitter import Fitter
from .selection import Snapshot
from .settings import check_settings

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointLock",
    "check_checkpoint",
    "check_fitter_settings",
    "check_fitter_state",
    "check_position",
    "check_posterior",
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
#: the files every generation holds (``best.pt`` and ``scheduler.pt`` only when there is one)
REQUIRED = ("posterior.safetensors", "fitter.pt", "rng.pt", "state.json")

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
                    stacklevel=user_stacklevel(),
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
def _incomplete(folder: Path) -> str | None:
    """Why the generation ``folder`` cannot be resumed from (None: it is complete)."""
    if not folder.is_dir():
        return "no such folder"
    missing = [name for name in REQUIRED if not (folder / name).is_file()]
    if missing:
        return f"no {', '.join(missing)}"
    try:
        meta = json.loads((folder / "state.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"state.json is not readable JSON ({err})"
    if not isinstance(meta, dict):
        return "state.json is not a JSON object"
    return None


def _generations(directory: Path) -> list[Path]:
    """The ``ckpt-NNNNNN`` folders of ``directory``, newest first."""
    found = [
        (int(m.group(1)), entry)
        for entry in directory.iterdir()
        if (m := _GENERATION.fullmatch(entry.name)) and entry.is_dir()
    ]
    return [entry for _, entry in sorted(found, reverse=True)]


def _pointed(directory: Path) -> tuple[Path | None, str | None]:
    """The complete generation ``LATEST`` names, else None and why not (None: no ``LATEST``)."""
    pointer = directory / POINTER
    try:
        name = pointer.read_text().strip()
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError) as err:
        return None, f"{pointer} is unreadable ({err})"
    if not _GENERATION.fullmatch(name):
        return None, f"{pointer} names {name[:40]!r}, which is not a checkpoint generation"
    why = _incomplete(directory / name)
    if why is not None:
        return None, f"{pointer} names {name}, which is incomplete ({why})"
    return directory / name, None


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint in ``directory``, or None when it holds none.

    The generation ``LATEST`` names when it is complete; else (``LATEST`` missing, unreadable,
    or naming a missing or incomplete generation) the newest complete ``ckpt-NNNNNN``, with a
    logged warning; else an old-layout ``last`` (or ``.last-old``, left by a kill between its
    renames).

    Raises
    ------
    RuntimeError
        When ``directory`` holds generations but none of them is complete (files deleted or
        truncated by hand): resuming would start over and a new run would delete them, so the
        folder is refused; the message names each generation and what it lacks.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    folder, why = _pointed(directory)
    if folder is not None:
        return folder
    generations = _generations(directory)
    for generation in generations:
        if _incomplete(generation) is None:
            logger.warning(
                "%s: %s; resuming from the newest complete generation, %s.",
                directory,
                why or f"no {POINTER} pointer",
                generation.name,
            )
            return generation
    for name in _LEGACY:
        if (directory / name / "state.json").is_file():
            return directory / name
    if generations:
        listed = "; ".join(f"{g.name}: {_incomplete(g)}" for g in generations[:5])
        raise RuntimeError(
            f"Checkpoint folder {directory} holds no complete generation ({listed}"
            + (f"; {why}" if why else "")
            + "). Its files were deleted or edited by hand. Restore them to resume, or start a "
            "new run with overwrite=True (its first checkpoint replaces them), or use another "
            "checkpoint_dir."
        )
    if why is not None:
        logger.warning("%s: %s, and no checkpoint generation is left.", directory, why)
    return None


def holds_run(directory: str | Path) -> bool:
    """Whether ``directory`` holds a run's checkpoint: a generation folder (complete or not) or
    an old-layout one. A ``fit`` without ``resume`` or ``overwrite`` refuses such a folder."""
    directory = Path(directory)
    if not directory.is_dir():
        return False
    if _generations(directory):
        return True
    return any((directory / name).is_dir() for name in _LEGACY)


def clean(directory: str | Path) -> list[str]:
    """Remove the temporary folders and files a killed fit left behind (never a generation:
    :func:`save_checkpoint` drops the older ones once its own is in place). Call it holding the
    folder's :class:`CheckpointLock`. Returns the names removed."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for entry in directory.iterdir():
        if entry.name.startswith(_TEMP_PREFIXES):
            _remove(entry)
            removed.append(entry.name)
    return removed


def check_position(
    meta: Any, steps_per_epoch: int | None = None, *, source: str | Path = "state.json"
) -> None:
    """Check that a checkpoint's position (``state.json``) adds up before a fit resumes from it.

    ``step`` must equal the number of recorded ``losses`` (one per step), ``epoch`` and
    ``batch`` must be non-negative integers, and with a known ``steps_per_epoch`` (``len`` of
    the data) ``batch <= steps_per_epoch`` and ``step == epoch * steps_per_epoch + batch``.

    Parameters
    ----------
    meta : dict
        The parsed ``state.json``.
    steps_per_epoch : int, optional
        Batches per epoch of the data the fit resumes with (None: unknown, not checked).
    source : path
        The file ``meta`` was read from, named in the error.

    Raises
    ------
    ValueError
        Naming ``source`` and the fields that do not add up.
    """
    if not isinstance(meta, dict):
        raise ValueError(f"{source} is not a JSON object; the checkpoint was edited by hand.")
    problems = []
    for key in ("step", "epoch", "batch"):
        if key not in meta and key != "batch":  # "batch": not in the earlier layout
            problems.append(f"{key} is missing")
        elif key in meta and (
            not isinstance(meta[key], int) or isinstance(meta[key], bool) or meta[key] < 0
        ):
            problems.append(f"{key}={meta[key]!r} is not an integer >= 0")
    losses = meta.get("losses")
    if not isinstance(losses, list):
        problems.append("losses is not a list")
    if not problems and isinstance(losses, list):  # (the isinstance narrows for mypy)
        step, epoch, batch = meta["step"], meta["epoch"], meta.get("batch")
        if step != len(losses):
            problems.append(f"step={step} but losses holds {len(losses)} values (one per step)")
        if steps_per_epoch:
            if batch is not None and batch > steps_per_epoch:
                problems.append(
                    f"batch={batch} exceeds the {steps_per_epoch} batches per epoch of the data"
                )
            done = epoch * steps_per_epoch + (batch if batch is not None else 0)
            if batch is not None and step != done:
                problems.append(
                    f"step={step} but epoch={epoch} x {steps_per_epoch} batches per epoch + "
                    f"batch={batch} = {done}"
                )
            elif batch is None and not 0 <= step - epoch * steps_per_epoch <= steps_per_epoch:
                problems.append(
                    f"step={step} is not within epoch={epoch} of {steps_per_epoch} batches"
                )
    if problems:
        raise ValueError(
            f"{source}: the checkpoint's position does not add up: {'; '.join(problems)}. The "
            "file was edited or the data changed; resume with the data the run was started "
            "with and the checkpoint as written, or start a new run with overwrite=True."
        )


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
    """Write a new generation into ``directory``, switch ``LATEST`` to it, drop the older ones.

    Hold the folder's :class:`CheckpointLock`. Returns the new generation's folder.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
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
    for older in _generations(directory):  # this run's own generation is now in place
        if older.name != name:
            _remove(older)
    for legacy in _LEGACY:  # an old-layout checkpoint this run resumed from
        if (directory / legacy).exists():
            _remove(directory / legacy)
    return directory / name


def _load_part(path: Path) -> Any:
    """``torch.load(path, weights_only=True)`` of a checkpoint file, refused naming the file
    when it does not read (truncated, edited, or not torch's format): torch's own error names
    neither the file nor the checkpoint."""
    try:
        return torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as err:
        reason = " ".join(str(err).split())[:160] or type(err).__name__
        raise ValueError(
            f"{path} does not read as a checkpoint file ({type(err).__name__}: {reason}); the "
            "checkpoint was truncated or edited after it was written, and resuming from it "
            "would restore part of the run. Restore the file, or start a new fit "
            "(Checkpointing(..., overwrite=True))."
        ) from None


def _check_parts(folder: Path) -> None:
    """Refuse a generation whose ``rng.pt``, ``scheduler.pt`` or ``best.pt`` does not read
    (``fitter.pt``: :func:`check_fitter_state`), before anything is restored: each is loaded
    after the guide's state, when the refusal would come too late."""
    rng = _load_part(folder / "rng.pt")
    if not isinstance(rng, dict) or not isinstance(rng.get("torch"), torch.Tensor):
        raise ValueError(
            f"{folder / 'rng.pt'} holds no random-number state (a dict with 'torch'); the "
            "checkpoint was edited. Restore it, or start a new fit "
            "(Checkpointing(..., overwrite=True))."
        )
    for name in ("scheduler.pt", "best.pt"):
        if (folder / name).exists():
            _load_part(folder / name)


def check_checkpoint(
    folder: str | Path,
    guide: Any,
    scheduler: Any = None,
    *,
    steps_per_epoch: int | None = None,
) -> dict[str, Any]:
    """What :func:`load_checkpoint` refuses, checked without restoring anything; returns the
    checkpoint's ``state.json``.

    In order: ``state.json`` must be readable JSON; the posterior must be of ``guide``'s
    family (another family first: nothing else matters then); its position must add up
    (:func:`check_position`, with ``steps_per_epoch`` the batches per epoch of the data the
    fit resumes with, if known); ``scheduler`` (the resuming fit's) must be there exactly
    when the checkpoint holds a schedule's state; and ``rng.pt``, ``scheduler.pt`` and
    ``best.pt`` must read.

    Raises
    ------
    ValueError
        For an unreadable ``state.json``, a position that does not add up, a schedule that
        is not the checkpoint's, or a checkpoint file that does not read (named).
    pyrobayes.io.PosteriorMismatchError
        When the checkpoint holds another family's posterior.
    """
    from ..io import read_header
    from ..io.compatibility import _check_family

    folder = Path(folder)
    state_file = folder / "state.json"
    try:
        meta = json.loads(state_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(
            f"{state_file} is not readable JSON ({err}); the checkpoint was edited or truncated. "
            "Restore it, or start a new run with overwrite=True."
        ) from None
    if isinstance(meta, dict):  # (check_position names a state.json that is not an object)
        posterior = folder / "posterior.safetensors"
        _check_family(posterior, read_header(posterior), guide)
    check_position(meta, steps_per_epoch, source=state_file)
    _check_schedule_matches(folder, meta, scheduler)
    _check_parts(folder)
    return meta


def check_fitter_settings(folder: str | Path, fitter: Fitter) -> None:
    """Refuse the checkpoint ``folder`` when its fitter ran under other settings than
    ``fitter``'s (an ``IVON``, ``SWAG``, ``MeanField`` record, ...), before anything is
    restored (:meth:`Fitter.load_state_dict` refuses the same, but only once the guide's state
    has been loaded). A fitter without settings has nothing to compare.

    Raises
    ------
    ValueError
        Naming the settings that differ and the record to resume with.
    """
    if fitter.settings is None:
        return
    state = torch.load(Path(folder) / "fitter.pt", weights_only=True)
    check_settings(fitter, state.get("settings") if isinstance(state, dict) else None)


def check_fitter_state(folder: str | Path, fitter: Fitter) -> None:
    """Refuse the checkpoint ``folder`` when its ``fitter.pt`` would not load into ``fitter``,
    before anything is restored or reset (the fitter's ``begin`` resets what a post-hoc
    family collected; :meth:`Fitter.load_state_dict` comes after it and after the guide's
    load): the settings record (:func:`check_fitter_settings`'s check), then the optimizer's
    parameter groups, whose number and sizes must be this fit's (torch refuses another
    layout only in the load, with "a parameter group that doesn't match the size").

    Raises
    ------
    ValueError
        Naming the file, the settings or the group and both parameter counts, and the fix.
    """
    path = Path(folder) / "fitter.pt"
    state = _load_part(path)
    saved = state.get("optimizer") if isinstance(state, dict) else None
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        raise ValueError(
            f"{path} holds no optimizer state (a dict with 'optimizer' and its "
            "'param_groups'); the checkpoint was edited or written by something else. Restore "
            "it, or start a new fit (Checkpointing(..., overwrite=True))."
        )
    if fitter.settings is not None:
        check_settings(fitter, state.get("settings"))
    then = [len(g["params"]) for g in groups]
    now = [len(g["params"]) for g in fitter.optimizer.param_groups]
    if then == now:
        return
    raise ValueError(
        f"fit(): the checkpoint {path} holds the state of an optimizer over {sum(then)} "
        f"parameter tensor(s) in {len(then)} group(s) ({then}), but this fit's "
        f"{type(fitter.optimizer).__name__} steps {sum(now)} in {len(now)} ({now}): the "
        "optimizer passed (Optimization(optimizer=...)) or the parameters the fit trains "
        "(the guide's, the model's trainable_modules) are not the run's, and its state would "
        "not load. Resume with the run's optimizer and model, or start a new fit "
        "(Checkpointing(..., overwrite=True))."
    )


def check_posterior(folder: str | Path, guide: Any, model: Any) -> None:
    """Refuse the checkpoint ``folder`` when its posterior would not load into ``guide`` and
    ``model``, before anything is restored or reset (the fitter's ``begin`` resets what a
    post-hoc family collected; :func:`load_checkpoint`'s load comes after it).

    The checks of :func:`pyrobayes.io.load_state`, without loading: the file's integrity,
    family, options, sites (another adapter rank), adapter, likelihood, model settings, tensor
    shapes, point parameters and base weights.

    Parameters
    ----------
    folder : path
        A checkpoint generation (from :func:`latest`).
    guide : PosteriorGuide
        The resuming fit's guide.
    model : FineTuneModel
        The resuming fit's model.

    Raises
    ------
    pyrobayes.io.PosteriorFileError
        When ``posterior.safetensors`` is unreadable, edited or non-finite.
    pyrobayes.io.PosteriorMismatchError
        When it was written for another guide or model; the message names the field and both
        values.
    """
    from ..io import _read_verified
    from ..io.compatibility import _check_base, _check_loadable

    path = Path(folder) / "posterior.safetensors"
    header, tensors = _read_verified(path)
    _check_loadable(path, header, tensors, guide, model)
    _check_base(path, header, model)


def load_checkpoint(
    folder: str | Path,
    guide: Any,
    model: Any,
    fitter: Fitter,
    scheduler: Any = None,
    *,
    steps_per_epoch: int | None = None,
    check_base: bool = True,
) -> tuple[dict[str, Any], Snapshot | None]:
    """Restore guide, point parameters, fitter, RNG and schedule from the checkpoint ``folder``
    (from :func:`latest`); returns its ``state.json`` and the best snapshot (or None).

    :func:`check_checkpoint` runs first (the family, the position, with ``steps_per_epoch``
    the batches per epoch of the data the fit resumes with, if known, and the schedule): on
    its error nothing has been restored. ``check_base=False`` skips the base-weight
    fingerprint (one pass over the adapted layers' frozen weights) where
    :func:`check_posterior` has just compared it, as a resuming fit does.
    """
    from ..io import load_state

    folder = Path(folder)
    meta = check_checkpoint(folder, guide, scheduler, steps_per_epoch=steps_per_epoch)
    load_state(guide, folder / "posterior.safetensors", model=model, check_base=check_base)
    fitter.load_state_dict(_load_part(folder / "fitter.pt"))
    set_rng_state(_load_part(folder / "rng.pt"))
    if scheduler is not None and (folder / "scheduler.pt").exists():
        scheduler.load_state_dict(_load_part(folder / "scheduler.pt"))
    best = None
    if (folder / "best.pt").exists():
        best = Snapshot.from_dict(_load_part(folder / "best.pt"))
    return meta, best


def _check_schedule_matches(folder: Path, meta: dict[str, Any], scheduler: Any) -> None:
    """Refuse a resume whose learning-rate schedule is not the checkpointed run's: the rest of
    the run would follow another rate than the one it started (a schedule with no saved state
    would restart at step 0)."""
    if not meta.get("step"):
        return
    saved = (folder / "scheduler.pt").exists()
    if scheduler is not None and not saved:
        raise ValueError(
            f"fit(): the checkpoint {folder} was written by a fit without a learning-rate "
            "schedule, and this fit has one (Optimization(scheduler=...), or the family's "
            "default, IVON's 'cosine'). Resume with optim=pyrobayes.Optimization("
            "scheduler='constant') to continue it as it ran, or start a new fit "
            "(Checkpointing(..., overwrite=True))."
        )
    if scheduler is None and saved:
        raise ValueError(
            f"fit(): the checkpoint {folder} was written by a fit with a learning-rate "
            "schedule; pass the same Optimization(scheduler=..., warmup=...) to resume it."
        )


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
