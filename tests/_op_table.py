"""The op sweep's table: MindSpore entry points with sample inputs, and the rank function
that runs every entry on DTensors under every placement of its inputs, comparing the
result and its gradients with the single-device op.

An entry is ``OpCase(name, family, fn, inputs)``; ``inputs`` are :class:`Arg` (shape, kind,
which placements it takes). ``status`` is ``"ok"``, ``"unsupported"`` (no rule: the sweep
checks the clear NotImplementedError), ``"bypass"`` (MindSpore runs it without calling the
tensor hook: the sweep checks that this is still so, so that a fix shows) or ``"cpu_kernel"``
(MindSpore has no CPU kernel: the sweep checks that the rule itself is there) or ``"open"``
(the sweep found a wrong result that is not fixed yet; listed in the README, not run). ``grad=False``
entries with a ``reason`` compare values only (no CPU kernel for the backward).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, mint, nn, ops

from hyper_parallel_ms.dtensor import DTensor, distribute_tensor
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.placement import Partial, Placement, Replicate, Shard

F = mint.nn.functional


@dataclass(frozen=True)
class Arg:
    """A sample input: ``kind`` is "f" (float), "pos" (positive float), "unit" (in (-1, 1)),
    "b" (bool), "i-<n>" (int64 in [0, n)), "i32-<n>" (int32), "z-<n>" (int64 in [-n, n)),
    "z32-<n>" (int32 in [-n, n)); ``shard`` says which placements it takes:
    "all", "rep" (replicated), "tied" (the first input's placement) or a tuple of the tensor
    dims it may be sharded on."""

    shape: Tuple[int, ...]
    kind: str = "f"
    shard: Any = "all"


@dataclass(frozen=True)
class OpCase:
    name: str
    family: str
    fn: Callable
    inputs: Tuple[Arg, ...]
    status: str = "ok"
    reason: str = ""
    grad: bool = True
    prim: str = ""          # the primitive a "cpu_kernel" entry dispatches (its rule must exist)


A = (5, 6)          # uneven over 4 ranks on both dims (2, 2, 1, 0 and 2, 2, 2, 0): empty pieces
A3 = (4, 5, 6)
X = Arg(A)
POS = Arg(A, "pos")
UNIT = Arg(A, "unit")
MASK = Arg(A, "b", "tied")

CASES: List[OpCase] = []
_NO_GRAD = "value only: MindSpore has no CPU kernel for the backward of {}"


def case(name, family, fn, *inputs, status="ok", reason="", grad=True, prim=""):
    CASES.append(OpCase(name, family, fn, tuple(inputs) or (X,), status, reason, grad, prim))


def gap(name, family, fn, prim, *inputs, grad=True):
    """An entry point whose kernel MindSpore lacks on CPU: its rule is checked, not run."""
    case(name, family, fn, *inputs, status="cpu_kernel", reason=f"no CPU kernel for {prim} in MindSpore 2.10",
         grad=grad, prim=prim)


# ---- element-wise, unary: the same function through mint, ops and Tensor methods ----
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

# ---- activations ----
for _n, _f in {"relu": F.relu, "silu": F.silu, "sigmoid": F.sigmoid, "tanh": F.tanh}.items():
    case(f"mint.nn.functional.{_n}", "activation", _f)
if tuple(int(v) for v in ms.__version__.split(".")[:2]) >= (2, 10):
    case("mint.nn.functional.softplus", "activation", F.softplus, grad=False, reason=_NO_GRAD.format("SoftplusGradExt"))
else:  # MindSpore 2.8 / 2.9 have no CPU kernel for SoftplusExt itself
    gap("mint.nn.functional.softplus", "activation", F.softplus, "SoftplusExt", grad=False)
for _n, _f in {"relu": ops.relu, "silu": ops.silu, "gelu": ops.gelu, "relu6": ops.relu6, "softsign": ops.softsign,
               "mish": ops.mish, "elu": ops.elu, "hardswish": ops.hardswish, "softplus": ops.softplus}.items():
    case(f"ops.{_n}", "activation", _f)
for _n, _cell in {"ReLU": nn.ReLU, "GELU": nn.GELU, "SiLU": nn.SiLU, "Tanh": nn.Tanh, "Sigmoid": nn.Sigmoid}.items():
    case(f"nn.{_n}", "activation", _cell())
for _n, _f in {"hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid}.items():
    case(f"mint.nn.functional.{_n}", "activation", _f)
for _n, _f, _p in (("gelu", F.gelu, "GeluExt"), ("leaky_relu", F.leaky_relu, "LeakyReLUExt"), ("elu", F.elu, "EluExt"),
                   ("hardtanh", F.hardtanh, "Hardtanh"), ("mish", F.mish, "MishExt"),
                   ("logsigmoid", F.logsigmoid, "LogSigmoid")):
    gap(f"mint.nn.functional.{_n}", "activation", _f, _p)
for _n in ("sinh", "cosh", "tan"):
    case(f"mint.{_n}", "element-wise", getattr(mint, _n), UNIT)
for _n, _p in (("log2", "Log2"), ("exp2", "Exp2"), ("frac", "Frac"), ("atan", "AtanExt"), ("asin", "AsinExt")):
    gap(f"mint.{_n}", "element-wise", getattr(mint, _n), _p, UNIT)

# ---- element-wise with scalars, casts ----
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
case("ops.zeros_like", "factory-like", ops.zeros_like, grad=False)
case("ops.ones_like", "factory-like", ops.ones_like, grad=False)
gap("mint.zeros_like", "factory-like", mint.zeros_like, "ZerosLikeExt", grad=False)
gap("mint.full_like", "factory-like", lambda t: mint.full_like(t, 2.0), "FullLike", grad=False)
gap("Tensor.clone()", "copy", lambda t: t.clone(), "Clone")
gap("mint.clone", "copy", mint.clone, "Clone")
case("Tensor.contiguous()", "copy", lambda t: t.contiguous())

# ---- binary element-wise and comparisons ----
Y = Arg(A)
ROW = Arg((6,))
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
               "x <= 0.5": lambda t: t <= 0.5, "mint.eq(x, 0.5)": lambda t: mint.eq(t, 0.5),
               "ops.isnan": ops.isnan, "mint.isnan": mint.isnan}.items():
    case(_n, "comparison", _f, grad=False)
for _n, _f in {"mint.logical_and": mint.logical_and, "mint.logical_or": mint.logical_or,
               "mint.logical_xor": mint.logical_xor, "ops.logical_and": ops.logical_and,
               "b & c": lambda a, b: a & b, "b | c": lambda a, b: a | b}.items():
    case(_n, "logical", _f, Arg(A, "b", (0, 1)), Arg(A, "b", "tied"), grad=False)
for _n, _f in {"mint.logical_not": mint.logical_not, "ops.logical_not": ops.logical_not, "~b": lambda a: ~a}.items():
    case(_n, "logical", _f, Arg(A, "b", (0, 1)), grad=False)

# ---- where / masked_fill / clamp ----
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

# ---- reductions, both spellings ----
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

# ---- scans, sort, top-k, flip, triangles ----
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

# ---- views and shapes ----
for _n, _f in {"Tensor.T": lambda t: t.T, "Tensor.t()": lambda t: t.t(), "mint.t": mint.t,
               "mint.transpose(x, 0, 1)": lambda t: mint.transpose(t, 0, 1),
               "ops.transpose": lambda t: ops.transpose(t, (1, 0)),
               "Tensor.transpose(1, 0)": lambda t: t.transpose(1, 0), "Tensor.permute(1, 0)": lambda t: t.permute(1, 0),
               "Tensor.swapaxes": lambda t: t.swapaxes(0, 1), "Tensor.reshape(30)": lambda t: t.reshape(30),
               "Tensor.view(5, 2, 3)": lambda t: t.view(5, 2, 3),
               "ops.reshape(x, (5, 3, 2))": lambda t: ops.reshape(t, (5, 3, 2)),
               "mint.reshape(x, (-1,))": lambda t: mint.reshape(t, (-1,)),
               "Tensor.unsqueeze(0)": lambda t: t.unsqueeze(0),
               "mint.unsqueeze(x, 2)": lambda t: mint.unsqueeze(t, 2),
               "ops.expand_dims(x, 1)": lambda t: ops.expand_dims(t, 1),
               "Tensor.expand_dims(0)": lambda t: t.expand_dims(0),
               "Tensor.squeeze()": lambda t: t.unsqueeze(1).squeeze(),
               "ops.squeeze(x, 0)": lambda t: ops.squeeze(t.unsqueeze(0), 0),
               "mint.flatten(x)": mint.flatten, "Tensor.flatten()": lambda t: t.flatten(),
               "ops.flatten(x)": ops.flatten,

               "mint.narrow(x, 1, 1, 3)": lambda t: mint.narrow(t, 1, 1, 3),
               "ops.narrow(x, 0, 1, 2)": lambda t: ops.narrow(t, 0, 1, 2),
               "x[1]": lambda t: t[1], "x[:, 2:5]": lambda t: t[:, 2:5],
               "x[..., None]": lambda t: t[..., None]}.items():
    case(_n, "view", _f)
for _n, _f in {"ops.unbind(x, 1)": lambda t: ops.unbind(t, 1)[2], "ops.unstack(x, 0)": lambda t: ops.unstack(t, 0)[0],
               "Tensor.unbind(1)": lambda t: t.unbind(1)[0], "ops.split(x, 3, 1)": lambda t: ops.split(t, 3, 1)[0],
               "ops.chunk(x, 2, 1)": lambda t: ops.chunk(t, 2, 1)[0]}.items():
    case(_n, "view", _f)
case("mint.split(x, 2, 1)", "view", lambda t: mint.split(t, 2, 1)[1])
case("mint.chunk(x, 2, 0)", "view", lambda t: mint.chunk(t, 2, 0)[1])
case("mint.unbind(x, 0)", "view", lambda t: mint.unbind(t, 0)[1], grad=False, reason=_NO_GRAD.format("UnstackExtView"))
for _n, _f in {"mint.flatten(x, 1, 2)": lambda t: mint.flatten(t, 1, 2), "ops.flatten(3-D)": ops.flatten,
               "Tensor.view(4, 30)": lambda t: t.view(4, 30),
               "mint.permute(x, (2, 0, 1))": lambda t: mint.permute(t, (2, 0, 1))}.items():
    case(_n, "view", _f, Arg(A3))
for _n, _f in {"mint.cat([x, y], 0)": lambda a, b: mint.cat([a, b], 0),
               "ops.cat([x, y], 1)": lambda a, b: ops.cat([a, b], 1),
               "ops.concat([x, y], 0)": lambda a, b: ops.concat([a, b], 0)}.items():
    case(_n, "view", _f, X, Y)
gap("mint.stack([x, y], 1)", "view", lambda a, b: mint.stack([a, b], 1), "StackExt", X, Y)
case("ops.stack([x, y], 0)", "view", lambda a, b: ops.stack([a, b], 0), X, Y)

# ---- broadcasting copies ----
COL = Arg((5, 1))
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

# ---- gathers and index selection ----
IDX1 = Arg((4,), "i32-5", "rep")
case("ops.gather(x, idx, 0)", "gather", lambda a, i: ops.gather(a, i, 0), X, IDX1)
case("ops.gather(x, idx, 1)", "gather", lambda a, i: ops.gather(a, i, 1), X, Arg((3,), "i32-6", "rep"))
case("ops.index_select(x, 1, idx)", "gather", lambda a, i: ops.index_select(a, 1, i), X, Arg((3,), "i32-6", "rep"))
case("ops.index_select(x, 0, idx)", "gather", lambda a, i: ops.index_select(a, 0, i), X, IDX1)
case("mint.gather(x, 1, idx)", "gather", lambda a, i: mint.gather(a, 1, i), X, Arg(A, "i-6", (0,)))
case("ops.gather_elements(x, 0, idx)", "gather", lambda a, i: ops.gather_elements(a, 0, i), X, Arg(A, "i-5", (1,)))
case("nn.Embedding", "gather", lambda t, i: ops.gather(t, i, 0), Arg((5, 6)), Arg((2, 3), "i32-5", "rep"))
gap("mint.index_select", "gather", lambda a, i: mint.index_select(a, 1, i), "IndexSelect", X, Arg((3,), "i-6", "rep"))

# ---- matmul, softmax, norms, losses ----
case("ops.matmul", "matmul", ops.matmul, X, Arg((6, 3)))
case("mint.matmul", "matmul", mint.matmul, X, Arg((6, 3)))
case("x @ w", "matmul", lambda a, b: a @ b, X, Arg((6, 3)))
case("Tensor.matmul", "matmul", lambda a, b: a.matmul(b), X, Arg((6, 3)))
case("mint.nn.functional.linear", "matmul", F.linear, X, Arg((3, 6)), Arg((3,)))
case("ops.bmm", "matmul", ops.bmm, Arg((2, 5, 6)), Arg((2, 6, 3)))
gap("mint.mm", "matmul", mint.mm, "Mm", X, Arg((6, 3)))
for _n, _f in {"ops.softmax(x, 1)": lambda t: ops.softmax(t, 1), "mint.softmax(x, 0)": lambda t: mint.softmax(t, 0),
               "Tensor.softmax(1)": lambda t: t.softmax(1), "ops.log_softmax(x, 1)": lambda t: ops.log_softmax(t, 1),
               "mint.nn.functional.softmax": lambda t: F.softmax(t, 1)}.items():
    case(_n, "softmax / norm", _f)
case("nn.LayerNorm", "softmax / norm", nn.LayerNorm((6,), begin_norm_axis=-1, begin_params_axis=-1), Arg(A3))
case("nn.LayerNorm (last two dims)", "softmax / norm", nn.LayerNorm((5, 6), begin_norm_axis=1, begin_params_axis=1),
     Arg(A3))
gap("mint.nn.functional.layer_norm", "softmax / norm", lambda t: F.layer_norm(t, (6,)), "LayerNormExt", Arg(A3))

# ---- integer and bool values that collectives move (exact on CPU: comm/_exact.py) ----
BIG32 = Arg(A, "z32-268435456")     # |x| < 2^28, beyond float32's 24-bit mantissa; 6 of them fit in int32
BIG64 = Arg(A, "z-1099511627776")   # |x| < 2^40
FEW32, FEW64 = Arg(A, "z32-3"), Arg(A, "z-3")   # in [-3, 3): products, equal pairs
BOOL = Arg(A, "b")
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

# ---- no rule (yet): the clear NotImplementedError ----
case("ops.trace", "unsupported", ops.trace, status="unsupported")
case("ops.diag", "unsupported", lambda t: ops.diag(t[0]), status="unsupported")
case("ops.renorm", "unsupported", lambda t: ops.renorm(t, 2, 0, 1.0), status="unsupported")
case("ops.diff", "unsupported", lambda t: ops.diff(t, 1, 0), status="unsupported")
case("ops.roll", "unsupported", lambda t: ops.roll(t, 1, 1), status="unsupported")


# ---------------------------------------------------------------------------------------------
# The rank function


def _array(arg: Arg, rng) -> np.ndarray:
    kind, shape = arg.kind, arg.shape
    if kind == "f":
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "pos":
        return (np.abs(rng.standard_normal(shape)) + 0.5).astype(np.float32)
    if kind == "unit":
        return rng.uniform(-0.9, 0.9, shape).astype(np.float32)
    if kind == "b":
        return rng.random(shape) > 0.5
    signed, kind = kind.startswith("z"), kind[1:]
    dtype, high = (np.int32, int(kind[3:])) if kind.startswith("32-") else (np.int64, int(kind[1:]))
    return rng.integers(-high if signed else 0, high, shape).astype(dtype)


def _options(arg: Arg, mesh_shape: Tuple[int, ...]) -> List[Tuple[Placement, ...]]:
    """The placements ``arg`` takes: on a 1-D mesh every one (Partial(sum) too for floats); on
    a 2-D mesh three, chosen for what a 1-D mesh cannot show: a dim sharded over both mesh
    dims (5 rows on 4 ranks: 2, 2, 1, 0, so an empty piece), two dims sharded, one replicated."""
    if arg.shard == "rep":
        return [(Replicate(),) * len(mesh_shape)]
    dims = range(len(arg.shape)) if arg.shard in ("all", "tied") else arg.shard
    per_dim: List[Placement] = [Replicate()] + [Shard(d) for d in dims]
    if len(mesh_shape) == 1:
        return [(p,) for p in per_dim] + ([(Partial(),)] if arg.kind in ("f", "pos", "unit") else [])
    first, last = Shard(min(dims)), Shard(max(dims))    # on a 2-D mesh, the costly cases only:
    return [(first, first), (last, first), (Replicate(), last)]   # nested (empty pieces), 2-D, 1-D


def _combos(c: OpCase, mesh_shape) -> List[Tuple[Tuple[Placement, ...], ...]]:
    """Every placement of each input: the input with the most placements takes all of them;
    each other input runs through all of its own alongside (cycled); "tied" inputs (masks,
    indices) follow the first other input."""
    options = [_options(a, mesh_shape) for a in c.inputs]
    count = max(len(o) for o in options)
    leader = next(j for j, a in enumerate(c.inputs) if a.shard != "tied")
    combos = []
    for k in range(count):
        combo = [opts[(k * (j + 1) + j) % len(opts)] for j, opts in enumerate(options)]
        for j, arg in enumerate(c.inputs):
            if arg.shard == "tied":
                same = arg.shape == c.inputs[leader].shape
                combo[j] = tuple(Replicate() if p.is_partial() or not same else p for p in combo[leader])
        combos.append(tuple(combo))
    return list(dict.fromkeys(combos))


def _outputs(result) -> Tuple[Any, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _is_float(t) -> bool:
    return t.dtype in (ms.float32, ms.float16, ms.float64, ms.bfloat16)


def _numpy(t) -> np.ndarray:
    """Float values as float32 (compared with a tolerance), integers and bools as they are
    (compared exactly, dtype included)."""
    return t.astype(ms.float32).asnumpy() if _is_float(t) else t.asnumpy()


def _differs(got: np.ndarray, want: np.ndarray) -> Optional[str]:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape {got.shape} {got.dtype}, want {want.shape} {want.dtype}"
    if want.dtype.kind in "biu":
        return None if np.array_equal(got, want) else f"{int(np.sum(got != want))} elements differ (exact)"
    return None if np.allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True) else \
        f"max error {np.max(np.abs(got - want))}"


def _reference(c: OpCase, arrays):
    full = [Tensor(a) for a in arrays]
    outs = _outputs(c.fn(*full))
    floats = tuple(i for i, a in enumerate(c.inputs) if a.kind in ("f", "pos", "unit"))
    weights = [Tensor(np.random.default_rng(7 + i).standard_normal(o.shape).astype(np.float32))
               for i, o in enumerate(outs)]
    grads = None
    if c.grad and floats:
        def loss(*args):
            return sum((o.astype(ms.float32) * w).sum() for o, w in zip(_outputs(c.fn(*args)), weights)
                       if _is_float(o))
        grads = ms.grad(loss, grad_position=floats)(*full)
        grads = grads if isinstance(grads, tuple) else (grads,)
    return [_numpy(o) for o in outs], weights, floats, grads


def _check(c: OpCase, mesh, combo, arrays, ref) -> Optional[str]:
    ref_outs, weights, floats, ref_grads = ref
    dts = [distribute_tensor(Tensor(a), mesh, p, src_data_rank=None) for a, p in zip(arrays, combo)]
    outs = _outputs(c.fn(*dts))
    for o in outs:
        if not isinstance(o, DTensor):
            return f"returned a {type(o).__name__}, not a DTensor"
    for o, want in zip(outs, ref_outs):
        problem = _differs((o.astype(ms.float32) if _is_float(o) else o).full_tensor().asnumpy(), want)
        if problem:
            return f"value differs: placements {o.placements}, {problem}"
    if ref_grads is None:
        return None

    def loss(*pieces):
        args = list(dts)
        for i, piece in zip(floats, pieces):
            args[i] = DTensor.from_local(piece, mesh, dts[i].layout, shape=dts[i].shape)
        return sum((o.full_tensor() * w).sum() for o, w in zip(_outputs(c.fn(*args)), weights) if _is_float(o))
    grads = ms.grad(loss, grad_position=tuple(range(len(floats))))(*[dts[i].to_local() for i in floats])
    grads = grads if isinstance(grads, tuple) else (grads,)
    coord = mesh.get_coordinate()
    for i, g, rg in zip(floats, grads, ref_grads):
        d = dts[i]
        layout = d.layout.with_placements(tuple(Replicate() if p.is_partial() else p for p in d.layout.placements))
        want = rg.asnumpy()[layout.local_slices(d.shape, coord)]
        if g.shape != want.shape or not np.allclose(g.asnumpy(), want, rtol=1e-5, atol=1e-5):
            return f"gradient of input {i} differs"
    return None


def sweep(mesh_shape: Tuple[int, ...], names: Optional[Sequence[str]] = None,
          trace: Optional[str] = None, skip_families: Sequence[str] = ()) -> Dict[str, Any]:
    """Run the table on this rank's mesh; return {"failures": [...], "checked": n, "cases": n}.
    ``names``: only these entries; ``trace``: a path prefix to which each rank logs each check;
    ``skip_families``: families left out."""
    from hyper_parallel_ms.ops import registered_ops
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=tuple(f"d{i}" for i in range(len(mesh_shape))))
    failures: List[str] = []
    checked = 0
    for c in CASES:
        if (names is not None and c.name not in names) or c.family in skip_families:
            continue
        rng = np.random.default_rng(zlib.crc32(c.name.encode()))
        arrays = [_array(a, rng) for a in c.inputs]
        if c.status == "open":              # a known wrong result, listed in the README; not run
            continue
        if c.status == "cpu_kernel":
            if c.prim not in registered_ops():
                failures.append(f"{c.name}: no rule for {c.prim}")
            continue
        if c.status == "bypass":
            dts = [distribute_tensor(Tensor(a), mesh, [Replicate()] * len(mesh_shape), src_data_rank=None)
                   for a in arrays]
            if isinstance(c.fn(*dts), DTensor):
                failures.append(f"{c.name}: now reaches the dispatcher; make it an ordinary entry")
            continue
        if c.status == "unsupported":
            dts = [distribute_tensor(Tensor(a), mesh, [Shard(0)] * len(mesh_shape), src_data_rank=None)
                   for a in arrays]
            try:
                c.fn(*dts)
                failures.append(f"{c.name}: expected NotImplementedError")
            except NotImplementedError as err:
                if "no sharding rule" not in str(err):
                    failures.append(f"{c.name}: unclear error {err}")
            continue
        try:
            ref = _reference(c, arrays)
        except Exception as err:  # noqa: BLE001
            failures.append(f"{c.name}: the single-device op failed: {str(err).strip().splitlines()[-1][:200]}")
            continue
        for combo in _combos(c, mesh_shape):
            checked += 1
            if trace:
                with open(f"{trace}.{mesh.get_coordinate()}", "a") as log:
                    log.write(f"{c.name} {combo}\n")
            try:
                problem = _check(c, mesh, combo, arrays, ref)
            except Exception as err:  # noqa: BLE001  (collected and reported by the test)
                problem = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            if problem:
                failures.append(f"{c.name} {[tuple(map(str, p)) for p in combo]}: {problem}")
    return {"failures": failures, "checked": checked, "cases": len(CASES)}
