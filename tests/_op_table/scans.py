"""The op sweep's entries: scans, sort, top-k, flip, triangles."""
from __future__ import annotations

from typing import List

from mindspore import mint, ops

from ._base import A, Arg, OpCase, X, _NO_GRAD, collector

CASES: List[OpCase] = []
case, gap = collector(CASES)

for _n, _f in {"ops.cumsum(x, 1)": lambda t: ops.cumsum(t, 1), "Tensor.cumsum(axis=1)": lambda t: t.cumsum(axis=1),
               "Tensor.cumsum(dim=0)": lambda t: t.cumsum(dim=0), "mint.cumprod(x, 1)": lambda t: mint.cumprod(t, 1),
               "ops.sort(x, 1)": lambda t: ops.sort(t, 1)[0], "ops.sort(x, 0) indices": lambda t: ops.sort(t, 0)[1],
               "ops.topk(x, 2)": lambda t: ops.topk(t, 2)[0], "ops.topk(x, 2) indices": lambda t: ops.topk(t, 2)[1],
               "mint.flip(x, (1,))": lambda t: mint.flip(t, (1,)), "ops.flip(x, (0,))": lambda t: ops.flip(t, (0,)),
               "ops.tril": ops.tril, "mint.triu(x, 1)": lambda t: mint.triu(t, 1)}.items():
    case(_n, "scan / sort", _f, Arg(A, "unit") if "prod" in _n else X, grad="indices" not in _n)
case("ops.cummax(x, 1)", "scan / sort", lambda t: ops.cummax(t, 1)[0], grad=False, reason=_NO_GRAD.format("Cummax"))
case("ops.cummin(x, 0)", "scan / sort", lambda t: ops.cummin(t, 0)[0], grad=False, reason=_NO_GRAD.format("Cummin"))
case("Tensor.topk(2)", "scan / sort", lambda t: t.topk(2)[0])
for _n, _f, _p in (("mint.cumsum", lambda t: mint.cumsum(t, 1), "CumsumExt"),
                   ("mint.topk", lambda t: mint.topk(t, 2, 1)[0], "TopkExt"),
                   ("mint.sort", lambda t: mint.sort(t, dim=1)[0], "SortExt"), ("mint.tril", mint.tril, "TrilExt")):
    gap(_n, "scan / sort", _f, _p)
