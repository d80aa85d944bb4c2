"""Smoke tests of the seam's compilation contracts (hyper_parallel_ms/_mindspore/compiling.py,
swaps.py, p2p.py): compile-time Python, compile detection, compiled-call argument checks, entry
point swaps, Cell classes for graphs, one custom-bprop Cell per call site, lazy imports."""
from __future__ import annotations

import inspect
import subprocess
import sys

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, mint, nn, ops

from hyper_parallel_ms import _mindspore as seam


class _NeverCompiled(Tensor):
    """Registered with reject_in_compiled_args by test_contract_compile_entry_points_see_the_arguments (only this test class)."""


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


def _no_check(fn, args) -> None:
    """A compile check refusing nothing (installs the swapped compile entry points)."""


def _jit_reading(n: int):
    @ms.jit
    def scaled(x):
        return x * _python_at_compile_time(n)
    return scaled


def test_contract_is_compiling_counts_compiles_through_the_swapped_entry_points():
    """With this package's compile entry points in place, a count they keep answers is_compiling
    (no frame walk); wrapped again by someone else, the frames are looked up: the same answers."""
    import functools
    from hyper_parallel_ms._mindspore import compiling
    from hyper_parallel_ms._mindspore._release import _graph_api
    seam.check_compiled_calls(_no_check)
    assert compiling._entry_points_ours() and not seam.is_compiling()
    _COMPILE_TIME.clear()
    np.testing.assert_allclose(_jit_reading(7)(Tensor([1.0])).asnumpy(), [14.0])
    assert _COMPILE_TIME == [True] and compiling._COMPILES.depth == 0

    def wrapped(original):
        @functools.wraps(original)
        def compile(self, *args, **kwargs):
            return original(self, *args, **kwargs)
        return compile
    undo = seam.swap_entry_points([(_graph_api._JitExecutor, "compile", wrapped)])
    try:
        assert not compiling._entry_points_ours() and not seam.is_compiling()
        np.testing.assert_allclose(_jit_reading(9)(Tensor([1.0])).asnumpy(), [18.0])
    finally:
        undo()
    assert _COMPILE_TIME == [True, True] and compiling._entry_points_ours()


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


class _Refused(nn.Cell):
    """A Cell that the check registered by test_contract_compile_checks_see_the_bound_object refuses."""

    def construct(self, x):
        return x + 1


def _refuse_marked(fn, args):
    if args and isinstance(args[0], _Refused):
        raise TypeError(f"refused: {getattr(fn, '__qualname__', fn)}")


def test_contract_compile_checks_see_the_bound_object():
    """check_compiled_calls: each compile of an ms.jit method (MindSpore's optimizers' construct) and
    of a GRAPH_MODE Cell calls the check with the bound object first (check_optimizer_step relies on it)."""
    seam.check_compiled_calls(_refuse_marked)
    seam.check_compiled_calls(_refuse_marked)              # idempotent

    class Jitted(_Refused):
        @ms.jit
        def construct(self, x):
            return x + 1
    with pytest.raises(TypeError, match="refused: .*construct"):
        Jitted()(Tensor([1.0]))
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        with pytest.raises(TypeError, match=r"refused: _Refused.construct"):
            _Refused()(Tensor([1.0]))
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


class _PassThrough(nn.Cell):
    def construct(self, x):
        return x

    def bprop(self, x, out, dout):
        return (dout,)


class _TimesOne(_PassThrough):
    def construct(self, x):
        return x * 1


class _TwoParameters(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.a = ms.Parameter(Tensor(np.ones(2, np.float32)), name="a")
        self.b = ms.Parameter(Tensor(np.zeros(2, np.float32)), name="b")

    def construct(self, x):
        return self.a + x, self.b + x


def _read_through(attr: str) -> property:
    cell = "_through_" + attr

    def read(self):
        return getattr(self, cell)(self._params[attr])
    return property(read)


def test_contract_property_reads_through_one_shared_custom_bprop_cell_compile_as_the_first():
    """Why ``nn._hooks.GradientSum`` shares a Cell that computes: two Parameters read by properties
    of a swapped class, each through a custom-bprop Cell, compile right with one Cell instance
    each, and as the first read for both when they share one instance (MindSpore 2.10, plain
    ms.jit of the forward; PyNative is right either way). A shared Cell whose forward computes
    (``x * 1``, ``nn._hooks._SummedGradient``) compiles right."""
    x = Tensor(np.zeros(2, np.float32))
    swapped = seam.cell_subclass("_TwoParameters", (_TwoParameters,), {"a": _read_through("a"),
                                                                       "b": _read_through("b")})
    shared, computing = _PassThrough(), _TimesOne()
    results = {}
    for how, first, second in (("own", _PassThrough(), _PassThrough()), ("shared", shared, shared),
                               ("shared, computing", computing, computing)):
        cell = _TwoParameters()
        object.__setattr__(cell, "_through_a", first)
        object.__setattr__(cell, "_through_b", second)
        cell.__class__ = swapped
        assert [t.asnumpy().tolist() for t in cell(x)] == [[1.0, 1.0], [0.0, 0.0]]
        results[how] = [t.asnumpy().tolist() for t in ms.jit(cell.construct)(x)]
    assert results["own"] == [[1.0, 1.0], [0.0, 0.0]]
    assert results["shared"] == [[1.0, 1.0], [1.0, 1.0]]          # b read as a
    assert results["shared, computing"] == [[1.0, 1.0], [0.0, 0.0]]
