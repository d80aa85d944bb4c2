"""Meshes of fully_shard: the data-parallel mesh (1-D: shard; 2-D: replicate x shard, HSDP),
the root mesh joining it with a tensor-parallel mesh for parameters placed by the
parallel styles (FSDP x TP), so that a piece's sharding names both, and the data-parallel
ranks of a tensor-parallel mesh (``hsdp``, which takes no mesh).

Example::

    dp, tp = mesh["dp"], mesh["tp"]
    root = join_meshes(dp, tp)          # the (dp, tp) mesh again, dims ("dp", "tp")
    complement_ranks([2, 3], 3, 4)      # [1, 3]: mesh["dp"]'s ranks on rank 3 of a (2, 2) mesh
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from .. import _cluster
from ..mesh import DeviceMesh, mesh_world

__all__ = ["dp_mesh_dims", "default_mesh", "join_meshes", "complement_ranks", "post_forward_mesh", "FSDP_X_TP"]

FSDP_X_TP = ("slice both from one mesh: mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=(\"dp\", \"tp\")), "
             "the parallel styles on mesh[\"tp\"], then fully_shard(cell, mesh=mesh[\"dp\"]) for each block and "
             "the root")


def default_mesh() -> DeviceMesh:
    """A 1-D mesh of every rank of the current world (fully_shard's default)."""
    world = _cluster.current_world()
    return DeviceMesh(world.device_type, list(range(world.size)), mesh_dim_names=("dp_shard",), _world=world)


def dp_mesh_dims(mesh: DeviceMesh) -> Tuple[int, Optional[int]]:
    """(shard dim, replicate dim or None) of a 1-D (FSDP) or 2-D (HSDP) data-parallel mesh."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 1:
        return 0, None
    if mesh.ndim == 2:
        return 1, 0
    raise ValueError(f"fully_shard takes a 1-D mesh (FSDP) or a 2-D mesh (replicate, shard) for HSDP, "
                     f"got a {mesh.ndim}-D mesh {mesh!r}")


def join_meshes(dp: DeviceMesh, tp: DeviceMesh) -> DeviceMesh:
    """The mesh of dims ``dp`` + ``tp`` whose slices through this rank are ``dp`` and ``tp``
    (the rank and world of ``dp``)."""
    world = mesh_world(dp)
    if mesh_world(tp) != world:
        raise ValueError(f"the data-parallel mesh {dp!r} and the tensor-parallel mesh {tp!r} belong to different "
                         f"worlds; {FSDP_X_TP}")
    me = world.rank
    dp_ranks, tp_ranks = dp.mesh, tp.mesh
    ranks = dp_ranks.reshape(dp_ranks.shape + (1,) * tp_ranks.ndim) + tp_ranks - me
    names = None
    if dp.mesh_dim_names and tp.mesh_dim_names:
        names = tuple(dp.mesh_dim_names) + tuple(tp.mesh_dim_names)
    flat = ranks.ravel().tolist()
    if len(set(flat)) != len(flat) or min(flat) < 0 or max(flat) >= world.size:
        raise ValueError(f"the data-parallel mesh {dp!r} and the tensor-parallel mesh {tp!r} of the parameters do "
                         f"not form one regular mesh (each rank in one data-parallel group and one tensor-parallel "
                         f"group); {FSDP_X_TP} (hsdp(cell) finds mesh['dp'] itself)")
    root = DeviceMesh(dp.device_type, ranks, mesh_dim_names=names, _world=world)
    coord = root.coordinate
    if not (np.array_equal(root.mesh[coord[:dp.ndim]], tp_ranks)
            and np.array_equal(root.mesh[(slice(None),) * dp.ndim + coord[dp.ndim:]], dp_ranks)):
        raise ValueError(f"meshes {dp!r} and {tp!r} do not slice one regular mesh; {FSDP_X_TP} (hsdp(cell) finds mesh['dp'] itself)")
    return root


def complement_ranks(tp_ranks: Sequence[int], me: int, world: int) -> List[int]:
    """The data-parallel ranks of rank ``me`` when ``tp_ranks`` (its tensor-parallel group) is one
    of the translated copies tiling ``world`` ranks: one rank per copy, at ``me``'s place in it
    (``mesh["dp"]``'s ranks for a ``(dp, tp)`` or ``(tp, dp)`` mesh). Copies are laid from the
    lowest free rank up; raise if they do not tile the ranks or ``me``'s group is not one of them.

    Args:
        tp_ranks: the ranks of ``me``'s tensor-parallel mesh (any order).
        me: this rank (one of ``tp_ranks``).
        world: the number of ranks.

    Example:
        >>> complement_ranks([0, 2], 2, 4)      # a (tp, dp) = (2, 2) mesh: tp groups {0, 2}, {1, 3}
        [2, 3]
    """
    group = sorted(int(r) for r in tp_ranks)
    offsets = [r - group[0] for r in group]
    free, anchors = [True] * world, []
    for start in range(world):
        if not free[start]:
            continue
        tile = [start + o for o in offsets]
        if tile[-1] >= world or not all(free[r] for r in tile):
            break
        for r in tile:
            free[r] = False
        anchors.append(start)
    if any(free) or me not in group or group[0] not in anchors:
        raise ValueError(f"the tensor-parallel group {group} of rank {me} is not one of copies tiling the {world} "
                         "ranks, so its data-parallel ranks are unknown")
    return [a + me - group[0] for a in anchors]


def post_forward_mesh(mesh: DeviceMesh, k: int) -> DeviceMesh:
    """The ranks of ``mesh``'s shard dim through this rank, as ``(n / k, k)``: dim 1 is this rank's
    group of ``k`` consecutive shard ranks, over which ``reshard_after_forward=k`` gathers in the
    backward (FSDP2's post-forward mesh).

    Args:
        mesh: the data-parallel mesh (1-D, or 2-D replicate x shard).
        k: a divisor of the shard dim's size.

    Example::

        post_forward_mesh(mesh, 2).size(1)      # 2
    """
    shard_dim, _ = dp_mesh_dims(mesh)
    n = mesh.size(shard_dim)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or n % k:
        raise ValueError(f"reshard_after_forward={k!r} must divide the {n} ranks of the shard dim of {mesh!r}")
    coord = mesh.coordinate
    line = mesh.mesh[tuple(slice(None) if d == shard_dim else coord[d] for d in range(mesh.ndim))]
    return DeviceMesh(mesh.device_type, line.reshape(n // k, k), mesh_dim_names=("dp_post_outer", "dp_post"),
                      _world=mesh_world(mesh))
