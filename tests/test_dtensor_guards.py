"""DTensors never compute silently on their local piece: compiled code refuses them,
sequence ops (cat, stack) propagate sharding on every MindSpore release, errors from the
dispatcher keep their type, from_local(run_check=True) compares Replicate pieces, and a
plain tensor that does not broadcast is named. 2 ranks."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, mint, nn, ops

from hyper_parallel_ms.dtensor import DTensor, distribute_tensor
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.ops import strict_plain_tensors
from hyper_parallel_ms.placement import Replicate, Shard
from hyper_parallel_ms.testing import multi_rank

_X = np.arange(8, dtype=np.float32).reshape(4, 2)


def _gram(t):
    return t @ t.T


class _Gram(nn.Cell):
    def construct(self, t):
        return t @ t.T


@multi_rank(2)
def test_dtensors_are_refused_by_ms_jit_and_graph_mode_cells():
    mesh = init_device_mesh("cpu", (2,))
    dt = distribute_tensor(Tensor(_X), mesh, [Shard(0)])
    with pytest.raises(TypeError, match=r"argument 't' of the ms.jit function '_gram' is a DTensor.*to_local"):
        ms.jit(_gram)(dt)
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        with pytest.raises(TypeError, match=r"argument 't' of the GRAPH_MODE Cell '_Gram.construct'.*to_local"):
            _Gram()(dt)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    full = _gram(dt)                             # PyNative: the global (4, 4) product
    assert full.shape == (4, 4)
    np.testing.assert_allclose(full.full_tensor().asnumpy(), _X @ _X.T, rtol=1e-6)
    local = ms.jit(_gram)(dt.to_local())         # the documented way: local pieces in, local out
    np.testing.assert_allclose(local.asnumpy(), dt.to_local().asnumpy() @ dt.to_local().asnumpy().T, rtol=1e-6)


@multi_rank(2)
def test_sequence_ops_propagate_sharding_on_every_release():
    mesh = init_device_mesh("cpu", (2,))
    a = distribute_tensor(Tensor(_X), mesh, [Shard(1)])
    b = distribute_tensor(Tensor(_X * 10), mesh, [Shard(1)])
    cases = {"ops.cat list": (lambda: ops.cat([a, b]), np.concatenate([_X, _X * 10])),
             "ops.cat tuple": (lambda: ops.cat((a, b), 1), np.concatenate([_X, _X * 10], 1)),
             "mint.cat list": (lambda: mint.cat([a, b], dim=0), np.concatenate([_X, _X * 10])),
             "ops.stack list": (lambda: ops.stack([a, b]), np.stack([_X, _X * 10])),
             "ops.stack axis -1": (lambda: ops.stack((a, b), -1), np.stack([_X, _X * 10], -1))}
    for name, (run, want) in cases.items():
        out = run()
        assert isinstance(out, DTensor), f"{name} returned {type(out).__name__}"
        np.testing.assert_allclose(out.full_tensor().asnumpy(), want, err_msg=name)


@multi_rank(2)
def test_dispatcher_errors_reach_the_caller_with_their_type():
    mesh = init_device_mesh("cpu", (2,))
    dt = distribute_tensor(Tensor(_X), mesh, [Shard(0)])
    plain = Tensor(_X)
    with strict_plain_tensors():
        for run in (lambda: dt + plain, lambda: plain * dt, lambda: dt.add(plain), lambda: ops.cat([dt, plain])):
            with pytest.raises(TypeError, match="plain Tensor"):
                run()
    # a DTensor keyword argument reached the op as this rank's piece (x.clamp(max=m) with m Shard(0)
    # gave every rank its own row, silently): refused, naming the positional form
    x = distribute_tensor(Tensor(np.ones((3, 2), np.float32)), mesh, [Replicate()])
    m = distribute_tensor(Tensor(np.array([0.1, -0.2], np.float32)), mesh, [Shard(0)])
    for run in (lambda: x.clamp(max=m), lambda: mint.clamp(x, max=m)):
        with pytest.raises(TypeError, match=r"keyword argument\(s\) \['max'\].*positionally"):
            run()
    np.testing.assert_allclose(mint.clamp(x, None, m).full_tensor().asnumpy(), [[0.1, -0.2]] * 3, rtol=1e-6)


@multi_rank(2)
def test_from_local_run_check_compares_replicate_pieces():
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    rank = mesh.get_coordinate()[0]
    same = DTensor.from_local(Tensor(_X), mesh, [Replicate(), Replicate()], run_check=True)
    assert same.shape == (4, 2)
    sharded = DTensor.from_local(Tensor(_X + rank), mesh, [Shard(0), Replicate()], run_check=True)
    assert sharded.shape == (8, 2)
    with pytest.raises(ValueError, match=r"Replicate mesh dim 'dp' differ.*largest element-wise difference 3"):
        DTensor.from_local(Tensor(_X + 3 * rank), mesh, [Replicate(), Shard(1)], run_check=True)


@multi_rank(2)
def test_plain_tensor_that_does_not_broadcast_is_named():
    mesh = init_device_mesh("cpu", (2,))
    dt = distribute_tensor(Tensor(_X), mesh, [Shard(0)])     # global (4, 2), local (2, 2)
    with pytest.raises(ValueError, match=r"argument 1 is a plain Tensor of shape \(3,\), read as Replicate"
                                         r".*strict_plain_tensors"):
        dt + Tensor(np.ones(3, np.float32))
