"""The fully_shard engine's options beyond the textbook step, on CPU ranks, against one device:
``reshard_after_forward=k`` (gather over k ranks in the backward, 1/k kept), ``set_reshard_after_backward(False)``
(gradient accumulation without collectives on the micro-steps), a plan that differs between ranks
(every rank raises, nothing changed) and a forward that raises (the pieces are put back)."""
from __future__ import annotations

from collections import Counter

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

from hyper_parallel_ms.comm import CommDebugMode
from hyper_parallel_ms.fsdp import fully_shard
from hyper_parallel_ms.fsdp._module import fsdp_state
from hyper_parallel_ms.fsdp._param import is_piece
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.testing import multi_rank
from tests._fsdp_models import Net, compare, per_block
from tests._parity import gathered


def _recorded(log):
    """A ``train`` for :func:`compare` logging each step's collectives as (kind, mesh dim, group size)."""
    def train(model, step, x):
        with CommDebugMode() as mode:
            out = step(x)
        log.append(Counter((r.kind, r.mesh_dim, r.group_size) for r in mode.records))
        return out
    return train


@multi_rank(4)
def test_reshard_after_forward_int_gathers_over_k_ranks_in_the_backward_4_ranks():
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    rank = mesh.get_local_rank(0)
    log = []
    compare(per_block(mesh, 2), rank, 4, loss_mesh=mesh, steps=3, train=_recorded(log), optimizer="adamw")
    # 3 units: the forward gathers over the 4 ranks, the backward over this rank's 2 (FSDP2's count);
    # the head's bias (3 rows: an empty piece on 4 ranks) stays whole, its gradient all-reduced
    assert log == [Counter({("all_gather", "dp", 4): 3, ("all_gather", "dp_post", 2): 3,
                            ("reduce_scatter", "dp", 4): 3, ("all_reduce", "dp", 4): 1})] * 3, log
    ms.set_seed(0)
    model = Net()
    per_block(mesh, 2)(model)
    states = [fsdp_state(layer) for layer in model.layers] + [fsdp_state(model)]
    held = {}

    def loss(v):
        out = (model(v) ** 2).mean()
        held["bytes"] = sum(s.saving.bytes_held() for s in states)
        return out
    ms.value_and_grad(loss, None, model.trainable_params())(ms.Tensor(np.ones((2, 8), np.float32)))
    half = sum(g.layout.length * g.layout.n // 2 * 4 for s in states for g in s.groups    # float32
               if g.post_forward_mesh is not None)
    assert held["bytes"] == half, (held, half)              # 1/2 of every sharded buffer kept, no more
    with pytest.raises(ValueError, match="must divide the 4 ranks"):
        fully_shard(Net(), mesh=mesh, reshard_after_forward=3)


def _accumulate_without_collectives(log):
    """4 micro-steps, sync on the last only, gathered parameters kept after the backward."""
    def train(model, step, x):
        rows = x.shape[0] // 4
        model.set_reshard_after_backward(False)
        total_loss, total = 0.0, None
        for i in range(4):
            model.set_requires_gradient_sync(i == 3)
            with CommDebugMode() as mode:
                loss, grads = step(x[i * rows:(i + 1) * rows])
            log.append(dict(mode.get_comm_counts()))
            total_loss = total_loss + loss
            total = grads if total is None else tuple(a + b for a, b in zip(total, grads))
        return total_loss / 4, tuple(g / 4 for g in total)
    return train


@multi_rank(2)
def test_reshard_after_backward_false_accumulates_without_collectives_2_ranks():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    rank = mesh.get_local_rank(0)
    for reshard in (True, False):
        log = []
        compare(per_block(mesh, reshard), rank, 2, loss_mesh=mesh, steps=2, rows=16,
                train=_accumulate_without_collectives(log), optimizer="adamw")
        # the first micro-step gathers each of the 3 units once, the last reduces once: nothing between
        assert log == [{"all_gather": 3}, {}, {}, {"reduce_scatter": 3}] * 2, (reshard, log)


def _mismatched_net():
    from mindspore import communication
    return Net(hidden=7 if communication.get_rank() == 0 else 6)


@multi_rank(2)
def test_a_plan_differing_on_one_rank_fails_every_rank_and_changes_nothing_2_ranks():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    ms.set_seed(0)
    model = _mismatched_net()
    layer = model.layers[0]
    before = {name: id(p) for name, p in model.parameters_and_names()}
    cls, layer_cls = type(model), type(layer)
    x = ms.Tensor(np.ones((2, 8), np.float32))
    y = model(x).asnumpy()
    with pytest.raises(ValueError, match="apply different plans"):
        fully_shard(layer, mesh=mesh)
    assert type(layer) is layer_cls and type(model) is cls and fsdp_state(layer) is None
    assert {name: id(p) for name, p in model.parameters_and_names()} == before
    assert not layer._forward_pre_hook and not layer._forward_hook
    np.testing.assert_array_equal(model(x).asnumpy(), y)


@multi_rank(2)
def test_a_forward_that_raises_puts_the_pieces_back_2_ranks():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    ms.set_seed(0)
    model = Net()
    per_block(mesh, True)(model)
    with pytest.raises(Exception):
        model(ms.Tensor(np.ones((2, 5), np.float32)))            # wrong width: the first Dense raises
    assert all(is_piece(p) for p in model.trainable_params())
    loss = ms.value_and_grad(lambda v: (model(v) ** 2).mean(), None, model.trainable_params())(
        ms.Tensor(np.ones((2, 8), np.float32)))[0]
    assert np.isfinite(loss.asnumpy())


def _gathers_before(kinds):
    """All-gathers of the backward (after the 3 forward ones) issued before its first reduce-scatter."""
    backward = kinds[3:]
    return backward[:backward.index("reduce_scatter")].count("all_gather")


@multi_rank(2)
def test_prefetch_gathers_ahead_with_the_same_collectives_and_results_2_ranks():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    rank = mesh.get_local_rank(0)
    for prefetch in (False, True):
        seen, orders = [], []

        def shard(model):
            per_block(mesh, True)(model)
            model.layers[0].up.register_forward_pre_hook(lambda cell, args: seen.append(len(_ACTIVE_LOG[-1].records)))
            if prefetch:
                model.layers[0].set_modules_to_forward_prefetch([model.layers[1]])
                model.layers[1].set_modules_to_backward_prefetch([model.layers[0]])

        def train(model, step, x):
            with CommDebugMode() as mode:
                _ACTIVE_LOG.append(mode)
                out = step(x)
                _ACTIVE_LOG.pop()
            orders.append([r.kind for r in mode.records])
            return out
        compare(shard, rank, 2, loss_mesh=mesh, steps=2, train=train, optimizer="adamw")
        assert all(Counter(o) == {"all_gather": 6, "reduce_scatter": 3} for o in orders), orders
        # the root's and block 0's gathers (and block 1's, fetched ahead) before block 0 computes
        assert seen == [3 if prefetch else 2] * 2, (prefetch, seen)
        # the backward gathers each unit when its first value is read: the root's head, then block 1,
        # whose reduce-scatter comes next (the root's comes last, its input layer ends the backward);
        # block 0's gather is issued with block 1's, ahead of block 1's reduce-scatter
        assert [_gathers_before(o) for o in orders] == [3 if prefetch else 2] * 2, (prefetch, orders)


_ACTIVE_LOG: list = []


class _WithEncode(Net):
    def encode(self, x):
        return self.inp(x) * 2.0


class _EncodesInForward(nn.Cell):
    """A forward calling a method registered with register_fsdp_forward_method (3 head rows: pieces
    of 2 and 1 rows, whose outputs still broadcast in the loss)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Dense(8, 8)
        self.head = nn.Dense(8, 3)

    def encode(self, x):
        return ops.tanh(self.inp(x))

    def construct(self, x):
        return self.head(self.encode(x))


@multi_rank(2)
def test_fully_shard_keyword_arguments_and_forward_methods_of_fsdp2_and_hyperparallel():
    """FSDP2's ignored_params (left whole, gradients not reduced), shard_placement_fn (a dim the
    parameter lacks refused; other dims: tests/test_fsdp_placement.py),
    offload_policy (CPUOffloadPolicy on CPU ranks: host memory already), register_fsdp_forward_method
    (without it, a method other than construct calling a sub-Cell is refused: it computed on the pieces;
    a forward calling a registered method); HyperParallel's
    hsdp(use_eager_hook=...) and its wait functions."""
    from hyper_parallel_ms.fsdp import (CPUOffloadPolicy, OffloadPolicy, hsdp, hsdp_sync_stream,
                                        hsdp_wait_grad_handle, register_fsdp_forward_method)
    from hyper_parallel_ms.placement import Shard
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    x = ms.Tensor(np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32))
    ms.set_seed(0)
    whole = _WithEncode()
    ms.set_seed(0)
    model = _WithEncode()
    fully_shard(model, mesh=mesh, ignored_params={model.head.weight}, shard_placement_fn=lambda p: Shard(0),
                offload_policy=CPUOffloadPolicy())
    assert not is_piece(model.head.weight) and model.head.weight.shape == (3, 8) and is_piece(model.inp.weight)
    np.testing.assert_allclose(model(x).asnumpy(), whole(x).asnumpy(), rtol=1e-6)
    # unregistered, the method's Dense would compute on its piece (4 of 8 rows): refused, naming the fix
    with pytest.raises(RuntimeError, match="Dense was called outside the forward of fully_shard.*"
                                           "register_fsdp_forward_method"):
        model.encode(x)
    reach = Net()
    fully_shard(reach.layers[0], mesh=mesh)
    with pytest.raises(RuntimeError, match=r"outside the forward of fully_shard\(Block\).*piece \(\d, 8\) of the whole \(7, 8\)"):
        reach.layers[0].up(x)            # from a parent's forward too: it gave 4 / 3 of the 7 outputs, silently
    register_fsdp_forward_method(model, "encode")
    np.testing.assert_allclose(model.encode(x).asnumpy(), whole.encode(x).asnumpy(), rtol=1e-6)
    assert model.inp.weight.shape == (4, 8)                    # the pieces are back
    # the forward calling the registered method: the nested call uses the gathered values in place (it
    # put the pieces back, and the head then computed on its piece: a loss off, no error)
    ms.set_seed(0)
    whole_enc = _EncodesInForward()
    ms.set_seed(0)
    enc = _EncodesInForward()
    fully_shard(enc, mesh=mesh)
    register_fsdp_forward_method(enc, "encode")
    (loss, grads), (whole_loss, whole_grads) = [
        ms.value_and_grad(lambda t, n=net: (n(t) ** 2).mean(), None, net.trainable_params())(x) for net in (enc, whole_enc)]
    np.testing.assert_allclose(loss.asnumpy(), whole_loss.asnumpy(), rtol=1e-5, atol=1e-6)
    for p, g, wg in zip(enc.trainable_params(), grads, whole_grads):
        np.testing.assert_allclose(gathered(p, g), wg.asnumpy(), rtol=1e-5, atol=1e-6, err_msg=p.name)
    with pytest.raises(TypeError, match="a list of Cells.*wrap a single Cell in a list"):
        model.set_modules_to_forward_prefetch(model)
    ms.set_seed(0)
    other = Net()
    with pytest.raises(ValueError, match="shard_placement_fn gives Shard\\(dim=1\\) for 'inp.bias' of shape "
                                         "\\(8,\\); it must return None or Shard\\(dim\\)"):
        fully_shard(other, mesh=mesh, shard_placement_fn=lambda p: Shard(1), offload_policy=OffloadPolicy())
    assert not any(is_piece(p) for p in other.trainable_params())
    hsdp(other, threshold=0, use_eager_hook=True)
    np.testing.assert_allclose(other(x).asnumpy(), whole(x).asnumpy(), rtol=1e-6)
    assert hsdp_wait_grad_handle() is None and hsdp_sync_stream() is None


@multi_rank(2)
def test_reshard_after_forward_none_keeps_the_root_gathered_and_reshards_the_blocks():
    """FSDP2's newer default: None is True for every unit but the root (found at the first
    forward), which keeps its parameters for the backward; values equal one device."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    ms.set_seed(0)
    whole = Net()
    ms.set_seed(0)
    model = Net()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=None)
    fully_shard(model, mesh=mesh, reshard_after_forward=None)
    x = ms.Tensor(np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32))
    np.testing.assert_allclose(model(x).asnumpy(), whole(x).asnumpy(), rtol=1e-6)
    assert fsdp_state(model).reshard_after_forward is False
    assert all(fsdp_state(layer).reshard_after_forward is True for layer in model.layers)
    step = ms.value_and_grad(lambda t: (model(t) ** 2).mean(), None, model.trainable_params())
    with CommDebugMode() as debug:
        step(x)
    assert debug.get_comm_counts()["all_gather"] == 3 + 2          # 3 units forward, the 2 blocks again
    # set before the first forward, an explicit value replaces the root's automatic False (FSDP2)
    ms.set_seed(0)
    explicit = Net()
    for layer in explicit.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=None)
    fully_shard(explicit, mesh=mesh, reshard_after_forward=None)
    explicit.set_reshard_after_forward(True, recurse=False)
    np.testing.assert_allclose(explicit(x).asnumpy(), whole(x).asnumpy(), rtol=1e-6)
    assert fsdp_state(explicit).reshard_after_forward is True


def _units(model):
    return [layer for layer in model.layers] + [model]


@multi_rank(2)
def test_gradient_divide_factor_scales_pynative_and_compiled_gradients_2_ranks():
    from tests._fsdp_models import GradStep, compiled, loss_of
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    x = ms.Tensor(np.random.default_rng(mesh.get_local_rank(0)).standard_normal((4, 8)).astype(np.float32))

    def grads(divide, mode):
        ms.set_seed(0)
        model = Net()
        per_block(mesh)(model)
        if divide is not None:
            for unit in _units(model):
                unit.set_gradient_divide_factor(divide)
        params = model.trainable_params()
        if mode == "pynative":
            step = ms.value_and_grad(lambda v: loss_of(model, v), None, params)
        else:
            step = compiled(mode, GradStep(model, params))
        return model, [g.asnumpy() for g in step(x)[1]]

    _, mean = grads(None, "pynative")
    # FSDP2: the gradients summed over the 2 ranks, then divided by the factor (1.0: the sum; 4.0: half the mean)
    for divide, factor in ((1.0, 2.0), (4.0, 0.5)):
        for mode in ("pynative", "jit") if divide == 4.0 else ("pynative",):    # one compile: test time
            model, got = grads(divide, mode)
            for g, m in zip(got, mean):
                np.testing.assert_allclose(g, factor * m, rtol=1e-6, atol=1e-7, err_msg=f"{divide} {mode}")
    # force_sum_reduction_for_comms: sum collectives only (seen by a spy on comm), the same gradients
    from hyper_parallel_ms import comm
    ops_sent, plain = [], comm.reduce_scatter

    def spy(*args, **kwargs):
        ops_sent.append(kwargs["op"])
        return plain(*args, **kwargs)
    comm.reduce_scatter = spy
    try:
        for force, divide, factor in ((True, None, 1.0), (True, 4.0, 0.5), (False, None, 1.0)):
            ms.set_seed(0)
            forced = Net()
            per_block(mesh)(forced)
            for unit in _units(forced):
                unit.set_force_sum_reduction_for_comms(force)
                if divide is not None:
                    unit.set_gradient_divide_factor(divide)
            params = forced.trainable_params()
            ops_sent.clear()
            got = ms.value_and_grad(lambda v: loss_of(forced, v), None, params)(x)[1]
            assert ops_sent and set(ops_sent) == {"sum" if force else "avg"}, (force, ops_sent)
            for g, m in zip(got, mean):
                np.testing.assert_allclose(g.asnumpy(), factor * m, rtol=1e-6, atol=1e-7, err_msg=f"{force} {divide}")
    finally:
        comm.reduce_scatter = plain
    with pytest.raises(TypeError, match="takes a bool"):
        forced.set_force_sum_reduction_for_comms(1)
    with pytest.raises(NotImplementedError, match="before the first compiled step"):
        model.set_gradient_divide_factor(2.0)                 # compiled with 4.0 built in
    with pytest.raises(NotImplementedError, match="before the first compiled step"):
        model.set_force_sum_reduction_for_comms(True)
    with pytest.raises(ValueError, match="positive number"):
        model.layers[0].set_gradient_divide_factor(0)
    with pytest.warns(FutureWarning, match="set_gradient_divide_factor"):
        grads(None, "pynative")[0].set_reduce_scatter_divide_factor(2.0)
    # FSDP2's handle and flag: the gather is done when unshard returns
    model = grads(None, "pynative")[0]
    handle = model.layers[0].unshard(async_op=True)
    assert handle.wait() is None and fsdp_state(model.layers[0]).kept is not None
    assert model.layers[0].unshard() is None
    model.set_is_last_backward(False)
    assert not fsdp_state(model.layers[1]).is_last_backward
    with pytest.raises(TypeError, match="bool"):
        model.set_is_last_backward(1)


def _accumulate_replicas(log):
    """4 micro-steps, the all-reduce over replicas on the last only (gradient sync on throughout)."""
    def train(model, step, x):
        rows = x.shape[0] // 4
        total_loss, total = 0.0, None
        with CommDebugMode() as mode:
            for i in range(4):
                model.set_requires_all_reduce(i == 3)
                loss, grads = step(x[i * rows:(i + 1) * rows])
                if i < 3:
                    assert all(not g.asnumpy().any() for g in grads)     # FSDP2: nothing until the all-reduce
                total_loss = total_loss + loss
                total = grads if total is None else tuple(a + b for a, b in zip(total, grads))
        log.append(mode.get_comm_counts())
        return total_loss / 4, tuple(g / 4 for g in total)
    return train


@multi_rank(4)
def test_set_requires_all_reduce_accumulates_across_replicas_4_ranks():
    from tests._fsdp_models import GradStep, compiled
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    log = []
    compare(per_block(mesh), mesh.get_local_rank(0) * 2 + mesh.get_local_rank(1), 4, loss_mesh=mesh, rows=16,
            steps=3, train=_accumulate_replicas(log))
    # per micro-step: every unit gathers twice and reduce-scatters in its shard pair; the replicas
    # all-reduce once per unit, on the last micro-step only
    assert log == [{"all_gather": 24, "reduce_scatter": 12, "all_reduce": 3}] * 3, log
    ms.set_seed(0)
    model = Net()
    per_block(mesh)(model)
    model.set_requires_all_reduce(False)
    step = compiled("jit", GradStep(model, model.trainable_params()))
    with pytest.raises(NotImplementedError, match="set_requires_all_reduce"):
        step(ms.Tensor(np.ones((2, 8), np.float32)))
    with pytest.raises(TypeError, match="bool"):
        model.set_requires_all_reduce("no")


class _OnlyInput(nn.Cell):
    def __init__(self, net) -> None:
        super().__init__()
        self.net = net

    def construct(self, x):
        return self.net.inp(x)


def _shard_with_ends_grouped(mesh):
    """Each block a unit, the input layer and the head one unit (FSDP2's list), then the root."""
    def shard(model):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        cells = [model.inp, model.head]
        assert fully_shard(cells, mesh=mesh) is cells
        assert fsdp_state(model.inp) is fsdp_state(model.head) and len(fsdp_state(model.inp).groups) == 1
        fully_shard(model, mesh=mesh)
    return shard


@multi_rank(2)
def test_fully_shard_of_a_list_of_cells_is_one_unit_2_ranks():
    from hyper_parallel_ms.fsdp import FSDPModule
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    rank = mesh.get_local_rank(0)
    log = []
    compare(_shard_with_ends_grouped(mesh), rank, 2, loss_mesh=mesh, steps=3, train=_recorded(log), optimizer="adamw")
    # 3 units with parameters (2 blocks, the input layer + head): one gather each in the forward, one
    # again in the backward, one reduce-scatter each
    assert log == [Counter({("all_gather", "dp", 2): 6, ("reduce_scatter", "dp", 2): 3})] * 3, log
    compare(_shard_with_ends_grouped(mesh), rank, 2, loss_mesh=mesh, steps=2, mode="jit")

    ms.set_seed(0)
    ref = Net()
    ms.set_seed(0)
    par = Net()
    _shard_with_ends_grouped(mesh)(par)
    assert isinstance(par.inp, FSDPModule) and isinstance(par.head, FSDPModule)
    x = ms.Tensor(np.random.default_rng(rank).standard_normal((2, 8)).astype(np.float32))
    # a Cell of the list called alone (no enclosing forward could continue its round): the round ends
    # with it, so a later call of the head gathers the pieces as they are then (here changed in between,
    # as an optimizer step or a checkpoint load would)
    state = fsdp_state(par.inp)
    np.testing.assert_allclose(par.inp(x).asnumpy(), ref.inp(x).asnumpy(), rtol=1e-6)
    assert not state.running and state._round is None
    for model in (ref, par):
        model.head.bias.set_data(model.head.bias.value() + 1.0)
    h = ref.inp(x)
    np.testing.assert_allclose(par.head(h).asnumpy(), ref.head(h).asnumpy(), rtol=1e-6)
    # a round its enclosing forward leaves unfinished (the head not run) ends with that forward
    only_inp = _OnlyInput(par)
    fully_shard(only_inp, mesh=mesh)
    np.testing.assert_allclose(only_inp(x).asnumpy(), ref.inp(x).asnumpy(), rtol=1e-6)
    assert not state.running and state._round is None
    np.testing.assert_allclose(par(x).asnumpy(), ref(x).asnumpy(), rtol=1e-5, atol=1e-6)
    assert all(is_piece(p) for p in par.trainable_params())

    # a weight tied between the two Cells of the list: one record, gathered once, gradients summed
    def tied_ends():
        model = Net(hidden=8)
        model.head = nn.Dense(8, 8)
        model.head.weight = model.inp.weight
        return model

    def shard_tied(model):
        _shard_with_ends_grouped(mesh)(model)
        assert [len(g.params) for g in fsdp_state(model.inp).groups] == [3]      # weight, two biases
    compare(shard_tied, rank, 2, loss_mesh=mesh, steps=2, make_model=tied_ends)

    fresh = Net()
    before = [id(p) for p in fresh.get_parameters()]
    for bad, error, match in (([fresh.inp, fresh.inp], ValueError, "twice"),
                              ([fresh, fresh.inp], ValueError, "inside"),
                              ([], TypeError, "non-empty list"), ([fresh.inp, 3], TypeError, "non-empty list")):
        with pytest.raises(error, match=match):
            fully_shard(bad, mesh=mesh)
    assert [id(p) for p in fresh.get_parameters()] == before and not isinstance(fresh.inp, FSDPModule)


@pytest.mark.parametrize("n,rank", [(1, 0), (3, 0), (3, 2), (4, 3)])
def test_flat_buffer_fold_and_split_are_the_way_back_of_unpack_and_pack(n, rank):
    """The gradient's way through a group's flat buffer: ``split`` inverts ``pack`` (this rank's pieces
    back, padding dropped) and ``fold`` is the adjoint of ``unpack`` (<unpack(x), v> = <x, fold(v)>
    for every x, v: padding rows get zero gradient), for uneven, 0-d and one-row parameters."""
    from hyper_parallel_ms.fsdp._chunks import Chunks
    from hyper_parallel_ms.fsdp._flat import FlatLayout, fold, pack, split, unpack
    shapes = [(5, 2), (7,), (1, 3)] + ([()] if n == 1 else [])
    layout = FlatLayout([Chunks(s, n, rank) for s in shapes])
    rng = np.random.default_rng(n * 10 + rank)
    pieces = [rng.standard_normal(c.piece_shape).astype(np.float32) for c in layout.chunks]
    back = split(layout, pack(layout, [ms.Tensor(p) for p in pieces]))
    for got, want in zip(back, pieces):
        assert got.shape == want.shape
        np.testing.assert_array_equal(got.asnumpy(), want)
    x = rng.standard_normal((n * layout.length,)).astype(np.float64)
    v = [rng.standard_normal(s).astype(np.float64) for s in shapes]
    values = unpack(layout, ms.Tensor(x))
    folded = fold(layout, [ms.Tensor(a) for a in v]).asnumpy()
    assert folded.shape == x.shape
    lhs = sum(float(np.sum(val.asnumpy() * a)) for val, a in zip(values, v))
    np.testing.assert_allclose(lhs, float(np.dot(x, folded)), rtol=1e-12)
    # the padding rows' slots of the folded gradient are zero; every value's slots hold its gradient
    mask = fold(layout, [ms.Tensor(np.ones(s)) for s in shapes]).asnumpy()
    assert set(np.unique(mask)) <= {0.0, 1.0} and mask.sum() == sum(int(np.prod(s)) for s in shapes)
