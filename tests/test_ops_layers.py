"""Layers' ops on DTensors: layer norm / rms_norm (CPU twins of the Ascend-only kernels),
embedding lookups, in-place updates, dropout; against the single-device computation."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

from hyper_parallel_ms.dtensor import DTensor, distribute_tensor
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.placement import Shard
from hyper_parallel_ms.testing import multi_rank
from tests._ops_check import S0, S1, S2, P, R, _on_dtensors, _rand, check_op


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


def _embedding_cpu(ids, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False):
    """One device's ``mint.nn.functional.embedding`` (its kernel is Ascend-only): the rows of ``ids``;
    the ``padding_idx`` row passes no gradient."""
    found = ops.gather(weight, ids, 0)
    if padding_idx is None:
        return found
    is_pad = ops.expand_dims(ids == padding_idx % weight.shape[0], -1).astype(found.dtype)
    return ops.stop_gradient(found) * is_pad + found * (1 - is_pad)


_embedding = _on_dtensors("Embedding", _embedding_cpu)


@multi_rank(4)
def test_mint_embedding_rule_cpu_twin():
    """``mint.nn.functional.embedding`` on a DTensor table: values, placements and the table's gradient
    (the padding row's zero) against one device; row-sharded tables run the rule's own masked lookup."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    table, ids = _rand(10, 8), np.array([[1, 7, 3], [9, 0, 7]], np.int32)
    w = np.random.default_rng(3).standard_normal((2, 3, 8)).astype(np.float32)
    for padding_idx in (None, 7, -3):
        want = np.zeros_like(table)
        np.add.at(want, ids, w)
        if padding_idx is not None:
            want[padding_idx] = 0
        for placements, expect in [([R, S1], (R, S2)), ([R, R], (R, R)), ([S0, R], (P, R)), ([S0, S1], (P, S2)),
                                   ([R, S0], (R, P))]:
            table_dt = distribute_tensor(ms.Tensor(table), mesh, placements)
            out = _embedding(ms.Tensor(ids), table_dt, padding_idx, None, 2.0, False)
            assert out.placements == expect
            np.testing.assert_allclose(out.full_tensor().asnumpy(), table[ids])

            def loss(local, table_dt=table_dt, padding_idx=padding_idx):
                t = DTensor.from_local(local, mesh, table_dt.layout, shape=(10, 8))
                out = _embedding(ms.Tensor(ids), t, padding_idx, None, 2.0, False)
                return (out.full_tensor() * ms.Tensor(w)).sum()
            grad = ms.grad(loss)(table_dt.to_local())
            mine = table_dt.layout.local_slices((10, 8), mesh.get_coordinate())
            np.testing.assert_allclose(grad.asnumpy(), want[mine], rtol=1e-5, atol=1e-5,
                                       err_msg=f"{placements} padding_idx={padding_idx}")
    sharded_ids = distribute_tensor(ms.Tensor(ids), mesh, [S0, R], src_data_rank=None)
    out = _embedding(sharded_ids, distribute_tensor(ms.Tensor(table), mesh, [R, S1]), None, None, 2.0, False)
    assert out.placements == (S0, S2)
    np.testing.assert_allclose(out.full_tensor().asnumpy(), table[ids])
    with pytest.raises(NotImplementedError, match="max_norm"):
        _embedding(ms.Tensor(ids), distribute_tensor(ms.Tensor(table), mesh, [R, S1]), None, 1.0, 2.0, False)
    with pytest.raises(NotImplementedError, match="max_norm"):     # replicas would renormalise different rows
        _embedding(sharded_ids, distribute_tensor(ms.Tensor(table), mesh, [R, R]), None, 1.0, 2.0, False)
    with pytest.raises(NotImplementedError, match="scale_grad_by_freq"):
        _embedding(ms.Tensor(ids), distribute_tensor(ms.Tensor(table), mesh, [S0, R]), None, None, 2.0, True)
    with pytest.raises(NotImplementedError, match="scale_grad_by_freq"):
        _embedding(sharded_ids, distribute_tensor(ms.Tensor(table), mesh, [R, R]), None, None, 2.0, True)


def _swiglu_cpu(x, dim):
    """One device's ``ops.swiglu`` (its kernel is Ascend-only): silu of the first half of ``dim``
    times the second."""
    a, b = ops.split(x, x.shape[dim] // 2, dim)
    return a * ops.sigmoid(a) * b


def _rope_cpu(x, cos, sin, mode):
    """One device's ``ops.rotary_position_embedding`` (Ascend-only): ``x * cos + rotated(x) * sin``,
    rotating halves (mode 0) or neighbouring pairs (mode 1) of the last dim."""
    if mode == 0:
        first, second = ops.split(x, x.shape[-1] // 2, -1)
        rotated = ops.cat((-second, first), -1)
    else:
        pairs = x.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
        rotated = ops.stack((-pairs[..., 1], pairs[..., 0]), -1).reshape(x.shape)
    return x * cos + rotated * sin


_swiglu = _on_dtensors("Swiglu", _swiglu_cpu)
_rope = _on_dtensors("RotaryPositionEmbedding", _rope_cpu)


@multi_rank(4)
def test_swiglu_and_rotary_position_embedding_rules_cpu_twins():
    """``Swiglu`` keeps every dim's sharding but the split one; ``RotaryPositionEmbedding`` is
    element-wise with broadcasting but for the rotated last dim: values, placements and gradients of
    every input against one device."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = _rand(4, 6, 8)
    check_op(mesh, lambda t: _swiglu(t, -1), [x], [[S0, S2]], [S0, R])     # the split dim gathered
    check_op(mesh, lambda t: _swiglu(t, 1), [x], [[P, S2]], [R, S2])       # Partial reduced first
    q = _rand(2, 4, 6, 8, seed=1)                                            # (batch, heads, seq, head_dim)
    cos, sin = _rand(1, 1, 6, 8, seed=2), _rand(1, 1, 6, 8, seed=3)
    for mode in (0, 1):
        def rope(t, c, s, mode=mode):
            return _rope(t, c, s, mode)
        # heads and sequence sharded: cos / sin brought to the sequence's pieces, no gather of q
        check_op(mesh, rope, [q, cos, sin], [[S1, S2], [R, R], [R, R]], [S1, S2])
        # the rotated dim is gathered, batch sharding kept
        check_op(mesh, rope, [q, cos, sin], [[S0, Shard(3)], [R, R], [R, Shard(3)]], [S0, R])


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


def _func_dropout_ext_cpu(x, p, training, inplace, seed, offset):
    return ops.Dropout(1.0 - p, 0, int(seed.asnumpy()) % 2 ** 31 + int(offset.asnumpy()))(x)[0]


@multi_rank(2)
def test_mint_dropout_rule_cpu_twin():
    """``FuncDropoutExt`` (Ascend-only kernel) with a CPU dropout standing in for it (its mask a
    function of the seed and offset tensors): the pieces are the whole tensor's draw."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    kernel = _on_dtensors("FuncDropoutExt", _func_dropout_ext_cpu)
    seed, offset = ms.Tensor(11, ms.int64), ms.Tensor(4, ms.int64)
    x = _rand(8, 6)
    want = _func_dropout_ext_cpu(ms.Tensor(x), 0.5, True, False, seed, offset).asnumpy()
    for placement in (R, S0, S1):
        y = kernel(distribute_tensor(ms.Tensor(x), mesh, [placement]), 0.5, True, False, seed, offset)
        assert y.placements == (placement,)
        np.testing.assert_array_equal(y.full_tensor().asnumpy(), want)


class _ConvNet(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, pad_mode="same", has_bias=True)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 6, (3, 2), stride=2, pad_mode="pad", padding=(1, 0, 1, 1), dilation=1)
        self.bn2 = nn.BatchNorm2d(6)
        self.fc = nn.Dense(6, 5)

    def construct(self, x):
        h = ops.relu(self.bn1(self.conv1(x)))
        h = ops.relu(self.bn2(self.conv2(h)))
        return self.fc(h.mean(axis=(2, 3)))


@multi_rank(2)
def test_a_conv_net_with_batch_norm_trains_as_one_device_under_shard_module():
    import hyper_parallel_ms as hp
    from hyper_parallel_ms.nn import ShardingPlan, shard_module
    from hyper_parallel_ms.placement import Replicate, Shard
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    rank = mesh.get_local_rank(0)
    x = ms.Tensor(np.random.default_rng(0).standard_normal((4, 3, 7, 7)).astype(np.float32))
    # data parallel (HyperParallel's input plan: the batch sharded), and the first conv's output channels
    # sharded (weight rows, output dim 1; the batch norm, whose moving averages are replicated, gathers the
    # channels: an update of a redistributed copy would be lost)
    for plan, local in ((ShardingPlan(input_plan={"input": (Shard(0),)}), True),
                        (ShardingPlan(plan={"conv1.weight": (Shard(0),), "conv1.bias": (Shard(0),)},
                                      input_plan={"input": (Replicate(),)}), False),
                        # ... and the batch norm's parameters and moving averages cut alike: updated in place
                        (ShardingPlan(plan={"conv1.weight": (Shard(0),), "conv1.bias": (Shard(0),),
                                            **{f"bn1.{n}": (Shard(0),) for n in
                                               ("gamma", "beta", "moving_mean", "moving_variance")}},
                                      input_plan={"input": (Replicate(),)}), False),
                        # only the batch norm's parameters cut: its input is cut to follow them
                        (ShardingPlan(plan={f"bn1.{n}": (Shard(0),) for n in
                                            ("gamma", "beta", "moving_mean", "moving_variance")},
                                      input_plan={"input": (Replicate(),)}), False)):
        ms.set_seed(0)
        ref = _ConvNet()
        ms.set_seed(0)
        par = shard_module(_ConvNet(), mesh, plan)
        ref.set_train(True)
        par.set_train(True)                      # batch statistics: the whole batch's, as one device
        ref_opt, opt = nn.SGD(ref.trainable_params(), 0.1), nn.SGD(par.trainable_params(), 0.1)
        feed = x[rank * 2:(rank + 1) * 2] if local else x
        for step in range(2):
            loss, want = ms.value_and_grad(lambda t: (ref(t) ** 2).mean(), None, ref.trainable_params())(x)
            p_loss, grads = hp.value_and_grad(lambda t: (par(t) ** 2).mean(), None, par.trainable_params())(feed)
            np.testing.assert_allclose(p_loss.full_tensor().asnumpy(), loss.asnumpy(), rtol=1e-5)
            for p, g, w in zip(par.trainable_params(), grads, want):
                np.testing.assert_allclose(g.full_tensor().asnumpy(), w.asnumpy(), rtol=1e-4, atol=1e-6,
                                           err_msg=f"step {step} {p.name}")
            ref_opt(want)
            opt(tuple(g.to_local() for g in grads))
        for (name, p), r in zip(par.parameters_and_names(), ref.get_parameters()):
            np.testing.assert_allclose(p.full_tensor().asnumpy(), r.asnumpy(), rtol=1e-4, atol=1e-6, err_msg=name)
        ref.set_train(False)
        par.set_train(False)                     # moving statistics: equal, so inference agrees too
        out = par(feed)
        np.testing.assert_allclose(out.full_tensor().asnumpy(), ref(x).asnumpy(), rtol=1e-5, atol=1e-6)
