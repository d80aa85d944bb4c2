"""The op sweep's entries: matmul, softmax, norms, losses."""
from __future__ import annotations

from typing import List

from mindspore import mint, nn, ops

from ._base import A3, Arg, F, OpCase, X, collector

CASES: List[OpCase] = []
case, gap = collector(CASES)

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
