"""DTensor on 4 ranks: properties, Parameter and optimizers, factories, distribute_tensor's
source rank, to_local / from_local gradients, casts and visualize_sharding."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from hyper_parallel_ms.comm import CommDebugMode
from hyper_parallel_ms.dtensor import (DTensor, distribute_tensor, empty, full, manual_seed, ones, rand, randn,
                                       sharding_table, visualize_sharding, zeros)
from hyper_parallel_ms.layout import Layout
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.placement import Partial, Replicate, Shard
from hyper_parallel_ms.testing import multi_rank


def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _piece(full_np, placements, mesh):
    return full_np[Layout(mesh.shape, placements).local_slices(full_np.shape, mesh.get_coordinate())]


@multi_rank(4)
def test_properties_and_repr():
    mesh = _mesh()
    x = np.arange(5 * 6, dtype=np.float32).reshape(5, 6)
    dt = distribute_tensor(ms.Tensor(x), mesh, [Shard(0), Shard(1)])
    dp, tp = mesh.get_coordinate()
    assert dt.shape == (5, 6) and dt.size() == (5, 6) and dt.size(1) == 6 and dt.numel() == 30
    assert dt.local_shape == ((3, 3) if dp == 0 else (2, 3)) and dt.ndim == 2
    assert dt.placements == (Shard(0), Shard(1)) and dt.device_mesh == mesh and dt.dtype == ms.float32
    text = repr(dt)
    assert "shape=(5, 6)" in text and "(S(0), S(1))" in text and f"local_shape={dt.local_shape}" in text
    alias = distribute_tensor(ms.Tensor(x), mesh, ("dp", "None"))
    assert alias.placements == (Shard(0), Replicate())
    np.testing.assert_array_equal(alias.to_local().asnumpy(), x[:3] if dp == 0 else x[3:])
    assert type(dt.to_local()) is ms.Tensor
    np.testing.assert_array_equal(dt.to_local().asnumpy(), _piece(x, [Shard(0), Shard(1)], mesh))
    half = dt.to(ms.float16)
    assert half.dtype == ms.float16 and half.placements == dt.placements and half.shape == (5, 6)
    assert half.float().dtype == ms.float32
    reduced = distribute_tensor(ms.Tensor(x), mesh, [Partial(), Shard(1)], src_data_rank=None).reduce_partial()
    assert reduced.placements == (Replicate(), Shard(1))
    np.testing.assert_allclose(reduced.to_local().asnumpy(), _piece(x, [Replicate(), Shard(1)], mesh))
    # clone: a DTensor of the same layout with a copy of the piece (not the piece as a plain whole tensor)
    copy = dt.clone()
    assert isinstance(copy, DTensor) and copy.placements == dt.placements and copy.shape == (5, 6)
    np.testing.assert_array_equal(copy.full_tensor().asnumpy(), x)
    copy.to_local()[0] = -1.0                                  # its own storage
    np.testing.assert_array_equal(dt.to_local().asnumpy(), _piece(x, [Shard(0), Shard(1)], mesh))
    grad = ms.grad(lambda t: (DTensor.from_local(t, mesh, [Shard(0), Shard(1)], shape=(5, 6)).clone().to_local()
                              * 3.0).sum())(dt.to_local())
    np.testing.assert_array_equal(grad.asnumpy(), np.full(dt.local_shape, 3.0, np.float32))


@multi_rank(4)
def test_parameter_and_optimizers_update_the_local_piece():
    mesh = _mesh()
    rng = np.random.default_rng(0)
    w_np, g_np = rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal((4, 6)).astype(np.float32)
    placements = [Replicate(), Shard(1)]
    for make_opt in (lambda ps: nn.SGD(ps, learning_rate=0.1, momentum=0.9),
                     lambda ps: nn.AdamWeightDecay(ps, learning_rate=0.01, weight_decay=0.1)):
        param = ms.Parameter(distribute_tensor(ms.Tensor(w_np), mesh, placements), name="w")
        assert isinstance(param, DTensor) and param.placements == tuple(placements) and param.shape == (4, 6)
        ref = ms.Parameter(ms.Tensor(w_np), name="w_ref")
        opt, ref_opt = make_opt([param]), make_opt([ref])
        for _ in range(3):
            opt((ms.Tensor(_piece(g_np, placements, mesh)),))
            ref_opt((ms.Tensor(g_np),))
        np.testing.assert_allclose(param.to_local().asnumpy(), _piece(ref.asnumpy(), placements, mesh),
                                   rtol=1e-6, atol=1e-6)
        assert param.placements == tuple(placements)


@multi_rank(4)
def test_factories():
    mesh = _mesh()
    # PyTorch's factories: every piece is filled, so a Partial mesh dim sums them (2 ranks each here)
    for placements, pieces in (([Shard(0), Shard(1)], 1), ([Replicate(), Partial()], 2), ([Partial(), Shard(0)], 2),
                               (("tp", "None"), 1)):
        for dt, want in [(zeros((5, 3), device_mesh=mesh, placements=placements), 0.0),
                         (ones(5, 3, device_mesh=mesh, placements=placements), 1.0),
                         (full((5, 3), 2.5, device_mesh=mesh, placements=placements), 2.5),
                         (ones((5, 3), device_mesh=mesh, placements=placements, dtype=ms.int32), 1),
                         (empty((5, 3), device_mesh=mesh, placements=placements), None)]:
            assert dt.shape == (5, 3) and not dt.requires_grad
            if want is not None:
                got = dt.full_tensor()
                assert got.dtype == (ms.int32 if isinstance(want, int) else ms.float32)
                np.testing.assert_allclose(got.asnumpy(), np.full((5, 3), want * pieces))
    with mesh:                                          # the current mesh, Replicate by default
        dt = zeros(4, 2, requires_grad=True)
        assert dt.requires_grad and dt.placements == (Replicate(), Replicate()) and dt.device_mesh is mesh
        assert distribute_tensor(ms.Tensor(np.ones((4, 2), np.float32))).placements == (Replicate(), Replicate())
        assert DTensor.from_local(ms.Tensor(np.ones((4, 2), np.float32))).shape == (4, 2)
        assert DTensor.from_local(local_tensor=ms.Tensor(np.ones((4, 2), np.float32)), device_mesh=mesh,
                                  placements=[Shard(0), Replicate()]).shape == (8, 2)     # PyTorch's keywords
    for factory, single in ((rand, ms.ops.rand), (randn, ms.ops.randn)):
        manual_seed(11, mesh)                       # checked equal on every rank, then ms.set_seed
        dt = factory((6, 4), device_mesh=mesh, placements=[Shard(1), Shard(0)])
        ms.set_seed(11)
        np.testing.assert_array_equal(dt.to_local().asnumpy(),
                                      _piece(single((6, 4)).asnumpy(), [Shard(1), Shard(0)], mesh))
    with pytest.raises(RuntimeError, match="pass different seeds"):
        manual_seed(11 + 2 ** 30 * (mesh.get_rank() % 2), mesh)    # differ above float32's exact integers
    with pytest.raises(ValueError, match="non-negative int"):
        manual_seed(-1, mesh)
    with pytest.raises(ValueError, match="non-negative ints"):
        zeros((2, -1), device_mesh=mesh, placements=[Shard(0), Replicate()])


@multi_rank(4)
def test_distribute_tensor_source_rank():
    mesh = _mesh()
    rank = mesh.get_rank()
    mine = ms.Tensor(np.full((4, 2), float(rank), np.float32))
    assert np.all(distribute_tensor(mine, mesh, [Shard(0), Replicate()]).full_tensor().asnumpy() == 0)
    # group rank 1 on both mesh dims is the rank at coordinate (1, 1): global rank 3
    assert np.all(distribute_tensor(mine, mesh, [Replicate(), Shard(1)], src_data_rank=1).full_tensor().asnumpy()
                  == 3)
    with CommDebugMode() as mode:
        own = distribute_tensor(mine, mesh, [Shard(0), Replicate()], src_data_rank=None)
    assert mode.get_total_counts() == 0 and np.all(own.to_local().asnumpy() == rank)


@multi_rank(4)
def test_gradients_through_from_local_and_to_local():
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    rank = mesh.get_rank()
    x = ms.Tensor(np.ones((2, 3), np.float32))
    w_mine = np.full((2, 3), float(rank + 1), np.float32)          # differs per rank
    w_sum = sum(np.full((2, 3), float(r + 1), np.float32) for r in range(4))

    def grad_of(placements, grad_placements):
        def loss(local):
            dt = DTensor.from_local(local, mesh, placements)
            return (dt.to_local(grad_placements=grad_placements) * ms.Tensor(w_mine)).sum()
        return ms.grad(loss)(x).asnumpy()

    np.testing.assert_allclose(grad_of([Replicate()], None), w_mine)               # local grads as they are
    np.testing.assert_allclose(grad_of([Replicate()], [Partial()]), w_sum)         # declared partial: summed
    np.testing.assert_allclose(grad_of([Partial()], None), w_sum)                  # default: own placements
    np.testing.assert_allclose(grad_of([Partial()], [Replicate()]), w_mine)
    np.testing.assert_allclose(grad_of([Shard(0)], None), w_mine)
    # full_tensor of a row-sharded tensor: each rank's gradient is its rows of the (replicated) weight
    big_w = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)

    def loss_full(local):
        return (DTensor.from_local(local, mesh, [Shard(0)]).full_tensor() * ms.Tensor(big_w)).sum()
    np.testing.assert_allclose(ms.grad(loss_full)(x).asnumpy(), big_w[2 * rank:2 * rank + 2])


@multi_rank(2)
def test_visualize_sharding(capsys=None):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    dt = distribute_tensor(ms.Tensor(np.zeros((5, 4), np.float32)), mesh, [Shard(0)])
    table = sharding_table(dt)
    assert "(0,)              0  (3, 4)          [0:3, 0:4]" in table
    assert "(1,)              1  (2, 4)          [3:5, 0:4]" in table
    assert visualize_sharding(dt, header="weights").startswith("weights\nDTensor (5, 4) placements (S(0))")


@multi_rank(4)
def test_gradient_of_an_averaged_partial():
    """Each of n pieces counts 1/n in a Partial(avg): its gradient is the full gradient / n."""
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    x = ms.Tensor(np.full((2, 3), float(mesh.get_rank()), np.float32))
    w = np.arange(6, dtype=np.float32).reshape(2, 3)

    def loss(local):
        return (DTensor.from_local(local, mesh, [Partial("avg")]).full_tensor() * ms.Tensor(w)).sum()
    np.testing.assert_allclose(ms.grad(loss)(x).asnumpy(), w / 4)
    dt = DTensor.from_local(x, mesh, [Partial("avg")])
    np.testing.assert_allclose(dt.full_tensor().asnumpy(), np.full((2, 3), 1.5, np.float32))


@multi_rank(4)
def test_item_assignment_strides_and_scalar_updates_act_on_the_global_tensor():
    """``dt[index] = value`` wrote each rank's own piece at the index (row 0 of every piece: global
    rows 0, 2, 4, 6 on 4 ranks), silently; ``stride()`` gave the piece's strides; ``add_(1.0)`` /
    ``x -= 1.0`` had no sharding rule; ``flatten()`` / ``narrow`` / ``std()`` (MindSpore ops written in
    Python) read the global shape against the piece and failed. Each now acts as one device does."""
    flat, square = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
    a = np.arange(48, dtype=np.float32).reshape(8, 6)
    for mesh, placements in ((flat, [Shard(0)]), (flat, [Shard(1)]), (flat, [Partial()]),
                             (square, [Shard(0), Shard(1)]), (square, [Replicate(), Shard(0)])):
        for index, value in ((0, 5.0), ((slice(None), 0), -1.0), (slice(2, 5), 7.0), ((3, 4), 2.5)):
            x = distribute_tensor(ms.Tensor(a), mesh, placements)
            x[index] = value
            want = a.copy()
            want[index] = value
            np.testing.assert_array_equal(x.full_tensor().asnumpy(), want, err_msg=f"{placements} [{index}]")
            assert x.placements == tuple(placements)
        x = distribute_tensor(ms.Tensor(a), mesh, placements)
        x[x > 20] = 0.0                                  # a DTensor mask
        np.testing.assert_array_equal(x.full_tensor().asnumpy(), np.where(a > 20, 0, a))
        assert x.stride() == [6, 1] and x.stride(0) == 6 and x.nelement() == 48
        assert x.size() == (8, 6) and x.size(1) == 6 and x.size == 48
        # MindSpore ops written in Python read .shape / .size of the piece they compute on
        y = distribute_tensor(ms.Tensor(a), mesh, placements)
        for f in (lambda t: t.flatten(), lambda t: t.narrow(1, 1, 3), lambda t: t.std()):
            np.testing.assert_allclose(f(y).full_tensor().asnumpy(), f(ms.Tensor(a)).asnumpy(), rtol=1e-6)
    x = distribute_tensor(ms.Tensor(a), flat, [Shard(0)])
    x.add_(1.0)
    x -= 3.0
    np.testing.assert_array_equal(x.full_tensor().asnumpy(), a - 2.0)
    partial = distribute_tensor(ms.Tensor(a), flat, [Partial()])
    with pytest.raises(NotImplementedError, match=r"InplaceAddsExt on a DTensor with placements.*reduce_partial"):
        partial.add_(1.0)
    from hyper_parallel_ms.mesh import DeviceMesh
    ends = DeviceMesh("cpu", [0, 3])                      # ranks 1 and 2 are outside it
    if ends.get_coordinate() is None:
        with pytest.raises(ValueError, match=r"rank [12] is not in .*call it on the mesh's ranks only"):
            zeros(4, 2, device_mesh=ends, placements=[Shard(0)])
    else:
        assert zeros(4, 2, device_mesh=ends, placements=[Shard(0)]).to_local().shape == (2, 2)


@multi_rank(2)
def test_pytorch_keywords_of_from_local_and_redistribute_run_check_dtypes_and_pickle():
    import pickle
    mesh = init_device_mesh("cpu", (2,))
    rank = mesh.get_rank()
    piece = ms.Tensor(np.full((3 - rank, 4), rank, np.float32))            # 5 rows: 3, 2
    dt = DTensor.from_local(piece, mesh, [Shard(0)], shape=(5, 4), stride=(4, 1))
    assert dt.shape == (5, 4) and dt.stride() == [4, 1]
    with pytest.raises(ValueError, match="not the contiguous stride"):
        DTensor.from_local(piece, mesh, [Shard(0)], shape=(5, 4), stride=(1, 5))
    with pytest.raises(ValueError, match="rank at mesh coordinate .* holds a Float64 local tensor|"
                                         "holds a Float32 local tensor"):
        DTensor.from_local(piece.astype(ms.float64 if rank == 0 else ms.float32), mesh, [Shard(0)], shape=(5, 4),
                           run_check=True)
    # a piece that does not fit the given shape on one rank: with run_check every rank raises (it hung the other)
    with pytest.raises(ValueError, match=r"coordinate \(1,\) holds a local tensor of shape \(3, 4\).*gives it \(2, 4\)"):
        DTensor.from_local(ms.Tensor(np.ones((3, 4), np.float32)), mesh, [Shard(0)], shape=(5, 4), run_check=True)
    half = dt.redistribute(mesh, [Replicate()], async_op=True, forward_dtype=ms.float16)
    assert half.dtype == ms.float16 and half.placements == (Replicate(),)
    np.testing.assert_array_equal(half.to_local().asnumpy(), dt.full_tensor().asnumpy().astype(np.float16))
    with pytest.raises(NotImplementedError, match="backward_dtype"):
        dt.redistribute(mesh, [Replicate()], backward_dtype=ms.float16)
    again = pickle.loads(pickle.dumps(dt))
    assert again.placements == dt.placements and again.shape == dt.shape
    np.testing.assert_array_equal(again.full_tensor().asnumpy(), dt.full_tensor().asnumpy())


def test_a_parameter_of_a_dtensor_with_an_empty_piece_is_refused_on_every_rank():
    """5 rows on 4 ranks (2, 2, 1, 0): MindSpore's optimizers cannot hold the empty piece, so an
    optimizer over ``Parameter(dtensor)`` failed on the last rank alone ("For 'initializer' ...
    shape must be positive") while the others went on to their next collective. Every rank
    (simulated here, one process) now refuses the Parameter itself; even pieces still work."""
    for rank, rows in enumerate((2, 2, 1, 0)):
        mesh = init_device_mesh("cpu", (4,), simulate=(4, rank))
        dt = DTensor.from_local(ms.Tensor(np.ones((rows, 3), np.float32)), mesh, [Shard(0)], shape=(5, 3),
                                run_check=False)
        with pytest.raises(ValueError, match=r"leaves a rank the empty piece \(0, 3\)"):
            ms.Parameter(dt, name="w")
        even = DTensor.from_local(ms.Tensor(np.ones((2, 3), np.float32)), mesh, [Shard(0)], shape=(8, 3),
                                  run_check=False)
        assert ms.Parameter(even, name="w").to_local().shape == (2, 3)
    assert Layout((2, 2), (Shard(0), Shard(0))).empty_piece((3, 4)) == (0, 4)    # nested pieces 1, 1, 1, 0
    assert Layout((2, 2), (Shard(0), Shard(0))).empty_piece((5, 4)) is None     # 2, 1, 1, 1


@multi_rank(2)
def test_skip_dtensor_dispatch_computes_on_pieces():
    from mindspore import ops
    from hyper_parallel_ms import SkipDTensorDispatch
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    dt = distribute_tensor(ms.Tensor(a), mesh, [Shard(0)])
    r = mesh.get_local_rank()
    with SkipDTensorDispatch():
        y = ops.mul(dt, 2)
        assert tuple(dt.shape) == (2, 3)                   # the piece's, as ops sizing results read it
    assert not isinstance(y, DTensor) and np.array_equal(y.asnumpy(), 2 * a[2 * r:2 * r + 2])
    z = ops.mul(dt, 2)                                     # dispatched again after the block
    assert isinstance(z, DTensor) and tuple(dt.shape) == (4, 3) and np.array_equal(z.full_tensor().asnumpy(), 2 * a)
    with pytest.raises(NotImplementedError, match="no_skip"):
        SkipDTensorDispatch(no_skip={"Mul"})
