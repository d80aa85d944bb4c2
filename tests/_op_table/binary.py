"""The op sweep's entries: binary element-wise and comparisons."""
from __future__ import annotations

from typing import List

from mindspore import mint, ops

from ._base import A, Arg, OpCase, ROW, X, Y, collector

CASES: List[OpCase] = []
case, _ = collector(CASES)

for _n, _f in {"x + y": lambda a, b: a + b, "x - y": lambda a, b: a - b, "x * y": lambda a, b: a * b,
               "mint.add": mint.add, "mint.sub": mint.sub, "mint.mul": mint.mul, "ops.add": ops.add,
               "ops.sub": ops.sub, "ops.mul": ops.mul, "Tensor.add": lambda a, b: a.add(b),
               "Tensor.sub": lambda a, b: a.sub(b), "mint.maximum": mint.maximum, "mint.minimum": mint.minimum,
               "ops.maximum": ops.maximum, "ops.minimum": ops.minimum, "Tensor.maximum": lambda a, b: a.maximum(b),
               "ops.atan2": ops.atan2, "ops.squared_difference": lambda a, b: ops.SquaredDifference()(a, b),
               "mint.lerp(x, y, 0.5)": lambda a, b: mint.lerp(a, b, 0.5)}.items():
    case(_n, "element-wise binary", _f, X, Y)
for _n, _f in {"x / y": lambda a, b: a / b, "mint.div": mint.div, "ops.div": ops.div}.items():
    case(_n, "element-wise binary", _f, X, Arg(A, "pos"))
case("x + row (broadcast)", "element-wise binary", lambda a, b: a + b, X, ROW)
case("row * x (broadcast)", "element-wise binary", lambda a, b: b * a, X, ROW)
for _n, _f in {"x == y": lambda a, b: a == b, "x != y": lambda a, b: a != b, "x < y": lambda a, b: a < b,
               "x <= y": lambda a, b: a <= b, "x > y": lambda a, b: a > b, "x >= y": lambda a, b: a >= b,
               "mint.eq": mint.eq, "mint.ne": mint.ne, "mint.lt": mint.lt, "mint.le": mint.le, "mint.gt": mint.gt,
               "mint.ge": mint.ge, "ops.equal": ops.equal, "ops.ne": ops.ne, "ops.less": ops.less,
               "ops.le": ops.le, "ops.greater": ops.greater, "ops.ge": ops.ge,
               "Tensor.eq": lambda a, b: a.eq(b), "Tensor.gt": lambda a, b: a.gt(b)}.items():
    case(_n, "comparison", _f, X, Y, grad=False)
for _n, _f in {"x > 0.5": lambda t: t > 0.5, "x == 0.5": lambda t: t == 0.5, "x != 0.5": lambda t: t != 0.5,
               "x <= 0.5": lambda t: t <= 0.5, "x < 0.5": lambda t: t < 0.5, "x >= 0.5": lambda t: t >= 0.5,
               "mint.eq(x, 0.5)": lambda t: mint.eq(t, 0.5),
               "ops.isnan": ops.isnan, "mint.isnan": mint.isnan}.items():
    case(_n, "comparison", _f, grad=False)
for _n, _f in {"mint.logical_and": mint.logical_and, "mint.logical_or": mint.logical_or,
               "mint.logical_xor": mint.logical_xor, "ops.logical_and": ops.logical_and,
               "b & c": lambda a, b: a & b, "b | c": lambda a, b: a | b}.items():
    case(_n, "logical", _f, Arg(A, "b", (0, 1)), Arg(A, "b", "tied"), grad=False)
for _n, _f in {"mint.logical_not": mint.logical_not, "ops.logical_not": ops.logical_not, "~b": lambda a: ~a}.items():
    case(_n, "logical", _f, Arg(A, "b", (0, 1)), grad=False)
