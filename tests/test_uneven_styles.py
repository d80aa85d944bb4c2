"""Colwise / Rowwise with features, vocabulary and embedding dims not divisible by the tp
size (pieces as torch.chunk cuts them: 10 on 4 ranks is 3, 3, 3, 1; 7 is 2, 2, 2, 1), in
PyNative and inside ms.jit, against the single-device model; and the error for a sequence
length that does not divide evenly."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module,
                                  parameter_sharding)
from hyper_parallel_ms.placement import Replicate, Shard
from hyper_parallel_ms.testing import multi_rank

from tests._parity import check_parity

VOCAB, DIM, HIDDEN = 7, 10, 7


class UnevenNet(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)        # Rowwise: 7 rows
        self.wide = nn.Embedding(VOCAB, DIM)         # Colwise: 10 columns
        self.up = nn.Dense(DIM, HIDDEN)              # Colwise: 7 out features
        self.down = nn.Dense(HIDDEN, DIM)            # Rowwise: 7 in features
        self.head = nn.Dense(DIM, VOCAB)             # Colwise gathered: 7 out features

    def construct(self, ids):
        x = self.embed(ids) + self.wide(ids)
        return self.head(self.down(ops.tanh(self.up(x))))


def _plan(model, mesh):
    parallelize_module(model, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "wide": ColwiseParallel(output_layouts=Replicate()),
        "up": ColwiseParallel(),
        "down": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Replicate()),
    })


def _ids(dp_index, dp_size, step):
    return (ms.Tensor(np.random.default_rng(30 + step).integers(0, VOCAB, (2, 3)).astype(np.int32)),)


def _loss(model, ids):
    return (model(ids) ** 2).mean()


@pytest.mark.parametrize("jit", [False, True])
@multi_rank(4)
def test_uneven_features_vocabulary_and_embedding_dim_on_4_ranks(jit):
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    check_parity(UnevenNet, lambda m: _plan(m, mesh), _ids, _loss, optimizer="sgd", steps=3, jit=jit)
    model = UnevenNet()
    _plan(model, mesh)
    rank = mesh.get_coordinate()[0]
    assert tuple(model.up.weight.shape) == ((2, 2, 2, 1)[rank], DIM)          # torch.chunk pieces
    assert tuple(model.wide.embedding_table.shape) == (VOCAB, (3, 3, 3, 1)[rank])
    assert parameter_sharding(model.down.weight).spec.shape == (DIM, HIDDEN)


class Seq(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Dense(4, 4)

    def construct(self, x):
        return self.body(x)


@multi_rank(4)
def test_uneven_sequence_sharding_raises_with_the_length():
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    model = Seq()
    parallelize_module(model, mesh, {"body": PrepareModuleInput(input_layouts=(Replicate(),),
                                                                desired_input_layouts=(Shard(1),),
                                                                use_local_output=True)})
    assert model(ms.Tensor(np.ones((2, 8, 4), np.float32))).shape == (2, 2, 4)
    with pytest.raises(ValueError, match="shards dim 1 of length 7 over 4 ranks unevenly"):
        model(ms.Tensor(np.ones((2, 7, 4), np.float32)))


@multi_rank(4)
def test_a_parameter_leaving_a_rank_an_empty_piece_is_refused_before_any_change():
    from hyper_parallel_ms.nn import ShardingPlan, shard_module
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    # 6 output features over 4 ranks: torch.chunk pieces 2, 2, 2, 0; MindSpore's optimizers cannot hold
    # the empty one, so rank 3 alone would fail its first step while the others wait
    dense = nn.Dense(8, 6)
    before = [(p.name, tuple(p.shape)) for p in dense.trainable_params()]
    with pytest.raises(ValueError, match=r"'weight' of shape \(6, 8\).*empty piece \(0, 8\)"):
        parallelize_module(dense, mesh, ColwiseParallel())
    with pytest.raises(ValueError, match=r"'weight' of shape \(6, 8\).*empty piece"):
        shard_module(dense, mesh, ShardingPlan(plan={"weight": (Shard(0),)}))
    assert [(p.name, tuple(p.shape)) for p in dense.trainable_params()] == before
    parallelize_module(nn.Dense(8, 7), mesh, ColwiseParallel())      # 2, 2, 2, 1: every rank holds a piece


def test_the_empty_piece_check_sees_nested_chunks_on_every_rank():
    from hyper_parallel_ms.nn._parameter import ParameterPlacement
    # 7 rows cut over a (2, 3) mesh twice: 4, 3 and then 2, 2, 0 / 1, 1, 1: rank (0, 2) is empty, the last is not
    for rank in range(6):
        mesh = init_device_mesh("cpu", (2, 3), mesh_dim_names=("a", "b"), simulate=(6, rank))
        placement = ParameterPlacement(mesh, (Shard(0), Shard(0)))
        assert placement.empty_piece((7, 2)) == (0, 2)
        assert placement.empty_piece((6, 2)) is None
        assert ParameterPlacement(mesh, (Replicate(), Shard(1))).empty_piece((7, 2)) == (7, 0)
