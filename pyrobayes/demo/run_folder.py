"""A run folder's files, and the rule that a new run never writes over an earlier one.

:func:`pyrobayes.demo.pipeline.run` and :func:`pyrobayes.demo.causal_lm.run` (and through them
``pyrobayes demo`` / ``pyrobayes fit``) write ``config.json``, ``metrics.json``, ``table.md``,
``posterior.nc``, ``normalize.json`` (a causal-LM job with ``compare_normalize``),
``guides/*.safetensors`` and ``plots/*.png``. A folder that already holds such
files belongs to another run: it is refused unless the caller asks to replace it, and then that
run's files are removed first, so no posterior of a family the new run does not fit is left
behind next to the new metrics. A run that stops before its first result (an error, or an
interrupt: Ctrl-C) removes what it wrote (:func:`remove_unfinished_run`), so the same command
starts it again in that folder.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "RUN_FILES",
    "RUN_GLOBS",
    "RunFolderError",
    "claim_run_folder",
    "remove_unfinished_run",
    "run_files",
    "write_json",
]

logger = logging.getLogger(__name__)

#: the files of a run folder
RUN_FILES = ("config.json", "metrics.json", "table.md", "posterior.nc", "normalize.json")
#: the patterns of a run folder's per-family files
RUN_GLOBS = ("guides/*.safetensors", "plots/*.png")


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
    out: str | Path, overwrite: bool, *, folder: str = "out_dir", replace: str = "overwrite=True"
) -> None:
    """Make ``out`` a folder a new run may write, or refuse.

    Parameters
    ----------
    out : path
        The run folder.
    overwrite : bool
        Replace a run already in ``out``: its files (:func:`run_files`) are removed first.
    folder, replace : str
        How the caller names the folder and the replacing option in the error message
        (``"--out"`` and ``"--overwrite"`` on the command line).

    Raises
    ------
    RunFolderError
        ``out`` holds another run's files and ``overwrite`` is false.
    """
    root = Path(out)
    taken = next((p for p in (root, *root.parents) if p.exists() and not p.is_dir()), None)
    if taken is not None:
        raise RunFolderError(
            f"{folder} {root}: {taken} is a file, not a folder, so the run cannot be written "
            f"there; pass another {folder} (a new or existing folder)."
        )
    _refuse_foreign_config(root, folder)
    files = run_files(out)
    if not files:
        return
    if not overwrite:
        listed = ", ".join(str(f.relative_to(root)) for f in files[:4])
        more = f" and {len(files) - 4} more" if len(files) > 4 else ""
        raise RunFolderError(
            f"{folder} {root} already holds a run ({listed}{more}); writing there would "
            f"overwrite its metrics, config and posteriors. Pass {replace} to replace that run, "
            f"or another {folder}."
        )
    logger.warning("%s: replacing the run in %s", replace, root)
    for file in files:
        file.unlink()


def remove_unfinished_run(out: Path, made: Sequence[Path], job: str, err: BaseException) -> None:
    """Remove what a run that stopped before its first result wrote into ``out``.

    ``out`` held no run before it (:func:`claim_run_folder` refused one, or ``overwrite``
    removed it), and a run with no ``metrics.json`` computed nothing a user could keep, so its
    ``config.json`` alone would only make the same command (or the corrected config) refused
    until ``overwrite``: an interrupt (Ctrl-C) is treated as an error is.

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
