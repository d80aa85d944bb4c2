"""The small model, its training and snapshots shared by the one-process checkpoint tests."""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import nn, ops


class MLP(nn.Cell):
    def __init__(self, dim: int = 6, hidden: int = 12) -> None:
        super().__init__()
        self.up = nn.Dense(dim, hidden)
        self.down = nn.Dense(hidden, dim)

    def construct(self, x):
        return self.down(ops.relu(self.up(x)))


def _trained(seed: int = 0, steps: int = 2):
    ms.set_seed(seed)
    model = MLP()
    opt = nn.Adam(model.trainable_params(), learning_rate=0.01)
    x = ms.Tensor(np.random.default_rng(seed).standard_normal((4, 6)).astype(np.float32))
    grad_fn = ms.value_and_grad(lambda: (model(x) ** 2).mean(), None, opt.parameters)
    for _ in range(steps):
        _, grads = grad_fn()
        opt(grads)
    return model, opt


def _snapshot(model, opt):
    return {p.name: p.asnumpy().copy() for p in list(model.get_parameters()) + list(opt.get_parameters())}
