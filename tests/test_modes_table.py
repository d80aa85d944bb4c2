"""The mode table of docs/modes.md is the registry's (``hyper_parallel_ms/_modes.py``), and every cell's
proof is a test that exists: "yes" cells name at least one, compiled ones in a file that compiles."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Set

from hyper_parallel_ms._modes import FEATURES, mode_table

ROOT = Path(__file__).resolve().parent.parent
COMPILES = re.compile(r"ms\.jit|GRAPH_MODE|\"jit\"|jit=True")


def _docs_table() -> str:
    lines = (ROOT / "docs" / "modes.md").read_text().splitlines()
    start = lines.index("## The mode table") + 1
    rows = []
    for line in lines[start:]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    return "\n".join(rows)


def _test_names(path: Path, cache: Dict[Path, Set[str]]) -> Set[str]:
    if path not in cache:
        tree = ast.parse(path.read_text())
        cache[path] = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
    return cache[path]


def test_docs_table_is_the_registrys():
    assert _docs_table() == mode_table(), "regenerate with: python -m hyper_parallel_ms._modes"


def test_every_cell_names_existing_tests_and_every_yes_has_one():
    cache: Dict[Path, Set[str]] = {}
    for feature in FEATURES:
        for column, cell in (("pynative", feature.pynative), ("graph", feature.graph)):
            assert cell.proofs or not cell.supported, f"{feature.name} / {column}: a 'yes' with no test"
            for proof in cell.proofs:
                file, _, name = proof.partition("::")
                path = ROOT / file
                assert path.is_file(), f"{feature.name} / {column}: no file {file}"
                assert name in _test_names(path, cache), f"{feature.name} / {column}: no test {proof}"
                if column == "graph" and cell.supported:
                    assert COMPILES.search(path.read_text()), f"{proof} compiles nothing"

