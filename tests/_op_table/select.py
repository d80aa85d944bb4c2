"""The op sweep's entries: where / masked_fill / clamp."""
from __future__ import annotations

from typing import List

from mindspore import mint, ops

from ._base import A, Arg, MASK, OpCase, X, Y, collector

CASES: List[OpCase] = []
case, _ = collector(CASES)

case("mint.where(c, x, y)", "select", lambda c, a, b: mint.where(c, a, b), MASK, X, Y)
case("ops.where(c, x, y)", "select", lambda c, a, b: ops.where(c, a, b), MASK, X, Y)
case("ops.where(c, x, 0.5)", "select", lambda c, a: ops.where(c, a, 0.5), MASK, X)
case("ops.select", "select", lambda c, a, b: ops.select(c, a, b), MASK, X, Y)
case("Tensor.masked_fill(m, 0.5)", "select", lambda a, m: a.masked_fill(m, 0.5), X, Arg(A, "b", "tied"))
case("ops.masked_fill(x, m, 0.5)", "select", lambda a, m: ops.masked_fill(a, m, 0.5), X, Arg(A, "b", "tied"))
for _n, _f in {"mint.clamp(x, -0.5, 0.5)": lambda t: mint.clamp(t, -0.5, 0.5),
               "mint.clamp(x, min=0)": lambda t: mint.clamp(t, min=0.0), "ops.clamp": lambda t: ops.clamp(t, -0.5, 0.5),
               "ops.clip": lambda t: ops.clip(t, -0.5, 0.5), "Tensor.clamp": lambda t: t.clamp(-0.5, 0.5),
               "Tensor.clip": lambda t: t.clip(-0.5, 0.5)}.items():
    case(_n, "select", _f)
case("mint.clamp(x, lo, hi) tensors", "select", lambda a, lo, hi: mint.clamp(a, lo, hi), X, Arg(A), Arg(A))
