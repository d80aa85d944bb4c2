"""Dropout under tensor and sequence parallelism against one device with the same seed: a
replicated activation gets the same mask on every rank, a sharded one its piece of the single
device's mask; loss per step and parameters after 3 AdamW steps (tests/_parity.py's rule), on 2
and 4 ranks, PyNative and ms.jit, through styled dropout Cells (SequenceParallel) and through
the DTensor rule; the refusals (dropout inside a SequenceParallel Cell, an unseeded nn.Dropout,
the Dropout primitive on Ascend)."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.testing import multi_rank

from tests._parity import check_parity


class DropoutMLP(nn.Cell):
    """Dropout on a replicated input, on the features between a Colwise and a Rowwise layer,
    and on the sequence-sharded output of the Rowwise layer."""

    def __init__(self) -> None:
        super().__init__()
        self.in_drop = nn.Dropout(p=0.1)
        self.up = nn.Dense(8, 16)
        self.act_drop = nn.Dropout(p=0.3)
        self.down = nn.Dense(16, 8, has_bias=False)
        self.out_drop = nn.Dropout(p=0.2)
        self.norm = nn.LayerNorm((8,))
        self.head = nn.Dense(8, 4)

    def construct(self, x):
        h = self.act_drop(ops.relu(self.up(self.in_drop(x))))
        return self.head(self.norm(self.out_drop(self.down(h))))


def _model():
    return DropoutMLP().set_train()


def _batch(dp_index, dp_size, step):
    rng = np.random.default_rng(100 + step)
    return (ms.Tensor(rng.standard_normal((2, 8, 8)).astype(np.float32)),
            ms.Tensor(rng.standard_normal((2, 8, 4)).astype(np.float32)))


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _local_plan(mesh, feature_dim: int = -1):
    """Every activation a local piece (the plan that compiles): the dropout Cells on pieces are styled
    (the features between the Colwise and the Rowwise layer as ``sequence_dim=feature_dim``: -1 or 2)."""
    from hyper_parallel_ms.nn import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
    from hyper_parallel_ms.placement import Replicate, Shard

    def apply(model):
        parallelize_module(model, mesh, {
            "up": ColwiseParallel(),
            "act_drop": SequenceParallel(sequence_dim=feature_dim, use_local_output=True),
            "down": RowwiseParallel(output_layouts=Shard(1)),
            "out_drop": SequenceParallel(use_local_output=True),
            "norm": SequenceParallel(use_local_output=True),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })
    return apply


def _dtensor_plan(mesh):
    """PyNative with DTensor activations: the unstyled dropout Cells meet DTensors (the op rule)."""
    from hyper_parallel_ms.nn import ColwiseParallel, RowwiseParallel, parallelize_module
    from hyper_parallel_ms.placement import Replicate, Shard

    def apply(model):
        parallelize_module(model, mesh, {
            "up": ColwiseParallel(use_local_output=False),
            "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "head": ColwiseParallel(output_layouts=Replicate()),
        })
    return apply


@pytest.mark.parametrize("jit", [False, True])
@multi_rank(2)
def test_dropout_model_matches_one_device_on_2_ranks(jit):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    check_parity(_model, _local_plan(mesh), _batch, _loss, optimizer="adamw", jit=jit)
    if not jit:
        check_parity(_model, _dtensor_plan(mesh), _batch, _loss, optimizer="adamw")


@multi_rank(4, timeout=600)
def test_dropout_model_matches_one_device_on_4_ranks():
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    for jit in (False, True):        # the last dim named from the front (it was refused as "no feature dim after it")
        check_parity(_model, _local_plan(mesh, feature_dim=2), _batch, _loss, optimizer="adamw", jit=jit)


def _pieces(dt):
    """The whole tensor from the DTensor's pieces."""
    return dt.full_tensor().asnumpy()


@multi_rank(2)
def test_masks_are_pieces_of_the_one_device_mask():
    """ops.dropout and a reused nn.Dropout on R / S(0) / S(1) / Partial DTensors of a (2,) mesh:
    the whole of the pieces is the one-device result for the same seed, call after call."""
    from hyper_parallel_ms.dtensor import DTensor, distribute_tensor
    from hyper_parallel_ms.placement import Partial, Replicate, Shard
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = np.random.default_rng(1).standard_normal((6, 8)).astype(np.float32)
    for placement in (Replicate(), Shard(0), Shard(1)):
        ms.set_seed(7)
        one = [ops.dropout(ms.Tensor(x), p=0.4).asnumpy() for _ in range(2)]
        cell = nn.Dropout(p=0.4).set_train()
        one_cell = [cell(ms.Tensor(x)).asnumpy() for _ in range(2)]
        ms.set_seed(7)
        dt = distribute_tensor(ms.Tensor(x), mesh, [placement])
        got = [ops.dropout(dt, p=0.4) for _ in range(2)]
        cell = nn.Dropout(p=0.4).set_train()
        got_cell = [cell(dt) for _ in range(2)]
        for want, y in zip(one + one_cell, got + got_cell):
            assert y.placements == (placement,)
            np.testing.assert_array_equal(_pieces(y), want)
        assert not np.array_equal(one_cell[0], one_cell[1])            # the Cell's stream goes on
    from hyper_parallel_ms.ops import propagator
    decided = len(propagator._decisions)                                # pylint: disable=protected-access
    for _ in range(3):                                                  # new seeds each call, one decision
        ops.dropout(dt, p=0.4)
    assert len(propagator._decisions) == decided                        # pylint: disable=protected-access
    ms.set_seed(7)
    want = ops.dropout(ms.Tensor(2 * x), p=0.4).asnumpy()
    ms.set_seed(7)
    partial = ops.dropout(DTensor.from_local(ms.Tensor(x), mesh, [Partial()]), p=0.4)
    assert partial.placements == (Replicate(),)                         # the sum is dropped, not its parts
    np.testing.assert_array_equal(partial.to_local().asnumpy(), want)

    def loss(local):
        return (ops.dropout(DTensor.from_local(local, mesh, [Shard(1)], shape=(6, 8)), p=0.5).to_local() * 5.0).sum()
    ms.set_seed(3)
    grad = ms.grad(loss)(distribute_tensor(ms.Tensor(x), mesh, [Shard(1)]).to_local()).asnumpy()
    ms.set_seed(3)
    want = ms.grad(lambda t: (ops.dropout(t, p=0.5) * 5.0).sum())(ms.Tensor(x)).asnumpy()
    np.testing.assert_array_equal(grad, want[:, 4 * mesh.get_coordinate()[0]:][:, :4])


@multi_rank(2)
def test_unseeded_dropout_agrees_across_ranks():
    """A Dropout primitive without seeds (its kernel would pick one per process): replicas draw
    the same mask, and sharded pieces are rows of one mask (not one piece's mask on every rank)."""
    from hyper_parallel_ms.comm import all_reduce
    from hyper_parallel_ms.dtensor import distribute_tensor
    from hyper_parallel_ms.placement import Replicate, Shard
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ones = ms.Tensor(np.ones((8, 64), np.float32))
    local = ops.Dropout(0.5, 0, 0)(distribute_tensor(ones, mesh, [Replicate()]))[0].to_local()
    np.testing.assert_array_equal(all_reduce(local, mesh, 0).asnumpy(), 2 * local.asnumpy())
    whole = ops.Dropout(0.5, 0, 0)(distribute_tensor(ones, mesh, [Shard(0)]))[0].full_tensor().asnumpy()
    assert not np.array_equal(whole[:4], whole[4:])


@multi_rank(2)
def test_refusals():
    from hyper_parallel_ms.dtensor import distribute_tensor
    from hyper_parallel_ms.nn import SequenceParallel, parallelize_module
    from hyper_parallel_ms.ops._rules import random as random_rules
    from hyper_parallel_ms.placement import Shard
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))

    class NormDrop(nn.Cell):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm((8,))
            self.drop = nn.Dropout(p=0.1)

        def construct(self, x):
            return self.drop(self.norm(x))
    ms.set_seed(1)
    block = NormDrop()
    with pytest.raises(ValueError, match=r"dropout Cells \['drop'\] inside it"):
        parallelize_module(block, mesh, SequenceParallel())
    assert type(block.drop) is nn.Dropout and type(block) is NormDrop    # nothing changed
    parallelize_module(block, mesh, {"norm": SequenceParallel(), "drop": SequenceParallel()})

    unseeded = NormDrop()
    unseeded.drop.dropout = ops.Dropout(0.9, 0, 0)       # as built before any ms.set_seed
    with pytest.raises(ValueError, match="'drop'.* before any ms.set_seed"):
        parallelize_module(unseeded, mesh, {"norm": SequenceParallel()})     # unstyled, but in the model
    assert type(unseeded.norm) is nn.LayerNorm

    original = random_rules.seeds_ignored
    random_rules.seeds_ignored = lambda: True            # Ascend: the Dropout primitive ignores seeds
    try:
        with pytest.raises(NotImplementedError, match="mint.nn.Dropout"):
            parallelize_module(nn.Dropout(p=0.1), mesh, SequenceParallel())
        with pytest.raises(NotImplementedError, match="ignores its seeds on Ascend"):
            ops.dropout(distribute_tensor(ms.Tensor(np.ones((4, 4), np.float32)), mesh, [Shard(0)]), p=0.5)
    finally:
        random_rules.seeds_ignored = original
