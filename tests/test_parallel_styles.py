"""Parallel styles on real Cells against the single-device model: loss, gathered gradients
and parameters after 5 optimizer steps (nn.SGD and nn.AdamWeightDecay), on meshes (2,),
(4,) and (2, 2) = dp x tp."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                  parallelize_module)
from hyper_parallel_ms.placement import Replicate, Shard
from hyper_parallel_ms.testing import multi_rank

from tests._parity import check_parity


class MLP(nn.Cell):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.up = nn.Dense(dim, hidden)
        self.down = nn.Dense(hidden, dim)

    def construct(self, x):
        return self.down(ops.relu(self.up(x)))


def _data(seed, *shape):
    return ms.Tensor(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _mlp_batch(dp_index, dp_size, step):
    x = _data(10 + step, 4, 3, 8)
    rows = 4 // dp_size
    return (x[dp_index * rows:(dp_index + 1) * rows],)


def _square_loss(model, x):
    return (model(x) ** 2).mean()


def _mlp_plan(model, mesh):
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@multi_rank(2)
def test_mlp_colwise_rowwise_on_2_ranks(optimizer):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    check_parity(MLP, lambda m: _mlp_plan(m, mesh), _mlp_batch, _square_loss, optimizer=optimizer)
