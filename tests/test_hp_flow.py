"""HyperParallel's own flow on a (dp, tp) mesh, against one device: a Cell built under
``no_init_parameters()``, ``shard_module`` with a parent plan and a child plan on ``relu``,
``hsdp`` over the ranks holding the same piece, ``init_parameters``, then
``parallelize_value_and_grad`` + ``nn.Adam`` on a DTensor input (4 ranks); the precedence of a
parent's ``return_local_tensor`` over a child plan; ``parallelize_value_and_grad`` refused
inside ``ms.jit``."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, nn, ops
from mindspore.common.initializer import initializer
from mindspore.nn.utils import no_init_parameters as ms_no_init_parameters

import hyper_parallel_ms as hp
from hyper_parallel_ms.dtensor import DTensor, distribute_tensor
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import ShardingPlan, parameter_sharding, shard_module
from hyper_parallel_ms.placement import Replicate, Shard
from hyper_parallel_ms.testing import multi_rank

from tests._parity import ZERO_GRAD, gathered

R, S0, S1 = Replicate(), Shard(0), Shard(1)


class MatmulReluSum(nn.Cell):
    """HyperParallel's ST model: ``matmul(x, weight) -> relu -> sum``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = Parameter(initializer("normal", (8, 4), ms.float32), name="weight")
        self.relu = nn.ReLU()

    def construct(self, x):
        return self.relu(ops.matmul(x, self.weight)).sum()


def _x(step: int):
    return ms.Tensor(np.random.default_rng(10 + step).standard_normal((8, 8)).astype(np.float32))


def _reference(context):
    """The one-device model: built eagerly (what hyper_parallel_ms.no_init_parameters() gives), or
    built under MindSpore's context and initialised by init_parameters_data() (what MindSpore's gives)."""
    ms.set_seed(0)
    if context is not ms_no_init_parameters:
        return MatmulReluSum()
    with context():
        ref = MatmulReluSum()
    ref.init_parameters_data()
    return ref


def _hp_flow(mesh, context, engine):
    ms.set_seed(0)
    with context():
        model = MatmulReluSum()
    shard_module(model, mesh, ShardingPlan(plan={"weight": (R, S0)}, input_plan={"input": (S0, S1)},
                                           output_plan={"output": (R, R)}))
    shard_module(model.relu, mesh, ShardingPlan(input_plan={"input": (S0, R)}, output_plan={"output": (S0, R)}))
    if engine == "hsdp":
        hp.hsdp(model, shard_size=2, threshold=0)        # over the 2 ranks holding the same tp piece
    else:
        hp.fully_shard(model, mesh=mesh["dp"])
    hp.init_parameters(model)
    return model


@pytest.mark.parametrize("context,engine", [("hyper_parallel_ms", "hsdp"), ("mindspore", "hsdp"),
                                            ("hyper_parallel_ms", "fully_shard")])
@multi_rank(4)
def test_shard_module_child_plan_hsdp_adam_equal_one_device(context, engine):
    context = hp.no_init_parameters if context == "hyper_parallel_ms" else ms_no_init_parameters
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref, model = _reference(context), _hp_flow(mesh, context, engine)
    (weight,) = model.trainable_params()
    # the piece: this rank's tp rows (4 of 8), halved over dp; recorded on the joint mesh
    assert tuple(weight.shape) == (2, 4) and parameter_sharding(weight).spec.shape == (8, 4)
    np.testing.assert_array_equal(gathered(weight, weight), ref.weight.asnumpy())
    ref_opt, opt = nn.Adam(ref.trainable_params(), 0.01), nn.Adam(model.trainable_params(), 0.01)
    ref_step = ms.value_and_grad(ref, None, ref.trainable_params())
    step_fn = hp.parallelize_value_and_grad(model, model.trainable_params())
    for step in range(3):
        want_loss, want_grads = ref_step(_x(step))
        assert np.abs(want_grads[0].asnumpy()).min() > ZERO_GRAD, "every element needs a gradient (Adam, _parity)"
        loss, grads = step_fn(distribute_tensor(_x(step), mesh, [S0, S1]))
        assert isinstance(loss, DTensor) and loss.placements == (R, R)
        np.testing.assert_allclose(loss.to_local().asnumpy(), want_loss.asnumpy(), rtol=1e-5, err_msg=f"loss {step}")
        np.testing.assert_allclose(gathered(weight, grads[0]), want_grads[0].asnumpy(), rtol=1e-5, atol=1e-5,
                                   err_msg=f"gradient, step {step}")
        ref_opt(want_grads)
        opt(grads)
    np.testing.assert_allclose(gathered(weight, weight), ref.weight.asnumpy(), rtol=1e-5, atol=1e-5,
                               err_msg="weight after 3 Adam steps")


class MatmulRelu(nn.Cell):
    """``relu(matmul(x, weight))``, keeping what its own code gets back from ``relu``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = Parameter(ms.Tensor(np.random.default_rng(5).standard_normal((8, 4)).astype(np.float32)),
                                name="weight")
        self.relu = nn.ReLU()
        self.seen = []

    def construct(self, x):
        h = self.relu(ops.matmul(x, self.weight))
        self.seen.append(h)
        return h


@multi_rank(4)
def test_parent_return_local_tensor_wins_over_child_plan_in_either_order():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_coordinate()[0]
    want = ops.relu(ops.matmul(_x(0), MatmulRelu().weight)).asnumpy()
    child = ShardingPlan(input_plan={"input": (S0, R)}, output_plan={"output": (S0, R)})
    for relu_output, rows in ((None, slice(4 * dp, 4 * dp + 4)), ((R, R), slice(None))):
        parent = ShardingPlan(plan={"weight": (R, S0)}, input_plan={"input": (S0, S1)},
                              output_plan={"relu.output": relu_output} if relu_output else {},
                              return_local_tensor=["relu"])
        for child_first in (False, True):
            model = MatmulRelu()
            for cell, plan in ((model.relu, child), (model, parent))[::1 if child_first else -1]:
                shard_module(cell, mesh, plan)
            out = model(distribute_tensor(_x(0), mesh, [S0, S1]))
            where = f"relu.output {relu_output}, child plan {'first' if child_first else 'second'}"
            # what the parent's code got from relu: the child's (S0, R) output, then the parent's
            # own output plan for relu, then local (its return_local_tensor)
            assert len(model.seen) == 1 and not isinstance(model.seen[0], DTensor), where
            np.testing.assert_allclose(model.seen[0].asnumpy(), want[rows], rtol=1e-5, atol=1e-5, err_msg=where)
            np.testing.assert_allclose(out.asnumpy(), want[rows], rtol=1e-5, atol=1e-5, err_msg=where)
    # a parent plan may not place again a parameter that a sub-Cell's own plan placed
    wrapped = nn.SequentialCell([MatmulRelu()])
    shard_module(wrapped[0], mesh, ShardingPlan(plan={"weight": (R, S0)}))
    with pytest.raises(ValueError, match="plan key '0.weight'.*DTensor"):
        shard_module(wrapped, mesh, ShardingPlan(plan={"0.weight": (S0, R)}))
    assert wrapped[0].weight.placements == (R, S0)


def test_parallelize_value_and_grad_refused_inside_jit():
    net = nn.Dense(3, 2)
    step_fn = hp.parallelize_value_and_grad(net, net.trainable_params())
    x = ms.Tensor(np.ones((2, 3), np.float32))

    @ms.jit
    def step(inputs):
        return step_fn(inputs)
    with pytest.raises(RuntimeError, match="parallelize_value_and_grad runs in PyNative only.*parallelize_module.*"
                                           "ms.value_and_grad inside ms.jit"):
        step(x)
    out, (gw, gb) = step_fn(x)                   # PyNative still works, and agrees with MindSpore
    want_gw, want_gb = ms.grad(lambda t: net(t).sum(), None, net.trainable_params())(x)
    np.testing.assert_allclose(out.asnumpy(), net(x).asnumpy(), rtol=1e-6)
    np.testing.assert_allclose(gw.asnumpy(), want_gw.asnumpy(), rtol=1e-6)
    np.testing.assert_allclose(gb.asnumpy(), want_gb.asnumpy(), rtol=1e-6)


@multi_rank(2)
def test_shard_module_gradients_step_mindspore_optimizers_directly():
    """HyperParallel's flow without a data-parallel engine: the gradients of
    parallelize_value_and_grad are DTensors laid out as the DTensor parameters, and an element-wise
    MindSpore optimizer (which MindSpore 2.10 compiles) steps them directly; one whose update reads a
    whole parameter's norm (Lamb) is refused, naming the argument."""
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    x = distribute_tensor(_x(0), mesh, [S0, S1])
    for make in (lambda p: nn.SGD(p, 0.1), lambda p: nn.Momentum(p, 0.1, 0.9), lambda p: nn.Adam(p, 0.01),
                 lambda p: nn.AdamWeightDecay(p, 0.01)):
        ref = _reference(hp.no_init_parameters)
        ms.set_seed(0)
        model = MatmulReluSum()
        shard_module(model, mesh, ShardingPlan(plan={"weight": (R, S0)}, input_plan={"input": (S0, S1)},
                                               output_plan={"output": (R, R)}))
        ref_opt, opt = make(ref.trainable_params()), make(model.trainable_params())
        ref_step = ms.value_and_grad(ref, None, ref.trainable_params())
        step_fn = hp.parallelize_value_and_grad(model, opt.parameters)
        for step in range(3):
            ref_opt(ref_step(_x(step))[1])
            _, grads = step_fn(distribute_tensor(_x(step), mesh, [S0, S1]))
            assert isinstance(grads[0], DTensor)
            opt(grads)
        np.testing.assert_allclose(model.weight.full_tensor().asnumpy(), ref.weight.asnumpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=type(opt).__name__)
    lamb = nn.Lamb(model.trainable_params(), 0.01)
    with pytest.raises(TypeError, match=r"argument 'gradients\[0\]' of the ms.jit function.*is a DTensor"):
        lamb(step_fn(x)[1])
