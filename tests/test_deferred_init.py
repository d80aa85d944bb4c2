"""Deferred initialisation gives the single-device values bitwise.

MindSpore draws each random initialiser's seed from numpy's global generator when the
Parameter is made; ``hyper_parallel_ms.no_init_parameters()`` records that point, and
``init_parameters`` / the parallel styles replay it: the eager values, in creation order.
Under MindSpore's own ``no_init_parameters()`` (no record) they follow MindSpore's deferred
order: the one-device model initialised by ``init_parameters_data()`` (attribute order), a
Parameter used alone when first read; one warning per call. Compared bitwise
(``assert_array_equal``): the same initialiser run from the same numpy state gives the same bits."""
from __future__ import annotations

import itertools
import warnings
from contextlib import nullcontext as _eager

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn
from mindspore.common.initializer import (HeUniform, Initializer, Normal, Orthogonal, TruncatedNormal, Uniform,
                                          XavierUniform, initializer)
from mindspore.nn.utils import no_init_parameters as mindspore_no_init_parameters

from hyper_parallel_ms import init_empty_weights, init_on_device, init_parameters, no_init_parameters
from hyper_parallel_ms._deferred import initial_value
from hyper_parallel_ms.testing import multi_rank

from tests._parity import gathered


class NumpyInit(Initializer):
    """A user's initialiser drawing from numpy's global generator (draws depend on the shape)."""

    def _initialize(self, arr):
        arr[:] = np.random.standard_normal(arr.shape)


class Counting(Initializer):
    """A user's initialiser that gives other values each run: its eager value cannot be replayed."""

    runs = itertools.count()

    def _initialize(self, arr):
        arr[:] = next(self.runs)


class Inner(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Dense(8, 6)
        self.scale = Parameter(initializer(TruncatedNormal(0.02), (6,)), name="scale")


class Orders(nn.Cell):
    """Parameters defined between sub-Cells, a sub-Cell assigned after one made later, a shared
    sub-Cell in two places, nesting, tied and re-initialised weights, an initialiser Tensor made
    early and taken by two Parameters late, every kind of initialiser, and numpy draws of the
    model's own in between (``shared_initializer=False``: no initialiser Tensor taken twice, which
    MindSpore's own ``init_parameters_data()`` cannot initialise)."""

    def __init__(self, shared_initializer: bool = True) -> None:
        super().__init__()
        early = initializer(Uniform(0.2), (3, 8))       # made now, run (eagerly) when a Parameter takes it
        self.a = nn.Dense(8, 6)
        self.p = Parameter(initializer(Normal(0.02), (6, 8)), name="p")
        self.own = Parameter(Tensor(np.random.standard_normal((4, 8)).astype(np.float32)), name="own")
        later = nn.Dense(8, 8, weight_init=XavierUniform(), bias_init=0.5)
        self.b = nn.Dense(8, 8, weight_init=Uniform(0.3))
        self.later = later
        self.shared = Inner()
        self.deep = nn.SequentialCell([nn.SequentialCell([Inner()]), nn.Dense(6, 4)])
        self.again = self.shared
        self.he = Parameter(initializer(HeUniform(), (6, 8)), name="he")
        self.orth = Parameter(initializer(Orthogonal(), (5, 8)), name="orth")
        self.numpy_init = Parameter(initializer(NumpyInit(), (4, 8)), name="numpy_init")
        self.consts = Parameter(initializer(0.25, (5,)), name="consts")
        self.ones = Parameter(initializer("ones", (3, 8)), name="ones")
        self.tensor_init = Parameter(initializer(Tensor(np.arange(8, dtype=np.float32)), (8,)), name="tensor_init")
        self.late = Parameter(early, name="late")
        if shared_initializer:
            self.late_copy = Parameter(early, name="late_copy")    # eagerly a copy of the data it became
        self.tied = nn.Dense(8, 6)
        self.tied.weight = self.a.weight
        self.b.weight.set_data(initializer(Normal(0.5), (8, 8)))


def _built(make, context):
    ms.set_seed(0)
    with context():
        model = make()
    return model, np.random.get_state()[1].copy()


def _assert_equal_params(got: nn.Cell, want: nn.Cell, value=lambda p: p.asnumpy()) -> None:
    pairs = list(zip(got.parameters_and_names(), want.parameters_and_names()))
    assert [n for (n, _), _ in pairs] == [n for _, (n, _) in pairs]
    for (name, g), (_, w) in pairs:
        np.testing.assert_array_equal(value(g), w.asnumpy(), err_msg=name)


def test_deferred_values_equal_eager_in_creation_order():
    eager, eager_state = _built(Orders, _eager)
    lazy, lazy_state = _built(Orders, no_init_parameters)
    np.testing.assert_array_equal(lazy_state, eager_state)      # the generator is where eager leaves it
    assert lazy.p.has_init and lazy.a.weight.has_init
    # in any order (here: last made first), each value is its eager one
    for param, want in reversed(list(zip(lazy.get_parameters(), eager.get_parameters()))):
        np.testing.assert_array_equal(initial_value(param), want.asnumpy(), err_msg=param.name)
    assert init_parameters(lazy) is lazy
    _assert_equal_params(lazy, eager)
    assert not any(p.has_init for p in lazy.get_parameters())
    np.testing.assert_array_equal(np.random.get_state()[1], eager_state)
    # HyperParallel's name for it
    empty, empty_state = _built(Orders, init_empty_weights)
    assert empty.p.has_init and empty.a.weight.has_init
    np.testing.assert_array_equal(empty_state, eager_state)
    _assert_equal_params(init_parameters(empty, stage_index=1), eager)     # HyperParallel's stage index: checked
    with pytest.raises(ValueError, match="stage_index must be a non-negative int"):
        init_parameters(empty, stage_index=-1)
    # HyperParallel's init_on_device: "meta" defers as init_empty_weights; this rank's device changes nothing
    meta, meta_state = _built(Orders, lambda: init_on_device("meta"))
    assert meta.p.has_init and meta.a.weight.has_init
    np.testing.assert_array_equal(meta_state, eager_state)
    _assert_equal_params(init_parameters(meta), eager)
    here, _ = _built(Orders, lambda: init_on_device("cpu:0"))
    assert not here.p.has_init
    _assert_equal_params(here, eager)
    with pytest.raises(ValueError, match="this rank computes on CPU"):
        with init_on_device("npu"):
            pass


def _no_share() -> Orders:
    return Orders(shared_initializer=False)


def _mindspore_reference(make, read=lambda model: ()):
    """The one-device answer of a script building under MindSpore's no_init_parameters(): the
    Parameters ``read(model)`` read in that order, then ``init_parameters_data()``."""
    model, _ = _built(make, mindspore_no_init_parameters)
    for param in read(model):
        param.asnumpy()                                 # MindSpore initialises it here, from the generator
    model.init_parameters_data()
    return model, np.random.get_state()[1].copy()


def _warnings_of(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in caught if "did not record" in str(w.message)]


def test_unrecorded_initialisers_follow_mindspores_deferred_order_with_one_warning():
    want, want_state = _mindspore_reference(_no_share)
    eager, _ = _built(_no_share, _eager)
    lazy, _ = _built(_no_share, mindspore_no_init_parameters)
    _, notices = _warnings_of(lambda: init_parameters(lazy))
    _assert_equal_params(lazy, want)                    # bitwise init_parameters_data() on one device
    np.testing.assert_array_equal(np.random.get_state()[1], want_state)
    assert not np.array_equal(lazy.b.weight.asnumpy(), eager.b.weight.asnumpy())      # not the eager order
    assert len(notices) == 1 and "'p'" in notices[0] and "attribute order" in notices[0]
    assert "hyper_parallel_ms.no_init_parameters() for the eager values" in notices[0]
    # an initialiser Tensor taken by two Parameters (MindSpore's init_parameters_data() fails): runs once
    shared, _ = _built(Orders, mindspore_no_init_parameters)
    _, notices = _warnings_of(lambda: init_parameters(shared))
    np.testing.assert_array_equal(shared.late_copy.asnumpy(), shared.late.asnumpy())
    assert len(notices) == 1 and not any(p.has_init for p in shared.get_parameters())
    # constant initialisers draw nothing: no order, no warning
    with mindspore_no_init_parameters():
        constant = nn.Dense(4, 3, weight_init="ones", bias_init=0.5)
    _, notices = _warnings_of(lambda: init_parameters(constant))
    assert notices == []
    np.testing.assert_array_equal(constant.weight.asnumpy(), np.ones((3, 4), np.float32))
    np.testing.assert_array_equal(constant.bias.asnumpy(), np.full((3,), 0.5, np.float32))


def test_recorded_and_unrecorded_random_initialisers_mixed_are_refused_and_the_model_left_as_it_was():
    with no_init_parameters():
        model = nn.SequentialCell([nn.Dense(4, 4)])
    with mindspore_no_init_parameters():
        model.append(nn.Dense(4, 2))
    pending = [p.name for p in model.get_parameters() if p.has_init]
    with pytest.raises(ValueError, match=r"parameter '0.weight' was built under hyper_parallel_ms.no_init_param.*"
                                         r"parameter '1.weight' has a random initializer it did not record"):
        init_parameters(model)
    assert [p.name for p in model.get_parameters() if p.has_init] == pending
    # an initialiser set after the recording context ended is unrecorded: alone, it follows the rule above
    with no_init_parameters():
        dense = nn.Dense(4, 4, weight_init="ones", bias_init="zeros")
    dense.weight.set_data(initializer(Normal(0.1), (4, 4)))
    ms.set_seed(5)
    _, notices = _warnings_of(lambda: init_parameters(dense))
    ms.set_seed(5)
    np.testing.assert_array_equal(dense.weight.asnumpy(), initializer(Normal(0.1), (4, 4)).init_data().asnumpy())
    assert len(notices) == 1 and "'weight'" in notices[0]


def test_initialisers_that_do_not_replay_are_refused():
    with no_init_parameters():
        model = nn.Dense(4, 3, weight_init=Counting())
    with pytest.raises(ValueError, match="parameter 'weight': its initializer Counting gave other values"):
        init_parameters(model)
    assert model.weight.has_init and model.bias.has_init


def _llama():
    from examples.llama import Llama, LlamaConfig
    return Llama(LlamaConfig(vocab=32, dim=16, layers=2, heads=2, hidden=24, max_seq=8))


@multi_rank(2)
def test_deferred_pieces_equal_single_device_on_2_ranks():
    from examples.llama import tp_plan
    from hyper_parallel_ms.dtensor import distribute_tensor
    from hyper_parallel_ms.fsdp import fully_shard, hsdp
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.nn import ColwiseParallel, RowwiseParallel, parallelize_module
    from hyper_parallel_ms.nn._targets import match_path
    from hyper_parallel_ms.placement import Shard
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))

    def check(make, shard):
        eager, _ = _built(make, _eager)
        lazy, _ = _built(make, no_init_parameters)
        shard(lazy)
        init_parameters(lazy)
        _assert_equal_params(lazy, eager, value=lambda p: gathered(p, p))

    def per_block(model):
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)

    check(Orders, lambda m: fully_shard(m, mesh=mesh))
    check(_llama, per_block)
    # tensor parallelism cuts the deferred weights from their eager values (Colwise / Rowwise)
    check(_llama, lambda m: parallelize_module(m, mesh, tp_plan(sequence_parallel=False)))
    # distribute_tensor of a deferred Parameter (e.g. in a distribute_module partition_fn): its eager value
    eager, _ = _built(Orders, _eager)
    lazy, _ = _built(Orders, no_init_parameters)
    piece = distribute_tensor(lazy.b.weight, mesh, [Shard(0)])
    np.testing.assert_array_equal(piece.full_tensor().asnumpy(), eager.b.weight.asnumpy())
    assert lazy.b.weight.has_init                                       # the Parameter itself left deferred
    # built under MindSpore's own no_init_parameters(): each rank's pieces equal the one-device model
    # of the same script (parameters a style cuts read when cut, the rest by init_parameters_data())
    def unrecorded(make, shard, read=lambda model: ()):
        want, _ = _mindspore_reference(make, read)
        lazy, _ = _built(make, mindspore_no_init_parameters)
        _, cut_notices = _warnings_of(lambda: shard(lazy))
        _, notices = _warnings_of(lambda: init_parameters(lazy))
        _assert_equal_params(lazy, want, value=lambda p: gathered(p, p))
        return cut_notices, notices

    cut_notices, notices = unrecorded(_no_share, lambda m: fully_shard(m, mesh=mesh))
    assert cut_notices == [] and len(notices) == 1 and "attribute order" in notices[0]
    cut_notices, notices = unrecorded(_no_share, lambda m: hsdp(m, threshold=0))
    assert cut_notices == [] and len(notices) == 1
    plan = tp_plan(sequence_parallel=False)

    def cut_in_plan_order(model):
        return [param for key, style in plan.items() if isinstance(style, (ColwiseParallel, RowwiseParallel))
                for path, cell in model.cells_and_names() if match_path(key, path)
                for param in cell.get_parameters(expand=False)]

    cut_notices, _ = unrecorded(_llama, lambda m: parallelize_module(m, mesh, plan), read=cut_in_plan_order)
    assert len(cut_notices) == 1 and "when cut by the plan" in cut_notices[0]
    # distribute_tensor of an unrecorded deferred Parameter: its value when first used, kept for it
    want, _ = _mindspore_reference(_no_share, read=lambda model: [model.b.weight])
    lazy, _ = _built(_no_share, mindspore_no_init_parameters)
    piece, notices = _warnings_of(lambda: distribute_tensor(lazy.b.weight, mesh, [Shard(0)]))
    np.testing.assert_array_equal(piece.full_tensor().asnumpy(), want.b.weight.asnumpy())
    assert lazy.b.weight.has_init and len(notices) == 1 and "'b.weight'" in notices[0]
    init_parameters(lazy)
    _assert_equal_params(lazy, want)
