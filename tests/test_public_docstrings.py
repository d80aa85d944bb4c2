"""Every public callable (exported by ``hyper_parallel_ms.__all__`` or a subpackage's ``__all__``)
documents each of its parameters in an ``Args:`` section and shows an example (``Example::``
or ``>>>``), so that ``help(...)`` answers what an argument does."""
from __future__ import annotations

import enum
import importlib
import inspect
import re
from typing import Dict, List, Set, Tuple

import hyper_parallel_ms

SUBPACKAGES = ("checkpoint", "comm", "dryrun", "dtensor", "fsdp", "moe", "nn", "ops", "pipelining", "redistribute",
               "testing", "training")
_ENTRY = re.compile(r"^    (\*{0,2}\w+(?:, \*{0,2}\w+)*)(?: \([^)]*\))?:")


def public_callables() -> Dict[str, object]:
    """Dotted export name -> function or class, each once (by its first name); constants and
    typing aliases (``LocalStep``) are no callables to document."""
    found: Dict[str, object] = {}
    seen: Set[int] = set()
    modules = [(hyper_parallel_ms.__name__, hyper_parallel_ms)]
    modules += [(f"hyper_parallel_ms.{name}", importlib.import_module(f"hyper_parallel_ms.{name}"))
                for name in SUBPACKAGES]
    for prefix, module in modules:
        for name in module.__all__:
            value = getattr(module, name)
            if (inspect.isroutine(value) or inspect.isclass(value)) and id(value) not in seen:
                seen.add(id(value))
                found[f"{prefix}.{name}"] = value
    return found


def parameters(obj) -> List[str]:
    """The names a caller passes (``self``, ``cls`` and private ``_names`` left out; ``*args`` as ``args``);
    an ``Enum`` class is called with its ``value`` only."""
    if inspect.isclass(obj) and issubclass(obj, enum.Enum):
        return ["value"]
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):      # an exception class with the builtin constructor
        return []
    return [p.name for p in signature.parameters.values()
            if p.name not in ("self", "cls") and not p.name.startswith("_")]


def documented(doc: str) -> Set[str]:
    """The names listed in the docstring's ``Args:`` section (``name:`` or ``name (type):``)."""
    lines = doc.splitlines()
    if "Args:" not in (line.strip() for line in lines):
        return set()
    start = [line.strip() for line in lines].index("Args:")
    indent = len(lines[start]) - len(lines[start].lstrip())
    names: Set[str] = set()
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        match = _ENTRY.match(line[indent:])
        if match:
            names |= {n.strip().lstrip("*") for n in match.group(1).split(",")}
    return names


def missing(obj) -> Tuple[List[str], bool]:
    """(parameters the docstring does not list, whether it has an example)."""
    doc = inspect.getdoc(obj) or ""
    return [p for p in parameters(obj) if p not in documented(doc)], ("Example::" in doc or ">>>" in doc)


def test_every_public_callable_documents_its_arguments_with_an_example():
    exported = public_callables()
    assert len(exported) > 90 and "hyper_parallel_ms.fully_shard" in exported
    problems = []
    for name, obj in exported.items():
        absent, example = missing(obj)
        if absent:
            problems.append(f"{name}: arguments not in its Args: section: {absent}")
        if not example:
            problems.append(f"{name}: no example (Example:: or >>>)")
    assert not problems, "\n".join(problems)


def test_fully_shard_help_names_every_argument():
    from hyper_parallel_ms import fully_shard
    assert documented(inspect.getdoc(fully_shard)) >= {"module", "mesh", "reshard_after_forward", "mp_policy"}


def test_the_reader_of_args_sections():
    def f(a, b=1, *rest, c, **options):
        """Do it.

        Args:
            a: the first.
            b (int): the second,
                over two lines.
            *rest: more.
            c, options: the others.

        Example::

            f(1, c=2)
        """
    assert missing(f) == ([], True)

    def g(a, b):
        """Do it.

        Args:
            a: only this one.
        """
    assert missing(g) == (["b"], False)
