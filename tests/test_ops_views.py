"""Views and dim-wise ops on DTensors: permute / transpose / reshape, softmax, cat / stack,
split / chunk (equal and uneven), narrow, indexing and slicing, against the single-device
computation on meshes (2,) and (2, 2)."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import mint, ops

from hyper_parallel_ms.dtensor import distribute_tensor
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.testing import multi_rank
from tests._ops_check import S0, S1, S2, P, R, _on_dtensors, _rand, check_op


def _permute(a):
    return a.permute(2, 0, 1)


def _transpose(a):
    return a.transpose(0, 2)


def _unsqueeze_squeeze(a):
    return a.unsqueeze(1).squeeze(1) * a.unsqueeze(0).squeeze()


def _reshape_merge(a):
    return a.reshape(-1, 2)


def _reshape_split(a):
    return a.reshape(2, 2, 6, 2)


def _softmax(a):
    return ops.softmax(a, -1)


def _log_softmax_rows(a):
    return ops.log_softmax(a, 0)


@multi_rank(4)
def test_views_and_softmax():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    a = _rand(4, 6, 2)
    check_op(mesh, _permute, [a], [[S2, S0]], [S0, S1])
    check_op(mesh, _transpose, [a], [[S0, P]], [S2, P])
    check_op(mesh, _unsqueeze_squeeze, [a], [[S0, S1]], [S0, S1])
    check_op(mesh, _reshape_merge, [a], [[S0, R]], [S0, R])        # rows stay first: 24 rows split evenly
    check_op(mesh, _reshape_merge, [a], [[S0, S1]], [S0, R])       # the inner sharded dim is gathered
    check_op(mesh, _reshape_split, [a], [[S0, R]], [S0, R])
    check_op(mesh, _reshape_split, [a], [[S1, S0]], [S2, S0])
    check_op(mesh, _softmax, [a], [[S0, S2]], [S0, R])             # the softmax dim is gathered
    check_op(mesh, _softmax, [a], [[P, S1]], [R, S1])
    check_op(mesh, _log_softmax_rows, [a], [[S1, S0]], [S1, R])


def _cat_cols(a, b):
    return ops.cat([a, b], 1)


def _cat_rows(a, b):
    return ops.cat((a, b), 0)


def _split_sum(a):
    first, second = ops.split(a, 3, 1)
    return first * second


@multi_rank(4)
def test_cat_and_split():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    a, b = _rand(4, 6), _rand(4, 2, seed=9)
    check_op(mesh, _cat_cols, [a, b], [[S0, R], [S0, R]], [S0, R])
    check_op(mesh, _cat_cols, [a, b], [[S0, S1], [R, R]], [S0, R])       # the cat dim is gathered
    check_op(mesh, _cat_cols, [a, b], [[P, S0], [P, S0]], [P, S0])
    check_op(mesh, _cat_rows, [a, a], [[S1, S0], [S1, R]], [S1, R])
    check_op(mesh, _split_sum, [a], [[S0, S1]], [S0, R])


def _stack_cpu(tensors, dim):
    return ops.stack(tensors, dim)


_stack = _on_dtensors("StackExt", _stack_cpu)


def _stack_mid(a, b):
    return _stack([a, b], 1)


def _split_uneven(a):
    first, second = ops.split(a, [1, 3], 1)
    return ops.cat([second, first * 2.0], 1)


def _split_by_size(a):
    pieces = ops.split(a, 3, 0)
    return ops.cat([p * (i + 1.0) for i, p in enumerate(pieces)], 0)


def _chunk_uneven(a):
    pieces = ops.chunk(a, 3, 0)
    return ops.cat([p * (i + 1.0) for i, p in enumerate(pieces)], 0)


def _mint_chunk(a):
    pieces = mint.chunk(a, 3, 1)
    return ops.cat([p * (i + 1.0) for i, p in enumerate(pieces)], 1)


def _narrow(a):
    return mint.narrow(a, 1, 1, 2)


def _narrow_whole(a):
    return mint.narrow(a, 0, 0, a.shape[0])


def _index_row(a):
    return a[1]


def _index_cols(a):
    return a[:, 1:3]


def _index_mixed(a):
    return a[..., None, ::2][:, 1]


def _index_whole(a):
    return a[:, :, None]


@multi_rank(4)
def test_stack_split_narrow_and_indexing():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    a, b = _rand(5, 4), _rand(5, 4, seed=2)
    check_op(mesh, _stack_mid, [a, b], [[S0, S1], [S0, R]], [S0, S2])
    check_op(mesh, _stack_mid, [a, b], [[P, S0], [P, R]], [P, S0])
    check_op(mesh, _split_uneven, [a], [[S0, S1]], [S0, R])
    check_op(mesh, _split_by_size, [_rand(7, 4)], [[S0, S1]], [R, S1])   # pieces 3, 3, 1
    check_op(mesh, _chunk_uneven, [_rand(7, 4)], [[S1, S0]], [S1, R])
    check_op(mesh, _mint_chunk, [_rand(4, 5)], [[S0, S1]], [S0, R])
    check_op(mesh, _narrow, [a], [[S0, S1]], [S0, R])
    check_op(mesh, _narrow_whole, [a], [[S0, S1]], [S0, S1])
    check_op(mesh, _index_row, [a], [[S0, S1]], [R, S0])
    check_op(mesh, _index_cols, [a], [[S0, S1]], [S0, R])
    check_op(mesh, _index_mixed, [_rand(3, 4, 6)], [[S2, S1]], [R, R])
    check_op(mesh, _index_mixed, [_rand(3, 4, 6)], [[S0, P]], [S0, P])
    check_op(mesh, _index_whole, [a], [[S1, S0]], [S1, S0])
    x = distribute_tensor(ms.Tensor(a), mesh, [S0, S1])
    # split into sizes: Tensor.split (SplitWithSize); mint.split's view form is refused (tests/test_silent_cases.py)
    pieces = x.split([1, 3], 1)
    assert [p.placements for p in pieces] == [(S0, R), (S0, R)]
    np.testing.assert_allclose(pieces[1].full_tensor().asnumpy(), a[:, 1:], rtol=1e-6)
    with pytest.raises(NotImplementedError, match="advanced indexing"):
        x[ms.Tensor(np.array([0, 1], np.int32))]
    with pytest.raises(IndexError, match="too many indices"):
        x[0, 0, 0]
    with pytest.raises(IndexError, match="out of bounds"):
        x[7]
