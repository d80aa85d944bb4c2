"""A rank's viewpoint without a cluster: meshes of a simulated rank, their collectives (recorded,
not run), and the plans built on them (styles, fully_shard, hsdp, pipeline meshes, checkpoint
pieces) checked against what real ranks build."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from hyper_parallel_ms.testing import multi_rank

ROOT = str(Path(__file__).resolve().parents[1])


def _cpu():
    import mindspore as ms
    if ms.get_context("device_target") != "CPU":
        ms.set_device("CPU")


def _llama(deferred: bool):
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import mindspore as ms
    from examples.llama import Llama, LlamaConfig
    from hyper_parallel_ms import no_init_parameters
    config = LlamaConfig(vocab=66, dim=32, layers=2, heads=4, hidden=48, max_seq=16)   # vocab 66: uneven
    ms.set_seed(0)
    if deferred:
        with no_init_parameters():
            return Llama(config)
    return Llama(config)


def _plan(mesh, deferred: bool):
    """The example's FSDP x TP plan on a (dp, tp) mesh; each parameter's (name, global shape,
    placements, local shape, mesh ranks) and its data-parallel dims."""
    from examples.llama import tp_plan
    from hyper_parallel_ms import fully_shard
    from hyper_parallel_ms.nn import parallelize_module, parameter_sharding
    model = _llama(deferred)
    parallelize_module(model, mesh["tp"], tp_plan(sequence_parallel=True))
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    out = []
    for p in model.get_parameters():
        spec = parameter_sharding(p).spec
        out.append((p.name, spec.shape, tuple(str(q) for q in spec.placements), tuple(p.shape),
                    spec.local_shape(), spec.mesh.rank_list, spec.mesh.mesh_dim_names))
    return model, out


def _collectives(mesh):
    """Every collective kind on ``mesh`` (uneven pieces too): output shapes and dtypes, and records."""
    import mindspore as ms
    from hyper_parallel_ms import comm
    from hyper_parallel_ms.comm import CommDebugMode
    tp = mesh.get_local_rank("tp")
    x = ms.Tensor(np.ones((5, 6), np.float32))
    uneven = ms.Tensor(np.ones((3 - tp, 4), np.float32))
    with CommDebugMode() as mode:
        outs = [comm.all_gather(x, mesh, "tp", dim=1), comm.all_gather(uneven, mesh, "tp", dim=0, sizes=(3, 2)),
                comm.reduce_scatter(x, mesh, "dp", dim=0), comm.all_reduce(x, mesh, "tp", op="max"),
                comm.all_reduce(x.astype(ms.int32), mesh, "dp"),
                comm.all_to_all(x, mesh, "tp", split_dim=0, concat_dim=1), comm.broadcast(x, mesh, "dp", src=1)]
    records = [r for r in mode.records]
    return [(tuple(o.shape), str(o.dtype)) for o in outs], records


def test_simulated_mesh_is_a_rank_of_a_simulated_cluster():
    _cpu()
    from hyper_parallel_ms.mesh import DeviceMesh, init_device_mesh
    seen = set()
    for r in range(8):
        mesh = init_device_mesh("npu", (2, 4), mesh_dim_names=("dp", "tp"), simulate=(8, r))
        dp, tp = divmod(r, 4)
        assert mesh.is_simulated and mesh.get_rank() == r and mesh.get_coordinate() == [dp, tp]
        assert mesh.device_target == "Ascend" and mesh.get_local_rank("tp") == tp
        assert mesh["tp"].rank_list == tuple(range(4 * dp, 4 * dp + 4)) and mesh["tp"].is_simulated
        assert mesh["dp"].rank_list == (tp, tp + 4) and mesh["dp"].get_rank() == r
        assert mesh.comm_group("tp").ranks == mesh["tp"].rank_list and mesh.comm_group("tp").rank == tp
        assert mesh.comm_group("dp").simulated and mesh.get_group("tp") is not None
        assert mesh._flatten("all").get_coordinate() == [r]
        assert f"simulated rank {r} of 8" in repr(mesh)
        seen.add(mesh)
    assert len(seen) == 8                   # the same ranks seen from different ranks are different meshes
    assert not init_device_mesh("cpu", (1,)).is_simulated
    with pytest.raises(ValueError, match=r"rank must be in \[0, 8\)"):
        init_device_mesh("npu", (8,), simulate=(8, 8))
    with pytest.raises(ValueError, match="holds 4 ranks but the world has 8"):
        init_device_mesh("npu", (4,), simulate=(8, 0))
    with pytest.raises(ValueError, match=r"simulate must be \(world_size, rank\)"):
        init_device_mesh("npu", (8,), simulate=8)
    npu = init_device_mesh("npu", (8,), simulate=(8, 0))
    with pytest.raises(ValueError, match="differs from the simulated world's 'npu'"):
        DeviceMesh("cpu", list(range(8)), _world=npu._world)
    outside = init_device_mesh("npu", (4,), rank_list=[4, 5, 6, 7], simulate=(8, 0))
    assert outside.get_coordinate() is None
    with pytest.raises(RuntimeError, match="rank 0 is not in"):
        outside.comm_group(0)


def test_simulated_collectives_return_shapes_and_record_the_native_path():
    _cpu()
    import mindspore as ms
    from hyper_parallel_ms import comm
    from hyper_parallel_ms.comm import CommDebugMode
    from hyper_parallel_ms.mesh import init_device_mesh
    for r in range(4):
        mesh = init_device_mesh("npu", (2, 2), mesh_dim_names=("dp", "tp"), simulate=(4, r))
        shapes, records = _collectives(mesh)
        tp = r % 2
        assert shapes == [((5, 12), "Float32"), ((5, 4), "Float32"), ((3 - r // 2, 6), "Float32"),
                          ((5, 6), "Float32"), ((5, 6), "Int32"), ((3 - tp, 12), "Float32"), ((5, 6), "Float32")]
        assert [(rec.kind, rec.path, rec.group) for rec in records] == [
            ("all_gather", "native", mesh["tp"].rank_list), ("all_gather", "native", mesh["tp"].rank_list),
            ("reduce_scatter", "native", mesh["dp"].rank_list), ("all_reduce", "native", mesh["tp"].rank_list),
            ("all_reduce", "native", mesh["dp"].rank_list), ("all_to_all", "native", mesh["tp"].rank_list),
            ("broadcast", "native", mesh["dp"].rank_list)]
        # textbook bytes: gather out - in; reduce-scatter in - own chunk; all-reduce 2 (n-1)/n size
        assert [rec.bytes for rec in records] == [120, 16 * (2 + tp), 120 - (3 - r // 2) * 24, 120, 120,
                                                  120 - (3 - tp) * 24, 120]
        with CommDebugMode() as mode:
            comm.send(ms.Tensor(np.ones((2, 3), np.float32)), mesh, "tp", dst=1 - r % 2)
            got = comm.recv(ms.Tensor(np.ones((2, 3), np.float16)), mesh, "tp", src=1 - r % 2)
        assert got.shape == (2, 3) and got.dtype == ms.float16
        peer = mesh["tp"].rank_list[1 - r % 2]
        assert [(m.kind, m.bytes, m.peer) for m in mode.records] == [("send", 24, peer), ("recv", 0, peer)]


def test_a_simulated_rank_plans_pieces_without_values_and_the_ranks_tile_every_tensor():
    _cpu()
    from hyper_parallel_ms.checkpoint import get_model_state_dict
    from hyper_parallel_ms.checkpoint._default_planner import DefaultSavePlanner
    from hyper_parallel_ms.checkpoint._boxes import assign_writers
    from hyper_parallel_ms.mesh import init_device_mesh
    plans, held = [], {}
    for r in range(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), simulate=(4, r))
        model, pieces = _plan(mesh, deferred=True)
        for name, shape, placements, local, expected, ranks, names in pieces:
            assert local == expected and ranks == (0, 1, 2, 3) and names == ("dp", "tp"), name
            held[name, r] = local
        assert all(p.has_init for p in model.get_parameters() if "norm" not in p.name)   # no values made
        planner = DefaultSavePlanner()
        planner.set_up_planner({"model": get_model_state_dict(model)}, is_coordinator=r == 0)
        plans.append(planner.create_local_plan(with_checksums=False))
    writes = assign_writers(plans)               # raises unless the ranks' pieces tile every tensor
    assert sum(len(w) for w in writes) >= len(plans[0])
    # the vocabulary (66 rows, tp 2 then dp 2: 33 -> 17 / 16) is uneven: ranks differ
    assert held["tok_embeddings.embedding_table", 0] == (17, 32)
    assert held["tok_embeddings.embedding_table", 2] == (16, 32)


def test_hsdp_and_default_meshes_take_the_simulated_world():
    _cpu()
    from mindspore import nn
    from hyper_parallel_ms import fully_shard, hsdp, no_init_parameters
    from hyper_parallel_ms._cluster import World, simulating
    from hyper_parallel_ms.nn import parameter_sharding
    from hyper_parallel_ms.pipelining._stage import default_pp_mesh
    for r in (0, 5):
        with simulating(World(8, r, simulated=True, device_type="npu")):
            with no_init_parameters():
                a, b = nn.Dense(16, 24), nn.Dense(16, 24)
            hsdp(a, shard_size=4, threshold=0)
            fully_shard(b)
            pp = default_pp_mesh()
        spec = parameter_sharding(a.weight).spec
        assert spec.mesh.shape == (2, 4) and spec.mesh.get_rank() == r and spec.mesh.is_simulated
        assert tuple(a.weight.shape) == (6, 16)
        assert parameter_sharding(b.weight).spec.mesh.shape == (8,) and tuple(b.weight.shape) == (3, 16)
        assert pp.is_simulated and pp.get_coordinate() == [r] and pp.device_type == "npu"


def _real_and_simulated():
    """On a real rank r of 4: the FSDP x TP plan and the collectives on the real (dp, tp) mesh and
    on the mesh simulating rank r, in the same process."""
    _cpu()
    from mindspore import communication
    from hyper_parallel_ms.mesh import init_device_mesh
    r = communication.get_rank()
    real = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    simulated = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), simulate=(4, r))
    _, real_pieces = _plan(real, deferred=False)
    _, simulated_pieces = _plan(simulated, deferred=True)
    real_out, real_records = _collectives(real)
    sim_out, sim_records = _collectives(simulated)
    return real_pieces == simulated_pieces, real_out == sim_out, real_records == sim_records, len(real_records)


@multi_rank(4)
def test_a_simulated_rank_plans_and_records_what_the_real_rank_does():
    same_pieces, same_outputs, same_records, count = _real_and_simulated()
    assert same_pieces and same_outputs and same_records and count == 7


def test_flattened_dims_are_reachable_from_the_root_mesh():
    """PyTorch's ``mesh["dp", "cp"]._flatten("dp_cp")`` then ``mesh["dp_cp"]`` (and beside other dims:
    ``mesh["pp", "dp_cp"]``), on every rank of an 8-rank (pp, dp, tp) mesh; a name that would mean
    other dims, and flattened dims out of order or repeated, are refused."""
    _cpu()
    from hyper_parallel_ms.mesh import init_device_mesh
    for r in range(8):
        mesh = init_device_mesh("npu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"), simulate=(8, r))
        pp = r // 4
        flat = mesh["dp", "tp"]._flatten("dp_tp")
        assert mesh["dp_tp"] is flat and flat.rank_list == tuple(range(4 * pp, 4 * pp + 4))
        assert flat.get_coordinate() == [r % 4]
        both = mesh["pp", "dp_tp"]
        assert both.mesh.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and both.mesh_dim_names == ("pp", "dp_tp")
        assert both.get_coordinate() == [pp, r % 4] and both["dp_tp"].rank_list == flat.rank_list
        outer = mesh["pp", "tp"]._flatten("pp_tp")
        assert mesh["pp_tp"] is outer and outer.rank_list == tuple(x + (r % 4 // 2) * 2 for x in (0, 1, 4, 5))
        with pytest.raises(KeyError, match="must follow the mesh's order"):
            mesh["pp_tp", "dp"]
        with pytest.raises(KeyError, match="repeat"):
            mesh["dp_tp", "tp"]
        with pytest.raises(ValueError, match="already names other dims"):
            mesh["pp", "dp"]._flatten("dp_tp")
        assert mesh["dp", "tp"]._flatten("dp_tp") is flat
    four = init_device_mesh("npu", (2, 2, 2, 2), mesh_dim_names=("a", "b", "c", "d"), simulate=(16, 0))
    four["a", "c"]._flatten("a_c")
    with pytest.raises(KeyError, match="not adjacent"):
        four["a_c", "d"]


def test_every_call_over_a_simulated_mesh_goes_through_its_exchange():
    """The mesh's exchange carries collectives, send / recv, agreements and object gathers: a
    simulated mesh's is the one entered with ``exchanging`` (else zeros, sends dropped), a lone
    process's is the cluster's; the layers above ask ``holds_values``, not whether it is simulated."""
    _cpu()
    import mindspore as ms
    from hyper_parallel_ms import comm
    from hyper_parallel_ms._cluster import World, simulating
    from hyper_parallel_ms.checkpoint._dist import Coordinator
    from hyper_parallel_ms.comm._agreement import extremes, observing_agreements
    from hyper_parallel_ms.comm._exchange import ClusterExchange, SimulatedExchange, current_exchange, exchanging
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.nn._consistency import check_same_on_all_ranks

    class Log(SimulatedExchange):
        def __init__(self):
            self.calls = []

        def count(self, kind, group, dim, peer=None):
            self.calls.append(("count", kind, dim, peer))

        def placeholder(self, x, shape):
            self.calls.append(("placeholder", tuple(shape)))
            return x.new_ones(tuple(shape))

        def send(self, x, group, dst):
            self.calls.append(("send", group.ranks[dst]))

        def recv(self, x, group, src):
            self.calls.append(("recv", group.ranks[src]))
            return x.new_ones(tuple(x.shape)) * 7

    local = init_device_mesh("cpu", (1,))
    assert isinstance(local.exchange, ClusterExchange) and local.holds_values and current_exchange().holds_values
    mesh = init_device_mesh("npu", (2, 2), mesh_dim_names=("dp", "tp"), simulate=(4, 2))
    assert type(mesh.exchange) is SimulatedExchange and not mesh.holds_values and not mesh.exchange.moves
    log = Log()
    x = ms.Tensor(np.zeros((4, 3), np.float32))
    with exchanging(log):
        assert mesh.exchange is log and mesh["tp"].exchange is log
        gathered = comm.all_gather(x, mesh, "tp", dim=0)
        comm.send(x, mesh, "dp", dst=0)
        got = comm.recv(x, mesh, "tp", src=1)
        high, low = extremes(np.array([3.0]), mesh)
    assert gathered.asnumpy().tolist() == np.ones((8, 3)).tolist() and (got.asnumpy() == 7).all()
    assert high.tolist() == low.tolist() == [3.0]
    assert log.calls == [("count", "all_gather", "tp", None), ("placeholder", (8, 3)), ("count", "send", "dp", 0),
                         ("send", 0), ("count", "recv", "tp", 1), ("recv", 3)]
    notes = []
    with observing_agreements(lambda what, m, entries: notes.append((what, m.rank_list, entries))):
        check_same_on_all_ranks([("fc", "Colwise")], mesh, "parallelize_module")   # noted, compared later
    assert notes == [("parallelize_module", mesh.rank_list, (("fc", "Colwise"),))]
    with simulating(World(4, 1, simulated=True, device_type="npu")):
        assert not current_exchange().holds_values
        with pytest.raises(NotImplementedError, match="rank 1 of a simulated cluster of 4 ranks cannot exchange"):
            Coordinator(distributed=True).all_gather({"plan": 1})
