"""HyperParallel's DeepSeek sparse attention (DSA) boundary styles on the ranks of a cp mesh, against one
device: boundary Cells shaped like MindFormers' (its indexer's ``(query, key, weights)``, its sparse
attention's ``(query, key, value, topk, query_rope, key_rope)``, its indexer loss's ten arguments
returning HyperParallel's fused ``(d_query_index, d_key_index, d_weights, loss)``), computed with ops that
have sharding rules (DSA's own kernels are Ascend kernels). Each rank's outputs and the gradients of every
input are its rows of one device's; the shared replicate cache serves the loss only the very tensors the
attention gathered; the asynchronous forms start their gathers at the handoff Cells. Run by
``tests/test_context_parallel.py``'s 2-rank call."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

from hyper_parallel_ms import nn as hnn

B, S, H, D = 2, 8, 2, 4
TOL = dict(rtol=1e-5, atol=1e-5)


def _t(x, perm):
    return ops.transpose(x, perm)


def _scores(q, k):
    """[B, S, H, D] x [B, T, H, D] -> [B, H, S, T]."""
    return ops.matmul(_t(q, (0, 2, 1, 3)), _t(k, (0, 2, 3, 1)))


class Indexer(nn.Cell):
    """The lightning indexer's arithmetic: per query row, sum over heads of weight x relu(q . k)."""

    def construct(self, query, key, weights):
        relu = ops.relu(_scores(query, key))
        return (relu * ops.expand_dims(_t(weights, (0, 2, 1)), -1)).sum(1)            # [B, S, T]


class SparseAttention(nn.Cell):
    """Attention whose scores add the rope parts (MLA's absorbed form); the top-k indices pass through."""

    def construct(self, query, key, value, topk_indices, query_rope=None, key_rope=None):
        probs = ops.softmax((_scores(query, key) + _scores(query_rope, key_rope)) * 0.5, -1)
        out = _t(ops.matmul(probs, _t(value, (0, 2, 1, 3))), (0, 2, 1, 3))               # [B, S, H, D]
        return out, topk_indices + 1


class IndexerLoss(nn.Cell):
    """HyperParallel's fused form: the indexer gradients written out and a loss; the key-index gradient
    sums over the query rows (Partial over cp), the loss over everything."""

    def construct(self, query, key, query_index, key_index, weights, topk_indices, softmax_max, softmax_sum,
                  query_rope, key_rope):
        si = _scores(query_index, key_index)                                              # [B, H, S, T]
        d_query_index = _t(ops.matmul(si, _t(key_index, (0, 2, 1, 3))), (0, 2, 1, 3))
        d_key_index = _t(ops.matmul(_t(si, (0, 1, 3, 2)), _t(query_index, (0, 2, 1, 3))), (0, 2, 1, 3))
        stats = _t(softmax_max * softmax_sum, (0, 2, 1))                                 # [B, H, S]
        attn = _scores(query, key) + _scores(query_rope, key_rope)
        loss = (si.sum(-1) * stats * _t(weights, (0, 2, 1))).sum() + (attn * attn).mean()
        return d_query_index, d_key_index, weights * 2.0, loss + (topk_indices.astype(ms.float32) * 0.0).sum()


class Handoff(nn.Cell):
    def construct(self, x):
        return x * 1.0


def _data(rng):
    # the loss's outputs multiply three inputs: at scale 0.5 they stay near 1 (an objective o * cos(o) of
    # outputs in the hundreds turns float32 rounding into 5e-5 relative gradient noise)
    q = lambda *shape: (0.5 * rng.standard_normal(shape)).astype(np.float32)      # noqa: E731
    return {
        "indexer": [q(B, S, H, D), q(B, S, H, D), q(B, S, H)],
        "attention": [q(B, S, H, D), q(B, S, H, D), q(B, S, H, D), rng.integers(0, S, (B, S, H)).astype(np.int32),
                      q(B, S, H, D), q(B, S, H, D)],
        "loss": [q(B, S, H, D), q(B, S, H, D), q(B, S, H, D), q(B, S, H, D), q(B, S, H),
                 rng.integers(0, S, (B, S, H)).astype(np.int32), q(B, S, H), q(B, S, H), q(B, S, H, D), q(B, S, H, D)],
    }


def _float_positions(arrays):
    return tuple(i for i, a in enumerate(arrays) if a.dtype == np.float32)


def _run(cell, arrays, call=None):
    """(outputs, gradients of the float inputs) of sum(w_i * output_i) over the float outputs."""
    positions = _float_positions(arrays)
    tensors = [ms.Tensor(a) for a in arrays]

    def loss(*floats):
        args = list(tensors)
        for p, f in zip(positions, floats):
            args[p] = f
        outs = (call or cell)(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        total = 0.0
        for o in outs:
            if o.dtype == ms.float32:
                total = total + (o * ops.cos(o)).sum()
        return total, outs
    (_, outs), grads = ms.value_and_grad(loss, grad_position=tuple(range(len(positions))), has_aux=True)(
        *(tensors[p] for p in positions))
    return [o.asnumpy() for o in outs], [g.asnumpy() for g in grads]


def _rows(x, rank, n, dim=1):
    length = x.shape[dim] // n
    return np.take(x, range(rank * length, (rank + 1) * length), axis=dim)


def _check(case, got, want, rank, n, whole=()):
    for i, (g, w) in enumerate(zip(got, want)):
        expect = w if i in whole else _rows(w, rank, n)
        np.testing.assert_allclose(g, expect, err_msg=f"{case} #{i}", **TOL)


def _loss_style(**kwargs):
    """MindFormers' indexer-loss style: the softmax statistics at 6 and 7 sharded with the query side."""
    return hnn.DSAIndexerLossContextParallel(softmax_max_index=6, softmax_sum_index=7, use_local_output=True, **kwargs)


def check_dsa_boundaries(mesh) -> None:
    """Each style (synchronous and asynchronous) against one device; the shared cache; what is refused."""
    rank, n = mesh.get_local_rank(0), mesh.size()
    data = _data(np.random.default_rng(11))
    mine = {k: [_rows(a, rank, n) for a in v] for k, v in data.items()}
    cases = [("indexer", Indexer, lambda: hnn.DSAIndexerContextParallel(use_local_output=True), ()),
             ("attention", SparseAttention, lambda: hnn.DSASparseAttentionContextParallel(use_local_output=True), ()),
             ("loss", IndexerLoss, lambda: _loss_style(), (3,))]
    for name, cell_class, make, whole in cases:
        want_out, want_grads = _run(cell_class(), data[name])
        cell = cell_class()
        make().apply(cell, mesh)
        got_out, got_grads = _run(cell, mine[name])
        _check(f"{name} outputs", got_out, want_out, rank, n, whole)
        _check(f"{name} gradients", got_grads, want_grads, rank, n)

    # the asynchronous forms: the gathers start at the handoff Cells, whose outputs reach the boundary
    want_out, want_grads = _run(SparseAttention(), data["attention"])
    cell, handoffs = SparseAttention(), {k: Handoff() for k in ("key", "value", "key_rope")}
    hnn.AsyncDSASparseAttentionContextParallel(use_local_output=True).apply(
        cell, mesh, key_handoff=handoffs["key"], value_handoff=handoffs["value"], key_rope_handoff=handoffs["key_rope"])

    def through_handoffs(q, k, v, topk, q_rope, k_rope):
        return cell(q, handoffs["key"](k), handoffs["value"](v), topk, q_rope, handoffs["key_rope"](k_rope))
    got_out, got_grads = _run(cell, mine["attention"], call=through_handoffs)
    _check("async attention outputs", got_out, want_out, rank, n)
    _check("async attention gradients", got_grads, want_grads, rank, n)
    q, k, v, topk, q_rope, k_rope = (ms.Tensor(a) for a in mine["attention"])
    with pytest.raises(ValueError, match="is not what its handoff Cell returned"):
        cell(q, handoffs["key"](k) + 0.0, handoffs["value"](v), topk, q_rope, handoffs["key_rope"](k_rope))

    # the shared cache: the loss takes the attention's gathered key and key_rope for the same tensors only,
    # and empties the cache when it returns
    cache = hnn.DSASequenceReplicateCache()
    attention, loss = SparseAttention(), IndexerLoss()
    hnn.DSASparseAttentionContextParallel(use_local_output=True, shared_replicate_cache=cache,
                                          share_key_value=True).apply(attention, mesh)
    _loss_style(shared_replicate_cache=cache).apply(loss, mesh)
    a_args = [ms.Tensor(a) for a in mine["attention"]]
    attention(*a_args)
    assert len(cache) == 2                                                     # key and key_rope
    args = [ms.Tensor(a) for a in mine["loss"]]
    args[1], args[9] = a_args[1], a_args[5]                                    # the very key and key_rope gathered
    full = list(data["loss"])
    full[1], full[9] = data["attention"][1], data["attention"][5]
    want, _ = _run(IndexerLoss(), full)
    _check("loss from the cache", [o.asnumpy() for o in loss(*args)], want, rank, n, (3,))
    assert len(cache) == 0
    attention(*a_args)                                                         # filled again; other tensors
    want, _ = _run(IndexerLoss(), data["loss"])                                # reach the loss: gathered anew
    _check("loss past the cache", [o.asnumpy() for o in loss(*(ms.Tensor(a) for a in mine["loss"]))], want, rank, n,
           (3,))


def check_dsa_with_tensor_parallel(mesh) -> None:
    """cp = 2 x tp = 2 (``mesh`` named ("cp", "tp")): the boundary's arguments come as DTensors of tensor
    parallelism, heads cut over tp; the styles put them on the mesh of both (the heads' placement kept) and
    give the outputs back on the tp mesh (``use_local_output=False``), their cp rows as the local part: the
    indexer's head sum Partial over tp, the attention's output sharded on the heads. Outputs and the
    gradients of every float input equal one device's (this rank's rows and heads)."""
    from hyper_parallel_ms.dtensor import DTensor
    from hyper_parallel_ms.placement import Shard

    cp, tp = mesh["cp"], mesh["tp"]
    r, t = cp.get_local_rank(0), tp.get_local_rank(0)
    data = _data(np.random.default_rng(5))

    def mine(a):
        rows = _rows(a, r, 2)
        return _rows(rows, t, 2, dim=2)                     # heads: dim 2 of every [B, S, H, ...] input

    for name, cell_class, style in (("indexer", Indexer, hnn.DSAIndexerContextParallel()),
                                    ("attention", SparseAttention, hnn.DSASparseAttentionContextParallel())):
        arrays = data[name]
        want_out, want_grads = _run(cell_class(), arrays)
        cell = cell_class()
        style.apply(cell, cp)

        def on_tp(*pieces):
            outs = cell(*(DTensor.from_local(p, tp, (Shard(2),)) for p in pieces))
            outs = outs if isinstance(outs, tuple) else (outs,)
            assert all(isinstance(o, DTensor) and o.device_mesh == tp for o in outs), outs
            # each tp rank's piece of dim 2 (the indexer's Partial head sum reduce-scattered): the ranks'
            # objectives add up to one device's
            return tuple(o.redistribute(tp, (Shard(2),)).to_local() for o in outs)
        got_out, got_grads = _run(cell, [mine(a) for a in arrays], call=on_tp)
        for i, (g, w) in enumerate(zip(got_out, want_out)):
            np.testing.assert_allclose(g, mine(w), err_msg=f"tp {name} output #{i}", **TOL)
        for i, (g, w) in enumerate(zip(got_grads, want_grads)):
            np.testing.assert_allclose(g, mine(w), err_msg=f"tp {name} gradient #{i}", **TOL)
