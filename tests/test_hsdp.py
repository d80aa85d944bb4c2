"""hsdp (HyperParallel's signature) against the single-device model: optimizer levels 1/2/3
on 2 and 4 ranks, shard_size 2 on 4 ranks, threshold, gradient accumulation with
set_requires_grad_sync, and one collective per bucket with comm_fusion."""
from __future__ import annotations

import pytest

from hyper_parallel_ms.fsdp import HSDPCell, hsdp
from hyper_parallel_ms.testing import multi_rank

from tests._fsdp_models import Net, accumulate_4, compare


def _hsdp_per_block(model, **kwargs):
    for layer in model.layers:
        hsdp(layer, **kwargs)
    hsdp(model, **kwargs)


def _rank():
    from mindspore import communication
    return communication.get_rank()


def _world_mesh():
    from hyper_parallel_ms.mesh import init_device_mesh
    from mindspore import communication
    return init_device_mesh("cpu", (communication.get_group_size(),))


@multi_rank(2)
def test_hsdp_levels_fusion_and_threshold_2_ranks():
    mesh, rank = _world_mesh(), _rank()
    expected = {"level1": {"all_gather": 3, "all_reduce": 3}, "level2": {"all_gather": 3, "reduce_scatter": 3},
                "level3": {"all_gather": 3, "reduce_scatter": 3}}
    for level, schedule in expected.items():
        counts = []

        def shard(model):
            _hsdp_per_block(model, threshold=0, optimizer_level=level, comm_fusion=True)
            assert isinstance(model, HSDPCell) and isinstance(model.layers[1], HSDPCell)
        compare(shard, rank, 2, loss_mesh=mesh, counts=counts)
        assert counts == [schedule] * 5, (level, counts)
    # without fusion: one collective per parameter (12 of them); under the default 64 KB threshold
    # every parameter of this tiny model stays replicated: gradients all-reduced, nothing gathered
    counts = []
    compare(lambda m: _hsdp_per_block(m, threshold=0, optimizer_level="level3"), rank, 2, loss_mesh=mesh,
            counts=counts, steps=1)
    assert counts == [{"all_gather": 12, "reduce_scatter": 12}], counts
    counts = []
    compare(lambda m: _hsdp_per_block(m, optimizer_level="level3"), rank, 2, loss_mesh=mesh, counts=counts, steps=1)
    assert counts == [{"all_reduce": 12}], counts
    # buckets of 2 KB: block (1536 + 96 | 1536 + 64 bytes) -> 2 buckets, root (1024 + 64 + 192 + 12) -> 1
    counts = []
    compare(lambda m: _hsdp_per_block(m, threshold=0, optimizer_level="level3", comm_fusion=True, bucket_size=2),
            rank, 2, loss_mesh=mesh, counts=counts, steps=2, make_model=lambda: Net(dim=16, hidden=24), dim=16)
    assert counts == [{"all_gather": 5, "reduce_scatter": 5}] * 2, counts


@multi_rank(4)
def test_hsdp_levels_shard_size_and_accumulation_4_ranks():
    mesh, rank = _world_mesh(), _rank()
    for level in ("level1", "level2"):
        compare(lambda m: _hsdp_per_block(m, threshold=0, optimizer_level=level, comm_fusion=True), rank, 4,
                loss_mesh=mesh)
    counts = []
    compare(lambda m: _hsdp_per_block(m, shard_size=2, threshold=0, optimizer_level="level3", comm_fusion=True),
            rank, 4, loss_mesh=mesh, optimizer="adamw", counts=counts)
    assert counts[0] == {"all_gather": 3, "reduce_scatter": 3, "all_reduce": 3}, counts
    counts = []
    # 16 rows on 4 ranks: 4 rows each, one per micro-step
    compare(lambda m: _hsdp_per_block(m, shard_size=2, threshold=0, optimizer_level="level3", comm_fusion=True,
                                      enable_grad_accumulation=True),
            rank, 4, loss_mesh=mesh, counts=counts, train=accumulate_4("set_requires_grad_sync"), steps=2,
            rows=16)
    assert counts == [{"all_gather": 12, "reduce_scatter": 3, "all_reduce": 3}] * 2, counts


def test_hsdp_argument_errors():
    import mindspore as ms
    from mindspore import nn
    cell = nn.Dense(2, 2)
    for kwargs, word in [({"shard_size": 0}, "shard_size"), ({"threshold": -1}, "threshold"),
                         ({"optimizer_level": "level4"}, "optimizer_level"), ({"grad_scale": 1}, "grad_scale"),
                         ({"bucket_size": -2}, "bucket_size"), ({"comm_fusion": 1}, "comm_fusion"),
                         ({"reduce_dtype": ms.int32}, "reduce_dtype")]:
        with pytest.raises(ValueError, match=word):
            hsdp(cell, **kwargs)
    assert not isinstance(cell, HSDPCell) and type(cell.weight).__name__ == "Parameter"
