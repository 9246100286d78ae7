"""An MkDocs hook that writes the API reference from the modules' ``__all__``.

A page under ``docs/api/`` holds a marker line ``<!-- api: pyrobayes.infer -->``; at build time
the hook replaces it with the module's docstring and one mkdocstrings block (``::: name``) per
name of the module's ``__all__``, in that order. A name that is itself a module is expanded the
same way one heading level down, after the module's own objects, unless another page documents
it (then a link to that page).
A name added to an ``__all__`` is therefore in the reference at the next build with no edit
here; ``tests/test_docs.py`` checks that every public module has a marker.

Registered in ``mkdocs.yml`` (``hooks:``); :func:`expand` is also what the test reads.
"""

from __future__ import annotations

import importlib
import posixpath
import re
from pathlib import Path
from types import ModuleType
from typing import Any

MARKER = re.compile(r"^<!--\s*api:\s*(?P<module>[\w.]+)\s*-->\s*$", re.M)

#: module name -> the docs-relative page whose marker documents it (filled by ``on_files``)
_PAGES: dict[str, str] = {}


def markers(markdown: str) -> list[str]:
    """The modules named by the ``<!-- api: module -->`` markers of a page."""
    return [m["module"] for m in MARKER.finditer(markdown)]


def _is_submodule(parent: ModuleType, value: Any) -> bool:
    return isinstance(value, ModuleType) and value.__name__.startswith(parent.__name__ + ".")


def _block(path: str, level: int, **options: Any) -> str:
    lines = [f"::: {path}", "    options:", f"      heading_level: {level}"]
    lines += [f"      {key}: {str(value).lower()}" for key, value in options.items()]
    return "\n".join(lines)


def expand(
    module_name: str, level: int = 2, pages: dict[str, str] | None = None, page: str = ""
) -> str:
    """The markdown that documents ``module_name``: its docstring, then each ``__all__`` name.

    Parameters
    ----------
    module_name : str
        An importable module with an ``__all__``.
    level : int
        Heading level of the names (the module's own heading is not repeated).
    pages : dict of str to str, optional
        Modules documented by a page of their own (module -> page path): linked, not expanded.
    page : str
        The path of the page being written (for the relative links).

    Raises
    ------
    ValueError
        The module has no ``__all__`` (what is public would be a guess), or its ``__all__``
        names something it does not define.
    """
    pages = _PAGES if pages is None else pages
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        raise ValueError(
            f"docs/hooks/api_reference.py: {module_name} has no __all__; the API reference lists "
            "a module's __all__, so define it (the public names, in reading order)."
        )
    parts = [_block(module_name, level, show_root_heading=False, members=False)]
    missing = [name for name in names if not hasattr(module, name)]
    if missing:
        raise ValueError(
            f"docs/hooks/api_reference.py: {module_name}.__all__ lists {missing}, which the "
            "module does not define; define or import them, or drop them from __all__."
        )
    values = {name: getattr(module, name) for name in names}
    # the module's own objects first, then its submodules (each a section of its own)
    for name in sorted(names, key=lambda n: _is_submodule(module, values[n])):
        path = f"{module_name}.{name}"
        value = values[name]
        if _is_submodule(module, value) and pages.get(value.__name__, page) != page:
            target = posixpath.relpath(pages[value.__name__], posixpath.dirname(page) or ".")
            parts.append(f"{'#' * level} `{path}`\n\nDocumented on [its own page]({target}).")
        elif _is_submodule(module, value):
            parts.append(f"{'#' * level} `{path}`")
            parts.append(expand(value.__name__, level + 1, pages, page))
        else:
            parts.append(_block(path, level, show_root_heading=True, show_root_full_path=False))
    return "\n\n".join(parts)


def on_files(files: Any, config: Any) -> Any:
    """Record which page documents which module (for links between pages)."""
    _PAGES.clear()
    for file in files:
        if file.src_uri.endswith(".md"):
            text = Path(file.abs_src_path).read_text(encoding="utf-8")
            for module in markers(text):
                _PAGES.setdefault(module, file.src_uri)
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace each ``<!-- api: module -->`` marker by the module's reference."""
    src = page.file.src_uri
    return MARKER.sub(lambda m: expand(m["module"], 2, _PAGES, src), markdown)
