"""Smoke tests of the seam's tensor-hook contracts (hyper_parallel_ms/_mindspore/hooks.py):
the hook, subclass views, seeded dropout, op interception. After a MindSpore upgrade, the
failing test names the contract that changed."""
from __future__ import annotations

import os
import sys

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, mint, nn, ops

from hyper_parallel_ms import _mindspore as seam


_CALLS: list = []


def _record(func, args, kwargs):
    _CALLS.append(getattr(func, "name", None) or getattr(func, "__name__", "?"))
    with seam.no_hook():
        out = func(*args, **kwargs)
    return seam.adopt(out, _Hooked) if type(out) is Tensor else out


def _refuse(func, args, kwargs):
    raise ValueError("refused by the hook")


class _Hooked(Tensor):
    __fallback__ = seam.tensor_hook(_record)


class _Refusing(Tensor):
    __fallback__ = seam.tensor_hook(_refuse)


def _hooked(values) -> Tensor:
    return seam.as_subclass(_Hooked, Tensor(np.array(values, np.float32)))


def test_contract_tensor_hook_sees_functional_ops_operators_and_methods():
    x = _hooked([1.0, 2.0])
    _CALLS.clear()
    for y in (ops.add(x, x), x * x, x.sum()):
        assert type(y) is _Hooked
    assert len(_CALLS) == 3, _CALLS
    np.testing.assert_allclose(ops.add(x, x).asnumpy(), [2.0, 4.0])


def test_contract_ops_handed_to_the_hook_return_results_the_caller_owns():
    """mint's overloaded ops hand the hook an op object; on 2.8 / 2.9 its results come back
    already released (the seam calls the overloaded function instead): each result here must
    hold exactly the references its plain twin holds, and the right values."""
    values = np.array([[3.0, 1.0], [2.0, 5.0]], np.float32)
    x, plain = _hooked(values), Tensor(values)
    cases = {"AddExt": lambda t: mint.add(t, t), "AddScalar": lambda t: mint.add(t, 0.5),
             "MaxDim": lambda t: mint.max(t, 1), "Select": lambda t: mint.where(plain > 2, t, plain)}
    for name, op in cases.items():
        _CALLS.clear()
        got, want = op(x), op(plain)
        assert name in _CALLS, (name, _CALLS)
        assert sys.getrefcount(got) == sys.getrefcount(want), name
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert sys.getrefcount(g) == sys.getrefcount(w), name
            np.testing.assert_array_equal(g.asnumpy(), w.asnumpy())


def test_contract_no_hook_guard_runs_ops_as_on_plain_tensors():
    x = _hooked([1.0, 2.0])
    _CALLS.clear()
    with seam.no_hook():
        y = ops.mul(x, x)
    assert _CALLS == [] and type(y) is Tensor
    np.testing.assert_allclose(y.asnumpy(), [1.0, 4.0])


def test_contract_hook_errors_keep_their_type():
    x = seam.as_subclass(_Refusing, Tensor(np.ones(2, np.float32)))
    with pytest.raises(ValueError, match="refused by the hook"):
        with seam.original_hook_errors():
            ops.add(x, x)
    seam.guard_mindspore_for(_Refusing)   # on 2.8 / 2.9: MindSpore's op entry points keep hook errors
    for run in (lambda: ops.add(x, x), lambda: ops.matmul(x, x), lambda: ops.cumsum(x, 0), lambda: mint.add(x, x),
                lambda: nn.Dense(2, 2)(x), lambda: ops.cat([x, x])):
        with pytest.raises(ValueError, match="refused by the hook"):
            run()


def test_contract_list_arguments_reach_the_hook_only_where_declared():
    x = _hooked([1.0, 2.0])
    _CALLS.clear()
    out = ops.cat([x, x])
    assert bool(_CALLS) == seam.LIST_ARGS_REACH_HOOK, (ms.__version__, _CALLS)
    assert tuple(out.shape) == (4,)


def test_contract_tuple_arguments_reach_the_hook_for_made_and_adopted_objects():
    made = _hooked([1.0, 2.0])
    _CALLS.clear()
    ops.cat((made, made))
    assert _CALLS, "a tuple of _make_subclass objects no longer reaches the hook"
    swapped = ops.add(Tensor([1.0]), Tensor([2.0]))
    swapped.__class__ = _Hooked            # how adopt() makes the subclass where it can
    _CALLS.clear()
    ops.cat((swapped, swapped))
    assert bool(_CALLS) == seam.ADOPTED_REACH_HOOK, (ms.__version__, _CALLS)


def test_contract_class_swapped_objects_reach_the_hook_in_legacy_primitives_where_declared():
    swapped = ops.add(Tensor([1.0]), Tensor([2.0]))
    swapped.__class__ = _Hooked
    _CALLS.clear()
    ops.reduce_sum(swapped)                # the legacy ReduceSum primitive
    assert bool(_CALLS) == seam.ADOPTED_REACH_HOOK, (ms.__version__, _CALLS)
    adopted = seam.adopt(ops.add(Tensor([1.0]), Tensor([2.0])), _Hooked)
    for run in (lambda t: ops.reduce_sum(t), lambda t: ops.cat((t, t))):   # adopt() reaches it everywhere
        _CALLS.clear()
        assert type(run(adopted)) is _Hooked and _CALLS, (ms.__version__, _CALLS)


def test_contract_make_subclass_shares_storage_and_gradients():
    base = Tensor(np.array([1.0, 2.0], np.float32))
    view = seam.as_subclass(_Hooked, base)
    assert type(view) is _Hooked and type(seam.as_subclass(Tensor, view)) is Tensor
    ops.assign(seam.as_subclass(Tensor, view), Tensor(np.array([5.0, 6.0], np.float32)))
    np.testing.assert_allclose(base.asnumpy(), [5.0, 6.0])
    grad = ms.grad(lambda t: (seam.as_subclass(Tensor, t) * 3.0).sum())(base)
    np.testing.assert_allclose(grad.asnumpy(), [3.0, 3.0])


def test_contract_class_swap_adopts_an_op_result():
    y = seam.adopt(ops.add(Tensor([1.0]), Tensor([2.0])), _Hooked)
    assert type(y) is _Hooked
    np.testing.assert_allclose(y.asnumpy(), [3.0])


def test_contract_seeded_dropout_is_the_primitive_behind_ops_dropout():
    assert seam.seeded_dropout.name == "FuncDropoutExt"


@pytest.mark.npu
@pytest.mark.skipif(os.environ.get("HPMS_TEST_DEVICE") != "Ascend",
                    reason="DropoutExt has no CPU kernel; CPU twin: the test above")
def test_contract_seeded_dropout_draws_its_mask_from_seed_and_offset():
    ms.set_device("Ascend")
    x, offset = Tensor(np.ones((64,), np.float32)), Tensor(0, ms.int64)
    a, b, c = (seam.seeded_dropout(x, 0.5, True, False, Tensor(seed, ms.int64), offset).asnumpy()
               for seed in (7, 7, 8))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c) and set(np.unique(a)) <= {0.0, 2.0}


def test_contract_op_interception_sees_primitive_names_and_keeps_gradients_and_replacements_are_used():
    """What selective checkpointing relies on: an interception returning ``run()`` leaves autodiff
    as without it (the forward), and a returned replacement is what later ops compute on (the
    recompute, whose own graph is never differentiated). Gradients through a replacement are not
    relied on (measured: they are not those of the replaced value)."""
    assert seam.OP_INTERCEPTION

    class Seen(seam.OpInterception):
        def __init__(self, replace=None):
            super().__init__()
            self.names, self.replace = [], replace

        def on_op(self, name, run):
            self.names.append(name)
            out = run()
            return self.replace if name == "Tanh" and self.replace is not None else out
    x = Tensor(np.random.RandomState(1).randn(3, 4).astype(np.float32))
    cell = nn.Dense(4, 4)
    seen = Seen()

    def fn(v):
        with seen:
            return (ops.tanh(cell(v)) ** 2).sum()
    loss, grads = ms.value_and_grad(fn, None, cell.trainable_params())(x)
    want_loss, want = ms.value_and_grad(lambda v: (ops.tanh(cell(v)) ** 2).sum(), None, cell.trainable_params())(x)
    assert "MatMul" in seen.names and "Tanh" in seen.names
    np.testing.assert_allclose(loss.asnumpy(), want_loss.asnumpy(), rtol=1e-6)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g.asnumpy(), w.asnumpy(), rtol=1e-6, atol=1e-7)
    with Seen(replace=Tensor(np.full((3, 4), 0.5, np.float32))):
        replaced = (ops.tanh(cell(x)) ** 2).sum()
    assert float(replaced.asnumpy()) == 3.0


class _ScalarProbe(Tensor):
    """Overrides the two private reads that DTensor overrides (test_contract_scalar_reads_...)."""

    def _item(self):
        return 7

    def _tolist(self):
        return ["probe"]


def test_contract_scalar_reads_route_through_item_and_tolist():
    """DTensor refuses scalar reads of a Partial value by overriding Tensor._item / _tolist:
    item(), float(), int(), bool() and tolist() must reach them."""
    t = seam.as_subclass(_ScalarProbe, Tensor(np.array([1.0], np.float32)))
    assert t.item() == 7 and float(t) == 7.0 and int(t) == 7 and bool(t) is True and t.tolist() == ["probe"]
