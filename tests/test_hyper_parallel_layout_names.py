"""HyperParallel's layout and mesh queries MindFormers 2.1.0 calls: ``Layout.repeat_num`` and
``get_global_shape``, a DTensor's ``layout`` bound to its mesh (``get_split_id``, ``rank_list``,
``alias_placements``), ``DTensor.local_shape``, ``DeviceMesh.mesh_shape`` / ``rank_list`` /
``get_rank_list_along_axis``. Pure layout math and simulated meshes, plus one 1-rank DTensor."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

from hyper_parallel_ms import distribute_tensor, init_device_mesh
from hyper_parallel_ms.dtensor._layout_view import tensor_layout
from hyper_parallel_ms.layout import Layout
from hyper_parallel_ms.placement import Partial, Replicate, Shard


@pytest.mark.parametrize("placements,expected", [
    ((Shard(0), Replicate()), 4), ((Replicate(), Shard(1)), 2), ((Shard(0), Shard(1)), 1),
    ((Shard(0), Shard(0)), 1), ((Partial(), Replicate()), 8), ((Replicate(), Replicate()), 8)])
def test_repeat_num_counts_the_ranks_holding_each_piece(placements, expected):
    # HyperParallel: the mesh size over the sizes of the mesh dims in the tensor map
    assert Layout((2, 4), placements).repeat_num() == expected


def test_get_global_shape_multiplies_by_the_shard_counts():
    assert Layout((2, 4), (Shard(0), Shard(1))).get_global_shape((3, 5)) == (6, 20)
    assert Layout((2, 4), (Shard(1), Shard(1))).get_global_shape((3, 5)) == (3, 40)
    assert Layout((2, 4), (Partial(), Replicate())).get_global_shape((3,)) == (3,)


def _piece_index(layout, shape, mesh, dim):
    """The independent answer: the piece's offset along ``dim`` over the piece size (even split)."""
    offset = layout.global_offset(shape, mesh.coordinate)[dim]
    return offset // layout.local_shape(shape, mesh.coordinate)[dim]


@pytest.mark.parametrize("placements,order", [
    ((Shard(0), Shard(1)), None), ((Shard(0), Shard(0)), None), ((Shard(0), Shard(0)), {0: (1, 0)}),
    ((Replicate(), Shard(0)), None), ((Partial(), Shard(1)), None)])
def test_get_split_id_is_the_index_of_this_ranks_piece(placements, order):
    shape = (16, 8)
    for rank in range(8):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"), simulate=(8, rank))
        layout = tensor_layout(Layout((2, 4), placements, shard_order=order), mesh, shape)
        assert [layout.get_split_id(d) for d in (0, 1)] == [_piece_index(layout, shape, mesh, d) for d in (0, 1)]
        assert layout.get_split_id(-2) == layout.get_split_id(0)
        with pytest.raises(IndexError, match=r"tensor_dim must be an int in \[-2, 2\)"):
            layout.get_split_id(5)
        assert layout.rank_list == tuple(range(8)) and layout.mesh is mesh


def test_get_rank_list_along_axis_is_this_ranks_line():
    for rank in range(8):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "tp"), simulate=(8, rank))
        pp, tp = divmod(rank, 4)
        assert mesh.get_rank_list_along_axis("pp") == [tp, 4 + tp]
        assert mesh.get_rank_list_along_axis("tp") == list(range(4 * pp, 4 * pp + 4))
        assert mesh.get_rank_list_along_axis(1) == mesh.get_rank_list_along_axis("tp")
        assert mesh.mesh_shape == (2, 4) and mesh.rank_list == tuple(range(8))
    with pytest.raises(KeyError, match="'cp' not found"):
        mesh.get_rank_list_along_axis("cp")


def test_a_one_rank_dtensor_answers_hyper_parallels_layout_queries():
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    dt = distribute_tensor(ms.Tensor(x), mesh, [Shard(1)])
    layout = dt.layout
    assert dt.local_shape == (3, 4) and layout.get_global_shape(dt.local_shape) == (3, 4)
    assert layout.get_split_id(1) == 0 and layout.repeat_num() == 1 and layout.rank_list == (0,)
    assert layout == Layout((1,), (Shard(1),), mesh_dim_names=("dp",)) and hash(layout) == hash(dt.spec.layout)
    assert layout.alias_placements == (Shard(1),) and mesh.get_rank_list_along_axis("dp") == [0]
    np.testing.assert_array_equal(type(dt).from_local(dt.to_local(), layout.mesh, layout.alias_placements)
                                  .full_tensor().asnumpy(), x)
