"""Tied parameters (one Parameter used by two Cells: an LM head sharing the embedding table)
under every engine: tensor-parallel styles in PyNative and GRAPH_MODE against the single-device
model (loss each step, parameters after 5 AdamW steps), one parameter afterwards (same count and
names as the single-device model); conflicting placements refused with both Cells named and the
model unchanged; shard_module / distribute_module giving one DTensor parameter; fully_shard
gathering a shared parameter once in the unit holding every use and refusing two units; FSDP x TP;
checkpoints holding the shared parameter once and loading it into both uses."""
from __future__ import annotations

import os
import shutil
import tempfile

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, nn, ops
from mindspore.mint import distributed as dist

from hyper_parallel_ms import checkpoint as dcp
from hyper_parallel_ms.dtensor import DTensor, distribute_tensor
from hyper_parallel_ms.fsdp import fully_shard
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import (ColwiseParallel, RowwiseParallel, ShardingPlan, distribute_module,
                                  parallelize_module, shard_module)
from hyper_parallel_ms.nn._parameter import ParameterPlacement
from hyper_parallel_ms.nn._tied import check_tied, parameter_holders
from hyper_parallel_ms.placement import Replicate, Shard
from hyper_parallel_ms.testing import multi_rank

from tests._fsdp_models import batch, compare
from tests._parity import STEPS, gathered

VOCAB, DIM = 16, 8


class TiedLM(nn.Cell):
    """Token ids made from a float input (so the shared comparison helpers feed it), an embedding,
    a Dense, and a head whose weight is the embedding table (the usual LM tie)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mid = nn.Dense(DIM, DIM)
        self.head = nn.Dense(DIM, VOCAB, has_bias=False)
        self.head.weight = self.embed.embedding_table

    def construct(self, x):
        ids = ops.cast(ops.abs(x) * 4.0, ms.int32) % VOCAB
        return self.head(ops.tanh(self.mid(self.embed(ids))))


def _tp_plan():
    # both cut the (vocab, dim) table by rows: the embedding's rows, the head's output features
    return {"embed": RowwiseParallel(input_layouts=Replicate()), "head": ColwiseParallel(output_layouts=Replicate())}


def _tied(model) -> bool:
    return model.head.weight is model.embed.embedding_table


def _state(model):
    """What a refused call must leave as it was: classes, parameter objects and values, the tie."""
    cells = [(n, type(c)) for n, c in model.cells_and_names()]
    params = [(id(p), p.name, tuple(p.shape), p.asnumpy().tobytes()) for p in model.get_parameters()]
    return cells, params, _tied(model)


def _refused(model, call, *fragments) -> None:
    before, out = _state(model), model(batch(0)).asnumpy()
    with pytest.raises(ValueError) as info:
        call(model)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert _state(model) == before
    np.testing.assert_array_equal(model(batch(0)).asnumpy(), out)


def _tp(mesh, check_one=True):
    def shard(model):
        parallelize_module(model, mesh, _tp_plan())
        assert _tied(model) and model.head.weight.shape == (VOCAB // 2, DIM)
        assert len(model.trainable_params()) == 3            # embedding table, mid weight and bias
    return shard


def test_every_use_of_a_shared_parameter_is_found_and_disagreements_name_both():
    model = TiedLM()
    holders = parameter_holders(model)
    uses = [(path, attr) for path, _, attr in holders[id(model.embed.embedding_table)]]
    assert uses == [("embed", "embedding_table"), ("head", "weight")]
    rows, cols = ParameterPlacement(None, (Shard(0),)), ParameterPlacement(None, (Shard(1),))
    embed, head = (id(model.embed), "embedding_table"), (id(model.head), "weight")
    check_tied(holders, {embed: rows, head: rows}, "parallelize_module")      # alike: one piece
    check_tied(holders, {}, "parallelize_module")                            # whole everywhere
    for planned, text in (({embed: cols, head: rows}, "(S(1)) and (S(0))"), ({head: rows}, "left whole")):
        with pytest.raises(ValueError) as info:
            check_tied(holders, planned, "parallelize_module")
        for fragment in ("'embed.embedding_table'", "'head.weight'", text):
            assert fragment in str(info.value), (fragment, str(info.value))


def _fsdp_root(dp):
    def shard(model):
        fully_shard(model.mid, mesh=dp)
        fully_shard(model, mesh=dp)          # the unit holding both uses of the table
        assert _tied(model) and len(model.trainable_params()) == 3
    return shard


@multi_rank(2)
def test_tied_head_under_tp_shard_module_distribute_module_and_fully_shard():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    # one piece for both uses: loss each step and parameters after 5 AdamW steps as on one device
    compare(_tp(mesh), 0, 1, optimizer="adamw", make_model=TiedLM)

    # placements that disagree, or a Cell using the table whole, are refused naming both uses
    _refused(TiedLM(), lambda m: parallelize_module(m, mesh, {"embed": ColwiseParallel(),
                                                              "head": ColwiseParallel()}),
             "'embed.embedding_table'", "'head.weight'", "(S(1))", "(S(0))")
    _refused(TiedLM(), lambda m: parallelize_module(m, mesh, {"head": ColwiseParallel()}),
             "'embed.embedding_table'", "'head.weight'", "left whole")

    # shard_module: naming one use places the parameter (one DTensor); two placements are refused
    ms.set_seed(0)
    ref = TiedLM()
    ms.set_seed(0)
    model = TiedLM()
    shard_module(model, mesh, ShardingPlan(plan={"head.weight": (Shard(0),)}))
    assert _tied(model) and isinstance(model.embed.embedding_table, DTensor)
    assert model.embed.embedding_table.placements == (Shard(0),)
    assert [p.name for p in model.trainable_params()] == [p.name for p in ref.trainable_params()]
    out = model(batch(0))
    out = out.full_tensor() if isinstance(out, DTensor) else out
    np.testing.assert_allclose(out.asnumpy(), ref(batch(0)).asnumpy(), rtol=1e-5, atol=1e-5)
    _refused(TiedLM(), lambda m: shard_module(m, mesh, ShardingPlan(plan={"head.weight": (Shard(0),),
                                                                          "embed.embedding_table": (Shard(1),)})),
             "'embed.embedding_table'", "'head.weight'")

    # distribute_module: the replacement of one use reaches the other; the rest replicated once
    def rows(name, cell, mesh):
        if name == "embed":
            cell.embedding_table = Parameter(distribute_tensor(cell.embedding_table, mesh, [Shard(0)]),
                                             name=cell.embedding_table.name)
    model = TiedLM()
    distribute_module(model, mesh, rows)
    assert _tied(model) and model.head.weight.placements == (Shard(0),)
    model = TiedLM()
    distribute_module(model, mesh)
    assert _tied(model) and model.head.weight.placements == (Replicate(),)
    assert len(model.trainable_params()) == 3

    def each(name, cell, mesh):
        attr = {"embed": "embedding_table", "head": "weight"}.get(name)
        if attr is not None:
            setattr(cell, attr, Parameter(distribute_tensor(getattr(cell, attr), mesh, [Shard(0)]),
                                          name=getattr(cell, attr).name))
    _refused(TiedLM(), lambda m: distribute_module(m, mesh, each), "'embed.embedding_table'", "'head.weight'",
             "replace it once")

    # fully_shard: the unit holding both uses gathers the table once; two units are refused
    dp = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    counts = []

    compare(_fsdp_root(dp), dp.get_local_rank(0), 2, optimizer="adamw", make_model=TiedLM, loss_mesh=dp, counts=counts)
    # mid: forward and again in backward (resharded); the root keeps its gathered table for the backward
    assert counts == [{"all_gather": 3, "reduce_scatter": 2}] * STEPS, counts
    model = TiedLM()
    fully_shard(model.embed, mesh=dp)
    for unit in (model.head, model):
        before = _state(model)
        with pytest.raises(ValueError) as info:
            fully_shard(unit, mesh=dp)
        for fragment in ("'embed.embedding_table'", "fully_shard(Embedding)", "'embedding_table'", "common parent"):
            assert fragment in str(info.value), (fragment, str(info.value))
        assert _state(model) == before


class ReadTableLM(nn.Cell):
    """The functional tie (GPT-2's ``h @ wte.weight.T``): the root's forward reads the embedding's
    table itself, outside the embedding's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mid = nn.Dense(DIM, DIM)

    def construct(self, x):
        ids = ops.cast(ops.abs(x) * 4.0, ms.int32) % VOCAB
        return ops.matmul(ops.tanh(self.mid(self.embed(ids))), self.embed.embedding_table.T)


@pytest.mark.parametrize("reshard", [True, False])
@multi_rank(2)
def test_a_table_read_inside_another_units_forward_is_gathered_there(reshard):
    """The embedding its own unit, the root reading its table: the read finds the piece (the
    embedding's forward is over) and gets the full table, gathered as the embedding's forward
    gathers it (one more all-gather and reduce-scatter of that unit per step); its gradient reaches
    the piece: loss each step and parameters after 5 AdamW steps as on one device. Before, the head
    computed on this rank's rows of the table (logits of width 8 for 16, no error)."""
    dp = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))

    def shard(model):
        for unit in (model.embed, model.mid, model):
            fully_shard(unit, mesh=dp, reshard_after_forward=reshard)
        # outside every forward the attribute is what the Cell holds: this rank's piece
        assert tuple(model.embed.embedding_table.shape) == (VOCAB // 2, DIM)

    counts = []
    compare(shard, dp.get_local_rank(0), 2, optimizer="adamw", make_model=ReadTableLM, loss_mesh=dp, counts=counts)
    # embed: its forward's gather and the read's (kept to the backward: no hook of its unit frees it);
    # mid: one (False) or two (True, again in the backward); embed's backward gathers nothing (no value read)
    want = {"all_gather": 3 + reshard, "reduce_scatter": 3}
    assert counts == [want] * STEPS, counts


@multi_rank(2, timeout=600)
def test_tied_head_under_tp_in_graph_mode():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    compare(_tp(mesh), 0, 1, optimizer="adamw", make_model=TiedLM, mode="graph")
    dp = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    compare(_fsdp_root(dp), dp.get_local_rank(0), 2, optimizer="adamw", make_model=TiedLM, loss_mesh=dp,
            mode="graph")


@multi_rank(4)
def test_tied_head_under_fsdp_x_tp_and_checkpoints():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def fsdp_tp(model):
        _tp(mesh["tp"])(model)
        fully_shard(model, mesh=mesh["dp"])
        assert _tied(model) and model.head.weight.shape == (VOCAB // 4, DIM)
    compare(fsdp_tp, mesh.get_local_rank("dp"), 2, optimizer="adamw", make_model=TiedLM, loss_mesh=mesh["dp"])

    # saved once (one key), loaded into both uses, on the same layout and on one device
    out = [None] * 4
    dist.all_gather_object(out, tempfile.mkdtemp(prefix="hpms_tied_") if ms.communication.get_rank() == 0 else None)
    path = os.path.join(out[0], "tied")
    try:
        ms.set_seed(1)
        saved = TiedLM()
        fsdp_tp(saved)
        state = dcp.get_model_state_dict(saved)
        assert sorted(state) == ["embed.embedding_table", "mid.bias", "mid.weight"]
        meta = dcp.save({"model": state}, checkpoint_id=path)
        assert sorted(meta.tensors) == ["model.embed.embedding_table", "model.mid.bias", "model.mid.weight"]
        full = gathered(saved.embed.embedding_table, saved.embed.embedding_table)
        for target in ("fsdp_tp", "one device"):
            ms.set_seed(2)
            model = TiedLM()
            if target == "fsdp_tp":
                fsdp_tp(model)
            dcp.load({"model": dcp.get_model_state_dict(model)}, checkpoint_id=path)
            assert _tied(model), target
            np.testing.assert_array_equal(gathered(model.head.weight, model.head.weight), full, err_msg=target)
    finally:
        dist.barrier()
        if ms.communication.get_rank() == 0:
            shutil.rmtree(out[0], ignore_errors=True)
