"""The op sweep's entries: views and shapes."""
from __future__ import annotations

from typing import List

from mindspore import mint, ops

from ._base import A3, Arg, OpCase, X, Y, _NO_GRAD, collector

CASES: List[OpCase] = []
case, gap = collector(CASES)

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
               "mint.permute(x, (2, 0, 1))": lambda t: mint.permute(t, (2, 0, 1)),
               "Tensor.transpose(2, 0, 1)": lambda t: t.transpose(2, 0, 1)}.items():
    case(_n, "view", _f, Arg(A3))
for _n, _f in {"mint.cat([x, y], 0)": lambda a, b: mint.cat([a, b], 0),
               "ops.cat([x, y], 1)": lambda a, b: ops.cat([a, b], 1),
               "ops.concat([x, y], 0)": lambda a, b: ops.concat([a, b], 0)}.items():
    case(_n, "view", _f, X, Y)
gap("mint.stack([x, y], 1)", "view", lambda a, b: mint.stack([a, b], 1), "StackExt", X, Y)
case("ops.stack([x, y], 0)", "view", lambda a, b: ops.stack([a, b], 0), X, Y)
