"""HyperParallel's tensor-map helpers that MindFormers' Muon optimizer imports
(``_infer_slice_area_by_rank``, ``DevMat``, ``RedistributionOperatorInfer``) and the in-place
layout face it calls on ``dtensor.layout`` (``tensor_map``, ``set_placements``,
``placement_to_tensor_map``, ``reset_partial``, deepcopy): hand-computed cases, every op list
executed on numpy pieces of all ranks, and MindFormers' own Muon helpers on this library's layouts.
Process-free (simulated meshes)."""
from __future__ import annotations

import copy
import itertools
import random
from math import prod

import mindspore as ms
import numpy as np
import pytest

from hyper_parallel_ms import init_device_mesh
from hyper_parallel_ms.compat._redistribute_infer import DevMat, RedistributionOperatorInfer, infer_slice_area_by_rank
from hyper_parallel_ms.dtensor._layout_view import tensor_layout
from hyper_parallel_ms.layout import Layout
from hyper_parallel_ms.placement import Partial, Replicate, Shard
from hyper_parallel_ms.testing import cpu_twins


# ----------------------------------------------------------------- _infer_slice_area_by_rank
@pytest.mark.parametrize("mesh,tmap,rank,shape,area", [
    ((2, 2), (1, 0), 3, (4, 6), [(2, 4), (3, 6)]),          # coordinate (1, 1): row piece 1, column piece 1
    ((2, 2), (1, 0), 1, (4, 6), [(0, 2), (3, 6)]),
    ((2, 4), ((1, 0), -1), 5, (16, 3), [(10, 12), (0, 3)]),  # (1, 1): piece 1 * 4 + 1 of 8 rows-pairs
    ((2, 4), ((0, 1), -1), 5, (16, 3), [(6, 8), (0, 3)]),    # mesh dim 1 major: piece 1 * 2 + 1 = 3
    ((2, 4), (-1, 0), 6, (3, 8), [(0, 3), (4, 6)]),          # (1, 2): mesh dim 0 replicates
    ((2, 2), ((1, -1), -1), 2, (4, 2), [(2, 4), (0, 2)]),    # -1 inside a tuple is skipped
    ((4,), (0,), 2, (5,), [(4, 5)]),                         # uneven: torch.chunk's pieces 2, 2, 1, 0
    ((4,), (0,), 3, (5,), [(5, 5)]),
])
def test_infer_slice_area_by_rank_hand_cases(mesh, tmap, rank, shape, area):
    assert infer_slice_area_by_rank(mesh, tmap, rank, shape) == area


@pytest.mark.parametrize("args,match", [
    (((2, 2), (1, 1), 0, (4, 4)), "mesh dim 0 shards tensor dims 0 and 1"),
    (((2, 2), (2, -1), 0, (4, 4)), "entry 2 of tensor dim 0"),
    (((2, 2), (1, -1), 4, (4, 4)), "rank_id 4 is not a position in a mesh of 4 ranks"),
    (((2, 2), (1, -1), 0, (4,)), "has 1 dims but the tensor map"),
])
def test_infer_slice_area_by_rank_refuses_what_it_cannot_place(args, match):
    with pytest.raises(ValueError, match=match):
        infer_slice_area_by_rank(*args)


# ------------------------------------------------------------------------------------- DevMat
@pytest.mark.parametrize("dims,rank,ranks,dim,group", [
    ([2, 4], 6, range(8), 0, [2, 6]),                      # (1, 2): column 2
    ([2, 4], 6, range(8), 1, [4, 5, 6, 7]),
    ([2, 4], 6, range(8), [0, 1], list(range(8))),
    ([2, 4], 6, range(8), [1, 0], [0, 4, 1, 5, 2, 6, 3, 7]),  # the first dim given is major
    ([2, 2, 2], 5, range(8), [2, 0], [0, 4, 1, 5]),
    ([2, 2], 12, [10, 12, 11, 13], 0, [12, 13]),           # grid [[10, 12], [11, 13]]: column 1
    ([1, 2], 3, [2, 3], 0, [3]),
])
def test_devmat_groups_hand_cases(dims, rank, ranks, dim, group):
    assert DevMat(dims).get_devices_along_dim(rank, list(ranks), dim) == group


def test_devmat_sizes_and_refusals():
    dev = DevMat([2, 3, 4])
    assert [dev.get_dim_by_reverse_idx(i) for i in (0, 1, 2)] == [4, 3, 2]
    assert dev.get_dim_by_reverse_idx((2, 0)) == 8 and dev.dims == [2, 3, 4]
    with pytest.raises(ValueError, match="out of range"):
        dev.get_devices_along_dim(0, list(range(24)), 3)
    with pytest.raises(ValueError, match="rank_list length"):
        dev.get_devices_along_dim(0, list(range(8)), 0)
    with pytest.raises(ValueError, match="Rank 30 not in rank_list"):
        dev.get_devices_along_dim(30, list(range(24)), 0)
    with pytest.raises(ValueError, match="distinct"):
        dev.get_devices_along_dim(0, list(range(24)), [1, 1])


# ------------------------------------------------------------------------ RedistributionOperatorInfer
@pytest.mark.parametrize("mesh,src,dst,rank,ranks,ops", [
    # to replicated, as MindFormers' Muon asks: one all_concat per sharded tensor dim, in dim order
    ([2, 2], [1, 0], [-1, -1], 0, range(4), [("all_concat", (0, 2, [0, 2])), ("all_concat", (1, 2, [0, 1]))]),
    ([2, 2], [(1, 0), -1], [-1, -1], 2, range(4), [("all_concat", (0, 4, [0, 1, 2, 3]))]),    # FSDP x TP rows
    ([2, 2], [(0, 1), -1], [-1, -1], 0, range(4), [("all_concat", (0, 4, [0, 2, 1, 3]))]),    # tp major
    ([2, 2], [0, -1], [-1, -1], 2, range(4), [("all_concat", (0, 2, [2, 3]))]),              # dp replicates
    ([1, 2], [1, 0], [-1, -1], 1, range(2), [("all_concat", (1, 2, [0, 1]))]),               # size-1 dim: no op
    ([2, 2], [1, 0], [1, 0], 0, range(4), []),
    # sharding more: a local split on this rank's group
    ([2, 4], [-1, -1], [1, -1], 6, range(8), [("all_split", (0, 2, [2, 6]))]),
    ([2, 2], [-1, -1], [(1, 0), -1], 7, [4, 5, 6, 7], [("all_split", (0, 4, [4, 5, 6, 7]))]),
    # a mesh dim moving between tensor dims: all_to_all (split dim, concat dim, size, group)
    ([2], [0, -1], [-1, 0], 5, [4, 5], [("all_to_all", (1, 0, 2, [4, 5]))]),
])
def test_infer_ops_list_hand_cases(mesh, src, dst, rank, ranks, ops):
    assert RedistributionOperatorInfer(mesh, src, dst).infer_ops_list(rank, list(ranks)) == ops


def test_use_permute_false_concats_then_splits():
    ops = RedistributionOperatorInfer([2], [0, -1], [-1, 0], use_permute=False).infer_ops_list(4, [4, 5])
    assert ops == [("all_concat", (0, 2, [4, 5])), ("all_split", (1, 2, [4, 5]))]


def _run_ops(mesh, src, dst, ranks, use_permute=True):
    """Every rank's piece of an arange tensor under ``src``, then each rank's ops executed on the
    pieces of its groups (all ranks step together); True when each ends with its ``dst`` piece."""
    shape = (2 * prod(mesh),) * len(src)
    full = np.arange(prod(shape)).reshape(shape)

    def piece(tmap, position):
        return full[tuple(slice(b, e) for b, e in infer_slice_area_by_rank(mesh, tmap, position, shape))]

    pieces = {r: piece(src, i) for i, r in enumerate(ranks)}
    ops = {r: RedistributionOperatorInfer(mesh, src, dst, use_permute).infer_ops_list(r, ranks) for r in ranks}
    assert len({len(o) for o in ops.values()}) == 1
    for step in range(len(ops[ranks[0]])):
        new = {}
        for r in ranks:
            kind, args = ops[r][step]
            if kind == "all_concat":
                dim, size, group = args
                assert len(group) == size and r in group
                new[r] = np.concatenate([pieces[g] for g in group], axis=dim)
            elif kind == "all_split":
                dim, size, group = args
                new[r] = np.split(pieces[r], size, axis=dim)[group.index(r)]
            else:
                split_dim, concat_dim, size, group = args
                new[r] = np.concatenate([np.split(pieces[g], size, axis=split_dim)[group.index(r)] for g in group],
                                        axis=concat_dim)
        pieces = new
    return all(np.array_equal(pieces[r], piece(dst, i)) for i, r in enumerate(ranks))


def _tensor_maps(mesh_ndim, ndim):
    """Every tensor map of an ``ndim``-D tensor on a mesh of ``mesh_ndim`` dims (each mesh dim on one
    tensor dim or none, every order of several on one dim)."""
    maps = set()
    for owner in itertools.product(range(-1, ndim), repeat=mesh_ndim):
        per_dim = [[mesh_ndim - 1 - a for a in range(mesh_ndim) if owner[a] == d] for d in range(ndim)]
        for orders in itertools.product(*(itertools.permutations(axes) for axes in per_dim)):
            maps.add(tuple(-1 if not o else o[0] if len(o) == 1 else tuple(o) for o in orders))
    return sorted(maps, key=repr)


def test_every_op_list_takes_each_ranks_piece_to_its_target_piece():
    maps = _tensor_maps(2, 2)
    assert len(maps) == 11
    for src, dst in itertools.product(maps, maps):            # 121 pairs on a 2 x 2 mesh of ranks 10..13
        assert _run_ops([2, 2], list(src), list(dst), [10, 11, 12, 13]), (src, dst)
        assert _run_ops([2, 2], list(src), list(dst), [10, 11, 12, 13], use_permute=False), (src, dst)
    rng = random.Random(0)
    maps3 = _tensor_maps(3, 3)
    for _ in range(40):                                        # a 2 x 1 x 2 mesh (a size-1 dim) and 3-D tensors
        src, dst = rng.choice(maps3), rng.choice(maps3)
        assert _run_ops([2, 1, 2], list(src), list(dst), [3, 1, 2, 0]), (src, dst)


def test_infer_refuses_maps_of_different_ranks():
    with pytest.raises(ValueError, match="different ranks"):
        RedistributionOperatorInfer([2], [0, -1], [-1])


# ------------------------------------------------------------------- the layout face MindFormers uses
def _view(placements, rank, shape=(8, 4), world=4, mesh_shape=(2, 2)):
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"), simulate=(world, rank))
    return tensor_layout(Layout(mesh_shape, placements, mesh_dim_names=("dp", "tp")), mesh, shape)


def test_tensor_map_is_a_value_and_still_answers_as_the_method():
    lay = _view((Shard(0), Shard(1)), 0)
    assert lay.tensor_map == (1, 0) and list(lay.tensor_map) == [1, 0] and lay.tensor_map(2) == (1, 0)
    assert _view((Shard(0), Shard(0)), 0).tensor_map == ((1, 0), -1)
    assert _view((Replicate(), Partial()), 0).tensor_map == (-1, -1)
    assert copy.deepcopy(lay.tensor_map) == (1, 0) and type(copy.deepcopy(lay.tensor_map)) is tuple


def test_in_place_setters_change_a_deep_copy_only():
    lay = _view((Partial(), Shard(1)), 3)
    rep = copy.deepcopy(lay)
    assert type(rep) is type(lay) and rep.mesh is lay.mesh and rep == lay
    rep.set_placements([Replicate()] * len(rep.mesh_shape))
    assert rep.placement_to_tensor_map(2) == [-1, -1] and rep.tensor_map == (-1, -1)
    assert lay.placements == (Partial(), Shard(1)) and lay.tensor_map == (-1, 0)     # the original is intact
    part = copy.deepcopy(lay)
    part.reset_partial()
    assert part.placements == (Replicate(), Shard(1)) and hash(part) == hash(Layout((2, 2), part.placements,
                                                                                   mesh_dim_names=("dp", "tp")))
    rep.set_placements([Shard(-1), Replicate()])                                   # normalised against the tensor
    assert rep.placements == (Shard(1), Replicate()) and rep.tensor_map == (-1, 1)
    with pytest.raises(ValueError, match="expected 2 placements"):
        rep.set_placements([Replicate()])


# ----------------------------------------------------- MindFormers' own Muon helpers on these layouts
@pytest.fixture(scope="module")
def muon():
    from hyper_parallel_ms.compat import alias_hyper_parallel
    from hyper_parallel_ms.compat._alias import _remove_alias
    alias_hyper_parallel()
    from mindformers.pynative.optimizer import muon as module
    yield module
    _remove_alias()


class _Piece:
    """What MindFormers reads of a DTensor gradient here: ``layout`` and ``to_local().shape``."""

    def __init__(self, layout):
        self.layout = layout
        self._local = np.zeros(layout.local_shape(layout.get_global_shape(), layout.mesh.coordinate))

    def to_local(self):
        return self._local


@pytest.mark.parametrize("placements,rank,ops", [
    ((Shard(0), Shard(0)), 1, [("all_concat", (0, 4, [0, 1, 2, 3]))]),
    ((Shard(0), Replicate()), 3, [("all_concat", (0, 2, [1, 3]))]),
    ((Partial(), Shard(1)), 2, [("all_concat", (1, 2, [2, 3]))]),       # its Partial is reset first
    ((Shard(1), Shard(0)), 0, [("all_concat", (0, 2, [0, 1])), ("all_concat", (1, 2, [0, 2]))]),
    ((Replicate(), Replicate()), 0, []),
])
def test_mindformers_infers_the_full_tensor_ops_from_a_dtensor_layout(muon, placements, rank, ops):
    piece = _Piece(_view(placements, rank))
    assert muon._infer_full_tensor_ops(piece, rank) == ops
    assert piece.layout.placements == placements                       # MindFormers works on its deep copy


def test_mindformers_replica_local_info_and_slices(muon):
    lay = _view((Shard(0), Replicate()), 3)
    # only mesh dim 0 (dp) shards: the replica-local group is rank 3's dp line, a 1-D mesh, map [0, -1]
    assert muon._get_replica_local_layout_info(3, lay.rank_list, lay.mesh_shape, lay.tensor_map) == \
        ((1, 3), (2,), [0, -1])
    full = np.arange(32, dtype=np.float32).reshape(8, 4)
    with cpu_twins():                                     # MindFormers clones each slice: no CPU Clone kernel
        _check_slices(muon, full)


def _check_slices(muon, full):
    for placements in [(Shard(0), Shard(1)), (Shard(0), Shard(0)), (Replicate(), Shard(0))]:
        for rank in range(4):
            lay = _view(placements, rank)
            want = full[lay.local_slices((8, 4), lay.mesh.coordinate)]
            got = muon._slice_full_tensor_for_layout_rank(ms.Tensor(full), lay, rank)
            np.testing.assert_array_equal(got.asnumpy(), want)
        shards = muon._list_full_tensor_local_shards_cached(
            ms.Tensor(full), lay.rank_list, lay.mesh_shape, list(lay.tensor_map))
        for rank, shard in zip(range(4), shards):
            view = _view(placements, rank)
            np.testing.assert_array_equal(shard.asnumpy(), full[view.local_slices((8, 4), view.mesh.coordinate)])


def test_platform_create_group_refuses_what_it_cannot_name():
    from hyper_parallel_ms.compat._platform import get_platform
    with pytest.raises(NotImplementedError, match="names its groups by their ranks"):
        get_platform().create_group([0, 1], group_name="mine")
    with pytest.raises(ValueError, match="two or more distinct ranks"):
        get_platform().create_group([3])
