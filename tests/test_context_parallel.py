"""Context parallelism against one device: ``context_parallel`` + ``scaled_dot_product_attention`` on
q, k, v of shape [2, 4, 16, 8] over cp = 2 and cp = 4 ranks, causal (load balanced) and not, for the
ring with "allgather" and "alltoall", Ulysses, and hybrid (cp = 4, Ulysses degree 2): outputs and the
gradients of q, k and v after ``context_parallel_unshard`` equal one device's, in PyNative and, for two
cases per world size, under ``ms.jit`` (one rank call per world size). Key-padding masks, grouped-query
attention and cp = 2 x tp = 2 (DTensor heads) in PyNative; HyperParallel's ``ContextParallel`` /
``AsyncContextParallel`` on an attention Cell in every mode, also through ``ops.flash_attention_score``
and its sharding rule; on 2 ranks, the DeepSeek sparse attention boundary styles
(tests/_dsa_boundaries.py). In process: the load balancer's order, the blocks a causal shard computes, the
argument checks, ``scaled_dot_product_attention`` on one device against its definition, its Ascend path,
and FlashAttentionScore's sharding rule per shard (the kernel computed by ``cpu_twins``).

Tolerance: float32, rtol 1e-5 with atol 1e-5 (the blockwise softmax sums the same 16 terms per row in
another order; measured differences up to 4e-6 on gradients of magnitude up to about 5).
"""
from __future__ import annotations

import os

import mindspore as ms
import numpy as np
import pytest
from mindspore import ops

from hyper_parallel_ms import nn as hnn
from hyper_parallel_ms._context_parallel._balance import (rank_chunks, restoring_order, sequence_order,
                                                          shard_positions)
from hyper_parallel_ms._context_parallel._schedule import ring_blocks
from hyper_parallel_ms.dtensor import DTensor
from hyper_parallel_ms.mesh import DeviceMesh
from hyper_parallel_ms.placement import Shard
from hyper_parallel_ms.nn import functional
from hyper_parallel_ms.nn.functional import scaled_dot_product_attention as sdpa
from hyper_parallel_ms.testing import cpu_twins, multi_rank

SHAPE = (2, 4, 16, 8)
TOL = dict(rtol=1e-5, atol=1e-5)


def _reference(q, k, v, mask=None, causal=False, scale=None):
    """Attention from its definition in float64 numpy (key heads repeated for grouped queries)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    groups = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, groups, -3), np.repeat(v, groups, -3)
    s = q @ np.swapaxes(k, -1, -2) * (1 / np.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        s = np.where(np.triu(np.ones(s.shape[-2:], bool), 1), -np.inf, s)
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == bool else s + mask
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


# ----------------------------------------------------------------------------- pure logic
def test_the_load_balancer_gives_each_rank_a_head_and_a_tail_chunk():
    assert rank_chunks(4) == ((0, 7), (1, 6), (2, 5), (3, 4))
    assert rank_chunks(2, load_balance=False) == ((0,), (1,))
    assert shard_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    order = sequence_order(16, 4)
    assert sorted(order.tolist()) == list(range(16)) and order[:4].tolist() == [0, 1, 14, 15]
    assert order[restoring_order(16, 4)].tolist() == list(range(16))
    assert sequence_order(16, 4, load_balance=False).tolist() == list(range(16))
    with pytest.raises(ValueError, match=r"length 12, which does not cut into 2 \* cp = 8 equal chunks"):
        shard_positions(12, 4, 0)


@pytest.mark.parametrize("cp", [2, 4])
def test_causal_work_is_equal_across_balanced_ranks_and_skipped_blocks_are_exact(cp):
    positions = [shard_positions(32, cp, r) for r in range(cp)]
    work = []
    for r in range(cp):
        blocks = ring_blocks(positions[r], positions, r, causal=True)
        assert [b.member for b in blocks] == [(r - s) % cp for s in range(cp)]      # the diagonal first
        area = 0
        for b in blocks:
            allowed = positions[b.member][None, :] <= positions[r][:, None]
            (r0, r1), (c0, c1) = b.rows, b.cols
            inside = np.zeros_like(allowed)
            inside[r0:r1, c0:c1] = True
            assert not (allowed & ~inside).any(), "a block's rectangle must hold every allowed pair"
            area += (r1 - r0) * (c1 - c0)
            assert b.kind != "skip"            # balanced: every rank meets every shard
        work.append(area)
    assert len(set(work)) == 1, work           # the same rectangles' area on every rank
    unbalanced = [shard_positions(32, cp, r, load_balance=False) for r in range(cp)]
    kinds = [b.kind for b in ring_blocks(unbalanced[0], unbalanced, 0, causal=True)]
    assert kinds == ["masked"] + ["skip"] * (cp - 1)    # rank 0 of a contiguous cut attends to itself only


def test_context_parallel_checks_its_arguments_and_changes_nothing_when_refused():
    mesh = DeviceMesh("cpu", [0], mesh_dim_names=("cp",))
    x = ms.Tensor(np.zeros((2, 4, 6, 8), np.float32))
    refused = [
        (dict(method="rings"), ValueError, "method must be one of"),
        (dict(method="ring", ulysses_degree=2), ValueError, "takes no ulysses_degree"),
        (dict(method="hybrid"), ValueError, "needs a ulysses_degree dividing"),
        (dict(buffers=[x], buffer_seq_dims=[2, 1]), ValueError, "1 buffers but 2 sequence dims"),
        (dict(buffers=[x], buffer_seq_dims=[4]), ValueError, "sequence dim 4 of buffers"),
        (dict(buffers=[x, x[:, :, :5]], buffer_seq_dims=[2, 2]), ValueError, r"buffers\[1\] .* has length 5"),
        (dict(buffers=[np.zeros(4)], buffer_seq_dims=[0]), TypeError, "must be a plain MindSpore Tensor"),
        (dict(load_balance=1), TypeError, "load_balance must be a bool"),
    ]
    for kwargs, error, match in refused:
        with pytest.raises(error, match=match):
            with hnn.context_parallel(mesh, **kwargs):
                pass
        assert x.shape == (2, 4, 6, 8)
    with pytest.raises(TypeError, match="mesh must be a DeviceMesh"):
        with hnn.context_parallel("cp"):
            pass
    with pytest.raises(NotImplementedError, match="rotate_method must be one of"):
        hnn.set_rotate_method("ring")
    with pytest.raises(ValueError, match="1-D"):
        hnn.context_parallel_unshard(DeviceMesh("cpu", [[0]]), [x], [2])


def test_one_rank_context_parallel_restores_buffers_and_refuses_what_cannot_follow_the_shards():
    """cp = 1 in this process: the engine's path (one ring member) and the checks of a call."""
    mesh = DeviceMesh("cpu", [0], mesh_dim_names=("cp",))
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(SHAPE).astype(np.float32) for _ in range(3))
    tq, tk, tv = ms.Tensor(q), ms.Tensor(k), ms.Tensor(v)
    with hnn.context_parallel(mesh, buffers=[tq, tk, tv], buffer_seq_dims=[2, 2, 2], no_restore_buffers={tv}):
        out = sdpa(tq, tk, tv, is_causal=True)
        np.testing.assert_allclose(out.asnumpy(), _reference(q, k, v, causal=True), **TOL)
        with pytest.raises(ValueError, match="dropout_p=0.5"):
            sdpa(tq, tk, tv, dropout_p=0.5)
        with pytest.raises(ValueError, match=r"must be a key-padding mask \[batch \| 1, heads \| 1, 1, 16\]"):
            sdpa(tq, tk, tv, ms.Tensor(np.ones((16, 16), bool)))
        with pytest.raises(ValueError, match="pass enable_gqa=True"):
            sdpa(tq, tk[:, :2], tv[:, :2])
        dq = DTensor.from_local(tq, mesh, (Shard(2),))
        with pytest.raises(ValueError, match=r"placements that cut only the heads \(Shard\(1\) or Replicate\)"):
            sdpa(dq, DTensor.from_local(tk, mesh, (Shard(2),)), DTensor.from_local(tv, mesh, (Shard(2),)))
        with pytest.raises(TypeError, match="all as DTensors .* or all as plain tensors"):
            sdpa(dq, tk, tv)
    assert tq.shape == SHAPE and tv.shape == SHAPE
    np.testing.assert_array_equal(tq.asnumpy(), q)


def test_the_hyper_parallel_styles_check_their_arguments_and_refuse_compiled_cells():
    with pytest.raises(ValueError, match="seq_dim and head_dim must differ"):
        hnn.ContextParallel(seq_dim=1, head_dim=1)
    with pytest.raises(ValueError, match="qkv_indices must be three argument positions"):
        hnn.ContextParallel(qkv_indices=(0, 1))
    with pytest.raises(NotImplementedError, match="head-tail exchange of query halves is not provided"):
        hnn.ContextParallel(ulysses_degree=1, load_balance=True)
    assert hnn.AsyncContextParallel().use_local_output is False and hnn.ContextParallel().use_local_output
    mesh = DeviceMesh("cpu", [0], mesh_dim_names=("cp",))
    with pytest.raises(ValueError, match="cp size 1 must divide by ulysses_degree 2"):
        hnn.ContextParallel(ulysses_degree=2).apply(ms.nn.Identity(), mesh)
    cell = _Attention()
    hnn.ContextParallel(seq_dim=2, head_dim=1, ulysses_degree=1).apply(cell.core, mesh)
    q = ms.Tensor(np.ones(SHAPE, np.float32))
    np.testing.assert_allclose(cell(q, q, q).asnumpy(), np.ones(SHAPE), **TOL)       # PyNative, one rank
    with pytest.raises(NotImplementedError, match="ContextParallel converts q, k and v to DTensors"):
        ms.jit(cell)(q, q, q)
    # a DTensor q of another mesh was passed through as if whole: refused (colossal on a mesh holding cp: placed)
    other = DTensor.from_local(q, DeviceMesh("cpu", [0], mesh_dim_names=("tp",)), (Shard(1),))
    with pytest.raises(ValueError, match="q is a DTensor on"):
        cell(other, q, q)
    ulysses = _Attention()
    hnn.ContextParallel(seq_dim=2, head_dim=1).apply(ulysses.core, mesh)
    with pytest.raises(ValueError, match="pass its local piece"):
        ulysses(DTensor.from_local(q, mesh, (Shard(2),)), q, q)


# ----------------------------------------------------------------------------- one device
def test_scaled_dot_product_attention_matches_its_definition():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 6, 8)).astype(np.float32)
    k = rng.standard_normal((2, 2, 5, 8)).astype(np.float32)
    v = rng.standard_normal((2, 2, 5, 3)).astype(np.float32)
    keep = rng.random((2, 1, 6, 5)) > 0.3
    keep[..., 0] = True
    added = rng.standard_normal((6, 5)).astype(np.float32)
    t = ms.Tensor
    cases = [(dict(), {}), (dict(attn_mask=t(keep)), dict(mask=keep)), (dict(attn_mask=t(added), scale=0.3),
             dict(mask=added, scale=0.3)), (dict(is_causal=True), dict(causal=True))]
    for kwargs, ref in cases:
        got = sdpa(t(q), t(k), t(v), enable_gqa=True, **kwargs)
        np.testing.assert_allclose(got.asnumpy(), _reference(q, k, v, **ref), **TOL)

    def causal(a, b, c):
        return sdpa(a, b, c, is_causal=True, enable_gqa=True)
    np.testing.assert_allclose(ms.jit(causal)(t(q), t(k), t(v)).asnumpy(), _reference(q, k, v, causal=True), **TOL)
    half = sdpa(t(q).astype(ms.float16), t(k).astype(ms.float16), t(v).astype(ms.float16), enable_gqa=True)
    assert half.dtype == ms.float16
    with pytest.raises(ValueError, match="not both"):
        sdpa(t(q), t(k), t(v), t(keep), is_causal=True, enable_gqa=True)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        sdpa(t(q), t(k), t(v))


def test_the_ascend_path_calls_flash_attention_as_the_math_path_computes(monkeypatch):
    """The arguments handed to ops.flash_attention_score (mask polarity, causal sparse mode, additive
    shift, grouped heads), checked on CPU with the kernel's twin (hyper_parallel_ms.testing.cpu_twins)."""
    monkeypatch.setattr(functional, "rank_device_target", lambda: "Ascend")
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 4, 6, 16)).astype(np.float16)
    k = rng.standard_normal((2, 2, 6, 16)).astype(np.float16)
    v = rng.standard_normal((2, 2, 6, 16)).astype(np.float16)
    keep = rng.random((2, 1, 1, 6)) > 0.3
    keep[..., 0] = True
    added = rng.standard_normal((1, 4, 6, 6)).astype(np.float16)
    t = ms.Tensor
    for kwargs, ref in [(dict(is_causal=True), dict(causal=True)), (dict(attn_mask=t(keep)), dict(mask=keep)),
                        (dict(attn_mask=t(added)), dict(mask=added.astype(np.float32))), (dict(), {})]:
        with cpu_twins():
            got = sdpa(t(q), t(k), t(v), enable_gqa=True, **kwargs)
        assert got.dtype == ms.float16
        np.testing.assert_allclose(got.asnumpy().astype(np.float32), _reference(q, k, v, **ref), rtol=2e-3,
                                   atol=2e-3)   # float16 inputs and output


@pytest.mark.npu
@pytest.mark.skipif(os.environ.get("HPMS_TEST_DEVICE") != "Ascend",
                    reason="needs an Ascend NPU: ops.flash_attention_score has no CPU kernel (its CPU twin runs in "
                           "test_the_ascend_path_calls_flash_attention_as_the_math_path_computes)")
def test_flash_attention_on_ascend_matches_the_definition():
    ms.set_device("Ascend")
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 4, 128, 64)).astype(np.float16) for _ in range(3))
    got = sdpa(ms.Tensor(q), ms.Tensor(k), ms.Tensor(v), is_causal=True)
    np.testing.assert_allclose(got.asnumpy().astype(np.float32), _reference(q, k, v, causal=True), rtol=5e-3,
                               atol=5e-3)


# ----------------------------------------------------------------------------- flash attention's rule
def _flash_on_cpu(flat) -> np.ndarray:
    """``ops.flash_attention_score`` on FlashAttentionScore's 18 flat arguments (numpy arrays for tensors),
    computed by its CPU twin: attention_out as float64."""
    t = [None if a is None else ms.Tensor(a.astype(np.uint8 if a.dtype == np.uint8 else np.float32))
         if isinstance(a, np.ndarray) else a for a in flat]
    layout = ("BSH", "BNSD", "SBH", "BSND", "TND")[t[16]]        # the primitive's enum
    with cpu_twins():
        out = ops.flash_attention_score(t[0], t[1], t[2], t[10], real_shift=t[3], drop_mask=t[4], padding_mask=t[5],
                                        attn_mask=t[6], keep_prob=t[11], scalar_value=t[12], pre_tokens=t[13],
                                        next_tokens=t[14], inner_precise=t[15], input_layout=layout, sparse_mode=t[17])
    return out.asnumpy().astype(np.float64)


@pytest.mark.parametrize("layout,mesh_shape,placements,sparse_mode,mask", [
    ("BNSD", (2,), ("seq",), 2, "compressed"),
    ("BNSD", (4,), ("seq",), 3, "compressed"),
    ("BSND", (2, 2), ("batch", "seq"), 4, "compressed"),
    ("BSH", (2, 2), ("heads", "seq"), 0, "full"),
    ("SBH", (2,), ("seq",), 1, "full"),
    ("BNSD", (2, 2), ("seq", "heads"), 0, None),
])
def test_flash_attention_rule_gives_each_shard_one_devices_rows(layout, mesh_shape, placements, sparse_mode, mask):
    """The rule's layouts and per-shard arguments, run by the kernel's CPU twin on every coordinate's
    pieces, give the rows of one device's output (float32: rtol 1e-5; a row's terms are the same)."""
    from hyper_parallel_ms.layout import Layout
    from hyper_parallel_ms.ops._registry import propagator
    from hyper_parallel_ms.ops._schema import OpSchema, TensorArg
    from hyper_parallel_ms.placement import Replicate as R, Shard as S

    b, n, n_kv, seq, d = 2, 4, 2, 8, 4
    dims = {"BNSD": (0, 2, 1), "BSND": (0, 1, 2), "BSH": (0, 1, 2), "SBH": (1, 0, 2)}[layout]
    shape_of = {"BNSD": lambda h, w: (b, h, seq, w), "BSND": lambda h, w: (b, seq, h, w),
                "BSH": lambda h, w: (b, seq, h * w), "SBH": lambda h, w: (seq, b, h * w)}[layout]
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal(shape_of(h, d)) for h in (n, n_kv, n_kv))
    attn = {"compressed": np.triu(np.ones((2048, 2048), np.uint8), 1), "full": (rng.random((seq, seq)) > 0.7)
            .astype(np.uint8), None: None}[mask]
    if attn is not None and mask == "full":
        attn[:, 0] = 0                                       # every row keeps a key
    pre, nxt = (3, 1) if sparse_mode == 4 else (2147483647, 2147483647)
    flat = [q, k, v, None, None, None, attn, None, None, None, n, 1.0, 0.5, pre, nxt, 0,
            ("BSH", "BNSD", "SBH", "BSND", "TND").index(layout), sparse_mode]
    role_dim = dict(zip(("batch", "seq", "heads"), dims))
    q_layout = Layout(mesh_shape, tuple(S(role_dim[r]) for r in placements))
    described = tuple(TensorArg(q_layout if i == 0 else Layout(mesh_shape, (R(),) * len(mesh_shape)), a.shape)
                      if isinstance(a, np.ndarray) else a for i, a in enumerate(flat))
    sharding = propagator.rule_for("FlashAttentionScore")(OpSchema("FlashAttentionScore", described))
    assert sharding.inputs[1].placements == tuple(R() if r == "seq" else S(role_dim[r]) for r in placements)
    want = _flash_on_cpu(flat)
    out_layout = sharding.outputs[3][0]
    for coord in out_layout.coordinates():
        local = [a[need.local_slices(a.shape, coord)] if isinstance(a, np.ndarray) else a
                 for a, need in zip(flat, sharding.inputs)]
        if sharding.local_args is not None:
            local = [a if o is None else o for a, o in zip(local, sharding.local_args(coord))]
        got = _flash_on_cpu(local)
        np.testing.assert_allclose(got, want[out_layout.local_slices(want.shape, coord)], rtol=1e-5, atol=1e-6,
                                   err_msg=f"coordinate {coord}")


def test_flash_attention_rule_refuses_what_a_shard_cannot_compute():
    from mindspore.ops.operations.nn_ops import FlashAttentionScore
    from hyper_parallel_ms.ops._rules.attention import band_for_rows
    with pytest.raises(NotImplementedError, match="sparse_mode=6"):
        band_for_rows(6, 0, 0, 4, 4, 8, 8)
    assert band_for_rows(3, 2147483647, 0, 0, 4, 8, 8) == (4, 8, -4)
    # [B, S, H] tensors given to a BNSD primitive: refused by the rule (DTensors) and the kernel's twin
    bsh = np.zeros((1, 8, 16), np.float32)
    mesh = DeviceMesh("cpu", [0], mesh_dim_names=("cp",))
    with cpu_twins():
        fa = FlashAttentionScore(head_num=2, input_layout="BNSD")
        for tensors in ([ms.Tensor(bsh)] * 3, [DTensor.from_local(ms.Tensor(bsh), mesh, (Shard(1),))] * 3):
            with pytest.raises(ValueError, match="input_layout 'BNSD' takes 4-D query"):
                fa(*tensors)


# ----------------------------------------------------------------------------- on ranks
def _cases(n: int):
    """(method, rotate method, Ulysses degree, also compiled) of a world of ``n`` ranks: two compiled
    cases per world (a compile costs seconds). Under ms.jit the ring moves keys and values by
    all-gather whatever the rotate method (point-to-point calls do not compile), so the compiled
    cases use "allgather"; "alltoall" runs in PyNative."""
    if n == 2:
        return [("ring", "allgather", None, True), ("ring", "alltoall", None, False),
                ("ulysses", "allgather", None, True)]
    return [("ring", "allgather", None, True), ("ring", "alltoall", None, False), ("ulysses", "allgather", None, False),
            ("hybrid", "allgather", 2, True), ("hybrid", "alltoall", 2, False)]


def _cp_against_one_device():
    """Every case of this world, causal and not, PyNative (and compiled where _cases says): outputs and
    the gradients of q, k and v after unsharding equal one device's; then key-padding masks and
    grouped-query attention; then HyperParallel's face."""
    from mindspore import communication

    n = communication.get_group_size()
    mesh = DeviceMesh("cpu", list(range(n)), mesh_dim_names=("cp",))
    rng = np.random.default_rng(7)
    data = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(8)]   # (q, k, v, w) twice

    def both(q1, k1, v1, w1, q2, k2, v2, w2):           # causal on the first set, not on the second
        causal, plain = sdpa(q1, k1, v1, is_causal=True), sdpa(q2, k2, v2)
        return (causal * w1).sum() + (plain * w2).sum(), causal, plain

    grad = ms.value_and_grad(both, grad_position=tuple(range(8)), has_aux=True)
    (_, *want_out), want = grad(*(ms.Tensor(d) for d in data))
    wanted = [g for i, g in enumerate(want) if i % 4 != 3] + list(want_out)       # dq, dk, dv twice; outputs
    for method, rotate, degree, also_compiled in _cases(n):
        hnn.set_rotate_method(rotate)
        for compiled in (False, True) if also_compiled else (False,):
            tensors = [ms.Tensor(d) for d in data]
            with hnn.context_parallel(mesh, buffers=tensors, buffer_seq_dims=[2] * 8, method=method,
                                      ulysses_degree=degree):
                (_, *outs), grads = (ms.jit(grad) if compiled else grad)(*tensors)
                full = hnn.context_parallel_unshard(mesh, [g for i, g in enumerate(grads) if i % 4 != 3] + outs,
                                                    [2] * 8)
            case = f"{method}/{rotate}/{'jit' if compiled else 'pynative'}"
            for what, got, ref in zip(("dq", "dk", "dv") * 2 + ("out causal", "out"), full, wanted):
                np.testing.assert_allclose(got.asnumpy(), ref.asnumpy(), err_msg=f"{case} {what}", **TOL)
    hnn.set_rotate_method("allgather")

    # key-padding mask (sharded like the keys) and grouped keys, each method, PyNative
    keep = rng.random((2, 1, 1, 16)) > 0.25
    keep[..., 0] = True
    kv2 = [rng.standard_normal((2, 2, 16, 8)).astype(np.float32) for _ in range(2)]
    one = lambda *a, **kw: sdpa(*(ms.Tensor(x) for x in a), **kw).asnumpy()    # noqa: E731
    want_mask = one(data[0], data[1], data[2], attn_mask=ms.Tensor(keep))
    want_gqa = one(data[0], kv2[0], kv2[1], is_causal=True, enable_gqa=True)
    for method, rotate, degree, _ in _cases(n):
        hnn.set_rotate_method(rotate)
        q, k, v, mask, k2, v2 = (ms.Tensor(x) for x in (data[0], data[1], data[2], keep, *kv2))
        with hnn.context_parallel(mesh, buffers=[q, k, v, mask, k2, v2], buffer_seq_dims=[2, 2, 2, 3, 2, 2],
                                  method=method, ulysses_degree=degree):
            outs = [sdpa(q, k, v, attn_mask=mask), sdpa(q, k2, v2, is_causal=True, enable_gqa=True)]
            full = hnn.context_parallel_unshard(mesh, outs, [2, 2])
        np.testing.assert_allclose(full[0].asnumpy(), want_mask, err_msg=f"mask {method}/{rotate}", **TOL)
        np.testing.assert_allclose(full[1].asnumpy(), want_gqa, err_msg=f"gqa {method}/{rotate}", **TOL)
    hnn.set_rotate_method("allgather")
    _hyper_parallel_face(n, mesh, data)
    if n == 2:
        from tests._dsa_boundaries import check_dsa_boundaries
        check_dsa_boundaries(mesh)
    if n == 4:
        _cp_with_tp(data, want, want_out[0])
        from tests._dsa_boundaries import check_dsa_with_tensor_parallel
        check_dsa_with_tensor_parallel(DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("cp", "tp")))


def _cp_with_tp(data, want, want_out) -> None:
    """cp = 2 x tp = 2: q, k, v DTensors with their heads cut over tp (Shard(1)), each local piece this
    rank's sequence shard; causal attention inside context_parallel over cp, ring and Ulysses: this
    rank's heads of the output and of the gradients of q, k and v equal one device's (PyNative)."""
    mesh = DeviceMesh("cpu", np.arange(4).reshape(2, 2), mesh_dim_names=("cp", "tp"))
    cp, tp = mesh["cp"], mesh["tp"]
    heads = slice(2 * tp.get_local_rank(0), 2 * tp.get_local_rank(0) + 2)

    def loss(q, k, v, w):
        q, k, v = (DTensor.from_local(x, tp, (Shard(1),)) for x in (q, k, v))
        out = sdpa(q, k, v, is_causal=True)
        assert tuple(out.placements) == (Shard(1),)
        local = out.to_local()
        return (local * w).sum(), local
    for method in ("ring", "ulysses"):
        tensors = [ms.Tensor(d[:, heads]) for d in data[:4]]
        with hnn.context_parallel(cp, buffers=tensors, buffer_seq_dims=[2] * 4, method=method):
            (_, out), grads = ms.value_and_grad(loss, grad_position=(0, 1, 2), has_aux=True)(*tensors)
            full = hnn.context_parallel_unshard(cp, list(grads) + [out], [2] * 4)
        for what, got, ref in zip(("dq", "dk", "dv", "out"), full, list(want[:3]) + [want_out]):
            np.testing.assert_allclose(got.asnumpy(), ref.asnumpy()[:, heads], err_msg=f"cp x tp {method} {what}",
                                       **TOL)


_CAUSAL_2048 = np.triu(np.ones((2048, 2048), np.uint8), 1)     # flash attention's compressed causal mask


class _Core(ms.nn.Cell):
    """MindFormers' core attention in miniature: q, k, v in (layout), attention out (same layout).
    ``"flash"``: BNSD through ``ops.flash_attention_score`` (left-up causal, sparse_mode 2), as on
    Ascend; on CPU ranks its twin computes it (``cpu_twins``), and a DTensor query takes the op's
    sharding rule."""

    def __init__(self, layout: str = "BNSD") -> None:
        super().__init__()
        self.layout = layout
        self.causal = ms.Tensor(_CAUSAL_2048)

    def construct(self, q, k, v, mask=None):
        if self.layout == "BSH":                 # [B, S, N * D]: heads of 8
            b, s, h = q.shape
            q, k, v = (x.reshape(b, s, h // 8, 8).swapaxes(1, 2) for x in (q, k, v))
            return sdpa(q, k, v, is_causal=True).swapaxes(1, 2).reshape(b, s, h)
        if self.layout == "flash":
            return ops.flash_attention_score(q, k, v, q.shape[1], attn_mask=self.causal, scalar_value=8 ** -0.5,
                                             input_layout="BNSD", sparse_mode=2)
        return sdpa(q, k, v, is_causal=True)


class _Attention(ms.nn.Cell):
    """The core behind three handoff Cells (AsyncContextParallel's producers of q, k and v)."""

    def __init__(self, layout: str = "BNSD") -> None:
        super().__init__()
        self.q, self.k, self.v, self.core = ms.nn.Identity(), ms.nn.Identity(), ms.nn.Identity(), _Core(layout)

    def construct(self, q, k, v):
        return self.core(self.q(q), self.k(k), self.v(v), None)


def _hyper_parallel_face(n: int, mesh, data) -> None:
    """ContextParallel / AsyncContextParallel on the core (contiguous shards, MindFormers' cut), every
    mode of this world ("colossal": ulysses_degree 1, "ulysses": None, "hybrid": 2 of 4): the output and
    the gradients of q, k and v equal one device's (PyNative); "flash" runs the colossal query shard
    through FlashAttentionScore's sharding rule (its causal mask moved to the shard's rows)."""
    rank = mesh.get_local_rank(0)
    degrees = [1, None] + ([2] if n == 4 else [])
    cases = [("BNSD", degree, style) for degree in degrees for style in (hnn.ContextParallel, hnn.AsyncContextParallel)]
    cases += [("BSH", 1, hnn.ContextParallel)] + [("flash", degree, hnn.ContextParallel) for degree in degrees]
    for layout, degree, style_class in cases:
        seq_dim = 1 if layout == "BSH" else 2
        full = [d.transpose(0, 2, 1, 3).reshape(2, 16, 32) if layout == "BSH" else d for d in data[:4]]

        def loss(cell, q, k, v, w):
            out = cell(q, k, v)
            return (out * w).sum(), out
        reference, cell = _Attention(layout), _Attention(layout)
        style = style_class(seq_dim=seq_dim, head_dim=2 if layout == "BSH" else 1, ulysses_degree=degree,
                            use_local_output=True)
        if style_class is hnn.AsyncContextParallel:
            style.apply(cell.core, mesh, q_proj=cell.q, k_proj=cell.k, v_proj=cell.v)
        else:
            style._apply(cell.core, mesh)
        length = 16 // n
        mine = lambda x: np.take(x, range(rank * length, (rank + 1) * length), axis=seq_dim)   # noqa: E731
        with cpu_twins():
            (_, want_out), want = ms.value_and_grad(lambda *a: loss(reference, *a), grad_position=(0, 1, 2),
                                                    has_aux=True)(*(ms.Tensor(d) for d in full))
            (_, out), got = ms.value_and_grad(lambda *a: loss(cell, *a), grad_position=(0, 1, 2),
                                              has_aux=True)(*(ms.Tensor(mine(d)) for d in full))
        case = f"{style_class.__name__} {layout} ulysses_degree={degree}"
        np.testing.assert_allclose(out.asnumpy(), mine(want_out.asnumpy()), err_msg=f"{case} out", **TOL)
        for what, g, w in zip(("dq", "dk", "dv"), got, want):
            np.testing.assert_allclose(g.asnumpy(), mine(w.asnumpy()), err_msg=f"{case} {what}", **TOL)


@multi_rank(2)
def test_context_parallel_equals_one_device_on_two_ranks():
    _cp_against_one_device()


@multi_rank(4)
def test_context_parallel_equals_one_device_on_four_ranks():
    _cp_against_one_device()
