"""Redistribution on 4 ranks, meshes (4,) and (2, 2): every pair of placement lists for
tensors of 1 to 3 dims, even and uneven: values, placements, gradients (against numpy) and
bytes moved (against the textbook collectives)."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

from hyper_parallel_ms.dtensor import DTensor, distribute_tensor
from hyper_parallel_ms.layout import Layout
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.placement import Partial, Replicate, Shard
from hyper_parallel_ms.redistribute import (AllToAll, Narrow, ReduceScatter, Redistribution, redistribution,
                                            replicate_partials)
from hyper_parallel_ms.redistribute._executor import lowered_steps
from hyper_parallel_ms.testing import multi_rank
from hyper_parallel_ms.testing.redistribute_bytes import measure, placement_lists

SHAPES = {  # ndim -> (even, uneven) global shapes for 4 ranks
    1: ((8,), (7,)),
    2: ((4, 8), (6, 5)),
    3: ((4, 2, 4), (3, 5, 2)),
}


def _piece(full: np.ndarray, layout: Layout, coord):
    return full[layout.local_slices(full.shape, coord)]


def _check_pair(mesh, x_np, w_np, src, dst):
    coord = mesh.get_coordinate()
    shape = x_np.shape
    src_layout = Layout(mesh.shape, src).normalized(len(shape))
    dst_layout = Layout(mesh.shape, dst).normalized(len(shape))
    dt = distribute_tensor(ms.Tensor(x_np), mesh, src, src_data_rank=None)
    w = ms.Tensor(w_np)
    seen = {}

    def loss(local):            # one PyNative forward serves the values and the gradient
        d = DTensor.from_local(local, mesh, src, shape=shape)
        seen["out"] = d.redistribute(mesh, dst)
        seen["full"] = seen["out"].full_tensor()
        return (seen["full"] * w).sum()

    grad = ms.grad(loss)(dt.to_local())
    out = seen["out"]
    assert out.placements == dst_layout.placements and out.shape == shape
    if not any(p.is_partial() for p in dst):      # every rank's piece
        np.testing.assert_allclose(out.to_local().asnumpy(), _piece(x_np, dst_layout, coord), rtol=1e-6)
    np.testing.assert_allclose(seen["full"].asnumpy(), x_np, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad.asnumpy(), _piece(w_np, replicate_partials(src_layout), coord),
                               rtol=1e-5, atol=1e-6)


def _matrix(mesh_shape, names, ndim, which):
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    shape = SHAPES[ndim][which]
    rng = np.random.default_rng(ndim * 10 + which)
    x_np = rng.standard_normal(shape).astype(np.float32)
    w_np = rng.standard_normal(shape).astype(np.float32)
    lists = placement_lists(mesh.ndim, ndim)
    for src in lists:
        for dst in lists:
            try:
                _check_pair(mesh, x_np, w_np, src, dst)
            except AssertionError as err:
                raise AssertionError(f"{[str(p) for p in src]} -> {[str(p) for p in dst]} on shape {shape}: "
                                     f"{err}") from None
    return len(lists) ** 2


# every (mesh, even / uneven shape, ndim) but the even 3-D tensor on the 2 x 2 mesh, whose transitions
# the uneven 3-D one runs too (an even split is the chunk logic's special case; 36 s of CI)
TRANSITION_CASES = [pytest.param(mesh, which, ndim, id=f"{mesh_id}-{which_id}-{ndim}")
                    for mesh, mesh_id in (((4,), "mesh4"), ((2, 2), "mesh2x2"))
                    for which, which_id in ((0, "even"), (1, "uneven")) for ndim in (1, 2, 3)
                    if (mesh_id, which_id, ndim) != ("mesh2x2", "even", 3)]


@pytest.mark.parametrize("mesh_shape,which,ndim", TRANSITION_CASES)
@multi_rank(4)
def test_every_transition(mesh_shape, which, ndim):
    names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
    assert _matrix(mesh_shape, names, ndim, which) == (2 + ndim) ** (2 * len(mesh_shape))


@multi_rank(4)
def test_nested_sharding_orders_and_aliases():
    """One tensor dim over two mesh dims in both orders, written with alias names."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x_np = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    for src in [(("dp", "tp"), "None"), (("tp", "dp"), "None"), ("tp", "dp"), ("None", "None")]:
        for dst in [(("tp", "dp"), "None"), (("dp", "tp"), "None"), ("dp", "None"), ("None", ("tp", "dp"))]:
            dt = distribute_tensor(ms.Tensor(x_np), mesh, src, src_data_rank=None)
            layout = Layout.from_alias((2, 2), ("dp", "tp"), src)
            np.testing.assert_array_equal(dt.to_local().asnumpy(), _piece(x_np, layout, mesh.get_coordinate()))
            out = dt.redistribute(mesh, dst)
            dst_layout = Layout.from_alias((2, 2), ("dp", "tp"), dst)
            assert out.layout == dst_layout.normalized(2)
            np.testing.assert_array_equal(out.to_local().asnumpy(),
                                          _piece(x_np, dst_layout, mesh.get_coordinate()))
            np.testing.assert_array_equal(out.full_tensor().asnumpy(), x_np)


def _textbook_single(src, dst, n, full_elems):
    """Textbook elements per rank for one mesh dim of n ranks changing src -> dst (even shapes),
    or None where the transition is not a single collective."""
    local = full_elems // n
    if src == dst or src.is_replicate():
        return 0
    if src.is_shard():
        return {True: (n - 1) * local, False: (n - 1) * local // n}[dst.is_replicate()] if not dst.is_partial() \
            else None
    return 2 * (n - 1) * full_elems // n if dst.is_replicate() else (n - 1) * full_elems // n if dst.is_shard() \
        else None


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["mesh4", "mesh2x2"])
@multi_rank(4)
def test_bytes_match_the_textbook(mesh_shape):
    mesh = init_device_mesh("cpu", mesh_shape)
    rows = measure(mesh, (8, 8))
    assert len(rows) == 16 ** len(mesh_shape)
    for row in rows:
        assert row.recorded == row.optimum <= row.naive, row
    if len(mesh_shape) == 1:  # one mesh dim: exactly the textbook collective of each transition
        options = {str(p): p for p in [Replicate(), Partial(), Shard(0), Shard(1)]}
        for row in rows:
            want = _textbook_single(options[row.src[0]], options[row.dst[0]], 4, 64)
            if want is not None:
                assert row.recorded == want * 4, row


@multi_rank(4)
def test_bad_input():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = ms.Tensor(np.ones((4, 4), np.float32))
    dt = distribute_tensor(x, mesh, [Shard(0), Replicate()])
    other = init_device_mesh("cpu", (4,), mesh_dim_names=("all",))
    for bad, err, msg in [
        (lambda: distribute_tensor(x, mesh, [Shard(0)]), ValueError, "expected 2 placements for the 2-D mesh"),
        (lambda: distribute_tensor(x, mesh, [Shard(2), Replicate()]), ValueError, "Shard dim 2 is out of range"),
        (lambda: dt.redistribute(mesh, [Shard(-3), Replicate()]), ValueError, "Shard dim -3 is out of range"),
        (lambda: Partial("prod"), ValueError, "must be one of"),
        (lambda: DTensor.from_local(ms.Tensor(np.ones((2, 4), np.float32)), mesh, [Shard(0), Replicate()],
                                    shape=(7, 4)), ValueError, "should hold"),
        (lambda: DTensor.from_local(ms.Tensor(np.ones((2, 4), np.float32)), mesh, [Shard(0), Replicate()],
                                    shape=(4,)), ValueError, "has 1 dims"),
        (lambda: DTensor.from_local(dt, mesh, [Shard(0), Replicate()]), TypeError, "plain mindspore Tensor"),
        (lambda: distribute_tensor(x, mesh, ("pp", "None")), ValueError, "unknown mesh dim name 'pp'"),
        (lambda: distribute_tensor(x, mesh, ["dp", Replicate()]), TypeError, "mix"),
        (lambda: distribute_tensor(x, mesh, [Shard(0), Replicate()], src_data_rank=2), ValueError, "src_data_rank"),
        (lambda: dt.redistribute(mesh), ValueError, "needs placements"),
    ]:
        with pytest.raises(err, match=msg):
            bad()
    # another mesh over the same ranks: allowed, and exact
    np.testing.assert_array_equal(dt.redistribute(other, [Replicate()]).to_local().asnumpy(), x.asnumpy())
    # run_check catches a rank whose piece disagrees with the layout (rank 3 claims 3 rows)
    rows = 3 if mesh.get_rank() == 3 else 2
    local = ms.Tensor(np.ones((rows, 4), np.float32))
    with pytest.raises(ValueError, match="run_check"):
        DTensor.from_local(local, mesh, [Shard(0), Replicate()], shape=None if rows == 2 else (6, 4), run_check=True)


@multi_rank(4)
def test_plans_execute_inside_jit():
    """Planning happens outside jit; the lowered plan runs on local tensors inside ms.jit with
    the same values and gradients as in PyNative."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    coord = mesh.get_coordinate()
    rng = np.random.default_rng(5)
    x_np, w_np = rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal((6, 4)).astype(np.float32)
    cases = [((Shard(0), Shard(1)), (Shard(1), Shard(0))), ((Partial(), Shard(0)), (Replicate(), Replicate())),
             ((Replicate(), Shard(1)), (Shard(0), Partial())), ((Shard(1), Shard(1)), (Replicate(), Shard(0)))]
    for src, dst in cases:
        src_l, dst_l = Layout(mesh.shape, src).normalized(2), Layout(mesh.shape, dst).normalized(2)
        gather = redistribution(mesh, dst_l, Layout(mesh.shape, (Replicate(), Replicate())), (6, 4))
        cell = redistribution(mesh, src_l, dst_l, (6, 4))
        w = ms.Tensor(w_np)

        def forward(local):
            return gather(cell(local))

        def loss(local):
            return (forward(local) * w).sum()
        def both(local):                  # one compile per case: the value and the gradient
            return forward(local), ms.grad(loss)(local)
        local = distribute_tensor(ms.Tensor(x_np), mesh, src, src_data_rank=None).to_local()
        eager_out, eager_grad = both(local)
        jit_out, jit_grad = ms.jit(both)(local)
        np.testing.assert_allclose(jit_out.asnumpy(), x_np, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(eager_out.asnumpy(), x_np, rtol=1e-6, atol=1e-6)
        want_grad = w_np[replicate_partials(src_l).local_slices((6, 4), coord)]
        np.testing.assert_allclose(jit_grad.asnumpy(), want_grad, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(eager_grad.asnumpy(), want_grad, rtol=1e-6, atol=1e-6)


@multi_rank(4)
def test_partial_avg_max_min():
    """Partial(avg/max/min) sources reduce with their op, into Replicate or a Shard, on both
    mesh dims; a Replicate source partitions into them (the values are equal on every rank)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    coord = mesh.get_coordinate()
    x_np = np.random.default_rng(8).standard_normal((4, 6)).astype(np.float32)
    rank = mesh.get_rank()
    for op in ("avg", "max", "min"):
        # every rank holds a different part; the global tensor is their reduction
        parts = [x_np + (r - 1.5) for r in range(4)]
        mine = parts[rank]
        want = {"avg": np.mean(parts, 0), "max": np.max(parts, 0), "min": np.min(parts, 0)}[op]
        dt = DTensor.from_local(ms.Tensor(mine), mesh, [Partial(op), Partial(op)])
        for dst in [(Replicate(), Replicate()), (Shard(0), Shard(1)), (Replicate(), Shard(0)), (Partial(op), Shard(1))]:
            out = dt.redistribute(mesh, dst)
            np.testing.assert_allclose(out.full_tensor().asnumpy(), want, rtol=1e-5, atol=1e-6)
            if not any(p.is_partial() for p in dst):
                np.testing.assert_allclose(out.to_local().asnumpy(),
                                           want[Layout(mesh.shape, dst).local_slices((4, 6), coord)], rtol=1e-5,
                                           atol=1e-6)
        back = distribute_tensor(ms.Tensor(x_np), mesh, [Replicate(), Partial(op)])
        np.testing.assert_allclose(back.full_tensor().asnumpy(), x_np, rtol=1e-6)
    # the gradient through a Partial(avg) made from another placement is the one-device gradient
    # (it came back divided by the ranks of every mesh dim that became avg: 1/2, 1/4 here)
    w = np.random.default_rng(9).standard_normal((4, 6)).astype(np.float32)
    for src, local, want in [((Replicate(), Replicate()), x_np, w),
                             ((Shard(0), Replicate()), x_np[2 * coord[0]:2 * coord[0] + 2], w[2 * coord[0]:][:2]),
                             ((Partial(), Replicate()), x_np, w)]:
        for dst in [(Partial("avg"), Replicate()), (Partial("avg"), Partial("avg")), (Replicate(), Partial("avg"))]:
            def loss(v, src=src, dst=dst):
                moved = DTensor.from_local(v, mesh, list(src), shape=(4, 6)).redistribute(mesh, list(dst))
                return (moved.full_tensor() * ms.Tensor(w)).sum()
            grad = ms.grad(loss)(ms.Tensor(local)).asnumpy()
            np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-6, err_msg=f"{src} -> {dst}")
    # Partial(max / min) into a new Partial(sum): the gradient reaches the rank holding the extremum
    # (it reached none: the mask compared the piece with value / n instead of the value)
    for op in ("max", "min"):
        holder = (rank == 0)                  # rank 0 holds x_np; the others hold values below / above it
        mine = x_np if holder else x_np + (-1.0 if op == "max" else 1.0) * (1.0 + rank)
        for dst in [(Partial(), Partial()), (Partial(), Replicate()), (Replicate(), Partial())]:
            def loss(v, op=op, dst=dst):
                moved = DTensor.from_local(v, mesh, [Partial(op), Partial(op)]).redistribute(mesh, list(dst))
                return (moved.full_tensor() * ms.Tensor(w)).sum()
            grad = ms.grad(loss)(ms.Tensor(mine)).asnumpy()
            np.testing.assert_allclose(grad, w if holder else np.zeros_like(w), rtol=1e-6, atol=1e-6,
                                       err_msg=f"P({op}) -> {dst}")
    # Partial(max) beside Partial(sum / avg) on the other mesh dim: the holders are found from the
    # pieces reduced over the max dim alone (compared with the whole value, no piece matched:
    # an identity redistribution through (P(max), P(sum)) had gradient 0, silently)
    def through(v, src, mid):
        moved = DTensor.from_local(v, mesh, list(src), shape=(4, 6)).redistribute(mesh, list(mid))
        return (moved.full_tensor() * ms.Tensor(w)).sum()
    cols = Layout(mesh.shape, (Replicate(), Shard(1))).local_slices((4, 6), coord)
    grad = ms.grad(lambda v: through(v, (Replicate(), Shard(1)), (Partial("max"), Partial())))(ms.Tensor(x_np[cols]))
    np.testing.assert_allclose(grad.asnumpy(), w[cols], rtol=1e-6, atol=1e-6)
    holder = coord[1] == 0                    # max over mesh dim 1, then the average over mesh dim 0
    mine = x_np + (coord[0] - 0.5) if holder else x_np - 5.0
    grad = ms.grad(lambda v: through(v, (Partial("avg"), Partial("max")), (Replicate(), Replicate())))(ms.Tensor(mine))
    np.testing.assert_allclose(grad.asnumpy(), w / 2 if holder else np.zeros_like(w), rtol=1e-6, atol=1e-6)


def test_gradient_copied_only_after_a_narrowing_step():
    """The backward hands back a fresh copy only when its last step narrows (a chunk, the kept
    piece of a reduce-scatter or all-to-all); other plans issue no copy (the test of the offset
    view this guards: test_op_sweep.test_gradient_through_a_split_view_of_a_gathered_piece)."""
    mesh4 = (4,)

    def cell(src, dst, shape=(8, 4)):
        src_l, dst_l = Layout(mesh4, (src,)), Layout(mesh4, (dst,))
        forward, backward, scaling = lowered_steps(src_l, dst_l, shape, (1,))
        return Redistribution(None, forward, backward + scaling), backward + scaling

    copying = {(Shard(0), Replicate()): Narrow, (Shard(0), Shard(1)): AllToAll, (Shard(1), Partial()): Narrow}
    for (src, dst), last in copying.items():
        red, backward = cell(src, dst)
        assert isinstance(backward[-1], last) and red.copies_gradient, (src, dst, backward)
    for src, dst in [(Replicate(), Shard(0)), (Partial(), Replicate()), (Replicate(), Partial()),
                     (Partial("avg"), Replicate()), (Replicate(), Replicate())]:
        red, backward = cell(src, dst)
        assert not any(isinstance(s, (Narrow, ReduceScatter, AllToAll)) for s in backward[-1:])
        assert not red.copies_gradient, (src, dst, backward)
    red, backward = cell(Partial(), Replicate())      # no backward step: the gradient itself goes back
    dout = ms.Tensor(np.ones((8, 4), np.float32))
    assert backward == () and red.bprop(dout, dout, dout)[0] is dout
