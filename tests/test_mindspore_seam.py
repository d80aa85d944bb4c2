"""One smoke test per MindSpore contract the seam (hyper_parallel_ms/_mindspore/) relies
on: after a MindSpore upgrade, the failing test names the contract that changed."""
from __future__ import annotations

import contextlib
import inspect
import os
import subprocess
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


class _NeverCompiled(Tensor):
    """Registered with reject_in_compiled_args by the test below (only this test class)."""


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


_COMPILE_TIME: list = []


@seam.run_in_python
def _python_at_compile_time(n: int):
    _COMPILE_TIME.append(seam.is_compiling())
    return n * 2


@ms.jit
def _jitted(x):
    return x * _python_at_compile_time(3)


def test_contract_lru_cache_runs_python_at_compile_time_and_is_compiling_fires():
    _COMPILE_TIME.clear()
    np.testing.assert_allclose(_jitted(Tensor([1.0])).asnumpy(), [6.0])
    assert _COMPILE_TIME == [True]            # ran once, in Python, while ms.jit compiled
    assert _python_at_compile_time(2) == 4 and _COMPILE_TIME[-1] is False


class _Scale(nn.Cell):
    def construct(self, x):
        return x * _python_at_compile_time(5)


def test_contract_is_compiling_fires_for_graph_mode_cells():
    _COMPILE_TIME.clear()
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        out = _Scale()(Tensor([1.0]))
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    np.testing.assert_allclose(out.asnumpy(), [10.0])
    assert _COMPILE_TIME == [True]


def _takes(first, second):
    return first + second


def test_contract_compile_entry_points_see_the_arguments():
    seam.reject_in_compiled_args(_NeverCompiled)
    odd = seam.as_subclass(_NeverCompiled, Tensor([1.0]))
    with pytest.raises(TypeError, match=r"argument 'second' of the ms.jit function '_takes'.*to_local"):
        ms.jit(_takes)(Tensor([1.0]), odd)
    with pytest.raises(TypeError, match=r"argument 'x\[1\]' of the ms.jit function"):
        ms.jit(lambda x: x[0])((Tensor([1.0]), odd))
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        with pytest.raises(TypeError, match=r"argument 'x' of the GRAPH_MODE Cell '_Scale.construct'"):
            _Scale()(odd)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    np.testing.assert_allclose(ms.jit(_takes)(Tensor([1.0]), Tensor([2.0])).asnumpy(), [3.0])


def _tagged(tag: str, calls: list):
    def wrap(original):
        def call(*args, **kwargs):
            calls.append(tag)
            return original(*args, **kwargs)
        return call
    return wrap


def test_contract_entry_points_are_looked_up_at_call_time_and_swaps_restore_exactly():
    """MindSpore's functions and Cell methods are module / class attributes looked up at each
    call (``nn.CrossEntropyLoss`` reaches ``ops.cross_entropy`` so): swapping one reroutes every
    later call; leaving a scope puts back the same objects, after an error too, scopes nest, an
    inherited attribute is removed again, and a failing wrap leaves nothing swapped."""
    calls: list = []
    x, target = Tensor(np.ones((2, 3), np.float32)), Tensor(np.array([0, 2], np.int32))
    original, construct = vars(ops)["cross_entropy"], vars(nn.CrossEntropyLoss)["construct"]
    with seam.entry_points_swapped([(ops, "cross_entropy", _tagged("outer", calls))]):
        outer = vars(ops)["cross_entropy"]
        with seam.entry_points_swapped([(ops, "cross_entropy", _tagged("inner", calls)),
                                        (nn.CrossEntropyLoss, "__call__", _tagged("cell", calls))]):
            loss = nn.CrossEntropyLoss()(x, target)
            assert calls == ["cell", "inner", "outer"]
        assert vars(ops)["cross_entropy"] is outer and "__call__" not in vars(nn.CrossEntropyLoss)
        np.testing.assert_allclose(ops.cross_entropy(x, target).asnumpy(), loss.asnumpy())
        with pytest.raises(ValueError, match="inside"):
            with seam.entry_points_swapped([(ops, "cross_entropy", _tagged("again", calls))]):
                raise ValueError("raised inside")
        assert vars(ops)["cross_entropy"] is outer

    def refuse(fn):
        raise RuntimeError("wrap refused")
    with pytest.raises(RuntimeError, match="refused"):
        seam.swap_entry_points([(ops, "cross_entropy", _tagged("x", calls)), (ops, "softmax", refuse)])
    assert vars(ops)["cross_entropy"] is original and vars(nn.CrossEntropyLoss)["construct"] is construct


def test_contract_point_to_point_kernels_exist_and_mint_send_still_reads_the_ascend_world_group():
    """The kernels behind mint.distributed.send / recv (their exchange on 2 ranks:
    tests/test_comm_p2p.py); and the reason to call them directly: mint.distributed.send's
    own-rank check still reads hccl_world_group, which a CPU process does not have."""
    from hyper_parallel_ms._mindspore.p2p import _p2p_kernels
    isend, irecv = _p2p_kernels()
    assert callable(isend) and callable(irecv)
    check = inspect.signature(mint.distributed.distributed.get_cache_group_rank).parameters["group"]
    assert check.default == "hccl_world_group"


def test_placement_and_layout_load_no_mindspore():
    code = ("import sys, hyper_parallel_ms.placement, hyper_parallel_ms.layout, hyper_parallel_ms\n"
            "hyper_parallel_ms.Shard(0)\n"
            "assert 'mindspore' not in sys.modules, 'mindspore was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_dtensor_ops_import_the_rules_on_first_use():
    code = ("import sys\n"
            "import mindspore as ms\n"
            "from hyper_parallel_ms.dtensor import DTensor, distribute_tensor\n"
            "from hyper_parallel_ms.mesh import init_device_mesh\n"
            "from hyper_parallel_ms.placement import Shard\n"
            "assert 'hyper_parallel_ms.ops' not in sys.modules, 'importing dtensor imported ops'\n"
            "dt = distribute_tensor(ms.Tensor([[1.0, 2.0]]), init_device_mesh('cpu', (1,)), [Shard(0)])\n"
            "y = dt + dt\n"
            "assert isinstance(y, DTensor) and y.placements == (Shard(0),), y\n")
    subprocess.run([sys.executable, "-c", code], check=True)


_EAGER_CALLS: list = []


def _eager_only_work(x):
    _EAGER_CALLS.append(type(x).__name__)         # plain Python: never compiled
    return x * 3


class _EagerOrGraph(nn.Cell):
    def construct(self, x):
        if seam.running_eagerly():
            return _eager_only_work(x)
        return x * 2


def test_contract_running_eagerly_keeps_a_branch_out_of_graphs():
    _EAGER_CALLS.clear()
    cell, x = _EagerOrGraph(), Tensor([1.0])
    np.testing.assert_allclose(cell(x).asnumpy(), [3.0])
    np.testing.assert_allclose(ms.jit(cell.construct)(x).asnumpy(), [2.0])
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        np.testing.assert_allclose(_EagerOrGraph()(x).asnumpy(), [2.0])
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert _EAGER_CALLS == ["Tensor"]


class _GraphCodeOrPython(nn.Cell):
    """``v`` is 2.0 when compiled as graph code, 3.0 when Python runs the property (also during a compile)."""

    @property
    def v(self):
        if seam.compiling_graph_code():
            return 2.0
        return 3.0

    def construct(self, x):
        return x * self.v

    def extend_repr(self):
        return f"v={self.v}"          # read by Python while GRAPH_MODE compiles (its repr)


def test_contract_compiling_graph_code_tells_graph_code_from_python_run_during_a_compile():
    cell, x = _GraphCodeOrPython(), Tensor([1.0])
    np.testing.assert_allclose(cell(x).asnumpy(), [3.0])
    np.testing.assert_allclose(ms.jit(cell.construct)(x).asnumpy(), [2.0])
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        np.testing.assert_allclose(_GraphCodeOrPython()(x).asnumpy(), [2.0])
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert "v=3.0" in repr(cell)


def test_contract_first_call_checks_run_once_and_a_forward_hook_always_called_runs_on_errors():
    dense = nn.Dense(2, 2)
    assert not dense._init_flag or not dense._is_check_and_refresh       # MindSpore's first call would check
    seam.run_first_call_checks(dense)
    assert dense._init_flag and dense._is_check_and_refresh
    seen = []
    dense.register_forward_hook(lambda cell, args, out: seen.append(out), always_call=True)
    with pytest.raises(Exception):
        dense(Tensor(np.ones((1, 3), np.float32)))            # wrong width: the forward raises
    assert seen == [None]


class _Base(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = ms.Parameter(Tensor(np.ones((2,), np.float32)), name="w")

    def construct(self, x):
        return x * self.w


class _Doubled(_Base):
    """``w`` read through a property computing from the parameter table."""

    @property
    def w(self):
        return self._params["w"] * 2.0


class _Wrapped(_Doubled):
    """Inherits the property and wraps the base construct: only right as a ``cell_subclass``."""
    _inner = _Base.construct

    def construct(self, x):
        return self._inner(x)


_SWAPPED = seam.cell_subclass("_Wrapped", (_Doubled,), {"_inner": _Base.construct, "construct": _Wrapped.construct})


class _GradOf(nn.Cell):
    def __init__(self, cell):
        super().__init__()
        self.cell = cell
        self.weights = ms.ParameterTuple(cell.trainable_params())

    def loss(self, x):
        return (self.cell(x) ** 2).sum()

    def construct(self, x):
        return ms.grad(self.loss, None, self.weights)(x)


@pytest.mark.parametrize("mode", ["jit", "graph"])
@pytest.mark.parametrize("cls", [_Doubled, _Wrapped, _SWAPPED])
def test_contract_only_a_cells_own_properties_compile_as_graph_code(cls, mode):
    # An inherited property is evaluated in Python while MindSpore compiles: a constant, no gradient.
    # Every class swap (styles' construct wrappers, fully_shard's gathered properties) goes through
    # seam.cell_subclass, which declares the properties again in the new class.
    cell = _Base()
    cell.__class__ = cls                      # as the engines swap a built Cell's class
    step, x = _GradOf(cell), Tensor(np.array([1.0, 2.0], np.float32))
    if mode == "jit":
        g = ms.jit(step.construct)(x)
    else:
        ms.set_context(mode=ms.GRAPH_MODE)
        try:
            g = step(x)
        finally:
            ms.set_context(mode=ms.PYNATIVE_MODE)
    expected = [0.0, 0.0] if cls is _Wrapped else [8.0, 32.0]     # d/dw sum((2 w x)^2) = 8 w x^2
    np.testing.assert_allclose(g[0].asnumpy(), expected)


def _initializers():
    from mindspore.common import initializer as init
    shapes = {"Identity": (4, 6), "Dirac": (4, 4, 3)}
    return [(getattr(init, n)(*([0.5] if n == "Constant" else [])), shapes.get(n, (5, 6)), draws)
            for n, draws in [("Zero", 0), ("One", 0), ("Constant", 0), ("Identity", 0), ("Dirac", 0), ("Normal", 1),
                             ("Uniform", 1), ("TruncatedNormal", 1), ("XavierNormal", 1), ("XavierUniform", 1),
                             ("HeNormal", 1), ("HeUniform", 1), ("VarianceScaling", 1)]]


@pytest.mark.parametrize("dtype", [ms.float32, ms.float16])
def test_contract_initializers_draw_only_their_declared_numpy_draws(dtype):
    from mindspore import Parameter
    from mindspore.common.initializer import Orthogonal, initializer
    assert seam.initializer_draws(Orthogonal()) is None                       # shape-dependent draws
    for init, shape, draws in _initializers():
        assert seam.initializer_draws(init) == draws, type(init).__name__
        ms.set_seed(3)
        values = seam.initial_array(init, shape, dtype)
        after = np.random.get_state()
        ms.set_seed(3)
        for _ in range(draws):
            seam.draw_numpy_seed()
        np.testing.assert_array_equal(np.random.get_state()[1], after[1], err_msg=type(init).__name__)
        assert np.random.get_state()[2] == after[2]
        ms.set_seed(3)                                   # eagerly, a Parameter runs it at once, the same way
        eager = Parameter(initializer(init, shape, dtype), name="w")
        np.testing.assert_array_equal(eager.asnumpy(), values, err_msg=type(init).__name__)


def test_contract_deferred_creation_is_seen_where_eager_initialisation_happens():
    from mindspore import Parameter
    from mindspore.common.initializer import Normal, initializer
    from mindspore.nn.utils import no_init_parameters
    seen, new_args, set_data = [], vars(Parameter)["_get_parameter_new_args"], Parameter.set_data
    with no_init_parameters(), seam.deferred_creation_hooked(seen.append):
        made = initializer(Normal(), (3, 4))
        p = Parameter(made, name="p")
        plain = Parameter(Tensor(np.ones(2, np.float32)), name="plain")
        assert seen == [made] and seam.pending_init(p) is made and seam.pending_init(plain) is None
        later = initializer("uniform", (3, 4))
        p.set_data(later)                                # deferred: kept as the initialiser, not run
        assert seen == [made, later] and seam.pending_init(p) is later and later.has_init
    eager = Parameter(initializer(Normal(), (3, 4)), name="eager")            # outside: run at once
    assert len(seen) == 2 and seam.pending_init(eager) is None
    assert vars(Parameter)["_get_parameter_new_args"] is new_args and Parameter.set_data is set_data
    seam.fill_deferred(p, np.full((3, 4), 2.0, np.float32))        # as init_data: in place, initialiser dropped
    assert not p.has_init and p.init_mode is None and later.has_init
    np.testing.assert_array_equal(p.asnumpy(), np.full((3, 4), 2.0, np.float32))


def test_contract_mindspore_initialises_deferred_parameters_in_attribute_order_and_on_first_read():
    """init_parameters follows init_parameters_data()'s order by iterating parameters_and_names();
    a deferred Parameter read before that is initialised then, from the generator where it is."""
    from mindspore import Parameter, nn
    from mindspore.common.initializer import Initializer, Normal, initializer
    from mindspore.nn.utils import no_init_parameters
    ran = []

    class Logged(Initializer):
        def __init__(self, tag):
            super().__init__()
            self.tag = tag

        def _initialize(self, arr):
            ran.append(self.tag)
            arr[:] = 0.0

    def dense():
        cell = nn.Dense(2, 2)
        cell.weight, cell.bias = (Parameter(initializer(Logged(n), s), name=n) for n, s in (("w", (2, 2)), ("b", (2,))))
        return cell

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.a = dense()
            self.p = Parameter(initializer(Logged("p"), (3,)), name="p")      # listed before self.a's
            self.b = dense()
            self.again = self.a
            self.b.bias = self.a.weight
    with no_init_parameters():
        net = Net()
    order = [name for name, _ in net.parameters_and_names()]
    net.init_parameters_data()
    assert order == ["p", "a.weight", "a.bias", "b.weight"]
    assert ran == ["p", "w", "b", "w"] and not any(q.has_init for q in net.get_parameters())
    with no_init_parameters():
        lazy = Parameter(initializer(Normal(), (2, 3)), name="lazy")
    ms.set_seed(1)
    read = lazy.asnumpy()
    ms.set_seed(1)
    np.testing.assert_array_equal(read, Parameter(initializer(Normal(), (2, 3)), name="eager").asnumpy())
    assert not lazy.has_init


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


def test_contract_deferred_parameters_hold_no_data_and_zero_stride_views_occupy_one_element():
    import resource
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    huge = seam.deferred_parameter((1 << 16, 1 << 16), ms.float32, "huge")      # 16 GiB if it held data
    view = seam.stride_free_view(Tensor(np.zeros((1,), np.float32)), (1 << 16, 1 << 16))
    assert huge.has_init and tuple(huge.shape) == (1 << 16, 1 << 16) and huge.name == "huge"
    assert tuple(view.shape) == (1 << 16, 1 << 16) and list(view.stride()) == [0, 0]
    assert seam.stride_free_view(Tensor(np.zeros((1,), np.float16)), ()).shape == ()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024     # KiB: nothing allocated
    assert getattr(ms.Parameter, "init_param", True) is True                           # the class flag is back


def test_contract_a_parameter_base_class_hook_sees_ops_on_parameters_and_cells_skip_their_first_call_init():
    class Run:                               # the members abstract_run uses
        unhooked = 0
        seen = []

        def value_and_grad(self, *a, **k):
            return "value_and_grad"

        def grad(self, *a, **k):
            return "grad"

        def cell_call(self, cell, call, args, kwargs):
            return call(*args, **kwargs)

        def parameter_op(self, func, args, kwargs):
            self.seen.append(getattr(func, "name", None))
            return Tensor(np.zeros((2, 3, 4), np.float32))

        def refuse_initialisation(self, param):
            raise RuntimeError(f"refused {param.name}")

    from mindspore.nn.utils import no_init_parameters
    with no_init_parameters():
        table = nn.Embedding(10, 4)
    run = Run()
    with seam.abstract_run(run):
        out = table(Tensor(np.zeros((2, 3), np.int32)))          # legacy Gather, a Parameter argument
        assert ms.value_and_grad(None) == "value_and_grad" and ms.ops.grad(None) == "grad"
        with pytest.raises(RuntimeError, match="refused embedding_table"):
            table.embedding_table.init_data()
    assert run.seen == ["Gather"] and tuple(out.shape) == (2, 3, 4) and table.embedding_table.has_init
    assert not hasattr(ms.Parameter, "__fallback__") and ms.value_and_grad is ms.ops.value_and_grad
    assert seam.has_custom_bprop(seam_bprop_cell()) and not seam.has_custom_bprop(nn.Dense(2, 2))


def seam_bprop_cell():
    class WithBprop(nn.Cell):
        def construct(self, x):
            return x

        def bprop(self, x, out, dout):
            return (dout,)
    return WithBprop()


def test_contract_grad_of_a_compiled_forward_needs_one_custom_bprop_instance_per_call_site():
    """``ms.value_and_grad(ms.jit(f))`` with one custom-bprop Cell instance called at two places:
    the backward reads the second call's output for the first (the weight reading the first call
    gets a wrong gradient); two instances, or the whole step compiled, are right. While compiling,
    ``cell_per_call_site`` builds a Cell per call; in PyNative it memoises."""

    class Ident(nn.Cell):
        def construct(self, x):
            return x

        def bprop(self, x, out, dout):
            return (dout * 1,)

    class Net(nn.Cell):
        def __init__(self, first, second):
            super().__init__()
            self.w1 = ms.Parameter(Tensor(np.random.RandomState(0).randn(4, 4).astype(np.float32)), name="w1")
            self.w2 = ms.Parameter(Tensor(np.random.RandomState(1).randn(4, 4).astype(np.float32)), name="w2")
            self.first, self.second = first, second

        def construct(self, x):
            h = ops.tanh(ops.matmul(self.first(x), self.w1))
            return ops.matmul(self.second(h), self.w2).sum()

    x = Tensor(np.random.RandomState(2).randn(3, 4).astype(np.float32))

    def gradients(net, how):
        params = net.trainable_params()

        def f(x):
            return net(x)
        if how == "grad of jit":
            return ms.value_and_grad(ms.jit(f), None, params)(x)[1]
        step = ms.value_and_grad(f, None, params)

        def whole(x):
            return step(x)
        return (ms.jit(whole) if how == "whole step" else whole)(x)[1]

    shared = Ident()
    net = Net(shared, shared)
    want = gradients(net, "eager")
    xn, w1, w2 = x.asnumpy(), net.w1.asnumpy(), net.w2.asnumpy()
    h = np.tanh(xn @ w1)
    dpre = (np.ones((3, 4)) @ w2.T) * (1 - h ** 2)
    # float32 against a float64 formula: 1e-4; the two candidates differ by more than 1
    assert np.abs(xn.T @ dpre - h.T @ dpre).max() > 1
    np.testing.assert_allclose(want[0].asnumpy(), xn.T @ dpre, atol=1e-4)
    got = gradients(net, "grad of jit")
    np.testing.assert_allclose(got[0].asnumpy(), h.T @ dpre, atol=1e-4)      # read the second call's output
    for net, how in ((Net(Ident(), Ident()), "grad of jit"), (Net(shared, shared), "whole step")):
        for g, w in zip(gradients(net, how), want):
            np.testing.assert_allclose(g.asnumpy(), w.asnumpy(), rtol=1e-6, atol=1e-6)

    built = []
    make = seam.cell_per_call_site(lambda k: built.append(k) or Ident())

    class Twice(nn.Cell):
        def construct(self, x):
            return make(1)(x) + make(1)(x)

    assert make(1) is make(1) and len(built) == 1
    ms.jit(Twice().construct)(x)
    assert len(built) == 1                          # a graph not differentiated from PyNative shares it

    def twice(x):
        return Twice()(x).sum()
    ms.value_and_grad(ms.jit(twice))(x)
    assert len(built) == 3                          # one per call site while compiling for PyNative's grad
