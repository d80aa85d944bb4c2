"""Shared by the ops tests: run a function on DTensors and on full tensors and compare the
output, its placements and the gradients of every input."""
from __future__ import annotations

import mindspore as ms
import numpy as np

from hyper_parallel_ms.dtensor import DTensor, distribute_tensor
from hyper_parallel_ms.ops import dispatch
from hyper_parallel_ms.placement import Partial, Replicate, Shard
from hyper_parallel_ms.redistribute import replicate_partials

R, P, S0, S1, S2 = Replicate(), Partial(), Shard(0), Shard(1), Shard(2)


def check_op(mesh, fn, arrays, placements, expect=None):
    """Run ``fn`` on DTensors and on full tensors; compare output, placements and gradients."""
    full = [ms.Tensor(a) for a in arrays]
    ref = fn(*full)
    w = ms.Tensor(np.random.default_rng(1).standard_normal(ref.shape).astype(np.float32))
    positions = tuple(range(len(arrays)))

    def ref_loss(*args):
        return (fn(*args) * w).sum()
    ref_grads = ms.grad(ref_loss, grad_position=positions)(*full)
    ref_grads = ref_grads if isinstance(ref_grads, tuple) else (ref_grads,)
    dts = [distribute_tensor(t, mesh, p, src_data_rank=None) for t, p in zip(full, placements)]
    out = fn(*dts)
    assert isinstance(out, DTensor), type(out)
    if expect is not None:
        assert out.placements == tuple(expect), (out.placements, expect)
    np.testing.assert_allclose(out.full_tensor().asnumpy(), ref.asnumpy(), rtol=1e-5, atol=1e-5)

    def loss(*locals_):
        args = [DTensor.from_local(piece, mesh, d.layout, shape=d.shape) for piece, d in zip(locals_, dts)]
        return (fn(*args).full_tensor() * w).sum()
    grads = ms.grad(loss, grad_position=positions)(*[d.to_local() for d in dts])
    grads = grads if isinstance(grads, tuple) else (grads,)
    coord = mesh.get_coordinate()
    for g, rg, d in zip(grads, ref_grads, dts):
        want = rg.asnumpy()[replicate_partials(d.layout).local_slices(d.shape, coord)]
        np.testing.assert_allclose(g.asnumpy(), want, rtol=1e-5, atol=1e-5)
    return out


def _rand(*shape, seed=0):
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape).astype(np.float32)


def _on_dtensors(name, impl):
    """``impl`` on plain tensors; on DTensors, the dispatcher running op ``name`` with ``impl``
    as its local kernel (a CPU twin for ops whose MindSpore kernel is Ascend-only)."""
    class Kernel:
        def __call__(self, *args):
            return impl(*args)
    kernel = Kernel()
    kernel.name = name

    def run(*args):
        flat = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])]
        if any(isinstance(t, DTensor) for t in flat):
            return dispatch(kernel, args, {})
        return impl(*args)
    return run
