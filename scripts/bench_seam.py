"""Cost of the seam's wrappers of MindSpore's compile entry points.

The first DTensor installs wrappers on ``_JitExecutor.compile`` (``ms.jit``) and
``_CellGraphExecutor.compile`` (GRAPH_MODE Cells) that look through a compiled call's
arguments for DTensors (:func:`hyper_parallel_ms._mindspore.compile_argument_checks`). This
script times the first call (graph compile plus one run) of a small ``ms.jit`` function and
of a small GRAPH_MODE Cell, each time a new one, alternating rounds without and with the
wrappers, and prints the medians and their ratio (one process, no ranks; one run). Compile
times vary by more than the wrappers add, so it also times the wrappers' own work per
compile: the ``ms.jit`` wrapper around a compile that does nothing, on the same arguments.

Usage: .venv/bin/python scripts/bench_seam.py [--rounds 7]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import types
from typing import Callable, Dict, List

os.environ.setdefault("GLOG_v", "3")   # before MindSpore loads: no "compiled again" warnings

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from hyper_parallel_ms import _mindspore as seam
from hyper_parallel_ms.dtensor import DTensor


def _new_jit_function() -> Callable:
    def step(x, w, scale):
        return (ops.relu(ops.matmul(x, w)) * scale[0] + scale[1]).sum()
    return ms.jit(step)


class _Small(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Dense(16, 16)

    def construct(self, x, scale):
        return (ops.relu(self.dense(x)) * scale[0] + scale[1]).sum()


def _first_call_seconds(kind: str, x, w) -> float:
    """Seconds of the first call of a new jit function / Cell (compile and one run)."""
    scale = (ms.Tensor(2.0), ms.Tensor(1.0))
    began = time.perf_counter()
    if kind == "jit":
        _new_jit_function()(x, w, scale).asnumpy()
    else:
        ms.set_context(mode=ms.GRAPH_MODE)
        try:
            _Small()(x, scale).asnumpy()
        finally:
            ms.set_context(mode=ms.PYNATIVE_MODE)
    return time.perf_counter() - began


def measure(rounds: int) -> Dict[str, Dict[str, List[float]]]:
    """{kind: {"without": seconds per round, "with": ...}}; each round runs both, in turns first."""
    x = ms.Tensor(np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32))
    w = ms.Tensor(np.random.default_rng(1).standard_normal((16, 16)).astype(np.float32))
    times: Dict[str, Dict[str, List[float]]] = {k: {"without": [], "with": []} for k in ("jit", "graph")}
    for kind in times:
        _first_call_seconds(kind, x, w)                                   # warm up MindSpore's compiler
    for r in range(rounds):
        for kind in times:
            for wrapped in ((False, True) if r % 2 == 0 else (True, False)):   # alternate which goes first
                if wrapped:
                    with seam.entry_points_swapped(seam.compile_argument_checks([DTensor])):
                        times[kind]["with"].append(_first_call_seconds(kind, x, w))
                else:
                    times[kind]["without"].append(_first_call_seconds(kind, x, w))
    return times


def wrapper_seconds(calls: int = 20000) -> float:
    """Seconds the ``ms.jit`` compile wrapper adds to one compile of a call with the
    arguments of the benchmarked function (measured around a compile that does nothing)."""
    jit_wrap = seam.compile_argument_checks([DTensor])[0][2]
    bare = jit_wrap(lambda self, method_name, *args, **kwargs: None)
    x = ms.Tensor(np.zeros((8, 16), np.float32))
    executor = types.SimpleNamespace(fn=_new_jit_function().__wrapped__, obj=None)
    args = (x, x, (ms.Tensor(2.0), ms.Tensor(1.0)))
    began = time.perf_counter()
    for _ in range(calls):
        bare(executor, "step", *args)
    return (time.perf_counter() - began) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"MindSpore {ms.__version__}; median of {args.rounds} first calls (compile + one run)")
    times = measure(args.rounds)
    print(f"{'':22}{'without (ms)':>14}{'with (ms)':>12}{'with / without':>16}")
    for kind, label in (("jit", "ms.jit function"), ("graph", "GRAPH_MODE Cell")):
        without, with_ = (statistics.median(times[kind][w]) for w in ("without", "with"))
        print(f"{label:22}{without * 1e3:14.1f}{with_ * 1e3:12.1f}{with_ / without:16.3f}")
    added = wrapper_seconds()
    jit_without = statistics.median(times["jit"]["without"])
    print(f"the wrapper's own work per compile: {added * 1e6:.1f} us "
          f"({added / jit_without:.2e} of the ms.jit first call)")


if __name__ == "__main__":
    main()
