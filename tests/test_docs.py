"""The documentation runs: every Python block of README.md and docs/ is executed as written, and
the API reference lists every public name (every ``__all__`` entry).

Blocks are found by :mod:`tests.doc_snippets`; one test per block, id ``file:line``. A block runs
complete as shown (a fresh namespace, an empty working directory, float32 as in a user's
interpreter); only a visible ``<!-- no-run: reason -->`` marker skips one. The counts are printed
at the end of the session (``docs snippets: N ran, M skipped``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pyro
import pytest
import torch

from tests import doc_snippets

SNIPPETS = doc_snippets.all_snippets()
_SNIPPET_TEST = "test_snippet_runs"


class _SnippetSummary:
    """Prints how many blocks ran, failed and were skipped (with their reasons) at session end."""

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        counts: dict[str, list[Any]] = {}
        for outcome in ("passed", "failed", "skipped"):
            counts[outcome] = [
                r
                for r in terminalreporter.stats.get(outcome, [])
                if f"::{_SNIPPET_TEST}[" in getattr(r, "nodeid", "") and r.when in ("call", "setup")
            ]
        if not any(counts.values()):
            return
        terminalreporter.write_sep("-", "docs snippets")
        terminalreporter.write_line(
            f"docs snippets: {len(counts['passed'])} ran, {len(counts['failed'])} failed, "
            f"{len(counts['skipped'])} skipped, of {len(SNIPPETS)} Python blocks in README.md "
            "and docs/"
        )
        for snippet in SNIPPETS:
            if snippet.skip:
                terminalreporter.write_line(f"  skipped {snippet.id}: no-run: {snippet.skip}")


@pytest.fixture(scope="session", autouse=True)
def _snippet_summary(request: pytest.FixtureRequest) -> None:
    manager = request.config.pluginmanager
    if not manager.has_plugin("pyrobayes-doc-snippets"):
        manager.register(_SnippetSummary(), "pyrobayes-doc-snippets")


@pytest.fixture
def user_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """What a reader's fresh interpreter has: float32 by default, an empty working directory,
    an empty Pyro param store; matplotlib draws off-screen."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    pyro.clear_param_store()
    try:
        yield tmp_path
    finally:
        torch.set_default_dtype(dtype)
        pyro.clear_param_store()
        import sys

        if "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close("all")


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_snippet_runs(snippet: doc_snippets.Snippet, user_session: Path) -> None:
    """The block runs as written (any exception, or any warning under ``filterwarnings =
    error``, fails it)."""
    if snippet.skip:
        pytest.skip(f"no-run: {snippet.skip}")
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(doc_snippets.compiled(snippet), namespace)


def test_snippet_inventory() -> None:
    """Every Python fence of README.md and docs/ is collected (counted independently, by a plain
    line match), the README's quick start among them and not skipped, and every skip names its
    reason."""
    fences = 0
    for path in doc_snippets.markdown_files():
        text = (doc_snippets.ROOT / path).read_text(encoding="utf-8")
        fences += len(re.findall(r"^\s*```(?:python|py|python3)\s*$", text, flags=re.M))
    assert len(SNIPPETS) == fences, "a ```python fence the collector missed (or invented)"
    readme = [s for s in SNIPPETS if s.path == Path("README.md")]
    assert readme, "README.md has no Python block: where did the quick start go?"
    quick_start = readme[0]
    assert quick_start.skip is None, "the README's quick start must run exactly as written"
    assert "pb.fit(" in quick_start.code and "pb.predict(" in quick_start.code
    assert all(s.skip for s in SNIPPETS if s.skip is not None)
    ran = sum(s.skip is None for s in SNIPPETS)
    print(f"docs snippets: {ran} to run, {len(SNIPPETS) - ran} marked no-run")


def test_no_run_marker_needs_reason(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("<!-- no-run: needs a GPU -->\n```python\nx = 1\n```\n")
    (tmp_path / "docs" / "a.md").write_text("text\n\n```python\ny = 2\n```\n\n```bash\nls\n```\n")
    found = doc_snippets.all_snippets(tmp_path)
    assert [(s.id, s.skip, s.code) for s in found] == [
        ("README.md:2", "needs a GPU", "x = 1\n"),
        ("docs/a.md:3", None, "y = 2\n"),
    ]
    (tmp_path / "docs" / "a.md").write_text("<!-- no-run -->\n```python\ny = 2\n```\n")
    with pytest.raises(ValueError, match="needs a reason"):
        doc_snippets.all_snippets(tmp_path)
    (tmp_path / "docs" / "a.md").write_text("```python\ny = 2\n")
    with pytest.raises(ValueError, match="never closed"):
        doc_snippets.all_snippets(tmp_path)


def test_demo_help_names_the_default_families() -> None:
    """``pyrobayes demo --help`` states the families the demo runs when none are given."""
    from pyrobayes.cli import build_parser
    from pyrobayes.demo.pipeline import DEFAULT_CONFIG

    parser = build_parser()
    demo = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices["demo"]
    help_text = next(a.help for a in demo._actions if "--families" in a.option_strings)
    assert f"default: {','.join(DEFAULT_CONFIG['families'])})" in help_text
