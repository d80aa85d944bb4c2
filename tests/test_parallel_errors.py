"""Invalid plans and styles: each raises a clear error and leaves the Cell exactly as it was
(parameters, their values, Cell classes, hooks, attributes)."""
from __future__ import annotations

import contextlib
import io
import re

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import (ColwiseParallel, GradientReducer, MultiheadAttentionParallel, PrepareModuleInput,
                                  PrepareModuleOutput, RowwiseParallel, SequenceParallel, ShardingPlan,
                                  parallelize_module, shard_module)
from hyper_parallel_ms.nn._adapter import named_cells, own_parameters
from hyper_parallel_ms.nn._targets import near_names
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
    _attention_plans_and_foreign_reads(mesh)


class ReadsChildWeight(nn.Cell):
    """A parent whose forward uses its child's weight itself (as a tied head would)."""

    def __init__(self, use_weight: bool) -> None:
        super().__init__()
        self.fc = nn.Dense(8, 8)
        self.use_weight = use_weight

    def construct(self, x):
        y = self.fc(x).astype(self.fc.weight.dtype)        # metadata of the piece: fine
        if self.use_weight:
            y = y + ops.matmul(x, self.fc.weight.T)        # an op on the piece outside fc's forward
        return y


def _encoder_layer():
    return nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)


def _attention_plans_and_foreign_reads(mesh) -> None:
    """MultiheadAttentionParallel's refusals; a style on a Cell whose parameters another Cell's
    forward uses is refused (before any change for nn.MultiheadAttention's out_proj, else at the
    first forward, PyNative), on every rank; a plan key naming no Cell suggests by its last token."""
    x = ms.Tensor(np.ones((1, 3, 8), np.float32))
    refused = [
        (lambda: parallelize_module(nn.Dense(8, 8), mesh, MultiheadAttentionParallel()), TypeError,
         "supports mindspore.nn.MultiheadAttention"),
        (lambda: parallelize_module(nn.MultiheadAttention(6, 3), mesh, MultiheadAttentionParallel()), ValueError,
         "its 3 heads do not divide over the 2 ranks"),
        (lambda: MultiheadAttentionParallel(output_layouts="S1"), TypeError, "Shard or Replicate"),
        (lambda: parallelize_module(_encoder_layer(), mesh, {"self_attn": MultiheadAttentionParallel(),
                                                             "self_attn.out_proj": RowwiseParallel()}),
         ValueError, "two styles of the plan shard the parameters of 'self_attn.out_proj'"),
    ]
    for call, kind, fragment in refused:
        with pytest.raises(kind, match=re.escape(fragment)):
            call()
    layer = _encoder_layer()
    before = _state(layer)
    with pytest.raises(ValueError, match="MultiheadAttention 'self_attn' reads its out_proj's parameters") as info:
        parallelize_module(layer, mesh, {"self_attn.out_proj": RowwiseParallel()})
    assert "RowwiseParallel on 'self_attn.out_proj'" in str(info.value)
    assert "MultiheadAttentionParallel() to 'self_attn'" in str(info.value)
    assert _state(layer) == before
    # the same out_proj styled alone (its parent unseen): refused at the attention's first forward
    parallelize_module(layer.self_attn.out_proj, mesh, RowwiseParallel())
    with pytest.raises(ValueError, match=r"RowwiseParallel on '<root>': its parameter 'weight' holds this rank's "
                                         r"piece, but the forward of another Cell \(MultiheadAttention\)") as info:
        layer(x)
    assert "apply MultiheadAttentionParallel() to the attention Cell" in str(info.value)
    for use_weight in (False, True):
        model = ReadsChildWeight(use_weight)
        parallelize_module(model, mesh, {"fc": ColwiseParallel(output_layouts=Replicate())})
        assert isinstance(model.fc.weight, ms.Parameter) and float(ops.abs(model.fc.weight).sum()) > 0   # outside
        if use_weight:
            with pytest.raises(ValueError, match=r"ColwiseParallel on 'fc': its parameter 'weight' .* another Cell "
                                                 r"\(ReadsChildWeight\) read it and used it in the op"):
                model(x)
        else:
            assert model(x).shape == (1, 3, 8)
    # attention dropout in training is refused at the forward; the same Cell in eval mode runs
    attention = nn.MultiheadAttention(8, 2, dropout=0.1)
    parallelize_module(attention, mesh, MultiheadAttentionParallel())
    attention.set_train(True)
    with pytest.raises(ValueError, match=r"attention dropout \(dropout=0.1\) in training"):
        attention(x[0], x[0], x[0])
    attention.set_train(False)
    assert attention(x[0], x[0], x[0])[0].shape == (3, 8)
    # PyTorch's names for MindSpore's layers: linear1 -> dense1; rank 0 prints the warning once
    encoder = nn.TransformerEncoder(_encoder_layer(), 2)
    for attempt in range(2):
        with contextlib.redirect_stderr(io.StringIO()) as err, \
                pytest.warns(UserWarning, match=re.escape("near names: ['layers.*.dense1'")):
            parallelize_module(encoder, mesh, {"layers.*.linear1": ColwiseParallel()})
        printed = err.getvalue().count("plan key 'layers.*.linear1' matches no sub-Cell")
        assert printed == (1 if mesh.get_rank() == 0 and attempt == 0 else 0), (mesh.get_rank(), err.getvalue())


def test_near_names_suggest_by_the_last_token():
    names = ["layers.0", "layers.0.self_attn", "layers.0.self_attn.out_proj", "layers.0.dense1", "layers.0.dense2",
             "layers.0.norm1", "layers.1.dense1", "head"]
    assert near_names("layers.*.linear1", names)[:2] == ["layers.*.dense1", "layers.*.dense2"]
    assert near_names("layers.*.fc2", names)[0] == "layers.*.dense2"
    assert near_names("layers.*.self_attn.o_proj", names) == ["layers.*.self_attn.out_proj"]
    assert near_names("heda", names) == ["head"]
    assert near_names("layer.*.dense1", names)[0].endswith(".dense1")      # a wrong prefix: the whole path


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
