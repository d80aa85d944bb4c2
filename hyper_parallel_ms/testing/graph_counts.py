"""Primitives counted in the graph MindSpore compiles (its graph dump), for tests and benchmarks
that check what a compiled step communicates (:func:`compiled_collectives`: recording while
tracing counts a graph MindSpore reuses for several reads once, the dump counts each primitive
the step runs) or that every rank compiles the same ops (:func:`compiled_primitives`).

Example::

    step = ms.jit(ms.value_and_grad(loss_fn, None, params))
    compiled_collectives(step, x)          # e.g. {"AllGather": 12, "AllReduce": 12}
"""
from __future__ import annotations

import glob
import os
import re
import tempfile
from typing import Any, Callable, Dict

__all__ = ["COLLECTIVE_PRIMITIVES", "compiled_collectives", "compiled_primitives"]

COLLECTIVE_PRIMITIVES = ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "AlltoAll")


def compiled_primitives(run: Callable, *args: Any) -> Dict[str, int]:
    """Call ``run(*args)`` once, with MindSpore's graph dump on, and count each primitive in the
    graphs it builds (a call that compiles nothing counts nothing: call it first here).

    Args:
        run: a compiled callable (``ms.jit`` function, or a Cell called in GRAPH_MODE).
        args: its arguments.

    Example::

        compiled_primitives(ms.jit(step), x)       # e.g. {"AllReduce": 2, "Concat": 2, "MatMul": 3, ...}
    """
    import mindspore as ms
    with tempfile.TemporaryDirectory() as path:
        ms.set_context(save_graphs=1, save_graphs_path=path)
        try:
            out = run(*args)
            for item in out if isinstance(out, (tuple, list)) else (out,):
                if hasattr(item, "asnumpy"):
                    item.asnumpy()
        finally:
            ms.set_context(save_graphs=0)
        text = "".join(open(g).read() for g in glob.glob(os.path.join(path, "**", "graph_build_*.ir"),
                                                         recursive=True))
    counts: Dict[str, int] = {}
    for name in re.findall(r"= ([A-Z]\w*)\(", text):
        counts[name] = counts.get(name, 0) + 1
    return counts


def compiled_collectives(run: Callable, *args: Any) -> Dict[str, int]:
    """The collective primitives of :func:`compiled_primitives`.

    Args:
        run: a compiled callable (``ms.jit`` function, or a Cell called in GRAPH_MODE).
        args: its arguments.

    Example::

        counts = compiled_collectives(ms.jit(step), x)
        assert counts == {"AllGather": 4, "AllReduce": 4}
    """
    counts = compiled_primitives(run, *args)
    return {p: counts[p] for p in COLLECTIVE_PRIMITIVES if p in counts}
