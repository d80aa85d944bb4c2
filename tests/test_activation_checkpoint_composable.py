"""PyTorch's other names for the activation wrappers, on one device against the unwrapped model:
the composable ``checkpoint(module)`` (in place, the module returned; its forward runs again in the
backward, counted by the block's own construct; context_fn from create_selective_checkpoint_contexts,
called or as a functools.partial; its refusals) and ``offload_wrapper(module)`` (PyTorch's
signature; saved activations kept on the host and read back, nothing recomputed)."""
from __future__ import annotations

import functools
import inspect
from contextlib import nullcontext

import mindspore as ms
import numpy as np
import pytest

from hyper_parallel_ms._mindspore import SAVED_TENSOR_HOOKS
from hyper_parallel_ms.training import (CheckpointWrapper, SwapWrapper, checkpoint, checkpoint_stats,
                                        create_selective_checkpoint_contexts, offload_wrapper, swap_stats)

from tests.test_activation_checkpoint import CALLS, Block, Net, _batch, _grads, _loss


def _same(model, x):
    ms.set_seed(0)
    plain = Net()
    loss, grads = _grads(plain, x)
    c_loss, c_grads = _grads(model, x)
    assert float(c_loss.asnumpy()) == float(loss.asnumpy())
    for p, g, cg in zip(plain.trainable_params(), grads, c_grads):
        np.testing.assert_allclose(cg.asnumpy(), g.asnumpy(), rtol=1e-6, atol=1e-7, err_msg=p.name)


def test_composable_checkpoint_recomputes_the_module_in_place():
    ms.set_seed(0)
    model = Net()
    names = [p.name for p in model.trainable_params()]
    layer = model.layers[0]
    assert checkpoint(layer) is layer and model.layers[0] is layer
    assert isinstance(layer, Block) and isinstance(layer, CheckpointWrapper) and type(layer).__name__ == "Block"
    assert [p.name for p in model.trainable_params()] == names
    x = _batch(0, 1, 0)[0]
    CALLS["n"] = 0
    _same(model, x)
    # the reference's 2 blocks once, the model's 2 blocks once and its checkpointed block again in the backward
    assert CALLS["n"] == 5, CALLS
    assert (checkpoint_stats(layer).forwards, checkpoint_stats(layer).recomputes) == (2, 1)
    params = model.trainable_params()

    def loss(v):
        return _loss(model, v)
    _, j_grads = ms.jit(ms.value_and_grad(loss, None, params))(x)
    _, grads = _grads(model, x)
    for p, g, jg in zip(params, grads, j_grads):
        np.testing.assert_allclose(jg.asnumpy(), g.asnumpy(), rtol=1e-6, atol=1e-7, err_msg=p.name)


@pytest.mark.parametrize("form", ["called", "partial"])
def test_composable_checkpoint_takes_a_selective_context_fn(form):
    context_fn = create_selective_checkpoint_contexts({"MatMul"}) if form == "called" else \
        functools.partial(create_selective_checkpoint_contexts, {"MatMul"})
    ms.set_seed(0)
    model = Net()
    for block in model.layers:
        checkpoint(block, context_fn=context_fn)
    _same(model, _batch(0, 1, 0)[0])
    stats = checkpoint_stats(model.layers[1])
    assert stats.recomputes == 1 and stats.saved == stats.replayed == {"MatMul": 2}, stats.saved


def test_composable_checkpoint_refusals_leave_the_module_as_it_was():
    block = Block()
    with pytest.raises(NotImplementedError, match="use_reentrant=True.*non-reentrant"):
        checkpoint(block, use_reentrant=True)
    with pytest.raises(NotImplementedError, match="create_selective_checkpoint_contexts.*policy="):
        checkpoint(block, context_fn=lambda: (nullcontext(), nullcontext()))
    with pytest.raises(ValueError, match="determinism_check"):
        checkpoint(block, determinism_check="strict")
    with pytest.raises(ValueError, match="either context_fn or policy"):
        checkpoint(block, context_fn=create_selective_checkpoint_contexts("selective"), policy="selective")
    with pytest.raises(TypeError, match=r"policy must be None, 'full', 'selective'.*got 42 \(int\)"):
        checkpoint(block, policy=42)
    with pytest.raises(TypeError, match="unexpected keyword"):
        checkpoint(block, unknown=1)
    assert type(block) is Block


@pytest.mark.skipif(not SAVED_TENSOR_HOOKS, reason="mindspore.saved_tensors_hooks (MindSpore 2.9 and later)")
def test_offload_wrapper_keeps_activations_on_the_host_with_the_exact_gradients():
    assert list(inspect.signature(offload_wrapper).parameters) == ["module"]      # PyTorch's signature
    ms.set_seed(0)
    model = Net()
    layer = model.layers[0]
    assert offload_wrapper(layer) is layer and isinstance(layer, SwapWrapper) and isinstance(layer, Block)
    x = _batch(0, 1, 0)[0]
    CALLS["n"] = 0
    _same(model, x)
    assert CALLS["n"] == 4, "each block runs once in each model: nothing is recomputed"
    stats = swap_stats(layer)
    assert stats.tensors > 0 and stats.restored == stats.tensors, stats
    params = model.trainable_params()

    def loss(v):
        return _loss(model, v)
    with pytest.raises(NotImplementedError, match="swap_wrapper.*checkpoint_wrapper"):
        ms.jit(ms.value_and_grad(loss, None, params))(x)
