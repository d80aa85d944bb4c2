"""The package's modules import each other without cycles, function-local imports included.

The graph is read statically (``ast``): ``import a.b`` and ``from a import b`` give an edge to
the module ``a.b``; ``from pkg import name`` gives an edge to the module that defines ``name``,
following the package ``__init__``'s re-exports (``from .sub import name``). The one documented
exception: importing a submodule makes Python run its package's ``__init__`` first, and those
``__init__`` files re-export their submodules, so the implicit edge from a submodule to its
parent package is not counted (a cycle through it would be a cycle through a re-export only).
Dynamic imports (``importlib.import_module``) cannot be read; :data:`DYNAMIC` lists each one
and why it is no edge between the package's modules.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "hyper_parallel_ms"

DYNAMIC = {
    "hyper_parallel_ms": "the lazy top-level exports (__getattr__): the package __init__'s re-exports",
    "hyper_parallel_ms.testing._worker": "a rank worker imports the module of the test function it runs",
    "hyper_parallel_ms.nn._loss_parallel": "MindSpore's mint.nn modules, none of this package",
    "hyper_parallel_ms.compat._alias": "the served hyper_parallel names import their hyper_parallel_ms modules "
                                       "on first use (a leaf: no module of the package imports compat)",
}


def _modules(root: Path, package: str) -> Dict[str, Tuple[Path, bool]]:
    """Every module of ``package`` under ``root``: dotted name -> (file, is a package __init__)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _reexports(modules, trees) -> Dict[str, Dict[str, str]]:
    """For each package ``__init__``: re-exported name -> the module it is imported from."""
    out: Dict[str, Dict[str, str]] = {}
    for name, (_, is_package) in modules.items():
        if not is_package:
            continue
        table = out.setdefault(name, {})
        for node in trees[name].body:
            if isinstance(node, ast.ImportFrom):
                source = _absolute(node, name, True)
                for alias in node.names:
                    table[alias.asname or alias.name] = source
    return out


def _defining(module: str, name: str, modules, reexports, seen: Optional[Set] = None) -> str:
    """The module that ``from module import name`` depends on."""
    if f"{module}.{name}" in modules:
        return f"{module}.{name}"
    source = reexports.get(module, {}).get(name)
    seen = seen or set()
    if source is None or source not in modules or (module, name) in seen:
        return module
    seen.add((module, name))
    return _defining(source, name, modules, reexports, seen)


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> Dict[str, Set[str]]:
    """module -> the package's modules it imports (anywhere in the file)."""
    modules = _modules(root, package)
    trees = {name: ast.parse(path.read_text()) for name, (path, _) in modules.items()}
    reexports = _reexports(modules, trees)
    graph: Dict[str, Set[str]] = {}
    for name, (_, is_package) in modules.items():
        edges = set()
        for node in ast.walk(trees[name]):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(node, name, is_package)
                if source in modules:
                    edges |= {_defining(source, a.name, modules, reexports) for a in node.names}
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One import cycle (``[a, b, ..., a]``), or ``None``."""
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None
    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50 and graph["hyper_parallel_ms.ops._dispatch"], "the graph was not read"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_dynamic_imports_are_the_documented_ones():
    found = set()
    for name, (path, _) in _modules(ROOT, PACKAGE).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "import_module" or \
                    isinstance(node, ast.Name) and node.id == "__import__":
                found.add(name)
    assert found == set(DYNAMIC), found


def test_function_local_and_reexported_imports_make_cycles(tmp_path):
    """The reader sees a cycle hidden in a function body, through a package's re-export."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from ._b import B\n")
    (pkg / "sub" / "_b.py").write_text("from ..a import f\nclass B: pass\n")
    (pkg / "a.py").write_text("def f():\n    from .sub import B\n    return B\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub._b"} and graph["pkg.sub._b"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub._b", "pkg.a"]


# The layers above ``comm``: they reach the cluster only through the mesh's exchange
# (``hyper_parallel_ms.comm._exchange``) and never ask whether a rank is simulated.
ABOVE_COMM = ("pipelining", "nn", "fsdp", "checkpoint", "training", "dtensor", "ops", "redistribute")
SIMULATION_WORDS = re.compile(r"simulat|runfirst|clusterexchange", re.IGNORECASE)


def simulation_mentions(root: Path = ROOT, package: str = PACKAGE, layers=ABOVE_COMM) -> List[str]:
    """``path:line: text`` of every line of ``layers`` (code, comments and docstrings) naming the
    simulated world or the exchange's implementations, and of every import of the dry run."""
    found = []
    for layer in layers:
        files = sorted((root / package / layer).rglob("*.py"))
        assert files, f"no module under {package}/{layer}"
        for path in files:
            text = path.read_text()
            for number, line in enumerate(text.splitlines(), 1):
                if SIMULATION_WORDS.search(line):
                    found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
            for node in ast.walk(ast.parse(text)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                    [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if any("dryrun" in n.split(".") for n in names):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: imports the dry run")
    return found


def test_the_layers_above_comm_never_mention_simulation():
    """Simulation enters through the mesh's exchange only (DESIGN.md): what differs on a simulated
    mesh is a property of the exchange (``mesh.holds_values``, ``Exchange.defer_agreement``)."""
    found = simulation_mentions()
    assert not found, "the layers above comm mention simulation:\n" + "\n".join(found)


def test_simulation_mentions_are_found(tmp_path):
    """The scan sees a test for simulation, a RunFirst, and an import of the dry run."""
    layer = tmp_path / "pkg" / "nn"
    layer.mkdir(parents=True)
    (layer / "a.py").write_text("def f(mesh):\n    return mesh.is_simulated\n")
    (layer / "b.py").write_text("from ..comm._x import RunFirst\nfrom ..dryrun import _session\n")
    found = simulation_mentions(tmp_path, "pkg", ("nn",))
    assert [f.split(":")[:2] for f in found] == [["pkg/nn/a.py", "2"], ["pkg/nn/b.py", "1"], ["pkg/nn/b.py", "2"]], found
