"""Collectives on every mesh dim of a (2, 2) mesh: values and gradients against numpy,
in PyNative and in ms.jit, even and uneven; native primitives where MCCL has them."""
from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel_ms.testing import multi_rank
import _collective_ref as ref

MODES = ["pynative", "jit"]


def _inputs(case: str, member: int, n: int, uneven: bool, seed: int):
    """Every member's input shape is derived from its index, so all ranks can rebuild all inputs."""
    rng = np.random.default_rng(seed + member)
    if case == "all_gather":
        shape = (3 - member, 4) if uneven else (2, 4)
    elif case == "all_to_all":
        shape = (5, 2 - (member == n - 1)) if uneven else (4, 2)
    else:
        shape = (5, 3) if uneven else (4, 3)
    return rng.standard_normal(shape).astype(np.float32)


def _weights(out_shape, world_rank, seed):
    return np.random.default_rng(seed + 100 + world_rank).standard_normal(out_shape).astype(np.float32)


def _run_case(case: str, mesh_dim: str, mode: str, uneven: bool, op: str = "sum", src: int = 0,
              mesh_shape=(2, 2), names=("dp", "tp")):
    import mindspore as ms
    from hyper_parallel_ms import comm
    from hyper_parallel_ms.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    group = mesh.comm_group(mesh_dim)
    n, me = group.size, group.rank
    xs = [_inputs(case, m, n, uneven, seed=7) for m in range(n)]
    if case == "all_gather":
        sizes = tuple(x.shape[0] for x in xs)
        fn = lambda t: comm.all_gather(t, mesh, mesh_dim, dim=0, sizes=sizes)  # noqa: E731
        want = lambda ws, m=me: ref.all_gather(xs, ws, m, 0)  # noqa: E731
    elif case == "all_reduce":
        fn = lambda t: comm.all_reduce(t, mesh, mesh_dim, op=op)  # noqa: E731
        want = lambda ws, m=me: ref.all_reduce(xs, ws, m, op)  # noqa: E731
    elif case == "reduce_scatter":
        fn = lambda t: comm.reduce_scatter(t, mesh, mesh_dim, dim=0, op=op)  # noqa: E731
        want = lambda ws, m=me: ref.reduce_scatter(xs, ws, m, 0, op)  # noqa: E731
    elif case == "all_to_all":
        sizes = tuple(x.shape[1] for x in xs)
        fn = lambda t: comm.all_to_all(t, mesh, mesh_dim, split_dim=0, concat_dim=1,  # noqa: E731
                                       concat_sizes=sizes)
        want = lambda ws, m=me: ref.all_to_all(xs, ws, m, 0, 1)  # noqa: E731
    else:
        fn = lambda t: comm.broadcast(t, mesh, mesh_dim, src=src)  # noqa: E731
        want = lambda ws, m=me: ref.broadcast(xs, ws, m, src)  # noqa: E731
    # rank s's loss weights its own output; the reference sums the gradient over the group
    out_shapes = [want(None, m).shape for m in range(n)]
    ws = [_weights(out_shapes[m], group.ranks[m], seed=3) for m in range(n)]
    expect_out, expect_grad = want(ws)

    w_mine = ms.Tensor(ws[me])

    def loss(t):
        return (fn(t) * w_mine).sum()

    forward, backward = fn, ms.grad(loss)
    if mode == "jit":
        forward, backward = ms.jit(forward), ms.jit(backward)
    x = ms.Tensor(xs[me])
    out = forward(x)
    grad = backward(x)
    np.testing.assert_allclose(out.asnumpy(), expect_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad.asnumpy(), expect_grad, rtol=1e-5, atol=1e-5)
    return out.shape


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mesh_dim", ["dp", "tp"])
@multi_rank(4)
def test_all_gather(mesh_dim, mode):
    for uneven in (False, True):
        _run_case("all_gather", mesh_dim, mode, uneven)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mesh_dim", ["dp", "tp"])
@multi_rank(4)
def test_all_reduce(mesh_dim, mode):
    for op in ("sum", "avg", "max", "min"):
        _run_case("all_reduce", mesh_dim, mode, False, op=op)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mesh_dim", ["dp", "tp"])
@multi_rank(4)
def test_reduce_scatter(mesh_dim, mode):
    for uneven in (False, True):
        for op in ("sum", "avg", "max"):
            _run_case("reduce_scatter", mesh_dim, mode, uneven, op=op)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mesh_dim", ["dp", "tp"])
@multi_rank(4)
def test_all_to_all(mesh_dim, mode):
    for uneven in (False, True):
        _run_case("all_to_all", mesh_dim, mode, uneven)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mesh_dim", ["dp", "tp"])
@multi_rank(4)
def test_broadcast(mesh_dim, mode):
    for src in (0, 1):
        _run_case("broadcast", mesh_dim, mode, False, src=src)


@pytest.mark.parametrize("mode", MODES)
@multi_rank(4)
def test_native_primitives_where_mccl_has_them(mode):
    """The Ascend path on CPU: MCCL has AllGather and Broadcast on the world group and
    AllReduce(sum) everywhere; ReduceScatter / AlltoAll have no CPU kernel."""
    from hyper_parallel_ms.comm import force_path
    with force_path("native"):
        for uneven in (False, True):
            _run_all_gather_forward(mode, uneven)
        for src in (0, 3):
            _run_case("broadcast", "tp", mode, False, src=src, mesh_shape=(4,), names=("tp",))
        _run_case("all_reduce", "tp", mode, False, op="sum", mesh_shape=(4,), names=("tp",))
        _run_case("all_reduce", "tp", mode, False, op="avg", mesh_shape=(4,), names=("tp",))


def _run_all_gather_forward(mode, uneven):
    import mindspore as ms
    from hyper_parallel_ms import comm
    from hyper_parallel_ms.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    me = mesh.get_local_rank()
    xs = [_inputs("all_gather", m, 4, uneven, seed=5) for m in range(4)]
    xs = [x.T.copy() for x in xs] if uneven else xs          # gather along dim 1 when uneven
    dim = 1 if uneven else 0
    sizes = tuple(x.shape[dim] for x in xs)

    def fn(t):
        return comm.all_gather(t, mesh, "tp", dim=dim, sizes=sizes)
    if mode == "jit":
        fn = ms.jit(fn)
    np.testing.assert_array_equal(fn(ms.Tensor(xs[me])).asnumpy(), np.concatenate(xs, dim))


@multi_rank(4)
def test_comm_debug_mode_counts_and_bytes():
    import mindspore as ms
    from hyper_parallel_ms import comm
    from hyper_parallel_ms.comm import CommDebugMode
    from hyper_parallel_ms.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = ms.Tensor(np.ones((4, 3), np.float32))                  # 48 bytes
    with CommDebugMode() as outer:
        with CommDebugMode() as mode:
            comm.all_gather(x, mesh, "tp", dim=0)
            comm.all_reduce(x, mesh, "dp")
            comm.all_reduce(x, mesh, "dp", op="max")
            comm.reduce_scatter(x, mesh, "tp", dim=0)
            comm.all_to_all(x, mesh, "tp", split_dim=0, concat_dim=1)
            comm.broadcast(x, mesh, "dp", src=1)
        def reduce_tp(t):
            return comm.all_reduce(t, mesh, "tp")
        compiled = ms.jit(reduce_tp)
        compiled(x)
        compiled(x)                                               # runs the compiled graph
    assert mode.get_comm_counts() == {"all_gather": 1, "all_reduce": 2, "reduce_scatter": 1,
                                      "all_to_all": 1, "broadcast": 1}
    assert outer.get_total_counts() == 7 and outer.records[-1].compiled   # recorded once, at compile
    assert not any(r.compiled for r in mode.records)
    got = [(r.kind, r.mesh_dim, r.group_size, r.path, r.bytes, r.wire_bytes) for r in mode.records]
    assert got == [
        ("all_gather", "tp", 2, "composed", 48, 96),              # out - in; all-reduce of 96 B
        ("all_reduce", "dp", 2, "composed", 48, 48),              # 2 (n-1)/n * 48
        ("all_reduce", "dp", 2, "composed", 48, 96),              # max: two slots
        ("reduce_scatter", "tp", 2, "composed", 24, 48),          # in - local out
        ("all_to_all", "tp", 2, "composed", 24, 96),              # in - kept chunk; gather of 96 B
        ("broadcast", "dp", 2, "composed", 48, 48),
    ]
    assert mode.total_bytes() == 240 and mode.total_bytes("all_reduce") == 96
    assert "all_to_all" in mode.summary()


@multi_rank(2)
def test_comm_errors():
    import mindspore as ms
    from hyper_parallel_ms import comm
    from hyper_parallel_ms.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = ms.Tensor(np.ones((4, 3), np.float32))
    for bad, err, msg in [
        (lambda: comm.all_gather(x, mesh, "tp", dim=2), ValueError, "dim 2 is out of range for a 2-D"),
        (lambda: comm.all_gather(x, mesh, "tp", sizes=(4,)), ValueError, "must give 2 non-negative ints"),
        (lambda: comm.all_gather(x, mesh, "tp", sizes=(3, 3)), ValueError, "this rank's tensor has 4"),
        (lambda: comm.all_reduce(x, mesh, "tp", op="prod"), ValueError, "reduce op must be one of"),
        (lambda: comm.reduce_scatter(x, mesh, "tp", op="mean"), ValueError, "reduce op must be one of"),
        (lambda: comm.all_to_all(x, mesh, "tp", split_dim=0, concat_dim=0), ValueError, "different split_dim"),
        (lambda: comm.broadcast(x, mesh, "tp", src=2), ValueError, r"src must be a rank index in \[0, 2\)"),
        (lambda: comm.all_reduce(x, mesh, "dp"), KeyError, "'dp' not found"),
        (lambda: comm.all_reduce(ms.Tensor(np.ones(2, np.int32)), mesh, "tp"), TypeError, "float32, float16"),
    ]:
        with pytest.raises(err, match=msg):
            bad()
