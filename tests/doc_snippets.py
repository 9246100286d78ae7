"""The Python blocks of README.md and docs/: found, marked and run by ``tests/test_docs.py``.

Every fenced block whose info string is ``python`` (or ``py``) is a snippet. It must be complete
as shown: it runs in a fresh namespace, in an empty working directory, with torch's default
dtype float32 (what a user's interpreter has), and defines every name it uses. A snippet that
cannot run here (it needs a GPU, the Hugging Face hub or ``torchrun``) carries a visible marker
as the last non-blank line above its fence::

    <!-- no-run: needs a CUDA device -->

and is reported as skipped with that reason. A marker without a reason is an error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
_NO_RUN = re.compile(r"^\s*<!--\s*no-run\s*(?::\s*(?P<reason>.*?))?\s*-->\s*$")
PYTHON_INFO = ("python", "py", "python3")


@dataclass(frozen=True)
class Snippet:
    """One fenced Python block of a markdown file.

    Attributes
    ----------
    path : Path
        The markdown file, relative to the repository root.
    line : int
        1-based line of the opening fence.
    code : str
        The block's text (its fence's indentation removed).
    skip : str or None
        The reason of a ``<!-- no-run: reason -->`` marker (the last non-blank line above the
        fence), else None.
    """

    path: Path
    line: int
    code: str
    skip: str | None

    @property
    def id(self) -> str:
        """``file:line`` of the opening fence (the pytest id)."""
        return f"{self.path.as_posix()}:{self.line}"


def markdown_files(root: Path = ROOT) -> list[Path]:
    """README.md and every ``docs/**/*.md``, relative to ``root``, in a stable order."""
    files = [Path("README.md")] if (root / "README.md").is_file() else []
    files += sorted(p.relative_to(root) for p in (root / "docs").rglob("*.md"))
    return files


def snippets(path: Path, root: Path = ROOT) -> list[Snippet]:
    """The Python blocks of one markdown file (``path`` relative to ``root``).

    Raises
    ------
    ValueError
        A fence is left open at the end of the file, or a ``no-run`` marker gives no reason.
    """
    lines = (root / path).read_text(encoding="utf-8").splitlines()
    found: list[Snippet] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        end = i + 1
        while end < len(lines):
            closing = _FENCE.match(lines[end])
            if closing and closing["fence"].startswith(fence) and not closing["info"]:
                break
            end += 1
        else:
            raise ValueError(f"{path}:{i + 1}: the code fence is never closed; close it.")
        if opening["info"].lower() in PYTHON_INFO:
            previous = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
            marker = _NO_RUN.match(previous)
            skip = None
            if marker is not None:
                skip = (marker["reason"] or "").strip()
                if not skip:
                    raise ValueError(
                        f"{path}:{i}: a no-run marker needs a reason: "
                        "<!-- no-run: what the block needs that the tests lack -->."
                    )
            code = "\n".join(
                ln[indent:] if ln[:indent].isspace() else ln for ln in lines[i + 1 : end]
            )
            found.append(Snippet(path, i + 1, code + "\n", skip))
        i = end + 1
    return found


def all_snippets(root: Path = ROOT) -> list[Snippet]:
    """Every Python block of README.md and docs/, file by file, top to bottom."""
    return [s for path in markdown_files(root) for s in snippets(path, root)]


def compiled(snippet: Snippet):
    """The block compiled with its markdown line numbers (tracebacks point into the file)."""
    source = "\n" * snippet.line + snippet.code
    return compile(source, str(ROOT / snippet.path), "exec", dont_inherit=True)


#: the parametrized test that runs the blocks (``tests/test_docs.py``)
SNIPPET_TEST = "test_docs.py::test_snippet_runs["


def write_summary(terminalreporter: Any) -> None:
    """Print how many blocks ran, failed and were skipped (and why) at the end of a session
    that ran any (``pytest_terminal_summary`` of ``tests/conftest.py``; under pytest-xdist the
    controller sees every worker's reports)."""
    counts: dict[str, set[str]] = {}
    for outcome in ("passed", "failed", "error", "skipped"):
        counts[outcome] = {
            r.nodeid
            for r in terminalreporter.stats.get(outcome, [])
            if SNIPPET_TEST in getattr(r, "nodeid", "")
            and (r.when == "call" or outcome != "passed")
        }
    if not any(counts.values()):
        return
    found = all_snippets()
    failed = counts["failed"] | counts["error"]
    terminalreporter.write_sep("-", "docs snippets")
    terminalreporter.write_line(
        f"docs snippets: {len(counts['passed'])} ran, {len(failed)} failed, "
        f"{len(counts['skipped'])} skipped, of {len(found)} Python blocks in README.md and docs/"
    )
    for snippet in found:
        if snippet.skip:
            terminalreporter.write_line(f"  skipped {snippet.id}: no-run: {snippet.skip}")
