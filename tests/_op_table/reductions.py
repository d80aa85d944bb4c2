"""The op sweep's entries: reductions, both spellings."""
from __future__ import annotations

from typing import List

from mindspore import mint, ops

from ._base import A, Arg, OpCase, X, collector

CASES: List[OpCase] = []
case, gap = collector(CASES)

for _n, _f in {"Tensor.sum()": lambda t: t.sum(), "Tensor.sum(dim=1)": lambda t: t.sum(dim=1),
               "Tensor.sum(axis=1)": lambda t: t.sum(axis=1),
               "Tensor.sum(1, keepdims=True)": lambda t: t.sum(1, keepdims=True),
               "Tensor.sum(dim=0, keepdim=True)": lambda t: t.sum(dim=0, keepdim=True),
               "Tensor.sum(axis=(0, 1))": lambda t: t.sum(axis=(0, 1)), "mint.sum(x, 0)": lambda t: mint.sum(t, 0),
               "ops.sum(x, 1)": lambda t: ops.sum(t, 1), "ops.reduce_sum(x, 0)": lambda t: ops.reduce_sum(t, 0),
               "ops.ReduceSum(keep_dims=True)": lambda t: ops.ReduceSum(keep_dims=True)(t, 1),
               "Tensor.mean()": lambda t: t.mean(), "Tensor.mean(dim=1)": lambda t: t.mean(dim=1),
               "Tensor.mean(axis=0)": lambda t: t.mean(axis=0),
               "Tensor.mean(1, keep_dims=True)": lambda t: t.mean(1, keep_dims=True),
               "mint.mean(x, 1)": lambda t: mint.mean(t, 1), "ops.mean(x, 1)": lambda t: ops.mean(t, 1),
               "ops.mean(x, 0, True)": lambda t: ops.mean(t, 0, True),
               "ops.reduce_mean(x, 1)": lambda t: ops.reduce_mean(t, 1),
               "Tensor.max()": lambda t: t.max(), "Tensor.min()": lambda t: t.min(),
               "Tensor.max(axis=1)": lambda t: t.max(axis=1), "Tensor.min(axis=0)": lambda t: t.min(axis=0),
               "Tensor.max(dim=1)": lambda t: t.max(dim=1)[0], "mint.max(x)": mint.max,
               "mint.amax(x, 1)": lambda t: mint.amax(t, 1),
               "ops.amax(x, 0)": lambda t: ops.amax(t, 0), "ops.amin(x, 1)": lambda t: ops.amin(t, 1),
               "Tensor.amax(axis=1)": lambda t: t.amax(axis=1), "ops.reduce_max(x, 1)": lambda t: ops.reduce_max(t, 1),
               "ops.reduce_min(x, 0)": lambda t: ops.reduce_min(t, 0), "ops.max(x, 1)": lambda t: ops.max(t, 1)[0],
               "Tensor.prod(1)": lambda t: t.prod(1), "Tensor.prod()": lambda t: t.prod(),
               "mint.prod(x, 1)": lambda t: mint.prod(t, 1), "ops.prod(x, 0)": lambda t: ops.prod(t, 0),
               "ops.ReduceProd": lambda t: ops.ReduceProd()(t, 1),
               "ops.std(x, 1)": lambda t: ops.std(t, 1), "ops.var(x, 0)": lambda t: ops.var(t, 0),
               "Tensor.std(axis=1)": lambda t: t.std(axis=1),
               "Tensor.var(axis=0, ddof=1)": lambda t: t.var(axis=0, ddof=1),
               "ops.logsumexp(x, 1)": lambda t: ops.logsumexp(t, 1), "ops.norm(x)": ops.norm}.items():
    case(_n, "reduction", _f, Arg(A, "unit") if "prod" in _n.lower() else X)
gap("mint.logsumexp", "reduction", lambda t: mint.logsumexp(t, 1), "LogSumExp")
gap("mint.std", "reduction", lambda t: mint.std(t, 1), "Std")
gap("mint.argmax(x, 1)", "reduction", lambda t: mint.argmax(t, 1), "ArgMaxExt", grad=False)
for _n, _f in {"ops.argmax(x, 1)": lambda t: ops.argmax(t, 1), "ops.argmin(x, 0)": lambda t: ops.argmin(t, 0),
               "Tensor.argmax(axis=1)": lambda t: t.argmax(axis=1), "Tensor.argmin(axis=0)": lambda t: t.argmin(axis=0),
               "Tensor.argmax()": lambda t: t.argmax(), "Tensor.max(dim=1) indices": lambda t: t.max(dim=1)[1],
               "Tensor.max(axis=1, return_indices=True)": lambda t: t.max(axis=1, return_indices=True)[1]}.items():
    case(_n, "reduction", _f, grad=False)
for _n, _f in {"mint.all(b, 1)": lambda t: mint.all(t, 1), "mint.any(b, 1)": lambda t: mint.any(t, 1),
               "ops.all(b, 1)": lambda t: ops.all(t, 1), "ops.any(b, 1)": lambda t: ops.any(t, 1),
               "Tensor.all(axis=1)": lambda t: t.all(axis=1), "Tensor.any(1)": lambda t: t.any(1)}.items():
    case(_n, "reduction", _f, Arg(A, "b"), grad=False)
