"""The op sweep's entries: integer and bool values that collectives move (exact on CPU: comm/_exact.py)."""
from __future__ import annotations

from typing import List

from mindspore import mint, ops

from ._base import A, Arg, BOOL, IDX1, OpCase, X, Y, collector

CASES: List[OpCase] = []
case, _ = collector(CASES)

BIG32 = Arg(A, "z32-268435456")     # |x| < 2^28, beyond float32's 24-bit mantissa; 6 of them fit in int32
BIG64 = Arg(A, "z-1099511627776")   # |x| < 2^40
FEW32, FEW64 = Arg(A, "z32-3"), Arg(A, "z-3")   # in [-3, 3): products, equal pairs
for _n, _f, _x in (("Tensor.sum(dim=1) int32", lambda t: t.sum(dim=1), BIG32),
                   ("mint.sum(x, 0) int32", lambda t: mint.sum(t, 0), BIG32),
                   ("Tensor.sum() int64", lambda t: t.sum(), BIG64),
                   ("ops.sum(x, 1) int64", lambda t: ops.sum(t, 1), BIG64),
                   ("Tensor.sum(1) bool", lambda t: t.sum(1), BOOL),
                   ("ops.prod(x, 1) int32", lambda t: ops.prod(t, 1), FEW32),
                   ("mint.prod(x, 0) int64", lambda t: mint.prod(t, 0), FEW64),
                   ("ops.amax(x, 1) int32", lambda t: ops.amax(t, 1), BIG32),
                   ("ops.amin(x, 0) int64", lambda t: ops.amin(t, 0), BIG64),
                   ("Tensor.max() int32", lambda t: t.max(), BIG32),
                   ("Tensor.min(axis=0) int64", lambda t: t.min(axis=0), BIG64),
                   ("ops.argmax(x, 1) int32", lambda t: ops.argmax(t, 1), BIG32),
                   ("ops.argmin(x, 0) int64", lambda t: ops.argmin(t, 0), BIG64),
                   ("ops.cumsum(x, 1) int32", lambda t: ops.cumsum(t, 1), BIG32),
                   ("Tensor.cumsum(dim=0) int64", lambda t: t.cumsum(dim=0), BIG64),
                   ("ops.sort(x, 1) int32", lambda t: ops.sort(t, 1)[0], BIG32),
                   ("ops.topk(x, 2) int64", lambda t: ops.topk(t, 2)[0], BIG64),
                   ("Tensor.reshape(30) int64", lambda t: t.reshape(30), BIG64),
                   ("Tensor.T int32", lambda t: t.T, BIG32),
                   ("mint.flip(x, (0,)) int64", lambda t: mint.flip(t, (0,)), BIG64),
                   ("ops.tile(b, (1, 2))", lambda t: ops.tile(t, (1, 2)), BOOL),
                   ("Tensor.all()", lambda t: t.all(), BOOL), ("Tensor.any()", lambda t: t.any(), BOOL),
                   ("mint.all(b, 0)", lambda t: mint.all(t, 0), BOOL)):
    case(_n, "integer / bool", _f, _x, grad=False)
for _n, _f, _x in (("x + y int32", lambda a, b: a + b, BIG32), ("ops.maximum int64", ops.maximum, BIG64),
                   ("x == y int32", lambda a, b: a == b, FEW32), ("x > y int64", lambda a, b: a > b, BIG64),
                   ("mint.cat([x, y], 0) int32", lambda a, b: mint.cat([a, b], 0), BIG32),
                   ("mint.logical_and(b, c)", mint.logical_and, BOOL), ("b ^ c", lambda a, b: a ^ b, BOOL)):
    case(_n, "integer / bool", _f, _x, _x, grad=False)
case("(x > 0) & (y > 0)", "integer / bool", lambda a, b: (a > 0) & (b > 0), X, Y, grad=False)
case("ops.where(c, x, y) int32", "integer / bool", lambda c, a, b: ops.where(c, a, b), BOOL, BIG32, BIG32, grad=False)
case("Tensor.masked_fill(m, 7) int32", "integer / bool", lambda a, m: a.masked_fill(m, 7), BIG32, BOOL, grad=False)
case("ops.gather(table, idx, 0) int64", "integer / bool", lambda a, i: ops.gather(a, i, 0), BIG64, IDX1, grad=False)
case("ops.index_select(x, 1, idx) int32", "integer / bool", lambda a, i: ops.index_select(a, 1, i), BIG32,
     Arg((3,), "i32-6", "rep"), grad=False)
case("ops.gather(x, ids, 0), ids sharded", "integer / bool", lambda t, i: ops.gather(t, i, 0), X, Arg((2, 3), "i32-5"))
case("mint.gather(x, 1, idx), idx sharded", "integer / bool", lambda a, i: mint.gather(a, 1, i), X, Arg(A, "i-6"))
case("ops.gather_elements(x, 0, idx), idx sharded", "integer / bool", lambda a, i: ops.gather_elements(a, 0, i), X,
     Arg(A, "i-5"))
