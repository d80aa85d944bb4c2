"""hyper_parallel_ms.grad / value_and_grad / parallelize_value_and_grad: DTensor gradients,
laid out like their tensors (Partial read as Replicate), against single-device gradients:
on op rules (matmul, pointwise, reductions) and on a shard_module model trained with SGD. 2 ranks."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn, ops

import hyper_parallel_ms as hp
from hyper_parallel_ms.dtensor import DTensor, distribute_tensor
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import ShardingPlan, shard_module
from hyper_parallel_ms.placement import Partial, Replicate, Shard
from hyper_parallel_ms.testing import multi_rank

_RNG = np.random.default_rng(7)
_X = _RNG.standard_normal((4, 6)).astype(np.float32)
_W = _RNG.standard_normal((6, 8)).astype(np.float32)


def _loss(x, w):
    return (ops.tanh(ops.matmul(x, w)) ** 2).sum()


def _loss_aux(x, w):
    y = ops.matmul(x, w)
    return (y * y).sum(), y


def _close(got, want, name):
    assert isinstance(got, DTensor), f"{name}: {type(got).__name__}"
    np.testing.assert_allclose(got.full_tensor().asnumpy(), want, rtol=1e-5, atol=1e-5, err_msg=name)


@multi_rank(2)
def test_grad_and_value_and_grad_on_op_rules():
    mesh = init_device_mesh("cpu", (2,))
    want_gx, want_gw = ms.grad(_loss, (0, 1))(Tensor(_X), Tensor(_W))
    for px, pw in ((Shard(0), Replicate()), (Replicate(), Shard(1)), (Shard(1), Shard(0))):
        x, w = distribute_tensor(Tensor(_X), mesh, [px]), distribute_tensor(Tensor(_W), mesh, [pw])
        gx, gw = hp.grad(_loss, (0, 1))(x, w)
        assert gx.placements == (px,) and gw.placements == (pw,)
        _close(gx, want_gx.asnumpy(), f"grad x {px} {pw}")
        _close(gw, want_gw.asnumpy(), f"grad w {px} {pw}")
        loss, gw_only = hp.value_and_grad(_loss, 1)(x, w)
        np.testing.assert_allclose(loss.full_tensor().asnumpy(), _loss(Tensor(_X), Tensor(_W)).asnumpy(), rtol=1e-5)
        _close(gw_only, want_gw.asnumpy(), "value_and_grad w")
        gx_only = hp.grad(_loss, (0,))(x, w)                     # a one-position tuple: the gradient bare, as ms.grad
        assert isinstance(gx_only, DTensor) and gx_only.placements == (px,)
        _close(gx_only, want_gx.asnumpy(), "grad (0,)")
    x = distribute_tensor(Tensor(_X), mesh, [Shard(0)])
    (gx, aux) = hp.grad(_loss_aux, 0, has_aux=True)(x, Tensor(_W))
    _close(gx, ms.grad(_loss_aux, 0, has_aux=True)(Tensor(_X), Tensor(_W))[0].asnumpy(), "has_aux")
    assert isinstance(aux[0], DTensor) and aux[0].shape == (4, 8)
    partial = DTensor.from_local(Tensor(_X), mesh, [Partial()])    # global = 2 * _X
    g = hp.grad(lambda t: (t * t).sum())(partial)
    assert g.placements == (Replicate(),)                         # Partial is read as Replicate
    np.testing.assert_allclose(g.to_local().asnumpy(), 4 * _X, rtol=1e-5)


class _Mlp(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Dense(6, 8, weight_init=Tensor(_W.T.copy()), bias_init="zeros")
        self.fc2 = nn.Dense(8, 3, weight_init=Tensor(_RNG.standard_normal((3, 8)).astype(np.float32)),
                            bias_init=Tensor(np.arange(3, dtype=np.float32)))

    def construct(self, x):
        return self.fc2(ops.relu(self.fc1(x)))


def _mse(net):
    def loss(x):
        out = net(x)
        return (out * out).mean(), out
    return loss


@multi_rank(2)
def test_shard_module_model_trains_with_dtensor_gradients():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    plan = ShardingPlan(plan={"fc1.weight": ("tp", "None"), "fc1.bias": ("tp",), "fc2.weight": ("None", "tp")})
    ref, net = _Mlp(), _Mlp()
    net.fc2.weight.set_data(ref.fc2.weight.value().copy())
    net.fc2.bias.set_data(ref.fc2.bias.value().copy())
    net = shard_module(net, mesh, plan)
    ref_opt, opt = nn.SGD(ref.trainable_params(), 0.1), nn.SGD(net.trainable_params(), 0.1)
    x = Tensor(_X)
    for step in range(3):
        want_loss, want = ms.value_and_grad(lambda t: _mse(ref)(t)[0], None, ref.trainable_params())(x)
        if step % 2 == 0:
            loss, grads = hp.value_and_grad(lambda t: _mse(net)(t)[0], None, net.trainable_params())(x)
        else:
            (loss, _), grads = hp.parallelize_value_and_grad(_mse(net), net.trainable_params(), sens=[1.0, 0.0])(x)
        np.testing.assert_allclose(loss.full_tensor().asnumpy(), want_loss.asnumpy(), rtol=1e-5)
        for p, g, w in zip(net.trainable_params(), grads, want):
            assert g.placements == p.placements, p.name
            _close(g, w.asnumpy(), f"step {step} {p.name}")
        ref_opt(want)
        opt(tuple(g.to_local() for g in grads))
    for p, r in zip(net.trainable_params(), ref.trainable_params()):
        np.testing.assert_allclose(p.full_tensor().asnumpy(), r.asnumpy(), rtol=1e-5, atol=1e-5, err_msg=p.name)


class _NormedMlp(nn.Cell):
    """MindSpore's LayerNorm reads ``self.gamma.astype(x.dtype)``: a read of a Parameter(DTensor)
    through a cast."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm((6,), gamma_init=Tensor(np.linspace(0.5, 1.5, 6).astype(np.float32)),
                                 beta_init=Tensor(np.linspace(-0.2, 0.3, 6).astype(np.float32)))
        self.mlp = _Mlp()

    def construct(self, x):
        return self.mlp(self.norm(x))


_READS = {"plain": lambda w: w, "astype": lambda w: w.astype(ms.float32), "to": lambda w: w.to(ms.float32),
          "float": lambda w: w.float(), "to_local": lambda w: DTensor.from_local(w.to_local(), w.device_mesh,
                                                                                 w.placements),
          "full_tensor": lambda w: w.full_tensor(), "redistribute": lambda w: w.redistribute(placements=[Replicate()]),
          "to_local(grad_placements)": lambda w: DTensor.from_local(w.to_local(grad_placements=w.placements),
                                                                   w.device_mesh, w.placements)}


class _Reads(nn.Cell):
    def __init__(self, w, read) -> None:
        super().__init__()
        self.w, self.read = w, read

    def construct(self, x):
        v = self.read(self.w)
        return (v * x).sum() if not isinstance(v, DTensor) else (v * x).sum().full_tensor()


@multi_rank(2)
def test_a_parameter_read_through_casts_and_local_views_keeps_its_gradient():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = Tensor(np.random.default_rng(3).standard_normal((4, 6)).astype(np.float32))
    w0 = Tensor(np.random.default_rng(4).standard_normal((4, 6)).astype(np.float32))
    for placement in (Replicate(), Shard(0), Shard(1)):
        for name, read in _READS.items():
            cell = _Reads(Parameter(distribute_tensor(w0, mesh, [placement]), name="w"), read)
            g = hp.grad(cell, None, [cell.w])(x)[0]
            np.testing.assert_allclose(g.full_tensor().asnumpy(), x.asnumpy(), rtol=1e-6,
                                       err_msg=f"{placement} {name}")     # d/dw sum(w * x) = x
    # shard_module over a model with nn.LayerNorm: gamma and beta train as on one device
    plan = ShardingPlan(plan={"mlp.fc1.weight": ("tp", "None"), "mlp.fc1.bias": ("tp",)})
    ref, net = _NormedMlp(), _NormedMlp()
    net.mlp.fc2.weight.set_data(ref.mlp.fc2.weight.value().copy())
    net.mlp.fc2.bias.set_data(ref.mlp.fc2.bias.value().copy())
    net = shard_module(net, mesh, plan)
    ref_opt, opt = nn.SGD(ref.trainable_params(), 0.1), nn.SGD(net.trainable_params(), 0.1)
    x = Tensor(_X)
    for step in range(3):
        _, want = ms.value_and_grad(lambda t: _mse(ref)(t)[0], None, ref.trainable_params())(x)
        _, grads = hp.value_and_grad(lambda t: _mse(net)(t)[0], None, net.trainable_params())(x)
        for p, g, w in zip(net.trainable_params(), grads, want):
            _close(g, w.asnumpy(), f"step {step} {p.name}")
        ref_opt(want)
        opt(tuple(g.to_local() for g in grads))
    for p, r in zip(net.trainable_params(), ref.trainable_params()):
        np.testing.assert_allclose(p.full_tensor().asnumpy(), r.asnumpy(), rtol=1e-5, atol=1e-6, err_msg=p.name)
    # a function raising inside a gradient call leaves the next one working (MindSpore kept recording:
    # "For LayerNormGrad, the index 7 is out of range of input num 7")
    with pytest.raises(ValueError, match="raised inside"):
        hp.value_and_grad(_raising(net), None, net.trainable_params())(x)
    _, again = hp.value_and_grad(lambda t: _mse(net)(t)[0], None, net.trainable_params())(x)
    _, want = ms.value_and_grad(lambda t: _mse(ref)(t)[0], None, ref.trainable_params())(x)
    for p, g, w in zip(net.trainable_params(), again, want):
        _close(g, w.asnumpy(), f"after a raise {p.name}")


def _raising(net):
    def loss(x):
        _mse(net)(x)
        raise ValueError("raised inside the differentiated function")
    return loss


@multi_rank(2)
def test_parallelize_value_and_grad_sensitivities():
    mesh = init_device_mesh("cpu", (2,))
    w = Parameter(distribute_tensor(Tensor(_W), mesh, [Shard(1)]), name="w")
    ref_w = Parameter(Tensor(_W), name="w")

    def two(weight):
        def fn(x):
            y = ops.matmul(x, weight)
            return y.sum(), (y * y).sum()
        return fn
    out, (gw,) = hp.parallelize_value_and_grad(two(w), [w], sens=[0.5, 2.0])(Tensor(_X))
    want = ms.grad(lambda x: 0.5 * two(ref_w)(x)[0] + 2.0 * two(ref_w)(x)[1], None, [ref_w])(Tensor(_X))[0]
    assert len(out) == 2 and gw.placements == (Shard(1),)
    _close(gw, want.asnumpy(), "sens")
    single, (g1,) = hp.parallelize_value_and_grad(lambda x: two(w)(x)[1], [w])(Tensor(_X))
    _close(g1, ms.grad(lambda x: two(ref_w)(x)[1], None, [ref_w])(Tensor(_X))[0].asnumpy(), "one output")
    with pytest.raises(TypeError, match="fn returned 2 outputs but sens has 1"):
        hp.parallelize_value_and_grad(two(w), [w], sens=[1.0])(Tensor(_X))
    with pytest.raises(TypeError, match="one output, so sens must be None"):
        hp.parallelize_value_and_grad(lambda x: two(w)(x)[1], [w], sens=[1.0])(Tensor(_X))


def _mean_of_squares(x):
    return (x * x).mean()


def _mean_over_dim1(x):
    return (x * x).mean(1).sum()


@multi_rank(4)
def test_a_mean_over_sharded_dims_gives_one_device_values_and_gradients_seeded_directly():
    """The mean of a loss over sharded dims, differentiated as it is (the usual loss): it was a
    Partial(avg) of the pieces' means, which MindSpore's seeding of ones on every piece turned into
    4 times the gradient on 4 ranks, and a nested uneven split ((2, 2) mesh, 6 over 4: 2, 1, 2, 1)
    averaged unequal pieces (wrong value). Now Partial(sum) of each piece's sum over the count."""
    rng = np.random.default_rng(6)
    flat, square = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
    for mesh, shape, placements in ((flat, (8, 3), [Shard(0)]), (flat, (5, 3), [Shard(0)]),
                                    (flat, (3, 6), [Shard(1)]), (square, (5, 6, 2), [Shard(1), Shard(1)]),
                                    (square, (5, 6, 2), [Shard(0), Shard(1)])):
        a = rng.standard_normal(shape).astype(np.float32)
        for fn in (_mean_of_squares, _mean_over_dim1):
            x = distribute_tensor(Tensor(a), mesh, placements)
            value = fn(x)
            np.testing.assert_allclose(value.full_tensor().asnumpy(), fn(Tensor(a)).asnumpy(), rtol=1e-5)
            _close(hp.grad(fn)(x), ms.grad(fn)(Tensor(a)).asnumpy(), f"{fn.__name__} {shape} {placements}")


def _cross_entropy(logits, target):
    return ops.cross_entropy(logits, target)


def _cross_entropy_loss_cell(logits, target):
    return nn.CrossEntropyLoss()(logits, target)


@multi_rank(2)
def test_mindspore_losses_on_dtensor_logits_equal_one_device():
    """MindSpore's losses check their arguments with ``ops.typeof``, which had no sharding rule:
    ``ops.cross_entropy`` / ``nn.CrossEntropyLoss`` on DTensor logits raised, even replicated ones.
    Replicated and batch-sharded logits now give one device's loss and gradient."""
    mesh = init_device_mesh("cpu", (2,))
    rng = np.random.default_rng(8)
    logits = rng.standard_normal((6, 5)).astype(np.float32)
    target = Tensor(rng.integers(0, 5, (6,)).astype(np.int32))
    for fn in (_cross_entropy, _cross_entropy_loss_cell):
        want = fn(Tensor(logits), target).asnumpy()
        want_grad = ms.grad(fn)(Tensor(logits), target).asnumpy()
        for placement in (Replicate(), Shard(0)):
            x = distribute_tensor(Tensor(logits), mesh, [placement])
            t = distribute_tensor(target, mesh, [placement])
            np.testing.assert_allclose(fn(x, t).full_tensor().asnumpy(), want, rtol=1e-5, err_msg=str(placement))
            _close(hp.grad(fn)(x, t), want_grad, f"{fn.__name__} {placement}")
