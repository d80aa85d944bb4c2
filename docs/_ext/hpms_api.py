"""Sphinx directives that document every name of a module's ``__all__`` from its docstring.

``.. hpms-api:: hyper_parallel_ms.nn`` expands to ``autoclass`` / ``autofunction`` entries (and a
``py:data`` entry for constants) for each exported name, in ``__all__``'s order, so the reference
follows the code; ``.. hpms-api-toplevel::`` lists ``hyper_parallel_ms.__all__`` with a link to the
entry of each name in the module that documents it.
"""
from __future__ import annotations

import enum
import importlib
import inspect
import pkgutil
import re
import sys
from typing import Any, List, Optional

from docutils import nodes
from docutils.parsers.rst import Directive
from docutils.statemachine import StringList
from sphinx.util.nodes import nested_parse_with_titles

PACKAGE = "hyper_parallel_ms"


def public_modules() -> List[str]:
    """The package's public modules and subpackages (names without a leading underscore; the renamed
    ones kept for a release, ``_DEPRECATED_MODULES``, left out: docs/differences.md lists them)."""
    package = importlib.import_module(PACKAGE)
    deprecated = getattr(package, "_DEPRECATED_MODULES", ())
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__)
                  if not m.name.startswith("_") and m.name not in deprecated)


def _comment_of(name: str, value: Any) -> Optional[str]:
    """The comment on or above the line assigning ``name`` in the package module that defines it."""
    pattern = re.compile(rf"^{re.escape(name)}\s*(?::[^=]*)?=")
    for module_name, module in sorted(sys.modules.items()):
        if not module_name.startswith(PACKAGE) or getattr(module, name, None) is not value:
            continue
        try:
            lines = inspect.getsource(module).splitlines()
        except (OSError, TypeError):
            continue
        for i, line in enumerate(lines):
            if pattern.match(line):
                if "#" in line:
                    return line.split("#", 1)[1].strip()
                above = []
                for prev in reversed(lines[:i]):
                    if not prev.startswith("#"):
                        break
                    above.insert(0, prev.lstrip("#").strip())
                if above:
                    return " ".join(above)
    return None


def _data_entry(module_name: str, name: str, value: Any) -> List[str]:
    """A ``py:data`` entry for a constant: its type, a short value and its source comment."""
    if isinstance(value, enum.Enum):
        text = f"``{type(value).__name__}.{value.name}``, a member of :class:`{type(value).__name__}`."
    else:
        text = _comment_of(name, value) or f"A constant of type ``{type(value).__name__}``."
    lines = [f".. py:data:: {name}", f"   :module: {module_name}"]
    shown = repr(value)
    if len(shown) <= 100 and "\n" not in shown:
        lines.append(f"   :value: {shown}")
    return lines + ["", f"   {text}", ""]


def _mixed_in(cls: type) -> List[str]:
    """``:inherited-members:`` for a class built from a private mixin of the package (``Layout``'s
    notations), whose members are the class's own to a reader."""
    public = {id(getattr(importlib.import_module(f"{PACKAGE}.{m}"), n)) for m in public_modules()
              for n in getattr(importlib.import_module(f"{PACKAGE}.{m}"), "__all__", ())}
    private = [base for base in cls.__mro__[1:] if base.__module__.startswith(PACKAGE + ".") and id(base) not in public]
    return ["   :inherited-members: object"] if private else []


def entries(module_name: str) -> List[str]:
    """reStructuredText documenting every name of ``module_name.__all__``."""
    module = importlib.import_module(module_name)
    lines: List[str] = []
    for name in module.__all__:
        value = getattr(module, name)
        qualified = f"{module_name}.{name}"
        if inspect.isclass(value):
            lines += [f".. autoclass:: {qualified}", "   :members:"] + _mixed_in(value) + [""]
        elif inspect.isroutine(value):
            lines += [f".. autofunction:: {qualified}", ""]
        elif inspect.ismodule(value):
            lines += [f".. py:data:: {name}", f"   :module: {module_name}", "",
                      f"   The module :doc:`{value.__name__.split('.')[-1]}`.", ""]
        else:
            lines += _data_entry(module_name, name, value)
    return lines


def home_of(name: str) -> Optional[str]:
    """The public module whose reference documents top-level ``name`` (None: a module itself)."""
    package = importlib.import_module(PACKAGE)
    value = getattr(package, name)
    if inspect.ismodule(value):
        return None
    for module_name in public_modules():
        module = importlib.import_module(f"{PACKAGE}.{module_name}")
        if name in getattr(module, "__all__", ()) and getattr(module, name) is value:
            return module_name
    raise ValueError(f"{PACKAGE}.{name} is in no public module's __all__: add it to one, or document it here")


class _Generated(Directive):
    """Parse generated reStructuredText in place of the directive."""

    def _parse(self, lines: List[str]) -> List[nodes.Node]:
        node = nodes.section()
        node.document = self.state.document
        nested_parse_with_titles(self.state, StringList(lines, source=self.state.document["source"]), node)
        return node.children


class ModuleApi(_Generated):
    """``.. hpms-api:: module``: document every name of the module's ``__all__``."""

    required_arguments = 1

    def run(self) -> List[nodes.Node]:
        return self._parse(entries(self.arguments[0]))


class TopLevelApi(_Generated):
    """``.. hpms-api-toplevel::``: ``hyper_parallel_ms.__all__``, each linked to its entry."""

    def run(self) -> List[nodes.Node]:
        package = importlib.import_module(PACKAGE)
        lines = [".. list-table::", "   :header-rows: 1", "", "   * - name", "     - documented as"]
        for name in package.__all__:
            home = home_of(name)
            target = f":doc:`{name}`" if home is None else f":py:obj:`{PACKAGE}.{home}.{name}`"
            lines += [f"   * - ``{PACKAGE}.{name}``", f"     - {target}"]
        return self._parse(lines + [""])


def setup(app) -> dict:
    app.add_directive("hpms-api", ModuleApi)
    app.add_directive("hpms-api-toplevel", TopLevelApi)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
