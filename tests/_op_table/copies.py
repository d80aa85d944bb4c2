"""The op sweep's entries: broadcasting copies."""
from __future__ import annotations

from typing import List

from mindspore import mint, ops

from ._base import A, Arg, COL, OpCase, collector

CASES: List[OpCase] = []
case, gap = collector(CASES)

for _n, _f in {"Tensor.expand(5, 6)": lambda t: t.expand(5, 6),
               "Tensor.expand((2, 5, 6))": lambda t: t.expand((2, 5, 6)),
               "Tensor.expand(2, -1, 6)": lambda t: t.expand(2, -1, 6),
               "mint.broadcast_to": lambda t: mint.broadcast_to(t, (5, 6)),
               "ops.broadcast_to": lambda t: ops.broadcast_to(t, (3, 5, 6))}.items():
    case(_n, "expand / tile", _f, COL)
case("Tensor.expand_as(x)", "expand / tile", lambda c, a: c.expand_as(a), COL, Arg(A, "f", "all"))
for _n, _f in {"mint.tile(x, (2, 1))": lambda t: mint.tile(t, (2, 1)),
               "ops.tile(x, (1, 2))": lambda t: ops.tile(t, (1, 2)),
               "Tensor.tile((2, 1, 1))": lambda t: t.tile((2, 1, 1))}.items():
    case(_n, "expand / tile", _f)
gap("Tensor.repeat(2, 1)", "expand / tile", lambda t: t.repeat(2, 1), "Repeat")
