"""Ops on DTensors: each result's placements, values and the gradients of every input
against the single-device computation, on meshes (2,) and (2, 2); communication counts."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import mint, nn, ops

from hyper_parallel_ms.comm import CommDebugMode
from hyper_parallel_ms.dtensor import DTensor, distribute_tensor
from hyper_parallel_ms.layout import Layout
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.ops import OpSchema, OutputSharding, dispatch, register_sharding, strict_plain_tensors
from hyper_parallel_ms.placement import Partial, Replicate, Shard
from hyper_parallel_ms.redistribute import replicate_partials
from hyper_parallel_ms.testing import multi_rank

R, P, S0, S1, S2 = Replicate(), Partial(), Shard(0), Shard(1), Shard(2)


def check_op(mesh, fn, arrays, placements, expect=None):
    """Run ``fn`` on DTensors and on full tensors; compare output, placements and gradients."""
    full = [ms.Tensor(a) for a in arrays]
    ref = fn(*full)
    w = ms.Tensor(np.random.default_rng(1).standard_normal(ref.shape).astype(np.float32))
    positions = tuple(range(len(arrays)))

    def ref_loss(*args):
        return (fn(*args) * w).sum()
    ref_grads = ms.grad(ref_loss, grad_position=positions)(*full)
    ref_grads = ref_grads if isinstance(ref_grads, tuple) else (ref_grads,)
    dts = [distribute_tensor(t, mesh, p, src_data_rank=None) for t, p in zip(full, placements)]
    out = fn(*dts)
    assert isinstance(out, DTensor), type(out)
    if expect is not None:
        assert out.placements == tuple(expect), (out.placements, expect)
    np.testing.assert_allclose(out.full_tensor().asnumpy(), ref.asnumpy(), rtol=1e-5, atol=1e-5)

    def loss(*locals_):
        args = [DTensor.from_local(piece, mesh, d.layout, shape=d.shape) for piece, d in zip(locals_, dts)]
        return (fn(*args).full_tensor() * w).sum()
    grads = ms.grad(loss, grad_position=positions)(*[d.to_local() for d in dts])
    grads = grads if isinstance(grads, tuple) else (grads,)
    coord = mesh.get_coordinate()
    for g, rg, d in zip(grads, ref_grads, dts):
        want = rg.asnumpy()[replicate_partials(d.layout).local_slices(d.shape, coord)]
        np.testing.assert_allclose(g.asnumpy(), want, rtol=1e-5, atol=1e-5)
    return out


def _rand(*shape, seed=0):
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape).astype(np.float32)


def _add(a, b):
    return a + b


def _mul(a, b):
    return a * b


def _sub_scalar(a):
    return 2.0 - a * 3.0


def _div(a, b):
    return a / b


def _gelu_exp(a):
    return ops.exp(ops.gelu(a) * 0.5)


def _neg(a):
    return -a


def _add_one(a):
    return a + 1.0


def _plain_first(a):
    return ms.Tensor(np.ones((4, 6), np.float32)) * a + ms.Tensor(np.arange(6, dtype=np.float32))


@multi_rank(2)
def test_pointwise_on_1d_mesh():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    a, b, row = _rand(4, 6), _rand(4, 6, seed=1), _rand(6, seed=2)
    check_op(mesh, _add, [a, b], [[S0], [S0]], [S0])
    check_op(mesh, _add, [a, b], [[S1], [R]], [S1])           # b chunked locally
    check_op(mesh, _add, [a, b], [[P], [P]], [P])             # sum of partials stays partial
    check_op(mesh, _add, [a, b], [[P], [R]], [R])             # partial + replicate reduces first
    check_op(mesh, _add, [a, row], [[S0], [R]], [S0])         # broadcast row over sharded rows
    check_op(mesh, _add, [a, row], [[S1], [S0]], [S1])        # broadcast operand sharded like the output
    check_op(mesh, _mul, [a, b], [[P], [R]], [P])             # partial * replicate stays partial
    check_op(mesh, _mul, [a, b], [[P], [P]], [R])             # partial * partial reduces
    check_op(mesh, _div, [a, b + 3.0], [[P], [R]], [P])
    check_op(mesh, _div, [a, b + 3.0], [[R], [P]], [R])
    check_op(mesh, _sub_scalar, [a], [[S0]], [S0])
    check_op(mesh, _sub_scalar, [a], [[P]], [R])
    check_op(mesh, _neg, [a], [[P]], [P])
    check_op(mesh, _add_one, [a], [[P]], [R])
    check_op(mesh, _gelu_exp, [a], [[S1]], [S1])
    check_op(mesh, _plain_first, [a], [[S0]], [S0])           # plain tensors read as Replicate


@multi_rank(4)
def test_pointwise_on_2d_mesh_uneven():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    a, b = _rand(5, 3, 2), _rand(5, 3, 2, seed=3)
    check_op(mesh, _mul, [a, b], [[S0, S1], [R, S1]], [S0, S1])
    check_op(mesh, _add, [a, b], [[S0, P], [S0, P]], [S0, P])
    check_op(mesh, _add, [a, b], [[S2, S0], [R, R]], [S2, S0])
    check_op(mesh, _gelu_exp, [a], [[P, S2]], [R, S2])


def _matmul(a, b):
    return ops.matmul(a, b)


def _mlp(x, w1, w2):
    return ops.matmul(ops.relu(ops.matmul(x, w1)), w2)


def _linear(x, w, b):
    return mint.nn.functional.linear(x, w, b)


def _bmm(a, b):
    return mint.matmul(a, b)


@multi_rank(2)
def test_matmul_and_linear_on_1d_mesh():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x, w1, w2 = _rand(4, 6), _rand(6, 8, seed=1), _rand(8, 6, seed=2)
    check_op(mesh, _matmul, [x, w1], [[R], [S1]], [S1])                 # column parallel
    check_op(mesh, _matmul, [x, w1], [[S1], [S0]], [P])                 # contraction -> Partial(sum)
    check_op(mesh, _matmul, [x, w1], [[S0], [R]], [S0])                 # data parallel
    check_op(mesh, _matmul, [x, w1], [[P], [R]], [P])
    # column-parallel then row-parallel runs exactly one all-reduce (when the result is read)
    with CommDebugMode() as mode:
        out = check_op(mesh, _mlp, [x, w1, w2], [[R], [S1], [S0]], [P])
    dts = [distribute_tensor(ms.Tensor(t), mesh, p) for t, p in zip([x, w1, w2], [[R], [S1], [S0]])]
    with CommDebugMode() as mode:
        y = _mlp(*dts)
        y.full_tensor()
    assert mode.get_comm_counts() == {"all_reduce": 1}, mode.summary()
    assert out.placements == (P,)
    # linear: w stored (out, in); colwise shards w dim 0 and the bias, rowwise shards w dim 1
    wl, bias = _rand(8, 6, seed=4), _rand(8, seed=5)
    check_op(mesh, _linear, [x, wl, bias], [[R], [S0], [S0]], [S1])
    out = check_op(mesh, _linear, [x, wl, bias], [[S1], [S1], [R]], [P])   # bias added once
    check_op(mesh, _bmm, [_rand(2, 4, 6), _rand(2, 6, 3, seed=6)], [[S0], [S0]], [S0])
    check_op(mesh, _bmm, [_rand(2, 4, 6), _rand(6, 3, seed=7)], [[S2], [S0]], [P])


@multi_rank(4)
def test_matmul_on_2d_mesh():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x, w = _rand(6, 4), _rand(4, 10, seed=1)
    check_op(mesh, _matmul, [x, w], [[S0, R], [R, S1]], [S0, S1])
    check_op(mesh, _matmul, [x, w], [[S0, S1], [R, S0]], [S0, P])
    check_op(mesh, _linear, [x, _rand(10, 4, seed=2), _rand(10, seed=3)], [[S0, R], [R, S0], [R, S0]], [S0, S1])


@multi_rank(2)
def test_nn_dense_with_dtensor_parameters():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ms.set_seed(3)                 # the same initial weights on every rank
    dense = nn.Dense(6, 8)
    w, b = dense.weight.asnumpy(), dense.bias.asnumpy()
    dense.weight = ms.Parameter(distribute_tensor(ms.Tensor(w), mesh, [S0]), name="weight")
    dense.bias = ms.Parameter(distribute_tensor(ms.Tensor(b), mesh, [S0]), name="bias")
    x = _rand(4, 6)
    y = dense(distribute_tensor(ms.Tensor(x), mesh, [R]))
    assert isinstance(y, DTensor) and y.placements == (S1,)
    np.testing.assert_allclose(y.full_tensor().asnumpy(), x @ w.T + b, rtol=1e-5, atol=1e-5)


def _sum_all(a):
    return a.sum()


def _sum_dim0(a):
    return a.sum(0)


def _sum_keep(a):
    return a.sum(1, keepdim=True)


def _mean_dim1(a):
    return a.mean(1)


@multi_rank(4)
def test_reductions():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    a = _rand(4, 6, 2)
    check_op(mesh, _sum_all, [a], [[S0, S1]], [P, P])
    check_op(mesh, _sum_dim0, [a], [[S0, S1]], [P, S0])
    check_op(mesh, _sum_keep, [a], [[S0, S1]], [S0, P])
    check_op(mesh, _mean_dim1, [a], [[S1, S0]], [Partial("avg"), S0])
    check_op(mesh, _mean_dim1, [_rand(4, 5, 2)], [[S1, R]], [R, R])   # uneven mean gathers first
    check_op(mesh, _sum_dim0, [a], [[P, S2]], [P, S1])


def _cumsum(a):
    return ops.cumsum(a, 0)


@multi_rank(2)
def test_missing_rule_strict_mode_and_registration():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    a = distribute_tensor(ms.Tensor(_rand(4, 6)), mesh, [S0])
    with pytest.raises(NotImplementedError, match=r"no sharding rule for MindSpore op '\w+' called as .*S\(0\)"):
        _cumsum(a)
    with pytest.raises(NotImplementedError, match="register_sharding"):
        _cumsum(a)
    with strict_plain_tensors():
        with pytest.raises(TypeError, match="plain Tensor of shape"):
            a + ms.Tensor(np.ones((4, 6), np.float32))
    other = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match="must share a mesh"):
        a + distribute_tensor(ms.Tensor(_rand(4, 6)), other, [S0])
    with pytest.raises(ValueError, match="primitive names"):
        register_sharding()
    try:
        name = str(_op_name(a))
    except NotImplementedError as err:
        name = str(err).split("'")[1]

    @register_sharding(name)
    def cumsum_rule(schema: OpSchema) -> OutputSharding:
        x = schema.args[0]
        dim = schema.args[1] % x.ndim
        placements = tuple(R if p.is_shard(dim) or p.is_partial() else p for p in x.layout.placements)
        layout = Layout(x.layout.mesh_shape, placements, mesh_dim_names=x.layout.mesh_dim_names)
        return OutputSharding((layout,) + (None,) * (len(schema.args) - 1), ((layout, x.shape),))
    out = check_op(mesh, _cumsum, [_rand(4, 6)], [[S1]], [S1])
    assert out.shape == (4, 6)


def _op_name(a):
    return _cumsum(a)


def _permute(a):
    return a.permute(2, 0, 1)


def _transpose(a):
    return a.transpose(0, 2)


def _unsqueeze_squeeze(a):
    return a.unsqueeze(1).squeeze(1) * a.unsqueeze(0).squeeze()


def _reshape_merge(a):
    return a.reshape(-1, 2)


def _reshape_split(a):
    return a.reshape(2, 2, 6, 2)


def _softmax(a):
    return ops.softmax(a, -1)


def _log_softmax_rows(a):
    return ops.log_softmax(a, 0)


@multi_rank(4)
def test_views_and_softmax():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    a = _rand(4, 6, 2)
    check_op(mesh, _permute, [a], [[S2, S0]], [S0, S1])
    check_op(mesh, _transpose, [a], [[S0, P]], [S2, P])
    check_op(mesh, _unsqueeze_squeeze, [a], [[S0, S1]], [S0, S1])
    check_op(mesh, _reshape_merge, [a], [[S0, R]], [S0, R])        # rows stay first: 24 rows split evenly
    check_op(mesh, _reshape_merge, [a], [[S0, S1]], [S0, R])       # the inner sharded dim is gathered
    check_op(mesh, _reshape_split, [a], [[S0, R]], [S0, R])
    check_op(mesh, _reshape_split, [a], [[S1, S0]], [S2, S0])
    check_op(mesh, _softmax, [a], [[S0, S2]], [S0, R])             # the softmax dim is gathered
    check_op(mesh, _softmax, [a], [[P, S1]], [R, S1])
    check_op(mesh, _log_softmax_rows, [a], [[S1, S0]], [S1, R])


@multi_rank(2)
def test_local_map():
    from hyper_parallel_ms.ops import local_map
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = _rand(4, 6)

    def row_norm(t):
        return t / ops.sqrt((t * t).sum(-1, keepdims=True))
    normed = local_map(row_norm, out_placements=[S0], in_placements=([S0],))
    out = normed(distribute_tensor(ms.Tensor(x), mesh, [S0]))
    assert isinstance(out, DTensor) and out.placements == (S0,)
    np.testing.assert_allclose(out.full_tensor().asnumpy(), x / np.sqrt((x * x).sum(-1, keepdims=True)), rtol=1e-5)
    with pytest.raises(ValueError, match="redistribute_inputs=True"):
        normed(distribute_tensor(ms.Tensor(x), mesh, [S1]))
    moved = local_map(row_norm, out_placements=[S0], in_placements=([S0],), redistribute_inputs=True)
    np.testing.assert_allclose(moved(distribute_tensor(ms.Tensor(x), mesh, [S1])).full_tensor().asnumpy(),
                               x / np.sqrt((x * x).sum(-1, keepdims=True)), rtol=1e-5)


def _layer_norm_fn():
    norm = nn.LayerNorm((2,), begin_norm_axis=-1, begin_params_axis=-1)

    def run(a):
        return norm(a)
    return run


@multi_rank(4)
def test_layer_norm_and_embedding():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    a = _rand(4, 6, 2)
    check_op(mesh, _layer_norm_fn(), [a], [[S0, S1]], [S0, S1])      # sequence-parallel style: no comm
    check_op(mesh, _layer_norm_fn(), [a], [[S2, P]], [R, R])         # normalised dim gathered, partial reduced
    table, ids = _rand(10, 8), np.array([[1, 7, 3], [9, 0, 2]], np.int32)
    ids_dt = distribute_tensor(ms.Tensor(ids), mesh, [R, R], src_data_rank=None)
    for placements, expect in [([R, S1], (R, S2)), ([R, R], (R, R)), ([S0, R], (P, R)), ([S0, S1], (P, S2)),
                               ([R, S0], (R, P))]:
        table_dt = distribute_tensor(ms.Tensor(table), mesh, placements)
        out = ops.gather(table_dt, ids_dt, 0)
        assert out.placements == expect
        np.testing.assert_allclose(out.full_tensor().asnumpy(), table[ids])
        w = np.random.default_rng(3).standard_normal((2, 3, 8)).astype(np.float32)

        def loss(local):
            t = DTensor.from_local(local, mesh, table_dt.layout, shape=(10, 8))
            return (ops.gather(t, ids_dt, 0).full_tensor() * ms.Tensor(w)).sum()
        want = np.zeros_like(table)
        np.add.at(want, ids, w)
        grad = ms.grad(loss)(table_dt.to_local())
        np.testing.assert_allclose(grad.asnumpy(), want[table_dt.layout.local_slices((10, 8), mesh.get_coordinate())],
                                   rtol=1e-5, atol=1e-5)
    uneven = _rand(7, 8)                                             # 7 rows on 2 ranks: 4 and 3
    out = ops.gather(distribute_tensor(ms.Tensor(uneven), mesh, [R, S0]), ms.Tensor(ids % 7), 0)  # plain ids
    assert out.placements == (R, P)
    np.testing.assert_allclose(out.full_tensor().asnumpy(), uneven[ids % 7])
    sharded_ids = distribute_tensor(ms.Tensor(ids), mesh, [S0, R], src_data_rank=None)
    out = ops.gather(distribute_tensor(ms.Tensor(table), mesh, [R, S1]), sharded_ids, 0)
    assert out.placements == (S0, S2)
    np.testing.assert_allclose(out.full_tensor().asnumpy(), table[ids])


@multi_rank(2)
def test_inplace_updates_keep_the_dtensor():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    g = _rand(4, 6)
    for placements in ([S0], [P], [R]):
        acc = distribute_tensor(ms.Tensor(np.zeros((4, 6), np.float32)), mesh, placements)
        grad = distribute_tensor(ms.Tensor(g), mesh, placements)
        same = acc
        acc += grad
        acc.add_(grad)
        acc.mul_(0.5)
        assert acc is same and isinstance(acc, DTensor) and acc.placements == tuple(placements)
        np.testing.assert_allclose(acc.full_tensor().asnumpy(), g, rtol=1e-6)
        acc.add_(distribute_tensor(ms.Tensor(g), mesh, [R]))            # another layout: brought to acc's
        np.testing.assert_allclose(acc.full_tensor().asnumpy(), 2 * g, rtol=1e-6)
        acc.copy_(distribute_tensor(ms.Tensor(3 * g), mesh, [S1]))
        assert acc.placements == tuple(placements)
        np.testing.assert_allclose(acc.full_tensor().asnumpy(), 3 * g, rtol=1e-6)


def _cat_cols(a, b):
    return ops.cat([a, b], 1)


def _cat_rows(a, b):
    return ops.cat((a, b), 0)


def _split_sum(a):
    first, second = ops.split(a, 3, 1)
    return first * second


@multi_rank(4)
def test_cat_and_split():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    a, b = _rand(4, 6), _rand(4, 2, seed=9)
    check_op(mesh, _cat_cols, [a, b], [[S0, R], [S0, R]], [S0, R])
    check_op(mesh, _cat_cols, [a, b], [[S0, S1], [R, R]], [S0, R])       # the cat dim is gathered
    check_op(mesh, _cat_cols, [a, b], [[P, S0], [P, S0]], [P, S0])
    check_op(mesh, _cat_rows, [a, a], [[S1, S0], [S1, R]], [S1, R])
    check_op(mesh, _split_sum, [a], [[S0, S1]], [S0, R])


@multi_rank(2)
def test_uneven_shapes_on_1d_mesh():
    """Odd sizes split 3 + 2 (or 4 + 3) over two ranks, through every rule family."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    a, b = _rand(5, 3), _rand(5, 3, seed=4)
    check_op(mesh, _mul, [a, b], [[S0], [R]], [S0])
    check_op(mesh, _matmul, [a, _rand(3, 7, seed=2)], [[R], [S1]], [S1])
    check_op(mesh, _matmul, [_rand(4, 5), _rand(5, 3, seed=3)], [[S1], [S0]], [P])
    check_op(mesh, _linear, [a, _rand(7, 3, seed=5), _rand(7, seed=6)], [[R], [S0], [S0]], [S1])
    check_op(mesh, _sum_dim0, [a], [[S0]], [P])
    check_op(mesh, _softmax, [a], [[S0]], [S0])
    check_op(mesh, _reshape_merge, [_rand(5, 3, 2)], [[S0]], [R])      # 5 rows do not split evenly into 15
    check_op(mesh, _permute, [_rand(5, 3, 2)], [[S0]], [S1])
    check_op(mesh, _cat_cols, [a, b], [[S0], [S0]], [S0])


def _on_dtensors(name, impl):
    """``impl`` on plain tensors; on DTensors, the dispatcher running op ``name`` with ``impl``
    as its local kernel (a CPU twin for ops whose MindSpore kernel is Ascend-only)."""
    class Kernel:
        def __call__(self, *args):
            return impl(*args)
    kernel = Kernel()
    kernel.name = name

    def run(*args):
        flat = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])]
        if any(isinstance(t, DTensor) for t in flat):
            return dispatch(kernel, args, {})
        return impl(*args)
    return run


def _amax_dim0(a):
    return ops.amax(a, 0)


def _max_all(a):
    return a.max()


def _amin_dim1(a):
    return ops.amin(a, 1)


def _min_dim1_values(a):
    return a.min(1)[0]                 # MinDim: values and indices


def _max_values_and_indices(a):
    values, indices = ops.max(a, 1)
    return indices.astype(ms.float32) * 0.0 + values


def _cast_round_trip(a):
    return ops.cast(ops.cast(a * 2.0, ms.float16), ms.float32)


@multi_rank(4)
def test_max_min_reductions_and_cast():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    a = _rand(4, 6, 2)
    check_op(mesh, _amax_dim0, [a], [[S0, S1]], [Partial("max"), S0])
    check_op(mesh, _max_all, [a], [[S0, S1]], [Partial("max"), Partial("max")])
    check_op(mesh, _amin_dim1, [a], [[S1, S0]], [Partial("min"), S0])
    check_op(mesh, _min_dim1_values, [a], [[S1, S0]], [R, S0])
    check_op(mesh, _max_values_and_indices, [a], [[S1, S2]], [R, S1])    # indices need the whole dim
    check_op(mesh, _amax_dim0, [_rand(5, 3)], [[S0, S1]], [Partial("max"), S0])
    check_op(mesh, _amax_dim0, [a], [[P, S2]], [R, S1])                  # max of a Partial(sum) reduces first
    check_op(mesh, _cast_round_trip, [a], [[S0, S2]], [S0, S2])
    x = distribute_tensor(ms.Tensor(a), mesh, [S0, S1])
    assert x.astype(ms.float16).placements == (S0, S1) and x.astype(ms.float16).dtype == ms.float16


def _stack_cpu(tensors, dim):
    return ops.stack(tensors, dim)


_stack = _on_dtensors("StackExt", _stack_cpu)


def _stack_mid(a, b):
    return _stack([a, b], 1)


def _split_uneven(a):
    first, second = ops.split(a, [1, 3], 1)
    return ops.cat([second, first * 2.0], 1)


def _split_by_size(a):
    pieces = ops.split(a, 3, 0)
    return ops.cat([p * (i + 1.0) for i, p in enumerate(pieces)], 0)


def _chunk_uneven(a):
    pieces = ops.chunk(a, 3, 0)
    return ops.cat([p * (i + 1.0) for i, p in enumerate(pieces)], 0)


def _mint_chunk(a):
    pieces = mint.chunk(a, 3, 1)
    return ops.cat([p * (i + 1.0) for i, p in enumerate(pieces)], 1)


def _narrow(a):
    return mint.narrow(a, 1, 1, 2)


def _narrow_whole(a):
    return mint.narrow(a, 0, 0, a.shape[0])


def _index_row(a):
    return a[1]


def _index_cols(a):
    return a[:, 1:3]


def _index_mixed(a):
    return a[..., None, ::2][:, 1]


def _index_whole(a):
    return a[:, :, None]


@multi_rank(4)
def test_stack_split_narrow_and_indexing():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    a, b = _rand(5, 4), _rand(5, 4, seed=2)
    check_op(mesh, _stack_mid, [a, b], [[S0, S1], [S0, R]], [S0, S2])
    check_op(mesh, _stack_mid, [a, b], [[P, S0], [P, R]], [P, S0])
    check_op(mesh, _split_uneven, [a], [[S0, S1]], [S0, R])
    check_op(mesh, _split_by_size, [_rand(7, 4)], [[S0, S1]], [R, S1])   # pieces 3, 3, 1
    check_op(mesh, _chunk_uneven, [_rand(7, 4)], [[S1, S0]], [S1, R])
    check_op(mesh, _mint_chunk, [_rand(4, 5)], [[S0, S1]], [S0, R])
    check_op(mesh, _narrow, [a], [[S0, S1]], [S0, R])
    check_op(mesh, _narrow_whole, [a], [[S0, S1]], [S0, S1])
    check_op(mesh, _index_row, [a], [[S0, S1]], [R, S0])
    check_op(mesh, _index_cols, [a], [[S0, S1]], [S0, R])
    check_op(mesh, _index_mixed, [_rand(3, 4, 6)], [[S2, S1]], [R, R])
    check_op(mesh, _index_mixed, [_rand(3, 4, 6)], [[S0, P]], [S0, P])
    check_op(mesh, _index_whole, [a], [[S1, S0]], [S1, S0])
    x = distribute_tensor(ms.Tensor(a), mesh, [S0, S1])
    # mint.split into sizes (forward only: MindSpore's CPU backward of this view op is wrong on plain tensors too)
    pieces = mint.split(x, [1, 3], 1)
    assert [p.placements for p in pieces] == [(S0, R), (S0, R)]
    np.testing.assert_allclose(pieces[1].full_tensor().asnumpy(), a[:, 1:], rtol=1e-6)
    with pytest.raises(NotImplementedError, match="advanced indexing"):
        x[ms.Tensor(np.array([0, 1], np.int32))]
    with pytest.raises(IndexError, match="too many indices"):
        x[0, 0, 0]
    with pytest.raises(IndexError, match="out of bounds"):
        x[7]


def _rms_norm_cpu(x, gamma, eps):
    rstd = ops.rsqrt((x * x).mean(-1, keep_dims=True) + eps)
    return x * rstd * gamma, rstd


def _layer_norm_ext_cpu(x, normalized_shape, weight, bias, eps):
    mean = x.mean(-1, keep_dims=True)
    rstd = ops.rsqrt(((x - mean) ** 2).mean(-1, keep_dims=True) + eps)
    return (x - mean) * rstd * weight + bias, mean, rstd


_rms_norm = _on_dtensors("RmsNorm", _rms_norm_cpu)
_layer_norm_ext = _on_dtensors("LayerNormExt", _layer_norm_ext_cpu)


def _rms(x, gamma):
    return _rms_norm(x, gamma, 1e-6)[0]


def _layer_norm_mint(x, weight, bias):
    return _layer_norm_ext(x, (x.shape[-1],), weight, bias, 1e-5)[0]


@multi_rank(4)
def test_rms_norm_and_mint_layer_norm_cpu_twins():
    """The RmsNorm / LayerNormExt rules with CPU kernels standing in for the Ascend-only ones."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x, g, bias = _rand(4, 3, 6), _rand(6, seed=1), _rand(6, seed=2)
    check_op(mesh, _rms, [x, g], [[S0, S1], [R, R]], [S0, S1])
    check_op(mesh, _rms, [x, g], [[S2, P], [R, R]], [R, R])          # the normalised dim gathered, Partial reduced
    check_op(mesh, _layer_norm_mint, [x, g, bias], [[S1, S2], [R, S0], [R, R]], [S1, R])


@multi_rank(2)
def test_dropout_masks_follow_placements():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ones = ms.Tensor(np.ones((8, 6), np.float32))

    def both_pieces(dt):  # rank 0's and rank 1's local pieces, side by side
        return DTensor.from_local(dt.to_local(), mesh, [S0]).full_tensor().asnumpy().reshape(2, -1)

    for dropout in (lambda t: ops.dropout(t, p=0.5), nn.Dropout(p=0.5).set_train()):
        replicated = dropout(distribute_tensor(ones, mesh, [R]))
        assert replicated.placements == (R,)
        pieces = both_pieces(replicated)
        np.testing.assert_array_equal(pieces[0], pieces[1])           # replicas draw the same mask
        assert set(np.unique(pieces)) <= {0.0, 2.0} and 0.0 in pieces and 2.0 in pieces
        sharded = dropout(distribute_tensor(ones, mesh, [S0]))
        assert sharded.placements == (S0,)
        pieces = both_pieces(sharded)
        assert not np.array_equal(pieces[0], pieces[1])               # pieces draw independent masks
        partial = dropout(DTensor.from_local(ones, mesh, [P]))
        assert partial.placements == (R,)                              # the sum is dropped, not its parts
        assert set(np.unique(partial.to_local().asnumpy())) <= {0.0, 4.0}
    ms.set_seed(5)
    seeded = [ops.dropout(distribute_tensor(ones, mesh, [R]), p=0.5).to_local().asnumpy() for _ in range(2)]
    assert not np.array_equal(seeded[0], seeded[1])                   # consecutive calls draw new masks
    x = distribute_tensor(ones * 3.0, mesh, [S1])

    def loss(local):
        return (ops.dropout(DTensor.from_local(local, mesh, [S1], shape=(8, 6)), p=0.5).to_local() * 5.0).sum()
    grad = ms.grad(loss)(x.to_local()).asnumpy()      # kept positions, scaled by 1 / keep_prob
    assert set(np.unique(grad)) <= {0.0, 10.0} and 10.0 in grad and 0.0 in grad


def _func_dropout_ext_cpu(x, p, training, inplace, seed, offset):
    return ops.Dropout(1.0 - p, 0, int(seed.asnumpy()) % 2 ** 31)(x)[0]


@multi_rank(2)
def test_mint_dropout_rule_cpu_twin():
    """``FuncDropoutExt`` (Ascend-only kernel) with a CPU dropout standing in for it."""
    from hyper_parallel_ms.ops._rules import random as random_rules
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    original = random_rules.func_dropout_ext_op
    random_rules.func_dropout_ext_op = _func_dropout_ext_cpu
    try:
        kernel = _on_dtensors("FuncDropoutExt", _func_dropout_ext_cpu)
        seed, offset = ms.Tensor(11, ms.int64), ms.Tensor(0, ms.int64)
        ones = ms.Tensor(np.ones((8, 6), np.float32))
        out = {}
        for placement in (R, S0):
            y = kernel(distribute_tensor(ones, mesh, [placement]), 0.5, True, False, seed, offset)
            assert y.placements == (placement,)
            out[placement] = DTensor.from_local(y.to_local(), mesh, [S0]).full_tensor().asnumpy().reshape(2, -1)
        np.testing.assert_array_equal(out[R][0], out[R][1])
        assert not np.array_equal(out[S0][0], out[S0][1])
    finally:
        random_rules.func_dropout_ext_op = original


@multi_rank(2)
def test_max_stack_split_slicing_and_norms_on_1d_mesh():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    a, b = _rand(5, 4), _rand(5, 4, seed=2)
    check_op(mesh, _amax_dim0, [a], [[S0]], [Partial("max")])
    check_op(mesh, _amin_dim1, [a], [[S0]], [S0])
    check_op(mesh, _max_values_and_indices, [a], [[S1]], [R])
    check_op(mesh, _cast_round_trip, [a], [[S1]], [S1])
    check_op(mesh, _stack_mid, [a, b], [[S1], [R]], [S2])
    check_op(mesh, _split_uneven, [a], [[S1]], [R])
    check_op(mesh, _chunk_uneven, [_rand(7, 4)], [[S0]], [R])
    check_op(mesh, _narrow, [a], [[S0]], [S0])
    check_op(mesh, _index_row, [a], [[S1]], [S0])
    check_op(mesh, _index_mixed, [_rand(3, 4, 6)], [[S0]], [S0])
    check_op(mesh, _rms, [_rand(4, 3, 6), _rand(6, seed=1)], [[S1], [R]], [S1])
    check_op(mesh, _layer_norm_mint, [_rand(4, 3, 6), _rand(6, seed=1), _rand(6, seed=2)], [[S2], [R], [R]], [R])
