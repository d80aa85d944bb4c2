"""Ops on DTensors: element-wise, matmul / linear, reductions and casts, rule registration,
local_map; each result's placements, values and the gradients of every input against the
single-device computation, on meshes (2,) and (2, 2); communication counts."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import mint, nn, ops

from hyper_parallel_ms.comm import CommDebugMode
from hyper_parallel_ms.dtensor import DTensor, distribute_tensor
from hyper_parallel_ms.layout import Layout
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.ops import OpSchema, OutputSharding, propagator, register_sharding, strict_plain_tensors
from hyper_parallel_ms.placement import Partial
from hyper_parallel_ms.testing import multi_rank
from tests._ops_check import S0, S1, S2, P, R, _rand, check_op
from tests.test_ops_layers import _layer_norm_mint, _rms
from tests.test_ops_views import (
    _cat_cols,
    _chunk_uneven,
    _index_mixed,
    _index_row,
    _narrow,
    _permute,
    _reshape_merge,
    _softmax,
    _split_uneven,
    _stack_mid,
)


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
    check_op(mesh, _mean_dim1, [a], [[S1, S0]], [Partial("sum"), S0])    # this rank's sum / the count
    check_op(mesh, _mean_dim1, [_rand(4, 5, 2)], [[S1, R]], [P, R])   # uneven: the same, nothing gathered
    check_op(mesh, _sum_dim0, [a], [[P, S2]], [P, S1])


def _trace(a):
    return ops.trace(a)


@multi_rank(2)
def test_missing_rule_strict_mode_and_registration():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    a = distribute_tensor(ms.Tensor(_rand(4, 6)), mesh, [S0])
    with pytest.raises(NotImplementedError, match=r"no sharding rule for MindSpore op '\w+' called as .*S\(0\)"):
        _trace(a)
    with pytest.raises(NotImplementedError, match="register_sharding"):
        _trace(a)
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
    def trace_rule(schema: OpSchema) -> OutputSharding:
        x = schema.args[0]
        layout = Layout(x.layout.mesh_shape, (R,) * len(x.layout.mesh_shape), mesh_dim_names=x.layout.mesh_dim_names)
        return OutputSharding((layout,) + (None,) * (len(schema.args) - 1), ((layout, ()),))
    try:
        out = check_op(mesh, _trace, [_rand(4, 6)], [[S1]], [R])
        assert out.shape == ()
    finally:
        propagator.unregister(name)
    with pytest.raises(NotImplementedError):
        _trace(a)


def _op_name(a):
    return _trace(a)


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


@multi_rank(2)
def test_custom_shard_is_local_map_in_hyper_parallels_spelling():
    from hyper_parallel_ms import custom_shard
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x, y = _rand(4, 6), _rand(4, 6, seed=1)

    def add_rows(a, b):
        return a + b.sum(0, keepdims=True)
    fn = custom_shard(add_rows, mesh, out_placements=((S0,),), in_placements=((S0,), (R,)))
    # y arrives row-sharded and is moved to Replicate first (redistribute_inputs defaults to True)
    out = fn(distribute_tensor(ms.Tensor(x), mesh, [S0]), distribute_tensor(ms.Tensor(y), mesh, [S0]))
    assert isinstance(out, DTensor) and out.placements == (S0,)       # one result: not a tuple
    np.testing.assert_allclose(out.full_tensor().asnumpy(), x + y.sum(0, keepdims=True), rtol=1e-5)
    both = custom_shard(lambda a: (a * 2, a.shape[0]), mesh, out_placements=((S0,), None), in_placements=((S0,),))
    doubled, rows = both(distribute_tensor(ms.Tensor(x), mesh, [S0]))
    assert rows == 2 and doubled.placements == (S0,)
    np.testing.assert_allclose(doubled.full_tensor().asnumpy(), 2 * x, rtol=1e-6)
    # no DTensor argument: run as it is, the result unwrapped
    plain = custom_shard(add_rows, mesh, out_placements=((S0,),))(ms.Tensor(x[:2]), ms.Tensor(y))
    assert not isinstance(plain, DTensor)
    np.testing.assert_allclose(plain.asnumpy(), x[:2] + y.sum(0, keepdims=True), rtol=1e-5)
    with pytest.raises(RuntimeError, match="in_placements is None"):
        custom_shard(add_rows, mesh, out_placements=((S0,),))(distribute_tensor(ms.Tensor(x), mesh, [S0]), y)
    with pytest.raises(TypeError, match="argument 1 is not a DTensor"):
        custom_shard(add_rows, mesh, ((S0,),), ((S0,), (R,)))(distribute_tensor(ms.Tensor(x), mesh, [S0]),
                                                              ms.Tensor(y))
    with pytest.raises(TypeError, match="argument 1 is a DTensor"):
        custom_shard(add_rows, mesh, ((S0,),), ((S0,), None))(distribute_tensor(ms.Tensor(x), mesh, [S0]),
                                                              distribute_tensor(ms.Tensor(y), mesh, [R]))
    with pytest.raises(ValueError, match="redistribute_inputs=True"):
        custom_shard(add_rows, mesh, ((S0,),), ((S0,), (R,)), redistribute_inputs=False)(
            distribute_tensor(ms.Tensor(x), mesh, [S0]), distribute_tensor(ms.Tensor(y), mesh, [S0]))


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


def _addcmul(a, b, c):
    return ops.addcmul(a, b, c, value=0.5)


def _view_as_6x4(a):
    return a.view_as(ms.Tensor(np.zeros((6, 4), np.float32)))


@multi_rank(2)
def test_view_as_addcmul_isclose_new_zeros():
    """Ops a PyTorch port reaches that had no rule: each against one device (value and gradients)."""
    mesh = init_device_mesh("cpu", (2,))
    a, b, c = _rand(4, 6), _rand(4, 6, seed=1), _rand(4, 6, seed=2)
    check_op(mesh, _addcmul, [a, b, c], [[S0], [S0], [R]], [S0])
    check_op(mesh, _view_as_6x4, [a], [[S0]], [S0])
    x, y = distribute_tensor(ms.Tensor(a), mesh, [S0]), distribute_tensor(ms.Tensor(a + 1e-9), mesh, [S1])
    np.testing.assert_array_equal(ops.isclose(x, y).full_tensor().asnumpy(), np.isclose(a, a + 1e-9))
    zeros = x.new_zeros((3, 2))
    assert zeros.placements == (R,) and zeros.shape == (3, 2) and not zeros.full_tensor().asnumpy().any()
    np.testing.assert_array_equal(x.new_ones((2,)).full_tensor().asnumpy(), [1.0, 1.0])
