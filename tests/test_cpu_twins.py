"""``hyper_parallel_ms.testing.cpu_twins()``: each twin against its formula (numpy), its gradient
where a model differentiates it, its refusals, and the restoration of the primitives. In the
pytest process, except the collective twins (2 CPU ranks, one call): the all-reduce, all-gather,
reduce-scatter and uneven all-to-alls of ``mindspore.ops.communication`` and the in-place all-reduce,
all-gather and ``batch_isend_irecv`` of ``mindspore.mint.distributed``."""
from __future__ import annotations

import numpy as np
import pytest
import mindspore as ms
from mindspore import mint, ops

from hyper_parallel_ms.testing import TWINS, cpu_twins, run_on_ranks

RNG = np.random.default_rng(3)


def _np(t):
    return t.asnumpy()


def _softmax(s):
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_elementary_twins_equal_their_formulas():
    x = RNG.normal(size=(3, 5)).astype(np.float32)
    idx = np.array([2, 0, 2], np.int64)
    with cpu_twins() as names:
        assert set(names) == set(TWINS)
        np.testing.assert_array_equal(_np(mint.full((2, 3), 1.5)), np.full((2, 3), 1.5, np.float32))
        np.testing.assert_array_equal(_np(mint.tril(ms.Tensor(x), diagonal=1)), np.tril(x, 1))
        np.testing.assert_array_equal(_np(mint.index_select(ms.Tensor(x), 1, ms.Tensor(idx))), x[:, idx])
        np.testing.assert_array_equal(_np(mint.arange(2, 11, 3)), np.arange(2, 11, 3))
        assert mint.arange(4).dtype == ms.int64 and mint.arange(0.0, 1.0, 0.25).dtype == ms.float32
        np.testing.assert_allclose(_np(mint.outer(ms.Tensor(x[0]), ms.Tensor(x[1]))), np.outer(x[0], x[1]), rtol=1e-6)
        np.testing.assert_array_equal(_np(mint.zeros_like(ms.Tensor(x))), np.zeros_like(x))
        assert mint.ones_like(ms.Tensor(x), dtype=ms.int32).dtype == ms.int32
        np.testing.assert_array_equal(_np(mint.ones_like(ms.Tensor(x))), np.ones_like(x))
        index = np.array([[0, 1, 0], [2, 2, 1]], np.int64)
        src = RNG.normal(size=(2, 4)).astype(np.float32)
        expect = x[:2, :3].copy()
        for i in range(2):
            for j in range(3):
                expect[i, index[i, j]] += src[i, j]
        got = mint.scatter_add(ms.Tensor(x[:2, :3]), 1, ms.Tensor(index), ms.Tensor(src))
        np.testing.assert_allclose(_np(got), expect, rtol=1e-6)


def test_rms_norm_and_embedding_twins_equal_their_formulas_with_gradients():
    x = RNG.normal(size=(2, 3, 8)).astype(np.float32)
    gamma = RNG.normal(size=(8,)).astype(np.float32)
    rstd = 1 / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)
    table = RNG.normal(size=(6, 4)).astype(np.float32)
    ids = np.array([[1, 0, 5], [0, 3, 1]], np.int32)
    with cpu_twins():
        y, r = ops.rms_norm(ms.Tensor(x), ms.Tensor(gamma), 1e-6)
        np.testing.assert_allclose(_np(y), x * rstd * gamma, rtol=1e-5)
        np.testing.assert_allclose(_np(r), rstd, rtol=1e-5)
        rows = mint.nn.functional.embedding(ms.Tensor(ids), ms.Tensor(table), padding_idx=0)
        np.testing.assert_array_equal(_np(rows), table[ids])
        grad = ms.grad(lambda t: mint.nn.functional.embedding(ms.Tensor(ids), t, padding_idx=0).sum())(ms.Tensor(table))
    expect = np.zeros_like(table)
    np.add.at(expect, ids[ids != 0], 1.0)                     # no gradient reaches the padding row
    np.testing.assert_array_equal(_np(grad), expect)


def test_split_twin_gives_the_gradients_mindspore_2_10_misplaces_on_cpu():
    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    dy = x + 100
    swap = lambda t: mint.cat(mint.split(t, 4, dim=-1)[::-1], dim=-1)       # noqa: E731
    with cpu_twins():
        grad = ms.grad(lambda t: (swap(t) * ms.Tensor(dy)).sum())(ms.Tensor(x))
        pieces = mint.split(ms.Tensor(np.arange(10, dtype=np.float32)), [3, 7])
    np.testing.assert_array_equal(_np(grad), np.concatenate([dy[:, 4:], dy[:, :4]], -1))
    assert [p.shape for p in pieces] == [(3,), (7,)]


def test_moe_twins_equal_their_formulas_with_gradients():
    """The twins MindFormers' MoE layers reach: routing (topk, sort, argsort, histc, cumsum, floor_divide,
    scatter_), its counters (add_), the token permutation (moe_token_permute / unpermute,
    repeat_interleave) and the experts' grouped matmul."""
    x = np.array([[0.5, 2.0, 2.0, -1.0, 0.5], [3.0, 3.0, 3.0, 0.0, 1.0]], np.float32)   # ties: lower index first
    with cpu_twins():
        values, index = mint.topk(ms.Tensor(x), 3, dim=-1)
        np.testing.assert_array_equal(_np(index), [[1, 2, 0], [0, 1, 2]])
        np.testing.assert_array_equal(_np(values), np.take_along_axis(x, _np(index), -1))
        assert index.dtype == ms.int64
        _, low = mint.topk(ms.Tensor(x), 1, dim=0, largest=False)
        np.testing.assert_array_equal(_np(low), [[0, 0, 0, 0, 0]])
        grad = ms.grad(lambda t: mint.topk(t, 2)[0].sum())(ms.Tensor(x))
        np.testing.assert_array_equal(_np(grad), [[0, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
        values, index = mint.sort(ms.Tensor(x), dim=-1, descending=True)
        np.testing.assert_array_equal(_np(index), np.argsort(-x, -1, kind="stable"))
        np.testing.assert_array_equal(_np(values), -np.sort(-x, -1))
        np.testing.assert_array_equal(_np(mint.argsort(ms.Tensor(x[1]), stable=True)), np.argsort(x[1], kind="stable"))
        ids = np.array([[0, 3], [3, 1], [1, 3]], np.int64)
        counts = mint.histc(ms.Tensor(ids), bins=4, min=0, max=4)
        np.testing.assert_array_equal(_np(counts), np.bincount(ids.reshape(-1), minlength=4))
        values = RNG.normal(size=20).astype(np.float32)
        np.testing.assert_array_equal(_np(mint.histc(ms.Tensor(values), bins=5)),
                                      np.histogram(values, 5, (values.min(), values.max()))[0])
        np.testing.assert_array_equal(_np(mint.histc(ms.Tensor(values), bins=4, min=-1, max=1)),
                                      np.histogram(values, 4, (-1, 1))[0])     # outside [min, max]: not counted
        running = mint.cumsum(ms.Tensor(np.array([1.0, 2.0, 0.0, 3.0], np.float32)), dim=0, dtype=ms.int64)
        assert running.dtype == ms.int64 and _np(running).tolist() == [1, 3, 3, 6]
        np.testing.assert_array_equal(_np(mint.floor_divide(ms.Tensor(np.array([-7, 5, 6], np.int64)), 3)), [-3, 1, 2])
        mask = mint.ones((3, 2), dtype=ms.bool_)
        mask.scatter_(1, ms.Tensor(np.array([[0], [1], [0]], np.int64)), False)
        np.testing.assert_array_equal(_np(mask), [[False, True], [True, False], [False, True]])
        counter = ms.Parameter(ms.Tensor(np.zeros(4, np.float32)), requires_grad=False)
        counter.add_(ms.Tensor(np.array([1, 2, 3, 4], np.int32)))
        counter.add_(ms.Tensor(np.ones(4, np.float32)), alpha=2)
        np.testing.assert_array_equal(_np(counter), [3, 4, 5, 6])            # in place (CPU: not written)
        scaled = ms.Tensor(np.array([1.0, -2.0, 4.0], np.float32))
        scaled.mul_(0.5)
        scaled.mul_(ms.Tensor(np.array([2.0, 2.0, -1.0], np.float32)))
        np.testing.assert_array_equal(_np(scaled), [1.0, -2.0, -2.0])       # in place (CPU: not written)
        # token permutation: rows grouped by expert (stable: token-major), each (token, slot)'s row returned
        tokens = RNG.normal(size=(4, 3)).astype(np.float32)
        experts = np.array([[2, 0], [1, 2], [0, 1], [2, 1]], np.int32)
        order = np.argsort(experts.reshape(-1), kind="stable")
        permuted, where = ops.moe_token_permute(ms.Tensor(tokens), ms.Tensor(experts))
        np.testing.assert_array_equal(_np(permuted), tokens[order // 2])
        assert where.dtype == ms.int32 and np.array_equal(order[_np(where)], np.arange(8))
        probs = RNG.random((4, 2)).astype(np.float32)
        back = ops.moe_token_unpermute(permuted, where, ms.Tensor(probs))
        np.testing.assert_allclose(_np(back), tokens * probs.sum(1, keepdims=True), rtol=1e-6)
        np.testing.assert_array_equal(_np(ops.moe_token_unpermute(permuted, where)), tokens[np.arange(8) // 2])
        def round_trip(t, p):
            return ops.moe_token_unpermute(ops.moe_token_permute(t, ms.Tensor(experts))[0], where, p).sum()
        grad = ms.grad(round_trip, (0, 1))(ms.Tensor(tokens), ms.Tensor(probs))
        np.testing.assert_allclose(_np(grad[0]), np.repeat(probs.sum(1, keepdims=True), 3, 1), rtol=1e-6)
        # a sum of 3 float32 values in another order: a few float32 ulps of the largest term
        np.testing.assert_allclose(_np(grad[1]), np.repeat(tokens.sum(1, keepdims=True), 2, 1), rtol=1e-6,
                                   atol=4 * np.finfo(np.float32).eps * np.abs(tokens).max())
        repeated = mint.repeat_interleave(ms.Tensor(np.array([5, 6, 7], np.int32)), ms.Tensor(np.array([2, 0, 1])),
                                          dim=0, output_size=3)
        np.testing.assert_array_equal(_np(repeated), [5, 5, 7])
        np.testing.assert_array_equal(_np(mint.repeat_interleave(ms.Tensor(x), 2)), np.repeat(x.reshape(-1), 2))
        # grouped matmul: rows [0, 1) by expert 0, none by expert 1, [1, 6) by expert 2
        from mindspore.ops.auto_generate import GroupedMatmul
        a, w = RNG.normal(size=(6, 4)).astype(np.float32), RNG.normal(size=(3, 4, 2)).astype(np.float32)
        dy = RNG.normal(size=(6, 2)).astype(np.float32)
        groups = ms.Tensor(np.array([1, 1, 6], np.int64))
        expert = np.array([0, 2, 2, 2, 2, 2])

        def gmm(a, w):
            return GroupedMatmul(split_item=3, group_type=0)([a], [w], None, None, None, None, None, groups)[0]
        np.testing.assert_allclose(_np(gmm(ms.Tensor(a), ms.Tensor(w))), np.einsum("mk,mkn->mn", a, w[expert]),
                                   rtol=1e-5, atol=1e-6)
        da, dw = ms.grad(lambda a, w: (gmm(a, w) * ms.Tensor(dy)).sum(), (0, 1))(ms.Tensor(a), ms.Tensor(w))
        np.testing.assert_allclose(_np(da), np.einsum("mn,mkn->mk", dy, w[expert]), rtol=1e-5, atol=1e-6)
        expect_dw = np.stack([a[expert == e].T @ dy[expert == e] for e in range(3)])
        np.testing.assert_allclose(_np(dw), expect_dw, rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match="ending at x's 6 rows"):
            GroupedMatmul(split_item=3, group_type=0)([ms.Tensor(a)], [ms.Tensor(w)], None, None, None, None, None,
                                                      ms.Tensor(np.array([1, 1, 5], np.int64)))


def _attention(q, k, v, scale, masked):
    """BNSD numpy attention; ``masked[i, j]`` True hides key j from query i."""
    groups = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, groups, 1), np.repeat(v, groups, 1)
    s = np.einsum("bnqd,bnkd->bnqk", q, k) * scale
    s = np.where(masked, -np.inf, s)
    return np.einsum("bnqk,bnkd->bnqd", _softmax(s), v)


@pytest.mark.parametrize("layout", ["BNSD", "BSH"])
def test_flash_attention_twin_equals_softmax_attention(layout):
    from mindspore.ops.operations.nn_ops import FlashAttentionScore
    b, n, kv, s, d = 2, 4, 2, 6, 8
    q, k, v = (RNG.normal(size=shape).astype(np.float32) for shape in ((b, n, s, d), (b, kv, s, d), (b, kv, s, d)))
    causal = np.triu(np.ones((s, s), bool), 1)
    band = (np.arange(s)[None] - np.arange(s)[:, None] > 1) | (np.arange(s)[:, None] - np.arange(s)[None] > 2)

    def to_layout(t):
        return t if layout == "BNSD" else t.transpose(0, 2, 1, 3).reshape(t.shape[0], t.shape[2], -1)

    with cpu_twins():
        nothing = ms.Tensor(np.zeros((s, s), np.uint8))
        # sparse_mode 0 applies the pre / next token band with an attn_mask only (MindSpore's defaultMask)
        for sparse_mode, pre, nxt, mask, hidden in ((2, 65536, 0, None, causal), (3, 65536, 0, None, causal),
                                                    (0, 2, 1, nothing, band), (0, 2, 1, None, causal & False)):
            fa = FlashAttentionScore(head_num=n, scale_value=0.3, pre_tokens=pre, next_tokens=nxt,
                                     input_layout=layout, sparse_mode=sparse_mode)
            out = fa(*(ms.Tensor(to_layout(t)) for t in (q, k, v)), attn_mask=mask)[3]
            np.testing.assert_allclose(_np(out), to_layout(_attention(q, k, v, 0.3, hidden)), rtol=1e-5, atol=1e-5)
        user_mask = RNG.random((s, s)) < 0.3
        np.fill_diagonal(user_mask, False)
        fa = FlashAttentionScore(head_num=n, scale_value=0.3, input_layout=layout, sparse_mode=0)
        out = fa(*(ms.Tensor(to_layout(t)) for t in (q, k, v)), attn_mask=ms.Tensor(user_mask.astype(np.uint8)))[3]
        np.testing.assert_allclose(_np(out), to_layout(_attention(q, k, v, 0.3, user_mask)), rtol=1e-5, atol=1e-5)
        # the gradient of the composition is the one of softmax attention written with mint ops
        ref = lambda q: mint.matmul(mint.softmax(mint.matmul(q, ms.Tensor(np.repeat(k, 2, 1)).swapaxes(-1, -2)) * 0.3, -1), ms.Tensor(np.repeat(v, 2, 1)))  # noqa: E731,E501
        fa = FlashAttentionScore(head_num=n, scale_value=0.3, input_layout="BNSD", sparse_mode=1)
        got = ms.grad(lambda q: fa(q, ms.Tensor(k), ms.Tensor(v))[3].sum())(ms.Tensor(q))
        np.testing.assert_allclose(_np(got), _np(ms.grad(lambda q: ref(q).sum())(ms.Tensor(q))), rtol=1e-4, atol=1e-6)
        with pytest.raises(ValueError, match="keep_prob"):
            FlashAttentionScore(head_num=n, keep_prob=0.9, input_layout="BNSD")(*(ms.Tensor(t) for t in (q, k, v)))


def _bf16(x):
    """``x`` rounded to bfloat16 (round to nearest even), as float32."""
    return ms.Tensor(x, ms.float32).astype(ms.bfloat16).astype(ms.float32).asnumpy()


def test_muon_twins_equal_their_formulas():
    """What MindFormers' Muon optimizer calls: bfloat16 matmuls (float32 accumulation, one rounding), stack,
    vector norms, clone, copy_ into and out of views, a 0-d float32 tensor times a bfloat16 one; its
    AdamW's addcmul; its trainer's parameter initialisation (normal_, fill_, zero_)."""
    a, b, c = (RNG.normal(size=shape).astype(np.float32) for shape in [(3, 4), (4, 5), (3, 5)])
    a16, b16, c16 = (ms.Tensor(t, ms.float32).astype(ms.bfloat16) for t in (a, b, c))
    a_, b_, c_ = (t.astype(ms.float32).asnumpy() for t in (a16, b16, c16))
    with cpu_twins():
        mm = mint.mm(a16, b16)
        assert mm.dtype == ms.bfloat16
        np.testing.assert_array_equal(mm.astype(ms.float32).asnumpy(), _bf16(a_ @ b_))
        np.testing.assert_allclose(_np(mint.mm(ms.Tensor(a), ms.Tensor(b))), a @ b, rtol=1e-6)
        got = mint.addmm(c16, a16, b16, beta=-0.5, alpha=2.0).astype(ms.float32).asnumpy()
        np.testing.assert_array_equal(got, _bf16(-0.5 * c_ + 2.0 * (a_ @ b_)))
        stacked = mint.stack([a16, a16 * 2], dim=0)
        assert stacked.dtype == ms.bfloat16 and tuple(stacked.shape) == (2, 3, 4)
        np.testing.assert_array_equal(stacked.astype(ms.float32).asnumpy(), np.stack([a_, 2 * a_]))
        sb = ms.Tensor(np.stack([b, b]), ms.float32).astype(ms.bfloat16)
        sb_ = sb.astype(ms.float32).asnumpy()
        np.testing.assert_array_equal(mint.bmm(stacked, sb).astype(ms.float32).asnumpy(),
                                      _bf16(np.stack([a_, 2 * a_]) @ sb_))
        base = ms.Tensor(np.stack([c, c]), ms.float32).astype(ms.bfloat16)
        got = mint.baddbmm(base, stacked, sb, beta=3.0, alpha=1.0).astype(ms.float32).asnumpy()
        np.testing.assert_array_equal(got, _bf16(3.0 * base.astype(ms.float32).asnumpy() + np.stack([a_, 2 * a_]) @ sb_))
        x = ms.Tensor(a)
        np.testing.assert_allclose(_np(mint.norm(x, p="fro", dim=(-2, -1), keepdim=True, dtype=ms.float32)),
                                   np.sqrt((a * a).sum(keepdims=True)), rtol=1e-6)
        np.testing.assert_allclose(_np(mint.norm(x, p=1, dim=1)), np.abs(a).sum(1), rtol=1e-6)
        np.testing.assert_allclose(_np(mint.norm(x, p=3)), (np.abs(a) ** 3).sum() ** (1 / 3), rtol=1e-5)
        from mindspore.ops.auto_generate.gen_ops_prim import LinalgVectorNorm    # mint.norm(p=inf) calls LpNormV2
        np.testing.assert_allclose(_np(LinalgVectorNorm()(x, float("inf"), 0, False, None)), np.abs(a).max(0), rtol=1e-6)
        view = x[:, 1:]                                          # strided view
        copied = view.clone()
        np.testing.assert_array_equal(_np(copied), a[:, 1:])
        assert copied.storage_offset() == 0 and copied.is_contiguous()
        assert a16.clone().dtype == ms.bfloat16 and mint.clone(x).shape == x.shape
        param = ms.Parameter(ms.Tensor(a), name="w")
        assert isinstance(param.clone("zeros"), ms.Parameter)
        whole = mint.zeros((4, 3), dtype=ms.float32)
        whole[2:4].copy_(ms.Tensor(c[:2, :3]))                   # into a view: written through
        whole[0:2].copy_(x[:2, 1:])                              # a view into a view of the same size
        np.testing.assert_array_equal(_np(whole), np.concatenate([a[:2, 1:], c[:2, :3]]))
        plain = mint.zeros((3, 4), dtype=ms.float32)
        plain.copy_(x)
        np.testing.assert_array_equal(_np(plain), a)
        scaled = ms.Tensor(0.3, ms.float32) * a16                # 0-d float32 times bfloat16: bfloat16
        assert scaled.dtype == ms.bfloat16
        np.testing.assert_array_equal(scaled.astype(ms.float32).asnumpy(), _bf16(np.float32(0.3) * a_))
        np.testing.assert_allclose(_np(ms.Tensor(a) * ms.Tensor(b[:3, :4])), a * b[:3, :4], rtol=1e-6)
        # MindFormers' initialisation (init_states): normal_, fill_, zero_ write in place
        drawn = []
        for _ in range(2):
            ms.manual_seed(5)
            t = mint.zeros((200, 50), dtype=ms.float32)
            t.normal_(mean=1.0, std=2.0)
            drawn.append(_np(t))
        np.testing.assert_array_equal(drawn[0], drawn[1])                 # the same seed, the same values
        assert abs(drawn[0].mean() - 1.0) < 0.1 and abs(drawn[0].std() - 2.0) < 0.1   # 5 standard errors
        norm_weight = ms.Parameter(ms.Tensor(a[0]), name="norm")
        norm_weight.fill_(1.0)
        np.testing.assert_array_equal(_np(norm_weight), np.ones(4, np.float32))
        norm_weight.zero_()
        np.testing.assert_array_equal(_np(norm_weight), np.zeros(4, np.float32))
        # MindFormers' AdamW: the second moment's update
        np.testing.assert_allclose(_np(mint.addcmul(ms.Tensor(c[:, :4]), ms.Tensor(a), ms.Tensor(a), value=0.25)),
                                   c[:, :4] + 0.25 * a * a, rtol=1e-6)


def test_twins_are_restored_and_refused_off_cpu(monkeypatch):
    from mindspore.ops.auto_generate import gen_ops_prim
    before = gen_ops_prim.Arange.__call__
    with cpu_twins():
        with cpu_twins():                              # re-entrant
            assert gen_ops_prim.Arange.__call__ is not before
        assert gen_ops_prim.Arange.__call__ is not before
    assert gen_ops_prim.Arange.__call__ is before
    monkeypatch.setattr("hyper_parallel_ms._mindspore.process_device_target", lambda: "Ascend")
    with pytest.raises(RuntimeError, match="tests on CPU ranks"):
        with cpu_twins():
            pass


def collectives_on_ranks():
    """The collective twins (``mindspore.ops.communication``'s not-in-place calls, ``mint.distributed``'s
    in-place all-reduce) on 2 ranks."""
    from mindspore.communication import GlobalComm, get_rank
    from mindspore.ops import communication as comm
    from mindspore.mint import distributed
    rank = get_rank()
    x = ms.Tensor(np.arange(8, dtype=np.float32).reshape(4, 2) * (rank + 1))
    # uneven all-to-all: rank 0 sends 1 row to itself and 2 to rank 1, rank 1 sends 3 to rank 0
    rows = ms.Tensor(np.arange(6, dtype=np.float32).reshape(3, 2) + 10 * rank)
    sends, receives = ((1, 2), (1, 3)) if rank == 0 else ((3, 0), (2, 0))
    comm.set_comm_ops_inplace(False)
    try:
        with cpu_twins():
            total = comm.all_reduce(x, group=GlobalComm.WORLD_COMM_GROUP)[0]
            gathered = comm.all_gather_into_tensor(None, x)[0]
            piece = comm.reduce_scatter_tensor(None, x)[0]

            def exchange(t):
                return comm.all_to_all_single(None, t, list(receives), list(sends))[0]
            moved = exchange(rows)
            # the gradient of sum(out^2) / 2 is out, sent back: each rank's own rows
            grad = ms.grad(lambda t: (exchange(t) ** 2).sum() / 2)(rows)
            lists = comm.all_to_all([(1, 2), (1, 2)], [ms.Tensor(np.full((1, 2), 10.0 * rank + j, np.float32))
                                                         for j in range(2)])[0]
            in_place = ms.Tensor(np.ones(3, np.float32) * (rank + 1))
            distributed.all_reduce(in_place)
            into = mint.zeros((8, 2), dtype=ms.float32)
            distributed.all_gather_into_tensor(into, x, async_op=True).wait()
            # batch_isend_irecv: each rank sends its x and receives the peer's into rows of a buffer (views)
            peer = 1 - rank
            buffer = mint.zeros((8, 2), dtype=ms.float32)
            ops_ = [distributed.P2POp("isend", x, peer), distributed.P2POp("irecv", buffer[4:8], peer)]
            distributed.batch_isend_irecv(ops_ if rank == 0 else ops_[::-1])[0].wait()
            # a DTensor's zero_ / fill_ (MindFormers' init_states of a tensor-parallel model): the dispatcher
            # runs InplaceZero / InplaceFillScalar on the piece
            from hyper_parallel_ms import Partial, Shard, distribute_tensor, init_device_mesh
            mesh = init_device_mesh("cpu", (2,))
            sharded = distribute_tensor(ms.Tensor(np.ones((4, 2), np.float32)), mesh, [Shard(0)])
            sharded.fill_(2.5)
            weight = ms.Parameter(distribute_tensor(ms.Tensor(np.ones((4, 2), np.float32)), mesh, [Shard(1)]), name="w")
            weight.fill_(-1.0)
            filled = (_np(sharded.full_tensor()), _np(weight.full_tensor()))
            sharded.zero_()
            weight.zero_()
            zeroed = (_np(sharded.full_tensor()), _np(weight.to_local()))
            try:
                sharded.redistribute(mesh, [Partial()]).fill_(1.0)
                filled += ("accepted",)
            except ValueError as exc:
                filled += (str(exc),)
    finally:
        comm.set_comm_ops_inplace(True)
    return (_np(total), _np(gathered), _np(piece), _np(moved), _np(grad), [_np(t) for t in lists], _np(in_place),
            _np(into), _np(buffer), (filled, zeroed))


def test_collective_twins_on_two_ranks():
    base = np.arange(8, dtype=np.float32).reshape(4, 2)
    rows = [np.arange(6, dtype=np.float32).reshape(3, 2) + 10 * r for r in range(2)]
    expect_moved = [np.concatenate([rows[0][:1], rows[1]]), rows[0][1:]]
    results = run_on_ranks(collectives_on_ranks, 2)
    for rank, (total, gathered, piece, moved, grad, lists, in_place, into, buffer, (filled, zeroed)) in enumerate(
            results):
        np.testing.assert_array_equal(filled[0], np.full((4, 2), 2.5, np.float32))       # the whole tensor
        np.testing.assert_array_equal(filled[1], np.full((4, 2), -1.0, np.float32))
        assert "Partial" in filled[2], filled[2]
        np.testing.assert_array_equal(zeroed[0], np.zeros((4, 2), np.float32))
        np.testing.assert_array_equal(zeroed[1], np.zeros((4, 1), np.float32))
        np.testing.assert_array_equal(total, base * 3)
        np.testing.assert_array_equal(gathered, np.concatenate([base, base * 2]))
        np.testing.assert_array_equal(piece, (base * 3)[2 * rank:2 * rank + 2])
        np.testing.assert_array_equal(moved, expect_moved[rank])
        np.testing.assert_array_equal(grad, rows[rank])
        np.testing.assert_array_equal(np.concatenate(lists), [[10.0 * i + rank] * 2 for i in range(2)])
        np.testing.assert_array_equal(in_place, np.full(3, 3.0))
        np.testing.assert_array_equal(into, np.concatenate([base, base * 2]))
        np.testing.assert_array_equal(buffer, np.concatenate([np.zeros((4, 2)), base * (2 - rank)]))
