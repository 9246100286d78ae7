"""The import graph of ``pyrobayes``, read with :mod:`ast`: no cycles, and the package layering.

Every module of the package is parsed (nothing is imported). Each ``import`` / ``from … import``
inside the package is an edge ``importer → target`` with its line and its scope:

* ``module``: executed when the importer is imported (top level, class bodies, ``try`` blocks);
* ``function``: inside a function body, executed when the function runs (lazy imports);
* ``typing``: under ``if TYPE_CHECKING:``, never executed.

Relative imports are resolved against the importer's package; ``from pkg import name`` is an edge
to ``pkg.name`` when that is a module, else to ``pkg``. Importing ``a.b.c`` also runs the
``__init__`` of ``a.b`` (and ``a``), so a module-level edge to ``a.b.c`` adds one to the package
``a.b`` unless the importer already lives inside ``a.b`` (then ``a.b`` is being initialised and
is not entered again).

Cycles are counted over module-level edges only: a function-local import is how a cycle is
broken, and the layering rules below cover every scope. Run this file with ``python`` to print the
function-local imports inside the package.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

PACKAGE = "pyrobayes"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


@dataclass(frozen=True)
class Edge:
    importer: str
    target: str
    line: int
    statement: str
    scope: str  # "module", "function" or "typing"
    implicit: bool = False  # the package __init__ run on the way to an explicit target

    def __str__(self) -> str:
        path = modules()[self.importer].relative_to(ROOT.parent).as_posix()
        via = f" (runs {self.target}'s __init__)" if self.implicit else ""
        return f"{self.importer} ({path}:{self.line}) `{self.statement}`{via}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by the name of its ``__init__``)."""
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return modules()[name].name == "__init__.py"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement of ``tree`` with its scope."""
    found: list[tuple[ast.Import | ast.ImportFrom, str]] = []

    def visit(node: ast.AST, scope: str) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append((node, scope))
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            scope = "function" if scope == "module" else scope
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, "typing")
            for child in node.orelse:
                visit(child, scope)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, "module")
    return found


def _resolve(importer: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The package modules ``node`` imports (absolute, dotted)."""
    known = modules()
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == PACKAGE]
    if node.level:
        package = importer if _is_package(importer) else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    if base.split(".")[0] != PACKAGE:
        return []
    targets = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        targets.append(sub if sub in known else base)
    return list(dict.fromkeys(targets))


@cache
def edges() -> tuple[Edge, ...]:
    """Every import edge inside the package, implicit package ``__init__`` edges included."""
    out: list[Edge] = []
    for name, path in modules().items():
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source, filename=str(path))
        for node, scope in _imports(tree):
            statement = " ".join(ast.get_source_segment(source, node).split())
            for target in _resolve(name, node):
                if target != name:
                    out.append(Edge(name, target, node.lineno, statement, scope))
                # the packages entered on the way to target (not those the importer is inside)
                parts = target.split(".")
                for k in range(2, len(parts)):
                    pkg = ".".join(parts[:k])
                    if pkg != name and not name.startswith(pkg + "."):
                        out.append(Edge(name, pkg, node.lineno, statement, scope, implicit=True))
    return tuple(out)


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return components


def _shortest_cycle(graph: dict[str, set[str]], start: str, inside: set[str]) -> list[str]:
    """``[start, …, start]``, a shortest cycle through ``start`` within ``inside``."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ()) & inside):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return []


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _shortest_cycle(graph, "b", {"a", "b", "c"}) == ["b", "c", "a", "b"]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_module_parses_and_relative_imports_resolve():
    assert f"{PACKAGE}.cli" in modules() and f"{PACKAGE}.models" in modules()
    unknown = [str(e) for e in edges() if e.target not in modules()]
    assert not unknown, "imports of modules that do not exist:\n" + "\n".join(unknown)


def test_no_import_cycle_at_module_level():
    module_edges = [e for e in edges() if e.scope == "module"]
    graph: dict[str, set[str]] = defaultdict(set)
    for e in module_edges:
        graph[e.importer].add(e.target)
    messages = []
    for component in _cycles(graph):
        inside = set(component)
        path = _shortest_cycle(graph, component[0], inside)
        steps = [
            next(str(e) for e in module_edges if e.importer == v and e.target == w)
            for v, w in zip(path[:-1], path[1:], strict=True)
        ]
        messages.append(
            f"import cycle {' -> '.join(path)}:\n  "
            + "\n  ".join(steps)
            + f"\n  (strongly connected: {component})"
        )
    assert not messages, "\n".join(messages)


def _violations(importer: Callable[[str], bool], forbidden: tuple[str, ...]) -> list[str]:
    """Explicit edges (any scope) from modules ``importer`` accepts to modules under ``forbidden``."""
    return [
        f"{e} imports {e.target}"
        for e in edges()
        if not e.implicit and importer(e.importer) and any(_in(e.target, p) for p in forbidden)
    ]


def _under(package: str) -> Callable[[str], bool]:
    return lambda module: _in(module, package)


def test_models_import_no_guides_infer_diagnostics_or_demo():
    bad = _violations(
        _under(f"{PACKAGE}.models"),
        tuple(f"{PACKAGE}.{p}" for p in ("guides", "infer", "diagnostics", "demo")),
    )
    assert not bad, "models/ must not depend on the layers above it:\n" + "\n".join(bad)


def test_diagnostics_import_nothing_from_demo():
    bad = _violations(_under(f"{PACKAGE}.diagnostics"), (f"{PACKAGE}.demo",))
    assert not bad, "diagnostics/ must not depend on the demo application:\n" + "\n".join(bad)


def test_only_the_cli_imports_the_demo():
    demo, cli = f"{PACKAGE}.demo", f"{PACKAGE}.cli"
    bad = _violations(lambda m: not _in(m, demo) and m != cli, (demo,))
    assert not bad, "only demo/ and cli.py may import the demo application:\n" + "\n".join(bad)


def test_diagnostics_and_demo_import_no_private_names():
    # what one module needs from another is a public, documented function of that module
    bad = []
    for name, path in modules().items():
        if not (_in(name, f"{PACKAGE}.diagnostics") or _in(name, f"{PACKAGE}.demo")):
            continue
        source = path.read_text(encoding="utf-8")
        for node, _ in _imports(ast.parse(source)):
            if not isinstance(node, ast.ImportFrom) or not _resolve(name, node):
                continue
            private = [
                a.name for a in node.names if a.name.startswith("_") and not a.name.endswith("__")
            ]
            if private:
                statement = " ".join(ast.get_source_segment(source, node).split())
                where = f"{path.relative_to(ROOT.parent).as_posix()}:{node.lineno}"
                bad.append(f"{name} ({where}) `{statement}` imports {private}")
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_guides_import_nothing_from_infer():
    bad = _violations(_under(f"{PACKAGE}.guides"), (f"{PACKAGE}.infer",))
    assert not bad, "guides/ must not depend on infer/:\n" + "\n".join(bad)


def test_the_layering_check_names_the_offending_import():
    # the checks above are only as good as the resolution: a known edge must be found by name
    found = [e for e in edges() if e.importer == f"{PACKAGE}.cli" and not e.implicit]
    assert any(e.target == f"{PACKAGE}.demo.pipeline" for e in found), [str(e) for e in found]
    assert all("cli.py:" in str(e) and "`" in str(e) for e in found)


# ------------------------------------------------------------------------ function sizes
#: No function in the package is longer than this many lines, its docstring excluded.
MAX_FUNCTION_LINES = 80

#: The exceptions, each with its reason in docs/architecture.md ("Function size"); a name here
#: that is no longer over the limit fails the test, so the list only shrinks.
LONG_FUNCTIONS: set[str] = set()


@dataclass(frozen=True)
class FunctionSize:
    where: str  # "path::Class.function"
    line: int
    body_lines: int  # from the `def` line (signature included) to the last, docstring excluded
    parameters: int  # every parameter, *args and **kwargs included, self/cls not


def function_sizes() -> list[FunctionSize]:
    """Every function and method of the package, with its body length and parameter count."""
    out = []
    for path in modules().values():
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = path.relative_to(ROOT.parent).as_posix()

        def visit(node: ast.AST, prefix: str, rel: str = rel) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")
                elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                    # the whole definition (signature, comments and blank lines included) less
                    # its docstring's lines, decorators excluded
                    lines = child.end_lineno - child.lineno + 1  # type: ignore[operator]
                    if ast.get_docstring(child, clean=False) is not None:
                        doc = child.body[0]
                        lines -= doc.end_lineno - doc.lineno + 1  # type: ignore[operator]
                    a = child.args
                    params = [*a.posonlyargs, *a.args, *a.kwonlyargs]
                    count = len(params) + (a.vararg is not None) + (a.kwarg is not None)
                    if prefix and params and params[0].arg in ("self", "cls"):
                        count -= 1
                    name = f"{rel}::{prefix}{child.name}"
                    out.append(FunctionSize(name, child.lineno, lines, count))
                    visit(child, f"{prefix}{child.name}.<locals>.")

        visit(tree, "")
    return out


def test_no_function_is_longer_than_the_limit():
    sizes = {f.where: f for f in function_sizes()}
    long = {w for w, f in sizes.items() if f.body_lines > MAX_FUNCTION_LINES}
    new = sorted(long - LONG_FUNCTIONS)
    assert not new, (
        f"functions over {MAX_FUNCTION_LINES} lines (docstring excluded): "
        + ", ".join(f"{w} ({sizes[w].body_lines})" for w in new)
        + "; split them into functions that each do one thing"
    )
    fixed = sorted(LONG_FUNCTIONS - long)
    assert not fixed, f"no longer over the limit, remove from LONG_FUNCTIONS: {fixed}"


def test_function_sizes_are_measured_without_the_docstring():
    sizes = {f.where: f for f in function_sizes()}
    fit = sizes["pyrobayes/infer/loop.py::fit"]
    assert fit.body_lines < 40  # its docstring alone is longer
    # model, guide, data, epochs, lr, seed and the four groups (21 before the groups; the
    # earlier keywords go through the _earlier_keywords decorator for one release)
    assert fit.parameters <= 10
    assert sizes["pyrobayes/infer/loop.py::_Loop._step"].parameters == 1  # self not counted


if __name__ == "__main__":  # the function-local imports inside the package
    for e in sorted(edges(), key=lambda e: (e.importer, e.line)):
        if e.scope == "function" and not e.implicit:
            print(e)
