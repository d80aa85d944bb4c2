"""Smoke tests of the seam's deferred-initialisation and shape-only-run contracts
(hyper_parallel_ms/_mindspore/deferred.py, abstract.py)."""
from __future__ import annotations


import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

from hyper_parallel_ms import _mindspore as seam


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
