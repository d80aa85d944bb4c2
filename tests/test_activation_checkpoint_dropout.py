"""Dropout inside an activation checkpoint: the recompute draws the forward's mask (nn.Dropout and
ops.dropout), full and selective policies, on one device against the unwrapped block."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

from hyper_parallel_ms.training import checkpoint_stats, checkpoint_wrapper


class _DropoutBlock(nn.Cell):
    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Dense(8, 16), nn.Dense(16, 8)
        self.functional = functional
        self.drop = nn.Dropout(p=0.5)

    def construct(self, x):
        h = ops.relu(self.a(x))
        h = ops.dropout(h, p=0.5) if self.functional else self.drop(h)
        return self.b(h)


@pytest.mark.parametrize("policy", [None, "selective"])
@pytest.mark.parametrize("functional", [False, True])
def test_dropout_inside_a_checkpoint_draws_the_forward_mask_in_the_recompute(policy, functional):
    """nn.Dropout (a kept primitive whose kernel holds its generator) and ops.dropout (seeds drawn in
    Python): the recompute uses the forward's mask and leaves the random state as one device does, so
    two steps give the unwrapped block's losses and gradients (before: gradients off by up to 2.7e3,
    the next step's loss 76292 for 41662)."""
    def run(wrap):
        ms.set_seed(1)
        block = _DropoutBlock(functional)
        block.set_train(True)
        rng = np.random.default_rng(0)
        for _, p in sorted(block.parameters_and_names()):
            p.set_data(ms.Tensor(rng.standard_normal(p.shape).astype(np.float32)))
        if wrap:
            checkpoint_wrapper(block, policy=policy)
        x = ms.Tensor(rng.standard_normal((4, 8)).astype(np.float32))
        step = ms.value_and_grad(lambda v: (block(v) ** 2).sum(), None, block.trainable_params())
        ms.set_seed(7)
        out = [step(x) for _ in range(2)]
        return [(float(loss.asnumpy()), [g.asnumpy() for g in grads]) for loss, grads in out], block
    want, _ = run(False)
    got, block = run(True)
    for (loss, grads), (w_loss, w_grads) in zip(got, want):
        assert loss == w_loss
        for g, w in zip(grads, w_grads):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    assert checkpoint_stats(block).replayed == checkpoint_stats(block).saved and checkpoint_stats(block).saved
