"""LocalRedistribute: plans made for the local shape met at call time, in PyNative and inside
ms.jit, with PyTorch's redistribute backward (or a given gradient layout)."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

from hyper_parallel_ms.layout import Layout
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.placement import Partial, Replicate, Shard
from hyper_parallel_ms.redistribute import LocalRedistribute
from hyper_parallel_ms.testing import multi_rank

R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)


def test_global_shape_of_even_pieces():
    assert Layout((2, 2), (S0, S1)).even_global_shape((3, 4)) == (6, 8)
    assert Layout((2, 2), (S1, S1)).even_global_shape((3, 4)) == (3, 16)
    assert Layout((4,), (R,)).even_global_shape((5,)) == (5,)


def _cases():
    """(src, dst, grad_src, forward(full pieces), backward(dout per rank) -> expected grad)."""
    return [((S1,), (R,), (P,)), ((P,), (R,), None), ((P,), (S1,), None), ((R,), (R,), (P,)), ((R,), (S0,), None)]


@pytest.mark.parametrize("use_jit", [False, True])
@multi_rank(2)
def test_local_redistribute_values_and_gradients(use_jit):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rank = mesh.get_coordinate()[0]
    rng = np.random.default_rng(0)
    for batch in (4, 6):                                # a new local shape plans again
        full = rng.standard_normal((batch, 4)).astype(np.float32)
        parts = [rng.standard_normal((batch, 4)).astype(np.float32) for _ in range(2)]
        weight = rng.standard_normal((batch, 4)).astype(np.float32)
        for src, dst, grad_src in _cases():
            cell = LocalRedistribute(mesh, Layout((2,), src), Layout((2,), dst),
                                     None if grad_src is None else Layout((2,), grad_src))
            if src == (S1,):
                x, want = full[:, 2 * rank:2 * rank + 2], full
            elif src == (P,):
                x, want = parts[rank], parts[0] + parts[1]
            else:
                x, want = full, full
            if dst == (S1,):
                want = want[:, 2 * rank:2 * rank + 2]
            elif dst == (S0,):
                want = want[batch // 2 * rank:batch // 2 * (rank + 1)]
            w = ms.Tensor(weight[:want.shape[0], :want.shape[1]])

            def loss(t):
                return (cell(t) * w).sum()
            fn = ms.jit(ms.value_and_grad(loss)) if use_jit else ms.value_and_grad(loss)
            value, grad = fn(ms.Tensor(x))
            terms = want * w.asnumpy()     # a sum may cancel: bound its rounding by the terms' magnitudes
            np.testing.assert_allclose(value.asnumpy(), terms.sum(), rtol=1e-5, atol=1e-6 * np.abs(terms).sum())
            # expected gradient: PyTorch's semantics (a Partial / given gradient layout read as the sum)
            w_full = weight[:want.shape[0], :want.shape[1]]
            if dst == (S1,):
                g_global = np.zeros((batch, 4), np.float32)
                g_global[:, 2 * rank:2 * rank + 2] = w_full   # this rank's part; the other rank's below
                other = weight[:batch, :2]
                g_global[:, 2 * (1 - rank):2 * (1 - rank) + 2] = other
            elif dst == (S0,):
                g_global = np.concatenate([weight[:batch // 2, :4]] * 2)
            else:
                g_global = w_full * (2 if grad_src == (P,) else 1)
            want_grad = g_global[:, 2 * rank:2 * rank + 2] if src == (S1,) else g_global
            np.testing.assert_allclose(grad.asnumpy(), want_grad, rtol=1e-5, atol=1e-6, err_msg=str((src, dst)))
