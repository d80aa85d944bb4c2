"""``enable_mindspore_backward_compat``: PyTorch's ``loss.backward()`` and ``param.grad`` on
MindSpore 2.10 (HyperParallel's name, which MindFormers' trainer calls). One process: the gradients
equal ``ms.grad``'s (also through a custom-bprop Cell), accumulate, honour ``gradient``, ``inputs``
and ``retain_graph``, refuse what PyTorch refuses; ``ms.grad`` keeps working beside it; ``disable``
puts MindSpore back. Two ranks: a tensor-parallel MLP (this library's collectives, whose Cells have
custom bprops) and a fully sharded one train by ``loss.backward()`` as by ``ms.value_and_grad`` and as
one device, their gradients read as DTensors laid out like the parameters."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops
from mindspore.common.api import _pynative_executor
from mindspore.graph.api import _no_grad

from hyper_parallel_ms.testing import run_on_ranks
from hyper_parallel_ms.training import disable_mindspore_backward_compat, enable_mindspore_backward_compat


class _Tripled(nn.Cell):
    """Doubles forward; its custom bprop triples (so the test sees which backward ran)."""

    def construct(self, x):
        return x * 2

    def bprop(self, x, out, dout):
        return (dout * 3,)


class _Net(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Dense(4, 3)
        self.tripled = _Tripled()

    def construct(self, x):
        return self.tripled(self.dense(x)).sum()


def _x() -> Tensor:
    return Tensor(np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32))


@pytest.fixture
def compat():
    enable_mindspore_backward_compat()
    yield
    disable_mindspore_backward_compat()


def test_backward_accumulates_the_gradients_ms_grad_computes(compat):
    net, x = _Net(), _x()
    params = net.trainable_params()
    reference = [g.asnumpy() for g in ms.grad(net, None, params)(x)]   # also under the compat: a top graph
    assert all(p.grad is None for p in params)                          # ms.grad leaves .grad alone
    net(x).backward()
    for p, ref in zip(params, reference):
        np.testing.assert_array_equal(p.grad.asnumpy(), ref)            # the custom bprop ran (3, not 2)
    net(x).backward(Tensor(0.5, ms.float32))                            # accumulates, scaled by gradient=
    for p, ref in zip(params, reference):
        np.testing.assert_allclose(p.grad.asnumpy(), 1.5 * ref, rtol=1e-6)
    for p in params:
        p.grad = None
    assert all(p.grad is None for p in params)
    again = ms.value_and_grad(lambda t: net(t), None, params)(x)[1]     # a function: its own top graph
    for g, ref in zip(again, reference):
        np.testing.assert_array_equal(g.asnumpy(), ref)
    assert _pynative_executor.grad_flag()                               # still recording after ms.grad


def test_backward_options_and_refusals(compat):
    net, x = _Net(), _x()
    loss = net(x)
    loss.backward(retain_graph=True)
    first = net.dense.weight.grad.asnumpy().copy()
    loss.backward()
    np.testing.assert_allclose(net.dense.weight.grad.asnumpy(), 2 * first, rtol=1e-6)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()                                                 # the graph was freed
    net.dense.weight.grad = net.dense.bias.grad = None
    net(x).backward(inputs=[net.dense.bias])
    assert net.dense.weight.grad is None and net.dense.bias.grad is not None
    inputs = _x()
    inputs.requires_grad_()
    (inputs * 2).sum().backward()
    np.testing.assert_array_equal(inputs.grad.asnumpy(), np.full((2, 4), 2, np.float32))
    with pytest.raises(RuntimeError, match="only for scalar outputs"):
        net.dense(x).backward()
    with _no_grad():
        unrecorded = net(x)
    with pytest.raises(RuntimeError, match="no autodiff record"):
        unrecorded.backward()
    with pytest.raises(RuntimeError, match="shape"):
        net.dense.weight.grad = ops.zeros((4, 3), ms.float32)
    with pytest.raises(TypeError, match="Tensor or None"):
        net.dense.weight.grad = 1.0


def test_disable_puts_mindspore_back():
    flag = _pynative_executor.grad_flag()
    originals = (nn.Cell._call_custom_bprop, nn.Cell._call_pre_process, _pynative_executor.new_graph)
    enable_mindspore_backward_compat()
    enable_mindspore_backward_compat()                                  # idempotent
    assert hasattr(Tensor, "backward") and hasattr(ms.Parameter, "grad")
    disable_mindspore_backward_compat()
    assert not hasattr(Tensor, "backward") and not hasattr(ms.Parameter, "grad")
    assert (nn.Cell._call_custom_bprop, nn.Cell._call_pre_process, _pynative_executor.new_graph) == originals
    assert _pynative_executor.grad_flag() == flag
    net, x = _Net(), _x()                                               # MindSpore's custom bprop path again
    np.testing.assert_allclose(ms.grad(net, 0)(x).asnumpy(), np.tile(3 * net.dense.weight.asnumpy().sum(0), (2, 1)),
                               rtol=1e-6)


# ---------------------------------------------------------------------------------------- two ranks

def _mlp():
    from tests.test_parallel_styles import MLP
    model = MLP()
    for i, p in enumerate(model.trainable_params()):
        p.set_data(Tensor(np.random.default_rng(i).standard_normal(p.shape).astype(np.float32) * 0.3))
    return model


def _rows(rank: int, world: int) -> Tensor:
    x = np.random.default_rng(5).standard_normal((4, 3, 8)).astype(np.float32)
    rows = 4 // world
    return Tensor(x[rank * rows:(rank + 1) * rows])


def _train(model, x, steps: int, by_backward: bool):
    """``steps`` SGD steps on ``mean(model(x)^2)``: by ``loss.backward()`` and ``p.grad`` (the optimizer
    given the local pieces of DTensor gradients), or by ``ms.value_and_grad``. Returns the losses and
    the first step's gradients' placements (``None`` for a plain gradient)."""
    params = model.trainable_params()
    opt = nn.SGD(params, learning_rate=0.1)
    losses, placements = [], None
    for _ in range(steps):
        if by_backward:
            loss = (model(x) ** 2).mean()
            loss.backward()
            grads = [p.grad for p in params]
            placements = placements or [getattr(g, "placements", None) for g in grads]
            opt(tuple(g.to_local() if hasattr(g, "to_local") else g for g in grads))
            for p in params:
                p.grad = None
        else:
            loss, grads = ms.value_and_grad(lambda t: (model(t) ** 2).mean(), None, params)(x)
            opt(grads)
        losses.append(float(loss.asnumpy()))
    return losses, placements


def _full(model) -> dict:
    from hyper_parallel_ms.checkpoint import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.asnumpy() for k, v in state.items()}


def backward_on_ranks(steps: int) -> dict:
    """On each of 2 ranks: one device (whole batch), TP=2 (ColwiseParallel / RowwiseParallel, whole
    batch) and fully_shard over dp=2 (each rank its rows), each trained by ``loss.backward()`` and
    (TP, fully_shard) by ``ms.value_and_grad``."""
    from mindspore.communication import get_rank
    from hyper_parallel_ms.fsdp import fully_shard
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.nn import ColwiseParallel, RowwiseParallel, parallelize_module
    rank, out = get_rank(), {}
    enable_mindspore_backward_compat()
    try:
        model = _mlp()
        out["one_device"] = _train(model, _rows(0, 1), steps, True)[0], _full(model)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        for how, by_backward in (("backward", True), ("value_and_grad", False)):
            model = _mlp()
            parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
            losses, placements = _train(model, _rows(0, 1), steps, by_backward)
            out[f"tp_{how}"] = losses, _full(model), placements
            model = _mlp()
            fully_shard(model, mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)))
            losses, placements = _train(model, _rows(rank, 2), steps, by_backward)
            out[f"fsdp_{how}"] = losses, _full(model), placements
    finally:
        disable_mindspore_backward_compat()
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(backward_on_ranks, 2, 3)


def test_tensor_parallel_and_fully_shard_train_by_backward_as_one_device(ranks):
    from hyper_parallel_ms.placement import Replicate, Shard
    ref_losses, ref_params = ranks[0]["one_device"]
    assert ref_losses[-1] < ref_losses[0]
    for rank in ranks:
        for case in ("tp", "fsdp"):
            losses, params, placements = rank[f"{case}_backward"]
            by_grad_losses, by_grad_params, _ = rank[f"{case}_value_and_grad"]
            assert losses == by_grad_losses                     # the same gradients, the same steps
            for name, ref in ref_params.items():
                np.testing.assert_array_equal(params[name], by_grad_params[name], err_msg=name)
                # float32 sums in another order over 3 SGD steps
                np.testing.assert_allclose(params[name], ref, rtol=1e-5, atol=1e-6, err_msg=name)
            if case == "tp":
                np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
                # up.weight, up.bias: Shard(0); down.weight: Shard(1); down.bias: Replicate
                assert placements == [(Shard(0),), (Shard(0),), (Shard(1),), (Replicate(),)]
            else:
                np.testing.assert_allclose(np.mean([r["fsdp_backward"][0] for r in ranks], 0), ref_losses, rtol=1e-6)
                assert all(p == (Shard(0),) for p in placements)
