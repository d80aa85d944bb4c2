"""The op sweep's entries: activations."""
from __future__ import annotations

from typing import List

import mindspore as ms
from mindspore import mint, nn, ops

from ._base import F, OpCase, UNIT, _NO_GRAD, collector

CASES: List[OpCase] = []
case, gap = collector(CASES)

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
