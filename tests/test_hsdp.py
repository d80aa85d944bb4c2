"""hsdp (HyperParallel's signature) against the single-device model: optimizer levels 1/2/3
on 2 and 4 ranks, shard_size 2 on 4 ranks, threshold (and its warning), gradient accumulation
with set_requires_grad_sync, set_reduce_op_type, one collective per bucket with comm_fusion, and hsdp after
parallelize_module (FSDP x TP: the data-parallel ranks found from the tp mesh)."""
from __future__ import annotations

import warnings

import pytest

from hyper_parallel_ms.fsdp import HSDPCell, hsdp
from hyper_parallel_ms.testing import multi_rank

from tests._fsdp_models import Net, accumulate_4, compare
from tests._parity import STEPS


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
                "level3": {"all_gather": 6, "reduce_scatter": 3}}     # level3 gathers again in backward
    for level, schedule in expected.items():
        counts = []

        def shard(model):
            _hsdp_per_block(model, threshold=0, optimizer_level=level, comm_fusion=True)
            assert isinstance(model, HSDPCell) and isinstance(model.layers[1], HSDPCell)
        compare(shard, rank, 2, loss_mesh=mesh, counts=counts)
        assert counts == [schedule] * STEPS, (level, counts)
    # without fusion: one collective per parameter (12 of them); under the default 64 KB threshold
    # every parameter of this tiny model stays replicated: gradients all-reduced, nothing gathered
    counts = []
    compare(lambda m: _hsdp_per_block(m, threshold=0, optimizer_level="level3"), rank, 2, loss_mesh=mesh,
            counts=counts, steps=1)
    # the backward gathers again only the 6 weights: a bias's gradient reads no value of it
    assert counts == [{"all_gather": 18, "reduce_scatter": 12}], counts
    counts = []
    compare(lambda m: _hsdp_per_block(m, optimizer_level="level3"), rank, 2, loss_mesh=mesh, counts=counts, steps=1)
    assert counts == [{"all_reduce": 12}], counts
    # buckets of 2 KB: block (1536 + 96 | 1536 + 64 bytes) -> 2 buckets, root (1024 + 64 + 192 + 12) -> 1
    counts = []
    compare(lambda m: _hsdp_per_block(m, threshold=0, optimizer_level="level3", comm_fusion=True, bucket_size=2),
            rank, 2, loss_mesh=mesh, counts=counts, steps=2, make_model=lambda: Net(dim=16, hidden=24), dim=16)
    assert counts == [{"all_gather": 10, "reduce_scatter": 5}] * 2, counts
    # HyperParallel's set_requires_grad_sync(False) without enable_grad_accumulation: accumulated locally,
    # reduced once on the last micro-step
    counts = []
    compare(lambda m: _hsdp_per_block(m, threshold=0, optimizer_level="level2", comm_fusion=True), rank, 2,
            loss_mesh=mesh, counts=counts, train=accumulate_4("set_requires_grad_sync"), steps=2, rows=16)
    assert counts == [{"all_gather": 12, "reduce_scatter": 3}] * 2, counts

    # set_reduce_op_type("sum"): the gradients summed over the 2 ranks (twice the mean)
    def summed(model):
        _hsdp_per_block(model, threshold=0, optimizer_level="level2", comm_fusion=True)
        for cell in list(model.layers) + [model]:
            cell.set_reduce_op_type("sum")

    def halved(model, step, x):
        loss, grads = step(x)
        return loss, tuple(g / 2 for g in grads)
    compare(summed, rank, 2, loss_mesh=mesh, train=halved, steps=2)
    with pytest.raises(ValueError, match="Unsupported reduce op type 'max'"):
        hsdp(Net(), threshold=0).set_reduce_op_type("max")


@multi_rank(4)
def test_hsdp_levels_shard_size_and_accumulation_4_ranks():
    mesh, rank = _world_mesh(), _rank()
    for level in ("level1", "level2"):
        compare(lambda m: _hsdp_per_block(m, threshold=0, optimizer_level=level, comm_fusion=True), rank, 4,
                loss_mesh=mesh)
    counts = []
    compare(lambda m: _hsdp_per_block(m, shard_size=2, threshold=0, optimizer_level="level3", comm_fusion=True),
            rank, 4, loss_mesh=mesh, optimizer="adamw", counts=counts)
    assert counts[0] == {"all_gather": 6, "reduce_scatter": 3, "all_reduce": 3}, counts
    counts = []
    # 16 rows on 4 ranks: 4 rows each, one per micro-step
    compare(lambda m: _hsdp_per_block(m, shard_size=2, threshold=0, optimizer_level="level3", comm_fusion=True,
                                      enable_grad_accumulation=True),
            rank, 4, loss_mesh=mesh, counts=counts, train=accumulate_4("set_requires_grad_sync"), steps=2,
            rows=16)
    assert counts == [{"all_gather": 24, "reduce_scatter": 3, "all_reduce": 3}] * 2, counts


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
    # HyperParallel's argument order: use_eager_hook sixth, then grad_scale (it was read as grad_scale)
    with pytest.raises(ValueError, match="grad_scale must be float but got 2"):
        hsdp(cell, -1, 0, "level1", False, True, 2)
    assert isinstance(hsdp(cell, -1, 0, "level1", False, True, 0.5), HSDPCell)


@multi_rank(2)
def test_hsdp_threshold_warning_2_ranks():
    from tests._fsdp_models import Net as Model
    # default threshold (64 KB): every parameter of the tiny model stays replicated, said once per call
    model = Model()
    names = [p.name for p in model.get_parameters()]
    nbytes = sum(p.size * p.itemsize for p in model.get_parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hsdp(model)
    assert len(caught) == 1 and caught[0].category is UserWarning, [str(w.message) for w in caught]
    text = str(caught[0].message)
    assert f"hsdp(Net): {len(names)} parameters ({nbytes} bytes in all) stay replicated" in text, text
    assert "threshold=64 KB" in text and "pass threshold=0 to shard everything" in text, text
    assert f"{', '.join(names[:5])}, ... ({len(names) - 5} more);" in text, text
    # threshold=1 KB: only the parameters under 1024 bytes are named; threshold=0: no warning
    model = Model(dim=16, hidden=24)
    small = [p.name for p in model.get_parameters() if p.size * p.itemsize < 1024]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hsdp(model, threshold=1)
        hsdp(Model(), threshold=0)
    assert len(caught) == 1 and f"{len(small)} parameters" in str(caught[0].message), [str(w.message) for w in caught]
    assert "threshold=1 KB" in str(caught[0].message) and small[0] in str(caught[0].message)


@multi_rank(4)
def test_hsdp_after_tp_on_4_ranks():
    from hyper_parallel_ms.fsdp import fully_shard
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.nn import ColwiseParallel, RowwiseParallel, parallelize_module, parameter_sharding
    from hyper_parallel_ms.placement import Replicate, Shard
    plan = {"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()}
    # TP on mesh["tp"], then hsdp without a mesh: it shards over the ranks at this rank's place in the other
    # tp groups (mesh["dp"]), for a (dp, tp) and a (tp, dp) layout, and trains as one device does; under the
    # default threshold the (tp-placed) parameters stay whole over dp, with their gradients all-reduced there
    for names, threshold in ((("dp", "tp"), 0), (("tp", "dp"), 0), (("dp", "tp"), 64)):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        dp_index = mesh.get_local_rank("dp")

        def shard(model):
            parallelize_module(model, mesh["tp"], plan)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _hsdp_per_block(model, threshold=threshold)
            spec = parameter_sharding(model.layers[0].up.weight).spec
            assert spec.mesh.mesh.tolist() == [[int(r) for r in mesh["tp"].mesh + d - mesh["tp"].mesh[
                mesh["tp"].get_local_rank(0)]] for d in mesh["dp"].mesh], (spec.mesh, names)
            dp_place = Shard(0) if threshold == 0 else Replicate()
            assert spec.placements == (dp_place, Shard(0)) and spec.shape == (6, 8), spec
        compare(shard, dp_index, 2, loss_mesh=mesh["dp"], make_model=lambda: Net(hidden=6), steps=3)
    # shard_size counts data-parallel ranks: 2 of them here
    with pytest.raises(ValueError, match="data-parallel ranks 2"):
        model = Net(hidden=6)
        parallelize_module(model, mesh["tp"], plan)
        hsdp(model.layers[0], shard_size=4)
    # fully_shard needs the dp mesh: without it the error names the call that works, and changes nothing
    model = Net(hidden=6)
    parallelize_module(model, mesh["tp"], plan)
    before = [(p.name, tuple(p.shape), id(p)) for p in model.get_parameters()]
    with pytest.raises(ValueError, match=r"fully_shard\(cell, mesh=mesh\[\"dp\"\]\)"):
        fully_shard(model.layers[0])
    assert [(p.name, tuple(p.shape), id(p)) for p in model.get_parameters()] == before
    assert type(model.layers[0]).__name__ == "Block"


def test_complement_ranks():
    from hyper_parallel_ms.fsdp._mesh import complement_ranks
    assert complement_ranks([1, 0], 1, 4) == [1, 3] and complement_ranks([1, 3], 3, 4) == [2, 3]
    assert complement_ranks([4, 5, 6, 7], 6, 8) == [2, 6] and complement_ranks(range(4), 2, 4) == [2]
    for group, me in (([0, 3], 0), ([1, 2], 1)):             # copies of {0, 3} or {1, 2} cannot tile 4 ranks
        with pytest.raises(ValueError, match="not one of copies tiling the 4 ranks"):
            complement_ranks(group, me, 4)


def test_hsdp_mesh_must_be_one_data_parallel_dim():
    """``mesh=`` (for a pipeline stage's dp ranks) takes a 1-D DeviceMesh; anything else is refused
    before the Cell changes."""
    from mindspore import nn
    from hyper_parallel_ms.fsdp import hsdp
    from hyper_parallel_ms.mesh import init_device_mesh
    cell = nn.Dense(4, 4)
    two_d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"), simulate=(4, 0))
    for bad in (two_d, "dp"):
        with pytest.raises(ValueError, match="mesh must be a 1-D DeviceMesh of the data-parallel ranks"):
            hsdp(cell, mesh=bad)
    assert type(cell) is nn.Dense
