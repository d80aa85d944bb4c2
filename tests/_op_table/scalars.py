"""The op sweep's entries: element-wise with scalars, casts."""
from __future__ import annotations

from typing import List

import mindspore as ms
from mindspore import mint, ops

from ._base import OpCase, collector

CASES: List[OpCase] = []
case, gap = collector(CASES)

for _n, _f in {"x + 1": lambda t: t + 1.0, "x - 1": lambda t: t - 1.0, "x * 2": lambda t: t * 2.0,
               "x / 2": lambda t: t / 2.0, "2 - x": lambda t: 2.0 - t, "2 * x": lambda t: 2.0 * t,
               "x ** 2": lambda t: t ** 2, "-x": lambda t: -t, "mint.pow(x, 2)": lambda t: mint.pow(t, 2),
               "ops.pow(x, 2.0)": lambda t: ops.pow(t, 2.0), "Tensor.pow(2)": lambda t: t.pow(2),
               "Tensor.mul(2.0)": lambda t: t.mul(2.0), "Tensor.div(2.0)": lambda t: t.div(2.0),
               "mint.fmod(x, 0.3)": lambda t: mint.fmod(t, 0.3), "x % 0.3": lambda t: t % 0.3,
               "x // 0.3": lambda t: t // 0.3}.items():
    case(_n, "element-wise scalar", _f, grad=_n not in ("x // 0.3",))
for _n, _f in {"Tensor.float()": lambda t: t.float(), "Tensor.half()": lambda t: t.half().float(),
               "Tensor.astype(float16)": lambda t: t.astype(ms.float16).astype(ms.float32),
               "Tensor.to(float16)": lambda t: t.to(ms.float16).to(ms.float32),
               "ops.cast(float16)": lambda t: ops.cast(ops.cast(t, ms.float16), ms.float32),
               "Tensor.int()": lambda t: (t * 3).int(), "Tensor.bool()": lambda t: t.bool(),
               "Tensor.long()": lambda t: (t * 3).long()}.items():
    case(_n, "cast", _f, grad=_n not in ("Tensor.int()", "Tensor.bool()", "Tensor.long()"))
case("ops.stop_gradient", "copy", lambda t: ops.stop_gradient(t) * t)
case("ops.zeros_like", "factory-like", ops.zeros_like, grad=False)
case("ops.ones_like", "factory-like", ops.ones_like, grad=False)
gap("mint.zeros_like", "factory-like", mint.zeros_like, "ZerosLikeExt", grad=False)
gap("mint.full_like", "factory-like", lambda t: mint.full_like(t, 2.0), "FullLike", grad=False)
gap("Tensor.clone()", "copy", lambda t: t.clone(), "Clone")
gap("mint.clone", "copy", mint.clone, "Clone")
case("Tensor.contiguous()", "copy", lambda t: t.contiguous())
