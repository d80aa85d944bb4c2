"""DeviceMesh: a world of one rank in this process, and 4 and 8 ranks through the harness."""
from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel_ms.testing import multi_rank


def test_world_of_one_needs_no_communication():
    import mindspore as ms
    from hyper_parallel_ms import comm
    from hyper_parallel_ms.comm import CommDebugMode
    from hyper_parallel_ms.mesh import init_device_mesh

    if ms.get_context("device_target") != "CPU":   # set_device fails once this process ran a kernel
        ms.set_device("CPU")
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    assert mesh.get_coordinate() == [0, 0] and mesh.size() == 1
    assert mesh.get_group("tp") is None and mesh["tp"].shape == (1,)     # no communication: no group
    x = ms.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    with CommDebugMode() as mode:
        for y in (comm.all_gather(x, mesh, "tp", dim=1), comm.all_reduce(x, mesh, "dp", op="max"),
                  comm.reduce_scatter(x, mesh, "tp"), comm.broadcast(x, mesh, "dp"),
                  comm.all_to_all(x, mesh, "tp", split_dim=0, concat_dim=1)):
            np.testing.assert_array_equal(y.asnumpy(), x.asnumpy())
    assert mode.get_total_counts() == 0
    with pytest.raises(ValueError, match="holds 2 ranks but the world has 1"):
        init_device_mesh("cpu", (2,))
    with pytest.raises(ValueError, match="device_type must be one of"):
        init_device_mesh("gpu", (1,))
    with pytest.raises(ValueError, match="needs MindSpore device target 'Ascend'"):
        init_device_mesh("npu", (1,))


def _rank():
    from mindspore import communication
    return communication.get_rank()


@multi_rank(4)
def test_mesh_4_ranks():
    import mindspore as ms
    from hyper_parallel_ms import comm
    from hyper_parallel_ms.mesh import DeviceMesh, init_device_mesh

    r = _rank()
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    assert flat.get_coordinate() == [r] and flat.get_local_rank() == r and flat.ndim == 1
    assert flat.comm_group(0).ranks == (0, 1, 2, 3) and flat.get_group("tp") == "mccl_world_group"

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = divmod(r, 2)
    assert mesh.get_coordinate() == [dp, tp] and mesh.shape == (2, 2) and mesh.size() == 4
    assert mesh.get_local_rank("dp") == dp and mesh.get_local_rank("tp") == tp and mesh.size("tp") == 2
    assert mesh.comm_group("tp").ranks == (2 * dp, 2 * dp + 1)
    assert mesh.comm_group("dp").ranks == (tp, tp + 2)
    assert mesh.get_group("tp") == f"hpms_{2 * dp}_{2 * dp + 1}"      # deterministic names
    assert mesh.get_all_groups() == [f"hpms_{tp}_{tp + 2}", f"hpms_{2 * dp}_{2 * dp + 1}"]
    sub = mesh["tp"]
    assert sub.mesh.tolist() == [2 * dp, 2 * dp + 1] and sub.mesh_dim_names == ("tp",)
    assert sub.get_coordinate() == [tp] and sub.get_group() == mesh.get_group("tp")
    assert mesh["dp"].mesh.tolist() == [tp, tp + 2]
    assert mesh["dp"].root_mesh is mesh and mesh.root_mesh is None and mesh.rank == r     # HyperParallel's names
    flat_dims = mesh._flatten("dp_tp_all")          # a flattened name reaches its group from the mesh (HyperParallel's)
    assert mesh.get_group("dp_tp_all") == flat_dims.get_group() == "mccl_world_group"
    assert mesh["dp", "tp"] == mesh and hash(mesh["dp", "tp"]) == hash(mesh)
    # groups are created once: a second mesh over the same ranks reuses the names
    again = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert again.get_all_groups() == mesh.get_all_groups()
    explicit = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("a", "b"))
    assert explicit.comm_group("a").ranks == ((0, 1) if r in (0, 1) else (2, 3))

    # the groups work: sums of global ranks along each dim
    x = ms.Tensor(np.full((2,), float(r), np.float32))
    assert comm.all_reduce(x, mesh, "tp").asnumpy()[0] == 4 * dp + 1
    assert comm.all_reduce(x, mesh, "dp").asnumpy()[0] == 2 * tp + 2
    assert comm.all_reduce(x, flat, 0).asnumpy()[0] == 6
    # a dim of size 1 names a group of this rank alone (MindSpore reads group=None as the world: a
    # MindSpore all_reduce over a one-rank dim's group must leave the value as it is)
    from mindspore import ops
    lone = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "cp"))
    assert lone.get_group("cp") == f"hpms_solo_{r}" == lone["cp"].get_group()
    assert ops.AllReduce(ops.ReduceOp.SUM, lone.get_group("cp"))(x).asnumpy()[0] == r

    for bad, err, msg in [
        (lambda: init_device_mesh("cpu", (3,)), ValueError, "holds 3 ranks but the world has 4"),
        (lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "a")), ValueError, "distinct"),
        (lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("a",)), ValueError, "1 names for a 2-D"),
        (lambda: init_device_mesh("cpu", (2, -2)), ValueError, "positive ints"),
        (lambda: mesh["pp"], KeyError, "'pp' not found"),
        (lambda: mesh["tp", "dp"], KeyError, "must follow the mesh's order"),
        (lambda: init_device_mesh("cpu", (4,))["dp"], RuntimeError, "without mesh_dim_names"),     # PyTorch's
        (lambda: mesh.get_local_rank(), ValueError, "needs mesh_dim"),
        (lambda: mesh.comm_group(2), IndexError, "out of range"),
        (lambda: DeviceMesh("cpu", [0, 1, 1, 2]), ValueError, "more than once"),
        (lambda: DeviceMesh("cpu", [0, 4]), ValueError, "outside the world of 4"),
    ]:
        with pytest.raises(err, match=msg):
            bad()


@multi_rank(4)
def test_mesh_surfaces_of_both_anchors():
    """PyTorch's ``with mesh:`` / parallelize_module without a mesh / _flatten / get_group();
    HyperParallel's mesh_shape, rank_list, from_group, rank_list= and init_backend=; and a
    DTensor moved onto another mesh over the same ranks."""
    import mindspore as ms
    from mindspore import nn

    from hyper_parallel_ms import DTensor, Replicate, Shard, current_mesh, distribute_tensor, get_current_mesh
    from hyper_parallel_ms.mesh import DeviceMesh, init_device_mesh
    from hyper_parallel_ms.nn import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    me = mesh.get_rank()
    assert mesh.mesh_shape == (2, 2) and mesh.rank_list == (0, 1, 2, 3)
    tp = mesh["tp"]
    assert tp.rank_list == ((0, 1) if me < 2 else (2, 3)) and tp.get_group() == tp.get_group("tp")
    with pytest.raises(RuntimeError, match="needs mesh_dim for a 2-D mesh"):
        mesh.get_group()

    # with mesh: -> parallelize_module(model, parallelize_plan=...) takes it
    with pytest.raises(ValueError, match="no mesh is current"):
        parallelize_module(nn.Dense(4, 4), parallelize_plan=ColwiseParallel())
    ms.set_seed(3)
    dense = nn.Dense(4, 4)
    with tp:
        assert current_mesh() is tp and get_current_mesh() is tp
        model = parallelize_module(dense, parallelize_plan=ColwiseParallel(output_layouts=Replicate()))
    assert current_mesh() is None
    with pytest.raises(RuntimeError, match="No device mesh is currently active"):
        get_current_mesh()
    assert model.weight.shape == (2, 4)

    # from_group: one group (1-D) or one group per dim with the rank array
    assert DeviceMesh.from_group(tp.get_group(), "cpu", mesh_dim_names=("tp",)) == tp
    rebuilt = DeviceMesh.from_group([mesh.get_group("dp"), mesh.get_group("tp")], "cpu", mesh=[[0, 1], [2, 3]],
                                    mesh_dim_names=("dp", "tp"))
    assert rebuilt == mesh
    with pytest.raises(ValueError, match="groups this rank with"):
        DeviceMesh.from_group([mesh.get_group("tp"), mesh.get_group("dp")], "cpu", mesh=[[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="must list the ranks of group"):
        DeviceMesh.from_group(tp.get_group(), "cpu", mesh=[3, 2])

    # init_device_mesh(rank_list=..., init_backend=False): a planning mesh without groups
    planning = init_device_mesh("cpu", (2, 2), rank_list=[3, 2, 1, 0], init_backend=False)
    assert planning.mesh.tolist() == [[3, 2], [1, 0]] and planning.get_local_rank(0) == (1 - me // 2)
    with pytest.raises(RuntimeError, match="init_backend=False"):
        planning.get_group(0)

    # _flatten: the 1-D mesh of all four ranks, also mesh["dp_tp"]
    flat = mesh._flatten()
    assert flat.mesh_dim_names == ("dp_tp",) and flat.rank_list == (0, 1, 2, 3) and mesh["dp_tp"] is flat

    # DTensor.redistribute onto another mesh over the same ranks
    full = np.arange(48, dtype=np.float32).reshape(8, 6)
    dt = distribute_tensor(ms.Tensor(full), flat, [Shard(0)])
    moved = dt.redistribute(mesh, [Shard(1), Shard(0)])
    assert isinstance(moved, DTensor) and moved.device_mesh == mesh
    d, t = mesh.get_coordinate()
    np.testing.assert_array_equal(moved.to_local().asnumpy(), full[4 * t:4 * t + 4, 3 * d:3 * d + 3])
    np.testing.assert_array_equal(moved.redistribute(flat, [Shard(1)]).to_local().asnumpy(),
                                  full[:, 2 * me:2 * me + 2])      # torch.chunk pieces: 2, 2, 2, 0
    # its gradient is the one-device gradient (the new piece was cut from the whole tensor, so
    # each rank's gradient held only its new piece's part: wrong, silently)
    w = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)

    def moved_loss(piece):
        there = DTensor.from_local(piece, flat, [Shard(0)], shape=(8, 6)).redistribute(mesh, [Shard(1), Shard(0)])
        return (there.full_tensor() * ms.Tensor(w)).sum()
    np.testing.assert_allclose(ms.grad(moved_loss)(dt.to_local()).asnumpy(), w[2 * me:2 * me + 2], rtol=1e-6)
    with pytest.raises(ValueError, match="only onto a mesh over the same ranks"):
        dt.redistribute(tp, [Replicate()])
