"""Invalid plans and styles: each raises a clear error and leaves the Cell exactly as it was
(parameters, their values, Cell classes, hooks, attributes)."""
from __future__ import annotations

import re

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import (ColwiseParallel, GradientReducer, PrepareModuleInput, PrepareModuleOutput,
                                  RowwiseParallel, SequenceParallel, ShardingPlan, parallelize_module, shard_module)
from hyper_parallel_ms.nn._adapter import named_cells, own_parameters
from hyper_parallel_ms.placement import Partial, Replicate, Shard
from hyper_parallel_ms.testing import multi_rank


class Model(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.up = nn.Dense(8, 16)
        self.act = nn.ReLU()
        self.down = nn.Dense(16, 8)
        self.odd = nn.Dense(8, 5)
        self.gated = nn.Dense(8, 8, activation="relu")
        self.relu = nn.ReLU()

    def construct(self, ids):
        h = self.embed(ids)
        return self.relu(self.down(self.act(self.up(h))) + self.gated(h) + self.odd(h).sum(-1, keepdims=True))


def _state(model):
    """Everything a failed call must not change."""
    out = []
    for path, cell in named_cells(model).items():
        params = tuple((n, id(p), tuple(p.shape), float(np.abs(p.asnumpy()).sum())) for n, p in
                       own_parameters(cell).items())
        hooks = tuple(len(getattr(cell, a) or ()) for a in ("_lazy_forward_pre_hook", "_lazy_forward_hook",
                                                            "_lazy_forward_pre_hook_with_kwargs")) + (
            "_hpms_construct_hooks" in vars(cell),)
        attrs = tuple(sorted((k, v) for k, v in vars(cell).items() if isinstance(v, (int, bool)) and
                             not k.startswith("_")))
        out.append((path, type(cell), params, hooks, attrs))
    return out


def _ids():
    return ms.Tensor(np.array([[1, 2, 3, 9]], np.int32))


def _cases(mesh, mesh2d):
    seq, rep = Shard(1), Replicate()
    return [
        # (description, callable, error type, message fragment)
        ("style on an unsupported Cell", lambda m: parallelize_module(m, mesh, {"act": ColwiseParallel()}),
         TypeError, "'act' is a ReLU"),
        ("rowwise on an unsupported Cell", lambda m: parallelize_module(m, mesh, {"relu": RowwiseParallel()}),
         TypeError, "supports nn.Dense"),
        ("2-D mesh to a 1-D style", lambda m: parallelize_module(m, mesh2d, {"up": ColwiseParallel()}),
         ValueError, "needs a 1-D mesh"),
        ("activation inside a row-parallel Dense", lambda m: parallelize_module(m, mesh, {
            "gated": RowwiseParallel()}), ValueError, "activation"),
        ("a later key fails: nothing applied", lambda m: parallelize_module(m, mesh, {
            "up": ColwiseParallel(), "down": RowwiseParallel(), "act": ColwiseParallel()}), TypeError,
         "'act' is a ReLU"),
        ("two styles shard one Cell", lambda m: parallelize_module(m, mesh, {
            "up": ColwiseParallel(), "u*": RowwiseParallel()}), ValueError, "two styles"),
        ("plan of a wrong type", lambda m: parallelize_module(m, mesh, "up"), TypeError,
         "ParallelStyle or a dict"),
        ("plan key not a string", lambda m: parallelize_module(m, mesh, {1: ColwiseParallel()}), TypeError,
         "dotted-path strings"),
        ("plan value not a style", lambda m: parallelize_module(m, mesh, {"up": "colwise"}), TypeError,
         "must be a ParallelStyle"),
        ("no mesh", lambda m: parallelize_module(m, None, {"up": ColwiseParallel()}), ValueError, "no mesh is current"),
        ("not a mesh", lambda m: parallelize_module(m, "tp", {"up": ColwiseParallel()}), TypeError, "DeviceMesh"),
        ("src_data_rank out of range", lambda m: parallelize_module(m, mesh, ColwiseParallel(), src_data_rank=5),
         ValueError, "src_data_rank"),
        ("row-sharded embedding without replicated ids", lambda m: parallelize_module(m, mesh, {
            "embed": RowwiseParallel()}), ValueError, "input_layouts=Replicate()"),
        ("Partial input layout", lambda m: ColwiseParallel(input_layouts=Partial()), TypeError, "Shard or Replicate"),
        ("use_local_output not a bool", lambda m: RowwiseParallel(use_local_output="yes"), TypeError, "True or False"),
        ("sequence_dim not an int", lambda m: SequenceParallel(sequence_dim="1"), TypeError, "sequence_dim"),
        ("sequence parallel over the features of a Cell that is not dropout", lambda m: parallelize_module(
            m, mesh, {"relu": SequenceParallel(sequence_dim=-1)}), ValueError, "sequence_dim=-1 is the feature dim"),
        ("input layouts of different lengths", lambda m: PrepareModuleInput(
            input_layouts=(seq, None), desired_input_layouts=(rep,)), ValueError, "same length"),
        ("keyword layouts naming different inputs", lambda m: PrepareModuleInput(
            input_kwarg_layouts={"mask": seq}, desired_input_kwarg_layouts={"bias": rep}), ValueError,
         "['bias', 'mask']"),
        ("output layouts without desired layouts", lambda m: PrepareModuleOutput(
            output_layouts=rep, desired_output_layouts=None), ValueError, "same length"),
        ("deferred gradients without a replicated input", lambda m: PrepareModuleInput(
            input_layouts=(rep,), desired_input_layouts=(seq,), defer_colwise_grads=True), ValueError,
         "brought to Replicate()"),
        ("deferred gradients with no Colwise layer inside", lambda m: parallelize_module(m, mesh, {
            "": PrepareModuleInput(input_layouts=(rep,), desired_input_layouts=(rep,), defer_colwise_grads=True),
            "down": RowwiseParallel()}), ValueError, "no ColwiseParallel layer"),
        ("input layout not a Placement", lambda m: PrepareModuleInput(
            input_layouts=("S1",), desired_input_layouts=(rep,)), TypeError, "Placement or None"),
        ("unknown parameter in a ShardingPlan", lambda m: shard_module(m, mesh, ShardingPlan(
            plan={"up.wieght": (Shard(0),)})), ValueError, "near names: ['up.weight'"),
        ("wrong placement count", lambda m: shard_module(m, mesh2d, ShardingPlan(plan={"up.weight": (Shard(0),)})),
         ValueError, "expected 2 placements"),
        ("shard dim out of range", lambda m: shard_module(m, mesh, ShardingPlan(plan={"up.weight": (Shard(2),)})),
         ValueError, "out of range"),
        ("unknown mesh dim name in an alias layout", lambda m: shard_module(m, mesh, ShardingPlan(
            plan={"up.weight": ("dp", "None")})), ValueError, "dp"),
        ("Partial parameter", lambda m: shard_module(m, mesh, ShardingPlan(plan={"up.*": (Partial(),)})),
         ValueError, "cannot be Partial"),
        ("malformed input_plan key", lambda m: shard_module(m, mesh, ShardingPlan(
            input_plan={"relu.inpt": (rep,)})), ValueError, "'<cell path>.input'"),
        ("input_plan for an unknown Cell", lambda m: shard_module(m, mesh, ShardingPlan(
            input_plan={"rleu.input": (rep,)})), ValueError, "no sub-Cell 'rleu'"),
        ("return_local_tensor naming an unknown Cell", lambda m: shard_module(m, mesh, ShardingPlan(
            return_local_tensor=["dwn"])), ValueError, "near names: ['down'"),
        ("not a ShardingPlan", lambda m: shard_module(m, mesh, {"up.weight": (Shard(0),)}), TypeError,
         "needs a ShardingPlan"),
        ("dp mesh without its dim", lambda m: GradientReducer(m.trainable_params(), dp_mesh=mesh2d), ValueError,
         "dp_mesh and dp_dim"),
        ("unknown dp dim", lambda m: GradientReducer(m.trainable_params(), dp_mesh=mesh2d, dp_dim="pp"), Exception,
         "pp"),
    ]


@multi_rank(2)
def test_invalid_plans_raise_and_leave_the_cell_unchanged():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    mesh2d = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    ms.set_seed(0)
    model = Model()
    before_state, before_out = _state(model), model(_ids()).asnumpy()
    cases = _cases(mesh, mesh2d)
    assert len(cases) >= 20
    for what, call, kind, fragment in cases:
        with pytest.raises(kind) as info:
            call(model)
        assert fragment in str(info.value), (what, str(info.value))
        assert _state(model) == before_state, what
        np.testing.assert_array_equal(model(_ids()).asnumpy(), before_out, err_msg=what)
    # as PyTorch: a key naming no sub-Cell, and no plan at all, warn and change nothing
    for plan, fragment in (({"upp": ColwiseParallel()}, "near names: ['up'"),
                           ({"layers.*": ColwiseParallel()}, "'layers.*' matches no sub-Cell"), (None, "unchanged")):
        with pytest.warns(UserWarning, match=re.escape(fragment)):
            assert parallelize_module(model, mesh, plan) is model
        assert _state(model) == before_state, plan
    with pytest.raises(ValueError, match=r"mesh_shape \(4,\) holds 4 ranks but the world has 2"):
        init_device_mesh("cpu", (4,))                      # a mesh larger than the world
    # a valid plan applies; applying it again is refused and changes nothing more
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    after = _state(model)
    with pytest.raises(RuntimeError, match="already sharded by parallelize_module"):
        parallelize_module(model, mesh, {"up": ColwiseParallel()})
    assert _state(model) == after
    assert ops.isfinite(model(_ids())).all()


@multi_rank(2)
def test_a_failure_while_applying_undoes_the_changes_already_made():
    from hyper_parallel_ms.nn._edit import InputSpec, ModuleEdit, apply_edits
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = Model()
    before = _state(model)
    good = ColwiseParallel().plan("up", model.up, mesh)            # parameters, hooks
    embed = RowwiseParallel(input_layouts=Replicate()).plan("embed", model.embed, mesh)   # class swap, attributes
    bad = ModuleEdit("down", model.down, inputs=InputSpec({0: "not a conversion"}))
    with pytest.raises(Exception):
        apply_edits([good, embed, bad], "parallelize_module")
    assert _state(model) == before
    assert type(model.embed) is nn.Embedding
