"""Parallel styles on real Cells against the single-device model: loss, gathered gradients
and parameters after 5 optimizer steps (nn.SGD and nn.AdamWeightDecay), on meshes (2,),
(4,) and (2, 2) = dp x tp."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                  parallelize_module)
from hyper_parallel_ms.placement import Replicate, Shard
from hyper_parallel_ms.testing import multi_rank

from tests._parity import check_parity


class MLP(nn.Cell):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.up = nn.Dense(dim, hidden)
        self.down = nn.Dense(hidden, dim)

    def construct(self, x):
        return self.down(ops.relu(self.up(x)))


def _data(seed, *shape):
    return ms.Tensor(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _mlp_batch(dp_index, dp_size, step):
    x = _data(10 + step, 4, 3, 8)
    rows = 4 // dp_size
    return (x[dp_index * rows:(dp_index + 1) * rows],)


def _square_loss(model, x):
    return (model(x) ** 2).mean()


def _mlp_plan(model, mesh):
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@multi_rank(2)
def test_mlp_colwise_rowwise_on_2_ranks(optimizer):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    check_parity(MLP, lambda m: _mlp_plan(m, mesh), _mlp_batch, _square_loss, optimizer=optimizer)


class Attention(nn.Cell):
    """Multi-head self-attention; heads are split across ranks by Colwise q / k / v."""

    def __init__(self, dim: int = 8, heads: int = 4) -> None:
        super().__init__()
        self.q = nn.Dense(dim, dim)
        self.k = nn.Dense(dim, dim)
        self.v = nn.Dense(dim, dim)
        self.o = nn.Dense(dim, dim)
        self.head_dim = dim // heads
        self.scale = 1.0 / float(np.sqrt(dim // heads))

    def construct(self, x):
        b, s = x.shape[0], x.shape[1]
        q = self.q(x).reshape(b, s, -1, self.head_dim).transpose(0, 2, 1, 3)
        k = self.k(x).reshape(b, s, -1, self.head_dim).transpose(0, 2, 1, 3)
        v = self.v(x).reshape(b, s, -1, self.head_dim).transpose(0, 2, 1, 3)
        att = ops.softmax(ops.matmul(q, k.transpose(0, 1, 3, 2)) * self.scale, -1)
        out = ops.matmul(att, v).transpose(0, 2, 1, 3).reshape(b, s, -1)
        return self.o(out)


def _attention_plan(model, mesh):
    parallelize_module(model, mesh, {"[qkv]": ColwiseParallel(), "o": RowwiseParallel()})


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@multi_rank(2)
def test_attention_heads_split_on_2_ranks(optimizer):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    check_parity(Attention, lambda m: _attention_plan(m, mesh), _mlp_batch, _square_loss, optimizer=optimizer)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@multi_rank(4)
def test_mlp_and_attention_on_4_ranks(optimizer):
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    check_parity(MLP, lambda m: _mlp_plan(m, mesh), _mlp_batch, _square_loss, optimizer=optimizer)
    check_parity(Attention, lambda m: _attention_plan(m, mesh), _mlp_batch, _square_loss, optimizer=optimizer)


class EmbedHead(nn.Cell):
    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Dense(dim, vocab, has_bias=False)

    def construct(self, ids):
        return self.head(self.embed(ids))


def _tokens(dp_index, dp_size, step):
    rng = np.random.default_rng(20 + step)
    ids = rng.integers(0, 16, (4, 6)).astype(np.int32)
    labels = rng.integers(0, 16, (4, 6)).astype(np.int32)
    rows = 4 // dp_size
    part = slice(dp_index * rows, (dp_index + 1) * rows)
    return ms.Tensor(ids[part]), ms.Tensor(np.eye(16, dtype=np.float32)[labels[part]])


def _nll(model, ids, onehot):
    return -(ops.log_softmax(model(ids), -1) * onehot).sum(-1).mean()


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@multi_rank(2)
def test_embedding_rowwise_and_colwise_with_head(optimizer):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    # a row-sharded table (masked lookup, reduced) and a head split by vocab, gathered for the loss
    check_parity(EmbedHead, lambda m: parallelize_module(m, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate())}), _tokens, _nll, optimizer=optimizer)
    # a column-sharded table feeding a row-parallel head
    check_parity(EmbedHead, lambda m: parallelize_module(m, mesh, {
        "embed": ColwiseParallel(), "head": RowwiseParallel()}), _tokens, _nll, optimizer=optimizer)


class Block(nn.Cell):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm((dim,))
        self.attn = Attention(dim)
        self.mlp_norm = nn.LayerNorm((dim,))
        self.mlp = MLP(dim, 2 * dim)

    def construct(self, x):
        h = x + self.attn(self.attn_norm(x))
        return h + self.mlp(self.mlp_norm(h))


class Transformer(nn.Cell):
    def __init__(self, vocab: int = 16, dim: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.CellList([Block(dim) for _ in range(layers)])
        self.norm = nn.LayerNorm((dim,))
        self.head = nn.Dense(dim, vocab, has_bias=False)

    def construct(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def transformer_plan(mesh) -> dict:
    """Tensor parallel with sequence parallel between the blocks (PyTorch's Llama plan)."""
    seq, rep = Shard(1), Replicate()
    return {
        "embed": RowwiseParallel(input_layouts=rep, output_layouts=seq),
        "layers.*": {
            "attn_norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(rep,)),
            "attn.[qkv]": ColwiseParallel(),
            "attn.o": RowwiseParallel(output_layouts=seq),
            "mlp_norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(rep,)),
            "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(output_layouts=seq),
        },
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=seq, output_layouts=rep),
    }


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@multi_rank(2)
def test_transformer_with_sequence_parallel_on_2_ranks(optimizer):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    check_parity(Transformer, lambda m: parallelize_module(m, mesh, transformer_plan(mesh)), _tokens, _nll,
                 optimizer=optimizer)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@multi_rank(4)
def test_dp_x_tp_on_2x2_mesh(optimizer):
    """Tensor parallel over "tp", batches split over "dp", gradients averaged over "dp"."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_coordinate()[0]
    check_parity(MLP, lambda m: _mlp_plan(m, mesh["tp"]), _mlp_batch, _square_loss, optimizer=optimizer,
                 dp_mesh=mesh, dp_dim="dp", dp_index=dp, dp_size=2)
    check_parity(Transformer, lambda m: parallelize_module(m, mesh["tp"], transformer_plan(mesh["tp"])), _tokens,
                 _nll, optimizer=optimizer, dp_mesh=mesh, dp_dim="dp", dp_index=dp, dp_size=2)
