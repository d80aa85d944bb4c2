"""ShardingPlan + shard_module and distribute_module (the DTensor path for Cells)."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, nn, ops

from hyper_parallel_ms.dtensor import DTensor, distribute_tensor
from hyper_parallel_ms.layout import Layout
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import ShardingPlan, distribute_module, shard_module
from hyper_parallel_ms.placement import Partial, Replicate, Shard
from hyper_parallel_ms.testing import multi_rank

R, S0, S1 = Replicate(), Shard(0), Shard(1)


class SeedNet(nn.Cell):
    """relu, then a matmul with the parameter ``weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = Parameter(ms.Tensor(np.random.default_rng(3).standard_normal((8, 6)).astype(np.float32)),
                                name="weight")
        self.relu = nn.ReLU()

    def construct(self, x):
        return ops.matmul(self.relu(x), self.weight)


def _x():
    return ms.Tensor(np.random.default_rng(4).standard_normal((4, 8)).astype(np.float32))


def _reference():
    net = SeedNet()
    return ops.matmul(ops.relu(_x()), net.weight).asnumpy()


@pytest.mark.parametrize("return_local", [False, True])
@multi_rank(4)
def test_seed_example_on_2d_mesh(return_local):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = ShardingPlan(
        plan={"weight": (R, S0)},                                # rows of the weight over tp
        input_plan={"input": (S0, R), "relu.input": (S0, S1)},   # batch over dp; relu on feature shards
        output_plan={"relu.output": (S0, S1), "output": (S0, R)},
        return_local_tensor=[""] if return_local else [])
    net = shard_module(SeedNet(), mesh, plan)
    assert isinstance(net.weight, DTensor) and net.weight.placements == (R, S0)
    seen = {}

    def record(cell, args, output):
        seen["relu"] = (args[0].placements, output.placements)
    net.relu.register_forward_hook(record)
    dp = mesh.get_coordinate()[0]
    out = net(_x()[2 * dp:2 * dp + 2])            # a plain input is this rank's piece: its dp rows
    assert seen["relu"] == ((S0, S1), (S0, S1))
    want = _reference()
    if return_local:
        assert not isinstance(out, DTensor)
        np.testing.assert_allclose(out.asnumpy(), want[2 * dp:2 * dp + 2], rtol=1e-5, atol=1e-5)
    else:
        assert isinstance(out, DTensor) and out.placements == (S0, R)
        np.testing.assert_allclose(out.full_tensor().asnumpy(), want, rtol=1e-5, atol=1e-5)


class MatmulRelu(nn.Cell):
    """The seed's ShardingPlan example model: a matmul with ``weight`` (in, out), then relu."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = Parameter(ms.Tensor(np.random.default_rng(5).standard_normal((8, 6)).astype(np.float32)),
                                name="weight")
        self.relu = nn.ReLU()

    def construct(self, x):
        return self.relu(ops.matmul(x, self.weight))


@pytest.mark.parametrize("root_local", [False, True])
@multi_rank(4)
def test_plain_inputs_are_local_pieces_and_local_outputs_are_not_cut_again(root_local):
    """Every rank feeds its dp rows; ``relu`` returns a local tensor that the root's output plan
    reads as this rank's piece: each rank gets its dp rows of the single-device output."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = ShardingPlan(plan={"weight": (R, S1)},
                        input_plan={"input": (S0, R), "relu.input": (S0, R)},
                        output_plan={"output": (S0, R), "relu.output": (S0, R)},
                        return_local_tensor=["relu", ""] if root_local else ["relu"])
    ref = MatmulRelu()
    net = shard_module(MatmulRelu(), mesh, plan)
    seen = {}

    def record(cell, args, output):
        seen["relu"] = output
    net.relu.register_forward_hook(record)
    dp = mesh.get_coordinate()[0]
    x = _x()
    out = net(x[2 * dp:2 * dp + 2])
    assert not isinstance(seen["relu"], DTensor)
    want = ref(x).asnumpy()[2 * dp:2 * dp + 2]
    if root_local:
        assert not isinstance(out, DTensor)
    else:
        assert isinstance(out, DTensor) and out.placements == (S0, R) and tuple(out.shape) == (4, 6)
        out = out.to_local()
    np.testing.assert_allclose(out.asnumpy(), want, rtol=1e-5, atol=1e-5)


class KeywordNet(nn.Cell):
    """HyperParallel's input-plan example: positional and keyword arguments."""

    def construct(self, x, y, z, scale=None):
        out = (x + y) * z
        return out if scale is None else out * scale


@multi_rank(4)
def test_input_plan_by_argument_name_reaches_keyword_arguments():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rng = np.random.default_rng(6)
    x, y, z, scale = (rng.standard_normal((4, 4)).astype(np.float32) for _ in range(4))
    net = shard_module(KeywordNet(), mesh, ShardingPlan(
        input_plan={"input": {"x": (S0, S1), "z": (S0, S1), "scale": (S0, S1)}}))   # y: as given

    def whole(a):
        return distribute_tensor(ms.Tensor(a), mesh, (R, R))
    out = net(whole(x), whole(y), z=whole(z), scale=whole(scale))
    assert isinstance(out, DTensor) and out.placements == (S0, S1), out.placements
    np.testing.assert_allclose(out.full_tensor().asnumpy(), (x + y) * z * scale, rtol=1e-6)
    out = net(whole(x), whole(y), whole(z))                   # z given positionally: converted by its name
    assert out.placements == (S0, S1) and np.allclose(out.full_tensor().asnumpy(), (x + y) * z)
    with pytest.raises(ValueError, match=r"'w' is not an argument of KeywordNet.construct"):
        shard_module(KeywordNet(), mesh, ShardingPlan(input_plan={"input": {"w": (R, R)}}))


@multi_rank(2)
def test_seed_example_on_1d_mesh_with_alias_layouts_and_training():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    plan = ShardingPlan(plan={"weight": ("tp", "None")}, input_plan={"input": (R,), "relu.input": ("None", "tp")},
                        output_plan={"output": (R,)}, return_local_tensor=[""])
    net = shard_module(SeedNet(), mesh, plan)
    ref = SeedNet()
    assert net.weight.placements == (S0,)
    x = _x()

    def loss(model):
        def fn(x):
            return (model(x) ** 2).sum()
        return fn
    ref_opt, opt = nn.SGD(ref.trainable_params(), 0.05), nn.SGD(net.trainable_params(), 0.05)
    for _ in range(5):
        rl, rg = ms.value_and_grad(loss(ref), None, ref.trainable_params())(x)
        pl, pg = ms.value_and_grad(loss(net), None, net.trainable_params())(x)
        np.testing.assert_allclose(pl.asnumpy(), rl.asnumpy(), rtol=1e-5)
        np.testing.assert_allclose(pg[0].asnumpy(), rg[0].asnumpy()[4 * mesh.get_coordinate()[0]:][:4], rtol=1e-5,
                                   atol=1e-5)
        ref_opt(rg)
        opt(pg)
    np.testing.assert_allclose(net.weight.full_tensor().asnumpy(), ref.weight.asnumpy(), rtol=1e-5, atol=1e-5)
    # the same plan in HyperParallel's Layout(mesh_shape, alias_name), called per tensor: the same values
    layout = Layout((2,), ("tp",))
    hp = shard_module(SeedNet(), mesh, ShardingPlan(
        plan={"weight": layout("tp", "None")}, input_plan={"input": layout("None", "None"),
                                                           "relu.input": (layout("None", "tp"),)},
        output_plan={"output": (layout("None", "None"),)}, return_local_tensor=[""]))
    assert hp.weight.placements == (S0,)
    np.testing.assert_allclose(hp(x).asnumpy(), shard_module(SeedNet(), mesh, plan)(x).asnumpy(), rtol=1e-6)


class TwoLayer(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Dense(6, 8)
        self.fc2 = nn.Dense(8, 4)

    def construct(self, x):
        return self.fc2(ops.relu(self.fc1(x)))


def _shard_fc1(name, cell, mesh):
    if name == "fc1":
        cell.weight = Parameter(distribute_tensor(ms.Tensor(cell.weight.asnumpy()), mesh, [S0]), name=cell.weight.name)
        cell.bias = Parameter(distribute_tensor(ms.Tensor(cell.bias.asnumpy()), mesh, [S0]), name=cell.bias.name)


def _inputs_replicated(module, inputs, mesh):
    return tuple(distribute_tensor(x, mesh, [R], src_data_rank=None) for x in inputs)


def _outputs_full(module, output, mesh):
    return output.full_tensor()


@multi_rank(2)
def test_distribute_module_partition_hooks_and_refusals():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ms.set_seed(1)
    ref = TwoLayer()
    ms.set_seed(1)
    net = TwoLayer()
    distribute_module(net, mesh, _shard_fc1, _inputs_replicated, _outputs_full)
    assert net.fc1.weight.placements == (S0,) and net.fc2.weight.placements == (R,)   # the rest replicated
    x = ms.Tensor(np.random.default_rng(2).standard_normal((3, 6)).astype(np.float32))
    out = net(x)
    assert not isinstance(out, DTensor)
    np.testing.assert_allclose(out.asnumpy(), ref(x).asnumpy(), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="already sharded by distribute_module"):
        distribute_module(net, mesh, _shard_fc1)
    # PyTorch's deprecated two-argument input_fn / output_fn: accepted with a FutureWarning
    ms.set_seed(1)
    old_style = TwoLayer()
    with pytest.warns(FutureWarning, match=r"input_fn with two arguments.*deprecated"):
        distribute_module(old_style, mesh, _shard_fc1, lambda inputs, mesh_: _inputs_replicated(None, inputs, mesh_),
                          lambda output, mesh_: output.full_tensor())
    np.testing.assert_allclose(old_style(x).asnumpy(), out.asnumpy(), rtol=1e-6)
    # a partition_fn that fails half-way leaves the module as it was
    fresh = TwoLayer()
    before = {n: p for n, p in fresh.parameters_and_names()}

    def failing(name, cell, mesh_):
        _shard_fc1(name, cell, mesh_)
        if name == "fc2":
            raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        distribute_module(fresh, mesh, failing)
    assert {n: p for n, p in fresh.parameters_and_names()} == before
    assert not any(isinstance(p, DTensor) for _, p in fresh.parameters_and_names())
    with pytest.raises(TypeError, match="callable"):
        distribute_module(TwoLayer(), mesh, partition_fn="fc1")
    with pytest.raises(ValueError, match="cannot be Partial"):
        shard_module(TwoLayer(), mesh, ShardingPlan(plan={"fc1.weight": (Partial(),)}))


class Doubling(nn.Cell):
    """No parameters: only the plan's input / output conversions touch it."""

    def __init__(self) -> None:
        super().__init__()
        self.relu = nn.ReLU()

    def construct(self, x, z=None):
        y = self.relu(x) * 2
        return y if z is None else y * z


def _calling(net):
    def run(t):
        return net(t)
    return run


@multi_rank(2)
def test_plans_refuse_to_compile_naming_the_cause_and_none_means_no_entries():
    """A compiled graph cannot hold the DTensors an input / output plan makes: ms.jit and
    GRAPH_MODE refuse it by name, for every kind of plan (MindSpore failed with errors naming
    neither the plan nor the fix); ``None`` entries are PyTorch's spelling of no plan."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    x = _x()
    plans = {"the root Cell": [ShardingPlan(input_plan={"input": {"x": (S0,)}}),
                               ShardingPlan(input_plan={"input": (S0,)}),
                               ShardingPlan(output_plan={"output": (R,)}, return_local_tensor=[""])],
             "'relu'": [ShardingPlan(input_plan={"relu.input": (S0,)})]}
    for where, kinds in plans.items():
        for plan in kinds:
            net = shard_module(Doubling(), mesh, plan)
            eager = net(x)                                    # PyNative runs the plan
            assert isinstance(eager, (DTensor, ms.Tensor))
            with pytest.raises(RuntimeError, match=f"shard_module's input / output plan on {where} .* PyNative only"):
                ms.jit(_calling(net))(x)
            ms.set_context(mode=ms.GRAPH_MODE)
            try:
                with pytest.raises(RuntimeError, match=f"plan on {where} .*PrepareModuleInput"):
                    net(x)
            finally:
                ms.set_context(mode=ms.PYNATIVE_MODE)
    # None: no entries of that kind (PyTorch's ShardingPlan(plan, output_plan=None, return_local_tensor=None))
    net = shard_module(SeedNet(), mesh, ShardingPlan(plan={"weight": (S1,)}, input_plan=None, output_plan=None,
                                                     return_local_tensor=None))
    np.testing.assert_allclose(net(distribute_tensor(x, mesh, (R,))).full_tensor().asnumpy(), _reference(), rtol=1e-5)
    with pytest.raises(TypeError, match=r"ShardingPlan.output_plan must be a dict \(or None\), got list"):
        shard_module(SeedNet(), mesh, ShardingPlan(output_plan=[("output", (R,))]))
    before = SeedNet()
    with pytest.raises(TypeError, match=r"return_local_tensor must be a list of Cell paths .* write \['relu'\]"):
        shard_module(before, mesh, ShardingPlan(plan={"weight": (S1,)}, return_local_tensor="relu"))
    assert not isinstance(before.weight, DTensor)          # refused before any change
