"""What the three entry points share: a user's ParallelStyle with its own ``apply``, one
done-marker (a Cell cannot go through two engines), one path-matching rule."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

from hyper_parallel_ms import ParallelStyle
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import (ColwiseParallel, RowwiseParallel, ShardingPlan, parallelize_module,
                                  parameter_sharding, shard_module)
from hyper_parallel_ms.placement import Replicate, Shard
from hyper_parallel_ms.testing import multi_rank


class Block(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Dense(4, 6)
        self.down = nn.Dense(6, 4)

    def construct(self, x):
        return self.down(ops.relu(self.up(x)))


class Net(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.CellList([Block(), Block()])

    def construct(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class GatheredColwise(ParallelStyle):
    """A user's style built on a built-in one, through the ``apply`` extension point."""

    def __init__(self) -> None:
        self.seen = []

    def apply(self, module, device_mesh):
        self.seen.append((type(module).__name__, self.src_data_rank))
        return ColwiseParallel(output_layouts=Replicate()).apply(module, device_mesh)


class Halved(ParallelStyle):
    def apply(self, module, device_mesh):
        module.register_forward_hook(_halve)
        return module


def _halve(cell, args, output):
    return output * 0.5


@multi_rank(2)
def test_user_style_apply_marker_and_path_rule():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = ms.Tensor(np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32))
    ms.set_seed(0)
    ref = Net()
    ms.set_seed(0)
    net = Net()
    custom = GatheredColwise()
    parallelize_module(net, mesh, {"blocks.*.up": custom, "blocks.0": Halved(), "blocks.1.down": RowwiseParallel(input_layouts=Replicate())},
                       src_data_rank=1)
    assert custom.seen == [("Dense", 1), ("Dense", 1)]
    assert parameter_sharding(net.blocks[0].up.weight).spec.placements == (Shard(0),)
    want = ref.blocks[1](ref.blocks[0](x) * 0.5)
    np.testing.assert_allclose(net(x).asnumpy(), want.asnumpy(), rtol=1e-5, atol=1e-5)
    # a Cell goes through one engine once
    with pytest.raises(RuntimeError, match="'blocks.0.up' was already sharded by parallelize_module"):
        shard_module(net, mesh, ShardingPlan())
    other = Net()
    shard_module(other, mesh, ShardingPlan(plan={"blocks.*.up.weight": (Shard(0),)}))
    with pytest.raises(RuntimeError, match="'blocks.0.up' was already sharded by shard_module"):
        parallelize_module(other, mesh, {"blocks.0.up": ColwiseParallel()})
    # '*' matches one path segment in both engines
    with pytest.raises(ValueError, match="matches no parameter"):
        shard_module(Net(), mesh, ShardingPlan(plan={"*.weight": (Shard(0),)}))
    with pytest.warns(UserWarning, match="matches no sub-Cell"):
        parallelize_module(Net(), mesh, {"*.up": ColwiseParallel()})
    # a style that implements neither plan nor apply is refused before anything changes
    fresh = Net()
    with pytest.raises(NotImplementedError, match="neither plan"):
        parallelize_module(fresh, mesh, {"blocks.0.up": ColwiseParallel(), "blocks.1.up": ParallelStyle()})
    assert parameter_sharding(fresh.blocks[0].up.weight) is None


@multi_rank(2)
def test_plans_that_differ_between_ranks_fail_on_every_rank_by_name():
    from hyper_parallel_ms.nn import distribute_module
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rank = mesh.get_coordinate()[0]
    net = Net()
    plan = {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}
    if rank == 1:
        del plan["blocks.*.down"]                      # one rank leaves a key out
    with pytest.raises(ValueError, match="apply different plans") as info:
        parallelize_module(net, mesh, plan)
    assert ("'blocks.0.down'" if rank == 0 else "nothing (its plan is shorter)") in str(info.value)
    assert all(parameter_sharding(p) is None for p in net.trainable_params())      # nothing changed
    # a key that matches on one rank only: that rank's error is compared, not left alone
    with pytest.raises(ValueError, match="apply different plans|matches no sub-Cell"):
        parallelize_module(net, mesh, {"blocks.0.up" if rank == 0 else "blocks.0.upp": ColwiseParallel()})
    with pytest.raises(ValueError, match="first difference is entry 0, where this rank .* has 'blocks.0.up.weight'"):
        shard_module(net, mesh, ShardingPlan(plan={"blocks.0.up.weight": (Shard(rank),)}))
    assert parameter_sharding(net.blocks[0].up.weight) is None and not net.blocks[0].up.weight.__class__.__name__.startswith("Parameter_DT")
    wide = Net() if rank == 0 else Block()
    with pytest.raises(ValueError, match="apply different plans"):
        distribute_module(wide, mesh)
    # the same plan on every rank still applies
    parallelize_module(net, mesh, {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()})
    assert parameter_sharding(net.blocks[1].down.weight).spec.placements == (Shard(1),)


class Norm(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm((4,))
        self.mix = Block()

    def construct(self, x, y):
        return self.mix(self.norm(x)) + y


@multi_rank(2)
def test_misuses_that_would_compute_silently_raise():
    from hyper_parallel_ms.nn import PrepareModuleInput, SequenceParallel
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = Norm()
    parallelize_module(model, mesh, {"norm": SequenceParallel(), "mix": PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)})
    x = ms.Tensor(np.ones((2, 4, 4), np.float32))
    with pytest.raises(ValueError, match="SequenceParallel on 'norm' needs inputs with a sequence dim"):
        model(ms.Tensor(np.ones((2, 4), np.float32)), x)                  # 2-D: no sequence dim
    twice = Norm()
    parallelize_module(twice, mesh, {"": PrepareModuleInput(input_layouts=(Replicate(),),
                                                            desired_input_layouts=(Replicate(),))})
    with pytest.raises(ValueError, match="got 2 positional inputs but its PrepareModuleInput names 1"):
        twice(x, x)
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        with pytest.raises(RuntimeError, match="GRAPH_MODE cannot compile"):
            shard_module(Net(), mesh, ShardingPlan(plan={"blocks.0.up.weight": (Shard(0),)}))
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


class RankScaled(nn.Cell):
    """Each rank's output is its own multiple of the input: a Partial(max) over the ranks."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def construct(self, x):
        return x * self.factor


@pytest.mark.parametrize("jit", [False, True])
@multi_rank(2)
def test_partial_max_conversion_masks_the_gradient_as_a_single_device_max(jit):
    from hyper_parallel_ms import comm
    from hyper_parallel_ms.nn import PrepareModuleOutput
    from hyper_parallel_ms.placement import Partial
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    factors = (np.array([1.0, -2.0, 3.0], np.float32), np.array([2.0, 1.0, -1.0], np.float32))
    rank = mesh.get_coordinate()[0]
    cell = RankScaled(ms.Tensor(factors[rank]))
    parallelize_module(cell, mesh, PrepareModuleOutput(output_layouts=(Partial("max"),),
                                                       desired_output_layouts=(Replicate(),)))
    x = ms.Tensor(np.array([1.0, 1.0, 1.0], np.float32))

    def loss(v):
        return (cell(v) * ms.Tensor(np.array([1.0, 2.0, 3.0], np.float32))).sum()
    grad = ms.grad(loss)
    g = (ms.jit(grad) if jit else grad)(x)
    both = np.stack(factors)
    np.testing.assert_allclose(cell(x).asnumpy(), both.max(0), rtol=1e-6)
    winner = both.argmax(0)                         # the single-device max's gradient reaches the maximum only
    want = both[winner, np.arange(3)] * np.array([1.0, 2.0, 3.0])
    total = comm.all_reduce(g, mesh, 0).asnumpy()    # x is replicated: its gradient is the sum of the ranks' shares
    np.testing.assert_allclose(total, want, rtol=1e-6)


class KwargBlock(nn.Cell):
    def construct(self, x, scale=None):
        return x * scale


class KwargList(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.CellList([KwargBlock()])

    def construct(self, x, scale):
        for b in self.blocks:
            x = b(x, scale=scale)
        return x


@multi_rank(2)
def test_keyword_conversions_refuse_to_compile_instead_of_being_skipped():
    from hyper_parallel_ms.nn import PrepareModuleInput
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = KwargList()
    parallelize_module(model, mesh, {"blocks.0": PrepareModuleInput(
        input_kwarg_layouts={"scale": Shard(0)}, desired_input_kwarg_layouts={"scale": Replicate()},
        use_local_output=True)})
    x, scale = ms.Tensor(np.ones((4, 2), np.float32)), ms.Tensor(np.full((2, 2), 3.0, np.float32))
    assert model(x, scale).shape == (4, 2)                         # PyNative: the keyword is gathered

    def run(a, b):
        return model(a, b)
    with pytest.raises(RuntimeError, match="converts keyword inputs .* PyNative only"):
        ms.jit(run)(x, scale)
