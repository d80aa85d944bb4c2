"""Collectives on every mesh dim of a (2, 2) mesh: values and gradients against numpy,
in PyNative and in ms.jit, even and uneven; native primitives where MCCL has them."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

from hyper_parallel_ms import comm
from hyper_parallel_ms.comm import CommDebugMode, force_path
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.testing import multi_rank
from hyper_parallel_ms.testing.collective_check import check_collective

MODES = ["pynative", "jit"]


def dims_and_modes(jit_dim: str) -> list:
    """PyNative on both mesh dims, ms.jit on one (the compiled code is the same for either dim; the
    collectives alternate dims so that both are compiled across the file)."""
    return [("dp", "pynative"), ("tp", "pynative"), (jit_dim, "jit")]


def _run_case(kind, mesh_dim, mode, pieces, op="sum", src=0, dim=0, mesh_shape=(2, 2), names=("dp", "tp"),
              grad=True):
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    check_collective(kind, mesh, mesh_dim, mode=mode, pieces=pieces, op=op, src=src, dim=dim, grad=grad)


@pytest.mark.parametrize("mesh_dim, mode", dims_and_modes("tp"))
@multi_rank(4)
def test_all_gather(mesh_dim, mode):
    for pieces, dim in [("even", 0), ("uneven", 0), ("uneven", 1)]:
        _run_case("all_gather", mesh_dim, mode, pieces, dim=dim)


@pytest.mark.parametrize("mesh_dim, mode", dims_and_modes("dp"))
@multi_rank(4)
def test_all_reduce(mesh_dim, mode):
    for op in ("sum", "avg", "max", "min"):
        _run_case("all_reduce", mesh_dim, mode, "even", op=op)


@pytest.mark.parametrize("mesh_dim, mode", dims_and_modes("dp"))
@multi_rank(4)
def test_reduce_scatter(mesh_dim, mode):
    for pieces, dim, op in [("even", 0, "sum"), ("uneven", 0, "sum"), ("uneven", 1, "avg"), ("uneven", 0, "max"),
                            ("even", 1, "min")]:
        _run_case("reduce_scatter", mesh_dim, mode, pieces, op=op, dim=dim)


@pytest.mark.parametrize("mesh_dim, mode", dims_and_modes("tp"))
@multi_rank(4)
def test_all_to_all(mesh_dim, mode):
    for pieces, dim in [("even", 0), ("uneven", 0), ("uneven", 1)]:
        _run_case("all_to_all", mesh_dim, mode, pieces, dim=dim)


@pytest.mark.parametrize("mesh_dim, mode", dims_and_modes("dp"))
@multi_rank(4)
def test_broadcast(mesh_dim, mode):
    for src in (0, 1):
        _run_case("broadcast", mesh_dim, mode, "even", src=src)


@pytest.mark.parametrize("mode", MODES)
@multi_rank(4)
def test_native_primitives_where_mccl_has_them(mode):
    """The Ascend path on CPU: MCCL has AllGather and Broadcast on the world group and
    AllReduce(sum) everywhere; ReduceScatter / AlltoAll have no CPU kernel."""
    flat = dict(mesh_shape=(4,), names=("tp",))
    with force_path("native"):
        for pieces, dim in [("even", 0), ("uneven", 0), ("uneven", 1)]:  # forward only: its backward is ReduceScatter
            _run_case("all_gather", "tp", mode, pieces, dim=dim, grad=False, **flat)
        for src in (0, 3):
            _run_case("broadcast", "tp", mode, "even", src=src, **flat)
        _run_case("all_reduce", "tp", mode, "even", op="sum", **flat)
        _run_case("all_reduce", "tp", mode, "even", op="avg", **flat)


@multi_rank(4)
def test_empty_pieces():
    """torch.chunk gives trailing ranks empty pieces (3 rows on 4 ranks: 1, 1, 1, 0). Gathering
    from an empty piece works everywhere; scattering into one works in PyNative and is refused
    clearly in ms.jit, where graph mode would prune that rank's backward collective."""
    flat = dict(mesh_shape=(4,), names=("tp",))
    for mode in MODES:
        _run_case("all_gather", "tp", mode, "empty", **flat)
        _run_case("all_gather", "tp", mode, "empty", dim=1, **flat)
    for kind in ("reduce_scatter", "all_to_all"):
        _run_case(kind, "tp", "pynative", "empty", **flat)
        _run_case(kind, "tp", "pynative", "empty", dim=1, **flat)
        with pytest.raises(NotImplementedError, match="empty output piece"):
            _run_case(kind, "tp", "jit", "empty", **flat)


@multi_rank(4)
def test_compiled_collectives_run_the_same_ops_on_every_rank():
    """Uneven pieces (11 rows on 4 ranks: 3, 3, 3, 2, on dims 0 and 1) and a max all-reduce: each rank
    pads its piece into its slot, the first and the last with nothing on one side. Compiled, with
    their backward, every rank's graph holds the same primitives, and the values are right: a rank
    whose graph had other ops could order its independent collectives differently from the others,
    and the ranks would pair different collectives (MCCL: "Launch kernel failed"). (Pieces of one
    row are left out: MindSpore itself compiles other ops for them, e.g. a transpose of a (1, 3)
    tensor as a reshape.)"""
    from mindspore.mint import distributed as dist
    from hyper_parallel_ms.testing import compiled_primitives
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    me = mesh.get_local_rank()
    sizes = (3, 3, 3, 2)
    x = ms.Tensor(np.full((sizes[me], 3), me + 1.0, np.float32))

    def loss(t):
        rows = comm.all_gather(t, mesh, "tp", dim=0, sizes=sizes)
        cols = comm.all_gather(t.T, mesh, "tp", dim=1, sizes=sizes)
        top = comm.all_reduce(t.sum(0), mesh, "tp", op="max")
        return (rows * rows).sum() + (cols * 2).sum() + top.sum()

    step = ms.jit(ms.value_and_grad(loss))
    counts = compiled_primitives(step, x)
    every = [None] * 4
    dist.all_gather_object(every, counts)
    assert all(c == every[0] for c in every) and every[0].get("AllReduce", 0) >= 3, every
    value, grad = step(x)
    whole = np.concatenate([np.full((s, 3), r + 1.0, np.float32) for r, s in enumerate(sizes)])
    # column sums per rank: 3, 6, 9, 8; their max is rank 2's
    np.testing.assert_allclose(value.asnumpy(), (whole ** 2).sum() + 2 * whole.sum() + 3 * 9.0, rtol=1e-6)
    # a gather's backward sums the four ranks' gradients (2 t and 2 per element); the max's reaches rank 2 only
    np.testing.assert_allclose(grad.asnumpy(), 4 * (2 * x.asnumpy() + 2) + (4.0 if me == 2 else 0.0), rtol=1e-6)


@multi_rank(4)
def test_comm_debug_mode_counts_and_bytes():

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
    _check_all_to_all_keeps_nothing_and_records_its_backward(mesh)


def _check_all_to_all_keeps_nothing_and_records_its_backward(mesh):
    """Under PyNative autodiff the composed all-to-all is one node keeping nothing (op by op, MindSpore
    kept the padded buffer and the all-reduced one, 2x the input each); its backward, the inverse
    all-to-all, is on the record with the forward; the gradient is the inverse exchange of the weights."""
    from hyper_parallel_ms._mindspore import SAVED_TENSOR_HOOKS
    rank = mesh.get_coordinate()[1]
    x = ms.Tensor(np.arange(96, dtype=np.float32).reshape(2, 4, 4, 3) + 100 * rank)     # 384 bytes
    w = ms.Tensor(np.random.RandomState(rank).randn(2, 2, 8, 3).astype(np.float32))

    def loss(t):
        return (comm.all_to_all(t, mesh, "tp", split_dim=1, concat_dim=2) * w).sum()
    kept = []

    def pack(t):
        kept.append(t.nbytes)
        return t
    with CommDebugMode() as mode:
        if SAVED_TENSOR_HOOKS:
            with ms.saved_tensors_hooks(pack, lambda t: t):
                grad = ms.grad(loss)(x)
        else:
            grad = ms.grad(loss)(x)
    assert [(r.kind, r.bytes) for r in mode.records] == [("all_to_all", 192), ("all_to_all", 192)]
    if SAVED_TENSOR_HOOKS:
        assert kept == [384]            # the product's copy of the result only
    weights = comm.all_gather(w, mesh, "tp", dim=1).asnumpy()               # every rank's w, heads whole
    np.testing.assert_array_equal(grad.asnumpy(), weights[:, :, 4 * rank:4 * rank + 4])


@multi_rank(2)
def test_comm_errors():

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
        (lambda: comm.all_reduce(ms.Tensor(np.ones(2, np.uint16)), mesh, "tp"), TypeError, "collectives on CPU carry"),
    ]:
        with pytest.raises(err, match=msg):
            bad()
    # a broadcast Cell first built inside a meta-device block (where MindFormers builds its models) is
    # cached: its flag must live on the process's device, or every later broadcast fails to copy it
    import importlib
    cells = importlib.import_module("hyper_parallel_ms.comm._broadcast")   # (comm's _broadcast is the function)
    with ms.DeviceCtx("meta"):
        cells._cell(1, mesh.comm_group("tp"), False)
    got = comm.broadcast(ms.Tensor(np.full((2,), float(mesh.get_rank()), np.float32)), mesh, "tp", src=1)
    np.testing.assert_array_equal(got.asnumpy(), [1.0, 1.0])


@multi_rank(2)
def test_gradients_through_sum_collectives_in_graph_mode_cells():
    """In a GRAPH_MODE Cell, MindSpore differentiated a bare AllReduce whose output is read twice
    (``y * y``) to twice the gradient (the composed all-gather too): 78 off for ``all_reduce`` sum,
    33 for ``all_gather``, silently. Values and gradients equal the PyNative ones now."""
    from mindspore import nn
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    rank = mesh.get_local_rank(0)
    x = ms.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3) + rank)

    class Squared(nn.Cell):
        def __init__(self, kind):
            super().__init__()
            self.kind = kind
            self.w = ms.Parameter(ms.Tensor(np.full((2, 3), 0.5, np.float32)), name="w")

        def construct(self, v):
            y = comm.all_reduce(self.w * v, mesh, 0) if self.kind == "sum" else comm.all_gather(
                self.w * v, mesh, 0, dim=1)
            return (y * y * 1.5).sum()

    class Step(nn.Cell):             # MindSpore's classic pattern: the gradient taken inside a construct
        def __init__(self, net):
            super().__init__()
            self.net, self.weights = net, ms.ParameterTuple(net.trainable_params())

        def construct(self, v):
            return ms.value_and_grad(self.net, 0, self.weights)(v)

    results = {}
    for mode in (ms.PYNATIVE_MODE, ms.GRAPH_MODE):
        ms.set_context(mode=mode)
        try:
            for kind in ("sum", "gather"):
                loss, (gx, gw) = Step(Squared(kind))(x)
                results[(mode, kind)] = (loss.asnumpy(), gx.asnumpy(), gw[0].asnumpy())
        finally:
            ms.set_context(mode=ms.PYNATIVE_MODE)
    for kind in ("sum", "gather"):
        for eager, graph in zip(results[(ms.PYNATIVE_MODE, kind)], results[(ms.GRAPH_MODE, kind)]):
            np.testing.assert_allclose(graph, eager, rtol=1e-6, atol=1e-6, err_msg=kind)


@multi_rank(4)
def test_process_groups_by_pytorch_and_hyper_parallel_names():
    """init_process_group / split_group / get_process_group_ranks / get_group_local_rank / get_backend /
    mark_created_groups / destroy_process_group over MindSpore group names: a split group is the mesh's
    group of the same ranks and reduces over its members only; what msrun decides is checked, not set."""
    import datetime

    from mindspore import ops

    from hyper_parallel_ms import (destroy_process_group, get_backend, get_group_local_rank,
                                   get_process_group_ranks, init_process_group, mark_created_groups, split_group)
    me = ms.communication.get_rank()
    init_process_group()                                   # up already: checked, nothing changes
    init_process_group(world_size=4, rank=me)
    with pytest.raises(ValueError, match=f"this process is rank {me} of 4"):
        init_process_group(world_size=8)
    with pytest.raises(ValueError, match="msrun's environment .* is the rendezvous"):
        init_process_group(init_method="tcp://127.0.0.1:23456")
    from hyper_parallel_ms.comm import _watchdog
    try:                                                   # timeout: the watchdog's wait for a silent peer
        init_process_group(timeout=datetime.timedelta(seconds=60))
        assert _watchdog.comm_timeout() == 60.0
        assert all(dog is None or dog.timeout == 60.0 for dog in _watchdog._dogs)  # pylint: disable=protected-access
        with pytest.raises(ValueError, match="timeout must be a positive datetime.timedelta or number of seconds"):
            init_process_group(timeout=datetime.timedelta(seconds=-1))
    finally:
        _watchdog.set_comm_timeout(None)
    assert _watchdog.comm_timeout() == _watchdog.default_timeout("cpu")
    with pytest.warns(UserWarning, match="device_id not applied"):
        init_process_group(device_id=0)
    assert get_process_group_ranks() == [0, 1, 2, 3] and get_group_local_rank() == me
    assert get_backend() == "mccl"
    pair = [[0, 1], [2, 3]][me // 2]
    group = split_group(split_ranks=[[0, 1], [2, 3]])
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert group == mesh.get_group("tp") and get_process_group_ranks(group) == pair
    assert get_group_local_rank(group) == me % 2 == mesh.get_local_rank("tp")
    total = ops.AllReduce(group=group)(ms.Tensor(np.array([me + 1.0], np.float32))).asnumpy()
    assert total.tolist() == [float(sum(r + 1 for r in pair))]
    # a lone rank's group has no communicator
    assert split_group(split_ranks=[[0], [1], [2, 3]]) == (None if me < 2 else group)
    mark_created_groups([group])                           # already this package's: nothing changes
    assert split_group(split_ranks=[[0, 1], [2, 3]]) == group
    with pytest.raises(ValueError, match="were given different split_ranks"):     # raised on every rank
        split_group(split_ranks=[[0, 1], [2, 3]] if me else [[0, 2], [1, 3]])
    with pytest.raises(ValueError, match="appear in two lists"):
        split_group(split_ranks=[[0, 1], [1, 2, 3]])
    with pytest.raises(ValueError, match="are not in the parent group"):
        split_group(group, split_ranks=[[0, 1, 2, 3]])
    with pytest.raises(ValueError, match="is the world group"):
        destroy_process_group(ms.communication.GlobalComm.WORLD_COMM_GROUP)
    with pytest.raises(TypeError, match="a group is a MindSpore group name"):
        mark_created_groups([3])


@multi_rank(4)
def test_all_to_all_single():
    """Uneven row blocks (some empty, one rank receiving nothing) over each dim of a (2, 2) mesh and over 4
    ranks, values and gradients against numpy, PyNative and ms.jit (splits as Python ints); counts exchanged
    when output_split_sizes is None; a rank's wrong output_split_sizes raises on every rank; CommDebugMode
    records the textbook bytes (the rows sent to the other ranks)."""
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
    for mesh, dim, mode, pieces in [(grid, "dp", "pynative", "uneven"), (grid, "tp", "jit", "uneven"),
                                    (flat, "ep", "pynative", "uneven"), (flat, "ep", "pynative", "empty"),
                                    (flat, "ep", "jit", "uneven"), (flat, "ep", "jit", "even")]:
        check_collective("all_to_all_single", mesh, dim, mode=mode, pieces=pieces)
    me = flat.get_local_rank()
    from hyper_parallel_ms.testing.collective_check import split_matrix
    matrix = split_matrix(4, "uneven")
    x = ms.Tensor(np.arange(sum(matrix[me]) * 3, dtype=np.float32).reshape(-1, 3) + 100 * me)
    with CommDebugMode() as mode:
        y = comm.all_to_all_single(x, None, matrix[me], flat, "ep")              # counts exchanged first
    want = np.concatenate([(np.arange(sum(matrix[i]) * 3, dtype=np.float32).reshape(-1, 3) + 100 * i)
                           [sum(matrix[i][:me]):sum(matrix[i][:me + 1])] for i in range(4)])
    np.testing.assert_array_equal(y.asnumpy(), want)
    rec = mode.records[0]
    assert (rec.kind, rec.mesh_dim, rec.group_size, rec.path) == ("all_to_all_single", "ep", 4, "composed")
    assert mode.get_total_counts() == 1 and rec.bytes == (sum(matrix[me]) - matrix[me][me]) * 12
    assert rec.wire_bytes == 504 + 192        # ring all-reduces of the 28-row buffer and of the 4 x 8 counts
    np.testing.assert_array_equal(comm.all_to_all_by_matrix(x, matrix, flat, "ep").asnumpy(), want)
    # the whole matrix known: inside ms.jit with row counts that differ between the ranks, value and gradient
    from hyper_parallel_ms.testing.collective_check import all_to_all_single as reference
    known = ((1, 2, 0, 1), (2, 1, 1, 0), (0, 3, 1, 2), (1, 0, 2, 1))
    xs = [np.random.default_rng(10 + r).standard_normal((sum(known[r]), 3)).astype(np.float32) for r in range(4)]
    ws = [np.random.default_rng(20 + r).standard_normal((sum(row[r] for row in known), 3)).astype(np.float32)
          for r in range(4)]
    weight = ms.Tensor(ws[me])

    def by_matrix(t):
        return (comm.all_to_all_by_matrix(t, known, flat, "ep") * weight).sum()
    value, grad = ms.jit(ms.value_and_grad(by_matrix))(ms.Tensor(xs[me]))
    out, want_grad = reference(xs, ws, me, known)
    np.testing.assert_allclose(value.asnumpy(), (reference(xs, None, me, known) * ws[me]).sum(), rtol=1e-5)
    np.testing.assert_allclose(grad.asnumpy(), want_grad, rtol=1e-5, atol=1e-6)
    with CommDebugMode() as mode:           # PyNative: the backward (the transposed exchange) is recorded too
        value, grad = ms.value_and_grad(by_matrix)(ms.Tensor(xs[me]))
    np.testing.assert_allclose(grad.asnumpy(), want_grad, rtol=1e-5, atol=1e-6)
    sent = [sum(known[me]) - known[me][me], sum(row[me] for row in known) - known[me][me]]
    assert [(r.kind, r.bytes) for r in mode.records] == [("all_to_all_single", 12 * n) for n in sent]
    wrong = tuple(row[me] for row in matrix)
    wrong = (wrong[0] + 1,) + wrong[1:] if me == 2 else wrong
    with pytest.raises(ValueError, match=r"rank 2 of the group \(global rank 2\) expects output_split_sizes"):
        comm.all_to_all_single(x, wrong, matrix[me], flat, "ep")
    def counts_unknown(t):
        return comm.all_to_all_single(t, None, matrix[me], flat, "ep")
    with pytest.raises(NotImplementedError, match="inside ms.jit needs output_split_sizes"):
        ms.jit(counts_unknown)(x)
    with pytest.raises(ValueError, match="input_split_sizes .* sum to"):
        comm.all_to_all_single(x, None, (1, 1, 1, 1), flat, "ep")
