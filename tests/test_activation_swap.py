"""Activation swapping (swap_wrapper, HyperParallel's name): the wrapped Cell's saved activations
are kept as host copies and read back in the backward. The single-device answer exactly (the same
ops run once; the values make a round trip), names and paths unchanged, Parameters never copied,
the policy obeyed; TP blocks and fully_shard units on 2 ranks against one device (loss per step,
parameters after 3 AdamW steps, tests/_parity.py); refusals: ms.jit, group_swap, nesting with
checkpoint_wrapper."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.testing import multi_rank
from hyper_parallel_ms.training import SwapWrapper, checkpoint_wrapper, swap_stats, swap_wrapper

from hyper_parallel_ms._mindspore import SAVED_TENSOR_HOOKS
from tests._parity import check_parity
from tests.test_activation_checkpoint import CALLS, Block, Net, _batch, _grads, _loss

_NEEDS_HOOKS = pytest.mark.skipif(not SAVED_TENSOR_HOOKS, reason="mindspore.saved_tensors_hooks (MindSpore 2.9 and "
                                  "later); the refusal on older releases is tested below")


@pytest.mark.skipif(SAVED_TENSOR_HOOKS, reason="this MindSpore has saved_tensors_hooks: the swap tests below run")
def test_older_mindspore_refuses_naming_checkpoint_wrapper():
    model = Net()
    with pytest.raises(NotImplementedError, match="use checkpoint_wrapper"):
        swap_wrapper(model)
    assert type(model) is Net


def _swap_blocks(model, policy_fn=None):
    for block in model.layers:
        swap_wrapper(block, policy_fn)
    return model


@_NEEDS_HOOKS
def test_swapped_blocks_give_the_exact_gradients_once_with_names_unchanged():
    ms.set_seed(0)
    plain = Net()
    ms.set_seed(0)
    model = _swap_blocks(Net())
    assert [p.name for p in model.trainable_params()] == [p.name for p in plain.trainable_params()]
    assert isinstance(model.layers[0], SwapWrapper) and isinstance(model.layers[0], Block)
    x = _batch(0, 1, 0)[0]
    loss, grads = _grads(plain, x)
    CALLS["n"] = 0
    s_loss, s_grads = _grads(model, x)
    assert CALLS["n"] == 2, "each block runs once: nothing is recomputed"
    assert float(s_loss.asnumpy()) == float(loss.asnumpy())
    for p, g, sg in zip(plain.trainable_params(), grads, s_grads):
        np.testing.assert_array_equal(sg.asnumpy(), g.asnumpy(), err_msg=p.name)
    stats = swap_stats(model.layers[0])
    # the block saves activations (its input, the matmul outputs, tanh's output), no Parameter
    assert stats.tensors > 0 and stats.restored == stats.tensors, stats
    assert stats.bytes >= 8 * 8 * 4, stats
    # a policy swapping nothing: same answer, nothing copied
    ms.set_seed(0)
    none = _swap_blocks(Net(), policy_fn=lambda t: False)
    n_loss, _ = _grads(none, x)
    assert float(n_loss.asnumpy()) == float(loss.asnumpy()) and swap_stats(none.layers[0]).tensors == 0


@_NEEDS_HOOKS
def test_refusals_leave_the_cell_as_it_was():
    ms.set_seed(0)
    model = Net()
    block = model.layers[0]
    with pytest.raises(ValueError, match="group_swap=True"):
        swap_wrapper(block, group_swap=True)
    with pytest.raises(TypeError, match="policy_fn must be a callable"):
        swap_wrapper(block, policy_fn=3)
    assert type(block) is Block
    checkpoint_wrapper(model.layers[1])
    with pytest.raises(ValueError, match="already swapped or checkpointed"):
        swap_wrapper(model)
    assert type(model) is Net
    # swapped inside a checkpointed forward: refused when it runs
    ms.set_seed(0)
    outer = Net()
    swap_wrapper(outer.layers[0])
    checkpoint_wrapper(outer)
    with pytest.raises(ValueError, match="runs inside the checkpointed"):
        _grads(outer, _batch(0, 1, 0)[0])
    # compiled: refused naming PyNative
    ms.set_seed(0)
    swapped = _swap_blocks(Net())

    def forward(x):
        return _loss(swapped, x)
    with pytest.raises(NotImplementedError, match="saved-tensor hooks"):
        ms.jit(forward)(_batch(0, 1, 0)[0])


@_NEEDS_HOOKS
@multi_rank(2, timeout=900)
def test_swapped_tp_blocks_and_fully_shard_units_parity_on_2_ranks():
    from hyper_parallel_ms.fsdp import fully_shard
    from hyper_parallel_ms.nn import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))

    def tp(model):
        parallelize_module(model, mesh, {"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()})
        _swap_blocks(model)
    check_parity(Net, tp, _batch, _loss, optimizer="adamw")
    dp = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))

    def fsdp(model):
        for layer in model.layers:
            fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
        _swap_blocks(model)
    check_parity(Net, fsdp, _batch, _loss, optimizer="adamw", dp_mesh=dp, dp_dim="dp",
                 dp_index=dp.get_local_rank(0), dp_size=2)
