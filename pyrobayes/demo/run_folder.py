"""A run folder's files, and the rule that a new run never writes over an earlier one.

:func:`pyrobayes.demo.pipeline.run` and :func:`pyrobayes.demo.causal_lm.run` (and through them
``pyrobayes demo`` / ``pyrobayes fit``) write ``config.json``, ``metrics.json``, ``table.md``,
``posterior.nc``, ``normalize.json`` (a causal-LM job with ``compare_normalize``),
``guides/*.safetensors`` and ``plots/*.png``. A folder that already holds such
files belongs to another run: it is refused unless the caller asks to replace it, and then that
run's files are removed first, so no posterior of a family the new run does not fit is left
behind next to the new metrics. A run that stops before its first result (an error, or an
interrupt: Ctrl-C, or SIGTERM on the command line) removes what it wrote
(:func:`remove_unfinished_run`), so the same command starts it again in that folder. One killed
then (SIGKILL: the OOM killer), which can remove nothing, leaves its ``config.json`` and no
``metrics.json``: :func:`claim_run_folder` lets a run of the same config take that folder over.

A job holds the folder for its whole life (:func:`claimed_run_folder`): an exclusive advisory
lock (``fcntl.flock``) on the folder itself, which the OS releases when the process dies, SIGKILL
included. A claim refuses a folder another live run holds, so the same command started twice on
one folder does not take the first one's files over while it runs. The lock is on the folder's
own descriptor, not on a file in it: nothing is added to the folder (a lock file left by SIGKILL,
or listed next to the run's files), and nothing has to be removed at release.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "RUN_FILES",
    "RUN_GLOBS",
    "RunFolderError",
    "claim_run_folder",
    "claimed_run_folder",
    "remove_unfinished_run",
    "run_files",
    "write_json",
]

logger = logging.getLogger(__name__)

#: the files of a run folder
RUN_FILES = ("config.json", "metrics.json", "table.md", "posterior.nc", "normalize.json")
#: the patterns of a run folder's per-family files
RUN_GLOBS = ("guides/*.safetensors", "plots/*.png")
#: how often a lock is taken again on a folder removed (and made again) while it was being locked
_LOCK_TRIES = 5


class RunFolderError(ValueError):
    """A run folder that cannot be used: no config, posteriors or metrics to evaluate, or, for
    a new run, the files of another run."""


def write_json(path: Path, value: Any) -> None:
    """Write ``value`` as indented JSON to ``path`` atomically: into a temporary file beside it,
    then ``os.replace``, so an interrupt or a full disk mid-write leaves the previous file whole
    (a job rewrites ``metrics.json`` after every fit: a truncated one lost every record)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(value, indent=2))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def run_files(out: str | Path) -> list[Path]:
    """The files of an earlier run in ``out`` (none for a new or an unrelated folder)."""
    folder = Path(out)
    if not folder.is_dir():
        return []
    found = [folder / name for name in RUN_FILES if (folder / name).is_file()]
    for pattern in RUN_GLOBS:
        found += sorted(folder.glob(pattern))
    return found


def _refuse_foreign_config(root: Path, folder: str) -> None:
    """Refuse ``root`` when its ``config.json`` is not a run's (a run's config names its
    ``families``): a Hugging Face model folder, say, whose config the run would overwrite (or
    ``overwrite`` delete)."""
    path = root / "config.json"
    if not path.is_file():
        return
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        record = None
    if isinstance(record, dict) and "families" in record:
        return
    what = (
        "a model's (it names a model_type)"
        if isinstance(record, dict) and "model_type" in record
        else "not a pyrobayes run's (it names no families)"
    )
    raise RunFolderError(
        f"{folder} {root}: its config.json is {what}; a run there would overwrite it, and "
        f"replacing a run would delete it. Pass another {folder} (a new folder, or one holding "
        "only a pyrobayes run)."
    )


def claim_run_folder(
    out: str | Path,
    overwrite: bool,
    *,
    folder: str = "out_dir",
    replace: str = "overwrite=True",
    config: dict[str, Any] | None = None,
) -> None:
    """Make ``out`` a folder a new run may write, or refuse.

    A folder holding an unfinished run (its ``config.json`` and no ``metrics.json``: a run
    killed before its first result by SIGKILL, as the OOM killer sends, which leaves no handler
    the chance to remove it) is taken over by a new run of the same ``config``: nothing was
    computed that the run would keep, and the same config cannot mix two runs. Its files are
    removed, with a logged warning. An unfinished run of another config is refused like any
    other run unless ``overwrite``. A folder another live run holds (:func:`claimed_run_folder`)
    is refused whatever it holds: that run is still writing there. The folder is locked while
    it is checked, so a run starting meanwhile does not lose its files to this claim; a job
    claims its folder through :func:`claimed_run_folder`, which keeps the lock.

    Parameters
    ----------
    out : path
        The run folder.
    overwrite : bool
        Replace a run already in ``out``: its files (:func:`run_files`) are removed first.
    folder, replace : str
        How the caller names the folder and the replacing option in the error message
        (``"--out"`` and ``"--overwrite"`` on the command line).
    config : dict, optional
        The config the new run writes as ``config.json`` (:func:`write_json`); compared with
        an unfinished run's after the same JSON round trip. None: no run is taken over.

    Raises
    ------
    RunFolderError
        ``out`` holds another run's files (an unfinished run's of another config included) and
        ``overwrite`` is false, or another live run (this process's other job included) holds
        ``out``.
    """
    root = Path(out)
    _refuse_file_in_path(root, folder)
    if not root.is_dir():  # nothing to claim (and nothing made: the job makes it)
        return
    with _folder_lock(root, folder):
        _claim(root, overwrite, folder, replace, config)


@contextmanager
def claimed_run_folder(
    out: str | Path,
    overwrite: bool,
    *,
    folder: str = "out_dir",
    replace: str = "overwrite=True",
    config: dict[str, Any] | None = None,
) -> Iterator[list[Path]]:
    """Claim ``out`` for a job (:func:`claim_run_folder`) and hold it until the job ends.

    ``out``, ``out/guides`` and ``out/plots`` are made, and the folder's lock is held from
    before the claim to the end of the ``with`` block, so no other run claims (or takes over)
    the folder while the job writes it; the OS releases it if the process dies. The same
    process can run a job again on the folder once the block is left. Where the OS has no
    ``fcntl.flock`` (Windows) or the file system refuses it, the folder is used unlocked
    (logged once at DEBUG).

    Parameters
    ----------
    out, overwrite, folder, replace, config
        As :func:`claim_run_folder`.

    Yields
    ------
    list of Path
        The folders the job made (of ``out``, ``guides``, ``plots``): what
        :func:`remove_unfinished_run` removes if left empty.

    Raises
    ------
    RunFolderError
        As :func:`claim_run_folder`, before anything is written.
    """
    root = Path(out)
    _refuse_file_in_path(root, folder)
    made = [d for d in (root, root / "guides", root / "plots") if not d.exists()]
    root.mkdir(parents=True, exist_ok=True)
    with _folder_lock(root, folder):
        _claim(root, overwrite, folder, replace, config)
        (root / "guides").mkdir(exist_ok=True)
        (root / "plots").mkdir(exist_ok=True)
        yield made


def _refuse_file_in_path(root: Path, folder: str) -> None:
    """Refuse ``root`` when it, or a folder above it, is a file."""
    taken = next((p for p in (root, *root.parents) if p.exists() and not p.is_dir()), None)
    if taken is not None:
        raise RunFolderError(
            f"{folder} {root}: {taken} is a file, not a folder, so the run cannot be written "
            f"there; pass another {folder} (a new or existing folder)."
        )


def _claim(
    root: Path, overwrite: bool, folder: str, replace: str, config: dict[str, Any] | None
) -> None:
    """:func:`claim_run_folder` on a folder whose lock the caller holds."""
    _refuse_foreign_config(root, folder)
    files = run_files(root)
    if not files:
        return
    if (
        not overwrite
        and config is not None
        and _unfinished_run_of(root, files, config, folder, replace)
    ):
        logger.warning(
            "%s %s holds an unfinished run of the same config (no metrics.json: it was killed "
            "before its first result, e.g. by SIGKILL); taking it over: removed %s.",
            folder,
            root,
            ", ".join(str(f.relative_to(root)) for f in files),
        )
    elif not overwrite:
        listed = ", ".join(str(f.relative_to(root)) for f in files[:4])
        more = f" and {len(files) - 4} more" if len(files) > 4 else ""
        raise RunFolderError(
            f"{folder} {root} already holds a run ({listed}{more}); writing there would "
            f"overwrite its metrics, config and posteriors. Pass {replace} to replace that run, "
            f"or another {folder}."
        )
    else:
        logger.warning("%s: replacing the run in %s", replace, root)
    for file in files:
        file.unlink()


@contextmanager
def _folder_lock(root: Path, folder: str) -> Iterator[None]:
    """Hold the exclusive lock of the folder ``root`` (made if missing) for the block."""
    fd = _lock(root, folder)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock (it belongs to this open file description)


def _lock(root: Path, folder: str) -> int | None:
    """Open ``root`` and take its exclusive lock without waiting; the descriptor holding it,
    or None where the OS cannot lock it. A folder removed (and made again) between the open
    and the lock, as a run that stopped before its first result removes its folder, is
    opened again: the lock must be on the folder at ``root``, not on a removed one.

    Raises
    ------
    RunFolderError
        Another open of the folder (another process, or another job of this one) holds it.
    """
    if fcntl is None:  # pragma: no cover - Windows
        _log_unlocked("fcntl.flock is not available on this platform")
        return None
    for _ in range(_LOCK_TRIES):
        root.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except FileNotFoundError:  # removed since the mkdir: make it again
            continue
        except OSError as err:  # a folder this user cannot open (no read permission)
            _log_unlocked(f"{type(err).__name__}: {err}")
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            _refuse_held(root, folder)
        except OSError as err:  # a file system without flock (ENOLCK, ENOSYS, EBADF...)
            os.close(fd)
            _log_unlocked(f"{type(err).__name__}: {err}")
            return None
        if _same_folder(fd, root):
            return fd
        os.close(fd)
    raise RunFolderError(
        f"{folder} {root} was removed and made again {_LOCK_TRIES} times while this run locked "
        f"it: another program is replacing it. Pass another {folder}."
    )


def _same_folder(fd: int, root: Path) -> bool:
    """Whether the open folder ``fd`` is still the one at ``root``."""
    try:
        now = os.stat(root)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


def _refuse_held(root: Path, folder: str) -> None:
    """Raise the error for a folder whose lock another run holds, naming its process when
    ``/proc/locks`` (Linux) shows it."""
    pid = _lock_holder(root)
    if pid == os.getpid():
        who = f"another job of this process (pid {pid})"
    else:
        who = f"process {pid}" if pid else "another process"
    raise RunFolderError(
        f"{folder} {root}: another run is writing there ({who} holds the folder's lock); a run "
        f"there would take over or overwrite its files. Wait for that run to end (or stop it), "
        f"or pass another {folder}."
    )


def _lock_holder(root: Path) -> int | None:
    """The pid holding the flock of the folder ``root``, from ``/proc/locks`` (None where that
    cannot tell: not Linux, or a pid of another pid namespace)."""
    try:
        info = os.stat(root)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    device = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    for line in lines:
        fields = line.split()  # "1: FLOCK ADVISORY WRITE <pid> <maj>:<min>:<inode> 0 EOF"
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == device:
            return int(fields[4]) or None
    return None


@functools.cache
def _log_unlocked(reason: str) -> None:
    """Log (DEBUG, once per reason) that run folders are used without a lock."""
    logger.debug(
        "run folders are not locked (%s): a second run started on a folder while the first "
        "writes it is not refused.",
        reason,
    )


def _canonical_json(value: Any) -> str | None:
    """``value`` as :func:`write_json` writes it, read back, then dumped with sorted keys (None
    when JSON cannot hold it): tuples are lists and keys strings on both sides, and a NaN
    equals itself."""
    try:
        return json.dumps(json.loads(json.dumps(value)), sort_keys=True)
    except (TypeError, ValueError):
        return None


def _differing_keys(saved: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """The dotted keys both configs set to values that differ after the JSON round trip."""
    from .causal_lm_config import differing_keys

    new = json.loads(json.dumps(config))
    return [
        key
        for key, mine, theirs in differing_keys(saved, new)
        if _canonical_json(mine) != _canonical_json(theirs)
    ]


def _unfinished_run_of(
    root: Path, files: Sequence[Path], config: dict[str, Any], folder: str, replace: str
) -> bool:
    """Whether ``root`` holds an unfinished run (its ``config.json``, no ``metrics.json``) of
    ``config``, which a new run takes over. False for a run with a result (or no config).

    Raises
    ------
    RunFolderError
        The unfinished run's config is another config.
    """
    path = root / "config.json"
    if path not in files or root / "metrics.json" in files:
        return False
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        saved = None
    if saved is None or _canonical_json(saved) != _canonical_json(config):
        keys = _differing_keys(saved, config) if isinstance(saved, dict) else []
        more = f" and {len(keys) - 4} more" if len(keys) > 4 else ""
        which = f" (they differ in {', '.join(keys[:4])}{more})" if keys else ""
        raise RunFolderError(
            f"{folder} {root} holds only an unfinished run (its config.json, no metrics.json: "
            f"it stopped before its first result) of another config{which}; a new run there "
            f"would mix the two. Pass {replace} to replace it, or another {folder}."
        )
    return True


def remove_unfinished_run(out: Path, made: Sequence[Path], job: str, err: BaseException) -> None:
    """Remove what a run that stopped before its first result wrote into ``out``.

    ``out`` held no run before it (:func:`claim_run_folder` refused one, or ``overwrite``
    removed it), and a run with no ``metrics.json`` computed nothing a user could keep, so its
    ``config.json`` alone would only make the same command (or the corrected config) refused
    until ``overwrite``: an interrupt (Ctrl-C, or SIGTERM, which the command line raises as a
    ``KeyboardInterrupt``) is treated as an error is.

    Parameters
    ----------
    out : Path
        The run folder.
    made : sequence of Path
        The folders the run created (``out``, ``guides``, ``plots``), removed if left empty.
    job : str
        The job the logged warning names (``"demo job"``, ``"causal-LM job"``).
    err : BaseException
        What stopped the run (a ``KeyboardInterrupt`` is worded as an interrupt).
    """
    for file in run_files(out):  # normalize.json among them (RUN_FILES)
        file.unlink(missing_ok=True)
    for folder in reversed(made):  # the folders this run made, if left empty
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    how = "was interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
    logger.warning(
        "%s %s before its first result; removed its files in %s, so the same command starts "
        "it again there.",
        job,
        how,
        out,
    )
