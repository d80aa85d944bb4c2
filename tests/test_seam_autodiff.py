"""Smoke tests of the seam's autodiff contracts (hyper_parallel_ms/_mindspore/autodiff.py): the
PyNative tape, saved-tensor hooks, recompute, the executor after a failed gradient call."""
from __future__ import annotations

import contextlib

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, mint, nn, ops

from hyper_parallel_ms import _mindspore as seam


def test_contract_tape_keeps_several_forwards_and_differentiates_them_in_any_order():
    """Pipeline stages keep each micro-batch's forward (one forward per micro-batch): tapes of
    several forwards live at once, their backwards run in any order, a kept tape serves a
    second call (input gradient, then weight gradient), an unreached input gives None, and
    ms.vjp cannot do the same (it finds only the latest forward)."""
    calls = []

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.dense = nn.Dense(3, 3)
            self.unused = ms.Parameter(Tensor(np.ones(2, np.float32)), name="unused")

        def construct(self, x):
            calls.append(1)
            return ops.tanh(self.dense(x))

    ms.set_seed(0)
    net = Net()
    weights = [net.dense.weight, net.dense.bias]
    xs = [Tensor(np.random.RandomState(i).randn(2, 3).astype(np.float32)) for i in range(3)]
    sens = [Tensor(np.random.RandomState(9 + i).randn(2, 3).astype(np.float32)) for i in range(3)]
    want = [ms.grad(lambda x, s=s: (net(x) * s).sum(), grad_position=0, weights=weights)(x) for x, s in zip(xs, sens)]
    calls.clear()
    outs = []
    with seam.taped():
        for x in xs:
            x.requires_grad_()
            outs.append(net(x))
    assert len(calls) == 3 and all(o._grad_node is not None for o in outs)
    assert net(xs[0])._grad_node is None                      # the flag is restored
    for m in (2, 0):
        got = seam.tape_backward([outs[m]], [sens[m]], [xs[m]] + weights + [net.unused])
        np.testing.assert_allclose(got[0].asnumpy(), want[m][0].asnumpy(), rtol=1e-6, atol=1e-7)
        for g, w in zip(got[1:3], want[m][1]):
            np.testing.assert_allclose(g.asnumpy(), w.asnumpy(), rtol=1e-6, atol=1e-7)
        assert got[3] is None
    dx, = seam.tape_backward([outs[1]], [sens[1]], [xs[1]], keep_graph=True)
    dw = seam.tape_backward([outs[1]], [sens[1]], weights)
    np.testing.assert_allclose(dx.asnumpy(), want[1][0].asnumpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dw[0].asnumpy(), want[1][1][0].asnumpy(), rtol=1e-6, atol=1e-7)
    assert len(calls) == 4                                     # no forward ran again

    pending = [ms.vjp(net, x, weights=weights)[1] for x in xs[:2]]
    with pytest.raises(RuntimeError, match="Can not find top cell for backward"):
        pending[0](sens[0])


class _KeepsOutput(nn.Cell):
    """A custom-bprop Cell (as fully_shard's gathering Cell): MindSpore keeps its input and output."""

    def construct(self, x):
        return x * 2.0

    def bprop(self, x, out, dout):
        return (dout * 2.0,)


def test_contract_saved_tensor_hooks_see_kept_tensors_by_address_and_the_backward_reads_unpack():
    assert seam.SAVED_TENSOR_HOOKS
    w = ms.Parameter(Tensor(np.arange(6, dtype=np.float32).reshape(2, 3)), name="w")
    x = Tensor(np.ones((4, 3), np.float32))
    addresses, packed = {}, []

    def pack(t):
        packed.append(seam.tensor_address(t))
        return ("kept", len(packed) - 1, t)

    def unpack(kept):
        return kept[2] if packed[kept[1]] != addresses["full"] else recomputed["full"]

    recomputed = {}

    def loss(v):
        with seam.saved_tensors_hooks(pack, unpack):
            full = _KeepsOutput()(w)
            addresses["full"] = seam.tensor_address(full)
            with seam.no_grad():
                recomputed["full"] = full * 1.0          # what the backward will read instead
            out = mint.nn.functional.linear(v, full)
        return out.sum()
    value, (grad,) = ms.value_and_grad(loss, None, [w])(x)
    assert packed.count(addresses["full"]) >= 2        # the Cell's output and linear's weight
    np.testing.assert_allclose(grad.asnumpy(), np.full((2, 3), 8.0))
    assert float(value.asnumpy()) == float((x.asnumpy() @ (2 * w.asnumpy()).T).sum())


def test_contract_custom_bprop_cells_need_the_top_graph_of_taped_call():
    """Tensor-parallel styles and fully_shard run collectives as Cells with a custom bprop: under
    the bare grad flag they fail ("top_cell_ is null"); taped_call records a top graph, several
    such tapes differentiate in any order with the custom bprop honoured, and an input-only
    backward does not run the custom bprop a weight reaches (so a zero-bubble I never reduces a
    fully_shard gradient, its W does, once)."""
    bprops = []

    class Scaled(nn.Cell):                       # forward x * 2, backward dout * 3 (on purpose)
        def construct(self, x):
            return x * 2

        def bprop(self, x, out, dout):
            bprops.append(1)
            return (dout * 3,)

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.dense = nn.Dense(3, 3)
            self.w = ms.Parameter(Tensor(np.ones((3, 3), np.float32)), name="w")
            self.scaled = Scaled()

        def construct(self, x):
            return ops.matmul(ops.tanh(self.dense(x)), self.scaled(self.w))

    ms.set_seed(0)
    net = Net()
    weights = [net.dense.weight, net.dense.bias, net.w]
    xs = [Tensor(np.random.RandomState(i).randn(2, 3).astype(np.float32)) for i in range(3)]
    one = Tensor(np.ones((2, 3), np.float32))
    want = [ms.grad(lambda x: net(x).sum(), grad_position=0, weights=weights)(x) for x in xs]
    with pytest.raises(RuntimeError, match="top_cell_"):
        with seam.taped():
            net(xs[0])
    outs = []
    for x in xs:
        x.requires_grad_()
        outs.append(seam.taped_call(net, x))
    assert net(xs[0])._grad_node is None                      # the flag is restored
    for m in (1, 0):
        got = seam.tape_backward([outs[m]], [one], [xs[m]] + weights)
        for g, w in zip(got, (want[m][0],) + tuple(want[m][1])):
            np.testing.assert_allclose(g.asnumpy(), w.asnumpy(), rtol=1e-6, atol=1e-7)
    bprops.clear()
    dx, = seam.tape_backward([outs[2]], [one], [xs[2]], keep_graph=True)
    assert not bprops                                          # the input gradient skips the weight's bprop
    dw = seam.tape_backward([outs[2]], [one], weights)
    assert len(bprops) == 1
    np.testing.assert_allclose(dx.asnumpy(), want[2][0].asnumpy(), rtol=1e-6, atol=1e-7)
    for g, w in zip(dw, want[2][1]):
        np.testing.assert_allclose(g.asnumpy(), w.asnumpy(), rtol=1e-6, atol=1e-7)


def test_contract_taped_call_of_a_compiled_forward_keeps_it_for_one_backward():
    """Compiled pipeline stages: ``taped_call`` of an ``ms.jit`` function runs the forward once as a
    graph (an ``assign_add`` counter sees one run, Python side effects none) and keeps what its
    compiled backward reads; several kept records differentiate in any order, exactly, without
    running the forward again. A second backward of one record after ``keep_graph=True`` returns
    ``None`` for what the first left out (so the runtime's compiled I computes W's gradients too)."""
    python_runs = []

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.dense = nn.Dense(3, 3)
            self.runs = ms.Parameter(Tensor(np.zeros(1, np.float32)), requires_grad=False, name="runs")

        def construct(self, x):
            python_runs.append(1)
            ops.assign_add(self.runs, ops.ones((1,), ms.float32))
            return ops.tanh(self.dense(x)) + x

    ms.set_seed(0)
    net = Net()
    weights = [net.dense.weight, net.dense.bias]

    def forward(x):
        return net(x)
    compiled = ms.jit(forward)
    xs = [Tensor(np.random.RandomState(i).randn(2, 3).astype(np.float32)) for i in range(3)]
    sens = Tensor(np.random.RandomState(7).randn(2, 3).astype(np.float32))
    want = [ms.grad(lambda x: (net(x) * sens).sum(), grad_position=0, weights=weights)(x) for x in xs]
    python_runs.clear()
    runs = float(net.runs.asnumpy()[0])
    outs = []
    for x in xs:
        x.requires_grad_()
        outs.append(seam.taped_call(compiled, x))
    assert not python_runs and float(net.runs.asnumpy()[0]) == runs + 3
    for m in (1, 0):
        got = seam.tape_backward([outs[m]], [sens], [xs[m]] + weights)
        for g, w in zip(got, (want[m][0],) + tuple(want[m][1])):
            np.testing.assert_allclose(g.asnumpy(), w.asnumpy(), rtol=1e-6, atol=1e-7)
    assert float(net.runs.asnumpy()[0]) == runs + 3                 # no forward ran again
    dx, = seam.tape_backward([outs[2]], [sens], [xs[2]], keep_graph=True)
    np.testing.assert_allclose(dx.asnumpy(), want[2][0].asnumpy(), rtol=1e-6, atol=1e-7)
    assert seam.tape_backward([outs[2]], [sens], weights) == (None, None)


def test_contract_an_error_inside_taped_call_leaves_the_executor_usable():
    """A pipeline stage raising inside its recorded forward: the failing rank still reads, sends and
    agrees afterwards, so later calls must work: a new record differentiates exactly, and one kept
    from before the error still does."""
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.dense = nn.Dense(3, 3)
            self.fail = False

        def construct(self, x):
            y = ops.tanh(self.dense(x))
            if self.fail:
                raise RuntimeError("stage failed")
            return y

    ms.set_seed(0)
    net = Net()
    weights = net.trainable_params()
    x = Tensor(np.random.RandomState(3).randn(2, 3).astype(np.float32))
    x.requires_grad_()
    kept = seam.taped_call(net, x)
    net.fail = True
    try:
        with pytest.raises(RuntimeError, match="stage failed"):
            seam.taped_call(net, x)
        net.fail = False
        want = ms.grad(lambda v: net(v).sum(), grad_position=0, weights=weights)(x)
        out = seam.taped_call(net, x)
        one = Tensor(np.ones((2, 3), np.float32))
        for record in (out, kept):
            got = seam.tape_backward([record], [one], [x] + weights)
            for g, w in zip(got, (want[0],) + tuple(want[1])):
                np.testing.assert_allclose(g.asnumpy(), w.asnumpy(), rtol=1e-6, atol=1e-7)
    finally:
        seam.discard_grad_recording()         # the failed call leaves MindSpore recording (contract below)


def test_contract_a_failed_taped_call_leaves_a_record_open_until_discard_tapes():
    """The record a failed taped_call leaves open (so that earlier ones still differentiate) takes in
    every later op once a gradient call and a taped block have run; discard_tapes (what a failed pipeline step calls) drops
    it, and the executor records only inside taped blocks again."""
    stage, bad = nn.Dense(6, 8), nn.Dense(5, 4)
    x = Tensor(np.ones((2, 6), np.float32))

    def two_stages(v):
        return bad(stage(v))                 # 8 features into a Dense of 5: MindSpore raises

    def recorded_outside_a_taped_block() -> bool:
        ms.grad(lambda v: stage(v).sum())(x)
        with seam.taped():
            stage(x)
        return stage(x)._grad_node is not None

    assert not recorded_outside_a_taped_block()
    with pytest.raises(ValueError):
        seam.taped_call(two_stages, x)
    assert recorded_outside_a_taped_block()     # the open record: a silent leak without discard_tapes
    seam.discard_tapes()
    assert not recorded_outside_a_taped_block()


class _Mlp(nn.Cell):
    def __init__(self):
        super().__init__()
        self.up = nn.Dense(4, 5)
        self.down = nn.Dense(5, 4)

    def construct(self, x):
        return self.down(ops.tanh(self.up(x)))


def _mlp_grads(fn, cell, x):
    return ms.value_and_grad(lambda v: (fn(v) ** 2).sum(), None, cell.trainable_params())(x)[1]


def test_contract_non_reentrant_recompute_reruns_the_whole_call_and_reads_parameters_when_it_runs():
    """Also why Cell.recompute() is not used: it keeps the parameters of when it was called."""
    def made():
        ms.set_seed(0)
        return _Mlp()
    plain, cell, old_style = made(), made(), made()
    x = Tensor(np.random.RandomState(0).randn(3, 4).astype(np.float32))
    hooks = []
    cell.register_forward_pre_hook(lambda c, args: hooks.append("pre"))
    cell.register_forward_hook(lambda c, args, out: hooks.append("post"))
    old_style.recompute()
    for m in (plain, cell, old_style):         # replaced after wrapping, as the parallel engines do
        m.up.weight = ms.Parameter(Tensor(np.full((5, 4), 0.3, np.float32)), name=m.up.weight.name)
        m.down.weight = ms.Parameter(Tensor(np.full((4, 5), 0.2, np.float32)), name=m.down.weight.name)
    want = _mlp_grads(plain, plain, x)
    enter = []

    @contextlib.contextmanager
    def recompute_ctx():
        enter.append("recompute")
        yield
    got = _mlp_grads(lambda v: seam.recompute_eagerly(cell.__call__, (v,), {},
                                                      lambda: (contextlib.nullcontext(), recompute_ctx())), cell, x)
    assert hooks == ["pre", "post", "pre", "post"] and enter == ["recompute"]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.asnumpy(), w.asnumpy(), rtol=1e-6, atol=1e-7)
    stale = _mlp_grads(old_style, old_style, x)
    assert float(np.abs(stale[0].asnumpy()).max()) == 0.0 < float(np.abs(want[0].asnumpy()).max())


def test_contract_graph_recompute_of_a_bound_method_adds_its_forward_ops_to_the_backward(tmp_path):
    class Wrapped(_Mlp):
        def construct(self, x):
            return seam.recompute_in_graph(self.inner, x)

        def inner(self, x):
            return _Mlp.construct(self, x)

    def matmuls(cell, where):
        x = Tensor(np.ones((3, 4), np.float32))
        ms.set_context(save_graphs=True, save_graphs_path=str(where))
        def loss(v):
            return (cell(v) ** 2).sum()
        try:
            grads = ms.jit(ms.value_and_grad(loss, None, cell.trainable_params()))(x)[1]
        finally:
            ms.set_context(save_graphs=False)
        text = next(where.glob("*_validate_*.ir")).read_text()
        return text.count("PrimFunc_MatMul(") + text.count("MatMul("), grads
    ms.set_seed(0)
    plain_count, want = matmuls(_Mlp(), tmp_path / "plain")
    ms.set_seed(0)
    count, got = matmuls(Wrapped(), tmp_path / "wrapped")
    assert count > plain_count > 0, (plain_count, count)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.asnumpy(), w.asnumpy(), rtol=1e-6, atol=1e-7)


def test_contract_recomputing_is_seen_in_the_forward_and_in_the_backward_recompute():
    """fully_shard does not free gathered values itself inside an activation checkpoint: it asks
    recomputing(), which must hold in the checkpointed forward and in its recompute."""
    if not seam.RECOMPUTE_CONTEXT_FN:
        pytest.skip("recompute(use_reentrant=False, context_fn=...) needs MindSpore 2.9+")
    seen = []
    w = ms.Parameter(Tensor(np.ones((3, 3), np.float32)), name="w")

    def block(x):
        seen.append(seam.recomputing())
        return ops.tanh(ops.matmul(x, w))

    x = Tensor(np.ones((2, 3), np.float32))
    grad = ms.grad(lambda v: seam.recompute_eagerly(block, (v,), {}).sum(), None, [w])(x)
    assert seen == [True, True] and not seam.recomputing()
    want = ms.grad(lambda v: block(v).sum(), None, [w])(x)
    np.testing.assert_allclose(grad[0].asnumpy(), want[0].asnumpy(), rtol=1e-6)


def _inplace_update_works() -> bool:
    p = ms.Parameter(Tensor(np.ones(3, np.float32)), name="probe")
    try:
        p.copy_(Tensor(np.zeros(3, np.float32)))
        return bool((p.asnumpy() == 0).all())
    except RuntimeError:
        return False


def test_contract_an_error_inside_a_gradient_call_leaves_the_executor_recording():
    """A forward raising inside value_and_grad leaves the grad flag on and its top cell pending: a
    later in-place update of a Parameter fails, even after another gradient call; clear_res (the
    seam's discard_grad_recording) ends it, and gradients stay right."""
    w = ms.Parameter(Tensor(np.ones(3, np.float32)), name="w")
    x = Tensor(np.full(3, 2.0, np.float32))

    def loss(v, fail):
        y = (v * w).sum()
        if fail:
            raise ValueError("refused inside the forward")
        return y
    grad_fn = ms.value_and_grad(loss, None, [w])
    try:
        assert _inplace_update_works()
        with pytest.raises(ValueError, match="refused"):
            grad_fn(x, True)
        assert not _inplace_update_works()
        seam.discard_grad_recording()
        assert _inplace_update_works()
        np.testing.assert_allclose(grad_fn(x, False)[1][0].asnumpy(), [2.0, 2.0, 2.0])
        assert _inplace_update_works()
        seam.discard_grad_recording()                 # not recording: nothing to drop
        assert _inplace_update_works()
    finally:
        seam.discard_grad_recording()


def test_contract_recording_gradients_is_seen_inside_a_gradient_call_only():
    """The grad flag: on while ms.grad / ms.value_and_grad run the function (fully_shard ends a round of
    a list of Cells gathered under another flag), off before and after."""
    w = ms.Parameter(Tensor(np.ones(3, np.float32)), name="w")
    seen = []

    def loss(v):
        seen.append(seam.recording_gradients())
        return (v * w).sum()
    assert not seam.recording_gradients()
    ms.value_and_grad(loss, None, [w])(Tensor(np.ones(3, np.float32)))
    loss(Tensor(np.ones(3, np.float32)))
    assert seen == [True, False] and not seam.recording_gradients()


def test_contract_random_state_holds_the_seeds_functional_random_ops_draw():
    """ops.dropout takes its seeds from per-op counters it advances in Python at each call
    (mindspore.common.seed._KERNEL_SEED): putting back random_state() draws the same mask again."""
    ms.set_seed(3)
    x = Tensor(np.ones((64,), np.float32))
    state = seam.random_state()
    first = ops.dropout(x, p=0.5).asnumpy()
    second = ops.dropout(x, p=0.5).asnumpy()
    assert not np.array_equal(first, second)           # the counters moved on
    seam.set_random_state(state)
    np.testing.assert_array_equal(ops.dropout(x, p=0.5).asnumpy(), first)
