"""The parallel styles, the Ascend-only kernels on DTensors and the training example on
Ascend NPUs. Needs ``HPMS_TEST_DEVICE=Ascend`` and 4 NPUs; on CPU it is skipped and its CPU
twins run: ``test_parallel_styles.py`` (same parity checks), ``test_ops_views.py`` and
``test_ops_layers.py`` (the rules of StackExt / RmsNorm / LayerNormExt / FuncDropoutExt with CPU
kernels standing in) and ``test_train_example.py``."""
from __future__ import annotations

import os

import mindspore as ms
import numpy as np
import pytest
from mindspore import mint, nn, ops

from hyper_parallel_ms.testing import multi_rank

pytestmark = [pytest.mark.npu,
              pytest.mark.skipif(os.environ.get("HPMS_TEST_DEVICE") != "Ascend",
                                 reason="needs Ascend NPUs (HPMS_TEST_DEVICE=Ascend); CPU twins: "
                                        "test_parallel_styles.py, test_ops_views.py, test_ops_layers.py, "
                                        "test_train_example.py")]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@multi_rank(4)
def test_transformer_parity_on_npu(optimizer):
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.nn import parallelize_module
    from tests._parity import check_parity
    from tests.test_parallel_styles import Transformer, _nll, _tokens, transformer_plan

    mesh = init_device_mesh("npu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_coordinate()[0]
    for jit in (False, True):
        check_parity(Transformer, lambda m: parallelize_module(m, mesh["tp"], transformer_plan(mesh["tp"])), _tokens,
                     _nll, optimizer=optimizer, dp_mesh=mesh, dp_dim="dp", dp_index=dp, dp_size=2, jit=jit,
                     tol=1e-4)


class _MintEmbedHead(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.embed = mint.nn.Embedding(16, 8)
        self.head = mint.nn.Linear(8, 16, bias=False)

    def construct(self, ids):
        return self.head(self.embed(ids))


@multi_rank(4)
def test_mint_embedding_styles_on_npu():
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.nn import ColwiseParallel, RowwiseParallel, parallelize_module
    from hyper_parallel_ms.placement import Replicate
    from tests._parity import check_parity
    from tests.test_parallel_styles import _nll, _tokens

    mesh = init_device_mesh("npu", (4,), mesh_dim_names=("tp",))
    check_parity(_MintEmbedHead, lambda m: parallelize_module(m, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate()), "head": ColwiseParallel(output_layouts=Replicate())}),
        _tokens, _nll, optimizer="adamw", tol=1e-4)
    check_parity(_MintEmbedHead, lambda m: parallelize_module(m, mesh, {
        "embed": ColwiseParallel(), "head": RowwiseParallel()}), _tokens, _nll, optimizer="adamw", tol=1e-4)


@multi_rank(4)
def test_ascend_only_kernels_on_dtensors():
    from hyper_parallel_ms.dtensor import DTensor, distribute_tensor
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.placement import Replicate, Shard

    mesh = init_device_mesh("npu", (2, 2), mesh_dim_names=("dp", "tp"))
    rng = np.random.default_rng(0)
    x = ms.Tensor(rng.standard_normal((4, 6, 8)).astype(np.float32))
    g = ms.Tensor(rng.standard_normal(8).astype(np.float32))
    dx = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    cases = [
        (lambda t: mint.stack([t, t * 2.0], 1), [Shard(0), Shard(2)]),
        (lambda t: ops.rms_norm(t, g)[0], [Shard(0), Shard(1)]),
        (lambda t: mint.nn.functional.layer_norm(t, (8,)), [Shard(0), Shard(1)]),
    ]
    for fn, placements in cases:
        out = fn(dx)
        assert isinstance(out, DTensor) and list(out.placements) == placements
        np.testing.assert_allclose(out.full_tensor().asnumpy(), fn(x).asnumpy(), rtol=1e-4, atol=1e-4)
    ones = distribute_tensor(ms.Tensor(np.ones((8, 6), np.float32)), mesh, [Replicate(), Shard(0)])
    dropped = mint.nn.functional.dropout(ones, 0.5)
    assert dropped.placements == (Replicate(), Shard(0))
    pieces = DTensor.from_local(dropped.to_local(), mesh, [Shard(0), Shard(0)]).full_tensor().asnumpy()
    assert set(np.unique(pieces)) <= {0.0, 2.0}


@pytest.mark.parametrize("mode", ["graph", "jit", "pynative"])
@multi_rank(4)
def test_training_example_on_npu(mode):
    from examples.train_tp import TrainConfig, train
    result = train(TrainConfig(dp=2, tp=2, mode=mode, steps=10), log=lambda line: None)
    assert result["max_relative_difference"] <= 1e-3
