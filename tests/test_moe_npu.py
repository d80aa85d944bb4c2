"""The experts' grouped matmul on Ascend NPUs (MindSpore's ``gmm``, group sizes from the counts): values and
gradients equal the per-expert loop. Needs ``HPMS_TEST_DEVICE=Ascend``; on CPU it is skipped and its twin,
``tests/test_moe.py::test_moe_layer_matches_numpy_and_compiles``, checks the CPU paths (loop and compiled)."""
from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = [pytest.mark.npu,
              pytest.mark.skipif(os.environ.get("HPMS_TEST_DEVICE") != "Ascend",
                                 reason="needs an Ascend NPU (HPMS_TEST_DEVICE=Ascend); CPU twin: test_moe.py")]


def test_grouped_matmul_experts_equal_the_loop_on_npu():
    import mindspore as ms
    from hyper_parallel_ms.moe import GroupedExperts
    from hyper_parallel_ms.moe._experts import _looped, _path

    ms.set_device("Ascend")
    assert _path() == "grouped"
    experts = GroupedExperts(16, 32, 4)
    counts = ms.Tensor(np.array([3, 0, 4, 1], np.int32))          # an expert without tokens included
    x = ms.Tensor(np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32))
    weights = experts.trainable_params()

    def grouped(v):
        return (experts(v, counts) ** 2).sum()

    def looped(v):
        return (_looped(v, experts.w1, experts.w2, experts.w3, counts) ** 2).sum()
    def flat(value):
        return [t for v in value for t in flat(v)] if isinstance(value, (tuple, list)) else [value]
    got, want = (flat(ms.value_and_grad(f, 0, weights)(x)) for f in (grouped, looped))
    assert len(got) == len(want) == 5                               # loss, x's gradient, w1 / w2 / w3's
    for a, b in zip(got, want):      # Ascend's matmuls may round float32 inputs through HF32: 1e-3
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-3, atol=1e-4)
