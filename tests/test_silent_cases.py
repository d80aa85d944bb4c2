"""Cases that gave a wrong value without an error: each now gives the single-device answer or
raises at the first call, naming the cause.

- A ``Shard`` of unknown length declared in ``PrepareModuleInput`` / ``PrepareModuleOutput``
  whose pieces are uneven (``torch.chunk`` of 5 on 2 ranks: 3, 2): every rank read a global
  length of its own (6 and 4) and rank 0 returned garbage while rank 1 failed.
- A ``Replicate`` input whose sequence length differs between the tensor-parallel ranks.
Both are caught by the ranks agreeing on the global shape they read (PyNative, every call).
- The gradient of a compiled forward (``ms.value_and_grad(ms.jit(f))``) through parallel styles:
  all but the last block's weight gradients were wrong (one conversion Cell shared by call sites).
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import mint, nn, ops

from hyper_parallel_ms.comm import CommDebugMode
from hyper_parallel_ms.dtensor import distribute_tensor
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel,
                                  parallelize_module)
from hyper_parallel_ms.placement import Replicate, Shard
from hyper_parallel_ms.testing import multi_rank


class Double(nn.Cell):
    def construct(self, x):
        return x * 2


def _sequence_pieces(rank: int, length: int) -> np.ndarray:
    """This rank's torch.chunk piece (dim 1) of a (2, length) sequence on 2 ranks."""
    full = np.arange(2 * length, dtype=np.float32).reshape(2, length)
    cut = (length + 1) // 2
    return full[:, :cut] if rank == 0 else full[:, cut:]


def _style(kind: str):
    if kind == "input":
        return PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True)
    if kind == "input_dtensor":
        return PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Shard(1))
    return PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())


@pytest.mark.parametrize("kind", ["input", "input_dtensor", "output"])
@multi_rank(2)
def test_uneven_declared_shard_raises_on_every_rank_and_even_pieces_work(kind):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = Double()
    parallelize_module(model, mesh, _style(kind))
    rank = mesh.get_rank()
    even = model(ms.Tensor(_sequence_pieces(rank, 6)))
    even = even.full_tensor() if hasattr(even, "full_tensor") else even
    np.testing.assert_array_equal(even.asnumpy(), np.arange(12, dtype=np.float32).reshape(2, 6) * 2)
    with pytest.raises(ValueError, match=r"read different global shapes.*holds \(2, [32]\).*\(2, 4\.\.6\)"):
        model(ms.Tensor(_sequence_pieces(rank, 5)))
    again = model(ms.Tensor(_sequence_pieces(rank, 6)))       # the ranks are still in step
    again = again.full_tensor() if hasattr(again, "full_tensor") else again
    np.testing.assert_array_equal(again.asnumpy(), even.asnumpy())


@multi_rank(2)
def test_replicate_input_of_another_sequence_length_on_one_rank_raises():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ms.set_seed(0)
    model = nn.Dense(4, 6)
    parallelize_module(model, mesh, ColwiseParallel(output_layouts=Replicate()))
    length = 3 if mesh.get_rank() == 0 else 5
    x = ms.Tensor(np.ones((2, length, 4), np.float32))
    with pytest.raises(ValueError, match=r"read different global shapes.*same sequence length"):
        model(x)
    with CommDebugMode() as mode:                              # agreeing costs no recorded collective
        y = model(ms.Tensor(np.ones((2, 3, 4), np.float32)))
    assert y.shape == (2, 3, 6)
    assert mode.get_comm_counts() == {"all_gather": 1}, mode.get_comm_counts()



class _LossStep(nn.Cell):
    def __init__(self, loss_fn) -> None:
        super().__init__()
        self.loss_fn = loss_fn

    def construct(self, logits, target):
        return self.loss_fn(logits, target)


@multi_rank(2)
def test_parallel_cross_entropy_out_of_range_target_raises_in_pynative_jit_and_graph_mode():
    """It read such a target as a logit of 0 inside ms.jit (no check there)."""
    from hyper_parallel_ms.nn import ParallelCrossEntropy
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    loss_fn = ParallelCrossEntropy(mesh, num_classes=5)
    full = np.random.default_rng(3).standard_normal((4, 5)).astype(np.float32)
    piece = ms.Tensor(full[:, :3] if mesh.get_rank() == 0 else full[:, 3:])
    good = ms.Tensor(np.array([0, 4, -100, 2], np.int32))
    bad = ms.Tensor(np.array([0, 5, -100, 2], np.int32))
    expected = ms.ops.cross_entropy(ms.Tensor(full), good).asnumpy()
    message = r"class indices in \[0, 5\) or ignore_index=-100; got \[5\]"
    step = ms.jit(ms.value_and_grad(loss_fn))
    for run in (loss_fn, lambda x, t: step(x, t)[0]):
        np.testing.assert_allclose(run(piece, good).asnumpy(), expected, rtol=1e-6)
        with pytest.raises(ValueError, match=message):
            run(piece, bad)
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        graph = _LossStep(loss_fn)
        np.testing.assert_allclose(graph(piece, good).asnumpy(), expected, rtol=1e-6)
        with pytest.raises(ValueError, match=message):
            graph(piece, bad)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)



def _tensor_split_by_sizes(a):
    first, second = a.split([1, 3], 1)
    return ops.cat([second, first * 2.0], 1)


def _ops_split_by_sizes_dim0(a):
    pieces = ops.split(a, [2, 2, 1], 0)
    return ops.cat([p * (i + 1.0) for i, p in enumerate(pieces)], 0)


@multi_rank(4)
def test_split_with_a_list_of_sizes_right_gradient_or_refused():
    """mint.split with a list of sizes (SplitWithSizeView) gave a DTensor's pieces wrong gradients
    when two pieces were used; it is refused naming the ops that work, and those are checked
    against one device (value and gradient)."""
    from tests._ops_check import check_op
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((5, 4)).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32)
    check_op(mesh, _tensor_split_by_sizes, [a], [[Shard(0), Shard(1)]], [Shard(0), Replicate()])
    check_op(mesh, _tensor_split_by_sizes, [b], [[Replicate(), Replicate()]], [Replicate(), Replicate()])
    check_op(mesh, _ops_split_by_sizes_dim0, [a], [[Shard(0), Shard(1)]], [Replicate(), Shard(1)])
    x = distribute_tensor(ms.Tensor(a), mesh, [Shard(0), Shard(1)])
    with pytest.raises(NotImplementedError, match=r"mint.split with a list of sizes \[1, 3\].*x.split\(sizes, dim\)"):
        mint.split(x, [1, 3], 1)


class _Attention(nn.Cell):
    """q, k Colwise and o Rowwise under a PrepareModuleInput(defer_colwise_grads=True);
    ``extra_use``: the input is also read by something else inside the Cell."""

    def __init__(self, extra_use: str = "") -> None:
        super().__init__()
        self.q, self.k, self.o = nn.Dense(4, 6), nn.Dense(4, 6), nn.Dense(6, 4)
        self.extra_use = extra_use

    def construct(self, x):
        h = self.o(self.q(x) * self.k(x))
        if self.extra_use == "residual":
            return h + x
        if self.extra_use == "scaled":
            return h * ops.reduce_sum(x)
        return h


def _deferred_plan(local: bool):
    return {"": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate(),
                                   defer_colwise_grads=True, use_local_output=local),
            "[qk]": ColwiseParallel(), "o": RowwiseParallel()}


@multi_rank(2)
def test_defer_colwise_grads_refuses_another_use_of_the_input():
    """With defer_colwise_grads the input's gradient is reduced once at the Cell from the Colwise
    layers' shares: a residual inside the Cell had its gradient counted once per rank (PyNative
    gave 2x the single-device input gradient on 2 ranks without an error)."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = ms.Tensor(np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32))
    for local in (True, False):
        ms.set_seed(0)
        ref = _Attention()
        ms.set_seed(0)
        par = _Attention()
        parallelize_module(par, mesh, _deferred_plan(local))
        want = ms.grad(lambda t: ref(t).sum())(x).asnumpy()
        got = ms.grad(lambda t: par(t).sum())(x).asnumpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        for use, op in (("residual", "add"), ("scaled", "ReduceSum")):
            ms.set_seed(0)
            bad = _Attention(use)
            parallelize_module(bad, mesh, _deferred_plan(local))
            with pytest.raises(ValueError, match=rf"defer_colwise_grads=True\) on the root Cell.*'{op}'.*"
                                                 r"defer_colwise_grads=False"):
                bad(x)
        assert type(x) is ms.Tensor                     # the caller's tensor is not marked


class _Block(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Dense(8, 16)
        self.down = nn.Dense(16, 8)

    def construct(self, x):
        return self.down(ops.tanh(self.up(x))) + x


class _Blocks(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Dense(6, 8)
        self.layers = nn.CellList([_Block() for _ in range(3)])

    def construct(self, x):
        x = self.embed(x)
        for block in self.layers:
            x = block(x)
        return x


@multi_rank(2)
def test_gradient_of_a_compiled_forward_with_parallel_styles_equals_one_device():
    """``ms.value_and_grad(ms.jit(forward))`` (PyNative differentiating a compiled forward, as a
    compiled pipeline stage does) on Colwise / Rowwise blocks: every block's conversions were one
    cached Cell, and MindSpore's backward read the last block's input for every block's weights
    (all but the last block's weight gradients wrong, no error). Now each call site of a
    compiled graph gets its own conversion Cell."""
    from hyper_parallel_ms.nn import GradientReducer
    from tests._parity import gathered
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = ms.Tensor(np.random.RandomState(0).randn(4, 6).astype(np.float32))
    ms.set_seed(0)
    ref = _Blocks()
    ref_params = ref.trainable_params()
    want = ms.value_and_grad(lambda x: (ref(x) ** 2).mean(), None, ref_params)(x)
    ms.set_seed(0)
    model = _Blocks()
    parallelize_module(model, mesh, {"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()})
    params = model.trainable_params()

    def forward(x):
        return (model(x) ** 2).mean()
    loss, grads = ms.value_and_grad(ms.jit(forward), None, params)(x)
    grads = GradientReducer(params)(grads)
    np.testing.assert_allclose(loss.asnumpy(), want[0].asnumpy(), rtol=1e-6)
    for p, g, w in zip(params, grads, want[1]):
        np.testing.assert_allclose(gathered(p, g), w.asnumpy(), rtol=1e-5, atol=1e-6, err_msg=p.name)


class _KeywordCalls(nn.Cell):
    """Styled layers called with their input by keyword (``mint.nn.Linear`` and ``nn.Dense`` name it
    ``x``), and a Cell whose input the style converts after an input left out."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Dense(8, 8)
        self.up = mint.nn.Linear(8, 6)
        self.down = nn.Dense(6, 8)

    def construct(self, x):
        return self.down(x=ops.tanh(self.up(x=self.pre(x))))


class _TwoInputs(nn.Cell):
    def construct(self, x, mask=None, scale=None):
        return x * 2 if scale is None else x * scale


@multi_rank(2)
def test_styled_layers_given_their_input_by_keyword_equal_one_device():
    """``up(x=h)`` on a ColwiseParallel layer passed the input around the style's conversion: the
    forward was right, but the input's gradient missed its all-reduce, so every layer before it
    trained on a wrong gradient (no error, PyNative and ms.jit). A keyword input the style reads is
    now converted as a positional one; one it cannot reach raises."""
    from hyper_parallel_ms.nn import GradientReducer
    from tests._parity import gathered
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = ms.Tensor(np.random.RandomState(0).randn(3, 8).astype(np.float32))
    ms.set_seed(7)
    ref = _KeywordCalls()
    want = ms.value_and_grad(lambda x: (ref(x) ** 2).sum(), None, ref.trainable_params())(x)
    ms.set_seed(7)
    model = _KeywordCalls()
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    params = model.trainable_params()

    def loss_fn(x):
        return (model(x) ** 2).sum()
    grad = ms.value_and_grad(loss_fn, None, params)
    for step in (grad, ms.jit(grad)):
        loss, grads = step(x)
        grads = GradientReducer(params)(grads)
        np.testing.assert_allclose(loss.asnumpy(), want[0].asnumpy(), rtol=1e-5)
        for p, g, w in zip(params, grads, want[1]):
            np.testing.assert_allclose(gathered(p, g), w.asnumpy(), rtol=1e-5, atol=1e-6, err_msg=p.name)
    two = _TwoInputs()
    parallelize_module(two, mesh, PrepareModuleInput(input_layouts=(Shard(0), None, Shard(0)),
                                                     desired_input_layouts=(Replicate(), None, Replicate()),
                                                     use_local_output=True))
    piece = ms.Tensor(np.full((1, 2), mesh.get_rank() + 1.0, np.float32))
    np.testing.assert_array_equal(two(x=piece).asnumpy(), [[2.0, 2.0], [4.0, 4.0]])
    with pytest.raises(ValueError, match=r"_TwoInputs got the input\(s\) \['scale'\] by keyword after the input "
                                         r"'mask' was left out.*pass them positionally"):
        two(piece, scale=piece)


class _RootRowwise(nn.Cell):
    """PyTorch's test_parallelize_module_with_root_module: a Rowwise layer whose output stays
    sharded (its bias is added to each rank's rows only)."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Dense(6, 8)
        self.net2 = nn.Dense(8, 6)

    def construct(self, x):
        return self.net2(ops.relu(self.net1(x)))


_ROW_INPUT = ms.Tensor(np.random.RandomState(1).randn(4, 6).astype(np.float32))


def _root_rowwise_loss(model, x):
    return (model(x) ** 2).sum()


def _three_sgd_steps(model, loss_of, batch, compiled: bool) -> None:
    opt = nn.SGD(model.trainable_params(), learning_rate=0.1)

    def loss_fn(*inputs):
        return loss_of(model, *inputs)
    step = ms.value_and_grad(loss_fn, None, opt.parameters)
    step = ms.jit(step) if compiled else step
    for _ in range(3):
        opt(step(*batch)[1])


@pytest.mark.parametrize("compiled", [False, True])
@multi_rank(2)
def test_sequence_parallel_and_sharded_rowwise_bias_gradients_are_whole_without_a_reducer(compiled):
    """The gradients of SequenceParallel Cells' parameters and of a Rowwise bias added to sharded
    outputs were each rank's share unless GradientReducer summed them: a port of PyTorch's tests
    with plain ms.value_and_grad + SGD trained every such parameter wrong (PyTorch's autograd
    sums them). They are now summed in the backward: 3 SGD steps equal one device, no reducer."""
    from tests._parity import gathered
    from tests.test_parallel_styles import Transformer, _nll, _tokens, transformer_plan
    from hyper_parallel_ms.nn import parameter_sharding
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rowwise = {"net1": ColwiseParallel(), "net2": RowwiseParallel(output_layouts=Shard(0))}
    for make, plan, loss_of, batch in ((_RootRowwise, rowwise, _root_rowwise_loss, (_ROW_INPUT,)),
                                       (Transformer, transformer_plan(mesh), _nll, _tokens(0, 1, 0))):
        ms.set_seed(0)
        ref = make()
        ms.set_seed(0)
        model = make()
        parallelize_module(model, mesh, plan)
        assert all(parameter_sharding(p) is None or not parameter_sharding(p).grad_partial_dims
                   for p in model.trainable_params())
        _three_sgd_steps(ref, loss_of, batch, False)
        _three_sgd_steps(model, loss_of, batch, compiled)
        for p, q in zip(model.trainable_params(), ref.trainable_params()):
            np.testing.assert_allclose(gathered(p, p), q.asnumpy(), rtol=1e-5, atol=1e-6, err_msg=p.name)


@multi_rank(2)
def test_optimizers_reading_whole_parameters_are_refused_over_pieces():
    """AdaFactor (factored moments, parameter RMS) stepped each rank's piece as if it were the whole
    parameter: parameters off by up to 7e-3 after 3 steps, silently; an optimizer built before
    sharding held Parameters the model no longer reads (zero gradients, no learning). Both are
    refused when the step compiles, before any parameter changes; grad_centralization (each row's
    mean over the other dims) too over pieces cut along dim 1 (RowwiseParallel), while fully_shard's
    pieces of rows centralize exactly; element-wise SGD steps the pieces; a model without pieces
    keeps AdaFactor."""
    from hyper_parallel_ms.fsdp import fully_shard
    from hyper_parallel_ms.nn._parameter import check_optimizer_step
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = ms.Tensor(np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32))

    def adafactor(params):
        return nn.AdaFactor(params, learning_rate=0.01, scale_parameter=False, relative_step=False,
                            warmup_init=False)

    def tp(model):
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})

    def fsdp(model):
        fully_shard(model, mesh=mesh)
    for shard, engine in ((tp, r"a parallel style \(parallelize_module"), (fsdp, r"fully_shard\(_Block\)")):
        ms.set_seed(0)
        model = _Block()
        early = nn.SGD(model.trainable_params(), learning_rate=0.1)       # built before sharding
        shard(model)
        params = model.trainable_params()
        # its Parameters are no longer the model's: zero gradients, a model that never learns
        zeros = ms.value_and_grad(lambda v: (model(v) ** 2).mean(), None, early.parameters)(x)[1]
        with pytest.raises(TypeError, match=f"SGD holds 4 Parameters that {engine}.* replaced .* Build the optimizer "
                                            "after sharding"):
            early(zeros)
        grads = ms.value_and_grad(lambda v: (model(v) ** 2).mean(), None, params)(x)[1]
        before = [p.asnumpy().copy() for p in params]
        with pytest.raises(TypeError, match=r"AdaFactor reads each parameter whole .* hold this rank's pieces"):
            adafactor(params)(grads)
        centralizing = nn.SGD([{"params": params, "grad_centralization": True}], learning_rate=0.1)
        if shard is tp:         # RowwiseParallel cuts down.weight along dim 1, the dim its rows' means read
            with pytest.raises(TypeError, match=r"SGD centralizes gradients .* \['down.weight'\]"):
                centralizing(grads)
            assert all(np.array_equal(b, p.asnumpy()) for b, p in zip(before, params)), shard.__name__
            nn.SGD(params, learning_rate=0.1)(grads)
            for b, p, g in zip(before, params, grads):
                np.testing.assert_allclose(p.asnumpy(), b - 0.1 * g.asnumpy(), rtol=1e-6, atol=1e-7)
        else:                   # fully_shard cuts rows, which centralize exactly: accepted (MindSpore's
            # Centralization kernel is Ascend-only, so the step itself cannot run here)
            assert check_optimizer_step(type(centralizing).construct, (centralizing, grads)) is None
    plain = _Block()
    params = plain.trainable_params()
    adafactor(params)(ms.value_and_grad(lambda v: (plain(v) ** 2).mean(), None, params)(x)[1])


@multi_rank(2)
def test_scalars_of_a_partial_dtensor_are_refused():
    """``float(loss)`` / ``loss.item()`` of a Partial DTensor (a mean over a sharded dim) gave each rank
    its share (1.75 and 15.75 for 17.5); now refused naming full_tensor(); Replicate gives the value."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    full = np.arange(8, dtype=np.float32).reshape(4, 2)
    d = distribute_tensor(ms.Tensor(full), mesh, [Shard(0)])
    loss = (d * d).mean()
    assert loss.placements[0].is_partial()
    for read in (lambda t: t.item(), float, int, bool, lambda t: t.tolist()):
        with pytest.raises(RuntimeError, match="share of the value, not the value; call .full_tensor()"):
            read(loss)
    want = float((full * full).mean())
    assert abs(loss.full_tensor().item() - want) < 1e-5
    assert abs(float(loss.redistribute(placements=[Replicate()])) - want) < 1e-5
    with pytest.raises(ValueError, match=r"Only one element tensors .* global shape \(4, 2\)"):
        d.item()
