"""The documentation runs: every Python block of README.md and docs/ is executed as written, and
the API reference lists every public name (every ``__all__`` entry).

Blocks are found by :mod:`tests.doc_snippets`; one test per block, id ``file:line``. A block runs
complete as shown (a fresh namespace, an empty working directory, float32 as in a user's
interpreter); only a visible ``<!-- no-run: reason -->`` marker skips one. The counts are printed
at the end of the session (``docs snippets: N ran, M skipped``; ``tests/conftest.py`` calls
:func:`tests.doc_snippets.write_summary`).
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


def test_docs_cite_no_internal_design_files() -> None:
    """Users have README.md, docs/ and the code; the project's internal design notes are not
    theirs to read, so the docs never point at them."""
    cited = [
        f"{path}:{n}"
        for path in doc_snippets.markdown_files()
        for n, line in enumerate((doc_snippets.ROOT / path).read_text().splitlines(), 1)
        if re.search(r"DESIGN\.md|SPECS|shared/", line)
    ]
    assert not cited, f"docs cite internal design files at {cited}"


def test_demo_help_names_the_default_families() -> None:
    """``pyrobayes demo --help`` states the families the demo runs when none are given."""
    from pyrobayes.cli import build_parser
    from pyrobayes.demo.pipeline import DEFAULT_CONFIG

    parser = build_parser()
    demo = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices["demo"]
    help_text = next(a.help for a in demo._actions if "--families" in a.option_strings)
    assert f"default: {','.join(DEFAULT_CONFIG['families'])})" in help_text


# ------------------------------------------------------------------------------------------------
# the API reference: every public name, generated from __all__
# ------------------------------------------------------------------------------------------------

#: not library API: the demo application behind ``pyrobayes demo`` (documented in the README)
_NOT_API = {"pyrobayes.demo"}
#: public modules that no ``__all__`` lists: the errors of ``pb.load``, the written contract and
#: (when present) the conformance kit
_ALSO_PUBLIC = ("pyrobayes.io", "pyrobayes.contract", "pyrobayes.testing")


def _api_hook() -> Any:
    import importlib.util

    path = doc_snippets.ROOT / "docs" / "hooks" / "api_reference.py"
    spec = importlib.util.spec_from_file_location("_pyrobayes_api_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def public_modules() -> list[str]:
    """``pyrobayes``, the modules of its ``__all__``, its subpackages (not the demo) and
    ``_ALSO_PUBLIC``: each must have an API page."""
    import importlib
    import importlib.util
    import pkgutil
    import types

    import pyrobayes

    found = ["pyrobayes"]
    found += [
        v.__name__
        for v in map(pyrobayes.__dict__.get, pyrobayes.__all__)
        if isinstance(v, types.ModuleType)
    ]
    found += [
        f"pyrobayes.{m.name}"
        for m in pkgutil.iter_modules(pyrobayes.__path__)
        if m.ispkg and not m.name.startswith("_")
    ]
    found += [m for m in _ALSO_PUBLIC if importlib.util.find_spec(m) is not None]
    return [m for m in dict.fromkeys(found) if m not in _NOT_API]


def _documented_names(module_name: str) -> list[str]:
    """Every dotted name the reference must hold for ``module_name``: its ``__all__`` entries,
    and those of the submodules it lists, recursively."""
    import importlib
    import types

    module = importlib.import_module(module_name)
    names = []
    for name in module.__all__:
        value = getattr(module, name)
        names.append(f"{module_name}.{name}")
        if isinstance(value, types.ModuleType) and value.__name__.startswith(module_name + "."):
            names += _documented_names(value.__name__)
    return names


def _api_pages() -> dict[str, str]:
    api = doc_snippets.ROOT / "docs" / "api"
    return {f"api/{p.name}": p.read_text(encoding="utf-8") for p in sorted(api.glob("*.md"))}


def test_every_public_module_has_an_api_page() -> None:
    hook = _api_hook()
    marked = {m for text in _api_pages().values() for m in hook.markers(text)}
    missing = [m for m in public_modules() if m not in marked]
    assert not missing, (
        f"public modules without an API page: {missing}; add docs/api/<name>.md holding the "
        "line <!-- api: <module> --> and list it in mkdocs.yml's nav"
    )


def test_api_pages_list_every_all_name() -> None:
    """The pages as the hook writes them hold a ``::: name`` block (or a section, for a module)
    for every ``__all__`` name of every public module, the exceptions of ``pb.load`` included."""
    hook = _api_hook()
    pages = _api_pages()
    owner = {m: page for page, text in pages.items() for m in hook.markers(text)}
    written = "\n".join(
        hook.expand(m, 2, owner, page) for page, text in pages.items() for m in hook.markers(text)
    )
    blocks = set(re.findall(r"^::: ([\w.]+)$", written, flags=re.M))
    expected = [n for m in public_modules() for n in _documented_names(m)]
    assert len(expected) > 100
    missing = [n for n in expected if n not in blocks]
    assert not missing, f"__all__ names missing from the API pages: {missing}"
    assert {"pyrobayes.io.PosteriorFileError", "pyrobayes.io.PosteriorMismatchError"} <= blocks


def test_api_hook_refuses_a_module_without_all(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "no_all_here.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="no_all_here has no __all__"):
        _api_hook().expand("no_all_here")
    (tmp_path / "all_too_long.py").write_text("__all__ = ['x', 'y']\nx = 1\n")
    with pytest.raises(ValueError, match=r"all_too_long.__all__ lists \['y'\]"):
        _api_hook().expand("all_too_long")


def test_every_docs_page_is_in_the_nav() -> None:
    import yaml

    config = yaml.safe_load((doc_snippets.ROOT / "mkdocs.yml").read_text(encoding="utf-8"))

    def pages(node: Any) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [p for item in node for p in pages(item)]
        if isinstance(node, dict):
            return [p for value in node.values() for p in pages(value)]
        return []

    in_nav = set(pages(config["nav"]))
    docs = doc_snippets.ROOT / "docs"
    on_disk = {p.relative_to(docs).as_posix() for p in docs.rglob("*.md")}
    assert on_disk - in_nav == set(), "docs pages missing from mkdocs.yml's nav"
    assert in_nav - on_disk == set(), "mkdocs.yml's nav names pages that do not exist"


@pytest.mark.integration
def test_built_reference_lists_every_all_name(tmp_path: Path) -> None:
    """``mkdocs build --strict`` succeeds and its object inventory holds every ``__all__`` name
    of every public module (what a reader can find and link)."""
    import subprocess
    import sys
    import zlib

    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings_handlers.python", reason="pip install -e '.[docs]'")
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=doc_snippets.ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    *header, compressed = (site / "objects.inv").read_bytes().split(b"\n", 4)
    assert header[0].startswith(b"# Sphinx inventory version 2")
    body = zlib.decompress(compressed).decode()
    inventory = {line.split()[0] for line in body.splitlines() if line.strip()}
    missing = [n for m in public_modules() for n in _documented_names(m) if n not in inventory]
    assert not missing, f"__all__ names missing from the built reference: {missing}"
