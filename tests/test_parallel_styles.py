"""Parallel styles on real Cells against the single-device model: loss, gathered gradients
and parameters after 3 optimizer steps (nn.SGD and nn.AdamWeightDecay), on meshes (2,),
(4,) and (2, 2) = dp x tp."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import mint, nn, ops

from hyper_parallel_ms.dtensor import DTensor
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput,
                                  RowwiseParallel, SequenceParallel, as_dtensor, parameter_sharding,
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


def transformer_plan(mesh, defer: bool = False) -> dict:
    """Tensor parallel with sequence parallel between the blocks (PyTorch's Llama plan);
    ``defer``: the attention / MLP input gradients reduced once (``defer_colwise_grads``)."""
    seq, rep = Shard(1), Replicate()
    return {
        "embed": RowwiseParallel(input_layouts=rep, output_layouts=seq),
        "layers.*": {
            "attn_norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(rep,), defer_colwise_grads=defer),
            "attn.[qkv]": ColwiseParallel(),
            "attn.o": RowwiseParallel(output_layouts=seq),
            "mlp_norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(rep,), defer_colwise_grads=defer),
            "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(output_layouts=seq),
        },
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=seq, output_layouts=rep),
    }


@pytest.mark.parametrize("optimizer,defer", [("sgd", False), ("adamw", False), ("sgd", True), ("adamw", True)])
@multi_rank(2)
def test_transformer_with_sequence_parallel_on_2_ranks(optimizer, defer):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    check_parity(Transformer, lambda m: parallelize_module(m, mesh, transformer_plan(mesh, defer)), _tokens, _nll,
                 optimizer=optimizer)


@multi_rank(2)
def test_deferred_colwise_gradients_reduce_once_per_block_half():
    """With defer_colwise_grads the backward of a block runs one reduce-scatter per block half
    (after the sequence gather) instead of an all-reduce per Colwise layer."""
    from hyper_parallel_ms.comm import CommDebugMode
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ids, onehot = _tokens(0, 1, 0)
    counts = {}
    for defer in (False, True):
        ms.set_seed(0)
        model = Transformer()
        parallelize_module(model, mesh, transformer_plan(mesh, defer))
        grad_fn = ms.grad(lambda i, o: _nll(model, i, o), grad_position=None, weights=model.trainable_params())
        with CommDebugMode() as mode:
            grad_fn(ids, onehot)
        counts[defer] = mode.get_comm_counts()
    # per block: attention q/k/v (3) + MLP up (1) all-reduce their input gradients without deferral
    assert counts[False]["all_reduce"] - counts[True].get("all_reduce", 0) == 2 * 4, counts
    assert counts[True]["reduce_scatter"] == counts[False]["reduce_scatter"] + 2 * 2, counts


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


@multi_rank(2)
def test_transformer_trains_inside_ms_jit():
    """The same plan inside a jitted train step: hooks run precomputed plans on local tensors."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    check_parity(Transformer, lambda m: parallelize_module(m, mesh, transformer_plan(mesh)), _tokens, _nll,
                 optimizer="adamw", jit=True)


class MintMLP(nn.Cell):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.up = mint.nn.Linear(dim, hidden)
        self.down = mint.nn.Linear(hidden, dim)

    def construct(self, x):
        return self.down(ops.relu(self.up(x)))


@multi_rank(2)
def test_mint_linear_and_the_shard_dims_of_stored_weights():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    check_parity(MintMLP, lambda m: _mlp_plan(m, mesh), _mlp_batch, _square_loss, optimizer="adamw")
    # nn.Dense and mint.nn.Linear store (out, in): Colwise shards dim 0, Rowwise dim 1
    for make in (MLP, MintMLP):
        model = make()
        _mlp_plan(model, mesh)
        up, down = parameter_sharding(model.up.weight).spec, parameter_sharding(model.down.weight).spec
        assert (up.placements, up.shape, tuple(model.up.weight.shape)) == ((Shard(0),), (16, 8), (8, 8))
        assert (down.placements, down.shape, tuple(model.down.weight.shape)) == ((Shard(1),), (8, 16), (8, 8))
        assert parameter_sharding(model.up.bias).spec.placements == (Shard(0),)
        assert parameter_sharding(model.down.bias).spec.placements == (Replicate(),)
        np.testing.assert_array_equal(as_dtensor(model.up.weight).full_tensor().shape, (16, 8))
    # mint.nn.Embedding (its kernel is Ascend-only): rows or columns of `weight`
    for style, placement, local in ((RowwiseParallel(input_layouts=Replicate()), Shard(0), (5, 8)),
                                    (ColwiseParallel(), Shard(1), (10, 4))):
        table = mint.nn.Embedding(10, 8)
        parallelize_module(table, mesh, style)
        assert parameter_sharding(table.weight).spec.placements == (placement,)
        assert tuple(table.weight.shape) == local


class Scaled(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()

    def construct(self, x, scale=None):
        y = self.mlp(x)
        return y if scale is None else y * scale


@multi_rank(2)
def test_prepare_module_input_output_kwargs_and_dtensor_outputs():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rank = mesh.get_coordinate()[0]
    ms.set_seed(0)
    ref = Scaled()
    ms.set_seed(0)
    model = Scaled()
    x, scale = _data(1, 4, 3, 8), _data(2, 4, 3, 8)
    want = ref(x, scale=scale).asnumpy()
    parallelize_module(model, mesh, {
        "": PrepareModuleInputOutput(input_layouts=Shard(0), desired_input_layouts=Replicate(),
                                     input_kwarg_layouts={"scale": Shard(0)},
                                     desired_input_kwarg_layouts={"scale": Replicate()},
                                     output_layouts=Replicate(), desired_output_layouts=Shard(0)),
        "mlp.up": ColwiseParallel(use_local_output=False),
        "mlp.down": RowwiseParallel()})
    out = model(x[2 * rank:2 * rank + 2], scale=scale[2 * rank:2 * rank + 2])   # batch-sharded in and out
    assert not isinstance(out, DTensor)
    np.testing.assert_allclose(out.asnumpy(), want[2 * rank:2 * rank + 2], rtol=1e-5, atol=1e-5)
    seen = {}

    def record(cell, args, output):
        seen["up"] = output.placements if isinstance(output, DTensor) else None
    model.mlp.up.register_forward_hook(record)
    model(x[2 * rank:2 * rank + 2])
    assert seen["up"] == (Shard(2),)             # use_local_output=False: a DTensor, sharded on features
    # PrepareModuleOutput with a DTensor result
    ms.set_seed(0)
    twin = MLP()
    ms.set_seed(0)
    plain = MLP()
    parallelize_module(plain, mesh, {"": PrepareModuleOutput(output_layouts=Replicate(),
                                                             desired_output_layouts=Shard(1), use_local_output=False)})
    y = plain(x)
    assert isinstance(y, DTensor) and y.placements == (Shard(1),)
    np.testing.assert_allclose(y.full_tensor().asnumpy(), twin(x).asnumpy(), rtol=1e-6)
