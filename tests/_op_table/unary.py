"""The op sweep's entries: element-wise, unary: the same function through mint, ops and Tensor methods."""
from __future__ import annotations

from typing import List

from mindspore import mint, ops

from ._base import OpCase, POS, X, collector

CASES: List[OpCase] = []
case, _ = collector(CASES)

_UNARY = {   # name: (input, mint form or None, ops form or None, method name or None, grad)
    "neg": (X, mint.neg, ops.neg, "neg", True), "abs": (X, mint.abs, ops.abs, "abs", True),
    "exp": (X, mint.exp, ops.exp, "exp", True), "log": (POS, mint.log, ops.log, "log", True),
    "sqrt": (POS, mint.sqrt, ops.sqrt, "sqrt", True), "rsqrt": (POS, mint.rsqrt, ops.rsqrt, "rsqrt", True),
    "sigmoid": (X, mint.sigmoid, ops.sigmoid, "sigmoid", True), "tanh": (X, mint.tanh, ops.tanh, "tanh", True),
    "erf": (X, mint.erf, ops.erf, "erf", True), "log1p": (POS, mint.log1p, ops.log1p, "log1p", True),
    "expm1": (X, mint.expm1, ops.expm1, None, True), "square": (X, mint.square, ops.square, "square", True),
    "sin": (X, mint.sin, ops.sin, None, True), "cos": (X, mint.cos, ops.cos, None, True),
    "reciprocal": (POS, mint.reciprocal, ops.reciprocal, "reciprocal", True),
    "floor": (X, mint.floor, ops.floor, "floor", False), "ceil": (X, mint.ceil, ops.ceil, None, False),
    "round": (X, mint.round, ops.round, "round", False), "sign": (X, mint.sign, ops.sign, "sign", False),
    "trunc": (X, mint.trunc, ops.trunc, None, False), "isinf": (X, mint.isinf, ops.isinf, None, False),
    "isfinite": (X, mint.isfinite, ops.isfinite, None, False), "nan_to_num": (X, mint.nan_to_num, None,
    "nan_to_num", True),
}
for _n, (_x, _m, _o, _meth, _g) in _UNARY.items():
    if _m is not None:
        case(f"mint.{_n}", "element-wise", _m, _x, grad=_g)
    if _o is not None:
        case(f"ops.{_n}", "element-wise", _o, _x, grad=_g)
    if _meth is not None:
        case(f"Tensor.{_meth}()", "element-wise", (lambda m: lambda t: getattr(t, m)())(_meth), _x, grad=_g)
