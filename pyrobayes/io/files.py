"""Writing a posterior file atomically (a temporary file next to the target, flushed, then
``os.replace``) and opening one, with OS errors that name the user's path and the fix."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .format import _HEADER_KEY, PosteriorFileError


def _os_error(err: OSError, message: str) -> OSError:
    """An error of ``err``'s type (``FileNotFoundError``, ``PermissionError``, ...) and errno
    whose message names the user's path and the fix instead of an internal file."""
    try:
        return type(err)(err.errno, message) if err.errno is not None else type(err)(message)
    except TypeError:  # an OSError subclass with another constructor
        return OSError(err.errno, message)


def _blocking_file(folder: Path) -> Path | None:
    """The first of ``folder`` and its parents (outermost first) that exists but is not a
    folder: what keeps ``folder`` from being created."""
    for candidate in [*reversed(folder.parents), folder]:
        if candidate.exists() and not candidate.is_dir():
            return candidate
    return None


def _target_folder(path: Path) -> None:
    """Refuse a ``path`` that cannot be a file, and create its folder, with errors that name
    ``path`` (not the temporary file ``save`` writes first)."""
    if path.is_dir():
        raise IsADirectoryError(
            errno.EISDIR,
            f"pb.save: {path} is a folder, not a file name; pass the path of the file to write "
            f"in it, e.g. {path / 'posterior.safetensors'}.",
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        blocker = _blocking_file(path.parent)
        if blocker is not None:
            raise NotADirectoryError(
                errno.ENOTDIR,
                f"pb.save: cannot write {path}: {blocker} is a file, not a folder"
                + ("" if blocker == path.parent else f", so {path.parent} cannot be created")
                + f". Save to a path whose parent folders are folders (or move {blocker} away).",
            ) from err
        raise _os_error(
            err,
            f"pb.save: cannot create the folder {path.parent} for {path}: "
            f"{err.strerror or err}. Save to a folder you can write to.",
        ) from err


def _umask() -> int:
    """The process's umask (read by setting it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_atomic(path: Path, tensors: dict[str, torch.Tensor], header: str) -> None:
    """``save_file`` into a temporary file next to ``path``, flushed, then ``os.replace``."""
    _target_folder(path)
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise _os_error(
            err,
            f"pb.save: cannot write {path}: cannot create a file in {path.parent} "
            f"({err.strerror or err}). Save to a folder you can write to.",
        ) from err
    os.close(fd)
    tmp = Path(name)
    try:
        save_file(tensors, str(tmp), metadata={_HEADER_KEY: header})
        # mkstemp's file is 0600: give it the mode a plain open() would (an existing file's,
        # or 0666 less the umask), so that the posterior stays readable as before
        os.chmod(tmp, path.stat().st_mode & 0o7777 if path.is_file() else 0o666 & ~_umask())
        with tmp.open("rb") as handle:
            os.fsync(handle.fileno())
        try:
            os.replace(tmp, path)
        except OSError as err:
            hint = (
                f"{path} is a folder; pass the path of a file in it"
                if path.is_dir()
                else "save to a path you can write to"
            )
            raise _os_error(
                err,
                f"pb.save: cannot move the written posterior into place at {path} "
                f"({err.strerror or err}); {hint}. Nothing was written.",
            ) from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if os.name == "posix":  # the rename itself reaches the disk
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _check_readable(path: str | Path) -> None:
    """A ``path`` that is no file gets an error naming it and the fix: ``FileNotFoundError``
    (missing), ``IsADirectoryError`` (a folder, with the posterior files in it)."""
    target = Path(path)
    if target.is_dir():
        found = sorted(p.name for p in target.glob("*.safetensors"))
        more = f" and {len(found) - 5} more" if len(found) > 5 else ""
        listed = f" (posterior files in it: {found[:5]}{more})" if found else ""
        raise IsADirectoryError(
            errno.EISDIR,
            f"{path} is a folder, not a posterior file{listed}; pass the path of the "
            ".safetensors file pb.save wrote.",
        )
    if not target.exists():
        where = (
            f"the folder {target.parent} exists but holds no such file"
            if target.parent.is_dir()
            else f"the folder {target.parent} does not exist"
        )
        raise FileNotFoundError(
            errno.ENOENT,
            f"No posterior file at {path} ({where}); pass the path pb.save wrote to.",
        )


def _safe_open(path: str | Path) -> Any:
    """``safe_open(path)`` on the CPU; the OS errors it can raise name ``path`` and the fix."""
    _check_readable(path)
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except OSError as err:
        raise _os_error(
            err, f"cannot read the posterior file {path}: {err.strerror or err}."
        ) from err


def _open_error(path: str | Path, err: Exception) -> PosteriorFileError:
    return PosteriorFileError(
        f"{path} cannot be read as a pyrobayes posterior file (truncated, or not a safetensors "
        f"file): {err}"
    )
