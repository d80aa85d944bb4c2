"""The op sweep's entries: gathers and index selection."""
from __future__ import annotations

from typing import List

from mindspore import mint, ops

from ._base import A, Arg, IDX1, OpCase, X, collector

CASES: List[OpCase] = []
case, gap = collector(CASES)

case("ops.gather(x, idx, 0)", "gather", lambda a, i: ops.gather(a, i, 0), X, IDX1)
case("ops.gather(x, idx, 1)", "gather", lambda a, i: ops.gather(a, i, 1), X, Arg((3,), "i32-6", "rep"))
case("ops.index_select(x, 1, idx)", "gather", lambda a, i: ops.index_select(a, 1, i), X, Arg((3,), "i32-6", "rep"))
case("ops.index_select(x, 0, idx)", "gather", lambda a, i: ops.index_select(a, 0, i), X, IDX1)
case("mint.gather(x, 1, idx)", "gather", lambda a, i: mint.gather(a, 1, i), X, Arg(A, "i-6", (0,)))
case("ops.gather_elements(x, 0, idx)", "gather", lambda a, i: ops.gather_elements(a, 0, i), X, Arg(A, "i-5", (1,)))
case("nn.Embedding", "gather", lambda t, i: ops.gather(t, i, 0), Arg((5, 6)), Arg((2, 3), "i32-5", "rep"))
gap("mint.index_select", "gather", lambda a, i: mint.index_select(a, 1, i), "IndexSelect", X, Arg((3,), "i-6", "rep"))
