"""HyperParallel's activation-checkpoint face (``hyper_parallel.core.activation_checkpoint``:
``checkpoint_wrapper``, ``swap_wrapper``, ``CheckpointPolicy``, ``SwapManager``,
``checkpoint_exclude_wrapper``) on hyper_parallel_ms.training, driven by MindFormers 2.1.0's own
``apply_ac`` (full recompute with exclusions, select recompute of a Cell and of a function, layer
swap with prefetch) on a small decoder: gradients equal to the unwrapped model's, and the
recompute, exclusion and swap counted. One call on the shared 2-rank pool (each rank runs the same
2 s of work, no collective); the refusals in-process."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

from hyper_parallel_ms.compat._activation import CheckpointPolicy, SwapManager, checkpoint_wrapper, swap_wrapper
from hyper_parallel_ms.testing import run_on_ranks
from hyper_parallel_ms.training import CheckpointWrapper, checkpoint_exclude_wrapper, exclude_stats, swap_stats

from tests._mindformers_qwen3 import available


@pytest.fixture(scope="module")
def mindformers_runs():
    if available() is not None:
        pytest.skip(available())
    from tests._compat_activation import run_mindformers_activation_checkpointing
    return run_on_ranks(run_mindformers_activation_checkpointing, 2, timeout=300)[0]   # the shared 2-rank pool


def test_full_recompute_with_exclusions_through_mindformers(mindformers_runs):
    full = mindformers_runs["full"]
    # the same ops on the same values in the same order: bit-equal gradients
    assert full["diff"] == 0.0
    assert full["wrapped"] == [True, True] and full["names"] == full["reference_names"]
    assert full["recomputes"] == [1, 1] and full["forwards"] == [2, 2]
    # MindFormers' context_fn (recompute_context_fn) marks the recompute: is_in_recompute() there only
    assert full["phases"] == [[False, True], [False, True]]
    # the excluded regions ran once, kept their saved tensors, and handed their output to the recompute
    for key, kept in (("excluded_mlp", 5), ("excluded_act", 1)):
        stats = full[key]
        assert (stats["runs"], stats["replays"], stats["plain"], stats["kept_tensors"]) == (1, 1, 0, kept), key


def test_select_recompute_of_a_cell_and_a_function_through_mindformers(mindformers_runs):
    select = mindformers_runs["select"]
    assert select["diff"] == 0.0
    assert select["attn"] == 1 and select["act"] == 1          # both recomputed once in the backward
    assert select["layers_wrapped"] == [False, False]


def test_layer_swap_with_prefetch_through_mindformers(mindformers_runs):
    swap = mindformers_runs["swap"]
    assert swap["diff"] == 0.0 and swap["swapped"]
    stats = swap["stats"]
    # MindFormers' policy answers MUST_SAVE for the block's own inputs (the mask): one tensor fewer
    # than swapping everything; every host copy read back by layer 1's backward, ahead of its use
    assert stats["tensors"] == swap["all_tensors"] - 1 > 0
    assert stats["restored"] == stats["prefetched"] == stats["tensors"]
    assert swap["pairs"] == [(True, True)]


class _Two(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Dense(4, 4), nn.Dense(4, 4)

    def construct(self, x):
        return self.b(ops.tanh(self.a(x)))


def test_the_face_refuses_what_it_does_not_do():
    cell = _Two()
    with pytest.raises(NotImplementedError, match="policy_fn"):
        checkpoint_wrapper(cell, policy_fn=lambda *a: CheckpointPolicy.MUST_SAVE)
    with pytest.raises(NotImplementedError, match="swap_inputs"):
        checkpoint_wrapper(cell, swap_inputs=True)
    with pytest.raises(NotImplementedError, match="cpu_pool"):
        swap_wrapper(cell, cpu_pool=object())
    with pytest.raises(NotImplementedError, match="save_output"):
        checkpoint_exclude_wrapper(cell.a, save_output=False)
    with pytest.raises(ValueError, match="nothing at or under"):
        SwapManager().set_forward_prefetch_layer(cell.a, cell.b)
    assert SwapManager() is SwapManager()
    # a swap policy answering a recompute is refused by name when it is asked
    swap_wrapper(cell.a, policy_fn=lambda t: CheckpointPolicy.PREFER_RECOMPUTE)
    x = ms.Tensor(np.ones((2, 4), np.float32))
    with pytest.raises(ValueError, match="PREFER_RECOMPUTE"):
        ms.grad(lambda x: cell(x).sum(), None, cell.trainable_params())(x)


def test_a_function_checkpointed_and_an_exclusion_outside_a_checkpoint():
    ms.set_seed(3)
    cell = _Two()
    x = ms.Tensor(np.random.RandomState(1).randn(3, 4).astype(np.float32))
    reference = ms.grad(lambda x: (cell(x) ** 2).sum(), 0)(x).asnumpy()
    wrapped = checkpoint_wrapper(lambda t: ops.exp(t * 0.5), output_recompute=True, early_stop=False)
    assert isinstance(wrapped, CheckpointWrapper)
    excluded = checkpoint_exclude_wrapper(cell)        # no checkpoint around it: runs as it is
    got = ms.grad(lambda x: (excluded(x) ** 2).sum(), 0)(x).asnumpy()
    np.testing.assert_array_equal(got, reference)
    assert exclude_stats(excluded).plain == 1 and exclude_stats(excluded).replays == 0
    value = ms.grad(lambda x: wrapped(x).sum(), 0)(x).asnumpy()
    # the derivative of exp(x / 2), recomputed; float32 exp against float64's: 3e-6 relative measured
    np.testing.assert_allclose(value, 0.5 * np.exp(0.5 * x.asnumpy().astype(np.float64)), rtol=1e-5)
    # swapping by CheckpointPolicy: MUST_SWAP moves, MUST_SAVE keeps
    swapped = swap_wrapper(_Two(), policy_fn=lambda t: CheckpointPolicy.MUST_SWAP if t.ndim == 2 else
                           CheckpointPolicy.MUST_SAVE)
    ms.grad(lambda x: swapped(x).sum(), 0)(x)
    assert swap_stats(swapped).tensors > 0 and swap_stats(swapped).restored == swap_stats(swapped).tensors


def test_an_exclusion_inside_a_selective_checkpoint():
    # the selective policy's op record leaves the excluded region out (it does not run in the recompute)
    from hyper_parallel_ms.training import checkpoint_stats
    from hyper_parallel_ms.training import checkpoint_wrapper as native_checkpoint_wrapper
    x = ms.Tensor(np.random.RandomState(2).randn(3, 4).astype(np.float32))
    ms.set_seed(5)
    reference_cell = _Two()
    reference = ms.grad(lambda x: (reference_cell(x) ** 2).sum(), None, reference_cell.trainable_params())(x)
    ms.set_seed(5)
    cell = _Two()
    checkpoint_exclude_wrapper(cell.b)
    native_checkpoint_wrapper(cell, policy="selective")
    got = ms.grad(lambda x: (cell(x) ** 2).sum(), None, cell.trainable_params())(x)
    for g, r in zip(got, reference):
        np.testing.assert_array_equal(g.asnumpy(), r.asnumpy())
    assert checkpoint_stats(cell).recomputes == 1
    assert (exclude_stats(cell.b).runs, exclude_stats(cell.b).replays) == (1, 1)
